"""The sequential state passes as Mosaic GPU kernels (wgmma, TMA; Hopper), in place of the Triton kernels where
`chunk_fwd.PASS_IMPL` picks them: the forward's pass (`state_pass_mosaic`, for `chunk_fwd._state_pass_kernel`)
and the backward's reverse pass (`reverse_pass_mosaic`, for `chunk_bwd._reverse_ds_kernel`); and the forward's
zero-start pass of the segments (`zero_start_pass_mosaic`, for `chunk_fwd._segment_end_kernel`, where
`chunk_fwd.ZERO_START_IMPL` picks it).

One CTA (one warpgroup) per (batch, segment, head, V tile of bv = 16, 32 or 64): the fp32 state (or its
cotangent) [K, bv] stays in registers (the WGMMA accumulator layout) across the segment's chunks, which
`plgpu.emit_pipeline` streams in by TMA (double buffered); each chunk's outputs leave through two SMEM slots by TMA.
The forward's pass without kept states may instead run two compute warpgroups a CTA, each on its own V tile, fed by
a third that issues the loads of the tiles they share (`plgpu.emit_pipeline_warp_specialized`; PASS_WARPGROUPS).
A sequence is one segment unless the caller splits it (`segments`: each segment then starts from its true start,
or, in reverse, its end cotangent, given). Per chunk, with S rounded to bf16 in SMEM:
    forward:  E = U - W S,   O = Qin S + M E,   S <- Diag(e^(G_C)) S + Kg^T E
    reverse:  dE = M^T dO + Kg dS,   dS <- Diag(e^(G_C)) dS + Qin^T dO - W^T dE
(X^T: X's SMEM tile read transposed). The same products at the same precisions as the Triton kernels (bf16
operands, fp32 accumulation). A forward alone may take two other forms of the forward pass (`state_pass_mosaic`'s
raw_qk and inverse): E = R (Diag(beta) V - Diag(beta) Kin S) from R = (I + A)^-1 and the raw v, and for a scalar
gate the raw q and k with the gate's row factors. Without a GPU they run in the Mosaic GPU interpreter.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lineattn.ops.pallas.solve_mgpu import _ROW, _interpret_params, _load, _smem

f32, bf16 = jnp.float32, jnp.bfloat16
BV = 64  # the V tile that PASS_IMPL "auto" takes (the one measured); 16 and 32 run too (PASS_IMPL "mosaic")
V_TILES = (16, 32, 64)  # (128 would hold the [K, 128] fp32 state and its accumulators in too few registers)
# PASS_WARPGROUPS: compute warpgroups a CTA of the forward's state pass without kept states (`state_pass_mosaic`'s
# warpgroups), taken where the grid keeps PASS_MIN_CTAS CTAs or more; MEMORY_REGISTERS: the registers a thread of
# the memory warpgroup keeps (the compute warpgroups share the rest). Read when traced. H200, forward alone at 8 x
# 4096 x 16 x 128 (run31a): 128 CTAs of two warpgroups (one wave on 132 SMs) against 256 of one (two waves, one CTA
# an SM by shared memory): the pass 0.177 ms against 0.279 for GDN, 0.203 against 0.266 for KDA; forward kernels GDN
# 0.498 against 0.599, KDA 1.260 against 1.322. (Two warpgroups in the pass that keeps S and E for the backward,
# sending them from the bf16 operand buffers, took 0.315 ms against 0.306 in run31b: not kept, history 70c9934.)
PASS_WARPGROUPS, PASS_MIN_CTAS, MEMORY_REGISTERS = 2, 128, 40


def _operand(shape, bv):
    """Swizzled SMEM for a bf16 wgmma operand. wgmma needs one swizzle on both operands: the V tile's rows (bv bf16,
    2 bv bytes) set it, and the [C, K] tiles (W, Qin, Kg, M) take the same."""
    return _smem(shape, bf16, swizzle=min(128, 2 * bv))


def _spec(shape, index_map, bv):
    """A pipelined bf16 block in SMEM as `_operand`'s (the form TMA and wgmma take)."""
    return plgpu.BlockSpec(shape, index_map, transforms=_operand(shape, bv).transforms)


@dataclasses.dataclass(frozen=True)
class _In:
    """A pipelined input of a pass: its name (how a step finds its SMEM slot), the array, and its block each chunk:
    "CK" a [C, K] tile, "CC" [C, C], "CV" [C, the value columns], "K" e^(G_C) [K], "C" row factors [C]; by_token: a
    raw input [B, Tp, H, D] (else head-major, [B, H, Tp, D], or [B, H, Tp] for row factors)."""
    name: str
    array: jax.Array
    block: str
    by_token: bool = False


