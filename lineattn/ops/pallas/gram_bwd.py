"""The Gram stage's backward: dq, dk and dG (the gradient with respect to the in-chunk cumsum G) from the cotangents
of the Gram matrices M, KK and of the gated rows Qin, Kg, Kin (the forward's `gram`; see
../shared/CHUNK_ALGORITHM.md, "Backward").

  - `gram_grads_fused` (a per-channel gate): one program per 16-row block, its row side and the column side of its
    column block, factored through the block's middle row as the forward's Gram kernel (exact path where a row lies
    beyond LIMIT nats of it); GRADS_SPLIT: the fast path everywhere, then the flagged chunks rewritten exactly;
  - `gram_grads_scalar` (a gate equal across K): one program per chunk, the decay factored out of the products; also
    gives dg.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.pallas import common, gram
from lineattn.ops.pallas.common import SUB, compiler_params, dot, exp, iota, pallas_call
from lineattn.ops.pallas.gram import LIMIT, _gram_block_spread, keys_toward

f32 = jnp.float32
# GRADS_WARPS: the Gram-gradient kernel's warps (read when a call is traced; H200 sweep, run7e: 2 or 8 warps
# 3.62 / 2.63 ms against 1.62 with 4).
GRADS_WARPS = 4
# The Gram gradients' K tile (run10b, 8 x 4096: 1.87 ms with 128 against 2.05 with 64 and 3.18 with 32).
GRADS_BK = 128
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
