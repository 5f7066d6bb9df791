"""The intra-chunk Gram stage of the chunkwise forward (see ../shared/CHUNK_ALGORITHM.md): per chunk, the gated
Gram matrices M (queries x keys, j <= i) and A (keys x keys, j < i, times beta_i), and the gated rows Qin = scale q
e^G, Kg = k e^(G_C - G) (and Kin = k e^G) that the solve and the state pass read.

  - `gram_chunks` (a per-channel gate, GRAM_FORMS_G, the default): one program per chunk forms G, the in-chunk cumsum
    of the log gate, by a product with the triangle of ones, then every 16-row block's products through its middle
    row (the 16 x 16 sub-chunk reference-point trick: no exponent overflows while every row lies within LIMIT nats of
    it), and flags the chunks where some row does not;
  - `gram_exact_chunks`: rewrites the flagged chunks exactly (off-diagonal sub-blocks through the block's first row,
    diagonal ones pair by pair, masked before the exp): exact for any g <= 0, also -1000;
  - `gate_cumsum` and `gram_rows` (one program per 16-row block): the same from a precomputed G, for the 16-row
    form and the backward's recompute;
  - `gram_scalar`: a gate equal across K (GDN, DeltaNet), where the decay factors out of the products.

The kernels that read the raw log gate g (`gram_chunks`, `gate_cumsum`, `gram_scalar`) raise values below
`ops.LOG_GATE_FLOOR` to it on each tile they load (`gates.floor_gate`), so g comes in as the caller gave it: no XLA
pass over g before them (see `chunk.GATE_FLOOR`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.gates import floor_gate
from lineattn.ops.pallas import common
from lineattn.ops.pallas.common import SUB, compiler_params, dot, exp, iota, pallas_call, row_of

f32 = jnp.float32


# ---- The Gram rows: M, A, Qin, Kg ----
# `_gram_rows_kernel`: one program per (chunk, 16-row block a), K in tiles of `bk` channels, no column loop.
#   - fast path: when every row of block a is within LIMIT (40) nats of the block's middle row r (max |G_a - G_r| <= 40:
#     always for gates >= -5 per token), the whole row of M and A is ONE product per K tile,
#     `(x_a e^(G_a - G_r)) (k e^(min(G_r - G, 40)))^T`: off-diagonal columns (j < a's rows) have G_r - G_j <= 0 and
#     diagonal ones |G_r - G_j| <= 40, so no factor exceeds e^40 and no product e^80 (fp32 holds e^88); columns
#     after the block are clamped, finite and masked away. Otherwise (a cut or reset gate inside the block: a
#     block-uniform `lax.cond`) the exact path below runs, so gates down to -1000 stay exact and finite.
#   - exact path: off-diagonal columns by one product with the first-row reference n of block a (both factors
#     <= 1), the 16 x 16 diagonal block pair by pair, masked before the exp, by a 16-step column loop on 2-D
#     tiles. (A 3-D broadcast form of it, the "mm2" intra stage, was removed on 2026-12-01 as redundant: both
#     took the same fast path, and the exact path runs only in blocks that hold a cut.)
LIMIT = 40.0
# Launch settings of the Gram kernels (read when a call is traced; for timing sweeps through
# benchmarks/profile_pallas_kda.py --configs): the 16-row Gram kernel's warps and K tile. H200 (8 x 4096, runs 4-5):
# 2 warps 1.36 ms against 1.62 with 4; run8a: K tile 128 with 4 warps 1.14 ms against 0.97.
GRAM_WARPS, GRAM_BK = 2, 64
# (Run10b-d: the Gram kernel with the fast path alone took 0.79 ms against 0.94-0.97 with the `lax.cond`; moving
# the exact path to a second kernel that rewrites the blocks holding a cut gave no gain: 0.17 ms for that kernel
# when it read G, and with the Gram kernel writing per-block flags 0.90 + 0.05 ms. With the flags from the gate
# cumsum kernel instead: GRAM_IMPL "triton-fast" below, the default since run11a.)
GRAM_SCALAR_WARPS = 4  # the scalar-gate Gram kernel, one program per chunk (run9a, GDN 8 x 4096: 0.26 ms)


def _gram_block_spread(G_ref, r0, K, bk):
    """max |G_a - G_r| over the 16-row block a at r0 and its middle row r (the fast path needs <= LIMIT)."""
    spread = jnp.float32(0.0)
    for t in range(K // bk):
        d = pl.ds(t * bk, bk)
        spread = jnp.maximum(spread, jnp.max(jnp.abs(G_ref[pl.ds(r0, SUB), d] - G_ref[pl.ds(r0 + SUB // 2, 1), d])))
    return spread


def middle_rows(G):
    """Each 16-row block's middle row of G [C, n] (its reference row), [1, n] each, picked out by masked sums."""
    rows = iota(G.shape, 0)
    return [row_of(G, a * SUB + SUB // 2, rows) for a in range(G.shape[0] // SUB)]


def keys_toward(k, G, Gr, limit=LIMIT):
    """Keys k [n, |d|] (rows with in-chunk cumsum G) scaled by e^(min(G_r - G, limit)) toward a reference row's
    G_r [1, |d|]: the clamp keeps every factor <= e^limit (rows after the reference block only meet masked
    entries)."""
    return k.astype(f32) * exp(jnp.minimum(Gr - G, limit))


# GRAM_TILE_LOOP, GRAM_STAGES: the fast-path Gram kernel's K tiles (`gram_rows(fast_only=True)`, GRAM_IMPL
# "triton-fast") in a `fori_loop` instead of unrolled, and that loop software-pipelined by Triton to this depth (the
# next tile's loads issued during this tile's math). Read when traced. H200, KDA 8 x 4096 (run33e): the Gram kernel
# 0.701 ms against 0.732 unrolled (0.726 looped without pipelining; K tile 32 0.817, 4 warps 1.130), forward kernels
# 1.231 against 1.262; o and the five gradients' errors against the fp32 XLA chunk form unchanged (o 3.3e-3, dg 5.7e-3).
# Three deep: 1.115 ms (run34d).
GRAM_TILE_LOOP, GRAM_STAGES = True, 2


def _a_prec(prec):
    """A's products' precision beside M's `prec`: with M's at "bf16x2" (the query side split into two bf16 parts, the
    keys in bf16: `common.dot`) A's take the same bf16 keys once (see GRAM_PREC)."""
    return "bf16" if prec == "bf16x2" else prec


def _gram_products(q_ref, k_ref, G_ref, r0, ref_row, limit, *, scale, prec, delta, bk, q0=0, loop=False):
    """[16, C] rows of (scale q) and k against all keys, factored through the reference row ref_row (the block's
    queries at rows q0.. of q_ref: 0 for a 16-row block, r0 for a whole chunk); loop: the K tiles in a `fori_loop`."""
    s, C, K = SUB, k_ref.shape[0], k_ref.shape[-1]
    blk = pl.ds(r0, s)

    def tile(d, carry):
        Mx, Ax = carry
        Gr = G_ref[pl.ds(ref_row, 1), d]
        xr = exp(G_ref[blk, d] - Gr)
        kc = keys_toward(k_ref[:, d], G_ref[:, d], Gr, limit)
        Mx = Mx + dot(q_ref[pl.ds(q0, s), d].astype(f32) * (scale * xr), kc, prec, trans_b=True)
        if delta:
            Ax = Ax + dot(k_ref[blk, d].astype(f32) * xr, kc, _a_prec(prec), trans_b=True)
        return Mx, Ax

    return common.over_tiles(K // bk, bk, tile, (jnp.zeros((s, C), f32), jnp.zeros((s, C), f32)), loop)


def _gram_exact(q_ref, k_ref, G_ref, r0, *, scale, prec, delta, bk, q0=0):
    """The exact path: off-diagonal columns through the block's first row, the diagonal block by a 16-step column
    loop on [16, bk] tiles (few registers)."""
    s, C, K = SUB, k_ref.shape[0], k_ref.shape[-1]
    blk = pl.ds(r0, s)
    cols = iota((s, C), 1)
    Mx, Ax = _gram_products(q_ref, k_ref, G_ref, r0, r0, 0.0, scale=scale, prec=prec, delta=delta, bk=bk, q0=q0)
    Mx, Ax = jnp.where(cols < r0, Mx, 0.0), jnp.where(cols < r0, Ax, 0.0)
    rows_s1 = iota((s, 1), 0)
    for t in range(K // bk):
        d = pl.ds(t * bk, bk)
        Ga = G_ref[blk, d]
        qa, ka = q_ref[pl.ds(q0, s), d].astype(f32) * scale, k_ref[blk, d].astype(f32)

        def column(j, acc, Ga=Ga, qa=qa, ka=ka, d=d):
            row = pl.ds(r0 + j, 1)
            kd = k_ref[row, d].astype(f32) * exp(jnp.where(rows_s1 >= j, Ga - G_ref[row, d], -jnp.inf))
            m = jnp.where(cols == r0 + j, acc[0] + jnp.sum(qa * kd, axis=1, keepdims=True), acc[0])
            a = jnp.where(cols == r0 + j, acc[1] + jnp.sum(ka * kd, axis=1, keepdims=True), acc[1]) if delta \
                else acc[1]
            return m, a

        Mx, Ax = jax.lax.fori_loop(0, s, column, (Mx, Ax))
    return Mx, Ax


def _store_gram(m_ref, a_ref, beta_ref, Mx, Ax, r0, delta, o0=0):
    """The block's rows of M (j <= i) and A (j < i, times beta_i), from its products Mx, Ax [16, C], into rows
    o0.. of m_ref, a_ref (beta_ref's rows o0..)."""
    rows, cols = iota(Mx.shape, 0) + r0, iota(Mx.shape, 1)
    out = pl.ds(o0, SUB)
    m_ref[out, :] = jnp.where(cols <= rows, Mx, 0.0).astype(m_ref.dtype)
    if delta:
        a_ref[out, :] = jnp.where(cols < rows, beta_ref[out].astype(f32)[:, None] * Ax, 0.0)


def _gram_rows_kernel(q_ref, k_ref, G_ref, beta_ref, m_ref, a_ref, qin_ref, kg_ref, *kin_ref, C, scale, prec, delta,
                      bk, fast_only=False):
    """One 16-row block: Qin, Kg (and Kin = k e^G: kin_ref) and the rows of M and A, the exact path taken by a
    block-uniform `lax.cond` (or left to `gram_exact_chunks`: fast_only)."""
    s = SUB
    r0 = (common.program_id(2) % (C // s)) * s
    K = k_ref.shape[-1]
    blk = pl.ds(r0, s)

    def gated(d, carry):
        Ga = G_ref[blk, d]
        qin_ref[:, d] = (q_ref[:, d].astype(f32) * scale * exp(Ga)).astype(qin_ref.dtype)
        kg_ref[:, d] = (k_ref[blk, d].astype(f32) * exp(G_ref[pl.ds(C - 1, 1), d] - Ga)).astype(kg_ref.dtype)
        if kin_ref:
            kin_ref[0][:, d] = (k_ref[blk, d].astype(f32) * exp(Ga)).astype(kin_ref[0].dtype)
        return carry

    loop = fast_only and GRAM_TILE_LOOP
    common.over_tiles(K // bk, bk, gated, 0, loop)
    kw = dict(scale=scale, prec=prec, delta=delta, bk=bk)
    fast = lambda: _gram_products(q_ref, k_ref, G_ref, r0, r0 + s // 2, LIMIT, **kw, loop=loop)
    if fast_only:
        Mx, Ax = fast()
    else:
        Mx, Ax = jax.lax.cond(_gram_block_spread(G_ref, r0, K, bk) <= LIMIT, fast,
                              lambda: _gram_exact(q_ref, k_ref, G_ref, r0, **kw))
    _store_gram(m_ref, a_ref, beta_ref, Mx, Ax, r0, delta)


def _gram_outputs(B, H, Tp, C, K, store, a_dtype):
    """The shapes of the Gram kernels' M, A [B, H, Tp, C] and Qin, Kg [B, H, Tp, K]."""
    mat = lambda D, dt: jax.ShapeDtypeStruct((B, H, Tp, D), dt)
    return [mat(C, store), mat(C, a_dtype), mat(K, store), mat(K, store)]


def gram_rows(q, k, G, beta, *, C, scale, store, prec, delta, warps, interpret, a_dtype=f32, bk=64,
              fast_only=False, kin=False):
    """M, A (= Diag(beta) KK, strictly lower), Qin, Kg (and with kin Kin = k e^G) as [B, H, Tp, .] from q, k [B,
    Tp, H, K], the in-chunk cumsum G (fp32) and beta [B, Tp, H] (see `_gram_rows_kernel`; fast_only: without the
    exact path, for `gram_exact_chunks` to complete)."""
    B, Tp, H, K = q.shape
    N, nb = Tp // C, C // SUB
    sub = lambda D: pl.BlockSpec((None, SUB, None, D), lambda b, h, i: (b, i, h, 0))
    whole = lambda D: pl.BlockSpec((None, C, None, D), lambda b, h, i: (b, i // nb, h, 0))
    row_out = lambda D: pl.BlockSpec((None, None, SUB, D), lambda b, h, i: (b, h, i, 0))
    return pallas_call(
        functools.partial(_gram_rows_kernel, C=C, scale=scale, prec=prec, delta=delta, bk=min(bk, K),
                          fast_only=fast_only),
        grid=(B, H, N * nb),
        in_specs=[sub(K), whole(K), whole(K), pl.BlockSpec((None, SUB, None), lambda b, h, i: (b, i, h))],
        out_specs=[row_out(C), row_out(C), row_out(K), row_out(K)] + [row_out(K)] * kin,
        out_shape=_gram_outputs(B, H, Tp, C, K, store, a_dtype) + [jax.ShapeDtypeStruct((B, H, Tp, K), store)] * kin,
        compiler_params=compiler_params(num_warps=warps, num_stages=GRAM_STAGES if fast_only else 1),
        interpret=interpret,
        name="lineattn_chunk_gram",
    )(q, k, G, beta)


def _gram_exact_chunk_kernel(flag_ref, q_ref, k_ref, G_ref, beta_ref, m_in_ref, a_in_ref, m_ref, a_ref, *, C,
                             scale, prec, bk):
    """One chunk: when flagged, rewrites all of M's and A's rows by the exact path (in place: m_in, a_in alias m,
    a); the other programs read their flag only."""
    del m_in_ref, a_in_ref

    @pl.when(jnp.max(flag_ref[...]) > 0.0)
    def _():
        def block(a, carry):
            r0 = a * SUB
            Mx, Ax = _gram_exact(q_ref, k_ref, G_ref, r0, scale=scale, prec=prec, delta=True, bk=bk, q0=r0)
            _store_gram(m_ref, a_ref, beta_ref, Mx, Ax, r0, True, o0=r0)
            return carry

        jax.lax.fori_loop(0, C // SUB, block, 0)


def chunk_flags(spreads, nb: int):
    """1.0 for the chunks that hold a 16-row block of spread > LIMIT, else 0.0, as [B, H, N, nb] (a row of nb for a
    Triton block) from `gate_cumsum`'s spreads [B, H, N, K tiles, C / 16]."""
    return jnp.broadcast_to((jnp.max(spreads, axis=(3, 4)) > LIMIT).astype(f32)[..., None], spreads.shape[:3] + (nb,))


def gram_exact_chunks(flags, q, k, G, beta, m, A, *, C, scale, interpret, prec, bk=64):
    """M, A [B, H, Tp, C] with the chunks flagged in flags [B, H, N, C / 16] (`chunk_flags`; those that hold a 16-row
    block of spread > LIMIT) recomputed exactly (`_gram_exact`, products at `prec`), after a fast path that has no
    exact path of its own (`gram_rows(fast_only=True)`, `gram_chunks`); q, k, G [B, Tp, H, K], beta [B, Tp, H]."""
    B, Tp, H, K = q.shape
    nb = C // SUB
    tok = pl.BlockSpec((None, C, None, K), lambda b, h, n: (b, n, h, 0))
    mat = pl.BlockSpec((None, None, C, C), lambda b, h, n: (b, h, n, 0))
    return pallas_call(
        functools.partial(_gram_exact_chunk_kernel, C=C, scale=scale, prec=prec, bk=min(bk, K)),
        grid=(B, H, Tp // C),
        in_specs=[pl.BlockSpec((None, None, None, nb), lambda b, h, n: (b, h, n, 0)), tok, tok, tok,
                  pl.BlockSpec((None, C, None), lambda b, h, n: (b, n, h)), mat, mat],
        out_specs=[mat, mat],
        out_shape=[jax.ShapeDtypeStruct(m.shape, m.dtype), jax.ShapeDtypeStruct(A.shape, A.dtype)],
        input_output_aliases={5: 0, 6: 1}, compiler_params=compiler_params(num_warps=GRAM_WARPS, num_stages=1),
        interpret=interpret, name="lineattn_chunk_gram_exact",
    )(flags, q, k, G, beta, m, A)


# GRAM_FORMS_G: for a per-channel gate (with the split Gram stage), one program per chunk forms the gate's in-chunk
# cumsum G itself, by a product with the lower triangle of ones (`chunk_cumsum`), and then the Gram rows of its four
# 16-row blocks, e^(G_C), Qin, Kg, (for the inverse's form) Kin and the chunk's flag for `gram_exact_chunks`: no
# gate-cumsum kernel. G is written only for the flagged chunks in a forward alone with the inverse in the pass, in
# every chunk where the solve or the backward reads it (`gram_chunks`' keep_g; since run41, before which those
# forwards kept the two kernels). H200, run41f (one profile, kernel time): KDA 8 x 4096 forward+backward 4.028 ms
# against 4.165 with both kernels, (1, 32768) 4.544 against 4.746, its forward (in segments) 1.384 against 1.582;
# errors unchanged to two digits (o 3.6e-3, dg 5.7e-3). Read when traced. H200, KDA 8 x 4096 (run40d, one
# profile): the kernel 0.666 ms against 0.701 + 0.162 for the Gram and gate-cumsum kernels, forward kernels 1.032
# against 1.226 (0.917 against 1.127 with GRAM_PREC "bf16x2"), errors against the fp32 XLA chunk form unchanged (o
# 3.3e-3); interleaved wall clock 1.852 ms a call against 2.035 (a slow host that run: jla's forward took 1.83 ms in
# the next). (Run27's form of the same fusion, each 16-row program forming the chunk's G by Triton scans, took 2.17
# ms, history 12059fe: the product with the triangle is cheap on the tensor cores, a scan across warps is not.)
GRAM_FORMS_G = True
# GRAM_CHUNK_BK, GRAM_CHUNK_WARPS, GRAM_CHUNK_STAGES: that kernel's K tile, warps and the depth to which Triton
# pipelines its loop over the K tiles (read when traced). H200, KDA 8 x 4096 (run40a-c, two deep unless said): 0.684
# ms with K tiles of 16 on 2 warps, 0.654 three deep, 2.163 on 1 warp; 0.893 with 32 on 2 warps; 0.956 / 0.964 /
# 2.015 / 5.440 with 16 / 32 / 64 / 128 on 4 warps (three deep with 16: 0.877); against 0.703 + 0.163 for the Gram
# and cumsum kernels it replaces. (Each row block's products against the keys up to its end only, 16, 32, 64 and 64
# rows split from the chunk's, took 0.706 ms against 0.684: run40c, history ff1450c.)
GRAM_CHUNK_BK, GRAM_CHUNK_WARPS, GRAM_CHUNK_STAGES = 16, 2, 3
# GRAM_FACTORS (a forward alone, which writes Kin for the state pass) and GRAM_FACTORS_KEEP_G (the forwards that keep
# G for the solve or the backward, no Kin): how that kernel scales each 16-row block a's keys toward a's middle row a',
# e^(G_a' - G_j) k_j (read when traced):
#   - "per-block": one exp per key and block, e^(min(G_a' - G_j, LIMIT)): four exps a tile element, seven with the
#     rows' e^G and e^(G_C - G) and the left operands' e^(G - G_a');
#   - "next-middle": a key j of an earlier block b as (e^(G_b'' - G_j) k_j) e^(G_a' - G_b''), b'' the middle row of
#     block b + 1: the first factor formed once for all blocks, the second a [1, |d|] row, both <= 1 (G falls along
#     the chunk), so a factor underflows only where the product does: five exps in all;
#   - "middle-keys": every key toward its own block's middle row once, e^(min(G_b' - G_j, LIMIT)) k_j, times the row
#     e^(G_a' - G_b') (<= 1 for b < a): four exps in all. No factor exceeds e^40, and the row underflows only where
#     the product is below e^-47 (the exact rewrite takes the chunks where a row lies beyond LIMIT).
# H200, KDA 8 x 4096 bf16, the kernel's time in one profile (run43c, repeated in run43d to 0.001 ms): a forward alone
# 0.500 ms per-block, 0.483 next-middle, 0.543 middle-keys; the forward that saves for the backward 0.601, 0.579,
# 0.502: forward kernels 0.869 -> 0.852 ms, forward+backward 4.030 -> 3.932 with the pair chosen here (Triton's
# schedule, not the count of exps, decides: K tiles pipelined two deep were 0.03-0.1 ms slower with either). With
# "middle", the rows e^G and e^(G_C - G) also through the middle rows (two exps in all, the flagged chunks' rows
# rewritten after): 0.585 / 0.597 (removed; history e79f86b). With the rows' stores after the middle rows' exps (the
# kernel's order changed, nothing else) per-block took 0.618 ms against 0.500 (run43b).
#   - "halves" (GRAM_FACTORS only): two 32-row halves in place of the four 16-row blocks. Each half's diagonal
#     block through its middle row, whose rows all lie within HALF_LIMIT nats of it (16 tokens: gates >= -5 a token
#     stay on the fast path); the lower-left block (second half's rows, first half's keys) through the second half's
#     first row, where both factors are <= 1. Six [32, 32] products a tile in place of four [16, 64]; four exps a
#     tile element and a half. The flags then mean a half beyond HALF_LIMIT; the backward's exact rewrite reads
#     16-row flags, so GRAM_FACTORS_KEEP_G takes no "halves". H200, KDA 8 x 4096 bf16 (run46a, one profile): the
#     kernel 0.466 ms against 0.486 next-middle (0.864 on 4 warps, 0.607 with K tiles of 32), forward kernels 0.834
#     against 0.854, o's error against the fp32 XLA chunk form 3.7e-3 against 3.6e-3; wall clock 1.068 ms against
#     1.094 (run46b, 5 interleaved rounds of 10 calls). Not the default: its bf16 operands round other factors than
#     the 16-row forms' (M and A differ from theirs by 3.6e-3 / 3.3e-3 relative RMS on the CPU, where "next-middle"
#     and "per-block" agree exactly), o's error grows a little (above), and only its forward's GPU tests ran. On an
#     H100 (run47c-d) it gains nothing: the kernel 0.579 ms against 0.577, wall clock 1.227 ms against 1.222.
GRAM_FACTORS, GRAM_FACTORS_KEEP_G = "next-middle", "middle-keys"
# HALF_LIMIT: "halves"' bound on |G_i - G_r| over a half (r its middle row; gates at -5 give 80): no factor then
# exceeds e^84 (fp32 holds e^88) and none underflows. The masked entries above a half's diagonal may overflow to inf
# or NaN in the products; the stores select them away.
HALF_LIMIT = 84.0


def _halves_tile(rows_out, d, carry, *, scale, prec):
    """GRAM_FACTORS "halves": one K tile's share of the six [C/2, C/2] products (M and A of the first half's
    diagonal block, the lower-left block and the second half's diagonal block), `rows_out` storing the rows'
    outputs; carry = (the largest |G_i - G_r| so far, the six accumulators)."""
    spread, (m00, a00, m10, a10, m11, a11) = carry
    G, q, k = rows_out(d)
    C = G.shape[0]
    h = C // 2
    rows = iota(G.shape, 0)
    mid0, first1, mid1 = (row_of(G, r, rows) for r in (h // 2, h, h + h // 2))
    G_mid = jnp.where(rows < h, mid0, mid1)
    spread = jnp.maximum(spread, jnp.max(jnp.abs(G - G_mid)))
    x = exp(G - G_mid)  # each row toward its half's middle row: within e^(+-HALF_LIMIT) on the fast path
    q0, q1 = jnp.split(q * (scale * x), 2, axis=0)
    k0, k1 = jnp.split(k * x, 2, axis=0)
    own0, own1 = jnp.split(k * exp(G_mid - G), 2, axis=0)  # the keys toward their own half's middle row
    to_first = exp(mid1 - first1)  # [1, bk], <= 1: the second half's rows toward its first row
    G0 = jnp.split(G, 2, axis=0)[0]
    lower_left = jnp.split(k, 2, axis=0)[0] * exp(first1 - G0)  # the first half's keys toward it, <= 1
    a_prec = _a_prec(prec)
    return spread, (m00 + dot(q0, own0, prec, trans_b=True), a00 + dot(k0, own0, a_prec, trans_b=True),
                    m10 + dot(q1 * to_first, lower_left, prec, trans_b=True),
                    a10 + dot(k1 * to_first, lower_left, a_prec, trans_b=True),
                    m11 + dot(q1, own1, prec, trans_b=True), a11 + dot(k1, own1, a_prec, trans_b=True))


def _store_halves(m_ref, a_ref, beta_ref, m00, a00, m10, a10, m11, a11):
    """M (j <= i) and A (j < i, times beta_i) of one chunk from "halves"' six [C/2, C/2] products; the block above the
    diagonal is zero. The masked entries of the diagonal blocks are selected away (they may hold inf or NaN)."""
    h = m00.shape[0]
    rows, cols = iota((h, h), 0), iota((h, h), 1)
    upper, below = cols > rows, cols < rows
    first, second = pl.ds(0, h), pl.ds(h, h)
    beta0, beta1 = (beta_ref[half].astype(f32)[:, None] for half in (first, second))
    m_ref[first, first] = jnp.where(upper, 0.0, m00).astype(m_ref.dtype)
    m_ref[first, second] = jnp.zeros((h, h), m_ref.dtype)
    m_ref[second, first] = m10.astype(m_ref.dtype)
    m_ref[second, second] = jnp.where(upper, 0.0, m11).astype(m_ref.dtype)
    a_ref[first, first] = jnp.where(below, beta0 * a00, 0.0)
    a_ref[first, second] = jnp.zeros((h, h), f32)
    a_ref[second, first] = beta1 * a10
    a_ref[second, second] = jnp.where(below, beta1 * a11, 0.0)


def chunk_cumsum(g):
    """The in-chunk cumsum of g [C, n] fp32 along its rows as tensor-core products: the lower triangle of ones (exact
    in bf16) against g in three bf16 parts (24 bits: their sum is g exactly), fp32 sums, smallest part first."""
    C = g.shape[0]
    ones = jnp.where(iota((C, C), 1) <= iota((C, C), 0), 1.0, 0.0).astype(jnp.bfloat16)
    hi = common.bf16_head(g)
    mid = common.bf16_head(g - hi)
    lo = g - hi - mid
    return dot(ones, lo, "bf16") + dot(ones, mid, "bf16") + dot(ones, hi, "bf16")


def _gram_chunk_kernel(q_ref, k_ref, g_ref, beta_ref, m_ref, a_ref, qin_ref, kg_ref, *refs, scale, prec, bk, kin,
                       keep_g):
    """One chunk from the raw gate: per K tile, G by `chunk_cumsum`, e^(G_C), Qin, Kg, (with kin) Kin for all its
    rows, and each 16-row block's products through its middle row (the fast path of `_gram_rows_kernel`, the left
    operands of the four blocks formed together and split by rows; or the two halves' products, GRAM_FACTORS
    "halves"); then M, A, the chunk's flag (a block beyond LIMIT of its middle row, a half beyond HALF_LIMIT:
    `gram_exact_chunks` rewrites it), and G: with keep_g in every chunk, else only in a flagged chunk (recomputed), for
    that rewrite."""
    kin_ref, dend_ref, flag_ref, G_ref = refs if kin else (None, *refs)
    C, K = k_ref.shape
    nb = C // SUB
    rows = iota((C, bk), 0)
    block_of_row = rows // SUB

    def by_block(values):
        """[C, bk]: values[b] [1, bk] in the rows of 16-row block b."""
        out = values[0]
        for b in range(1, nb):
            out = jnp.where(block_of_row == b, values[b], out)
        return out

    def gate(d):
        G = chunk_cumsum(floor_gate(g_ref[:, d].astype(f32)))
        return G, row_of(G, C - 1, rows)

    def toward(Ga, anchors):
        """[C, bk]: e^(Ga - anchors[b]) in the rows of each block b < len(anchors), 1 elsewhere (Ga [1, bk])."""
        step = jnp.ones_like(Ga)
        for b, anchor in enumerate(anchors):
            step = jnp.where(block_of_row == b, exp(Ga - anchor), step)
        return step

    factors = GRAM_FACTORS_KEEP_G if keep_g else GRAM_FACTORS
    allowed = ("per-block", "next-middle", "middle-keys") + (() if keep_g else ("halves",))
    if factors not in allowed:
        raise ValueError(f"gram.GRAM_FACTORS{'_KEEP_G' if keep_g else ''} must be one of {allowed}, got {factors!r}")

    def rows_out(d):
        """G, q, k of tile d (fp32), the tile's Qin, Kg, (with kin) Kin, e^(G_C) and (with keep_g) G stored."""
        G, G_C = gate(d)
        if keep_g:
            G_ref[:, d] = G
        dend_ref[d] = exp(G_C[0])
        q, k = q_ref[:, d].astype(f32), k_ref[:, d].astype(f32)
        eG = exp(G)
        qin_ref[:, d] = (q * scale * eG).astype(qin_ref.dtype)
        if kin:
            kin_ref[:, d] = (k * eG).astype(kin_ref.dtype)
        kg_ref[:, d] = (k * exp(G_C - G)).astype(kg_ref.dtype)
        return G, q, k

    def tile(d, carry):
        spread, acc = carry
        G, q, k = rows_out(d)
        mids = middle_rows(G)
        G_mid = by_block(mids)
        spread = jnp.maximum(spread, jnp.max(jnp.abs(G - G_mid)))
        x = exp(G - G_mid)  # each row toward its block's middle row
        left_q, left_k = jnp.split(q * (scale * x), nb, axis=0), jnp.split(k * x, nb, axis=0)
        if factors != "per-block":
            own = keys_toward(k, G, G_mid)  # every key toward its own block's middle row
        if factors == "next-middle":
            ahead = k * exp(by_block(mids[1:] + mids[-1:]) - G)  # each key of block b toward block b + 1's middle
        new = []
        for a in range(nb):
            if factors == "per-block":
                kc = keys_toward(k, G, mids[a])
            elif a == 0:
                kc = own  # (the keys of later blocks meet masked entries only, and are finite)
            elif factors == "middle-keys":
                kc = own * toward(mids[a], mids[:a])
            else:
                kc = jnp.where(block_of_row < a, ahead * toward(mids[a], mids[1:a + 1]), own)
            new.append((acc[a][0] + dot(left_q[a], kc, prec, trans_b=True),
                        acc[a][1] + dot(left_k[a], kc, _a_prec(prec), trans_b=True)))
        return spread, new

    if factors == "halves":
        spread, acc = common.over_tiles(K // bk, bk, functools.partial(_halves_tile, rows_out, scale=scale, prec=prec),
                                        (jnp.float32(0.0), (jnp.zeros((C // 2, C // 2), f32),) * 6), GRAM_TILE_LOOP)
        _store_halves(m_ref, a_ref, beta_ref, *acc)
        limit = HALF_LIMIT
    else:
        zeros = jnp.zeros((SUB, C), f32)
        spread, acc = common.over_tiles(K // bk, bk, tile, (jnp.float32(0.0), [(zeros, zeros)] * nb), GRAM_TILE_LOOP)
        for a, (Mx, Ax) in enumerate(acc):
            _store_gram(m_ref, a_ref, beta_ref, Mx, Ax, a * SUB, True, o0=a * SUB)
        limit = LIMIT
    flagged = spread > limit
    flag_ref[...] = jnp.broadcast_to(jnp.where(flagged, 1.0, 0.0), flag_ref.shape)

    if keep_g:
        return

    @pl.when(flagged)
    def _():
        def write(d, carry):
            G_ref[:, d] = gate(d)[0]
            return carry

        common.over_tiles(K // bk, bk, write, 0)


def gram_chunks(q, k, g, beta, *, C, scale, store, prec, interpret, bk=None, kin=True, keep_g=False):
    """From the raw per-channel log gate g [B, Tp, H, K] fp32 (no gate-cumsum kernel before it; see GRAM_FORMS_G):
    M, A, Qin, Kg, (with kin) Kin [B, H, Tp, .] (`gram_rows(fast_only=True, kin=kin)`'s), e^(G_C) [B, H, N, K], the
    chunks' flags [B, H, N, C / 16] (1.0 where `gram_exact_chunks` must rewrite the chunk) and G [B, Tp, H, K] fp32,
    written in every chunk with keep_g (for the solve and the backward), else in the flagged chunks only (elsewhere
    unset). q, k [B, Tp, H, K], beta [B, Tp, H]."""
    B, Tp, H, K = q.shape
    N, nb = Tp // C, C // SUB
    bk = min(bk or GRAM_CHUNK_BK, K)
    tok = lambda D: pl.BlockSpec((None, C, None, D), lambda b, h, n: (b, n, h, 0))
    rows = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, n, 0))
    return pallas_call(
        functools.partial(_gram_chunk_kernel, scale=scale, prec=prec, bk=bk, kin=kin, keep_g=keep_g),
        grid=(B, H, N),
        in_specs=[tok(K), tok(K), tok(K), pl.BlockSpec((None, C, None), lambda b, h, n: (b, n, h))],
        out_specs=[rows(C), rows(C), rows(K), rows(K)] + [rows(K)] * kin + [
            pl.BlockSpec((None, None, None, K), lambda b, h, n: (b, h, n, 0)),
            pl.BlockSpec((None, None, None, nb), lambda b, h, n: (b, h, n, 0)), tok(K)],
        out_shape=_gram_outputs(B, H, Tp, C, K, store, f32) + [jax.ShapeDtypeStruct((B, H, Tp, K), store)] * kin + [
            jax.ShapeDtypeStruct((B, H, N, K), f32), jax.ShapeDtypeStruct((B, H, N, nb), f32),
            jax.ShapeDtypeStruct((B, Tp, H, K), f32)],
        compiler_params=compiler_params(num_warps=GRAM_CHUNK_WARPS, num_stages=GRAM_CHUNK_STAGES),
        interpret=interpret,
        name="lineattn_chunk_gram_g",
    )(q, k, g, beta)


# ---- The Gram matrices for a gate equal across K (GDN, DeltaNet: the `scalar` path) ----
# The decay then factors out of the products, P_ij = (x_i . k_j) e^(G_i - G_j): one program per chunk, the products
# on the raw inputs (bf16 operands on the tensor cores for bf16 inputs: exact products) and the [C, C] decay taken
# pair by pair, masked before the exp (its exponent never above 0: exact for any g <= 0, no reference row).


def scalar_decay(g_ref):
    """From one chunk of a scalar log gate [C]: its in-chunk cumsum G as a column [C, 1], the decay
    D_ij = e^(G_i - G_j) for j <= i (0 above the diagonal) [C, C], and G_C (the chunk's sum); g floored as loaded."""
    g = floor_gate(g_ref[...].astype(f32))
    Gs = jnp.cumsum(g)
    C = g.shape[0]
    decay = exp(jnp.where(iota((C, C), 1) <= iota((C, C), 0), Gs[:, None] - Gs[None, :], -jnp.inf))
    return Gs[:, None], decay, jnp.sum(g)


def _gram_scalar_kernel(q_ref, k_ref, g_ref, beta_ref, m_ref, a_ref, *gated_refs, C, scale, prec, delta, bk):
    """gated_refs: Qin, Kg (or none: a state pass that applies the row factors itself, `chunk_fwd.forward`'s
    row_gate)."""
    i, j = iota((C, C), 0), iota((C, C), 1)
    G, decay, G_end = scalar_decay(g_ref)
    to_end = exp(G_end - G)
    QK, KK = jnp.zeros((C, C), f32), jnp.zeros((C, C), f32)
    for t in range(k_ref.shape[-1] // bk):
        d = pl.ds(t * bk, bk)
        q, k = q_ref[:, d], k_ref[:, d]
        if gated_refs:
            qin_ref, kg_ref = gated_refs
            qin_ref[:, d] = (q.astype(f32) * (scale * exp(G))).astype(qin_ref.dtype)
            kg_ref[:, d] = (k.astype(f32) * to_end).astype(kg_ref.dtype)
        QK = QK + dot(q, k, prec, trans_b=True)
        if delta:
            KK = KK + dot(k, k, prec, trans_b=True)
    m_ref[...] = (scale * QK * decay).astype(m_ref.dtype)
    if delta:
        a_ref[...] = jnp.where(j < i, beta_ref[...].astype(f32)[:, None] * KK * decay, 0.0)


def gram_scalar(q, k, g, beta, *, C, scale, store, exact, delta, interpret, a_dtype=f32, bk=64, gated=True):
    """`gram_rows`'s outputs (M, A, Qin, Kg [B, H, Tp, .]) for a gate equal across K, by `_gram_scalar_kernel`;
    g [B, Tp, H] fp32 is the scalar log gate (its in-chunk cumsum is taken in the kernel). gated False: Qin and
    Kg are not written (None)."""
    B, Tp, H, K = q.shape
    kernel = functools.partial(_gram_scalar_kernel, C=C, scale=scale, prec="ieee" if exact else "bf16", delta=delta,
                               bk=min(bk, K))
    tok = pl.BlockSpec((None, C, None, K), lambda b, h, n: (b, n, h, 0))
    tok1 = pl.BlockSpec((None, C, None), lambda b, h, n: (b, n, h))
    out = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, n, 0))
    outs = 4 if gated else 2
    return (*pallas_call(
        kernel,
        grid=(B, H, Tp // C),
        in_specs=[tok, tok, tok1, tok1],
        out_specs=[out(C), out(C), out(K), out(K)][:outs],
        out_shape=_gram_outputs(B, H, Tp, C, K, store, a_dtype)[:outs],
        compiler_params=compiler_params(num_warps=GRAM_SCALAR_WARPS, num_stages=1),
        interpret=interpret,
        name="lineattn_chunk_gram_scalar",
    )(q, k, g, beta), *(() if gated else (None, None)))


# ---- Gate cumsum as a kernel (XLA's cumsum over the chunk axis took 0.6 ms at 8 x 4096 x 16 x 128) ----


def _cumsum_kernel(g_ref, G_ref, dend_ref, *spread_ref):
    g = floor_gate(g_ref[...].astype(f32))
    if g.ndim == 1:  # a gate equal across K: one cumsum, e^(G_C) broadcast over K for the state passes
        G_ref[...] = jnp.cumsum(g)
        dend_ref[...] = jnp.broadcast_to(exp(jnp.sum(g)), dend_ref.shape)
        return
    G = jnp.cumsum(g, axis=0)
    G_ref[...] = G
    dend_ref[...] = exp(jnp.sum(g, axis=0))
    if spread_ref:  # each 16-row block's max |G - G_r| over this K tile (r: the block's middle row)
        rows, nb = iota(G.shape, 0), G.shape[0] // SUB
        spreads = jnp.zeros((nb,), f32)
        for a, mid in enumerate(middle_rows(G)):
            spread = jnp.max(jnp.where(rows // SUB == a, jnp.abs(G - mid), 0.0))
            spreads = jnp.where(iota((nb,), 0) == a, spread, spreads)
        spread_ref[0][...] = spreads


# The gate cumsum kernel's K tile and warps (read when traced; H200 8 x 4096, run13d: K tile 128 took 0.176 ms, 64
# 0.169; run20a-b: 2 warps 0.162-0.164 against 0.167-0.169 with 4, 8 warps 0.233, K tile 32 0.193). Nsight Compute
# (run20b): 3.07 TB/s of DRAM traffic, fp32 g in and G out: bandwidth-bound.
CUMSUM_BK, CUMSUM_WARPS = 64, 2


def gate_cumsum(g, *, C, K, interpret, spreads=False):
    """G (the cumsum of g within each chunk of C, fp32, g's shape) and e^(G_C) [B, H, K, N], from g [B, Tp, H, K]
    or [B, Tp, H] (a gate equal across K: G [B, Tp, H], e^(G_C) broadcast over K). spreads (a per-channel g): also
    every 16-row block's max |G - G_r| (r its middle row) per K tile of CUMSUM_BK, [B, H, N, K tiles, C / 16]."""
    B, Tp, H = g.shape[:3]
    N = Tp // C
    bk = min(K, CUMSUM_BK) if g.ndim == 4 else K  # (a scalar gate: one program per chunk)
    g_spec = (pl.BlockSpec((None, C, None, bk), lambda b, h, n, t: (b, n, h, t)) if g.ndim == 4
              else pl.BlockSpec((None, C, None), lambda b, h, n, t: (b, n, h)))
    spread = ([pl.BlockSpec((None, None, None, None, C // SUB), lambda b, h, n, t: (b, h, n, t, 0))],
              [jax.ShapeDtypeStruct((B, H, N, K // bk, C // SUB), f32)]) if spreads else ([], [])
    return pallas_call(
        _cumsum_kernel,
        grid=(B, H, N, K // bk),
        in_specs=[g_spec],
        out_specs=[g_spec, pl.BlockSpec((None, None, bk, None), lambda b, h, n, t: (b, h, t, n))] + spread[0],
        out_shape=[jax.ShapeDtypeStruct(g.shape, f32), jax.ShapeDtypeStruct((B, H, K, N), f32)] + spread[1],
        compiler_params=compiler_params(num_warps=CUMSUM_WARPS, num_stages=1),
        interpret=interpret,
        name="lineattn_chunk_cumsum",
    )(g)


# GRAM_PREC: for bf16 inputs (fp32 inputs: "ieee"), read when a call is traced: the Gram kernels' products. In bf16
# (run8a/b profiles, beside UW_PREC's bf16 in `solve`): Gram 0.90 ms against 0.97, o 4.0e-3 (not taken). Again in
# run38b, with today's kernel: the Gram kernel 0.580 ms against 0.705, forward kernels 1.108 against 1.236, o 4.0e-3
# against 3.3e-3 (jla's 4.0e-3, FLA's 3.3e-3), dv and dbeta 3.7e-3 against 2.9e-3; still not taken: the 1.2 ms forward
# target stays out of reach, and M's bf16 products cost o its accuracy. A's products alone in bf16 cost no accuracy
# (CPU: o and every gradient within 1.5 % of tf32's; A reaches o through R, stored in bf16) but were slower, 0.718 ms
# against 0.706 in run38c: M's and A's products share the key operand, which is then needed in two precisions (history
# c17ba2a). Splitting one of M's operands into two bf16 parts, the other and A's products in bf16 (three bf16 products
# where tf32 takes the issue slots of four), halves the loss (CPU, K = 128: o 3.48e-3 with the query side split, 3.60e-3
# with the key side, against 3.22e-3 in fp32 and 3.78e-3 in bf16). That is GRAM_PREC "bf16x2" (M's products with the
# query side split, A's in bf16: `_a_prec`). H200, KDA 8 x 4096 (run39c, one profile, --check): the Gram kernel 0.599 ms
# against 0.700 (tf32) and 0.578 (bf16); forward kernels 1.127 against 1.229 and 1.107, forward+backward 4.166 against
# 4.262 and 4.150; o 3.6e-3 against 3.3e-3 and 4.0e-3, dv and dbeta 3.3e-3 against 2.9e-3 and 3.7e-3, dq, dk, dg
# unchanged. Not the default then: the target stayed out of reach and o loses a tenth of its accuracy. The default since
# run40: with the Gram kernel forming G itself (GRAM_FORMS_G) it takes the forward alone's kernels to 0.917 ms against
# 1.032 in tf32 (run40d) and the bench's forward to 1.152 ms (run40g), under the 1.2 ms target; the whole GPU suite
# passed with it (run40e: bf16, T = 16381, KDA o 3.7e-3 against 3.3e-3 in tf32, dbeta 3.4e-3 against 2.2e-3, the rest
# within 1e-4; GLA o 2.8e-3 against 2.4e-3), all within FLA's bounds.
GRAM_PREC = "bf16x2"
# The Gram stage's implementation for a per-channel gate with the delta write: "triton" (`gram_rows` with its
# exact path behind a block-uniform `lax.cond`) or "triton-fast" (`gram_rows` without it, then
# `gram_exact_chunks` recomputes the chunks the gate-cumsum kernel flags beyond LIMIT). H200, 8 x 4096 (run11a):
# 0.79 + 0.01 ms (+ 0.02 for the cumsum kernel's spreads) against 0.94. (A Mosaic GPU Gram kernel, bf16 wgmma
# with reference points per 16-column block, took 2.00 ms in run11a: removed; so was "triton-triangle", the fast
# path by 16-column blocks up to the diagonal only, under a `pl.when` per block: 1.18 ms in run12a, for 5/8 of
# the exps, loads and products; and one program per chunk, its four row blocks in turn, each against the keys
# up to its diagonal block (16, 32, 64, 64): 2.05 / 2.35 / 2.57 ms with 2 / 4 / 8 warps in run15b: the kernel is
# latency-bound, and 4x more programs win. Run16a: each 16-row block as 2 or 4 programs over column windows, those
# above the diagonal writing zeros without products: 0.835 / 1.229 ms against 0.786; and the Gram kernel also
# writing Kin = Diag(beta) k e^G in bf16 for the Mosaic solve to read in place of k and G (48 KB of SMEM a CTA
# instead of 80): solve 0.372 against 0.415 but Gram 0.834 against 0.786, the forward 1.602 against 1.595: both
# removed. Run26b: 2 or 4 row blocks a program sharing the loads of the chunk's k and G, 0.703-1.156 ms against
# 0.705 (history a77d315); run26c, "triton-factored": each key block scaled once toward its own middle row and the
# row blocks' factors e^(G_ma - G_mb) on the left operand, as 16 x 16 products: 1.18-8.04 ms (history 3331c0f);
# run27a, the Gram kernel forming G itself from g by Triton scans (no gate-cumsum kernel) and writing Kin for the
# solve: 1.95-2.30 ms against 0.70 + 0.16 (history 12059fe).)
# ("mosaic", the Gram and solve stages fused in one Mosaic GPU kernel, `gram_mgpu.py`, opt-in since run18: H200,
# 8 x 4096, 1.19 ms against 0.725 + 0.404 for the Gram kernel and the Mosaic solve it would replace, 0.87 for the
# forward alone's Gram, inversion and inverse since run30. Removed in session 30; history 2b834a5. Run32's Gram
# kernel in key-major orientation, Mosaic GPU: 0.82-0.97 ms against 0.74, history 02751f6.)
GRAM_IMPL = "triton-fast"


def split_gram(scalar: bool, delta: bool) -> bool:
    """Whether the Gram stage takes the fast path everywhere and a fix-up after it, GRAM_IMPL "triton-fast" (its
    chunk flags from the gate cumsum's block spreads, or from `gram_chunks`: the backward takes them from the forward's
    saved terms, or its own cumsum asks for the spreads)."""
    if GRAM_IMPL not in ("triton", "triton-fast"):
        raise ValueError(f"gram.GRAM_IMPL must be 'triton' or 'triton-fast', got {GRAM_IMPL!r}")
    return GRAM_IMPL == "triton-fast" and not scalar and delta
