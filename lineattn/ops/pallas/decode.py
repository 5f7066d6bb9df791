"""Decode step kernel: a few new tokens for each of B requests, updating the fp32 state in place.

One program per (request, head, V tile) reads its `[K, BV]` slice of the state once, applies each token in turn
(gate, delta or additive write, read-out) in fp32 registers, and writes the slice back into the same buffer
(`input_output_aliases`; under `jax.jit` with the state donated no copy is made). With `output_states=True` it
also writes the state after every token, `[B, T, H, K, V]` (for speculative decoding: roll back to any token).

(A Mosaic GPU form, a fixed number of CTAs each streaming its share of the tiles through a TMA pipeline, the state
a mutable ref updated in place, was correct on the H200 but slower, run16c/f at B = 256, H = 16, K = V = 128: kernel
time 3.24-3.34 TB/s of state read + write with V tiles of 64 on 128-132 CTAs, 3.51-3.59 with 32 on 256-264, 3.40
with 32 on 396 (three CTAs an SM), 2.05-2.22 with 16 on 512-792, against 3.77 for this kernel and 4.11 for a plain
copy on its grid: removed; it is in the history at 0f60cc7, whose CTAs take equal tile counts: run16f's gave each
CTA its own, a traced `emit_pipeline` grid. A persistent Triton form, a fixed number of programs each looping over
its tiles with the next tile's state loaded before the current tile's math, was slower too, run23a: 2.64-3.35 TB/s
on 132-1056 programs, V tiles of 32-128, Triton pipelining depth 1 or 2, against 3.72 for this kernel in the same run;
a persistent plain copy reached 3.95-3.98 against 4.10 on this grid: in the history at b2bbd38. A form with few
registers, one token in two passes over slabs of the state's rows, the first for the read-outs and the second reading
each slab again, from L2, to write it, was slower too, run39f: 2.94-3.16 TB/s for slabs of 16-64 rows, V tiles of
32-128, 2-8 warps and Triton pipelining 1-3 deep, against 3.77 for this kernel; in the history at 18e5373. Nsight
Compute, run39e: this kernel 140 us for one step against 145 for FLA's `fused_recurrent_kda` on the same inputs, DRAM
throughput 76.6 % of peak and L2 84.2 %; V tiles of 32 take 72 registers, not 128, but 149 us. Run41: one Mosaic GPU
CTA per tile, the tile brought into SMEM by TMA (SMEM, not registers, to hold more of the state in flight), computed
from SMEM in column pieces, was slower too: 147.7-159.9 us for V tiles of 64 in pieces of 32 (121-125 registers: each
factor broadcast takes a register per value), 164.6-211.2 us in pieces of 16 or 8 (87-88 and 61-63 registers, more
serial steps), against 142.8-144.5 us for this kernel; this kernel with its tile's columns in slices of 32 or 16 took
166-208 us. Both are in the history at e2bd8aa.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.pallas.common import compiler_params, interpret_mode, is_pow2

f32 = jnp.float32


def _decode_kernel(q_ref, k_ref, v_ref, g_ref, beta_ref, s_ref, o_ref, s_out_ref, *states_ref, T, scale, delta,
                   readout):
    S = s_ref[...].astype(f32)
    for t in range(T):  # T is small (1 token, or a few draft tokens)
        q_t = q_ref[t, :].astype(f32)[:, None]
        k_t = k_ref[t, :].astype(f32)[:, None]
        v_t = v_ref[t, :].astype(f32)[None, :]
        S = S * jnp.exp(g_ref[t, :].astype(f32))[:, None]
        if readout == "decayed":  # o = q^T (S + k r^T) = q^T S + (q . k) r: both reductions on the decayed S
            qS = jnp.sum(S * q_t, axis=0, keepdims=True)
        if delta:
            residual = v_t - jnp.sum(S * k_t, axis=0, keepdims=True)
            write = beta_ref[pl.ds(t, 1)].astype(f32)[:, None] * residual
        else:
            write = v_t
        S = S + k_t * write
        if readout == "decayed":
            o = qS + jnp.sum(q_t * k_t) * write
        else:
            o = jnp.sum(S * q_t, axis=0, keepdims=True)
        o_ref[pl.ds(t, 1), :] = (scale * o).astype(o_ref.dtype)
        if states_ref:
            states_ref[0][t, :, :] = S
    s_out_ref[...] = S


def _check_inputs(q, k, v, g, beta):
    """A ValueError naming the first of q, k [B, T, H, K], v [B, T, H, V], g [B, T, H, K] or [B, T, H] (or None)
    and beta [B, T, H] (or None) of another shape (a block read from a wider array would be silently wrong)."""
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


@functools.partial(jax.jit, static_argnames=("scale", "output_states", "interpret", "block_v", "num_warps",
                                             "v_fastest", "readout"))
def decode_step(q, k, v, g, beta, state, *, scale: float | None = None, output_states: bool = False,
                interpret: bool | None = None, block_v: int | None = None, num_warps: int = 4,
                v_fastest: bool = True, readout: str = "decayed"):
    """T new tokens per request through the recurrence, from `state`.

    Args:
      q, k: [B, T, H, K]; v: [B, T, H, V]; g: log decay [B, T, H, K] (channel), [B, T, H] (head) or None;
      beta: [B, T, H] for the delta write, None for the additive write; state: [B, H, K, V] fp32 (donate it
      under jit to update it in place).
      output_states: also return the state after every token, [B, T, H, K, V] fp32.
      block_v, num_warps: the V tile of a program and its warps (for tuning). block_v None: 64 when that still
        gives 128 programs or more (large batches; H200, B = 256, H = 16, K = V = 128, 2026-12-01 run7b: 3.25
        TB/s of state read+write with 64 x 4 warps, 3.18 with 64 x 8, 2.78 / 2.84 with 32 x 4 / 8, 2.50 with
        128 x 8), else 32 (the earlier default; small batches are latency-bound and were not timed).
      v_fastest: launch the V tiles of one state next to each other (the grid's first axis varies fastest)
        instead of the requests (default; H200 run8c, B = 256: 3.35 TB/s with V tile 64 x 4 warps against 3.13
        without, 3.22 against 2.79 with V tile 32; run9c: 3.41 against 3.33, 2 warps and V tile 16 slower; FLA's
        decode kernel orders its grid the same way).
      readout: "decayed" (default) takes both reductions on the decayed state S' before the write,
        o = q^T S' + (q . k) r with r the written row; "updated" reads o from the updated state, q^T S_t (the
        same value; one more dependent pass before the state's store). H200, B = 256 (run13b-c, kernel time of
        3 runs each): 0.1427-0.1445 ms against 0.1443-0.1461, 3.72-3.76 TB/s of state read + write against
        3.68-3.72; the evict-first cache policy on the state's load and store changed nothing (0.1440 ms).
        (Run17a: a "folded" read-out, both reductions on the state as loaded with the decay folded into q and
        k and the update S e^g + k r^T in one pass, took 0.1467 ms against 0.1427 (3.66 against 3.76 TB/s):
        removed. Nsight Compute, same run: this kernel 128 registers, 4 blocks of 4 warps an SM, DRAM throughput
        75.7 % of peak; FLA's `fused_recurrent_kda` 80 registers, V tiles of 32, 76.2 %, 141 us against 142.)

    Returns:
      (o [B, T, H, V] in q's dtype, new state [B, H, K, V] fp32[, states [B, T, H, K, V]]).
    """
    _check_inputs(q, k, v, g, beta)
    B, T, H, K = q.shape
    V = v.shape[-1]
    if readout not in ("updated", "decayed"):
        raise ValueError(f"decode_step's readout must be 'updated' or 'decayed', got {readout!r}")
    if not (is_pow2(K) and is_pow2(V)) or state.shape != (B, H, K, V) or state.dtype != f32:
        raise ValueError(f"decode_step needs K, V powers of two and an fp32 state [B, H, K, V] = "
                         f"[{B}, {H}, {K}, {V}], got K={K}, V={V}, state {state.dtype} {tuple(state.shape)}")
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
    grid = (B, H, V // BV)
    if v_fastest:  # the grid's first axis varies fastest in the launch order
        grid, at = grid[::-1], lambda f: lambda j, h, b: f(b, h, j)
    else:
        at = lambda f: f

    tok = lambda D: pl.BlockSpec((None, T, None, D), at(lambda b, h, j: (b, 0, h, 0)))
    vtok = pl.BlockSpec((None, T, None, BV), at(lambda b, h, j: (b, 0, h, j)))
    st = pl.BlockSpec((None, None, K, BV), at(lambda b, h, j: (b, h, 0, j)))
    out_specs = [vtok, st]
    out_shape = [jax.ShapeDtypeStruct((B, T, H, V), q.dtype), jax.ShapeDtypeStruct((B, H, K, V), f32)]
    if output_states:
        out_specs.append(pl.BlockSpec((None, None, T, K, BV), at(lambda b, h, j: (b, h, 0, 0, j))))
        out_shape.append(jax.ShapeDtypeStruct((B, H, T, K, V), f32))
    outs = pl.pallas_call(
        functools.partial(_decode_kernel, T=T, scale=float(scale), delta=delta, readout=readout),
        grid=grid,
        in_specs=[tok(K), tok(K), vtok, tok(K), pl.BlockSpec((None, T, None), at(lambda b, h, j: (b, 0, h))), st],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={5: 1},
        compiler_params=compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret_mode(interpret),
        name="lineattn_decode_step",
    )(q, k, v, g, beta, state)
    if output_states:
        return outs[0], outs[1], jnp.moveaxis(outs[2], 2, 1)
    return outs[0], outs[1]