def _check(name, inputs, dend, state, C, bv, value_cols):
    """The segment count, after ValueErrors naming what does not fit: the state [B, H, K, value_cols] (one segment)
    or [B, H, nseg, K, value_cols], value_cols V or the zero-start pass's V + K; dend = e^(G_C) [B, H, N, K] with nseg
    dividing N; chunk_size 64, K 64 or 128, block_v in V_TILES dividing value_cols; and every input bf16 ([C, *]
    tiles) and of its shape for Tp = N C."""
    tiles = [x for x in inputs if x.block in ("CK", "CC", "CV")]
    if any(x.array.dtype != bf16 for x in tiles):
        raise ValueError(f"{name} takes bf16 matrices, got {[f'{x.name} {x.array.dtype}' for x in tiles]}")
    B, H, K = state.shape[0], state.shape[1], state.shape[-2]
    if C != 64 or K not in (64, 128) or bv not in V_TILES or value_cols % bv:
        raise ValueError(f"{name} takes chunk_size 64, K 64 or 128 and block_v in {V_TILES} dividing V, got {C}, "
                         f"{K}, {bv} and V = {value_cols}")
    nseg = state.shape[2] if state.ndim == 5 else 1
    N = dend.shape[2] if dend.ndim == 4 else -1
    if dend.shape != (B, H, N, K) or state.shape not in ((B, H, K, value_cols), (B, H, nseg, K, value_cols)) \
            or N % nseg:
        raise ValueError(f"{name}: dend must be [B, H, N, K] = {(B, H, 'N', K)} and the state [B, H, K, V] = "
                         f"{(B, H, K, value_cols)} or [B, H, nseg, K, V] with nseg dividing N, got {dend.shape} and "
                         f"{state.shape}")
    Tp = N * C
    width = {"CK": K, "CC": C, "CV": next(x.array.shape[-1] for x in tiles if x.block == "CV")}
    want = lambda x: (B, H, Tp) if x.block == "C" else ((B, Tp, H) if x.by_token else (B, H, Tp)) + (width[x.block],)
    bad = {x.name: (x.array.shape, want(x)) for x in inputs if x.block != "K" and x.array.shape != want(x)}
    if bad:
        raise ValueError(f"{name}: the inputs must be [B, Tp, H, D] (raw), [B, H, Tp, D] (D: K, C or V) or [B, H, Tp] "
                         f"(row factors) with B, Tp, H, K = {(B, Tp, H, K)}; (got, expected): {bad}")
    return nseg


def _pipeline_io(inputs, gmem, b, h, chunk, value_block, C, K, bv):
    """The pipeline's operands, this CTA's (batch, head) slices of the inputs' GMEM refs, and their block specs: step
    n reads chunk(n); value_block: the "CV" blocks' (width, a function giving their column tile)."""
    width, col = value_block

    def spec(block):
        if block in ("K", "C"):  # (1-D)
            return plgpu.BlockSpec((K if block == "K" else C,), lambda n: (chunk(n),))
        shape = {"CK": (C, K), "CC": (C, C), "CV": (C, width)}[block]
        return _spec(shape, (lambda n: (chunk(n), col())) if block == "CV" else (lambda n: (chunk(n), 0)), bv)

    operands = tuple(g.at[b, :, h, :] if x.by_token else g.at[b, h] for g, x in zip(gmem, inputs))
    return operands, [spec(x.block) for x in inputs]


def _row_factors(**rows):
    """The row factors given (not None) as pipelined inputs, in the order named."""
    return [_In(name, r, "C") for name, r in rows.items() if r is not None]


def _named(inputs, refs):
    """{name: ref} of a step's SMEM slots (or a body's GMEM refs), refs in the inputs' order."""
    return dict(zip((x.name for x in inputs), refs))


def _read_state(src, bar, K, bv, h_s=None):
    """An fp32 [K, bv] state tile from GMEM into registers (WGMMA layout), through the fp32 SMEM h_s, or SMEM
    scoped for it alone; bar: the barrier (slot) of the copy."""
    def through(h_s):
        plgpu.copy_gmem_to_smem(src, h_s, bar)
        plgpu.barrier_wait(bar)
        return _load(h_s)

    return through(h_s) if h_s is not None else pl.run_scoped(through, _smem((K, bv), f32))


