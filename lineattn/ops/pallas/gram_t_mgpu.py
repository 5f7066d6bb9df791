"""A Mosaic GPU Gram kernel in key-major orientation: each chunk's M^T and A^T (a prototype to time).

One CTA (one warpgroup) per (batch, head, chunk). For each 16-row block a (reference row r_a, its middle row) the keys
toward r_a, k e^(min(G_ra - G, limit)) [C, bk], are the wgmma's left operand (from registers: all C rows are
wanted), and block a's own rows, x e^(G - G_ra) for x = scale q and k [16, bk], its right operand (SMEM): a product
[C keys, 16 rows] per block instead of [C rows, C keys] with three blocks of rows zero. The result is M and A
transposed within each chunk (row j a key, column i a query). Products as bf16 hi + lo parts (three wgmmas).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lineattn.ops.pallas.common import SUB, interpret_mode, split_bf16
from lineattn.ops.pallas.solve_mgpu import _copy_in, _interpret_params, _load, _smem, math_params

f32, bf16 = jnp.float32, jnp.bfloat16
_WG = plgpu.Layout.WGMMA
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column of a WGMMA-layout array
LHS_REGS = True
WHOLE_CHUNK = False  # load every channel tile of q, k, G at once (more SMEM) instead of one tile at a time


def gram_keys_major(q, k, G, beta, *, C, scale, limit, interpret: bool | None = None):
    """(MT, AT [B, H, Tp, C]: per chunk M^T (bf16) and A^T (fp32), row j a key and column i a query; Qin, Kg, Kin
    [B, H, Tp, K] bf16) from q, k [B, Tp, H, K] bf16, G [B, Tp, H, K] fp32, beta [B, Tp, H]; the fast path in every
    block (chunk 64, K a multiple of 64)."""
    B, Tp, H, K = k.shape
    N, nb = Tp // C, C // SUB
    bk = 64
    nt = K // bk
    if C != 64 or K % 64 or q.dtype != bf16 or k.dtype != bf16:
        raise ValueError(f"gram_keys_major takes bf16 q, k, chunk 64 and K a multiple of 64, got {q.dtype}, C={C}, "
                         f"K={K}")
    beta_BHT = jnp.moveaxis(beta.astype(f32), 1, 2)
    regs = LHS_REGS and not interpret_mode(interpret)
    ref_rows = [a * SUB + SUB // 2 for a in range(nb)] + [C - 1]

    def body(q_g, k_g, G_g, b_g, mt_g, at_g, qin_g, kg_g, kin_g, tile_u, gref_s, b_s, x_s, *rest):
        (q_all, k_all, G_all), (mt_s, at_s) = tile_u  # (the inputs, then the transposed Gram blocks)
        tiles = nt if WHOLE_CHUNK else 1
        keys_s, (bar_rows, bar_tile) = (None, rest) if regs else (rest[0], rest[1:])
        b, h, n = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("n")
        rows = pl.ds(n * C, C)
        cols = lambda t: pl.ds(t * bk, bk)
        block = plgpu.broadcasted_iota(jnp.int32, (C, bk), 0, layout=_WG) // SUB
        G_row = lambda a, t: jax.lax.broadcast_in_dim(
            plgpu.load(gref_s.at[a, cols(t)], layout=_COL, optimized=False), (C, bk), [1])
        copies = [(b_g.at[b, h, rows], b_s)]
        copies += [(G_g.at[b, pl.ds(n * C + r, 1), h], gref_s.at[pl.ds(i, 1)]) for i, r in enumerate(ref_rows)]
        _copy_in(copies, bar_rows.at[0])

        def products(*accs):
            acc_m, acc_a = accs[:nb], accs[nb:]
            for t in range(nt):
                if WHOLE_CHUNK and t == 0:
                    _copy_in([(x_g.at[b, rows, h, cols(u)], x_s_.at[u]) for x_g, x_s_ in ((q_g, q_all), (k_g, k_all),
                                                                                         (G_g, G_all))
                              for u in range(nt)], bar_tile.at[0])
                elif not WHOLE_CHUNK:
                    _copy_in([(x_g.at[b, rows, h, cols(t)], x_s_.at[0]) for x_g, x_s_ in ((q_g, q_all), (k_g, k_all),
                                                                                         (G_g, G_all))],
                             bar_tile.at[0])
                q_s, k_s, G_s = (x_s_.at[t % tiles] for x_s_ in (q_all, k_all, G_all))
                G_ = _load(G_s)
                Gm = G_row(0, t)
                for a in range(1, nb):
                    Gm = jnp.where(block == a, G_row(a, t), Gm)
                own = jnp.exp(jnp.minimum(G_ - Gm, limit))  # every row toward its own block's middle row
                kf = _load(k_s).astype(f32)
                parts = (*split_bf16(_load(q_s).astype(f32) * (scale * own)), *split_bf16(kf * own))
                for p, part in enumerate(parts):
                    x_s.at[p][...] = part
                plgpu.commit_smem()
                for a in range(nb):
                    keys = split_bf16(kf * jnp.exp(jnp.minimum(G_row(a, t) - G_, limit)))
                    if not regs:  # two slots: block a - 1's six products may still read the other
                        plgpu.wgmma_wait(6)
                        for p, part in enumerate(keys):
                            keys_s.at[a % 2, p][...] = part
                        plgpu.commit_smem()
                        keys = (keys_s.at[a % 2, 0], keys_s.at[a % 2, 1])
                    x = lambda p: x_s.at[p, pl.ds(a * SUB, SUB)].transpose((1, 0))
                    for acc, hi, lo in ((acc_m[a], x(0), x(1)), (acc_a[a], x(2), x(3))):
                        for lhs, rhs in ((keys[0], hi), (keys[0], lo), (keys[1], hi)):
                            plgpu.wgmma(acc, lhs, rhs)
                plgpu.wgmma_wait(0)
                # the gated outputs of tile t (into x_s, free again): Qin = scale q e^G, Kg = k e^(G_C - G), Kin = k e^G
                eG = jnp.exp(G_)
                x_s.at[0][...] = (_load(q_s).astype(f32) * (scale * eG)).astype(bf16)
                x_s.at[1][...] = (kf * jnp.exp(G_row(nb, t) - G_)).astype(bf16)
                x_s.at[2][...] = (kf * eG).astype(bf16)
                plgpu.commit_smem()
                for p, o_g in enumerate((qin_g, kg_g, kin_g)):
                    plgpu.copy_smem_to_gmem(x_s.at[p], o_g.at[b, h, rows, cols(t)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            jj = plgpu.broadcasted_iota(jnp.int32, (C, SUB), 0, layout=_WG)
            for a in range(nb):
                ii = plgpu.broadcasted_iota(jnp.int32, (C, SUB), 1, layout=_WG) + a * SUB
                beta_i = jax.lax.broadcast_in_dim(
                    plgpu.load(b_s.at[pl.ds(a * SUB, SUB)], layout=_COL, optimized=False), (C, SUB), [1])
                mt_s.at[a][...] = jnp.where(jj <= ii, acc_m[a][...], 0.0).astype(bf16)
                at_s.at[a][...] = jnp.where(jj < ii, beta_i * acc_a[a][...], 0.0)
            plgpu.commit_smem()
            for a in range(nb):
                plgpu.copy_smem_to_gmem(mt_s.at[a], mt_g.at[b, h, rows, pl.ds(a * SUB, SUB)])
                plgpu.copy_smem_to_gmem(at_s.at[a], at_g.at[b, h, rows, pl.ds(a * SUB, SUB)])
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(products, *[plgpu.ACC((C, SUB), f32) for _ in range(2 * nb)])

    # SMEM: the tile's q, k, G (32 KB; then the transposed blocks, 24 KB), the reference rows of G and beta (4 KB),
    # the right operands' parts (32 KB; then the gated outputs); with the left operands from SMEM their two slots of
    # parts (32 KB): 68 KB or 100 KB a CTA.
    tiles = nt if WHOLE_CHUNK else 1
    scratch = [plgpu.RefUnion((_smem((tiles, C, bk), bf16), _smem((tiles, C, bk), bf16), _smem((tiles, C, bk), f32)),
                              (plgpu.SMEM((nb, C, SUB), bf16), plgpu.SMEM((nb, C, SUB), f32))),
               plgpu.SMEM((8, K), f32), plgpu.SMEM((C,), f32), _smem((4, C, bk), bf16)]
    scratch += [] if regs else [_smem((2, 2, C, bk), bf16)]
    scratch += [plgpu.Barrier(num_arrivals=len(ref_rows) + 1, num_barriers=1),
                plgpu.Barrier(num_arrivals=3 * tiles, num_barriers=1)]
    mat = lambda D, dt: jax.ShapeDtypeStruct((B, H, Tp, D), dt)
    out = [mat(C, bf16), mat(C, f32), mat(K, bf16), mat(K, bf16), mat(K, bf16)]
    kernel = plgpu.kernel(body, out_type=out, scratch_types=scratch, grid=(B, H, N), grid_names=("b", "h", "n"),
                          interpret=_interpret_params(interpret), compiler_params=math_params(),
                          kernel_name="lineattn_gram_keys_major")
    return kernel(q, k, G, beta_BHT)


def chunk_transpose(X):
    """X [B, H, Tp, C] with each chunk's [C, C] block transposed."""
    B, H, Tp, C = X.shape
    return jnp.swapaxes(X.reshape(B, H, Tp // C, C, C), -1, -2).reshape(B, H, Tp, C)
