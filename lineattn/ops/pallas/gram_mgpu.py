"""The forward's Gram and solve stages fused in one Mosaic GPU kernel (wgmma, TMA; Hopper), in place of
`chunk_fwd.gram_rows` + the solve where `chunk_fwd.GRAM_IMPL` picks it ("mosaic").

One CTA (one warpgroup) per (batch, head, chunk): q, k, G, beta come in by TMA; the gated Gram matrices
    A_ij = k_i . k_j e^(G_i - G_j) (j < i),   M_ij = scale q_i . k_j e^(G_i - G_j) (j <= i)
by the reference-point trick of `chunk_fwd._gram_products` (each 16-row block a through its middle row r_a, factors
clamped at e^limit): for each a, the keys toward r_a, R_a = k e^(min(G_ra - G, limit)) (bf16 hi + lo parts in
SMEM, KEYS_SPLIT) and the rows of block a from r_a, L_a = x e^(min(G - G_ra, limit)) (bf16 hi + lo parts in
registers, the other rows zero),
accumulate A += (L_a^k) R_a^T and M += (L_a^q) R_a^T on the tensor cores (wgmma takes 64 rows, so each product
spans the whole chunk with three blocks zero). Then Qin = scale q e^G, Kg = k e^(G_C - G), and the solve of
`solve_mgpu` on A = Diag(beta) KK: R = (I + A)^-1 by block doubling, W = R Diag(beta) k e^G, U = R Diag(beta) v.

Like GRAM_IMPL "triton-fast", the kernel takes the fast path in every block: the chunks that the gate-cumsum kernel
flags (a 16-row block spread beyond `chunk_fwd.LIMIT` nats) are recomputed exactly afterwards by `gram_exact_chunks`
and `chunk_fwd.solve_full(flags=...)` (KK is written for them: with save for every chunk, else only their rows are
read).

Opt-in: exact, but no faster than the two kernels it replaces (H200, 8 x 4096 x 16 x 128, run19a-b: 1.19 ms against
0.725 + 0.404; 2.66 with the accurate exps, run18e). Without a GPU it runs in the Mosaic GPU interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lineattn.ops.pallas.common import SUB, interpret_mode, split_bf16
from lineattn.ops.pallas.solve_mgpu import (_ROW, _copy_in, _interpret_params, _load, _smem, invert_and_apply,
                                            math_params, operand_buffers)

f32, bf16 = jnp.float32, jnp.bfloat16
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column of a WGMMA-layout array
# LHS_REGS: the Gram products' left operands (the bf16 parts of L_a) from registers; the interpreter takes SMEM
# operands only (read when a call is traced).
LHS_REGS = True
# KEYS_SPLIT: the keys toward each reference row, R_a, as bf16 hi + lo parts too (three products a term, as the
# solve's bf16x3: about 16 mantissa bits); False: R_a rounded to bf16 (two products; CPU, T = 128, K = 64: KK's
# relative RMS error 1.8e-3 against an fp64 reference).
KEYS_SPLIT = True
# GBK: the channel tile of the Gram's elementwise work and products (each tile's arrays and SMEM buffers apart:
# fewer registers live; H200 run18b: with 128, 255 registers a thread and 206 M spill requests, 8.2 ms).
# OVERLAP: form the next tile's operands while the last products run (more registers live).
GBK, OVERLAP = 64, False
# LOOP: how the Gram's steps (row block a, channel tile t) are emitted: "none" all unrolled in Python (3.6 ms in
# run18c; run18d's Nsight Compute reading: no spills at 250 registers, but warps stalled 8.5 of every 12.5 cycles
# waiting for an instruction fetch), "blocks" a `fori_loop` over the row blocks (2.66 ms, run18e), "steps" one over
# every (a, t). With APPROX_MATH (run19a-b): "blocks" 1.167 ms (1.607 with save, as in fwd+bwd), "steps" 1.186
# (1.196 with save), "none" 2.90. "tiles": a loop over the channel tiles, each forming L's parts for all rows once
# (each row toward its own block's middle row: a quarter of the per-step exps and splits), then a loop over the row
# blocks that selects block a's rows of them (more registers live): 1.177 ms in run20a (1.203 with save), no faster.
LOOP = "steps"


def gram_solve_mosaic(q, k, v, G, beta, *, C, scale, limit, save=False, interpret: bool | None = None):
    """(M [B, H, Tp, C], KK [B, H, Tp, C] fp32, Qin, Kg, W [B, H, Tp, K], U [B, H, Tp, V]) and, with save, R
    [B, H, Tp, C] fp32; the bf16 terms in bf16. KK is the unscaled key Gram (strictly lower), written only with
    save. q, k [B, Tp, H, K], v [B, Tp, H, V] bf16, G [B, Tp, H, K] fp32 (in-chunk cumsum), beta [B, Tp, H];
    chunk 64, K and V multiples of 64; limit: the fast path's clamp in nats (`chunk_fwd.LIMIT`, which the flags of
    the chunks left to the fix-ups are against)."""
    B, Tp, H, K = k.shape
    V, N = v.shape[-1], Tp // C
    if q.dtype != bf16 or k.dtype != bf16 or v.dtype != bf16:
        raise ValueError(f"gram_solve_mosaic takes bf16 q, k, v, got {q.dtype}, {k.dtype} and {v.dtype}")
    if C != 64 or K % 64 or V % 64:
        raise ValueError(f"gram_solve_mosaic takes chunk_size 64 and K, V multiples of 64, got {C}, {K} and {V}")
    if G.shape != k.shape or G.dtype != f32:
        raise ValueError(f"G must be fp32 {k.shape}, got {G.dtype} {G.shape}")
    beta_BHT = jnp.moveaxis(beta.astype(f32), 1, 2)  # [B, H, Tp]: each chunk's beta contiguous for its TMA copy
    regs = LHS_REGS and not interpret_mode(interpret)

    bk = min(GBK, K)
    nt = K // bk  # channel tiles: each [C, bk] array in registers, each tile a slice [t] of stacked SMEM buffers
    if LOOP not in ("none", "blocks", "steps", "tiles"):
        raise ValueError(f"gram_mgpu.LOOP must be 'none', 'blocks', 'steps' or 'tiles', got {LOOP!r}")

    def body(q_g, k_g, v_g, G_g, b_g, m_g, kk_g, qin_g, kg_g, w_g, u_g, *rest):
        r_g = rest[0] if save else None
        q_s, k_s, b_s, m_s, (kk_s, rlo_s), bar, bar_v = rest[int(save):]
        b, h, n = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("n")
        rows = pl.ds(n * C, C)
        cols = lambda t: pl.ds(t * bk, bk)
        by_row = lambda D: jax.lax.broadcast_in_dim(plgpu.load(b_s, layout=_ROW), (C, D), [0])
        block = plgpu.broadcasted_iota(jnp.int32, (C, bk), 0, layout=plgpu.Layout.WGMMA) // SUB
        i = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=plgpu.Layout.WGMMA)
        j = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=plgpu.Layout.WGMMA)
        ref_rows = [a * SUB + SUB // 2 for a in range(C // SUB)] + [C - 1]  # the reference rows, then G_C's

        def gram(gref_s, G_s, r_s, *l_bufs):
            copies = [(x_g.at[b, rows, h, cols(t)], x_s.at[t]) for x_g, x_s in ((q_g, q_s), (k_g, k_s), (G_g, G_s))
                      for t in range(nt)]
            copies += [(b_g.at[b, h, rows], b_s)]  # and the rows that broadcast, each into a plain SMEM row
            copies += [(G_g.at[b, pl.ds(n * C + r, 1), h], gref_s.at[pl.ds(t, 1)]) for t, r in enumerate(ref_rows)]
            _copy_in(copies, bar.at[0])
            G_row = lambda a, t: jax.lax.broadcast_in_dim(
                plgpu.load(gref_s.at[a, cols(t)], layout=_COL, optimized=False), (C, bk), [1])

            def products(acc_m, acc_a):
                def row_operands(toward, kf, t):
                    """The bf16 parts of L^k = kf toward and L^q = scale q toward [C, bk] (kf: tile t's keys, fp32)."""
                    return (*split_bf16(kf * toward), *split_bf16(_load(q_s.at[t]).astype(f32) * (scale * toward)))

                def own_operands(t):  # every row toward its own block's middle row (LOOP "tiles")
                    G_ref_rows = G_row(0, t)
                    for a in range(1, C // SUB):
                        G_ref_rows = jnp.where(block == a, G_row(a, t), G_ref_rows)
                    toward = jnp.exp(jnp.minimum(_load(G_s.at[t]) - G_ref_rows, limit))
                    return row_operands(toward, _load(k_s.at[t]).astype(f32), t)

                def step(a, t, own=None):  # row block a, channel tile t (static or traced); own: own_operands(t)
                    if not OVERLAP:
                        plgpu.wgmma_wait(0)  # (a no-op when nothing is in flight)
                    # (in this order, few [C, bk] arrays live at once: the keys leave for SMEM first)
                    Gr, G_ = G_row(a, t), _load(G_s.at[t])
                    kf = _load(k_s.at[t]).astype(f32)
                    keys = kf * jnp.exp(jnp.minimum(Gr - G_, limit))
                    keys = split_bf16(keys) if KEYS_SPLIT else (keys.astype(bf16),)
                    if OVERLAP:  # the last block's products on this tile have read its buffers
                        plgpu.wgmma_wait(6 * (nt - 1) if KEYS_SPLIT else 4 * (nt - 1))
                    for buf, part in zip((r_s.at[t], rlo_s.at[t]), keys):
                        buf[...] = part
                    if own is None:
                        parts = row_operands(jnp.where(block == a, jnp.exp(jnp.minimum(G_ - Gr, limit)), 0.0), kf, t)
                    else:  # (block a's rows of them; the same numbers)
                        parts = tuple(jnp.where(block == a, part, 0.0) for part in own)
                    if not regs:
                        for p, part in enumerate(parts):
                            l_bufs[0].at[t, p][...] = part
                        parts = [l_bufs[0].at[t, p] for p in range(4)]
                    plgpu.commit_smem()
                    hi, lo = r_s.at[t].transpose((1, 0)), rlo_s.at[t].transpose((1, 0))
                    for acc, x_hi, x_lo in ((acc_a, parts[0], parts[1]), (acc_m, parts[2], parts[3])):
                        for lhs, rhs in ((x_hi, hi), (x_lo, hi)) + (((x_hi, lo),) if KEYS_SPLIT else ()):
                            plgpu.wgmma(acc, lhs, rhs)

                def block_steps(a, carry):
                    for t in range(nt):
                        step(a, t)
                    return carry

                def one_step(s, carry):
                    step(s // nt, s % nt)
                    return carry

                def tile_steps(t, carry):
                    own = own_operands(t)

                    def own_block(a, carry):
                        step(a, t, own)
                        return carry

                    return jax.lax.fori_loop(0, nb, own_block, carry)

                nb = C // SUB
                if LOOP == "tiles":
                    jax.lax.fori_loop(0, nt, tile_steps, 0)
                elif LOOP == "steps":
                    jax.lax.fori_loop(0, nb * nt, one_step, 0)
                elif LOOP == "blocks":
                    jax.lax.fori_loop(0, nb, block_steps, 0)
                else:
                    for a in range(nb):
                        block_steps(a, 0)
                plgpu.wgmma_wait(0)
                return acc_m[...], acc_a[...]

            Mx, KKx = pl.run_scoped(products, plgpu.ACC((C, C), f32), plgpu.ACC((C, C), f32))
            KK = jnp.where(j < i, KKx, 0.0)
            for t in range(nt):  # Kg (into r_s, free again), Kin = Diag(beta) k e^G (for W), Qin
                G_ = _load(G_s.at[t])
                kf, eG = _load(k_s.at[t]).astype(f32), jnp.exp(G_)
                r_s.at[t][...] = (kf * jnp.exp(G_row(C // SUB, t) - G_)).astype(bf16)
                k_s.at[t][...] = (by_row(bk) * kf * eG).astype(bf16)
                q_s.at[t][...] = (_load(q_s.at[t]).astype(f32) * (scale * eG)).astype(bf16)
            m_s[...] = jnp.where(j <= i, Mx, 0.0).astype(bf16)
            if save:
                kk_s[...] = KK
            plgpu.commit_smem()
            for t in range(nt):
                plgpu.copy_smem_to_gmem(r_s.at[t], kg_g.at[b, h, rows, cols(t)])
            outs = [(q_s.at[t], qin_g.at[b, h, rows, cols(t)]) for t in range(nt)] + [(m_s, m_g.at[b, h, rows])]
            outs += [(kk_s, kk_g.at[b, h, rows])] if save else []
            for src, dst in outs:
                plgpu.copy_smem_to_gmem(src, dst)
            plgpu.wait_smem_to_gmem(len(outs), wait_read_only=True)  # Kg's copies have read r_s (freed here)
            return by_row(C) * KK

        l_bufs = [] if regs else [_smem((nt, 4, C, bk), bf16)]
        A_ = pl.run_scoped(gram, plgpu.SMEM((8, K), f32), _smem((nt, C, bk), f32), _smem((nt, C, bk), bf16),
                           *l_bufs)

        def solve(v_s, *sq):
            plgpu.copy_gmem_to_smem(v_g.at[b, rows, h], v_s, bar_v.at[0])  # (in flight during the doubling)

            def scale_v():
                plgpu.barrier_wait(bar_v.at[0])
                v_s[...] = (by_row(V) * _load(v_s).astype(f32)).astype(bf16)

            X = invert_and_apply(A_, [k_s.at[t] for t in range(nt)] + [v_s], sq, regs, before_apply=scale_v)
            plgpu.commit_smem()
            for t in range(nt):
                plgpu.copy_smem_to_gmem(k_s.at[t], w_g.at[b, h, rows, cols(t)])
            plgpu.copy_smem_to_gmem(v_s, u_g.at[b, h, rows])
            if save:
                plgpu.wait_smem_to_gmem(nt + 1, wait_read_only=True)  # KK's copy has read kk_s, which now takes R
                kk_s[...] = X
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(kk_s, r_g.at[b, h, rows])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(solve, _smem((C, V), bf16), *operand_buffers(C, regs))

    # SMEM at K = V = 128 (LHS_REGS): q (then Qin), k (then Kin, W), M, KK (then R; with save) and beta throughout,
    # 57 KB; the Gram's G (fp32), its reference rows and R_a (then Kg), 52 KB; then v (then U) and the doubling's
    # operands, 32 KB: 110 KB at the most, two CTAs per SM on the H200.
    scratch = [_smem((nt, C, bk), bf16), _smem((nt, C, bk), bf16), plgpu.SMEM((C,), f32), _smem((C, C), bf16),
               plgpu.RefUnion(_smem((C, C), f32), _smem((nt, C, bk), bf16)),
               plgpu.Barrier(num_arrivals=3 * nt + 6, num_barriers=1), plgpu.Barrier(num_arrivals=1, num_barriers=1)]
    mat = lambda D, dt: jax.ShapeDtypeStruct((B, H, Tp, D), dt)
    out = [mat(C, bf16), mat(C, f32), mat(K, bf16), mat(K, bf16), mat(K, bf16), mat(V, bf16)]
    out += [mat(C, f32)] if save else []
    kernel = plgpu.kernel(body, out_type=out, scratch_types=scratch, grid=(B, H, N), grid_names=("b", "h", "n"),
                          interpret=_interpret_params(interpret), compiler_params=math_params(),
                          kernel_name="lineattn_gram_solve_mosaic")
    return kernel(q, k, v, G, beta_BHT)