def _write_state(S, dst, K, bv, h_s=None):
    """The fp32 state S [K, bv] into GMEM, through the fp32 SMEM h_s, or SMEM scoped for it alone."""
    def through(h_s):
        h_s[...] = S
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(h_s, dst)
        plgpu.wait_smem_to_gmem(0)

    pl.run_scoped(through, _smem((K, bv), f32)) if h_s is None else through(h_s)


def _products(*pairs_by_acc):
    """For each accumulator, the sum of its (lhs, rhs) SMEM products on the tensor cores, as fp32 arrays; the
    accumulators start at zero (the interpreter has no rule for ones initialised from a value)."""
    shapes = [(pairs[0][0].shape[0], pairs[0][1].shape[1]) for pairs in pairs_by_acc]

    def scoped(*accs):
        for acc, pairs in zip(accs, pairs_by_acc):
            for lhs, rhs in pairs:
                plgpu.wgmma(acc, lhs, rhs)
        plgpu.wgmma_wait(0)
        return tuple(acc[...] for acc in accs)

    return pl.run_scoped(scoped, *[plgpu.ACC(s, f32) for s in shapes])


def _inverse_residual(r_s, e_s, U, WS, a, b):
    """The inverse form's E = R (Diag(a) U - Diag(b) WS) [C, bv] fp32, R's right operand staged in e_s (bf16)."""
    e_s[...] = (a * U - b * WS).astype(bf16)
    plgpu.commit_smem()
    return _products([(r_s, e_s)])[0]


def _copy_out(pairs):
    """Each (SMEM slot, GMEM slice) by TMA, after the stores into the slots (the outputs leave by hand: the
    interpreter takes no predicated copies, which emit_pipeline's out_specs make)."""
    plgpu.commit_smem()
    for src, dst in pairs:
        plgpu.copy_smem_to_gmem(src, dst)


