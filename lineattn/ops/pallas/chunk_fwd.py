"""Chunkwise delta-rule forward as Pallas kernels (see ../shared/CHUNK_ALGORITHM.md for the algebra).

The intra-chunk stage, parallel over (batch, head, chunk) (`_intra`):
  - `gate_cumsum`: G, the cumsum of the log gate inside each chunk, and e^(G_C) (for a per-channel gate the Gram
    kernel forms G itself instead: `gram_chunks`, one program per chunk, GRAM_FORMS_G);
  - `gram_rows`: one program per (chunk, 16-row block a) for the gated Gram matrices M (queries x keys, j <= i)
    and A (keys x keys, j < i, times beta_i), and Qin = scale q e^G, Kg = k e^(G_C - G). Off-diagonal sub-blocks
    (a > b) factor the decay through a reference row of block a, `(x_a e^(G_a - G_r)) (k_b e^(G_r - G_b))^T`, so
    no exponent overflows; a diagonal block takes the same factoring through its middle row when all its rows
    lie within LIMIT (40) nats of it, and is computed exactly otherwise (pair by pair, masked before the exp):
    exact for any g <= 0 (also -1000). By default (GRAM_IMPL "triton-fast") the kernel takes the fast path
    everywhere and `gram_exact_chunks` rewrites the chunks that `gate_cumsum` flags beyond LIMIT;
  - `invert_diagonal_blocks` (DIAG_INVERSE): each 32 x 32 (DIAG_INVERSE_BLOCK) diagonal block of I + A inverted in
    fp32, in place in a forward alone, into a new array where the forward keeps A for the backward
    (DIAG_INVERSE_SAVE);
  - `solve_full`: R = (I + A)^-1 for the whole chunk by block doubling (the same numbers as block forward
    substitution, 16 -> 32 -> 64; from the inverted diagonal blocks), then U = R Diag(b) V and
    W = R Diag(b) Kin (on a Hopper GPU, for bf16 at chunk 64, the same algebra as a Mosaic GPU kernel:
    `solve_mgpu.solve_mosaic`, see SOLVE_IMPL).
`state_pass`, one program per (batch, head, V tile): the sequential pass over chunks with the fp32 state in
registers, E = U - W S, O = Qin S + M E, S <- Diag(e^(G_C)) S + Kg^T E; writes O and the final state (and, for
the backward, every chunk's S and E); on a Hopper GPU where it fits, the same as a Mosaic GPU kernel
(`state_mgpu.state_pass_mosaic`, see PASS_IMPL). For a few long sequences in a forward that saves for the
backward, the pass runs in segments of chunks side by side (PASS_SEGMENTS): `segment_starts` gives each
segment's true start and its map, which the backward's reverse pass then reuses.
A forward alone on the Mosaic pass writes fewer intermediates: the solve writes R alone and the pass forms E = R
(Diag(beta) V - Diag(beta) Kin S) itself (INVERSE_IN_PASS); a scalar gate's pass also reads the raw q and k with
the gate as row factors, so its Gram kernel writes M and A only (ROW_GATE).

Precision: bf16 inputs keep bf16 intermediates (Qin, Kg, W, U, M) and run the state pass's products on bf16
tensor cores with fp32 accumulation; the Gram products take bf16x2 (M's query side in two bf16 parts, A's in bf16),
the solve's doubling bf16x3 and its U, W products bf16 (see GRAM_PREC, UW_PREC). fp32 inputs run
everything in exact fp32. Intermediate memory: (3 K + V + C) values per token and head in the input dtype, plus
K fp32 per chunk.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.pallas.common import SUB, compiler_params, dot, exp, hopper, interpret_mode, is_pow2, pallas_call
from lineattn.ops.pallas import common, segments, solve_mgpu, state_mgpu

f32 = jnp.float32


def _iota(shape, dim):
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


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
# Launch settings of the forward (read when a call is traced; for timing sweeps through
# benchmarks/profile_pallas_kda.py --configs): warps of the Gram kernel, the solve and the state pass, and the Gram
# kernel's K tile. H200 (8 x 4096, runs 4-5): Gram 2 warps 1.36 ms against 1.62 with 4, solve 4 warps 1.22 against
# 1.63 with 8 (timed alone); run8a: Gram K tile 128 with 4 warps 1.14 ms against 0.97. PASS_STAGES: the state
# pass's pipeline depth (run8a: 0.35 ms with 3, 0.42 with 2, 0.375 with 1).
GRAM_WARPS, SOLVE_WARPS, PASS_WARPS, GRAM_BK, PASS_STAGES = 2, 4, 4, 64, 3
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
    rows = _iota(G.shape, 0)
    return [jnp.sum(jnp.where(rows == a * SUB + SUB // 2, G, 0.0), axis=0, keepdims=True)
            for a in range(G.shape[0] // SUB)]


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
    cols = _iota((s, C), 1)
    Mx, Ax = _gram_products(q_ref, k_ref, G_ref, r0, r0, 0.0, scale=scale, prec=prec, delta=delta, bk=bk, q0=q0)
    Mx, Ax = jnp.where(cols < r0, Mx, 0.0), jnp.where(cols < r0, Ax, 0.0)
    rows_s1 = _iota((s, 1), 0)
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
    rows, cols = _iota(Mx.shape, 0) + r0, _iota(Mx.shape, 1)
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


def chunk_cumsum(g):
    """The in-chunk cumsum of g [C, n] fp32 along its rows as tensor-core products: the lower triangle of ones (exact
    in bf16) against g in three bf16 parts (24 bits: their sum is g exactly), fp32 sums, smallest part first."""
    C = g.shape[0]
    ones = jnp.where(_iota((C, C), 1) <= _iota((C, C), 0), 1.0, 0.0).astype(jnp.bfloat16)
    hi = common.bf16_head(g)
    mid = common.bf16_head(g - hi)
    lo = g - hi - mid
    return dot(ones, lo, "bf16") + dot(ones, mid, "bf16") + dot(ones, hi, "bf16")


def _gram_chunk_kernel(q_ref, k_ref, g_ref, beta_ref, m_ref, a_ref, qin_ref, kg_ref, *refs, scale, prec, bk, kin,
                       keep_g):
    """One chunk from the raw gate: per K tile, G by `chunk_cumsum`, e^(G_C), Qin, Kg, (with kin) Kin for all its
    rows, and each 16-row block's products through its middle row (the fast path of `_gram_rows_kernel`, the left
    operands of the four blocks formed together and split by rows); then M, A, the chunk's flag (a block beyond LIMIT
    of its middle row: `gram_exact_chunks` rewrites it), and G: with keep_g in every chunk, else only in a flagged
    chunk (recomputed), for that rewrite."""
    kin_ref, dend_ref, flag_ref, G_ref = refs if kin else (None, *refs)
    C, K = k_ref.shape
    nb = C // SUB
    rows = _iota((C, bk), 0)
    block_of_row = rows // SUB

    def gate(d):
        G = chunk_cumsum(g_ref[:, d].astype(f32))
        return G, jnp.sum(jnp.where(rows == C - 1, G, 0.0), axis=0, keepdims=True)

    def tile(d, carry):
        spread, acc = carry
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
        mids = middle_rows(G)
        G_mid = mids[0]
        for a in range(1, nb):
            G_mid = jnp.where(block_of_row == a, mids[a], G_mid)
        spread = jnp.maximum(spread, jnp.max(jnp.abs(G - G_mid)))
        x = exp(G - G_mid)  # each row toward its block's middle row
        left_q, left_k = jnp.split(q * (scale * x), nb, axis=0), jnp.split(k * x, nb, axis=0)
        new = []
        for a in range(nb):
            kc = keys_toward(k, G, mids[a])
            new.append((acc[a][0] + dot(left_q[a], kc, prec, trans_b=True),
                        acc[a][1] + dot(left_k[a], kc, _a_prec(prec), trans_b=True)))
        return spread, new

    zeros = jnp.zeros((SUB, C), f32)
    spread, acc = common.over_tiles(K // bk, bk, tile, (jnp.float32(0.0), [(zeros, zeros)] * nb), GRAM_TILE_LOOP)
    for a, (Mx, Ax) in enumerate(acc):
        _store_gram(m_ref, a_ref, beta_ref, Mx, Ax, a * SUB, True, o0=a * SUB)
    flagged = spread > LIMIT
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


def unit_lower_inverse_exact(L):
    """(I + L)^-1 for a strictly lower triangular [n, n] L (fp32) by forward substitution: row c of the inverse
    is final once the rows above it are, and then leaves -L[:, c] times itself in every row below (exact fp32)."""
    n = L.shape[0]
    rows, cols = _iota((n, n), 0), _iota((n, n), 1)
    X = jnp.where(rows == cols, 1.0, 0.0)
    for c in range(n - 1):  # (a Python loop: Triton's lowering refuses `fori_loop(..., unroll=True)`)
        x_c = jnp.sum(jnp.where(rows == c, X, 0.0), axis=0, keepdims=True)  # [1, n]
        l_c = jnp.sum(jnp.where(cols == c, L, 0.0), axis=1, keepdims=True)  # [n, 1], zero at rows <= c
        X = X - l_c * x_c
    return X


def _diagonal_inverse(load, n):
    """(I + L)^-1 - I for a strictly lower diagonal block L of n = 16 or 32 rows, as {(r, c): its 16 x 16 block}
    (r, c: row and column blocks inside it); load(r, c) gives L's 16 x 16 block (r, c) in fp32. A 32 x 32 block
    [[L1, 0], [L21, L2]]: its halves by forward substitution, then the inverse's corner -X2 L21 X1 by two fp32
    products."""
    eye = jnp.where(_iota((SUB, SUB), 0) == _iota((SUB, SUB), 1), 1.0, 0.0)
    if n == SUB:
        return {(0, 0): unit_lower_inverse_exact(load(0, 0)) - eye}
    X1, X2 = unit_lower_inverse_exact(load(0, 0)), unit_lower_inverse_exact(load(1, 1))
    return {(1, 0): -dot(dot(X2, load(1, 0), "ieee"), X1, "ieee"), (0, 0): X1 - eye, (1, 1): X2 - eye,
            (0, 1): jnp.zeros_like(eye)}


def _sub(i):
    """The i-th 16-row (or column) block."""
    return pl.ds(i * SUB, SUB)


def _invert_diagonal_block_kernel(a_ref, o_ref):
    for (r, c), x in _diagonal_inverse(lambda r, c: a_ref[_sub(r), _sub(c)], a_ref.shape[0]).items():
        o_ref[_sub(r), _sub(c)] = x


def _scaled_diagonal_inverse_kernel(a_ref, b_ref, o_ref, *, nb):
    """The rows of one diagonal block of a chunk (a_ref, o_ref [block, C]; nb blocks a chunk): Diag(beta) A with the
    diagonal block replaced by its inverse's form (right of it, zeros), for a forward that keeps the unscaled A for
    the backward. The block's column position depends on the program: one static branch for each."""
    block, C = a_ref.shape
    per = block // SUB  # 16-row blocks in a diagonal block
    beta = [b_ref[_sub(r)].astype(f32)[:, None] for r in range(per)]  # (each row block's, loaded once)
    scaled = lambda r, c: a_ref[_sub(r), _sub(c)] * beta[r]
    for d in range(nb):
        @pl.when(pl.program_id(2) % nb == d)
        def _(d=d):
            for r in range(per):
                for c in range(C // SUB):
                    if c // per != d:
                        o_ref[_sub(r), _sub(c)] = scaled(r, c) if c < d * per else jnp.zeros((SUB, SUB), f32)
            for (r, c), x in _diagonal_inverse(lambda r, c: scaled(r, d * per + c), block).items():
                o_ref[_sub(r), _sub(d * per + c)] = x


# DIAG_INVERSE: in a forward alone (nothing saved for the backward), a small kernel inverts each 16 x 16 diagonal
# block of I + A in place (forward substitution in fp32, one warp a block) once A is final (after the exact fix-up
# where there is one), so the solve's doubling starts from 16 x 16 blocks: two levels instead of five. H200,
# 8 x 4096: KDA (run28b) the Mosaic solve 0.257 ms against 0.403, this kernel 0.040, forward kernels 1.382 against
# 1.490; GDN's scalar-gate path (run29a) 0.239 against 0.387, forward kernels 0.759 against 0.865; errors
# unchanged. The same inversion inside the Gram kernel took that kernel from 0.696 to 2.478 ms (run28a, history
# 00afc93: cross-warp reductions in each 16-row program). A forward that saves for the backward keeps the
# unscaled key Gram for it: with DIAG_INVERSE_SAVE the kernel then writes Diag(beta) KK with its diagonal blocks
# inverted into a new array (one program for each diagonal block's rows), for the solve that also writes R; without,
# that solve runs the whole doubling from KK. H200, 8 x 4096, forward+backward kernels (run36c): KDA 4.272 ms against
# 4.329 (solve 0.262 against 0.425, the inversion 0.103; 0.112 with one program a chunk, run36b), GDN 2.946 against
# 3.030; errors unchanged, and the whole GPU suite passed with it (121 tests).
DIAG_INVERSE = True
DIAG_INVERSE_SAVE = True
# DIAG_INVERSE_BLOCK: the size of those diagonal blocks, 16 or 32 (a 32 x 32 block from its two 16 x 16 halves and
# two 16 x 16 fp32 products; the solve's doubling then runs one level). Read when traced. H200, 8 x 4096 (run30b):
# the inversion kernel 0.062 ms against 0.041 with 16; `solve_mgpu.inverse_mosaic` 0.081 against 0.152, the Mosaic
# solve 0.231 against 0.256; forward kernels GDN 0.599 against 0.649, KDA 1.324 (1.378 with INVERSE_IN_PASS off,
# 1.383 with 16 as well). The whole R of a forward alone by one Triton kernel a chunk instead (block forward
# substitution on 16 x 16 blocks) took 0.146 ms with bf16x3 products against 0.062 + 0.083 here (run34a; reverted,
# history 2c7d932).
DIAG_INVERSE_BLOCK = 32
# DIAG_INVERSE_WARPS: the inversion kernel's warps a block (read when traced). H200, KDA 8 x 4096 (run33d): 32 x 32
# blocks 0.062 ms with 1, 0.143 with 2, 0.158 with 4; 16 x 16 blocks on 2 warps 0.121 (0.041 on 1, run30b).
DIAG_INVERSE_WARPS = 1


def invert_diagonal_blocks(A, *, C, interpret, block=SUB, beta=None):
    """A [B, H, Tp, C] fp32 (strictly lower per chunk) with each `block` x `block` (16 or 32) diagonal block L
    replaced, in place, by (I + L)^-1 - I, the form the solves take with diag_inverse = block. With beta [B, Tp, H]
    (a forward that saves the unscaled key Gram A = KK for the backward): a new array, Diag(beta) A with its diagonal
    blocks so replaced (A itself unchanged), one program per diagonal block's rows."""
    B, H, Tp, _ = A.shape
    if block not in (SUB, 2 * SUB) or C % block:
        raise ValueError(f"invert_diagonal_blocks takes blocks of {SUB} or {2 * SUB} dividing C = {C}, got {block}")
    if beta is not None and beta.shape != (B, Tp, H):
        raise ValueError(f"invert_diagonal_blocks: beta must be [B, Tp, H] = {[B, Tp, H]}, got {list(beta.shape)}")
    params = dict(out_shape=jax.ShapeDtypeStruct(A.shape, A.dtype), interpret=interpret,
                  compiler_params=compiler_params(num_warps=DIAG_INVERSE_WARPS, num_stages=1),
                  name="lineattn_invert_diagonal_blocks")
    nb = C // block
    if beta is not None:
        rows = pl.BlockSpec((None, None, block, C), lambda b, h, i: (b, h, i, 0))
        return pallas_call(
            functools.partial(_scaled_diagonal_inverse_kernel, nb=nb), grid=(B, H, Tp // block),
            in_specs=[rows, pl.BlockSpec((None, block, None), lambda b, h, i: (b, i, h))], out_specs=rows, **params,
        )(A, beta)
    spec = pl.BlockSpec((None, None, block, block), lambda b, h, i: (b, h, i, i % nb))
    return pallas_call(
        _invert_diagonal_block_kernel, grid=(B, H, Tp // block), in_specs=[spec], out_specs=spec,
        input_output_aliases={0: 0}, **params,
    )(A)


# ---- The Gram matrices for a gate equal across K (GDN, DeltaNet: the `scalar` path) ----
# The decay then factors out of the products, P_ij = (x_i . k_j) e^(G_i - G_j): one program per chunk, the products
# on the raw inputs (bf16 operands on the tensor cores for bf16 inputs: exact products) and the [C, C] decay taken
# pair by pair, masked before the exp (its exponent never above 0: exact for any g <= 0, no reference row).


def scalar_decay(g_ref):
    """From one chunk of a scalar log gate [C]: its in-chunk cumsum G as a column [C, 1], the decay
    D_ij = e^(G_i - G_j) for j <= i (0 above the diagonal) [C, C], and G_C (the chunk's sum)."""
    g = g_ref[...].astype(f32)
    Gs = jnp.cumsum(g)
    C = g.shape[0]
    decay = exp(jnp.where(_iota((C, C), 1) <= _iota((C, C), 0), Gs[:, None] - Gs[None, :], -jnp.inf))
    return Gs[:, None], decay, jnp.sum(g)


def _gram_scalar_kernel(q_ref, k_ref, g_ref, beta_ref, m_ref, a_ref, *gated_refs, C, scale, prec, delta, bk):
    """gated_refs: Qin, Kg (or none: a state pass that applies the row factors itself, `forward`'s row_gate)."""
    i, j = _iota((C, C), 0), _iota((C, C), 1)
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
    g = g_ref[...].astype(f32)
    if g.ndim == 1:  # a gate equal across K: one cumsum, e^(G_C) broadcast over K for the state passes
        G_ref[...] = jnp.cumsum(g)
        dend_ref[...] = jnp.broadcast_to(exp(jnp.sum(g)), dend_ref.shape)
        return
    G = jnp.cumsum(g, axis=0)
    G_ref[...] = G
    dend_ref[...] = exp(jnp.sum(g, axis=0))
    if spread_ref:  # each 16-row block's max |G - G_r| over this K tile (r: the block's middle row)
        rows, nb = _iota(G.shape, 0), G.shape[0] // SUB
        spreads = jnp.zeros((nb,), f32)
        for a, mid in enumerate(middle_rows(G)):
            spread = jnp.max(jnp.where(rows // SUB == a, jnp.abs(G - mid), 0.0))
            spreads = jnp.where(_iota((nb,), 0) == a, spread, spreads)
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


# ---- The solve on the whole chunk tile by block doubling ("solve": "full") ----
# SOLVE_PREC: the doubling products' precision for bf16 inputs (read when a call is traced). "bf16" (one pass
# instead of three) costs accuracy where keys are correlated (CPU, Triton solve, T = 509, K = V = 128, bf16 inputs,
# relative RMS against the fp32 XLA chunk form on the same rounded inputs; keys at cosine ~0.8 to a shared
# direction, gates in (-0.1, 0)): DeltaNet o 5.2e-3 against 4.1e-3, dk 6.8e-3 against 4.8e-3, dv 6.1e-3 against
# 3.8e-3; KDA o 5.3e-3 against 5.0e-3, dg 6.1e-3 against 5.1e-3. With random unit keys it changed nothing.
SOLVE_PREC = "bf16x3"
# For bf16 inputs (fp32 inputs: "ieee"), read when a call is traced: the Gram kernel's products and the solve's
# U = R Diag(b) V, W = R Diag(b) Kin (stored in bf16 either way). H200, 8 x 4096 x 16 x 128 (run8a/b profiles):
# U, W in bf16 0.54 ms for the solve against 0.81 in tf32, o's relative RMS error against the fp32 XLA chunk form
# 3.3e-3 against 2.9e-3 (FLA's chunk_kda: 3.3e-3 in the same comparison, jla 4.0e-3), the gradients' at most
# +4e-4; the Gram products in bf16 as well: Gram 0.90 ms against 0.97, o 4.0e-3 (not taken). Again in run38b, with
# today's kernel: the Gram kernel 0.580 ms against 0.705, forward kernels 1.108 against 1.236, o 4.0e-3 against 3.3e-3
# (jla's 4.0e-3, FLA's 3.3e-3), dv and dbeta 3.7e-3 against 2.9e-3; still not taken: the 1.2 ms forward target stays
# out of reach, and M's bf16 products cost o its accuracy. A's products alone in bf16 cost no accuracy (CPU: o and
# every gradient within 1.5 % of tf32's; A reaches o through R, stored in bf16) but were slower, 0.718 ms against
# 0.706 in run38c: M's and A's products share the key operand, which is then needed in two precisions (history
# c17ba2a). Splitting one of M's operands into two bf16 parts, the other and A's products in bf16 (three bf16
# products where tf32 takes the issue slots of four), halves the loss (CPU, K = 128: o 3.48e-3 with the query side
# split, 3.60e-3 with the key side, against 3.22e-3 in fp32 and 3.78e-3 in bf16). That is GRAM_PREC "bf16x2" (M's
# products with the query side split, A's in bf16: `_a_prec`). H200, KDA 8 x 4096 (run39c, one profile, --check):
# the Gram kernel 0.599 ms against 0.700 (tf32) and 0.578 (bf16); forward kernels 1.127 against 1.229 and 1.107,
# forward+backward 4.166 against 4.262 and 4.150; o 3.6e-3 against 3.3e-3 and 4.0e-3, dv and dbeta 3.3e-3 against
# 2.9e-3 and 3.7e-3, dq, dk, dg unchanged. Not the default then: the target stayed out of reach and o loses a tenth
# of its accuracy. The default since run40: with the Gram kernel forming G itself (GRAM_FORMS_G) it takes the forward
# alone's kernels to 0.917 ms against 1.032 in tf32 (run40d) and the bench's forward to 1.152 ms (run40g), under the
# 1.2 ms target; the whole GPU suite passed with it (run40e: bf16, T = 16381, KDA o 3.7e-3 against 3.3e-3 in tf32,
# dbeta 3.4e-3 against 2.2e-3, the rest within 1e-4; GLA o 2.8e-3 against 2.4e-3), all within FLA's bounds.
GRAM_PREC, UW_PREC = "bf16x2", "bf16"
# The solve's implementation: "triton" (`solve_full`), "mosaic" (`solve_mgpu.solve_mosaic`: the same algebra as a
# Mosaic GPU wgmma kernel, Hopper only; bf16 inputs, chunk 64, K and V multiples of 64, SOLVE_PREC "bf16x3" with
# UW_PREC "bf16") or "auto": "mosaic" where it applies and the kernels are compiled for a Hopper GPU, else
# "triton" (the same products at the same precisions, so the same results to rounding). H200, 8 x 4096 x 16 x
# 128 (run11a): 0.415 ms (left operands from registers, `solve_mgpu.LHS_REGS`) and 0.471 (from SMEM) against
# 0.540 for the Triton kernel; the Mosaic kernel's layouts do not lower for K = 32 (run11a).
SOLVE_IMPL = "auto"
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
        raise ValueError(f"chunk_fwd.GRAM_IMPL must be 'triton' or 'triton-fast', got {GRAM_IMPL!r}")
    return GRAM_IMPL == "triton-fast" and not scalar and delta


def mosaic_solve(exact: bool, C: int, K: int, V: int, interpret: bool) -> bool:
    """Whether the solve runs as `solve_mgpu.solve_mosaic` (see SOLVE_IMPL)."""
    fits = not exact and C == 64 and K % 64 == 0 and V % 64 == 0 and (SOLVE_PREC, UW_PREC) == ("bf16x3", "bf16")
    if SOLVE_IMPL == "mosaic":
        return True  # solve_mosaic raises a ValueError where it does not fit
    return SOLVE_IMPL == "auto" and fits and not interpret and hopper()
# R = (I + A)^-1 for the unit lower triangular I + A of one chunk, in registers, from X_1 = I by
# X_2b = X_b - X_b A_b X_b, A_b = A restricted to the blocks below the diagonal inside each diagonal block of 2b
# (X_b is block diagonal with inverted diagonal blocks of size b): the recursive block inverse
# [[L11, 0], [L21, L22]]^-1 = [[X11, 0], [-X22 L21 X11, X22]] for all blocks of one size at once, so the same
# numbers as block forward substitution (no power series: exact for correlated keys too). log2(C) - 1 pairs of
# C x C x C products at `inv_prec` ("bf16x3": three bf16 tensor-core passes; "ieee" for fp32 inputs), then
# U = R Diag(b) V, W = R Diag(b) Kin. Optionally writes R (fp32) for the backward. (A kernel on 16 x 16 blocks, each
# diagonal block inverted by doubling and then block forward substitution with only the ten nonzero blocks'
# products, was slower on the H200: 0.91 ms against 0.81 at 8 x 4096 x 16 x 128, run8b; removed.)


def _invert_unit_lower(A, n, inv_prec, diag_inverse=0):
    """(I + A)^-1 for a strictly lower triangular [n, n] A by the block doubling above; diag_inverse (16 or 32; 0:
    none): A's diagonal blocks of that size hold their inverses' strictly lower parts already (X_b - I), the
    doubling starts there."""
    i, j = _iota((n, n), 0), _iota((n, n), 1)
    if diag_inverse:
        X, b = jnp.where(i == j, 1.0, jnp.where(i // diag_inverse == j // diag_inverse, A, 0.0)), diag_inverse
    else:
        X, b = jnp.where(i == j, 1.0, jnp.where((i // 2 == j // 2) & (i != j), -A, 0.0)), 2  # X_2 = I - A_1
    while b < n:
        Ab = jnp.where((i // (2 * b) == j // (2 * b)) & (i // b != j // b), A, 0.0)
        X = X - dot(dot(X, Ab, inv_prec), X, inv_prec)
        b *= 2
    return X


def gate_factor(G_ref, d=slice(None)):
    """e^G for a chunk's rows and the channels d, from G_ref [C, K] (a channel gate) or [C] (a scalar gate: a
    column [C, 1] that broadcasts over the channels)."""
    return exp(G_ref[:, d]) if len(G_ref.shape) == 2 else exp(G_ref[...])[:, None]


def _solve_full_kernel(a_ref, k_ref, v_ref, G_ref, beta_ref, w_ref, u_ref, *r_ref, C, prec, inv_prec, kk,
                       diag_inverse=0):
    beta = beta_ref[...].astype(f32)[:, None]
    A = beta * a_ref[...] if kk else a_ref[...]  # kk: a_ref holds the unscaled key Gram KK (strictly lower)
    X = _invert_unit_lower(A, C, inv_prec, diag_inverse)
    u_ref[...] = dot(X, beta * v_ref[...].astype(f32), prec).astype(u_ref.dtype)
    w_ref[...] = dot(X, beta * k_ref[...].astype(f32) * gate_factor(G_ref), prec).astype(w_ref.dtype)
    if r_ref:
        r_ref[0][...] = X


def solve_full(A, k, v, G, beta, *, C, store, prec, inv_prec, warps, interpret, with_r=False, kk=False,
               diag_inverse=0):
    """W, U [B, H, Tp, .] (and R [B, H, Tp, C] fp32 when with_r) by `_solve_full_kernel`; G [B, Tp, H, K], or
    [B, Tp, H] for a gate equal across K; kk: A is the unscaled key Gram (A = Diag(beta) KK is formed in the
    kernel). diag_inverse (16 or 32): A's diagonal blocks of that size are their inverses' strictly lower parts
    (`invert_diagonal_blocks`)."""
    B, Tp, H, K = k.shape
    V, N = v.shape[-1], Tp // C
    tok = lambda D: pl.BlockSpec((None, C, None, D), lambda b, h, n: (b, n, h, 0))
    tok1 = pl.BlockSpec((None, C, None), lambda b, h, n: (b, n, h))
    chunk_out = lambda D: pl.BlockSpec((None, None, C, D), lambda b, h, n: (b, h, n, 0))
    kernel = functools.partial(_solve_full_kernel, C=C, prec=prec, inv_prec=inv_prec, kk=kk,
                               diag_inverse=diag_inverse)
    in_specs = [chunk_out(C), tok(K), tok(V), tok(K) if G.ndim == 4 else tok1, tok1]
    out_specs = [chunk_out(K), chunk_out(V)] + ([chunk_out(C)] if with_r else [])
    return pallas_call(
        kernel,
        grid=(B, H, N),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=[jax.ShapeDtypeStruct((B, H, Tp, K), store), jax.ShapeDtypeStruct((B, H, Tp, V), store)]
        + ([jax.ShapeDtypeStruct((B, H, Tp, C), f32)] if with_r else []),
        compiler_params=compiler_params(num_warps=warps, num_stages=1),
        interpret=interpret,
        name="lineattn_chunk_solve_full",
    )(A, k, v, G, beta)


def _intra(q, k, v, g, beta, *, C, scale, store, prec, delta, warps, interpret, save=False, scalar=False,
           row_gate=False, inverse_in_pass=False):
    """The intra-chunk stage's outputs (qin, kg, w, u, m, e^(G_C) as [B, H, K, N]): the gate-cumsum kernel, the
    Gram rows (or `gram_scalar`; with a per-channel gate and the split Gram stage `gram_chunks`, which forms G
    itself, in place of both: GRAM_FORMS_G) and the whole-chunk solve. save: also the unscaled key Gram KK and R =
    (I + A)^-1 (fp32 [B, H, Tp, C]) for the backward (the Gram kernel then writes KK and the solve scales it by
    beta), G and the chunk flags (see `forward`'s save). row_gate (a scalar gate, not with save): qin and kg
    None, and the scalar gate's G [B, Tp, H] last (see ROW_GATE). inverse_in_pass (not with save): R = (I + A)^-1
    [B, H, Tp, C] bf16 in w's place and Kin = k e^G [B, H, Tp, K] in u's (None for a scalar gate; see
    INVERSE_IN_PASS)."""
    K = q.shape[-1]
    exact = prec == "ieee"
    split = split_gram(scalar, delta)
    forms_g = split and GRAM_FORMS_G
    gram_prec = prec if exact else GRAM_PREC
    gram_beta = jnp.ones_like(beta) if save else beta
    if forms_g:  # (G kept, in every chunk, where the solve or the backward reads it: all but the inverse's forms)
        m, A, qin, kg, *kin, dend, flags, G = gram_chunks(q, k, g, gram_beta, C=C, scale=scale, store=store,
                                                          prec=gram_prec, interpret=interpret, kin=inverse_in_pass,
                                                          keep_g=not inverse_in_pass)
        dend = jnp.swapaxes(dend, -1, -2)  # (the state pass's swap undoes it: XLA drops both)
    else:
        G, dend, *spreads = gate_cumsum(g, C=C, K=K, interpret=interpret, spreads=split)
        if split:
            m, A, qin, kg, *kin = gram_rows(q, k, G, gram_beta, C=C, scale=scale, store=store, prec=gram_prec,
                                            delta=True, warps=warps, interpret=interpret, bk=GRAM_BK, fast_only=True,
                                            kin=inverse_in_pass)
            flags = chunk_flags(spreads[0], C // SUB)
        elif scalar:
            m, A, qin, kg = gram_scalar(q, k, g, gram_beta, C=C, scale=scale, store=store, exact=exact,
                                        delta=delta, interpret=interpret, gated=not row_gate)
            kin = []
        else:
            m, A, qin, kg, *kin = gram_rows(q, k, G, gram_beta, C=C, scale=scale, store=store, prec=gram_prec,
                                            delta=delta, warps=warps, interpret=interpret, bk=GRAM_BK,
                                            kin=inverse_in_pass)
    if split:
        m, A = gram_exact_chunks(flags, q, k, G, gram_beta, m, A, C=C, scale=scale, interpret=interpret,
                                 prec=gram_prec)
    # saved for the backward: a channel gate's G and chunk flags (a scalar gate's G is K times its g: recomputed)
    gate = (None, None) if scalar else (G, flags if split else None)
    if not delta:
        return (qin, kg, None, None, m, dend) + ((None, None, *gate) if save else ())
    # (A is final here: after the exact fix-up where there is one; with save it is the unscaled KK, kept)
    diag_inverse = min(DIAG_INVERSE_BLOCK, C) if DIAG_INVERSE and (DIAG_INVERSE_SAVE or not save) else 0
    A_solve, kk = A, save and not diag_inverse  # (kk: the solve scales A by beta itself)
    if diag_inverse:
        A_solve = invert_diagonal_blocks(A, C=C, interpret=interpret, block=diag_inverse, beta=beta if save else None)
    inv_prec = "ieee" if exact else SOLVE_PREC
    if inverse_in_pass:
        R = solve_mgpu.inverse_mosaic(A_solve, C=C, diag_inverse=diag_inverse, interpret=interpret)
        return (qin, kg, R, kin[0] if kin else None, m, dend) + ((G,) if row_gate else ())
    if mosaic_solve(exact, C, K, v.shape[-1], interpret):
        out = solve_mgpu.solve_mosaic(A_solve, k, v, G, beta, C=C, store=store, with_r=save, kk=kk,
                                      interpret=interpret, diag_inverse=diag_inverse)
    else:
        out = solve_full(A_solve, k, v, G, beta, C=C, store=store, prec=prec if exact else UW_PREC, inv_prec=inv_prec,
                         warps=SOLVE_WARPS, interpret=interpret, with_r=save, kk=kk, diag_inverse=diag_inverse)
    if save:
        w, u, R = out
        return qin, kg, w, u, m, dend, A, R, *gate
    w, u = out
    return (qin, kg, w, u, m, dend) + ((G,) if row_gate else ())


def saved_gate(saved):
    """(G, chunk flags (`chunk_flags`)) from `forward(..., save=True)`'s saved terms: (None, None) for a scalar
    gate."""
    return saved[8], saved[9]


def _state_pass_kernel(qin_ref, kg_ref, w_ref, u_ref, m_ref, dend_ref, h0_ref, o_ref, ht_ref, *extra_refs, C, N, K,
                       prec, delta, export, keep):
    """The sequential pass of one (batch, head, V tile). extra_refs: the exported states (export: chunk indices), or
    with keep every chunk's incoming state [N K, BV] and E [Tp, BV] (what the backward's states pass writes)."""
    def body(n, S):
        for slot, chunk in enumerate(export):  # the incoming state of chosen chunks (serving checkpoints)
            @pl.when(n == chunk)
            def _(slot=slot):
                extra_refs[0][slot] = S

        t = pl.ds(n * C, C)
        U = u_ref[t, :].astype(f32)
        E = U - dot(w_ref[t, :], S, prec) if delta else U
        if keep:
            extra_refs[0][pl.ds(n * K, K), :] = S.astype(extra_refs[0].dtype)
            extra_refs[1][t, :] = E.astype(extra_refs[1].dtype)
        O = dot(qin_ref[t, :], S, prec) + dot(m_ref[t, :], E, prec)
        o_ref[t, :] = O.astype(o_ref.dtype)
        return S * dend_ref[:, pl.ds(n, 1)] + dot(kg_ref[t, :], E, prec, trans_a=True)

    ht_ref[...] = jax.lax.fori_loop(0, N, body, h0_ref[...].astype(f32))


def _segment_end_kernel(kg_ref, w_ref, u_ref, dend_ref, end_ref, *, C, N, prec, delta, value_tiles):
    """One segment's recurrence from a zero start: column tiles j < value_tiles (the last grid axis) of V give its
    offset c, the tiles after give its map P's columns (started at the identity's columns with U = 0), so that
    S_end = P S_start + c."""
    j = common.program_id(3)
    K, BQ = end_ref.shape
    S = (_iota((K, BQ), 0) == _iota((K, BQ), 1) + (j - value_tiles) * BQ).astype(f32)  # zeros in a value tile
    keep = (j < value_tiles).astype(f32)

    def body(n, S):
        t = pl.ds(n * C, C)
        E = u_ref[t, :].astype(f32) * keep
        if delta:
            E = E - dot(w_ref[t, :], S, prec)
        return S * dend_ref[:, pl.ds(n, 1)] + dot(kg_ref[t, :], E, prec, trans_a=True)

    end_ref[...] = jax.lax.fori_loop(0, N, body, S)


def segment_starts(kg, w, u, dend, h0, *, C: int, nseg: int, BV: int, prec: str, delta: bool, interpret: bool,
                   kg_rows=None, inverse=None):
    """(every segment's true start [B, H, nseg, K, V] fp32, the segments' transposed maps PT [B, H, nseg, K, K])
    of the state pass over kg, w [B, H, Tp, K], u [B, H, Tp, V], dend = e^(G_C) [B, H, K, N] from h0 [B, H, K, V]:
    `_segment_end_kernel` on every segment at once (column tiles of min(BV, K): V's for the offsets, then K's for
    the maps), then `segments.chain` in fp32. PT is what the backward's reverse pass takes (`chunk_bwd`). kg_rows,
    inverse: the forms of a forward alone (`state_mgpu.zero_start_pass_mosaic`'s; its Mosaic kernel only)."""
    B, H, K, V = h0.shape
    N = dend.shape[-1]
    Tp = N * C
    BQ = min(BV, K)
    NQ = V // BQ
    if mosaic_zero_start(kg.dtype, delta, C, K, V, BQ, interpret):
        ends = state_mgpu.zero_start_pass_mosaic(kg, w, u, jnp.swapaxes(dend, -1, -2),
                                                 segments.zero_starts(B, H, nseg, K, V, K), value_tiles=NQ,
                                                 block_v=BQ, kg_rows=kg_rows, inverse=inverse, interpret=interpret)
    elif kg_rows is not None or inverse is not None:
        raise ValueError("segment_starts: kg_rows and inverse take the Mosaic zero-start pass (ZERO_START_IMPL)")
    else:
        whole, _, state, _, kn, _ = segments.block_specs(Tp, N, K, nseg, BQ)
        u_tile = pl.BlockSpec((None, None, Tp // nseg, BQ), lambda b, h, s, j: (b, h, s, jnp.minimum(j, NQ - 1)))
        ends = pallas_call(  # (a map tile reads the last V tile of u: unused)
            functools.partial(_segment_end_kernel, C=C, N=N // nseg, prec=prec, delta=delta, value_tiles=NQ),
            grid=(B, H, nseg, NQ + K // BQ),
            in_specs=[whole(K), whole(K), u_tile, kn],
            out_specs=state,
            out_shape=jax.ShapeDtypeStruct((B, H, nseg, K, V + K), f32),
            compiler_params=compiler_params(num_warps=PASS_WARPS, num_stages=PASS_STAGES),
            interpret=interpret,
            name="lineattn_chunk_state_pass_local",
        )(kg, w, u, dend)
    PT = jnp.swapaxes(ends[..., V:], -1, -2)
    return segments.chain(PT, ends[..., :V], h0, reverse=False), PT


def check_shapes(K: int, V: int, chunk_size: int):
    if not (is_pow2(K) and 16 <= K <= 256 and is_pow2(V) and 16 <= V <= 256):
        raise ValueError(f"the Pallas kernels need K and V powers of two in [16, 256], got K={K}, V={V}")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"the Pallas kernels take chunk_size 16, 32 or 64, got {chunk_size}")


# The state passes' V tile: 64, halved (down to 16) while the grid has fewer than PASS_MIN_PROGRAMS programs
# (read when a call is traced). H200, 8 x 4096, B * H = 128 (2026-11-29 run1): the forward state pass 0.31 ms with
# 64 (256 programs), 0.76 with 32, 1.7 with 16. A single long sequence (B * H = 16) gets 16 (128 programs); at
# 1 x 32768 (run9b) 32 (64 programs) took the forward pass 0.80 -> 0.77 ms but the backward's states and reverse
# passes 0.84 / 1.82 -> 0.90 / 1.99, and 64: 0.98 / 1.06 / 2.40.
PASS_MIN_PROGRAMS = 128
# PASS_MAX_BV: the largest V tile (for sweeps). 128 reads Qin, Kg, W once per (batch, head), on half the programs:
# H200, 8 x 4096 (run13d, with PASS_STAGES 2; 3 stages exceed the shared memory): forward state pass 0.63 ms and
# the backward's reverse pass 0.63 against 0.35 and 0.45 with 64.
PASS_MAX_BV = 64


# The state passes' implementation: "triton" (`_state_pass_kernel`, `chunk_bwd._reverse_ds_kernel`), "mosaic"
# (`state_mgpu`'s kernels, wgmma and TMA, Hopper only: bf16 inputs with the delta write, chunk 64, K 64 or 128,
# V tiles of 64, no exported chunks, kept states in bf16; whole sequences or segments, `segments`) or "auto":
# "mosaic" where it applies on a Hopper GPU. "mosaic" takes `pick_block_v`'s V tile, also 16 or 32 (a few long
# sequences unsegmented: slower, run15a). Read when a call is traced. H200, 8 x 4096 x 16 x 128 bf16
# (run14b profile): forward state pass 0.206 ms against 0.352, with the kept states 0.307 against 0.463, reverse
# pass 0.264 against 0.447; kernels fwd 1.602 against 1.742 ms, fwd+bwd 5.089 against 5.429 (GDN 0.978 / 4.007
# against 1.120 / 4.340); o and the five gradients' errors against the fp32 XLA chunk form unchanged to two digits.
PASS_IMPL = "auto"
# ROW_GATE: in a forward alone with a scalar gate (GDN) and the Mosaic state pass, the pass reads the raw q and k
# and applies the gate as row factors, O = Diag(scale e^G) (q S) + M E and Kg^T E = k^T Diag(e^(G_C - G)) E, so the
# scalar Gram kernel writes no Qin, Kg (2 K bf16 values per token and head). Read when traced. H200, GDN 8 x 4096
# (run30a): scalar Gram 0.145 ms against 0.238, state pass 0.253 against 0.206; forward kernels 0.715 against 0.760.
ROW_GATE = True
# INVERSE_IN_PASS: in a forward alone with the delta write and the Mosaic state pass, the solve writes R = (I + A)^-1
# alone (`solve_mgpu.inverse_mosaic`, bf16) and the state pass forms E = R (Diag(beta) V - Diag(beta) (Kin S)) from
# the raw v (W = R Diag(beta) Kin, U = R Diag(beta) V): no W, U are formed or written. Kin = k e^G comes from the
# Gram kernel (a channel gate) or, with ROW_GATE, is the raw k with the row factor e^G. Read when traced. H200, 8 x
# 4096 (run30a, 16 x 16 diagonal blocks): GDN inverse 0.152 ms against the solve's 0.241, state pass 0.278 against
# 0.253, forward kernels 0.647 against 0.715; KDA Gram 0.733 against 0.696 (Kin), inverse 0.153 against 0.256, state
# pass 0.270 against 0.207: 1.379 against 1.381, no gain. With 32 x 32 blocks (run30b) the inverse takes 0.081
# against the solve's 0.231: KDA forward kernels 1.324 against 1.378.
INVERSE_IN_PASS = True
# FORMS_IN_SEGMENTS: whether a forward alone in segments (PASS_SEGMENTS) takes those two forms too, its zero-start
# pass (`state_mgpu.zero_start_pass_mosaic`'s kg_rows and inverse) and state pass alike: True, False, or "scalar" (a
# gate equal across K only); without them it takes the pass over Qin, Kg, W and U, which its solve forms and writes.
# Read when traced. H200, forward alone at 1 x 32768, kernel time (run36a; the GPU tests passed with the plain
# form's errors in run35f): GDN 0.808 ms against 1.001 (the solve's 0.201 replaced by the inverse's 0.082, the
# scalar Gram 0.146 against 0.236 with ROW_GATE, the zero-start pass 0.241 against 0.217); KDA 1.657 against 1.624
# (its zero-start pass forming E = R (...) 0.352 against 0.215, the Gram kernel writing Kin 0.718 against 0.690).
# (Run35f's A/B of wall clocks had been inconclusive: GDN 1.358 against 1.240 ms, rounds 1.19-1.50.)
FORMS_IN_SEGMENTS = "scalar"


def forms_in_segments(scalar: bool) -> bool:
    """Whether FORMS_IN_SEGMENTS gives a forward alone in segments the raw-q/k and inverse forms, for a gate equal
    across K (scalar) or a channel gate."""
    if FORMS_IN_SEGMENTS not in (True, False, "scalar"):
        raise ValueError(f"chunk_fwd.FORMS_IN_SEGMENTS must be True, False or 'scalar', got {FORMS_IN_SEGMENTS!r}")
    return FORMS_IN_SEGMENTS is True or (FORMS_IN_SEGMENTS == "scalar" and scalar)


def mosaic_pass(dtype, delta: bool, C: int, K: int, V: int, BV: int, exporting: bool, keep_dtype,
                interpret: bool) -> bool:
    """Whether a state pass over matrices (Qin, Kg, W, ...) of `dtype` runs as `state_mgpu`'s kernel (see
    PASS_IMPL)."""
    fits = (dtype == jnp.bfloat16 and delta and C == 64 and K in (64, 128) and V % state_mgpu.BV == 0
            and BV == state_mgpu.BV and not exporting and keep_dtype in (None, jnp.bfloat16))
    if PASS_IMPL == "mosaic":  # state_pass_mosaic raises a ValueError where its shapes or dtypes do not fit
        if not delta or exporting:
            raise ValueError("PASS_IMPL 'mosaic' takes the delta write without exported chunks")
        return True
    return PASS_IMPL == "auto" and fits and not interpret and hopper()


# PASS_SEGMENTS: a few long sequences (see `segments.pick_segments`) run the forward's state pass in segments of
# chunks side by side: `segment_starts` (a zero-start pass per segment over V + K columns, then a chain in XLA) gives
# each segment's true start and its map, and where the forward saves for the backward, the backward's zero-start
# reverse pass then needs V columns only, taking the maps from here (transposed): the K extra columns are paid once.
# "always" (the default since run35a) segments a forward that saves nothing too: GDN at 1 x 32768, with the Mosaic
# zero-start and state passes in place of the unsegmented Triton pass (0.785 ms of 1.308 of kernels, run34e-f), 1.233
# ms a call against 1.539, KDA 1.910 against 2.173 (run35a A/B, 3 interleaved rounds; at 8 x 4096 the grid is large
# enough unsegmented: no change). "save" segments only a forward that saves for the backward (the Triton passes gained
# nothing in run13a: 2.469 against 2.471 ms), "never" none. Read when a call is traced; not with export_chunks.
PASS_SEGMENTS = "always"


# ZERO_START_IMPL: the segments' zero-start pass in the forward, "triton" (`_segment_end_kernel`), "mosaic"
# (`state_mgpu.zero_start_pass_mosaic`: bf16, chunk 64, the delta write, K 64 or 128, column tiles of 16-64) or
# "auto": "mosaic" where it fits on a Hopper GPU. Read when traced. H200, 1 x 32768 x 16 x 128 bf16, 8 segments
# (run22a profile): 0.184 ms against 0.339 for the Triton kernel, fwd+bwd kernels 4.802 against 4.952 ms; o and
# the five gradients' errors against the fp32 XLA chunk form unchanged to two digits.
ZERO_START_IMPL = "auto"


def mosaic_zero_start(dtype, delta: bool, C: int, K: int, V: int, BQ: int, interpret: bool) -> bool:
    """Whether `segment_starts` runs its zero-start pass as `state_mgpu.zero_start_pass_mosaic` (ZERO_START_IMPL)."""
    if ZERO_START_IMPL not in ("auto", "triton", "mosaic"):
        raise ValueError(f"ZERO_START_IMPL must be 'auto', 'triton' or 'mosaic', got {ZERO_START_IMPL!r}")
    if ZERO_START_IMPL == "mosaic":  # (state_mgpu's checks raise where its shapes or dtypes do not fit)
        return True
    fits = (dtype == jnp.bfloat16 and delta and C == 64 and K in (64, 128) and BQ in state_mgpu.V_TILES
            and V % BQ == 0)
    return ZERO_START_IMPL == "auto" and fits and not interpret and hopper()


def pass_segments(programs: int, N: int, V: int, save: bool, export: bool) -> int:
    """Segments per sequence of the forward's state pass (see PASS_SEGMENTS and `segments.pick_segments`)."""
    if PASS_SEGMENTS not in ("save", "always", "never"):
        raise ValueError(f"PASS_SEGMENTS must be 'save', 'always' or 'never', got {PASS_SEGMENTS!r}")
    wanted = PASS_SEGMENTS == "always" or (PASS_SEGMENTS == "save" and save)
    return segments.pick_segments(programs, N, V) if wanted and not export else 1


def pick_block_v(programs: int, V: int) -> int:
    """V tile of the state passes for a grid of `programs` (batch, head) pairs (see PASS_MIN_PROGRAMS)."""
    bv = min(V, PASS_MAX_BV)
    while bv > 16 and programs * (V // bv) < PASS_MIN_PROGRAMS:
        bv //= 2
    return bv


def _constants():
    """The module constants (upper-case names) of the modules the forward reads when traced, every one of them, so
    that none set later is missed; and whether the device is a Hopper GPU (which `mosaic_solve` asks)."""
    modules = (sys.modules[__name__], common, solve_mgpu, state_mgpu, segments)
    return tuple((name, value) for module in modules for name, value in sorted(vars(module).items())
                 if name.isupper() and isinstance(value, (bool, int, float, str, tuple))) + (hopper(),)


def _retrace_on_constants(jitted):
    """`jitted` called with the module constants' current values as its static `constants` argument: jit caches
    by static arguments, not by globals, so without it a constant set after a first call would be ignored."""
    @functools.wraps(jitted)
    def call(*args, **kwargs):
        return jitted(*args, **kwargs, constants=_constants())
    return call


@_retrace_on_constants
@functools.partial(jax.jit, static_argnames=("scale", "chunk_size", "interpret", "block_v", "warps", "only_intra",
                                             "export_chunks", "save", "states_dtype", "constants"))
def forward(q, k, v, g, beta, h0, *, scale: float, chunk_size: int = 64, interpret: bool | None = None,
            block_v: int | None = None, warps: tuple[int, int] | None = None, only_intra: bool = False,
            export_chunks: tuple[int, ...] = (), save: bool = False, states_dtype: str | None = None,
            constants: tuple = ()):
    """o [B, T, H, V] (q's dtype) and final state [B, H, K, V] fp32 of the delta rule with a per-channel gate.

    q, k [B, T, H, K] and v [B, T, H, V] (bf16 or fp32, one dtype), g [B, T, H, K] log decay per channel or
    [B, T, H] per head (fp32; the scalar path: `gram_scalar` for the Gram matrices), beta [B, T, H] or None
    (additive write), h0 [B, H, K, V] fp32. block_v, warps (intra, state pass; default (GRAM_WARPS, PASS_WARPS))
    and only_intra (return the intra stage's outputs) are for tuning and timing. The intra-chunk stage
    (`gate_cumsum`, `_gram_rows_kernel`, `_solve_full_kernel`) took 2.31 ms with the state pass at 8 x 4096 x 16 x
    128 bf16 on the H200 (run10d; benchmarks/results/README.md). (Removed on 2026-12-01 as slower in every H200
    run: the "split" family with an XLA cumsum and a 16 x 16-block solve, 4.44-8.01 ms, two single-program
    stages, "fused2" 7.15 ms and "fused" 9.40 ms; and, as redundant, "mm2", a 3-D form of the exact diagonal
    blocks.)
    export_chunks: chunk indices n whose incoming fp32 state the state pass also writes; when given, the
    return is (o, final state, S0 [B, H, len(export_chunks), K, V], w [B, H, Tp, K], u [B, H, Tp, V]) with w, u
    kernel 1's WY terms (None for the additive write), from which `lineattn.ops.checkpoints` advances S0
    inside the chunk.
    save: return (o, final state, saved) with saved = (qin, kg, w, u, m [B, H, Tp, .] in the store dtype, e^(G_C) [B,
    H, K, N], KK, R [B, H, Tp, C] fp32 (the last four None for the additive write), G [B, Tp, H, K] fp32 and the chunk
    flags [B, H, N, C / 16] (`chunk_flags`; None for a scalar gate; flags None where the Gram stage is not split), the
    segments' transposed maps PT [B, H, nseg, K, K] fp32 (None for an unsegmented pass: see PASS_SEGMENTS)), what
    `chunk_bwd.backward_fast` would otherwise recompute; with states_dtype (a dtype name, for bf16 inputs; fp32 inputs
    keep fp32) the state pass also writes every chunk's incoming state S0 [B, H, N K, V] and E = U - W S0 [B, H, Tp,
    V], appended to saved (the backward then skips its own states pass). constants: set by the wrapper (the module
    constants' values, a cache key only).
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    check_shapes(K, V, C)
    interpret = interpret_mode(interpret)
    if warps is None:
        warps = (GRAM_WARPS, PASS_WARPS)
    delta = beta is not None
    pad = -T % C
    if pad:
        pad_t = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g = map(pad_t, (q, k, v, g))
        beta = pad_t(beta) if delta else None
    Tp, N = T + pad, (T + pad) // C
    scalar = g.ndim == 3  # (its cumsum G is [B, Tp, H]; e^(G_C) is broadcast over K for the state passes)
    dt = q.dtype
    exact = dt == jnp.float32
    store = f32 if exact else dt
    if not delta:
        beta = jnp.zeros((B, Tp, H), dt)  # unused by the additive kernel

    nseg = pass_segments(B * H, N, V, save, bool(export_chunks))
    BV = block_v or pick_block_v(B * H * nseg, V)
    # (in segments, the forms need FORMS_IN_SEGMENTS and the Mosaic zero-start pass, which alone takes them)
    in_segments = forms_in_segments(scalar)  # (checked at every call, segmented or not)
    forms_fit = nseg == 1 or (in_segments and mosaic_zero_start(store, delta, C, K, V, min(BV, K), interpret))
    fused = (delta and not save and not only_intra and forms_fit
             and mosaic_pass(store, delta, C, K, V, BV, bool(export_chunks), None, interpret))
    row_gate = ROW_GATE and scalar and fused
    inverse_in_pass = INVERSE_IN_PASS and fused and (row_gate or not scalar)
    qin, kg, w, u, m, dend, *extra = _intra(
        q, k, v, g, beta, C=C, scale=scale, store=store, prec="ieee" if exact else "tf32", delta=delta,
        warps=warps[0], interpret=interpret, save=save, scalar=scalar, row_gate=row_gate,
        inverse_in_pass=inverse_in_pass)
    if only_intra:
        return qin, kg, w, u, m, dend
    if not delta:
        u = jnp.moveaxis(v, 2, 1).astype(store)
        w = qin  # unread by the additive state pass
    if row_gate or inverse_in_pass:  # the row factors [B, H, Tp] of state_pass_mosaic's raw_qk and inverse forms
        by_row = lambda *xs: [jnp.moveaxis(x.reshape(B, Tp, H), 1, 2) for x in xs]
        raw_qk = inverse = None
        if row_gate:  # Qin = Diag(scale e^G) q and Kg = Diag(e^(G_C - G)) k
            G, eG = extra[0].reshape(B, N, C, H), jnp.exp(extra[0])
            raw_qk = by_row(scale * eG, jnp.exp(G[:, :, -1:] - G))
        if inverse_in_pass:  # w holds R, u Kin (None: the raw k, whose row factor e^G joins beta's)
            beta_ = beta.astype(f32)
            inverse = (w, *by_row(beta_, beta_ * eG)) if row_gate else (w, *by_row(beta_), None)  # (b = a)
            w, u = u, v
        starts = h0.astype(f32)
        if nseg > 1:
            starts, _ = segment_starts(k if row_gate else kg, w, u, dend, h0, C=C, nseg=nseg, BV=BV, prec="bf16",
                                       delta=delta, interpret=interpret, kg_rows=raw_qk[1] if row_gate else None,
                                       inverse=inverse)
        o, ends = state_mgpu.state_pass_mosaic(
            q if row_gate else qin, k if row_gate else kg, w, u, m, jnp.swapaxes(dend, -1, -2), starts,
            out_dtype=dt, block_v=BV, raw_qk=raw_qk, inverse=inverse, interpret=interpret)
        return o[:, :T], ends if nseg == 1 else ends[:, :, -1]

    prec = "ieee" if exact else "bf16"
    # grid (B, H, segments, V tiles): the block specs of the backward's passes (`segments`)
    whole, vtile, state, per_chunk, kn, tokens = segments.block_specs(Tp, N, K, nseg, BV)
    maps = None  # the segments' transposed maps, for the backward
    if nseg == 1:
        starts = h0.astype(f32)[:, :, None]
    else:
        starts, maps = segment_starts(kg, w, u, dend, h0, C=C, nseg=nseg, BV=BV, prec=prec, delta=delta,
                                      interpret=interpret)
    n_slots = 1 << max(len(export_chunks) - 1, 0).bit_length()  # Triton blocks: powers of two
    exported = ([pl.BlockSpec((None, None, n_slots, K, BV), lambda b, h, s, j: (b, h, 0, 0, j))],
                [jax.ShapeDtypeStruct((B, H, n_slots, K, V), f32)]) if export_chunks else ([], [])
    keep = save and states_dtype is not None and not export_chunks
    kept = (f32 if exact else jnp.dtype(states_dtype)) if keep else None
    if mosaic_pass(store, delta, C, K, V, BV, bool(export_chunks), kept, interpret):
        o, ends, *s0 = state_mgpu.state_pass_mosaic(qin, kg, w, u, m, jnp.swapaxes(dend, -1, -2), starts,
                                                    out_dtype=dt, keep_dtype=kept, block_v=BV, interpret=interpret)
        ht = ends[:, :, -1]
        return (o[:, :T], ht, (qin, kg, w, u, m, dend, *extra, maps, *s0)) if save else (o[:, :T], ht)
    if keep:
        exported = ([per_chunk, vtile],
                    [jax.ShapeDtypeStruct((B, H, N * K, V), kept), jax.ShapeDtypeStruct((B, H, Tp, V), kept)])
    o, ends, *s0 = pallas_call(
        functools.partial(_state_pass_kernel, C=C, N=N // nseg, K=K, prec=prec, delta=delta, export=export_chunks,
                          keep=keep),
        grid=(B, H, nseg, V // BV),
        in_specs=[whole(K), whole(K), whole(K), vtile, whole(C), kn, state],
        out_specs=[tokens, state] + exported[0],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, V), dt), jax.ShapeDtypeStruct((B, H, nseg, K, V), f32)]
        + exported[1],
        compiler_params=compiler_params(num_warps=warps[1], num_stages=PASS_STAGES),
        interpret=interpret,
        name="lineattn_chunk_state_pass",
    )(qin, kg, w, u, m, dend, starts)
    ht = ends[:, :, -1]
    if export_chunks:
        return o[:, :T], ht, s0[0][:, :, :len(export_chunks)], (w if delta else None), (u if delta else None)
    if save:
        return o[:, :T], ht, (qin, kg, w if delta else None, u if delta else None, m, dend, *extra, maps, *s0)
    return o[:, :T], ht
