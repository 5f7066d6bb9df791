"""The forward's solve stage as a Mosaic GPU kernel (wgmma on Hopper): the default in place of
`solve.solve_full` (Triton), chosen by `solve.SOLVE_IMPL` ("auto": on a Hopper GPU where it fits).

One CTA (one warpgroup) per (batch, head, chunk): A [C, C] (and the chunk's k, v, G, beta) come in by TMA; R =
(I + A)^-1 by the same block doubling as `solve._invert_unit_lower` (X_2b = X_b - X_b A_b X_b), each product
on the tensor cores as three bf16 wgmmas (hi hi + hi lo + lo hi of the fp32 operands split into bf16 parts, as the
Triton kernel's "bf16x3"), from X_2 or, in a forward alone, from the 32 x 32 (or 16 x 16) diagonal blocks'
inverses that `solve.invert_diagonal_blocks` wrote into A (`solve.DIAG_INVERSE`: one or two levels instead
of five); then U = R Diag(beta) V and W = R Diag(beta) (k e^G) as one bf16 wgmma each, written back by TMA. The
register arrays live in the WGMMA accumulator layout; the products' right operands (and, without LHS_REGS, their
left ones) go through swizzled SMEM. Without a GPU it runs in the Mosaic GPU interpreter (`plgpu.InterpretGPUParams`).
`inverse_mosaic`: R alone, in bf16, for a forward alone whose state pass applies it (`chunk_fwd.INVERSE_IN_PASS`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lineattn.ops.pallas.common import interpret_mode, split_bf16

f32, bf16 = jnp.float32, jnp.bfloat16
_WG = plgpu.Layout.WGMMA
_ROW = plgpu.Layout.WGMMA.reduce(1)  # one value per row of a WGMMA-layout array


def _smem(shape, dtype, swizzle=None):
    """SMEM tiled (8 rows) and swizzled (by default for its minor dimension; wgmma wants one swizzle on both
    operands): the form wgmma operands and TMA copies take."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = swizzle or plgpu.find_swizzle(shape[-1] * itemsize * 8)
    return plgpu.SMEM(shape, dtype, transforms=(plgpu.TilingTransform((8, swizzle // itemsize)),
                                                plgpu.SwizzleTransform(swizzle)))


def _load(ref):
    """An SMEM ref into registers in the WGMMA layout."""
    return plgpu.load(ref, layout=_WG, optimized=False)


def _copy_in(copies, barrier):
    """TMA copies of (GMEM slice, SMEM ref) pairs on one barrier (num_arrivals = len(copies)), then waits."""
    for src, dst in copies:
        plgpu.copy_gmem_to_smem(src, dst, barrier)
    plgpu.barrier_wait(barrier)


# INTERPRET_RACES: the Mosaic GPU interpreter (no GPU) also checks each kernel's shared- and global-memory accesses
# for data races between its warpgroups and its TMA copies (vector clocks; slower). For tests; read when traced.
INTERPRET_RACES = False


def _interpret_params(interpret: bool | None):
    """The Mosaic GPU interpreter's parameters where `common.interpret_mode` says to interpret, else None."""
    return plgpu.InterpretGPUParams(detect_races=INTERPRET_RACES) if interpret_mode(interpret) else None


# LHS_REGS: the left operands of the wgmmas (X's bf16 parts) straight from registers instead of SMEM (fewer SMEM
# stores, 16 KB less SMEM); the Mosaic GPU interpreter takes SMEM operands only, so on the CPU they are staged
# through SMEM either way (read when a call is traced). H200, 8 x 4096 x 16 x 128 (run11a): 0.415 ms against 0.471.
LHS_REGS = True
# APPROX_MATH: the Mosaic GPU kernels' exps (here e^G of Kin) as one multiply and an ex2.approx instead of the
# accurate expansion (the Triton kernels' counterpart: `common.FAST_EXP`). H200, 8 x 4096 (run19a): the solve 0.404
# ms against 0.415 (in fwd+bwd 0.425 against 0.445), the fused Gram + solve kernel of the time (removed since) 1.167
# against 2.66; o and the gradients' errors unchanged to two digits. Read when a call is traced.
APPROX_MATH = True


def math_params():
    """The Mosaic GPU compiler parameters for APPROX_MATH."""
    return plgpu.CompilerParams(approx_math=APPROX_MATH)


def _product(lhs, rhs, bufs, regs: bool):
    """lhs @ rhs for fp32 register arrays [C, C] (WGMMA layout) on the tensor cores as three bf16 wgmmas (hi hi +
    hi lo + lo hi). bufs: [C, C] bf16 SMEM buffers for the parts: (rhs_hi, rhs_lo) with regs (the lhs parts from
    registers), else (lhs_hi, lhs_lo, rhs_hi, rhs_lo)."""
    (a_hi, a_lo), (b_hi, b_lo) = split_bf16(lhs), split_bf16(rhs)
    bufs[-2][...], bufs[-1][...] = b_hi, b_lo
    if regs:
        a_hi_op, a_lo_op = a_hi, a_lo
    else:
        bufs[0][...], bufs[1][...] = a_hi, a_lo
        a_hi_op, a_lo_op = bufs[0], bufs[1]
    plgpu.commit_smem()

    def scoped(acc):
        for a, b in ((a_hi_op, bufs[-2]), (a_hi_op, bufs[-1]), (a_lo_op, bufs[-2])):
            plgpu.wgmma(acc, a, b)
        plgpu.wgmma_wait(0)
        return acc[...]

    return pl.run_scoped(scoped, plgpu.ACC((lhs.shape[0], rhs.shape[1]), f32))


def operand_buffers(C: int, regs: bool):
    """The doubling's bf16 [C, C] SMEM operand buffers (`_product`'s bufs): two with regs, else four."""
    return [_smem((C, C), bf16) for _ in range(2 if regs else 4)]


def invert_and_apply(A_, outs, sq, regs: bool, diag_inverse: int = 0):
    """R = (I + A)^-1 for a strictly lower [C, C] fp32 A_ (registers, WGMMA layout) by block doubling
    (X_2b = X_b - X_b A_b X_b, A_b: A inside the diagonal blocks of 2b, off those of b; the products bf16x3), then
    R x for each bf16 SMEM tile x [C, D] in outs (e.g. k and v for W and U) on the tensor cores, written back in
    place. sq: `operand_buffers`; diag_inverse (16 or 32; 0: none): A_'s diagonal blocks of that size hold their
    inverses' strictly lower parts (X_b - I), and the doubling starts from them. outs empty: R alone. Returns R (fp32
    registers)."""
    C = A_.shape[0]
    i = plgpu.broadcasted_iota(jnp.int32, (C, C), 0, layout=_WG)
    j = plgpu.broadcasted_iota(jnp.int32, (C, C), 1, layout=_WG)
    zero = jnp.zeros((C, C), f32)
    if diag_inverse:
        first = diag_inverse.bit_length() - 1  # the level that doubles the inverted blocks (`invert_diagonal_blocks`)
        X = jnp.where(i == j, 1.0, jnp.where((i >> first) == (j >> first), A_, zero))
    else:
        X, first = jnp.where(i == j, 1.0, jnp.where(((i >> 1) == (j >> 1)) & (i != j), -A_, zero)), 1
    # (i, j in one block of 2b and in two blocks of b: b <= (i ^ j) < 2b; a loop over the levels, b traced: less
    # code than unrolled and no slower, H200 run19a: 0.412 ms against 0.416)
    def level(n, X):
        b = jnp.left_shift(jnp.int32(1), n)
        A_b = jnp.where(((i ^ j) >= b) & ((i ^ j) < 2 * b), A_, zero)
        return X - _product(_product(X, A_b, sq, regs), X, sq, regs)

    # (levels 1-3, inside the 16 x 16 blocks, cost 0.15 ms of the solve's 0.40 at 8 x 4096, run28a)
    X = jax.lax.fori_loop(first, C.bit_length() - 1, level, X)
    if not outs:
        return X
    if regs:
        x_op = X.astype(bf16)
    else:
        sq[0][...] = X.astype(bf16)
        x_op = sq[0]
    plgpu.commit_smem()

    def apply(*accs):
        for acc, x_s in zip(accs, outs):
            plgpu.wgmma(acc, x_op, x_s)
        plgpu.wgmma_wait(0)
        return [acc[...] for acc in accs]

    for x_s, y in zip(outs, pl.run_scoped(apply, *[plgpu.ACC(x_s.shape, f32) for x_s in outs])):
        x_s[...] = y.astype(bf16)
    return X


def solve_mosaic(A, k, v, G, beta, *, C, store, with_r=False, kk=False, interpret: bool | None = None,
                 diag_inverse: int = 0):
    """`solve.solve_full`'s outputs (W, U [B, H, Tp, .] in `store`, and R [B, H, Tp, C] fp32 when with_r) by
    the Mosaic GPU kernel above; A [B, H, Tp, C] fp32 (kk: the unscaled key Gram, scaled by beta here), k [B, Tp,
    H, K], v [B, Tp, H, V] (bf16), G [B, Tp, H, K] fp32 (or [B, Tp, H] for a gate equal across K), beta [B, Tp,
    H]. bf16 inputs only (fp32 inputs keep the exact Triton solve). interpret: the Mosaic GPU interpreter (default:
    when no GPU is the default backend). diag_inverse (16 or 32): A's diagonal blocks of that size hold their
    inverses' strictly lower parts (`solve.invert_diagonal_blocks`)."""
    if diag_inverse and kk:
        raise ValueError("solve_mosaic: diag_inverse takes A = Diag(beta) KK with its blocks inverted, not kk")
    B, Tp, H, K = k.shape
    V, N = v.shape[-1], Tp // C
    if k.dtype != bf16 or v.dtype != bf16 or store != bf16:
        raise ValueError(f"solve_mosaic takes bf16 k, v and store, got {k.dtype}, {v.dtype} and {store}")
    if C != 64 or K % 64 or V % 64:  # wgmma's 64 rows; K = 32 failed Mosaic GPU's layout inference on the H200
        raise ValueError(f"solve_mosaic takes chunk_size 64 and K, V multiples of 64, got {C}, {K} and {V}")
    beta_BHT = jnp.moveaxis(beta.astype(f32), 1, 2)  # [B, H, Tp]: each chunk's beta contiguous for its TMA copy
    scalar = G.ndim == 3
    if scalar:  # (likewise a scalar gate's G: a row factor, like beta)
        G = jnp.moveaxis(G, 1, 2)

    def body(a_g, k_g, v_g, G_g, b_g, w_g, u_g, *rest):
        r_g = rest[0] if with_r else None
        k_s, v_s, b_s, bar = rest[int(with_r):]
        b, h, n = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("n")
        rows = pl.ds(n * C, C)
        row_bcast = lambda D, ref=b_s: jax.lax.broadcast_in_dim(plgpu.load(ref, layout=_ROW), (C, D), [0])

        def inputs(a_s, G_s):  # A into registers; k_s <- Diag(beta) k e^G, v_s <- Diag(beta) v (bf16)
            copies = ((a_g.at[b, h, rows], a_s), (k_g.at[b, rows, h], k_s), (v_g.at[b, rows, h], v_s),
                      (G_g.at[b, h, rows] if scalar else G_g.at[b, rows, h], G_s), (b_g.at[b, h, rows], b_s))
            _copy_in(copies, bar.at[0])
            A_ = _load(a_s)
            G_ = row_bcast(K, G_s) if scalar else _load(G_s)
            k_s[...] = (row_bcast(K) * _load(k_s).astype(f32) * jnp.exp(G_)).astype(bf16)
            v_s[...] = (row_bcast(V) * _load(v_s).astype(f32)).astype(bf16)
            return A_ * row_bcast(C) if kk else A_

        G_smem = plgpu.SMEM((C,), f32) if scalar else _smem((C, K), f32)
        A_ = pl.run_scoped(inputs, _smem((C, C), f32), G_smem)
        X = pl.run_scoped(lambda *sq: invert_and_apply(A_, (k_s, v_s), sq, regs, diag_inverse=diag_inverse),
                          *operand_buffers(C, regs))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(k_s, w_g.at[b, h, rows])
        plgpu.copy_smem_to_gmem(v_s, u_g.at[b, h, rows])
        if with_r:
            def store_r(r_s):
                r_s[...] = X
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(r_s, r_g.at[b, h, rows])
                plgpu.wait_smem_to_gmem(0)

            pl.run_scoped(store_r, _smem((C, C), f32))
        plgpu.wait_smem_to_gmem(0)

    # SMEM: the k and v tiles (reused for W and U) throughout, then in turn A and G (fp32) while the inputs are
    # formed, the four (LHS_REGS: two) bf16 operand buffers of the doubling, and R: 32 + 48 = 80 KB at C = 64,
    # K = V = 128 (two CTAs per SM on the H200; 48 KB in all with a scalar gate). (G in a second TMA batch after
    # A's, 64 KB at the peak, was slower: 0.422 ms against 0.403 at 8 x 4096, run27b, history 251a3b4.)
    scratch = [_smem((C, K), bf16), _smem((C, V), bf16), plgpu.SMEM((C,), f32),
               plgpu.Barrier(num_arrivals=5, num_barriers=1)]
    out = [jax.ShapeDtypeStruct((B, H, Tp, K), bf16), jax.ShapeDtypeStruct((B, H, Tp, V), bf16)]
    out += [jax.ShapeDtypeStruct((B, H, Tp, C), f32)] if with_r else []
    regs = LHS_REGS and not interpret_mode(interpret)
    kernel = plgpu.kernel(body, out_type=out, scratch_types=scratch, grid=(B, H, N), grid_names=("b", "h", "n"),
                          interpret=_interpret_params(interpret), compiler_params=math_params(),
                          kernel_name="lineattn_solve_mosaic")
    return kernel(A, k, v, G, beta_BHT)


def inverse_mosaic(A, *, C: int, diag_inverse: int = 0, interpret: bool | None = None):
    """R = (I + A)^-1 [B, H, Tp, C] in bf16 for a strictly lower A [B, H, Tp, C] fp32 per chunk of C = 64
    (diag_inverse, 16 or 32: its diagonal blocks of that size hold their inverses' strictly lower parts,
    `solve.invert_diagonal_blocks`), by `invert_and_apply`'s block doubling, one CTA per (batch, head, chunk).
    For a forward alone whose state pass applies R itself (`state_mgpu.state_pass_mosaic`'s inverse,
    `chunk_fwd.INVERSE_IN_PASS`): no W, U are formed or written."""
    B, H, Tp, _ = A.shape
    if C != 64 or A.shape[-1] != C or A.dtype != f32:
        raise ValueError(f"inverse_mosaic takes chunk_size 64 and A [B, H, Tp, 64] fp32, got {C} and A "
                         f"{A.shape} {A.dtype}")

    def body(a_g, r_g, a_s, r_s, bar):
        b, h, n = jax.lax.axis_index("b"), jax.lax.axis_index("h"), jax.lax.axis_index("n")
        rows = pl.ds(n * C, C)
        _copy_in(((a_g.at[b, h, rows], a_s),), bar.at[0])
        A_ = _load(a_s)
        X = pl.run_scoped(lambda *sq: invert_and_apply(A_, (), sq, regs, diag_inverse=diag_inverse),
                          *operand_buffers(C, regs))
        r_s[...] = X.astype(bf16)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(r_s, r_g.at[b, h, rows])
        plgpu.wait_smem_to_gmem(0)

    regs = LHS_REGS and not interpret_mode(interpret)
    scratch = [_smem((C, C), f32), _smem((C, C), bf16), plgpu.Barrier(num_arrivals=1, num_barriers=1)]
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((B, H, Tp, C), bf16), scratch_types=scratch,
                          grid=(B, H, Tp // C), grid_names=("b", "h", "n"), interpret=_interpret_params(interpret),
                          compiler_params=math_params(), kernel_name="lineattn_inverse_mosaic")
    return kernel(A)