def _run(body, inputs, out_type, scratch, B, H, V, bv, nseg, name, interpret, warpgroups=1):
    """`body` on the grid (batch x segment, head, V tile): the body reads its (b, s, h, j) from `_where`. With
    warpgroups > 1, that many compute warpgroups and a memory warpgroup a CTA (axis "wg"; the scratch then holds
    its own barriers)."""
    threads = {} if warpgroups == 1 else dict(num_threads=warpgroups + 1, thread_name="wg")
    if warpgroups == 1:
        scratch = scratch + [plgpu.Barrier(num_arrivals=1, num_barriers=1)]  # (the state's first load)
    kernel = plgpu.kernel(body, out_type=out_type, scratch_types=scratch, grid=(B * nseg, H, V // bv),
                          grid_names=("bs", "h", "j"), interpret=_interpret_params(interpret), kernel_name=name,
                          **threads)
    return kernel(*inputs)


def _where(nseg):
    """This CTA's (batch, segment, head, V tile)."""
    bs = jax.lax.axis_index("bs")
    return bs // nseg, bs % nseg, jax.lax.axis_index("h"), jax.lax.axis_index("j")


def _segmented(state):
    """A state [B, H, K, V] as one segment [B, H, 1, K, V]; [B, H, nseg, K, V] as it is."""
    return state if state.ndim == 5 else state[:, :, None]


def _row_factor(row_s, C, bv):
    """A chunk's row factors [C] from SMEM as a [C, bv] column broadcast in the WGMMA layout."""
    return jax.lax.broadcast_in_dim(plgpu.load(row_s, layout=_ROW, optimized=False), (C, bv), [0])


def _decay(dend_s, K, bv):
    """e^(G_C) [K] from SMEM as a [K, bv] row broadcast in the WGMMA layout."""
    return jax.lax.broadcast_in_dim(plgpu.load(dend_s, layout=_ROW, optimized=False), (K, bv), [0])


def _warpgroups_fit(wgs: int, V: int, bv: int, keep: bool, out_dtype) -> bool:
    """Whether `state_pass_mosaic` runs as CTAs of wgs (> 1) compute warpgroups: no kept states, a bf16 o, wgs V
    tiles of bv a CTA."""
    return not keep and out_dtype == bf16 and V % (wgs * bv) == 0


def pick_warpgroups(ctas: int, V: int, bv: int, keep: bool, out_dtype) -> int:
    """The compute warpgroups a CTA of `state_pass_mosaic` takes (see PASS_WARPGROUPS) for a grid of `ctas` CTAs
    of one V tile each."""
    wgs = PASS_WARPGROUPS
    fits = wgs > 1 and _warpgroups_fit(wgs, V, bv, keep, out_dtype) and ctas // wgs >= PASS_MIN_CTAS
    return wgs if fits else 1


def state_pass_mosaic(qin, kg, w, u, m, dend, h0, *, out_dtype, keep_dtype=None, block_v: int = BV,
                      raw_qk=None, inverse=None, warpgroups: int | None = None, interpret: bool | None = None):
    """o [B, Tp, H, V] (out_dtype) and the final state [B, H, K, V] fp32 of the delta-rule state pass; with
    keep_dtype also every chunk's incoming state [B, H, N K, V] and E = U - W S [B, H, Tp, V] in keep_dtype.

    qin, kg, w [B, H, Tp, K], u [B, H, Tp, V], m [B, H, Tp, C] (bf16, C = 64), dend = e^(G_C) [B, H, N, K] fp32,
    h0 [B, H, K, V] fp32, or every segment's true start [B, H, nseg, K, V] (the segments of N / nseg chunks then
    run side by side, and the final state is each segment's end, [B, H, nseg, K, V]); block_v the V tile (16, 32
    or 64). Two forms for a forward alone (no keep_dtype), each with row factors [B, H, Tp] fp32:
    - raw_qk = (scale e^G, e^(G_C - G)) for a gate equal across K: qin and kg are the raw q and k [B, Tp, H, K],
      O = Diag(scale e^G) (q S) + M E and Kg^T E = k^T (Diag(e^(G_C - G)) E): no Qin, Kg need be written;
    - inverse = (R, a, b) with R = (I + A)^-1 [B, H, Tp, C] bf16: u is the raw v [B, Tp, H, V], w is Kin = k e^G
      (or None with raw_qk: the raw k), and E = R (Diag(a) V - Diag(b) (w S)), which is U - W S for a = beta,
      b = beta (b = beta e^G with the raw k): no W, U need be formed or written. b None: b = a (one row factor
      less to load).
    warpgroups: the compute warpgroups of a CTA, each on its own V tile, sharing the loads of every [C, K] and
    [C, C] tile (a third warpgroup issues them: `plgpu.emit_pipeline_warp_specialized`); 2 takes no keep_dtype
    and a bf16 out_dtype. None: `pick_warpgroups`."""
    raw, inv, keep = raw_qk is not None, inverse is not None, keep_dtype is not None
    if (raw or inv) and keep:
        raise ValueError("state_pass_mosaic: raw_qk and inverse are forms of a forward alone: they take no keep_dtype")
    if raw and len(raw_qk) != 2:
        raise ValueError(f"state_pass_mosaic: raw_qk is two row factors (scale e^G, e^(G_C - G)), got {len(raw_qk)}")
    if (w is None) != (raw and inv):
        raise ValueError("state_pass_mosaic: w is None with raw_qk and inverse (the W S product then takes the raw "
                         "k), and given otherwise (W, or Kin with inverse)")
    (q_row, k_row), (R, a, b) = raw_qk or (None, None), inverse or (None, None, None)
    # the pipelined inputs, the row factors last (each chunk's e^(G_C): a 1-D block of the flattened [B, H, N K])
    inputs = [_In("q", qin, "CK", raw), _In("k", kg, "CK", raw)] + ([_In("w", w, "CK")] if w is not None else [])
    inputs += [_In("R", R, "CC")] if inv else []
    inputs += [_In("u", u, "CV", inv), _In("m", m, "CC"), _In("dend", dend.reshape(*dend.shape[:2], -1), "K")]
    inputs += _row_factors(q_row=q_row, k_row=k_row, a=a, b=b)
    V, C, bv = u.shape[-1], m.shape[-1], block_v
    nseg = _check("state_pass_mosaic", inputs, dend, h0, C, bv, V)
    B, H, N, K = dend.shape
    Tp = N * C
    Ns = N // nseg
    wgs = pick_warpgroups(B * nseg * H * (V // bv), V, bv, keep, out_dtype) if warpgroups is None else warpgroups
    if wgs not in (1, 2) or (wgs > 1 and not _warpgroups_fit(wgs, V, bv, keep, out_dtype)):
        raise ValueError(f"state_pass_mosaic: warpgroups must be 1, or 2 with no keep_dtype, a bf16 out_dtype and "
                         f"2 block_v dividing V; got {warpgroups} with keep_dtype {keep_dtype}, out_dtype "
                         f"{out_dtype}, block_v {bv}, V = {V}")
    n_in = len(inputs)

    def chunk(ins, S, s_s, e_s, ek_s, o_s, kept_s, copy_out, wait_o):
        """One chunk from the state S entering it, ins its SMEM slots by name: O into o_s, then copy_out(); the next
        state. wait_o() comes before the chunk's first write into o_s (which may be ek_s: free once the products
        have read it)."""
        row = lambda name: _row_factor(ins[name], C, bv)
        s_s[...] = S.astype(bf16)
        if keep:
            kept_s[0][...] = S.astype(keep_dtype)
        plgpu.commit_smem()
        # (W S: the raw k's with raw_qk and inverse; raw q S: its own accumulator)
        WS, *QS = _products([(ins.get("w", ins["k"]), s_s)], *([[(ins["q"], s_s)]] if raw else []))
        U = _load(ins["u"]).astype(f32)
        E = _inverse_residual(ins["R"], e_s, U, WS, row("a"), row("b" if "b" in ins else "a")) if inv else U - WS
        e_s[...] = E.astype(bf16)
        if keep:
            kept_s[1][...] = E.astype(keep_dtype)
        if raw:  # (the right operand of k^T: E's rows scaled by e^(G_C - G); it may hold O too)
            if o_s is ek_s:
                wait_o()
            ek_s[...] = (E * row("k_row")).astype(bf16)
        plgpu.commit_smem()
        if raw:
            ME, KgE = _products([(ins["m"], e_s)], [(ins["k"].transpose((1, 0)), ek_s)])
            O = QS[0] * row("q_row") + ME
        else:
            O, KgE = _products([(ins["q"], s_s), (ins["m"], e_s)], [(ins["k"].transpose((1, 0)), e_s)])
        if o_s is not ek_s:
            wait_o()
        o_s[...] = O.astype(out_dtype)
        copy_out()
        return S * _decay(ins["dend"], K, bv) + KgE

    def pipeline_io(gmem, b, h, j, first):
        """The pipeline's operands and specs for this CTA's batch and head, its V tile j of wgs bv columns, from the
        segment's first chunk."""
        return _pipeline_io(inputs, gmem, b, h, lambda n: first + n, (wgs * bv, lambda: j), C, K, bv)

    def body(*refs):
        gmem, (h0_g, o_g, ht_g, *rest) = refs[:n_in], refs[n_in:]
        keep_g, (s_s, e_s, *outs_s, bar) = rest[:2 * keep], rest[2 * keep:]
        ek_s, outs_s = (outs_s[0], outs_s[1:]) if raw else (None, outs_s)
        b, sg, h, j = _where(nseg)
        cols, first = pl.ds(j * bv, bv), sg * Ns  # (this segment's first chunk)

        def step(idx, *ins_and_state):
            *ins, S = ins_and_state
            n = first + idx[0]
            slot, tok = idx[0] % 2, pl.ds(n * C, C)
            # the copies out of this slot (two chunks back) must have read it: at most the last chunk's in flight
            plgpu.wait_smem_to_gmem(len(outs_s), wait_read_only=True)
            kept_s = (outs_s[1].at[slot], outs_s[2].at[slot]) if keep else ()
            copy_out = lambda: _copy_out(
                [(outs_s[0].at[slot], o_g.at[b, tok, h, cols])]
                + ([(kept_s[0], keep_g[0].at[b, h, pl.ds(n * K, K), cols]),
                    (kept_s[1], keep_g[1].at[b, h, tok, cols])] if keep else []))
            return chunk(_named(inputs, ins), S, s_s, e_s, ek_s, outs_s[0].at[slot], kept_s, copy_out,
                         lambda: None)

        operands, in_specs = pipeline_io(gmem, b, h, j, first)
        S = plgpu.emit_pipeline(step, grid=(Ns,), in_specs=in_specs, max_concurrent_steps=2,
                                init_carry=_read_state(h0_g.at[b, h, sg, :, cols], bar.at[0], K, bv))(*operands)
        _write_state(S, ht_g.at[b, h, sg, :, cols], K, bv)

    def body_warpgroups(*refs):
        gmem, (h0_g, o_g, ht_g, (stage, bufs), bar) = refs[:n_in], refs[n_in:]
        b, sg, h, j = _where(nseg)
        wg, first = jax.lax.axis_index("wg"), sg * Ns
        cols = pl.ds((j * wgs + wg) * bv, bv)  # (this warpgroup's V tile; the memory warpgroup's is unused)
        # this warpgroup's bf16 buffers, rows of bufs[wg]: S, E and the O slot (with raw_qk also E's rows scaled,
        # in O's slot: the products have read them before O is stored)
        s_s, e_s, o_s = bufs.at[wg, pl.ds(0, K)], bufs.at[wg, pl.ds(K, C)], bufs.at[wg, pl.ds(K + C, C)]
        ek_s = o_s if raw else None

        def step(idx, *ins_and_state):
            *ins, S = ins_and_state
            ins = _named(inputs, ins)
            ins["u"] = ins["u"].at[:, pl.ds(wg * bv, bv)]  # (this warpgroup's V columns)
            tok = pl.ds((first + idx[0]) * C, C)
            copy_out = lambda: _copy_out([(o_s, o_g.at[b, tok, h, cols])])
            # one O slot: the last chunk's copy out of it must have read it
            wait_o = lambda: plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return chunk(ins, S, s_s, e_s, ek_s, o_s, (), copy_out, wait_o)

        def compute(run):
            # the state enters and leaves through fp32 SMEM sharing bytes with this warpgroup's bf16 buffers only
            st = stage.at[wg, pl.ds(0, K)]
            S = _read_state(h0_g.at[b, h, sg, :, cols], bar.at[wg], K, bv, h_s=st)
            plgpu.commit_smem()  # (every warp has read st before the first chunk writes over it)
            S = run(S)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # (the last O copy has read its slot, inside st)
            _write_state(S, ht_g.at[b, h, sg, :, cols], K, bv, h_s=st)

        operands, in_specs = pipeline_io(gmem, b, h, j, first)
        plgpu.emit_pipeline_warp_specialized(step, grid=(Ns,), in_specs=in_specs, max_concurrent_steps=2,
                                             memory_registers=MEMORY_REGISTERS, wg_axis="wg", num_compute_wgs=wgs,
                                             compute_context=compute)(*operands)

    out = [jax.ShapeDtypeStruct((B, Tp, H, V), out_dtype), jax.ShapeDtypeStruct((B, H, nseg, K, V), f32)]
    # SMEM at K = 128, bv = 64: two pipeline slots of (Qin, Kg, W, U, M, e^(G_C)) = 2 x 64.5 KB and of o (and of
    # the kept S, E: 2 x 24 KB), S and E in bf16 (24 KB): 169 KB (217 KB with keep; the fp32 state's 32 KB for its
    # first load and last store are scoped outside the pipeline; raw_qk: 8.5 KB more for the scaled E and the row
    # factors; inverse with Kin: 16 KB more for R's slots). The H200 has 227 KB per block: one CTA per SM.
    # Two warpgroups: the slots of U (or V) span both V tiles (8 KB more a slot), each warpgroup has one O slot
    # (raw_qk: the scaled E's), and its fp32 state shares bytes with its bf16 S, E, O (a RefUnion): KDA's inverse
    # form with b = a 226.5 KB, 464 bytes under the limit (with b given it does not fit).
    if wgs > 1:
        n_rows = K + 2 * C  # (S, E, O)
        scratch = [plgpu.RefUnion(_smem((wgs, n_rows // 2, bv), f32), _operand((wgs, n_rows, bv), bv)),
                   plgpu.Barrier(num_arrivals=1, num_barriers=wgs)]
    else:
        scratch = [_operand((K, bv), bv), _operand((C, bv), bv)] + [_operand((C, bv), bv)] * raw
        scratch += [_smem((2, C, bv), out_dtype)]
    if keep:
        out += [jax.ShapeDtypeStruct((B, H, N * K, V), keep_dtype), jax.ShapeDtypeStruct((B, H, Tp, V), keep_dtype)]
        scratch += [_smem((2, K, bv), keep_dtype), _smem((2, C, bv), keep_dtype)]
    o, ends, *kept = _run(body if wgs == 1 else body_warpgroups, tuple(x.array for x in inputs) + (_segmented(h0),),
                          out, scratch, B, H, V, bv * wgs, nseg, "lineattn_state_pass_mosaic", interpret,
                          warpgroups=wgs)
    return (o, ends if h0.ndim == 5 else ends[:, :, 0], *kept)


def reverse_pass_mosaic(qin, kg, w, m, dend, do, dht, *, ds_dtype, de_dtype, block_v: int = BV,
                        chunk_outputs: bool = True, interpret: bool | None = None):
    """The reverse pass of the backward from the final state's cotangent dht: every chunk's outgoing-state
    cotangent dS [B, H, N K, V] (ds_dtype), dE = M^T dO + Kg dS [B, H, Tp, V] (de_dtype) and the initial state's
    cotangent [B, H, K, V] fp32.

    qin, kg, w [B, H, Tp, K], m [B, H, Tp, C] (bf16, C = 64), dend = e^(G_C) [B, H, N, K] fp32, do [B, Tp, H, V]
    bf16, dht [B, H, K, V] fp32, or every segment's end cotangent [B, H, nseg, K, V] (the segments of N / nseg
    chunks then run side by side, and the last output is each segment's start cotangent, [B, H, nseg, K, V]);
    block_v the V tile (16, 32 or 64). chunk_outputs False: the start cotangent alone (a zero-end pass giving the
    segments' offsets, `segments`), with no per-chunk dS, dE written."""
    B, H, Tp, K = qin.shape
    V, C = do.shape[-1], m.shape[-1]
    N, bv = Tp // C, block_v
    inputs = [_In("qin", qin, "CK"), _In("kg", kg, "CK"), _In("w", w, "CK"), _In("m", m, "CC"),
              _In("dend", dend.reshape(*dend.shape[:2], -1), "K"), _In("do", do, "CV", by_token=True)]
    nseg = _check("reverse_pass_mosaic", inputs, dend, dht, C, bv, V)
    Ns = N // nseg

    def body(qin_g, kg_g, w_g, m_g, dend_g, do_g, dht_g, *rest):
        (ds_g, de_g, dh0_g, s_s, e_s, ds_out, de_out, bar) = rest if chunk_outputs else (None, None, *rest[:3], None,
                                                                                       None, rest[3])
        b, sg, h, j = _where(nseg)
        cols, last = pl.ds(j * bv, bv), sg * Ns + Ns - 1  # (this segment's last chunk)

        def step(idx, qin_s, kg_s, w_s, m_s, dend_s, do_s, dS):
            n = last - idx[0]
            slot = idx[0] % 2
            if chunk_outputs:
                plgpu.wait_smem_to_gmem(2, wait_read_only=True)  # (as the forward pass: two copies per chunk)
                ds_out.at[slot][...] = dS.astype(ds_dtype)
            s_s[...] = dS.astype(bf16)
            plgpu.commit_smem()
            dE = _products([(m_s.transpose((1, 0)), do_s), (kg_s, s_s)])[0]
            e_s[...] = (-dE).astype(bf16)  # (negated: the accumulator below only adds)
            if chunk_outputs:
                de_out.at[slot][...] = dE.astype(de_dtype)
            plgpu.commit_smem()
            dS_in = _products([(qin_s.transpose((1, 0)), do_s), (w_s.transpose((1, 0)), e_s)])[0]
            if chunk_outputs:
                _copy_out([(ds_out.at[slot], ds_g.at[b, h, pl.ds(n * K, K), cols]),
                           (de_out.at[slot], de_g.at[b, h, pl.ds(n * C, C), cols])])
            return dS * _decay(dend_s, K, bv) + dS_in

        operands, in_specs = _pipeline_io(inputs, (qin_g, kg_g, w_g, m_g, dend_g, do_g), b, h, lambda n: last - n,
                                          (bv, lambda: j), C, K, bv)
        dS = plgpu.emit_pipeline(step, grid=(Ns,), in_specs=in_specs, max_concurrent_steps=2,
                                 init_carry=_read_state(dht_g.at[b, h, sg, :, cols], bar.at[0], K, bv))(*operands)
        _write_state(dS, dh0_g.at[b, h, sg, :, cols], K, bv)

    out = [jax.ShapeDtypeStruct((B, H, N * K, V), ds_dtype), jax.ShapeDtypeStruct((B, H, Tp, V), de_dtype)]
    # SMEM at K = 128, bv = 64: two slots of (Qin, Kg, W, M, e^(G_C), dO) = 2 x 64.5 KB, dS and -dE in bf16 (24 KB), two
    # slots of the dS and dE outputs (48 KB in bf16): 201 KB
    scratch = [_operand((K, bv), bv), _operand((C, bv), bv), _smem((2, K, bv), ds_dtype), _smem((2, C, bv), de_dtype)]
    if not chunk_outputs:
        out, scratch = [], scratch[:2]
    *chunks, starts = _run(body, tuple(x.array for x in inputs) + (_segmented(dht),),
                           out + [jax.ShapeDtypeStruct((B, H, nseg, K, V), f32)], scratch, B, H, V, bv, nseg,
                           "lineattn_reverse_pass_mosaic", interpret)
    return (*chunks, starts if dht.ndim == 5 else starts[:, :, 0])


def zero_start_pass_mosaic(kg, w, u, dend, start, *, value_tiles: int, block_v: int = BV, kg_rows=None,
                           inverse=None, interpret: bool | None = None):
    """Each segment's end [B, H, nseg, K, V'] fp32 of the state recurrence S <- Diag(e^(G_C)) S + Kg^T (U - W S)
    from `start` [B, H, nseg, K, V'], writing nothing per chunk: the forward's zero-start pass of
    `chunk_fwd.segment_starts`. Column tiles j < value_tiles read U's tile j (the offsets, from a zero start); the
    tiles after run with U = 0 (the maps' columns, from the identity's).

    kg, w [B, H, Tp, K], u [B, H, Tp, V] (bf16, chunk 64), dend = e^(G_C) [B, H, N, K] fp32; block_v the column
    tile (16, 32 or 64) dividing V and V'. The forms of `state_pass_mosaic` for a forward alone, with row factors
    [B, H, Tp] fp32:
    - kg_rows = e^(G_C - G) for a gate equal across K: kg is the raw k [B, Tp, H, K] and Kg^T E = k^T (Diag(kg_rows)
      E) (raw_qk's second factor);
    - inverse = (R, a, b) with R = (I + A)^-1 [B, H, Tp, C] bf16: u is the raw v [B, Tp, H, V], w is Kin (or None
      with kg_rows: the raw k), and E = R (Diag(a) V - Diag(b) (w S)); b None: b = a."""
    raw, inv = kg_rows is not None, inverse is not None
    if (w is None) != (raw and inv):
        raise ValueError("zero_start_pass_mosaic: w is None with kg_rows and inverse (the W S product then takes the "
                         "raw k), and given otherwise (W, or Kin with inverse)")
    R, a, b = inverse or (None, None, None)
    # the pipelined inputs, the row factors last
    inputs = [_In("k", kg, "CK", raw)] + ([_In("w", w, "CK")] if w is not None else [])
    inputs += [_In("R", R, "CC")] if inv else []
    inputs += [_In("u", u, "CV", inv), _In("dend", dend.reshape(*dend.shape[:2], -1), "K")]
    inputs += _row_factors(k_row=kg_rows, a=a, b=b)
    V, C, bv, K = u.shape[-1], 64, block_v, dend.shape[-1]
    nseg = _check("zero_start_pass_mosaic", inputs, dend, start, C, bv, start.shape[-1])
    if V % bv or value_tiles != V // bv:
        raise ValueError(f"zero_start_pass_mosaic: value_tiles must be V / block_v = {V // bv}, got {value_tiles}")
    Ns = dend.shape[2] // nseg
    n_in = len(inputs)

    def body(*refs):
        gmem, (start_g, end_g, s_s, e_s, bar) = refs[:n_in], refs[n_in:]
        b, sg, h, j = _where(nseg)
        first, keep = sg * Ns, (j < value_tiles).astype(f32)

        def step(idx, *ins_and_state):
            *ins, S = ins_and_state
            ins = _named(inputs, ins)
            row = lambda name: _row_factor(ins[name], C, bv)
            s_s[...] = S.astype(bf16)
            plgpu.commit_smem()
            WS = _products([(ins.get("w", ins["k"]), s_s)])[0]  # (the raw k's with kg_rows and inverse)
            U = _load(ins["u"]).astype(f32) * keep
            E = _inverse_residual(ins["R"], e_s, U, WS, row("a"), row("b" if "b" in ins else "a")) if inv else U - WS
            e_s[...] = (E * row("k_row") if raw else E).astype(bf16)
            plgpu.commit_smem()
            return S * _decay(ins["dend"], K, bv) + _products([(ins["k"].transpose((1, 0)), e_s)])[0]

        # (a map's column tile reads U's last tile, and zeroes it)
        operands, in_specs = _pipeline_io(inputs, gmem, b, h, lambda n: first + n,
                                          (bv, lambda: jnp.minimum(j, value_tiles - 1)), C, K, bv)
        cols = pl.ds(j * bv, bv)
        S = plgpu.emit_pipeline(step, grid=(Ns,), in_specs=in_specs, max_concurrent_steps=2,
                                init_carry=_read_state(start_g.at[b, h, sg, :, cols], bar.at[0], K, bv))(*operands)
        _write_state(S, end_g.at[b, h, sg, :, cols], K, bv)

    # SMEM at K = 128, bv = 64: two slots of (Kg, W, U, e^(G_C)) = 2 x 40.5 KB, S and E in bf16 (24 KB): 105 KB
    # (inverse: 16 KB more for R's slots)
    return _run(body, tuple(x.array for x in inputs) + (start,), jax.ShapeDtypeStruct(start.shape, f32),
                [_operand((K, bv), bv), _operand((C, bv), bv)], dend.shape[0], dend.shape[1], start.shape[-1], bv, nseg,
                "lineattn_zero_start_pass_mosaic", interpret)
