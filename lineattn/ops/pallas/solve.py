"""The solve of the chunkwise forward: R = (I + A)^-1 for each chunk's unit lower triangular I + A, and the WY terms
U = R Diag(beta) V, W = R Diag(beta) Kin (see ../shared/CHUNK_ALGORITHM.md).

  - `invert_diagonal_blocks` (DIAG_INVERSE): each 32 x 32 (DIAG_INVERSE_BLOCK) diagonal block of I + A inverted in
    fp32 by forward substitution, in place in a forward alone, into a new array where the forward keeps A for the
    backward (DIAG_INVERSE_SAVE);
  - `solve_full`: R for the whole chunk by block doubling from those blocks (the same numbers as block forward
    substitution, 16 -> 32 -> 64), then U and W; on a Hopper GPU, for bf16 at chunk 64, the same algebra as a Mosaic
    GPU kernel (`solve_mgpu.solve_mosaic`, see SOLVE_IMPL).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.pallas import common
from lineattn.ops.pallas.common import SUB, compiler_params, dot, exp, iota, pallas_call

f32 = jnp.float32


def unit_lower_inverse_exact(L):
    """(I + L)^-1 for a strictly lower triangular [n, n] L (fp32) by forward substitution: row c of the inverse
    is final once the rows above it are, and then leaves -L[:, c] times itself in every row below (exact fp32)."""
    n = L.shape[0]
    rows, cols = iota((n, n), 0), iota((n, n), 1)
    X = jnp.where(rows == cols, 1.0, 0.0)
    for c in range(n - 1):  # (a Python loop: Triton's lowering refuses `fori_loop(..., unroll=True)`)
        x_c = common.row_of(X, c, rows)  # [1, n]
        l_c = jnp.sum(jnp.where(cols == c, L, 0.0), axis=1, keepdims=True)  # [n, 1], zero at rows <= c
        X = X - l_c * x_c
    return X


def _diagonal_inverse(load, n):
    """(I + L)^-1 - I for a strictly lower diagonal block L of n = 16 or 32 rows, as {(r, c): its 16 x 16 block}
    (r, c: row and column blocks inside it); load(r, c) gives L's 16 x 16 block (r, c) in fp32. A 32 x 32 block
    [[L1, 0], [L21, L2]]: its halves by forward substitution, then the inverse's corner -X2 L21 X1 by two fp32
    products."""
    eye = jnp.where(iota((SUB, SUB), 0) == iota((SUB, SUB), 1), 1.0, 0.0)
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


# ---- The solve on the whole chunk tile by block doubling ("solve": "full") ----
# SOLVE_PREC: the doubling products' precision for bf16 inputs (read when a call is traced). "bf16" (one pass
# instead of three) costs accuracy where keys are correlated (CPU, Triton solve, T = 509, K = V = 128, bf16 inputs,
# relative RMS against the fp32 XLA chunk form on the same rounded inputs; keys at cosine ~0.8 to a shared
# direction, gates in (-0.1, 0)): DeltaNet o 5.2e-3 against 4.1e-3, dk 6.8e-3 against 4.8e-3, dv 6.1e-3 against
# 3.8e-3; KDA o 5.3e-3 against 5.0e-3, dg 6.1e-3 against 5.1e-3. With random unit keys it changed nothing.
SOLVE_PREC = "bf16x3"
# UW_PREC: for bf16 inputs (fp32 inputs: "ieee"), read when a call is traced: the precision of the solve's
# U = R Diag(b) V, W = R Diag(b) Kin (stored in bf16 either way). H200, 8 x 4096 x 16 x 128 (run8a/b profiles):
# U, W in bf16 0.54 ms for the solve against 0.81 in tf32, o's relative RMS error against the fp32 XLA chunk form
# 3.3e-3 against 2.9e-3 (FLA's chunk_kda: 3.3e-3 in the same comparison, jla 4.0e-3), the gradients' at most +4e-4.
UW_PREC = "bf16"
# The Triton solve's warps (read when traced; H200, 8 x 4096, runs 4-5: 4 warps 1.22 ms against 1.63 with 8, timed
# alone).
SOLVE_WARPS = 4
# The solve's implementation: "triton" (`solve_full`), "mosaic" (`solve_mgpu.solve_mosaic`: the same algebra as a
# Mosaic GPU wgmma kernel, Hopper only; bf16 inputs, chunk 64, K and V multiples of 64, SOLVE_PREC "bf16x3" with
# UW_PREC "bf16") or "auto": "mosaic" where it applies and the kernels are compiled for a Hopper GPU, else
# "triton" (the same products at the same precisions, so the same results to rounding). H200, 8 x 4096 x 16 x
# 128 (run11a): 0.415 ms (left operands from registers, `solve_mgpu.LHS_REGS`) and 0.471 (from SMEM) against
# 0.540 for the Triton kernel; the Mosaic kernel's layouts do not lower for K = 32 (run11a).
SOLVE_IMPL = "auto"


def mosaic_solve(exact: bool, C: int, K: int, V: int, interpret: bool) -> bool:
    """Whether the solve runs as `solve_mgpu.solve_mosaic` (see SOLVE_IMPL)."""
    fits = not exact and C == 64 and K % 64 == 0 and V % 64 == 0 and (SOLVE_PREC, UW_PREC) == ("bf16x3", "bf16")
    if SOLVE_IMPL == "mosaic":
        return True  # solve_mosaic raises a ValueError where it does not fit
    return SOLVE_IMPL == "auto" and fits and not interpret and common.hopper()


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
    i, j = iota((n, n), 0), iota((n, n), 1)
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
