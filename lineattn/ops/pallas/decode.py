"""Decode step kernel: a few new tokens for each of B requests, updating the fp32 state in place.

One program per (request, head, V tile) reads its `[K, BV]` slice of the state once, applies each token in turn
(gate, delta or additive write, read-out) in fp32 registers, and writes the slice back into the same buffer
(`input_output_aliases`; under `jax.jit` with the state donated no copy is made). With `output_states=True` it
also writes the state after every token, `[B, T, H, K, V]` (for speculative decoding: roll back to any token).

Why this form: memory bound, it moves the state at 3.72-3.77 TB/s of read + write on the H200 (B = 256, H = 16,
K = V = 128), 92 % of a plain copy on the same grid (4.10-4.11 TB/s); with the state stored transposed
(`state_layout="vk"`) 3.87-3.89, 98 % of that layout's copy (3.93-3.97). Each program holds its whole tile in registers
(128 a thread at V tiles of 64), which bounds the state in flight. Every form tried that holds more of it or overlaps
more was slower: other V tiles and warp counts, a persistent or a streaming (TMA) kernel, two passes over slabs of
rows, SMEM tiles computed in column pieces. The kernel notes (`README.md` here, "Speed") list each with its run and
the commit that holds it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.pallas.common import compiler_params, interpret_mode, is_pow2

f32 = jnp.float32


def _decode_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *states_ref, T, scale, delta,
                   readout, k_axis):
    # The state tile is [K, BV] (k_axis 0, state_layout "kv") or [BV, K] (k_axis 1, "vk"); every reduction runs
    # over K and keeps its axis, so a row of V values is [1, BV] or [BV, 1].
    S = s_ref[...].astype(f32)
    along_k = (lambda x: x[:, None]) if k_axis == 0 else (lambda x: x[None, :])  # a [K] vector against S
    along_v = (lambda x: x[None, :]) if k_axis == 0 else (lambda x: x[:, None])  # a [BV] vector against S
    for t in range(T):  # T is small (1 token, or a few draft tokens)
        q_t = along_k(q_ref[t, :].astype(f32))
        k_t = along_k(k_ref[t, :].astype(f32))
        v_t = along_v(v_ref[t, :].astype(f32))
        S = S * along_k(jnp.exp(g_ref[t, :].astype(f32)))
        if readout == "decayed":  # o = q^T (S + k r^T) = q^T S + (q . k) r: both reductions on the decayed S
            qS = jnp.sum(S * q_t, axis=k_axis, keepdims=True)
        if delta:
            residual = v_t - jnp.sum(S * k_t, axis=k_axis, keepdims=True)
            write = beta_ref[pl.ds(t, 1)].astype(f32)[:, None] * residual
        else:
            write = v_t
        S = S + k_t * write
        stored_first = readout == "stored"  # the state's stores before o's reduction, off the state's path
        if stored_first:
            _store_states(S, t, T, s_out_ref, states_ref)
        if readout == "decayed":
            o = qS + jnp.sum(q_t * k_t) * write
        else:
            o = jnp.sum(S * q_t, axis=k_axis, keepdims=True)
        o_ref[pl.ds(t, 1), :] = (scale * o).astype(o_ref.dtype).reshape(1, o.size)
        if not stored_first:
            _store_states(S, t, T, s_out_ref, states_ref)


def _store_states(S, t, T, s_out_ref, states_ref):
    """Token t's state into the emitted states (with output_states), the last token's into the final state."""
    if states_ref:
        states_ref[0][t, :, :] = S
    if t == T - 1:
        s_out_ref[...] = S


def _check_inputs(q, k, v, g, beta):
    """A ValueError naming the first of q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K] or [B, T, H] (or None)
    and beta [B, T, H] (or None) of another shape (a block read from a wider array would be silently wrong) or of
    a dtype that is not floating point."""
    if q.ndim != 4:
        raise ValueError(f"decode_step: q must be [B, T, H, K], got {q.dtype} {tuple(q.shape)}")
    B, T, H, K = q.shape
    want = {"k": [(B, T, H, K)], "v": [(B, T, H, v.shape[-1])], "g": [(B, T, H, K), (B, T, H), None],
            "beta": [(B, T, H), None]}
    for name, x in (("k", k), ("v", v), ("g", g), ("beta", beta)):
        if (None if x is None else tuple(x.shape)) not in want[name]:
            expected = " or ".join("None" if w is None else str(list(w)) for w in want[name])
            got = "None" if x is None else f"{x.dtype} {tuple(x.shape)}"
            raise ValueError(f"decode_step: {name} must be {expected} (B, T, H, K = {B}, {T}, {H}, {K}), got {got}")
    for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
        if x is not None and not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"decode_step: {name} must be a floating-point array, got {x.dtype}")


@functools.partial(jax.jit, static_argnames=("scale", "output_states", "interpret", "block_v", "num_warps",
                                             "v_fastest", "readout", "state_layout", "v_tiles"))
def decode_step(q, k, v, g, beta, state, *, scale: float | None = None, output_states: bool = False,
                interpret: bool | None = None, block_v: int | None = None, num_warps: int | None = None,
                v_fastest: bool = True, readout: str | None = None, state_layout: str = "kv",
                v_tiles: str = "blocks"):
    """T new tokens per request through the recurrence, from `state`.

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g: log decay [B, T, H, K] (channel), [B, T, H] (head) or None;
      beta: [B, T, H] for the delta write, None for the additive write; state: [B, H, K, V] fp32 (donate it
      under jit to update it in place), or [B, H, V, K] with state_layout "vk".
      output_states: also return the state after every token, [B, T, H, K, V] fp32 ([B, T, H, V, K] with "vk").
      block_v, num_warps: the V tile of a program and its warps (for tuning). block_v None: 64 when that still
        gives 128 programs or more (large batches; H200 run7b, B = 256: 3.25 TB/s with 64 x 4 warps, the best of the
        tiles of 32-128 on 4-8 warps), else 32 (small batches are latency-bound and were not timed). num_warps
        None: 4 with "kv", 8 with "vk" (each layout's fastest, below).
      v_fastest: launch the V tiles of one state next to each other (the grid's first axis varies fastest)
        instead of the requests (default; H200 run8c, B = 256: 3.35 TB/s against 3.13, as FLA orders its grid).
      readout: None picks "decayed" with "kv" and "stored" with "vk". "decayed" takes both reductions on the
        decayed state S' before the write, o = q^T S' + (q . k) r with r the written row; "updated" reads o from
        the updated state, q^T S_t (the same value; one more dependent pass before the state's store: 3.68-3.72
        TB/s against 3.72-3.76, run13b-c); "stored" reads o from the updated state after storing it, so that o's
        reduction over K (and, with "kv", its exchanges between warps) no longer precedes the state's store (H200
        run50a, B = 256, "kv": 3.69 TB/s of kernel time against "decayed"'s 3.76).
      state_layout: "kv" (default; the layout of every other op's states) or "vk", the state stored transposed
        ([B, H, V, K], K contiguous): a program's tile is then [BV, K], each row of K = 128 fp32 values one warp's
        128-bit loads, so Triton can keep the reductions over K inside a warp (no exchange between warps before
        the state's store). B = 256, V tiles of 64, TB/s of state read + write by kernel time: H200 run50, "vk"
        with "stored" 3.87 on 8 warps (3.89 on 16, 3.56 on 4) against "kv"'s 3.76 and FLA's fused_recurrent_kda
        3.84; a plain copy on the "vk" grid reaches only 3.93-3.97 (4.11 on "kv"'s), so neither meets 4.0. H100
        run49a: 2.94 on 8 warps, 2.79 on 4, against "kv"'s 2.91.
      v_tiles: which V rows a program takes: "blocks" (default), V / BV consecutive rows; "strided" (with "vk"
        only), rows j, j + V / BV, j + 2 V / BV, ..., so that the tiles of one state interleave in memory as the
        "kv" layout's do (an experiment: run50's plain copy moved the "vk" layout's contiguous tiles at 3.93-3.97
        TB/s, "kv"'s interleaved ones at 4.11; H100 run51a: 2.97 TB/s on 16 warps, 99.5 % of its copy, where every
        tiling's copy runs at 2.97-2.98; not yet timed on an H200).

    Returns:
      (o [B, T, H, V] in q's dtype, new state fp32 in state's layout[, states [B, T, H, K, V] or [B, T, H, V, K]]).
    """
    _check_inputs(q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if state_layout not in ("kv", "vk"):
        raise ValueError(f"decode_step's state_layout must be 'kv' or 'vk', got {state_layout!r}")
    if readout is None:  # each layout's fastest form (H200 run50, B = 256)
        readout = "decayed" if state_layout == "kv" else "stored"
    if num_warps is None:
        num_warps = 4 if state_layout == "kv" else 8
    if readout not in ("updated", "decayed", "stored"):
        raise ValueError(f"decode_step's readout must be 'decayed', 'updated' or 'stored', got {readout!r}")
    if v_tiles not in ("blocks", "strided") or (v_tiles == "strided" and state_layout != "vk"):
        raise ValueError(f"decode_step's v_tiles must be 'blocks', or 'strided' with state_layout 'vk' (the 'kv' "
                         f"layout's strided rows would not coalesce), got {v_tiles!r} with {state_layout!r}")
    k_axis = 0 if state_layout == "kv" else 1
    tile = lambda a, b: (a, b) if k_axis == 0 else (b, a)  # a [K, V]-ordered pair in the state's layout
    if not (is_pow2(K) and is_pow2(V)) or state.shape != (B, H, *tile(K, V)) or state.dtype != f32:
        names = "[B, H, K, V]" if k_axis == 0 else "[B, H, V, K]"
        raise ValueError(f"decode_step needs K, V powers of two and an fp32 state {names} = "
                         f"{[B, H, *tile(K, V)]}, got K={K}, V={V}, state {state.dtype} {tuple(state.shape)}")
    scale = K**-0.5 if scale is None else scale
    if g is None:
        g = jnp.zeros((B, T, H, K), f32)
    elif g.ndim == 3:
        g = jnp.broadcast_to(g[..., None], (B, T, H, K))
    delta = beta is not None
    if not delta:
        beta = jnp.zeros((B, T, H), f32)
    if block_v is None:
        block_v = 64 if B * H * max(V // 64, 1) >= 128 else 32
    BV = min(block_v, V)
    NV = V // BV
    grid = (B, H, NV)
    if v_fastest:  # the grid's first axis varies fastest in the launch order
        grid, at = grid[::-1], lambda f: lambda j, h, b: f(b, h, j)
    else:
        at = lambda f: f
    # Every V axis as the programs split it: "blocks" keeps [V] and gives program j the block j of BV rows;
    # "strided" views it as [BV, NV] (row n NV + j at (n, j), a free reshape) and gives program j the column j.
    strided = v_tiles == "strided"
    v_view, v_block = ((BV, NV), (BV, None)) if strided else ((V,), (BV,))
    v_at = (lambda j: (0, j)) if strided else (lambda j: (j,))
    pair = lambda k_part, v_part: (*k_part, *v_part) if k_axis == 0 else (*v_part, *k_part)  # in the state's order

    tok = lambda D: pl.BlockSpec((None, T, None, D), at(lambda b, h, j: (b, 0, h, 0)))
    vtok = pl.BlockSpec((None, T, None, *v_block), at(lambda b, h, j: (b, 0, h, *v_at(j))))
    st = pl.BlockSpec((None, None, *pair((K,), v_block)), at(lambda b, h, j: (b, h, *pair((0,), v_at(j)))))
    out_specs = [vtok, st]
    out_shape = [jax.ShapeDtypeStruct((B, T, H, *v_view), q.dtype),
                 jax.ShapeDtypeStruct((B, H, *pair((K,), v_view)), f32)]
    if output_states:
        out_specs.append(pl.BlockSpec((None, None, T, *pair((K,), v_block)),
                                      at(lambda b, h, j: (b, h, 0, *pair((0,), v_at(j))))))
        out_shape.append(jax.ShapeDtypeStruct((B, H, T, *pair((K,), v_view)), f32))
    outs = pl.pallas_call(
        functools.partial(_decode_kernel, T=T, scale=float(scale), delta=delta, readout=readout, k_axis=k_axis),
        grid=grid,
        in_specs=[tok(K), tok(K), vtok, tok(K), pl.BlockSpec((None, T, None), at(lambda b, h, j: (b, 0, h))), st],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={5: 1},
        compiler_params=compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret_mode(interpret),
        name="lineattn_decode_step",
    )(q, k, v.reshape(B, T, H, *v_view), g, beta, state.reshape(B, H, *pair((K,), v_view)))
    o, new_state = outs[0].reshape(B, T, H, V), outs[1].reshape(state.shape)
    if output_states:
        return o, new_state, jnp.moveaxis(outs[2].reshape(B, H, T, *tile(K, V)), 2, 1)
    return o, new_state
