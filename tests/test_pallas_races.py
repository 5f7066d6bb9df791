"""The Mosaic GPU kernels under the interpreter's race detector (`solve_mgpu.INTERPRET_RACES`).

On the CPU the Mosaic GPU kernels run in JAX's Mosaic GPU interpreter, which runs a CTA's warpgroups as concurrent
threads. With race detection on, it checks every SMEM and GMEM access against the others by vector clocks and
prints "RACE DETECTED" with the two accesses. A race between warpgroups (the state pass's two compute warpgroups
and the memory warpgroup feeding them) gives right answers in the interpreter's order and wrong ones on a GPU. So
equal outputs do not rule it out; this check does.

The interpreter runs TMA copies eagerly, at issue, so it does not check a copy still in flight: the waits before a
slot is reused are not covered here.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu

from conftest import grad_jaxpr, loss_and_grads, make_inputs
from lineattn import ops
from lineattn.ops.pallas import solve_mgpu, tuning


def _race_reports(printed: str) -> list[str]:
    """The detector's reports in the captured output, one string each (its two accesses)."""
    return [block.strip() for block in printed.split("RACE DETECTED")[1:]]


def _warpgroups(report: str) -> set[str]:
    return set(re.findall(r"warpgroup_id=(\d+)", report))


def _mosaic_kernels(jaxpr_text: str) -> set[str]:
    return set(re.findall(r"name=(lineattn_\w+_mosaic)\n", jaxpr_text))


def _two_warpgroups_write(shared: bool):
    """A CTA of two warpgroups, each writing an [8, 128] SMEM tile and copying it out: its own tile, or (shared)
    the same one."""
    def body(x_g, o_g, tiles):
        wg = jax.lax.axis_index("wg")
        tile = tiles.at[0] if shared else tiles.at[wg]
        tile[...] = jnp.full((8, 128), 1.0, jnp.float32) * wg.astype(jnp.float32)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(tile, o_g.at[wg])
        plgpu.wait_smem_to_gmem(0)

    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((2, 8, 128), jnp.float32),
                          scratch_types=[plgpu.SMEM((2, 8, 128), jnp.float32)], num_threads=2, thread_name="wg",
                          interpret=solve_mgpu._interpret_params(True))
    return kernel(jnp.zeros((8, 128), jnp.float32))


def test_the_race_detector_reports_two_warpgroups_writing_one_tile(capfd):
    # The control: with INTERPRET_RACES the interpreter reports two warpgroups writing the same SMEM tile (what
    # each then copies out depends on how the threads interleave), and nothing when each writes its own.
    with tuning.override({"solve_mgpu.INTERPRET_RACES": True}):
        own = _two_warpgroups_write(shared=False)
        races = _race_reports(capfd.readouterr().out)
        assert not races, races[0]
        _two_warpgroups_write(shared=True)
        reports = _race_reports(capfd.readouterr().out)
    assert [float(x) for x in own[:, 0, 0]] == [0.0, 1.0]
    assert reports and all(_warpgroups(r) == {"0", "1"} and "alias group" not in r for r in reports)


@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_mosaic_kernels_have_no_data_race(rule, capfd, monkeypatch):
    # Every Mosaic GPU kernel in the forms it takes on an H200, under the race detector: the forward alone with the
    # state pass as CTAs of two compute warpgroups (PASS_MIN_CTAS 1, V tiles of 64: V = 128 is one CTA's two
    # tiles), the inverse form (`inverse_mosaic`; GDN also the raw q and k), in 2 segments of 2 chunks with the
    # zero-start pass; then forward+backward: the solve writing R, the pass keeping every chunk's state, the
    # reverse pass. bf16, B = H = 1, T = 200 (4 chunks of 64, ragged), K = 64.
    # No two accesses to the same bytes race. The detector does report the two-warpgroup pass's RefUnion: each
    # warpgroup's fp32 state staging shares bytes with its own bf16 S, E and O rows, and it compares a union's
    # members by alias group, not by bytes, so one warpgroup's access to its rows "races" the other's to its own.
    # Those reports must join two different warpgroups (a warpgroup's own accesses are in program order).
    from lineattn.ops.pallas import segments
    monkeypatch.setattr(segments, "MIN_SEGMENT_CHUNKS", 2)
    assert segments.pick_segments(1, 4, 128) == 2
    inputs = make_inputs(rule, B=1, T=200, H=1, K=64, V=128, seed=31, g_low=-0.05)
    x = {n: y.astype(jnp.bfloat16) if n in ("q", "k", "v", "beta") else y for n, y in inputs.items()}
    args = [x[n] for n in ("q", "k", "v", "g", "beta")]
    forward = jax.jit(lambda q, k, v, g, beta, h0: ops.linear_attention(
        rule, q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="pallas", chunk_size=64))
    settings = {"solve_mgpu.INTERPRET_RACES": True, "chunk_fwd.PASS_IMPL": "mosaic", "solve.SOLVE_IMPL": "mosaic",
                "chunk_fwd.ZERO_START_IMPL": "mosaic", "chunk_fwd.PASS_SEGMENTS": "always",
                "chunk_fwd.FORMS_IN_SEGMENTS": True, "chunk_fwd.PASS_MIN_PROGRAMS": 1, "state_mgpu.PASS_MIN_CTAS": 1}
    with tuning.override(settings):
        passes = {"lineattn_state_pass_mosaic", "lineattn_zero_start_pass_mosaic"}
        assert _mosaic_kernels(str(jax.make_jaxpr(forward)(*args, x["initial_state"]))) == passes | {
            "lineattn_inverse_mosaic"}
        jax.block_until_ready(forward(*args, x["initial_state"]))
        reports = _race_reports(capfd.readouterr().out)
        assert reports, "the two-warpgroup pass's RefUnion reports are missing: is the detector on?"
        races = [r for r in reports if "alias group" not in r or len(_warpgroups(r)) != 2]
        assert not races, races[0]
        assert _mosaic_kernels(grad_jaxpr(rule, x, chunk_size=64, backend="pallas")) == passes | {
            "lineattn_solve_mosaic", "lineattn_reverse_pass_mosaic"}
        jax.block_until_ready(loss_and_grads(rule, x, backend="pallas", chunk_size=64))
        races = _race_reports(capfd.readouterr().out)
        assert not races, races[0]
