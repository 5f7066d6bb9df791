"""Chunkwise delta-rule forward as Pallas kernels (see ../shared/CHUNK_ALGORITHM.md for the algebra).

`forward` runs two stages:
  - the intra-chunk stage, parallel over (batch, head, chunk) (`_intra`): the gated Gram matrices M, A and the gated
    rows Qin, Kg (`gram`: the 16 x 16 sub-chunk reference-point trick, exact for any g <= 0), then R = (I + A)^-1
    and the WY terms W, U (`solve`);
  - the state pass, one program per (batch, head, V tile): the sequential pass over chunks with the fp32 state in
    registers, E = U - W S, O = Qin S + M E, S <- Diag(e^(G_C)) S + Kg^T E; writes O and the final state (and, for
    the backward, every chunk's S and E); on a Hopper GPU where it fits, the same as a Mosaic GPU kernel
    (`state_mgpu.state_pass_mosaic`, see PASS_IMPL). For a few long sequences the pass runs in segments of chunks
    side by side (PASS_SEGMENTS): `segment_starts` gives each segment's true start and its map, which the
    backward's reverse pass then reuses.
A forward alone on the Mosaic pass writes fewer intermediates: the solve writes R alone and the pass forms E = R
(Diag(beta) V - Diag(beta) Kin S) itself (INVERSE_IN_PASS); a scalar gate's pass also reads the raw q and k with
the gate as row factors, so its Gram kernel writes M and A only (ROW_GATE).

Precision: bf16 inputs keep bf16 intermediates (Qin, Kg, W, U, M) and run the state pass's products on bf16
tensor cores with fp32 accumulation; the Gram products take bf16x2 (M's query side in two bf16 parts, A's in bf16),
the solve's doubling bf16x3 and its U, W products bf16 (see `gram.GRAM_PREC`, `solve.UW_PREC`). fp32 inputs run
everything in exact fp32. Intermediate memory: (3 K + V + C) values per token and head in the input dtype, plus
K fp32 per chunk.
"""

from __future__ import annotations

import functools
import sys

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.pallas import common, gram, segments, solve, solve_mgpu, state_mgpu
from lineattn.ops.pallas.common import SUB, compiler_params, dot, interpret_mode, iota, is_pow2, pallas_call
from lineattn.ops.pallas.gram import chunk_flags, gate_cumsum, gram_chunks, gram_exact_chunks, gram_rows, gram_scalar
from lineattn.ops.pallas.solve import invert_diagonal_blocks, solve_full

f32 = jnp.float32


# Launch settings of the state pass (read when a call is traced; for timing sweeps through
# benchmarks/profile_pallas_kda.py --configs): its warps and its pipeline depth PASS_STAGES (H200, 8 x 4096, run8a:
# 0.35 ms with 3 stages, 0.42 with 2, 0.375 with 1).
PASS_WARPS, PASS_STAGES = 4, 3


