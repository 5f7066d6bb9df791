"""The forward's Gram stage for a per-channel gate as a Mosaic GPU kernel (wgmma on Hopper): an experimental
alternative to `chunk_fwd.gram_rows` (Triton), chosen by `chunk_fwd.GRAM_IMPL = "mosaic"`.

wgmma multiplies 64 rows at a time, so the reference point is taken per 16-COLUMN block c (its middle row r)
instead of per 16-row block: for all 64 rows i of the chunk and the keys j of block c,

    P_ij = sum_d (x_id e^(min(G_id - G_rd, 40))) (k_jd e^(min(G_rd - G_jd, 40)))

with x = scale q (M) or k (A). Rows i >= j below the block have G_i - G_r <= 0 and keys inside it |G_r - G_j| <=
40 when the block's spread (max |G_j - G_r|) is at most LIMIT = 40 nats (always for gates >= -5 per token), so
nothing overflows; rows above the block are clamped, finite and masked away. A chunk with a block beyond LIMIT (a
cut or reset gate) is recomputed exactly by `chunk_fwd.gram_exact_chunks` (Triton), so gates down to -1000 stay
exact. Operands are bf16 (the Triton kernel's products take TF32: see `chunk_fwd.GRAM_PREC`), accumulation fp32.
One CTA (one warpgroup) per (batch, head, chunk); K in tiles of 64 columns. Without a GPU it runs in the Mosaic
GPU interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lineattn.ops.pallas.common import SUB
from lineattn.ops.pallas.solve_mgpu import _ROW, _WG, _copy_in, _interpret_params, _load, _smem

f32, bf16 = jnp.float32, jnp.bfloat16
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column of a WGMMA-layout array
LIMIT = 40.0
_BK = 64  # K tile


def gram_mosaic(q, k, G, beta, *, C, scale, interpret: bool | None = None):
    """M (bf16), A (fp32, = Diag(beta) KK strictly lower), Qin, Kg (bf16) as [B, H, Tp, .] from bf16 q, k [B, Tp,
    H, K], the in-chunk cumsum G [B, Tp, H, K] fp32 and beta [B, Tp, H] (`chunk_fwd.gram_rows`' outputs) by the
    Mosaic GPU kernel above: the fast path only (see `chunk_fwd.gram_exact_chunks` for the chunks beyond LIMIT).
    interpret: the Mosaic GPU interpreter (default: when no GPU is the default backend)."""
    B, Tp, H, K = q.shape
    N, nb = Tp // C, C // SUB
    if q.dtype != bf16 or k.dtype != bf16 or C != 64 or K % _BK:
        raise ValueError(f"gram_mosaic takes bf16 q, k, chunk 64 and K a multiple of {_BK}, got {q.dtype}, "
                         f"{k.dtype}, C={C}, K={K}")
    beta_BHT = jnp.moveaxis(beta.astype(f32), 1, 2)  # [B, H, Tp]
    # the reference rows (the middle row of every 16-row block) and the last row of every chunk: [B, H, N, nb+1, K]
    Gc = jnp.moveaxis(G.reshape(B, N, C, H, K), 3, 1)
    G_ref = jnp.concatenate([Gc[:, :, :, SUB // 2::SUB], Gc[:, :, :, C - 1:]], axis=3)

    def body(q_g, k_g, G_g, r_g, b_g, m_g, a_g, qin_g, kg_g, q_s, k_s, G_s, r_s, b_s, m_s, a_s, bar):
        b, h, n = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("n")
        rows = pl.ds(n * C, C)
        copies = ((q_g.at[b, rows, h], q_s), (k_g.at[b, rows, h], k_s), (G_g.at[b, rows, h], G_s),
                  (r_g.at[b, h, n], r_s), (b_g.at[b, h, rows], b_s))
        _copy_in(copies, bar.at[0])
        cols_of = lambda row, t: jax.lax.broadcast_in_dim(  # G's row `row` of r_s (K tile t) down all C rows
            plgpu.load(r_s.at[row, pl.ds(t * _BK, _BK)], layout=_COL), (C, _BK), [1])
        i = plgpu.broadcasted_iota(jnp.int32, (C, SUB), 0, layout=_WG)
        jj = plgpu.broadcasted_iota(jnp.int32, (C, SUB), 1, layout=_WG)
        beta_rows = jax.lax.broadcast_in_dim(plgpu.load(b_s, layout=_ROW), (C, SUB), [0])

        def column_block(c, xq_s, xk_s, kb_s):  # M and A's columns of block c, through its middle row
            def products(acc_m, acc_a):
                for t in range(K // _BK):
                    d = pl.ds(t * _BK, _BK)
                    qt, kt, Gt = _load(q_s.at[:, d]).astype(f32), _load(k_s.at[:, d]).astype(f32), _load(G_s.at[:, d])
                    Gr = cols_of(c, t)
                    down = jnp.exp(jnp.minimum(Gt - Gr, LIMIT))
                    xq_s[...] = (qt * (scale * down)).astype(bf16)
                    xk_s[...] = (kt * down).astype(bf16)
                    kb_s[...] = (kt * jnp.exp(jnp.minimum(Gr - Gt, LIMIT))).astype(bf16)
                    plgpu.commit_smem()
                    keys = plgpu.transpose_ref(kb_s.at[pl.ds(c * SUB, SUB)], (1, 0))  # [bk, 16]
                    plgpu.wgmma(acc_m, xq_s, keys)
                    plgpu.wgmma(acc_a, xk_s, keys)
                    plgpu.wgmma_wait(0)  # the operand buffers are rewritten by the next tile
                return acc_m[...], acc_a[...]

            Mc, Ac = pl.run_scoped(products, plgpu.ACC((C, SUB), f32), plgpu.ACC((C, SUB), f32))
            j = jj + c * SUB
            m_s[...] = jnp.where(j <= i, Mc, 0.0).astype(bf16)
            a_s[...] = jnp.where(j < i, beta_rows * Ac, 0.0)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(m_s, m_g.at[b, h, rows, pl.ds(c * SUB, SUB)])
            plgpu.copy_smem_to_gmem(a_s, a_g.at[b, h, rows, pl.ds(c * SUB, SUB)])
            plgpu.wait_smem_to_gmem(0)  # m_s, a_s are rewritten by the next block

        def all_blocks(xq_s, xk_s, kb_s):
            for c in range(nb):
                column_block(c, xq_s, xk_s, kb_s)

        pl.run_scoped(all_blocks, *[_smem((C, _BK), bf16) for _ in range(3)])
        for t in range(K // _BK):  # Qin = scale q e^G, Kg = k e^(G_C - G), in place of q and k
            d = pl.ds(t * _BK, _BK)
            Gt = _load(G_s.at[:, d])
            q_s[:, d] = (_load(q_s.at[:, d]).astype(f32) * (scale * jnp.exp(Gt))).astype(bf16)
            k_s[:, d] = (_load(k_s.at[:, d]).astype(f32) * jnp.exp(cols_of(nb, t) - Gt)).astype(bf16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_s, qin_g.at[b, h, rows])
        plgpu.copy_smem_to_gmem(k_s, kg_g.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    # SMEM: q, k (bf16, then Qin, Kg) 32 KB, G 32 KB, the reference rows 2.5 KB, three [C, 64] bf16 operand
    # buffers 24 KB and one column block of M and A 6 KB: about 97 KB at K = 128 (two CTAs per SM on the H200)
    scratch = [_smem((C, K), bf16), _smem((C, K), bf16), _smem((C, K), f32), plgpu.SMEM((nb + 1, K), f32),
               plgpu.SMEM((C,), f32), _smem((C, SUB), bf16), _smem((C, SUB), f32),
               plgpu.Barrier(num_arrivals=5, num_barriers=1)]
    mat = lambda D, dt: jax.ShapeDtypeStruct((B, H, Tp, D), dt)
    kernel = plgpu.kernel(body, out_type=[mat(C, bf16), mat(C, f32), mat(K, bf16), mat(K, bf16)],
                          scratch_types=scratch, grid=(B, H, N), grid_names=("b", "h", "n"),
                          interpret=_interpret_params(interpret), kernel_name="lineattn_gram_mosaic")
    return kernel(q, k, G, G_ref, beta_BHT)
