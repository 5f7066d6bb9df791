"""Backward of the chunkwise form with the two sequential passes over chunks as Pallas kernels.

Per chunk (../shared/CHUNK_ALGORITHM.md, "Backward"), with E = U - W S0 recomputed from the saved S0:

    dE  = M^T dO + Kg dS                       (dS: cotangent of the chunk's outgoing state)
    dU  = dE,  dW = -dE S0^T,  dQin = dO S0^T,  dM = dO E^T,  dKg = E dS^T,  d e^(G_C) = rowsum(S0 * dS)
    dS0 = Qin^T dO + Diag(e^(G_C)) dS - W^T dE  (handed to the previous chunk)

`_states_kernel` runs the forward pass again and writes every chunk's incoming state S0 (K*V/C values per token and
head) and E; `_reverse_ds_kernel` runs the reverse pass, one program per (batch, head, V tile), writing dS per chunk,
dE and d(initial state); `_chunk_grads_kernel`, one program per chunk, the cotangents that sum over V. The intra-chunk
part, terms -> (dq, dk, dv, dg, dbeta), is parallel over chunks: `backward_fast` below, all Pallas kernels (the Gram
stage's backward is `gram_bwd`). (Removed on 2026-12-01 as slower on the H200: a reverse pass writing per-V-tile
partials and the "kernels" backwards with XLA algebra for the WY part, 24.6-53.6 ms at 8 x 4096 x 16 x 128; the
"passes" backward with the XLA VJP of `lineattn.ops.chunk.chunk_terms`, 76.6 ms.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.chunk import ChunkTerms, pad_to_chunks
from lineattn.ops.pallas import chunk_fwd, common, gram, gram_bwd, solve, state_mgpu
from lineattn.ops.pallas.chunk_fwd import pick_block_v
from lineattn.ops.pallas.common import SUB, compiler_params, dot, interpret_mode, iota, pallas_call
from lineattn.ops.pallas.gram import gate_cumsum, gram_rows
from lineattn.ops.pallas.gram_bwd import gram_grads_fused, gram_grads_scalar
from lineattn.ops.pallas.solve import gate_factor, solve_full
from lineattn.ops.pallas.segments import block_specs, chain, pick_segments, zero_starts

f32 = jnp.float32
# Products of `backward_fast` for bf16 inputs (fp32 inputs: "ieee"), read when a call is traced: the state
# passes and chunk gradients (`state_passes`), and the WY backward (`_wy_bwd_kernel`); see `common.dot`.
# H200, 8 x 4096 x 16 x 128 (2026-12-01 run7c profile): bf16 passes 0.60 / 1.41 ms (reverse / chunk gradients)
# against 0.94 / 2.11 with tf32; the WY backward 1.23 ms at tf32 against 1.78 at bf16x3; the relative RMS errors
# of o and the five gradients against the fp32 XLA chunk form were the same to two digits (2.4e-3, dg 5.2e-3).
# The WY backward in bf16 (run9a): 0.96 ms against 1.24 at tf32, dv and dbeta 2.9e-3 against 2.4e-3, the rest
# unchanged.
PASS_PREC = "bf16"
WY_PREC = "bf16"
# The dtype of the per-chunk states S0, their cotangents dS and E = U - W S0 that the state passes store for the
# chunk gradients, for bf16 inputs: with PASS_PREC "bf16" the products round them to bf16 anyway; only
# d e^(G_C) = rowsum(S0 * dS) sees the difference. bf16 (H200, 8 x 4096, run7d profile): states / reverse / chunk
# gradients 0.27 / 0.51 / 1.10 ms against 0.38 / 0.58 / 1.33 in fp32, the same relative RMS errors to two digits.
STATES_DTYPE = "bfloat16"
# Launch settings of `backward_fast`'s chunk-parallel kernels (read when a call is traced; for timing sweeps):
# warps of the WY backward, the chunk gradients and dg, and the dg kernel's K tile (H200 sweep, run7e: WY 4 / 16
# warps 1.28 / 2.42 ms against 1.24 with 8; chunk gradients 0.95 with 4 warps against 1.11 with 8; the Gram
# gradients' warps: `gram_bwd.GRADS_WARPS`). Since the WY backward's tiles of 128
# (run13d): WY 0.554 ms with 4 warps against 0.649 with 8; chunk gradients 0.642 with 8 against 0.569 with 4.
# Run20a-b: dg 0.172-0.174 ms with 2 warps against 0.179-0.182 with 4 (3.05 TB/s: bandwidth-bound), K tile 32 0.191.
WY_WARPS, CHUNK_GRADS_WARPS, DG_WARPS, DG_BK = 4, 4, 2, 64
# Column tiles: the WY backward's V and K tiles, the chunk gradients' K and V tiles (capped at K and V). H200,
# 8 x 4096, K = V = 128 (run12d): WY backward 0.64 ms with 128 against 0.75 with 64; chunk gradients 0.56 with a
# V tile of 128 against 0.64 with 64 and 0.99 with 32, 0.98 with a K tile of 128; o and the five gradients'
# errors against the fp32 XLA chunk form unchanged to two digits in each. Run17b-c (after the chunk gradients kept
# their loads in bf16): WY backward 0.517 ms with 64 against 0.553 with 128 (Nsight Compute: 0.2 M local-memory
# spill requests against 5.0 M, 255 registers either way); chunk gradients 0.644 with a V tile of 64 against 0.568.
WY_BT, CHUNK_GRADS_BK, CHUNK_GRADS_BV = 64, 64, 128
# WY_TILE_LOOP, WY_STAGES: the WY backward's V and K tiles (WY_BT) in a `fori_loop` that Triton pipelines to
# WY_STAGES, as the forward's Gram kernel (`gram.GRAM_TILE_LOOP`). Read when traced. H200, KDA 8 x 4096 (run34a,
# kernel time): 0.480 ms with 3 stages against 0.514 with 2 and 0.529 unrolled; forward+backward kernels 4.357
# against 4.406; errors unchanged (o 3.3e-3, dg 5.7e-3). The same loop over the Gram gradients' K tiles of 64 took
# 1.646-1.685 ms against 1.311 for the default's one tile of 128 (run34a; removed, history 09163ea).
WY_TILE_LOOP, WY_STAGES = True, 3
# The pipeline depths of the states pass and the reverse pass (run8a: states 0.27 / 0.32 / 0.37 ms with 2 / 3 / 1
# stages, reverse 0.51 / 0.49 / 0.49).
STATES_STAGES, REVERSE_STAGES = 2, 1
# The dtype of the fp32-accumulated cotangents dQin, dKg and dM that `_chunk_grads_kernel` writes for the Gram
# gradients, for bf16 inputs (read when a call is traced). dU and dW go only into bf16 products when PASS_PREC
# and WY_PREC are "bf16", so they are stored in bf16 then: the same numbers (bit-identical gradients on the CPU),
# and on the H200 (run9d, 8 x 4096) the WY backward / chunk gradients / reverse pass took 0.82 / 0.83 / 0.45 ms
# against 0.96 / 0.95 / 0.48 (kernels fwd+bwd 6.31 against 6.62). COT_DTYPE "bfloat16" (run9d): chunk gradients
# 0.64 ms against 0.83, Gram gradients 2.04 against 2.11 (kernels 6.04 ms against 6.31), at dq / dk / dg
# 3.3e-3 / 3.3e-3 / 5.7e-3 against 2.8e-3 / 2.9e-3 / 5.5e-3 (the fp32 XLA chunk form, same inputs); GPU tests at
# T = 16381 (run10a): KDA dq 3.7e-3, dg 5.3e-3; GDN dq 3.6e-3, dg 4.7e-3 (FLA's bounds 8e-3 / 2e-2).
COT_DTYPE = "bfloat16"
# WY_COT_DTYPE: the same for the WY backward's dKK [C, C] and dKin [C, K]: "bfloat16" halves their 48 KB per
# chunk written and read back by the Gram gradients. CPU, KDA T = 512, K = V = 64: every gradient's relative RMS
# error against the oracle unchanged to 3 digits (dk 3.75e-3). H200, 8 x 4096 (run12a): WY backward 0.75 ms and
# Gram gradients 1.79 against 0.81 and 1.87 with "float32"; o and the five gradients' errors against the fp32 XLA
# chunk form unchanged to two digits.
WY_COT_DTYPE = "bfloat16"
PASSES_WARPS = 4  # both state passes (run9b, 1 x 32768, V tile 16: 2 warps 1.05 / 2.59 ms against 0.84 / 1.82)


def _states_kernel(kg_ref, w_ref, u_ref, dend_ref, h0_ref, *out_refs, C, K, N, prec, delta):
    """The forward pass over one sequence's (or segment's) N chunks from the state in h0: writes every chunk's
    incoming state S0 and E = U - W S0 for the chunk gradients (out_refs (s0, E)), or the final state only
    (out_refs (hT,): a segment's offset from a zero start)."""
    full = len(out_refs) == 2

    def body(n, S):
        t = pl.ds(n * C, C)
        if full:
            out_refs[0][pl.ds(n * K, K), :] = S.astype(out_refs[0].dtype)
        E = u_ref[t, :].astype(f32)
        if delta:
            E = E - dot(w_ref[t, :], S, prec)
        if full:
            out_refs[1][t, :] = E.astype(out_refs[1].dtype)
        return S * dend_ref[:, pl.ds(n, 1)] + dot(kg_ref[t, :], E, prec, trans_a=True)

    S = jax.lax.fori_loop(0, N, body, h0_ref[...].astype(f32))
    if not full:
        out_refs[0][...] = S


def _pass_dims(terms: ChunkTerms):
    """(B, H, N, C, K, V, Tp, delta) of chunk terms [B, H, N, C, .]."""
    B, H, N, C, K = terms.Qin_BHNCK.shape
    return B, H, N, C, K, terms.U_BHNCV.shape[-1], N * C, terms.W_BHNCK is not None


def _pass_operands(terms: ChunkTerms):
    """The state passes' operands: Qin, Kg, M, U, W as [B, H, Tp, .] (W zeros for the additive write) and e^(G_C)
    as [B, H, K, N] (the kernels always take a channel gate: `terms.decay_end` is [B, H, N, K])."""
    B, H, N, C, K, V, Tp, delta = _pass_dims(terms)
    flat = lambda x: x.reshape(B, H, Tp, x.shape[-1])
    qin, kg, m, u = map(flat, (terms.Qin_BHNCK, terms.Kg_BHNCK, terms.M_BHNCC, terms.U_BHNCV))
    w = flat(terms.W_BHNCK) if delta else jnp.zeros((B, H, Tp, K), f32)
    return qin, kg, m, u, w, jnp.swapaxes(terms.decay_end, -1, -2)


def _pass_setup(terms: ChunkTerms, block_v, nseg):
    """(`_pass_operands`, the V tile BV, the grid (B, H, nseg, V tiles) and the block specs of segment s
    (`segments.block_specs`: whole(D), a V tile, a segment's state, the per-chunk states, e^(G_C) and do's V
    tile))."""
    B, H, N, C, K, V, Tp, delta = _pass_dims(terms)
    BV = block_v or pick_block_v(B * H * nseg, V)
    return _pass_operands(terms), BV, (B, H, nseg, V // BV), block_specs(Tp, N, K, nseg, BV)


# ---- `backward_fast`: the backward as kernels only ----
# gate cumsum kernel -> Gram rows -> whole-tile solve writing R (both skipped with the forward's saved terms) -> the
# three state passes -> `_wy_bwd_kernel` (the WY part: dv, dbeta, dKK = Diag(b) dA, dKin, one program per chunk) ->
# `gram_bwd._gram_bwd_kernel` (dq, dk, dG) -> `_dg_kernel` (dg, the in-chunk reverse cumsum; written in the inputs' [B,
# T, H, .] layout); for a gate equal across K, `gram_bwd._gram_scalar_bwd_kernel` gives dq, dk and dG's sums over K for
# dg. What XLA still does: padding, small reshapes and (a scalar gate) dg's in-chunk sums on [B, H, N, C].
# (One kernel per (chunk, K tile) for both of the last two, the four 16-row blocks in turn with the reverse cumsum
# carried, took 5.8 ms at 8 x 4096 x 16 x 128 on the H200 against 1.90 + 1.08 for the pair, run7d: removed.)


def _wy_bwd_kernel(r_ref, kk_ref, du_ref, dw_ref, v_ref, k_ref, G_ref, beta_ref, dv_ref, dbeta_ref, dkk_ref,
                   dkin_ref, *, C, prec, bt):
    """dBv = R^T dU, dBk = R^T dW, dR = dU (bV)^T + dW (bKin)^T, dA = -strict(R^T dR R^T); writes dv = b dBv,
    dbeta = rowsum(dBv V + dBk Kin + dA KK), dKK = b dA and dKin = b dBk. V and K in tiles of bt columns, so
    only [C, bt] tiles and the [C, C] R and dR are live (whole [C, V] fp32 tiles spilled registers: 3.3 ms at
    8 x 4096 x 16 x 128 on the H200, 2026-12-01 profile)."""
    i, j = iota((C, C), 0), iota((C, C), 1)
    R = r_ref[...]
    beta = beta_ref[...].astype(f32)[:, None]

    def value_side(d, carry):  # dv, and dU (bV)^T into dR
        dR, dbeta = carry
        dU, v = du_ref[:, d], v_ref[:, d].astype(f32)
        dBv = dot(R, dU, prec, trans_a=True)
        dv_ref[:, d] = (beta * dBv).astype(dv_ref.dtype)
        return dR + dot(dU, beta * v, prec, trans_b=True), dbeta + jnp.sum(dBv * v, axis=1)

    def key_side(d, carry):  # dKin, and dW (bKin)^T into dR
        dR, dbeta = carry
        dW, kin = dw_ref[:, d], k_ref[:, d].astype(f32) * gate_factor(G_ref, d)
        dBk = dot(R, dW, prec, trans_a=True)
        dkin_ref[:, d] = (beta * dBk).astype(dkin_ref.dtype)
        return dR + dot(dW, beta * kin, prec, trans_b=True), dbeta + jnp.sum(dBk * kin, axis=1)

    carry = common.over_tiles(v_ref.shape[-1] // bt, bt, value_side, (jnp.zeros((C, C), f32), jnp.zeros((C,), f32)),
                              WY_TILE_LOOP)
    dR, dbeta = common.over_tiles(k_ref.shape[-1] // bt, bt, key_side, carry, WY_TILE_LOOP)
    dA = -jnp.where(j < i, dot(dot(R, dR, prec, trans_a=True), R, prec, trans_b=True), 0.0)
    dbeta_ref[...] = (dbeta + jnp.sum(dA * kk_ref[...], axis=1)).astype(dbeta_ref.dtype)
    dkk_ref[...] = (beta * dA).astype(dkk_ref.dtype)


def _reverse_cumsum_rows(dG, dG_end):
    """dg = the in-chunk reverse cumsum of dG [C, bk] with dG_end [1, bk] added to its last row (so to every row's
    dg)."""
    dG = dG + jnp.where(iota((dG.shape[0], 1), 0) == dG.shape[0] - 1, dG_end, 0.0)
    return jnp.sum(dG, axis=0)[None, :] - jnp.cumsum(dG, axis=0) + dG


def _dg_kernel(dG_ref, r_ref, dend_ref, ddend_ref, *refs):
    """dg for one chunk and K tile from dG and the 16-row blocks' sums of Kg * dKg (`gram_bwd._gram_bwd_kernel` with
    combine); with a mask ref (int8, 1 where g was below the floor) before dg_ref, 0 there."""
    *below_ref, dg_ref = refs
    dG_end = jnp.sum(r_ref[...], axis=0)[None, :] + dend_ref[...][None, :] * ddend_ref[...][None, :]
    dg = _reverse_cumsum_rows(dG_ref[...], dG_end)
    if below_ref:
        dg = jnp.where(below_ref[0][...] != 0, 0.0, dg)
    dg_ref[...] = dg.astype(dg_ref.dtype)


def backward_fast(q, k, v, g, beta, h0, do, dht, *, scale: float, chunk_size: int, interpret=None,
                  gram_warps: int = 2, grads_warps: int | None = None, saved=None, below=None):
    """The VJP of `chunk_fwd.forward`: (dq, dk, dv, dg, dbeta, dh0), every chunk-parallel stage a Pallas kernel
    (see the comment above); do [B, T, H, V] and dht [B, H, K, V] are the cotangents of o and the final state.
    saved: `chunk_fwd.forward(..., save=True)`'s terms (backward "kernels-saved"): no Gram recompute and no solve
    here, and the state passes read the stored (bf16 for bf16 inputs) Qin, Kg, M, W, U; where saved holds the
    gate's cumsum G, g is read for its rank and dtype only (`chunk.chunk_pallas` then keeps an empty stand-in).
    g [B, T, H] (a gate equal across K) takes the scalar Gram kernels (`gram.gram_scalar`,
    `gram_grads_scalar`) and gets dg [B, T, H]. below: None or int8 in g's shape, 1 where g was below
    `ops.LOG_GATE_FLOOR` (the kernels raised it): dg is 0 there (`chunk.below_floor`)."""

    C = chunk_size
    B, T, H, K = q.shape
    V = v.shape[-1]
    exact = q.dtype == f32
    prec = "ieee" if exact else "tf32"
    inv_prec = "ieee" if exact else solve.SOLVE_PREC
    interpret = interpret_mode(interpret)
    delta = beta is not None
    G, flags = (None, None) if saved is None else chunk_fwd.saved_gate(saved)  # (a channel gate's, saved)
    qp, kp, vp, gp, bp = pad_to_chunks(q, k, v, g if G is None else None, beta, C)
    Tp = qp.shape[1]
    N = Tp // C
    scalar = g.ndim == 3  # (its cumsum G is [B, Tp, H]; e^(G_C) is broadcast over K for the state passes)
    grads_split = gram_bwd.GRADS_SPLIT and gram.split_gram(scalar, delta)
    if G is None:  # the forward's call (with its block spreads where its Gram stage is split): XLA may merge the two
        gp = gp.astype(f32)
        G, dend_KN, *spreads = gate_cumsum(gp, C=C, K=K, interpret=interpret,
                                           spreads=gram.split_gram(scalar, delta))
        flags = gram.chunk_flags(spreads[0], C // SUB) if spreads else None
    ch = lambda x: x.reshape(B, H, N, C, x.shape[-1])
    states = maps = None
    if saved is not None:
        Qin, Kg, W, U, M, dend_KN, KK, R, _, _, maps, *states = saved
        states = tuple(states) or None  # (S0, E) when the forward's state pass kept them
        if not delta:
            U = jnp.moveaxis(vp, 2, 1).astype(f32)
    else:
        ones = jnp.ones((B, Tp, H), qp.dtype)
        if scalar:
            M, KK, Qin, Kg = gram.gram_scalar(qp, kp, gp, ones, C=C, scale=scale, store=f32, exact=exact,
                                                   delta=delta, interpret=interpret)
        else:
            M, KK, Qin, Kg = gram_rows(qp, kp, G, ones, C=C, scale=scale, store=f32,
                                       prec=prec if exact else gram.GRAM_PREC, delta=delta, warps=gram_warps,
                                       interpret=interpret)
        if delta:
            W, U, R = solve_full(KK, kp, vp, G, bp, C=C, store=f32, prec=prec if exact else solve.UW_PREC,
                                 inv_prec=inv_prec, warps=4, interpret=interpret, with_r=True, kk=True)
        else:
            U, W, R = jnp.moveaxis(vp, 2, 1).astype(f32), None, None
    terms = ChunkTerms(ch(Qin), ch(M), ch(Kg), jnp.swapaxes(dend_KN, -1, -2), ch(U), None if W is None else ch(W))
    dop = jnp.pad(do, [(0, 0), (0, Tp - T), (0, 0), (0, 0)])  # the kernels read it in its dtype
    cot, dh0 = state_passes(terms, h0, dop, dht, exact=exact, interpret=interpret, states=states, maps=maps)
    flat = lambda x: x.reshape(B, H, Tp, x.shape[-1])
    tok = lambda D: pl.BlockSpec((None, C, None, D), lambda b, h, n: (b, n, h, 0))
    tok1 = pl.BlockSpec((None, C, None), lambda b, h, n: (b, n, h))
    chunk = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, n, 0))
    wy_cot = f32 if exact else jnp.dtype(WY_COT_DTYPE)
    if delta:
        dv, dbeta, dKK, dKin = pallas_call(
            functools.partial(_wy_bwd_kernel, C=C, prec="ieee" if exact else WY_PREC, bt=min(WY_BT, K, V)),
            grid=(B, H, N),
            in_specs=[chunk(C), chunk(C), chunk(V), chunk(K), tok(V), tok(K), tok1 if scalar else tok(K), tok1],
            out_specs=[tok(V), tok1, chunk(C), chunk(K)],
            out_shape=[jax.ShapeDtypeStruct((B, Tp, H, V), v.dtype), jax.ShapeDtypeStruct((B, Tp, H), beta.dtype),
                       jax.ShapeDtypeStruct((B, H, Tp, C), wy_cot), jax.ShapeDtypeStruct((B, H, Tp, K), wy_cot)],
            compiler_params=compiler_params(num_warps=WY_WARPS, num_stages=WY_STAGES), interpret=interpret,
            name="lineattn_chunk_wy_bwd",
        )(R, KK, flat(cot.U_BHNCV), flat(cot.W_BHNCK), vp, kp, G, bp)
    else:
        dv = jnp.moveaxis(flat(cot.U_BHNCV), 1, 2).astype(v.dtype)
        dbeta, dKK, dKin = None, jnp.zeros((B, H, Tp, C), f32), jnp.zeros((B, H, Tp, K), f32)
    ddend_KN = jnp.swapaxes(cot.decay_end, -1, -2)  # [B, H, K, N] (g is always given to the kernels)
    grads = (qp, kp, gp if scalar else G, flat(cot.M_BHNCC), dKK, flat(cot.Qin_BHNCK), flat(cot.Kg_BHNCK),
             dKin)
    cut = lambda x: None if x is None else x[:, :T]
    if scalar:  # dg straight from the Gram gradients, [B, H, Tp]
        dq, dk, dg = gram_grads_scalar(*grads, dend_KN, ddend_KN, C=C, scale=scale, exact=exact,
                                       interpret=interpret, delta=delta)
        dg = cut(jnp.moveaxis(dg, 1, 2))
        if below is not None:
            dg = jnp.where(below != 0, 0.0, dg)
        return cut(dq), cut(dk), cut(dv), dg.astype(g.dtype), cut(dbeta), dh0.astype(h0.dtype)
    dq, dk, dG, kg_dkg = gram_grads_fused(*grads, C=C, scale=scale, exact=exact, interpret=interpret,
                                          warps=grads_warps or gram_bwd.GRADS_WARPS, delta=delta,
                                          bk=gram_bwd.GRADS_BK, flags=flags if grads_split else None)
    bk = min(K, DG_BK)  # K tiles: the reverse cumsum is independent per channel
    ktok = pl.BlockSpec((None, C, None, bk), lambda b, h, n, t: (b, n, h, t))
    kchunk = pl.BlockSpec((None, None, C, bk), lambda b, h, n, t: (b, h, n, t))
    kn = pl.BlockSpec((None, None, bk, None), lambda b, h, n, t: (b, h, t, n))
    nr = kg_dkg.shape[2] // N  # rows of Kg * dKg column sums per chunk (the 16-row blocks)
    masks = [] if below is None else [jnp.pad(below, [(0, 0), (0, Tp - T), (0, 0), (0, 0)])]  # (as dop)
    dg = pallas_call(
        _dg_kernel, grid=(B, H, N, K // bk),
        in_specs=[kchunk, pl.BlockSpec((None, None, nr, bk), lambda b, h, n, t: (b, h, n, t)), kn, kn]
        + [ktok] * len(masks),
        out_specs=ktok, out_shape=jax.ShapeDtypeStruct((B, Tp, H, K), g.dtype),
        compiler_params=compiler_params(num_warps=DG_WARPS, num_stages=1), interpret=interpret,
        name="lineattn_chunk_bwd_dg",
    )(dG, kg_dkg, dend_KN, ddend_KN, *masks)
    return cut(dq), cut(dk), cut(dv), cut(dg), cut(dbeta), dh0.astype(h0.dtype)


# ---- The state passes, used by `backward_fast` ----
# No per-V-tile partials (partial sums of dQin, dKg, dW, dM per V tile, summed by XLA, were about 8 GB of traffic
# at 8 x 4096 x 16 x 128): the reverse pass only carries the state cotangent dS and writes dS per chunk and
# dE = M^T dO + Kg dS (both per V tile); the cotangents that sum over V come from `_chunk_grads_kernel`, one
# program per chunk looping over V tiles, with E = U - W S0 written by the states pass:
#     dQin = dO S0^T,  dM = dO E^T,  dKg = E dS^T,  dW = -dE S0^T,  d e^(G_C) = rowsum(S0 * dS).


def _reverse_ds_kernel(qin_ref, kg_ref, w_ref, m_ref, dend_ref, do_ref, dht_ref, *out_refs, C, K, N, prec, delta,
                       value_tiles=None):
    """The reverse pass over N chunks from the state cotangent dht: writes dS per chunk, dE and the cotangent of
    the incoming state (out_refs (ds, du, dh0)), or the last only (out_refs (dh0,): a segment's offset).
    value_tiles: programs past this many column tiles (the last grid axis) run without dO (a segment's map)."""
    *full, dh0_ref = out_refs
    keep = 1.0 if value_tiles is None else (common.program_id(3) < value_tiles).astype(f32)

    def body(i, dS):
        n = N - 1 - i
        t = pl.ds(n * C, C)
        if full:
            full[0][pl.ds(n * K, K), :] = dS.astype(full[0].dtype)
        dO = do_ref[t, :].astype(f32) * keep
        dE = dot(m_ref[t, :], dO, prec, trans_a=True) + dot(kg_ref[t, :], dS, prec)
        if full:
            full[1][t, :] = dE.astype(full[1].dtype)
        dS_prev = dot(qin_ref[t, :], dO, prec, trans_a=True) + dS * dend_ref[:, pl.ds(n, 1)]
        if delta:
            dS_prev = dS_prev - dot(w_ref[t, :], dE, prec, trans_a=True)
        return dS_prev

    dh0_ref[...] = jax.lax.fori_loop(0, N, body, dht_ref[...].astype(f32))


def _chunk_grads_kernel(e_ref, s0_ref, ds_ref, do_ref, du_ref, dqin_ref, dm_ref, dkg_ref, dw_ref, ddend_ref, *, C, prec,
                        delta, bk, bv):
    # [C, bk] accumulators per K tile over V tiles of bv (a chunk's whole [C, K] fp32 cotangents at once spilled
    # registers: 5.0 ms at 8 x 4096 x 16 x 128 on the H200, 2026-12-01 profile)
    K, V = s0_ref.shape
    dM = jnp.zeros((C, C), f32)
    for t in range(K // bk):
        d = pl.ds(t * bk, bk)
        dqin, dkg, dw = (jnp.zeros((C, bk), f32) for _ in range(3))
        dd = jnp.zeros((bk,), f32)
        for c in range(V // bv):
            e = pl.ds(c * bv, bv)
            # in their stored dtype (bf16 for bf16 inputs): the products take them so, and fp32 copies of the
            # four [C, bv] / [bk, bv] tiles spilled registers (run17b)
            dO, E, S0, dS = do_ref[:, e], e_ref[:, e], s0_ref[d, e], ds_ref[d, e]
            if t == 0:
                dM = dM + dot(dO, E, prec, trans_b=True)
            dqin = dqin + dot(dO, S0, prec, trans_b=True)
            dkg = dkg + dot(E, dS, prec, trans_b=True)
            if delta:
                dw = dw - dot(du_ref[:, e], S0, prec, trans_b=True)
            dd = dd + jnp.sum(S0.astype(f32) * dS.astype(f32), axis=1)
        dqin_ref[:, d] = dqin.astype(dqin_ref.dtype)
        dkg_ref[:, d] = dkg.astype(dkg_ref.dtype)
        if delta:
            dw_ref[:, d] = dw.astype(dw_ref.dtype)
        ddend_ref[d] = dd
    dm_ref[...] = jnp.where(iota((C, C), 1) <= iota((C, C), 0), dM, 0.0).astype(dm_ref.dtype)  # M: lower


def state_passes(terms: ChunkTerms, h0, do, dht, *, exact: bool, interpret=None, block_v=None, warps=None,
                 bk=None, bv=None, states=None, maps=None):
    """The Pallas passes: cotangents of `terms` (a ChunkTerms of [B, H, N, C, .] arrays) and d(h0), by
    `_states_kernel`, `_reverse_ds_kernel` (in segments: see SEGMENT_PASSES) and `_chunk_grads_kernel`. do:
    [B, Tp, H, V] (Tp = N * C), dht: [B, H, K, V]. states: (S0 [B, H, N K, V], E [B, H, Tp, V]) kept by the
    forward's state pass (`chunk_fwd.forward(states_dtype=...)`), in place of `_states_kernel`'s. maps: the
    segments' transposed maps [B, H, nseg, K, K] from the forward's segmented pass (`chunk_fwd.segment_starts`),
    which sets the segments; the zero-start reverse pass then runs over V columns only. bk, bv: the chunk
    gradients' tiles (default CHUNK_GRADS_BK, CHUNK_GRADS_BV). Returns (ChunkTerms of cotangents, dh0)."""
    bk, bv = bk or CHUNK_GRADS_BK, bv or CHUNK_GRADS_BV
    B, H, N, C, K, V, Tp, delta = _pass_dims(terms)
    interpret, prec = interpret_mode(interpret), "ieee" if exact else PASS_PREC
    nseg = pick_segments(B * H, N, V) if maps is None else maps.shape[2]
    (qin, kg, m, u, w, dend_KN), BV, grid, (whole, vtile, state, per_chunk, kn, do_spec) = _pass_setup(terms,
                                                                                                       block_v, nseg)
    Ns = N // nseg
    kept = f32 if exact else jnp.dtype(STATES_DTYPE)
    cot_dt = f32 if exact else jnp.dtype(COT_DTYPE)
    wy_dt = jnp.bfloat16 if not exact and PASS_PREC == WY_PREC == "bf16" else f32  # (dU, dW: see COT_DTYPE)
    seg_states = lambda D: jax.ShapeDtypeStruct((B, H, nseg, K, D), f32)

    def run(kernel, name, stages, in_specs, out_specs, out_shape, *args, grid=grid, **kw):
        return pallas_call(
            functools.partial(kernel, C=C, K=K, N=Ns, prec=prec, delta=delta, **kw), grid=grid, in_specs=in_specs,
            out_specs=out_specs, out_shape=out_shape, interpret=interpret, name=name,
            compiler_params=compiler_params(num_warps=PASSES_WARPS, num_stages=stages))(*args)

    states_in = [whole(K), whole(K), vtile, kn, state]
    reverse_in = [whole(K), whole(K), whole(K), whole(C), kn, do_spec, state]
    if nseg == 1:
        S_start, dS_end = h0.astype(f32)[:, :, None], dht.astype(f32)[:, :, None]
    else:  # the segments' true starts (S) and ends (dS) from their maps and zero-start offsets
        BQ = min(BV, K)  # the reverse zero-start pass: V tiles of dS, then K tiles of the map (no dO)
        NQ = V // BQ
        stateq = pl.BlockSpec((None, None, None, K, BQ), lambda b, h, s, j: (b, h, s, 0, j))
        do_q = pl.BlockSpec((None, Ns * C, None, BQ), lambda b, h, s, j: (b, s, h, jnp.minimum(j, NQ - 1)))
        NM = K // BQ if maps is None else 0  # the maps' column tiles, where the forward gave none
        start = zero_starts(B, H, nseg, K, V, NM * BQ)
        if not NM and chunk_fwd.mosaic_pass(qin.dtype, delta, C, K, V, BV, False, kept, interpret):
            out = state_mgpu.reverse_pass_mosaic(qin, kg, w, m, terms.decay_end, do, start, ds_dtype=kept,
                                                 de_dtype=wy_dt, block_v=BV, chunk_outputs=False,
                                                 interpret=interpret)[0]
        else:
            out = run(_reverse_ds_kernel, "lineattn_chunk_bwd_reverse_local", REVERSE_STAGES,
                      reverse_in[:5] + [do_q, stateq], [stateq], [seg_states(V + NM * BQ)], qin, kg, w, m, dend_KN,
                      do, start, grid=grid[:3] + (NQ + NM,), value_tiles=NQ)[0]
        PT = out[..., V:] if maps is None else maps
        dS_end = chain(PT, out[..., :V], dht, reverse=True)
        if states is None:
            offsets = run(_states_kernel, "lineattn_chunk_bwd_states_local", STATES_STAGES, states_in, [state],
                          [seg_states(V)], kg, w, u, dend_KN, jnp.zeros((B, H, nseg, K, V), f32))[0]
            S_start = chain(PT, offsets, h0, reverse=False)
    if states is None:
        s0, E = run(_states_kernel, "lineattn_chunk_bwd_states", STATES_STAGES, states_in, [per_chunk, vtile],
                    [jax.ShapeDtypeStruct((B, H, N * K, V), kept), jax.ShapeDtypeStruct((B, H, Tp, V), kept)],
                    kg, w, u, dend_KN, S_start)
    else:
        s0, E = states
    if chunk_fwd.mosaic_pass(qin.dtype, delta, C, K, V, BV, False, kept, interpret):
        ds, du, dS_start = state_mgpu.reverse_pass_mosaic(qin, kg, w, m, terms.decay_end, do, dS_end,
                                                          ds_dtype=kept, de_dtype=wy_dt, block_v=BV,
                                                          interpret=interpret)
        dh0 = dS_start[:, :, 0]
    else:
        ds, du, dS_start = run(_reverse_ds_kernel, "lineattn_chunk_bwd_reverse_ds", REVERSE_STAGES, reverse_in,
                               [per_chunk, vtile, state], [jax.ShapeDtypeStruct((B, H, N * K, V), kept),
                                                        jax.ShapeDtypeStruct((B, H, Tp, V), wy_dt), seg_states(V)],
                               qin, kg, w, m, dend_KN, do, dS_end)
        dh0 = dS_start[:, :, 0]
    chunk = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, n, 0))
    kv = pl.BlockSpec((None, None, K, V), lambda b, h, n: (b, h, n, 0))
    dqin, dm, dkg, dw, ddend = pallas_call(
        functools.partial(_chunk_grads_kernel, C=C, prec=prec, delta=delta, bk=min(bk, K), bv=min(bv, V)),
        grid=(B, H, N),
        in_specs=[chunk(V), kv, kv, pl.BlockSpec((None, C, None, V), lambda b, h, n: (b, n, h, 0)), chunk(V)],
        out_specs=[chunk(K), chunk(C), chunk(K), chunk(K), pl.BlockSpec((None, None, K, None),
                                                                         lambda b, h, n: (b, h, 0, n))],
        out_shape=[jax.ShapeDtypeStruct((B, H, Tp, K), cot_dt), jax.ShapeDtypeStruct((B, H, Tp, C), cot_dt),
                   jax.ShapeDtypeStruct((B, H, Tp, K), cot_dt), jax.ShapeDtypeStruct((B, H, Tp, K), wy_dt),
                   jax.ShapeDtypeStruct((B, H, K, N), f32)],
        compiler_params=compiler_params(num_warps=warps or CHUNK_GRADS_WARPS, num_stages=1), interpret=interpret,
        name="lineattn_chunk_bwd_chunk_grads",
    )(E, s0, ds, do, du)
    chunked = lambda x: x.reshape(B, H, N, C, x.shape[-1])
    cot = ChunkTerms(chunked(dqin), chunked(dm), chunked(dkg), jnp.swapaxes(ddend, -1, -2), chunked(du),
                     chunked(dw) if delta else None)
    return cot, dh0
