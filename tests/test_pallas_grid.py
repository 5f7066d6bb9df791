"""The Triton kernels' grids: each output block belongs to one program, so no result depends on the grid's order.

Interpret mode runs a grid's programs one after another, in order; a GPU runs them at once, in any order. A kernel
whose programs share an output block (or read a block another program writes, through an aliased input) can pass
every CPU test and be wrong on a GPU. This reads each `pallas_call`'s block specs from the traced program (no GPU,
nothing run) and checks, at every grid point, that:
  - each output block index is taken by exactly one program, and the blocks tile the whole output (an output
    updated in place may leave blocks as they were);
  - an input aliased to an output (updated in place) is read by the same block index as it is written, so a program
    reads only the block it writes itself.
The Mosaic GPU kernels (`plgpu.kernel`: whole-array refs, each CTA copying its own slices by TMA) are not covered
here; `tests/test_pallas_races.py` checks their warpgroups.
"""

from __future__ import annotations

import collections
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src.pallas import core as pallas_core  # (get_block_size: a block dim's size, 1 if squeezed)
from jax.extend.core import ClosedJaxpr, Jaxpr, jaxpr_as_fun

from conftest import pallas_value_and_grad
from lineattn.ops.pallas import chunk_fwd, common, segments
from lineattn.ops.pallas.chunk import chunk_pallas
from lineattn.ops.pallas.decode import decode_step

S = jax.ShapeDtypeStruct


def _pallas_calls(jaxpr):
    """Every `pallas_call` equation in a jaxpr and the jaxprs nested in it (jit, custom_vjp, cond, ...)."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            yield eqn
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                if isinstance(sub, ClosedJaxpr):
                    yield from _pallas_calls(sub.jaxpr)
                elif isinstance(sub, Jaxpr):
                    yield from _pallas_calls(sub)


def _block_indices(block_mapping, grid) -> np.ndarray:
    """The block index [points, rank] that `block_mapping`'s index map gives at each grid point (row-major)."""
    index_map = jaxpr_as_fun(block_mapping.index_map_jaxpr)
    points = np.array(list(itertools.product(*map(range, grid))), np.int32).reshape(-1, len(grid))
    at = lambda *ids: jnp.stack(index_map(*ids))
    return np.asarray(jax.vmap(at)(*points.T))