def _intra(q, k, v, g, beta, *, C, scale, store, prec, delta, warps, interpret, save=False, scalar=False,
           row_gate=False, inverse_in_pass=False):
    """The intra-chunk stage's outputs (qin, kg, w, u, m, e^(G_C) as [B, H, K, N]): the gate-cumsum kernel, the Gram
    rows (or `gram_scalar`; with a per-channel gate and the split Gram stage `gram_chunks`, which forms G itself, in
    place of both: `gram.GRAM_FORMS_G`) and the whole-chunk solve. save: also the unscaled key Gram KK and R = (I +
    A)^-1 (fp32 [B, H, Tp, C]) for the backward (the Gram kernel then writes KK and the solve scales it by beta), G
    and the chunk flags (see `forward`'s save). row_gate (a scalar gate, not with save): qin and kg None, and the
    scalar gate's G [B, Tp, H] last (see ROW_GATE). inverse_in_pass (not with save): R = (I + A)^-1 [B, H, Tp, C] bf16
    in w's place and Kin = k e^G [B, H, Tp, K] in u's (None for a scalar gate; see INVERSE_IN_PASS)."""
    K = q.shape[-1]
    exact = prec == "ieee"
    split = gram.split_gram(scalar, delta)
    forms_g = split and gram.GRAM_FORMS_G
    gram_prec = prec if exact else gram.GRAM_PREC
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
                                            delta=True, warps=warps, interpret=interpret, bk=gram.GRAM_BK,
                                            fast_only=True, kin=inverse_in_pass)
            flags = chunk_flags(spreads[0], C // SUB)
        elif scalar:
            m, A, qin, kg = gram_scalar(q, k, g, gram_beta, C=C, scale=scale, store=store, exact=exact,
                                        delta=delta, interpret=interpret, gated=not row_gate)
            kin = []
        else:
            m, A, qin, kg, *kin = gram_rows(q, k, G, gram_beta, C=C, scale=scale, store=store, prec=gram_prec,
                                            delta=delta, warps=warps, interpret=interpret, bk=gram.GRAM_BK,
                                            kin=inverse_in_pass)
    if split:
        m, A = gram_exact_chunks(flags, q, k, G, gram_beta, m, A, C=C, scale=scale, interpret=interpret,
                                 prec=gram_prec)
    # saved for the backward: a channel gate's G and chunk flags (a scalar gate's G is K times its g: recomputed)
    gate = (None, None) if scalar else (G, flags if split else None)
    if not delta:
        return (qin, kg, None, None, m, dend) + ((None, None, *gate) if save else ())
    # (A is final here: after the exact fix-up where there is one; with save it is the unscaled KK, kept)
    inverts = solve.DIAG_INVERSE and (solve.DIAG_INVERSE_SAVE or not save)
    diag_inverse = min(solve.DIAG_INVERSE_BLOCK, C) if inverts else 0
    A_solve, kk = A, save and not diag_inverse  # (kk: the solve scales A by beta itself)
    if diag_inverse:
        A_solve = invert_diagonal_blocks(A, C=C, interpret=interpret, block=diag_inverse, beta=beta if save else None)
    inv_prec = "ieee" if exact else solve.SOLVE_PREC
    if inverse_in_pass:
        R = solve_mgpu.inverse_mosaic(A_solve, C=C, diag_inverse=diag_inverse, interpret=interpret)
        return (qin, kg, R, kin[0] if kin else None, m, dend) + ((G,) if row_gate else ())
    if solve.mosaic_solve(exact, C, K, v.shape[-1], interpret):
        out = solve_mgpu.solve_mosaic(A_solve, k, v, G, beta, C=C, store=store, with_r=save, kk=kk,
                                      interpret=interpret, diag_inverse=diag_inverse)
    else:
        out = solve_full(A_solve, k, v, G, beta, C=C, store=store, prec=prec if exact else solve.UW_PREC,
                         inv_prec=inv_prec, warps=solve.SOLVE_WARPS, interpret=interpret, with_r=save, kk=kk,
                         diag_inverse=diag_inverse)
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
    S = (iota((K, BQ), 0) == iota((K, BQ), 1) + (j - value_tiles) * BQ).astype(f32)  # zeros in a value tile
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


def _pass_with_forms(q, k, v, beta, h0, qin, kg, w, u, m, dend, G, *, scale, C, nseg, BV, inverse_in_pass,
                     interpret):
    """(o [B, Tp, H, V], final state) of a forward alone on the Mosaic state pass with its forms (see ROW_GATE,
    INVERSE_IN_PASS): the row factors [B, H, Tp] of `state_mgpu.state_pass_mosaic`'s raw_qk and inverse forms from
    the intra stage's outputs (w holds R and u Kin with inverse_in_pass; G [B, Tp, H], the scalar gate's cumsum, with
    row_gate, else None), then the pass (in nseg segments: `segment_starts` first)."""
    B, Tp, H, _ = q.shape
    row_gate = G is not None
    by_row = lambda *xs: [jnp.moveaxis(x.reshape(B, Tp, H), 1, 2) for x in xs]
    raw_qk = inverse = None
    if row_gate:  # Qin = Diag(scale e^G) q and Kg = Diag(e^(G_C - G)) k
        Gc, eG = G.reshape(B, Tp // C, C, H), jnp.exp(G)
        raw_qk = by_row(scale * eG, jnp.exp(Gc[:, :, -1:] - Gc))
    if inverse_in_pass:  # w holds R, u Kin (None: the raw k, whose row factor e^G joins beta's)
        beta_ = beta.astype(f32)
        inverse = (w, *by_row(beta_, beta_ * eG)) if row_gate else (w, *by_row(beta_), None)  # (b = a)
        w, u = u, v
    starts = h0.astype(f32)
    if nseg > 1:
        starts, _ = segment_starts(k if row_gate else kg, w, u, dend, h0, C=C, nseg=nseg, BV=BV, prec="bf16",
                                   delta=True, interpret=interpret, kg_rows=raw_qk[1] if row_gate else None,
                                   inverse=inverse)
    o, ends = state_mgpu.state_pass_mosaic(
        q if row_gate else qin, k if row_gate else kg, w, u, m, jnp.swapaxes(dend, -1, -2), starts,
        out_dtype=q.dtype, block_v=BV, raw_qk=raw_qk, inverse=inverse, interpret=interpret)
    return o, ends if nseg == 1 else ends[:, :, -1]


def _state_pass(qin, kg, w, u, m, dend, h0, *, C, nseg, BV, out_dtype, delta, warps, export_chunks, states_dtype,
                interpret):
    """(o [B, Tp, H, V], final state, *extra) of the state pass over the intra stage's outputs (for the additive
    write w is unread and u holds v), on `state_mgpu`'s kernel where it fits (`mosaic_pass`), else
    `_state_pass_kernel`. extra: with export_chunks (S0 [B, H, len(export_chunks), K, V], w, u), else the segments'
    transposed maps (None unsegmented) and, with states_dtype, every chunk's S0 and E (see `forward`'s save)."""
    B, H, Tp, K = qin.shape
    V = u.shape[-1]
    N = Tp // C
    exact = qin.dtype == jnp.float32
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
    keep = states_dtype is not None and not export_chunks
    kept = (f32 if exact else jnp.dtype(states_dtype)) if keep else None
    if mosaic_pass(qin.dtype, delta, C, K, V, BV, bool(export_chunks), kept, interpret):
        o, ends, *s0 = state_mgpu.state_pass_mosaic(qin, kg, w, u, m, jnp.swapaxes(dend, -1, -2), starts,
                                                    out_dtype=out_dtype, keep_dtype=kept, block_v=BV,
                                                    interpret=interpret)
        return o, ends[:, :, -1], maps, *s0
    if keep:
        exported = ([per_chunk, vtile],
                    [jax.ShapeDtypeStruct((B, H, N * K, V), kept), jax.ShapeDtypeStruct((B, H, Tp, V), kept)])
    o, ends, *s0 = pallas_call(
        functools.partial(_state_pass_kernel, C=C, N=N // nseg, K=K, prec=prec, delta=delta, export=export_chunks,
                          keep=keep),
        grid=(B, H, nseg, V // BV),
        in_specs=[whole(K), whole(K), whole(K), vtile, whole(C), kn, state],
        out_specs=[tokens, state] + exported[0],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, V), out_dtype), jax.ShapeDtypeStruct((B, H, nseg, K, V), f32)]
        + exported[1],
        compiler_params=compiler_params(num_warps=warps, num_stages=PASS_STAGES),
        interpret=interpret,
        name="lineattn_chunk_state_pass",
    )(qin, kg, w, u, m, dend, starts)
    ht = ends[:, :, -1]
    if export_chunks:
        return o, ht, s0[0][:, :, :len(export_chunks)], (w if delta else None), (u if delta else None)
    return o, ht, maps, *s0


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
    return PASS_IMPL == "auto" and fits and not interpret and common.hopper()


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
    return ZERO_START_IMPL == "auto" and fits and not interpret and common.hopper()


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
    modules = (sys.modules[__name__], common, gram, solve, solve_mgpu, state_mgpu, segments)
    return tuple((name, value) for module in modules for name, value in sorted(vars(module).items())
                 if name.isupper() and isinstance(value, (bool, int, float, str, tuple))) + (common.hopper(),)


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

    q, k [B, T, H, K] and v [B, T, H, V] (bf16 or fp32, one dtype), g [B, T, H, K] log decay per channel or [B, T, H]
    per head (fp32; the scalar path: `gram_scalar` for the Gram matrices), beta [B, T, H] or None (additive write), h0
    [B, H, K, V] fp32. block_v, warps (intra, state pass; default (gram.GRAM_WARPS, PASS_WARPS)) and only_intra
    (return the intra stage's outputs) are for tuning and timing. The intra-chunk stage (`gram.gate_cumsum`,
    `gram._gram_rows_kernel`, `solve._solve_full_kernel`) took 2.31 ms with the state pass at 8 x 4096 x 16 x 128 bf16
    on the H200 (run10d; benchmarks/results/README.md). (Removed on 2026-12-01 as slower in every H200 run: the
    "split" family with an XLA cumsum and a 16 x 16-block solve, 4.44-8.01 ms, two single-program stages, "fused2"
    7.15 ms and "fused" 9.40 ms; and, as redundant, "mm2", a 3-D form of the exact diagonal blocks.)
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
        warps = (gram.GRAM_WARPS, PASS_WARPS)
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
    if row_gate or inverse_in_pass:
        o, ht = _pass_with_forms(q, k, v, beta, h0, qin, kg, w, u, m, dend, extra[0] if row_gate else None,
                                 scale=scale, C=C, nseg=nseg, BV=BV, inverse_in_pass=inverse_in_pass,
                                 interpret=interpret)
        return o[:, :T], ht
    o, ht, *rest = _state_pass(qin, kg, w, u, m, dend, h0, C=C, nseg=nseg, BV=BV, out_dtype=dt, delta=delta,
                               warps=warps[1], export_chunks=export_chunks, states_dtype=states_dtype if save else None,
                               interpret=interpret)
    if export_chunks:
        return o[:, :T], ht, *rest
    if save:
        maps, *s0 = rest
        return o[:, :T], ht, (qin, kg, w if delta else None, u if delta else None, m, dend, *extra, maps, *s0)
    return o[:, :T], ht
