"""Backward of the chunkwise form with the two sequential passes over chunks as Pallas kernels.

Per chunk (../shared/CHUNK_ALGORITHM.md, "Backward"), with E = U - W S0 recomputed from the saved S0:

    dE  = M^T dO + Kg dS                       (dS: cotangent of the chunk's outgoing state)
    dU  = dE,  dW = -dE S0^T,  dQin = dO S0^T,  dM = dO E^T,  dKg = E dS^T,  d e^(G_C) = rowsum(S0 * dS)
    dS0 = Qin^T dO + Diag(e^(G_C)) dS - W^T dE  (handed to the previous chunk)

`_states_kernel` runs the forward pass again and writes every chunk's incoming state S0 (K*V/C values per
token and head) and E; `_reverse_ds_kernel` runs the reverse pass, one program per (batch, head, V tile), writing
dS per chunk, dE and d(initial state); `_chunk_grads_kernel`, one program per chunk, the cotangents that sum over V.
The intra-chunk part, terms -> (dq, dk, dv, dg, dbeta), is parallel over chunks: `backward_fast` below, all
Pallas kernels. (Removed on 2026-12-01 as slower on the H200: a reverse pass writing per-V-tile partials and the
"kernels" backwards with XLA algebra for the WY part, 24.6-53.6 ms at 8 x 4096 x 16 x 128; the "passes" backward
with the XLA VJP of `lineattn.ops.chunk.chunk_terms`, 76.6 ms.)
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.chunk import ChunkTerms, pad_to_chunks
from lineattn.ops.pallas import chunk_fwd, common, gram, solve, state_mgpu
from lineattn.ops.pallas.chunk_fwd import pick_block_v
from lineattn.ops.pallas.common import SUB, compiler_params, dot, exp, interpret_mode, iota, pallas_call
from lineattn.ops.pallas.gram import LIMIT, _gram_block_spread, gate_cumsum, gram_rows, keys_toward
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
# warps of the Gram gradients, the WY backward, the chunk gradients and dg, and the dg kernel's K tile (H200 sweep,
# run7e: 2 or 8 warps for the Gram gradients 3.62 / 2.63 ms against 1.62 with 4; WY 4 / 16 warps 1.28 / 2.42
# against 1.24 with 8; chunk gradients 0.95 with 4 warps against 1.11 with 8). Since the WY backward's tiles of 128
# (run13d): WY 0.554 ms with 4 warps against 0.649 with 8; chunk gradients 0.642 with 8 against 0.569 with 4.
# Run20a-b: dg 0.172-0.174 ms with 2 warps against 0.179-0.182 with 4 (3.05 TB/s: bandwidth-bound), K tile 32 0.191.
GRADS_WARPS, WY_WARPS, CHUNK_GRADS_WARPS, DG_WARPS, DG_BK = 4, 4, 4, 2, 64
# Column tiles: the WY backward's V and K tiles, the chunk gradients' K and V tiles (capped at K and V). H200,
# 8 x 4096, K = V = 128 (run12d): WY backward 0.64 ms with 128 against 0.75 with 64; chunk gradients 0.56 with a
# V tile of 128 against 0.64 with 64 and 0.99 with 32, 0.98 with a K tile of 128; o and the five gradients'
# errors against the fp32 XLA chunk form unchanged to two digits in each. Run17b-c (after the chunk gradients kept
# their loads in bf16): WY backward 0.517 ms with 64 against 0.553 with 128 (Nsight Compute: 0.2 M local-memory
# spill requests against 5.0 M, 255 registers either way); chunk gradients 0.644 with a V tile of 64 against 0.568.
WY_BT, CHUNK_GRADS_BK, CHUNK_GRADS_BV = 64, 64, 128
# The Gram gradients' K tile (run10b, 8 x 4096: 1.87 ms with 128 against 2.05 with 64 and 3.18 with 32).
GRADS_BK = 128
# WY_TILE_LOOP, WY_STAGES: the WY backward's V and K tiles (WY_BT) in a `fori_loop` that Triton pipelines to
# WY_STAGES, as the forward's Gram kernel (`gram.GRAM_TILE_LOOP`). Read when traced. H200, KDA 8 x 4096 (run34a,
# kernel time): 0.480 ms with 3 stages against 0.514 with 2 and 0.529 unrolled; forward+backward kernels 4.357
# against 4.406; errors unchanged (o 3.3e-3, dg 5.7e-3). The same loop over the Gram gradients' K tiles of 64 took
# 1.646-1.685 ms against 1.311 for the default's one tile of 128 (run34a; removed, history 09163ea).
WY_TILE_LOOP, WY_STAGES = True, 3
# GRADS_SPLIT: the Gram-gradient kernel without its exact path (every block on the fast path), then a second
# kernel that rewrites by the exact path the chunks the gate-cumsum kernel flags beyond LIMIT (as the forward's
# GRAM_IMPL "triton-fast"). Read when a call is traced; applies where the forward's Gram stage is split too (its
# spreads). H200, 8 x 4096 (run12a): 1.72 + 0.06 ms against 1.87 with both paths in one kernel. (The fast path
# by 16-column blocks, each side over the blocks where dP is nonzero only, 5/8 of the exps, loads and products,
# each block behind a `lax.cond`: 1.92 ms in run12a; removed. One program per chunk over its four row blocks in
# turn, each side over its triangle: 5.87 / 3.85 / 2.68 ms with 2 / 4 / 8 warps in run15b; removed. Two programs
# per 16-row block over halves of K: 1.815 + 0.111 ms against 1.717 + 0.057 in run16a; removed.)
GRADS_SPLIT = True
# GRADS_ROW_SPLIT: the parts in which the fast path contracts over the chunk's rows (1: the whole [C, K tile]
# operands at once). Nsight Compute, H200, 8 x 4096: the kernel as it was (run17a; each side's operands formed
# before any product) used 255 registers a thread, spilled 19.4 M local-memory requests and took 1.70 ms; with the
# row side's products before the column side's operands (this code, run17b) 7.3 M and 1.59 ms; in 2 parts no
# spills but 1.61 ms, in 4 parts 1.92, in 2 parts with 8 warps (GRADS_WARPS) 128 registers, 1.58 ms (all 2 blocks
# an SM). Profiler (run17c, kernel time): 1.601 ms with 1 part against 1.717 before (run16a), 1.615 with 2 parts,
# 1.589 with 2 parts on 8 warps but its exact-path kernel 0.112 against 0.057; with the exact path on one program
# per chunk (run17e) 1.586 (exact 0.017) against 1.573 (exact 0.032), fwd+bwd 4.831 against 4.838 ms.
GRADS_ROW_SPLIT = 1
# GRADS_PREC, GRADS_SCALAR_PREC: the products of the Gram gradients (`gram_grads_fused`; `gram_grads_scalar`, a
# gate equal across K) for bf16 inputs: "tf32"; "bf16x3" (three bf16 tensor-core products of the fp32 operands'
# parts: about 16 mantissa bits against TF32's 10); "bf16x2" (the scalar kernel's right operands are the bf16
# inputs themselves: two products, the numbers of bf16x3). GRADS_SCALAR_WARPS, GRADS_SCALAR_BK: the scalar
# kernel's warps and K tile. H200, 8 x 4096, kernel time (run29a-c): KDA's kernel 2.197 ms with bf16x3 against
# 1.290 with tf32 (dg 2.9e-3 against 5.7e-3 from the fp32 XLA chunk form); GDN's, K tile 64 / 32 / 16 on 4 warps
# with bf16x2: 1.090 / 0.964 / 0.823 ms (run29-37; 1.220 before run29, tf32 with scale * q as an operand,
# dg 4.5e-3 against 2.7e-3 now); K tile 32: tf32 1.014, bf16x3 1.305, 8 warps 1.236 (bf16x3 on 8: 1.878); K tile
# 64: 8 warps 0.980, bf16x3 1.061. (Plain bf16 products, dg from them: dg's error 1.3e-2 against 1.8e-3, CPU,
# T = 512, before run29.) KDA's kernel with bf16x2 (its right operands the gated keys, which bf16 does not hold): 1.392
# ms against 1.289 and dg's error 4.0e-2 against 5.7e-3 (run39h). Read when a call is traced.
# GRADS_SCALAR_GRAM_DG: the scalar kernel takes dg's share of the Gram matrices from dM * M and dKK * KK, M and KK
# formed in the kernel by exact bf16 products (`_gram_scalar_bwd_kernel`), instead of from its four products summed
# over K; the products then only feed dq and dk, in plain bf16. H200, GDN 8 x 4096, kernel time (run37d-e): 0.635 ms
# with one K tile of 128 on 8 warps (the default) against 0.826 for run29's form (products in bf16x2, dg from them, K
# tiles of 16 on 4 warps); with GRAM_DG: bf16x2 on tiles of 16 0.992, bf16 on tiles of 16 / 32 / 64 0.894 / 0.759 /
# 0.676 (on 8 warps 0.785 for 64), 128 on 4 warps 1.218. Forward+backward kernels 2.756 ms against 2.948; errors
# against the fp32 XLA chunk form unchanged (dg 2.7e-3) but dq, dk 3.2e-3 against 3.1e-3.
GRADS_PREC = "tf32"
GRADS_SCALAR_PREC, GRADS_SCALAR_WARPS, GRADS_SCALAR_BK = "bf16", 8, 128
GRADS_SCALAR_GRAM_DG = True
# dq, dk and dG are formed inside the Gram-gradient kernel, row by row, and `_dg_kernel` takes dg's reverse
# cumsum. (A separate combine kernel reading four fp32 Gram gradients back was slower on the H200, run8a: 1.62 +
# 1.05 ms against 2.13 + 0.18; removed.)
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


# The Gram gradients. For P_ij = sum_d x_id k_jd e^(G_id - G_jd) (M: x = scale q; KK: x = k),
#     dx_i = sum_j dP_ij k_j e^(G_i - G_j),   dk_j = sum_i dP_ij x_i e^(G_i - G_j),   dG_i += x_i dx_i - k_i dk_i.
# One kernel, `_gram_bwd_kernel` (one program per 16-row block a: its row side and the column side of column
# block a), with no column loop (see `gram._gram_rows_kernel`): when the block's rows are within LIMIT nats
# of its middle row r, one product per K tile for each side,
#     row:    dx_a = e^(G_a - G_r) (dP[a, :] @ (k e^(min(G_r - G, 40))))
#     column: dk_a = e^(G_r - G_a) (dP[:, a]^T @ (x e^(min(G - G_r, 40))))
# (dP is zero above the diagonal; clamped factors stay finite and meet only those zeros); otherwise the exact path:
# off-diagonal blocks through the first row of block a (row side) or the last row of block a (column side), both
# factors <= 1, and the diagonal 16 x 16 block pair by pair, masked before the exp, by 16-step loops.


def _gram_grad_fast(q_ref, k_ref, G_ref, dm_ref, dkk_ref, r0, d, *, scale, prec):
    """The fast path for the 16-row block at r0 and channels d: (dXq, dXk, dKq, dKk) as [16, |d|] values (dXq
    with respect to scale * q). Both sides contract over the chunk's rows, in GRADS_ROW_SPLIT parts (each part's
    [C / split, |d|] operands live only while its products run)."""
    blk = pl.ds(r0, SUB)
    C = k_ref.shape[0]
    Gr, Ga = G_ref[pl.ds(r0 + SUB // 2, 1), d], G_ref[blk, d]
    parts = max(1, min(GRADS_ROW_SPLIT, C // SUB))  # (parts of 16 rows at least: the tensor cores' unit)
    n = C // parts
    xq, xk, kq, kk = (jnp.zeros((SUB, Ga.shape[1]), f32) for _ in range(4))
    for part in range(parts):
        rows = pl.ds(part * n, n)
        G = G_ref[rows, d]
        kc = keys_toward(k_ref[rows, d], G, Gr)
        xq = xq + dot(dm_ref[blk, rows], kc, prec)
        xk = xk + dot(dkk_ref[blk, rows], kc, prec)
        up = exp(jnp.minimum(G - Gr, LIMIT))
        kq = kq + dot(dm_ref[rows, blk], q_ref[rows, d].astype(f32) * (scale * up), prec, trans_a=True)
        kk = kk + dot(dkk_ref[rows, blk], k_ref[rows, d].astype(f32) * up, prec, trans_a=True)
    row, col = exp(Ga - Gr), exp(Gr - Ga)
    return row * xq, row * xk, col * kq, col * kk


def _exact_operands(dm_ref, dkk_ref, r0):
    """The exact paths' cotangent blocks for the 16-row block at r0: the row side left of the diagonal block
    (dM, dKK [16, C]), the column side below it ([C, 16]) and the diagonal blocks [16 (i), 16 (j)]."""
    s, C = SUB, dm_ref.shape[-1]
    blk = pl.ds(r0, s)
    left = lambda ref: jnp.where(iota((s, C), 1) < r0, ref[blk, :], 0.0)
    below = lambda ref: jnp.where(iota((C, s), 0) >= r0 + s, ref[:, blk], 0.0)
    return left(dm_ref), left(dkk_ref), below(dm_ref), below(dkk_ref), dm_ref[blk, blk], dkk_ref[blk, blk]


def _gram_grad_exact_loop(q_ref, k_ref, G_ref, dm_ref, dkk_ref, r0, d, *, scale, prec):
    """The exact path with 16-step loops for the diagonal block (few registers), as `_gram_grad_fast`."""
    s = SUB
    blk = pl.ds(r0, s)
    rows_s1 = iota((s, 1), 0)
    dM_off, dKK_off, dMc_off, dKKc_off, dM_d, dKK_d = _exact_operands(dm_ref, dkk_ref, r0)
    Gn, Gm = G_ref[pl.ds(r0, 1), d], G_ref[pl.ds(r0 + s - 1, 1), d]
    Ga, G = G_ref[blk, d], G_ref[:, d]
    kc = k_ref[:, d].astype(f32) * exp(jnp.minimum(Gn - G, 0.0))
    down = exp(jnp.minimum(G - Gm, 0.0))
    row = exp(Ga - Gn)
    col = exp(Gm - Ga)
    xq = row * dot(dM_off, kc, prec)
    xk = row * dot(dKK_off, kc, prec)
    kq = col * dot(dMc_off, q_ref[:, d].astype(f32) * (scale * down), prec, trans_a=True)
    kk = col * dot(dKKc_off, k_ref[:, d].astype(f32) * down, prec, trans_a=True)

    def step(j, acc):  # j: a column of the block (row side), then a row (column side)
        xq, xk, kq, kk = acc
        r = pl.ds(r0 + j, 1)
        Gj = G_ref[r, d]
        e_row = exp(jnp.where(rows_s1 >= j, Ga - Gj, -jnp.inf)) * k_ref[r, d].astype(f32)  # i >= j
        xq = xq + dm_ref[blk, r] * e_row
        xk = xk + dkk_ref[blk, r] * e_row
        e_col = exp(jnp.where(rows_s1 <= j, Gj - Ga, -jnp.inf))  # row j against columns <= j
        wq = jnp.sum(jnp.where(rows_s1 == j, dM_d, 0.0), axis=0)[:, None]  # dP[j, :] as a column
        wk = jnp.sum(jnp.where(rows_s1 == j, dKK_d, 0.0), axis=0)[:, None]
        kq = kq + wq * e_col * (q_ref[r, d].astype(f32) * scale)
        kk = kk + wk * e_col * k_ref[r, d].astype(f32)
        return xq, xk, kq, kk

    return jax.lax.fori_loop(0, s, step, (xq, xk, kq, kk))


def _gram_bwd_kernel(*refs, C, scale, prec, bk, delta=True, paths="both"):
    """The Gram gradients of one 16-row block with the row-local combine: from the block's rows of dQin, dKg,
    dKin [16, K], the outputs dq, dk (the inputs' layout), dG [16, K] and the block's column sum of Kg * dKg
    [1, K] (`_combine_rows`; `_dg_kernel` then takes the in-chunk reverse cumsum). paths: "both" (the fast path
    where the block's spread allows it, else the exact one), "fast" (the fast path only), or "exact" (the exact
    path, one program per chunk, only in the chunks flagged by a leading flag ref, the outputs aliased to four
    trailing inputs)."""
    if paths == "exact":
        flag_ref, *refs = refs
        refs = refs[:8] + refs[12:]  # (the aliased outputs' input copies are not read)
    q_ref, k_ref, G_ref, dm_ref, dkk_ref, dqin_ref, dkg_ref, dkin_ref, dq_ref, dk_ref, dG_ref, r_ref = refs
    s = SUB
    K = k_ref.shape[-1]

    def block(a, o0, path):
        """16-row block a of the chunk by `path`, its rows at o0 of the row-wise refs (a program's own block: 0;
        the whole chunk's: a * 16)."""
        r0 = a * s
        blk, out = pl.ds(r0, s), pl.ds(o0, s)

        def emit(d, xq, xk, kq, kk):
            q, k, G = q_ref[blk, d].astype(f32), k_ref[blk, d].astype(f32), G_ref[blk, d]
            dkin = dkin_ref[out, d] if delta else None
            dq, dk, dG, kg_dkg = _combine_rows(q, k, G, G_ref[pl.ds(C - 1, 1), d], dqin_ref[out, d],
                                               dkg_ref[out, d], dkin, xq, xk, kq, kk, scale)
            dq_ref[out, d] = dq.astype(dq_ref.dtype)
            dk_ref[out, d] = dk.astype(dk_ref.dtype)
            dG_ref[out, d] = dG
            r_ref[pl.ds(o0 // s, 1), d] = jnp.sum(kg_dkg, axis=0, keepdims=True)

        for t in range(K // bk):
            d = pl.ds(t * bk, bk)
            emit(d, *path(q_ref, k_ref, G_ref, dm_ref, dkk_ref, r0, d, scale=scale, prec=prec))

    if paths == "exact":  # one program per chunk: its four blocks in turn, where the chunk is flagged
        def each_block(a, carry):
            block(a, a * s, _gram_grad_exact_loop)
            return carry

        @pl.when(jnp.max(flag_ref[...]) > 0.0)
        def _():
            jax.lax.fori_loop(0, C // s, each_block, 0)
        return
    a = common.program_id(2) % (C // s)
    if paths == "fast":
        block(a, 0, _gram_grad_fast)
    else:
        spread = _gram_block_spread(G_ref, a * s, K, bk)
        pl.when(spread <= LIMIT)(lambda: block(a, 0, _gram_grad_fast))
        pl.when(spread > LIMIT)(lambda: block(a, 0, _gram_grad_exact_loop))


def gram_grads_fused(q, k, G, dM, dKK, dQin, dKg, dKin, *, C, scale, exact, interpret, warps=4, bk=64, delta=True,
                     flags=None):
    """The Gram gradients with the row-local combine, by `_gram_bwd_kernel`: from q, k, G [B, Tp, H, K], dM, dKK
    [B, H, Tp, C] (lower triangular) and dQin, dKg, dKin [B, H, Tp, K] fp32, dq, dk [B, Tp, H, K] (q's and k's
    dtypes), dG [B, H, Tp, K] fp32 and the 16-row blocks' column sums of Kg * dKg [B, H, Tp / 16, K] (see
    `_combine_rows`). flags: the chunk flags [B, H, N, C / 16] (`gram.chunk_flags`; GRADS_SPLIT): the kernel
    takes the fast path in every block, then a second one rewrites the flagged chunks by the exact path."""
    B, Tp, H, K = q.shape
    N, nb = Tp // C, C // SUB
    chunk_tok = lambda D: pl.BlockSpec((None, C, None, D), lambda b, h, i: (b, i // nb, h, 0))
    chunk_mat = pl.BlockSpec((None, None, C, C), lambda b, h, i: (b, h, i // nb, 0))
    rows = pl.BlockSpec((None, None, SUB, K), lambda b, h, i: (b, h, i, 0))
    tok_rows = pl.BlockSpec((None, SUB, None, K), lambda b, h, i: (b, i, h, 0))
    prec = "ieee" if exact else GRADS_PREC
    out_specs = [tok_rows, tok_rows, rows, pl.BlockSpec((None, None, 1, K), lambda b, h, i: (b, h, i, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, Tp, H, K), q.dtype), jax.ShapeDtypeStruct((B, Tp, H, K), k.dtype),
                 jax.ShapeDtypeStruct((B, H, Tp, K), f32), jax.ShapeDtypeStruct((B, H, N * nb, K), f32)]
    in_specs = [chunk_tok(K), chunk_tok(K), chunk_tok(K), chunk_mat, chunk_mat, rows, rows, rows]
    args = (q, k, G, dM, dKK, dQin, dKg, dKin)

    def call(paths, name, in_specs, out_specs, grid, flags=None, fast=()):
        """The kernel with `paths`; for "exact": the chunk flags first and the fast outputs last (aliased)."""
        return pallas_call(
            functools.partial(_gram_bwd_kernel, C=C, scale=scale, prec=prec, bk=min(bk, K), delta=delta, paths=paths),
            grid=grid, in_specs=in_specs + (out_specs if fast else []), out_specs=out_specs, out_shape=out_shape,
            input_output_aliases={9 + i: i for i in range(len(fast))}, interpret=interpret, name=name,
            compiler_params=compiler_params(num_warps=warps, num_stages=1),
        )(*([] if flags is None else [flags]), *args, *fast)

    if flags is None:
        return call("both", "lineattn_gram_bwd_combine", in_specs, out_specs, (B, H, N * nb))
    fast = call("fast", "lineattn_gram_bwd_combine", in_specs, out_specs, (B, H, N * nb))
    # the exact path over whole chunks (4x fewer programs, most of which only read their flag): chunk-sized blocks
    tok = pl.BlockSpec((None, C, None, K), lambda b, h, n: (b, n, h, 0))
    chunk = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, n, 0))
    exact_in = [pl.BlockSpec((None, None, None, nb), lambda b, h, n: (b, h, n, 0)), tok, tok, tok, chunk(C),
                chunk(C), chunk(K), chunk(K), chunk(K)]
    exact_out = [tok, tok, chunk(K), pl.BlockSpec((None, None, nb, K), lambda b, h, n: (b, h, n, 0))]
    return call("exact", "lineattn_gram_bwd_exact", exact_in, exact_out, (B, H, N),
                flags, fast)


def _gram_scalar_bwd_kernel(q_ref, k_ref, g_ref, dm_ref, dkk_ref, dqin_ref, dkg_ref, dkin_ref, dq_ref, dk_ref,
                            rest_ref, kgd_ref, *, C, scale, prec, delta, bk, gram_dg):
    """The Gram gradients for a gate equal across K (`gram.gram_scalar`), one program per chunk, with the
    row-local combine: with D_ij = e^(G_i - G_j) (j <= i), dx = (dP * D) k and dk = (dP * D)^T x, then
    `_combine_rows` as in `_gram_bwd_kernel`; for dg, each row's sums over K of dG without its -Kg * dKg term
    (rest) and of Kg * dKg (kgd), [C] each: dg_t = sum_{s >= t} rest_s + sum_{s < t} kgd_s + the chunk-end term
    (`gram_grads_scalar`). (The kgd terms cancel in dG's reverse cumsum; summed over K first, as fp32 sums they
    made dg 3-7x less accurate (CPU, fp32, gates at -5).)
    gram_dg: the Gram matrices' share of rest straight from them, rowsum(P) - colsum(P) with P = dM * M + dKK * KK
    (M = scale (q k^T) * D and KK = (k k^T) * D formed here, exact for bf16 inputs: bf16 products, fp32 sums), so
    dg takes nothing from the four products, which then only feed dq and dk (and may run in plain bf16)."""
    G, decay, G_end = gram.scalar_decay(g_ref)
    dM, dKK = dm_ref[...] * decay, dkk_ref[...] * decay
    rest = kgd = jnp.zeros((k_ref.shape[0],), f32)
    if gram_dg:  # its own pass over the K tiles first, so that its two [C, C] sums are not live beside the rest
        gram_prec = "ieee" if prec == "ieee" else "bf16"  # (bf16 inputs: exact products, fp32 accumulation)
        qk = kk_ = jnp.zeros((k_ref.shape[0],) * 2, f32)
        for t in range(k_ref.shape[-1] // bk):
            d = pl.ds(t * bk, bk)
            qk = qk + dot(q_ref[:, d], k_ref[:, d], gram_prec, trans_b=True)
            if delta:  # (the additive write has no KK)
                kk_ = kk_ + dot(k_ref[:, d], k_ref[:, d], gram_prec, trans_b=True)
        P = scale * dM * qk + (dKK * kk_ if delta else 0.0)
        rest = jnp.sum(P, axis=1) - jnp.sum(P, axis=0)
    for t in range(k_ref.shape[-1] // bk):
        d = pl.ds(t * bk, bk)
        q_in, k_in = q_ref[:, d], k_ref[:, d]  # (as given: exact right operands for "bf16x2")
        xq, xk = dot(dM, k_in, prec), dot(dKK, k_in, prec)
        kq, kk = scale * dot(dM, q_in, prec, trans_a=True), dot(dKK, k_in, prec, trans_a=True)
        q, k = q_in.astype(f32), k_in.astype(f32)
        dq, dk, dG, kg_dkg = _combine_rows(q, k, G, G_end, dqin_ref[:, d], dkg_ref[:, d],
                                           dkin_ref[:, d] if delta else None, xq, xk, kq, kk, scale, kg_term=False,
                                           gram_terms=not gram_dg)
        dq_ref[:, d] = dq.astype(dq_ref.dtype)
        dk_ref[:, d] = dk.astype(dk_ref.dtype)
        rest, kgd = rest + jnp.sum(dG, axis=1), kgd + jnp.sum(kg_dkg, axis=1)
    rest_ref[...], kgd_ref[...] = rest, kgd


def gram_grads_scalar(q, k, g, dM, dKK, dQin, dKg, dKin, dend, ddend, *, C, scale, exact, interpret, delta=True):
    """dq, dk [B, Tp, H, K] and dg [B, H, Tp] fp32 for a gate equal across K (g [B, Tp, H] fp32, the scalar log
    gate), from `gram_grads_fused`'s inputs and e^(G_C) and its cotangent [B, H, K, N]: `_gram_scalar_bwd_kernel`,
    then dg's in-chunk sums on [B, H, N, C] (small: XLA's)."""
    B, Tp, H, K = q.shape
    N = Tp // C
    tok = pl.BlockSpec((None, C, None, K), lambda b, h, n: (b, n, h, 0))
    chunk = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, n, 0))
    row = pl.BlockSpec((None, None, C), lambda b, h, n: (b, h, n))
    dq, dk, rest, kgd = pallas_call(
        functools.partial(_gram_scalar_bwd_kernel, C=C, scale=scale, prec="ieee" if exact else GRADS_SCALAR_PREC,
                          delta=delta, bk=min(GRADS_SCALAR_BK, K), gram_dg=GRADS_SCALAR_GRAM_DG),
        grid=(B, H, N),
        in_specs=[tok, tok, pl.BlockSpec((None, C, None), lambda b, h, n: (b, n, h)), chunk(C), chunk(C),
                  chunk(K), chunk(K), chunk(K)],
        out_specs=[tok, tok, row, row],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, K), q.dtype), jax.ShapeDtypeStruct((B, Tp, H, K), k.dtype),
                   jax.ShapeDtypeStruct((B, H, Tp), f32), jax.ShapeDtypeStruct((B, H, Tp), f32)],
        compiler_params=compiler_params(num_warps=GRADS_SCALAR_WARPS, num_stages=1), interpret=interpret,
        name="lineattn_gram_bwd_scalar",
    )(q, k, g, dM, dKK, dQin, dKg, dKin)
    rest, kgd = rest.reshape(B, H, N, C), kgd.reshape(B, H, N, C)
    end = jnp.sum(dend * ddend, axis=2)[..., None]  # [B, H, N, 1]
    dg = jax.lax.cumsum(rest, axis=3, reverse=True) + (jnp.cumsum(kgd, axis=3) - kgd) + end
    return dq, dk, dg.reshape(B, H, Tp)


# ---- `backward_fast`: the backward as kernels only ----
# gate cumsum kernel -> Gram rows -> whole-tile solve writing R (both skipped with the forward's saved terms) ->
# the three state passes -> `_wy_bwd_kernel` (the WY part: dv, dbeta, dKK = Diag(b) dA, dKin, one program per
# chunk) -> `_gram_bwd_kernel` (dq, dk, dG) -> `_dg_kernel` (dg, the in-chunk reverse cumsum; written in the
# inputs' [B, T, H, .] layout); for a gate equal across K, `_gram_scalar_bwd_kernel` gives dq, dk and dG's sums over
# K for dg. What XLA still does: padding, small reshapes and (a scalar gate) dg's in-chunk sums on [B, H, N, C].
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


def _combine_rows(q, k, G, G_end, dQin, dKg, dKin, xq, xk, kq, kk, scale, kg_term=True, gram_terms=True):
    """The row-local part of the combine, for rows of q, k, G (fp32) and their cotangent terms: (dq, dk, dG,
    Kg * dKg). dG is the gradient with respect to the in-chunk cumsum G, without the chunk-end term (and, without
    kg_term, without its -Kg * dKg; without gram_terms, without the Gram matrices' share, which the scalar kernel
    then takes from the matrices themselves); dKin is None for the additive write."""
    dQin, dKg = dQin.astype(f32), dKg.astype(f32)
    eG, eGk = exp(G), exp(G_end - G)
    gq = eG * dQin + xq  # the cotangent of scale * q e^G, through Qin and M
    Kg = k * eGk
    dk = eGk * dKg + kq + xk + kk
    dG = scale * q * (gq if gram_terms else eG * dQin) - (Kg * dKg if kg_term else 0.0)
    if gram_terms:
        dG = dG - k * kq + k * xk - k * kk
    if dKin is not None:
        dKin = dKin.astype(f32)
        dk = dk + eG * dKin
        dG = dG + k * eG * dKin
    return scale * gq, dk, dG, Kg * dKg


def _reverse_cumsum_rows(dG, dG_end):
    """dg = the in-chunk reverse cumsum of dG [C, bk] with dG_end [1, bk] added to its last row (so to every row's
    dg)."""
    dG = dG + jnp.where(iota((dG.shape[0], 1), 0) == dG.shape[0] - 1, dG_end, 0.0)
    return jnp.sum(dG, axis=0)[None, :] - jnp.cumsum(dG, axis=0) + dG


def _dg_kernel(dG_ref, r_ref, dend_ref, ddend_ref, dg_ref):
    """dg for one chunk and K tile from dG and the 16-row blocks' sums of Kg * dKg (`_gram_bwd_kernel` with
    combine)."""
    dG_end = jnp.sum(r_ref[...], axis=0)[None, :] + dend_ref[...][None, :] * ddend_ref[...][None, :]
    dg_ref[...] = _reverse_cumsum_rows(dG_ref[...], dG_end).astype(dg_ref.dtype)


def backward_fast(q, k, v, g, beta, h0, do, dht, *, scale: float, chunk_size: int, interpret=None,
                  gram_warps: int = 2, grads_warps: int | None = None, saved=None):
    """The VJP of `chunk_fwd.forward`: (dq, dk, dv, dg, dbeta, dh0), every chunk-parallel stage a Pallas kernel
    (see the comment above); do [B, T, H, V] and dht [B, H, K, V] are the cotangents of o and the final state.
    saved: `chunk_fwd.forward(..., save=True)`'s terms (backward "kernels-saved"): no Gram recompute and no solve
    here, and the state passes read the stored (bf16 for bf16 inputs) Qin, Kg, M, W, U; where saved holds the
    gate's cumsum G, g is read for its rank and dtype only (`chunk.chunk_pallas` then keeps an empty stand-in).
    g [B, T, H] (a gate equal across K) takes the scalar Gram kernels (`gram.gram_scalar`,
    `gram_grads_scalar`) and gets dg [B, T, H]."""

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
    grads_split = GRADS_SPLIT and gram.split_gram(scalar, delta)
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
        return cut(dq), cut(dk), cut(dv), cut(jnp.moveaxis(dg, 1, 2).astype(g.dtype)), cut(dbeta), dh0.astype(h0.dtype)
    dq, dk, dG, kg_dkg = gram_grads_fused(*grads, C=C, scale=scale, exact=exact, interpret=interpret,
                                          warps=grads_warps or GRADS_WARPS, delta=delta, bk=GRADS_BK,
                                          flags=flags if grads_split else None)
    bk = min(K, DG_BK)  # K tiles: the reverse cumsum is independent per channel
    ktok = pl.BlockSpec((None, C, None, bk), lambda b, h, n, t: (b, n, h, t))
    kchunk = pl.BlockSpec((None, None, C, bk), lambda b, h, n, t: (b, h, n, t))
    kn = pl.BlockSpec((None, None, bk, None), lambda b, h, n, t: (b, h, t, n))
    nr = kg_dkg.shape[2] // N  # rows of Kg * dKg column sums per chunk (the 16-row blocks)
    dg = pallas_call(
        _dg_kernel, grid=(B, H, N, K // bk),
        in_specs=[kchunk, pl.BlockSpec((None, None, nr, bk), lambda b, h, n, t: (b, h, n, t)), kn, kn],
        out_specs=ktok, out_shape=jax.ShapeDtypeStruct((B, Tp, H, K), g.dtype),
        compiler_params=compiler_params(num_warps=DG_WARPS, num_stages=1), interpret=interpret,
        name="lineattn_chunk_bwd_dg",
    )(dG, kg_dkg, dend_KN, ddend_KN)
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