def _grid_problems(eqn) -> list[str]:
    """What breaks grid-order independence in one Triton-style `pallas_call` (empty: nothing)."""
    mapping = eqn.params["grid_mapping"]
    name, grid = str(eqn.params["name"]), tuple(mapping.grid)
    n_in, n_out = mapping.num_inputs, mapping.num_outputs
    outputs = mapping.block_mappings[n_in:n_in + n_out]
    aliased = {i_out for _, i_out in eqn.params["input_output_aliases"]}
    problems = []
    for i, block in enumerate(outputs):
        indices = _block_indices(block, grid)
        shared = [idx for idx, n in collections.Counter(map(tuple, indices.tolist())).items() if n > 1]
        if shared:
            problems.append(f"{name}: output {i}'s block {shared[0]} is written by more than one program")
        shape = [pallas_core.get_block_size(d) for d in block.block_shape]
        blocks = math.prod(-(-n // d) for n, d in zip(block.array_aval.shape, shape))
        if i not in aliased and len(set(map(tuple, indices))) != blocks:  # (in place: the rest keeps the input)
            problems.append(f"{name}: output {i}'s {blocks} blocks are not all written ({len(indices)} programs)")
    for i_in, i_out in eqn.params["input_output_aliases"]:
        read = _block_indices(mapping.block_mappings[i_in], grid)
        if not np.array_equal(read, _block_indices(outputs[i_out], grid)):
            problems.append(f"{name}: input {i_in}, updated in place as output {i_out}, is read in other blocks")
    return problems


def _check_program(fn, *args) -> set[str]:
    """The names of the Triton kernels in fn's traced program; asserts each is independent of its grid order."""
    calls = [eqn for eqn in _pallas_calls(jax.make_jaxpr(fn)(*args).jaxpr) if eqn.params["mesh"] is None]
    problems = [p for eqn in calls for p in _grid_problems(eqn)]
    assert not problems, problems
    return {str(eqn.params["name"]).split()[0] for eqn in calls}


def _chunk_args(B, T, H, K, V, dtype, gate, delta=True):
    """q, k, v, g, beta, h0 as `chunk_pallas` takes them (no gate: a head gate of zeros, as `api.run` gives)."""
    g = S((B, T, H, K) if gate == "channel" else (B, T, H), jnp.float32)
    return (S((B, T, H, K), dtype), S((B, T, H, K), dtype), S((B, T, H, V), dtype), g,
            S((B, T, H), dtype) if delta else None, S((B, H, K, V), jnp.float32))


def _forward(backward, chunk_size):
    return lambda q, k, v, g, beta, h0: chunk_pallas(q, k, v, g, beta, h0, q.shape[-1] ** -0.5, chunk_size, False,
                                                     backward)


@pytest.mark.parametrize("hopper", [True, False])
@pytest.mark.parametrize("gate,dtype,backward", [
    ("channel", jnp.bfloat16, "kernels-saved"), ("channel", jnp.float32, "kernels-saved"),
    ("channel", jnp.bfloat16, "kernels-mml2"), ("head", jnp.bfloat16, "kernels-saved"),
    ("none", jnp.bfloat16, "kernels-saved")])
def test_chunk_kernels_write_each_output_block_once(monkeypatch, hopper, gate, dtype, backward):
    # KDA, GDN and DeltaNet, bf16 and fp32, the saving and the recomputing backward, as an H200 (`common.hopper`:
    # the Mosaic stages where they fit, so the Triton kernels beside them) and as another GPU (the Triton solve and
    # passes): B = 2, T = 200 (ragged at chunk 64), H = 4, K = 64, V = 128; the forward alone, then
    # forward+backward; and one long sequence whose passes run in segments (B = H = 1, T = 1024, 8 segments of 2
    # chunks).
    monkeypatch.setattr(common, "hopper", lambda: hopper)
    monkeypatch.setattr(segments, "MIN_SEGMENT_CHUNKS", 2)
    monkeypatch.setattr(chunk_fwd, "PASS_MIN_PROGRAMS", 1)  # (V tiles of 64, which the Mosaic passes take)
    forward = _forward(backward, 64)
    grads = pallas_value_and_grad(backward, 64)
    args = _chunk_args(2, 200, 4, 64, 128, dtype, gate)
    names = _check_program(forward, *args) | _check_program(grads, *args)
    assert segments.pick_segments(1, 1024 // 64, 128) == 8
    long = _chunk_args(1, 1024, 1, 64, 128, dtype, gate)
    names |= _check_program(forward, *long) | _check_program(grads, *long)
    assert "lineattn_chunk_bwd_chunk_grads" in names and "lineattn_chunk_wy_bwd" in names
    assert ("lineattn_chunk_state_pass" in names) == (not hopper or dtype == jnp.float32)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_small_chunk_kernels_write_each_output_block_once(chunk_size):
    # Chunks of 16 and 32 (the Triton kernels only), KDA and GLA (the additive write), fp32, T = 100 ragged.
    for delta in (True, False):
        args = _chunk_args(2, 100, 2, 32, 32, jnp.float32, "channel", delta)
        _check_program(_forward("kernels-saved", chunk_size), *args)
        _check_program(pallas_value_and_grad("kernels-saved", chunk_size), *args)


def test_checkpoint_kernels_write_each_output_block_once():
    # Prefix-state caching's forward (`chunk_pallas_checkpoints`: the state pass also exports the states entering
    # chosen chunks), KDA bf16 and fp32, states after 30, 100 and 200 of T = 200 tokens.
    from lineattn.ops.pallas.checkpoints import chunk_pallas_checkpoints
    for dtype in (jnp.bfloat16, jnp.float32):
        args = _chunk_args(2, 200, 2, 64, 64, dtype, "channel")
        names = _check_program(lambda *a: chunk_pallas_checkpoints(*a, 0.125, 64, (30, 100, 200), False), *args)
        assert "lineattn_chunk_state_pass" in names


@pytest.mark.parametrize("output_states", [False, True])
def test_decode_kernel_updates_each_state_tile_in_its_own_program(output_states):
    # The decode step updates the state in place: each (request, head, V tile) program reads and writes its own
    # tile. B = 3 requests, 2 tokens, H = 2, K = V = 128, V tiles of 32 and 64, either launch order and state layout,
    # and "vk"'s strided V rows.
    B, T, H, K, V = 3, 2, 2, 128, 128
    args = (S((B, T, H, K), jnp.bfloat16), S((B, T, H, K), jnp.bfloat16), S((B, T, H, V), jnp.bfloat16),
            S((B, T, H, K), jnp.float32), S((B, T, H), jnp.bfloat16), S((B, H, K, V), jnp.float32))
    forms = [("kv", "blocks"), ("vk", "blocks"), ("vk", "strided")]
    for block_v, v_fastest, (layout, v_tiles) in itertools.product((32, 64), (True, False), forms):
        step = lambda *a: decode_step(*a, output_states=output_states, interpret=False, block_v=block_v,
                                      v_fastest=v_fastest, state_layout=layout, v_tiles=v_tiles)
        assert _check_program(step, *args) == {"lineattn_decode_step"}
