"""Helpers shared by the Pallas kernels (Triton backend of `jax.experimental.pallas`).

On a machine without a GPU every `pallas_call` here runs with `interpret=True` (slow, sequential grid: for
tests). Inside a kernel there is no value slicing in the Triton backend, so every sub-block is loaded from its
ref, and rows or columns are picked out of a register tile with masks and reductions.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pl_triton

SUB = 16  # sub-chunk rows: the unit of the reference-point trick and of the blockwise inverse

# The Triton backend is deprecated in JAX 0.11 (it still works in 0.11.2); the warning says so on every call.
warnings.filterwarnings("ignore", message=".*Pallas Triton backend is deprecated.*")


def on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def hopper() -> bool:
    """Whether the default device is a Hopper GPU (sm_90: the Mosaic GPU kernels' wgmma and TMA)."""
    return on_gpu() and str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9")


def interpret_mode(interpret: bool | None) -> bool:
    """Interpret (CPU) unless a GPU is the default backend, or as forced by the caller."""
    return (not on_gpu()) if interpret is None else bool(interpret)


# FAST_EXP: in the chunk kernels (Triton) compiled for a GPU, exp(x) as one multiply by log2(e) and PTX ex2.approx.ftz
# (about 2 ulp; 0 below 2^-126; the decode kernel keeps jnp.exp) in place of libdevice's __nv_expf; read when a kernel
# is traced. Interpreted kernels keep jnp.exp. H200, 8 x 4096 x 16 x 128 (run19b): the Gram kernel 0.725 ms against
# 0.790, the Gram gradients 1.297 against 1.587, fwd+bwd 4.464 against 4.836; o and the gradients' errors unchanged to
# two digits.
FAST_EXP = True
_LOG2E = 1.4426950408889634
_asm_exp = False  # set while `pallas_call` traces a kernel that is compiled for a GPU


def exp(x):
    """e^x for fp32 x inside a kernel launched by `pallas_call` (see FAST_EXP; a 0-d x keeps jnp.exp: Triton's
    inline assembly takes tensors)."""
    if not _asm_exp or jnp.ndim(x) == 0:
        return jnp.exp(x)
    y = x * _LOG2E
    return pl_triton.elementwise_inline_asm("ex2.approx.ftz.f32 $0, $1;", args=[y], constraints="=r,r", pack=1,
                                            result_shape_dtypes=[jax.ShapeDtypeStruct(y.shape, y.dtype)])[0]


_grid_rank = 0  # the grid's rank while `pallas_call` traces a kernel named in LAST_AXIS_FASTEST, else 0


def program_id(axis: int):
    """`pl.program_id` in the grid as written, for kernels launched through `pallas_call` (see LAST_AXIS_FASTEST)."""
    return pl.program_id(_grid_rank - 1 - axis if _grid_rank else axis)


# LAST_AXIS_FASTEST: names of the Triton kernels launched with their grid reversed (comma-separated, or "*" for all;
# read when a call is traced). Triton launches a grid's first axis fastest: with (B, H, N, ...) grids, programs side
# by side then read rows of different sequences; reversed, neighbours read neighbouring rows (and the same chunk).
# H200, 8 x 4096 x 16 x 128 (run20a-b, kernel time): the Gram kernel 0.693 ms against 0.719, the chunk gradients
# 0.505 against 0.540, the WY backward 0.485 against 0.497; the Gram gradients 1.395 against 1.317 (kept in order);
# the gate cumsum and dg kernels unchanged (both move their fp32 [B, T, H, K] in and out at ~3.05 TB/s).
LAST_AXIS_FASTEST = "lineattn_chunk_gram,lineattn_chunk_bwd_chunk_grads,lineattn_chunk_wy_bwd"


def _flip(spec):
    """spec (a BlockSpec or a list of them) with its index map taking the program ids in reverse order (None, the
    whole arrays, stays None)."""
    if spec is None:
        return None
    if isinstance(spec, (list, tuple)):
        return [_flip(s) for s in spec]
    return dataclasses.replace(spec, index_map=(lambda f: lambda *ids: f(*ids[::-1]))(spec.index_map))


def pallas_call(kernel, *, interpret, grid=(), in_specs=None, out_specs=None, name=None, **kwargs):
    """`pl.pallas_call` for the Triton kernels: their `exp` takes PTX's ex2.approx while the kernel is traced for a
    GPU with FAST_EXP set (the interpreter cannot run inline assembly), and the kernels named in LAST_AXIS_FASTEST
    launch their grid reversed while their index maps and `program_id` keep the grid as written."""
    interpret = interpret_mode(interpret)
    asm = FAST_EXP and not interpret
    rank = len(grid) if LAST_AXIS_FASTEST == "*" or name in LAST_AXIS_FASTEST.split(",") else 0
    if rank:
        grid, in_specs, out_specs = grid[::-1], _flip(in_specs), _flip(out_specs)
    specs = {key: spec for key, spec in (("in_specs", in_specs), ("out_specs", out_specs)) if spec is not None}

    @functools.wraps(kernel)
    def traced(*refs):
        global _asm_exp, _grid_rank
        before = _asm_exp, _grid_rank
        _asm_exp, _grid_rank = asm, rank
        try:
            return kernel(*refs)
        finally:
            _asm_exp, _grid_rank = before

    return pl.pallas_call(traced, interpret=interpret, grid=grid, name=name, **specs, **kwargs)


def iota(shape, dim):
    """int32 indices along axis `dim` of an array of `shape` (row or column numbers, for masks)."""
    return jax.lax.broadcasted_iota(jnp.int32, shape, dim)


def row_of(x, r, rows):
    """Row r of a 2-D value x as [1, n], by a masked sum over `rows` = iota(x.shape, 0) (a kernel's values take no
    dynamic row index)."""
    return jnp.sum(jnp.where(rows == r, x, 0.0), axis=0, keepdims=True)


def over_tiles(count: int, width: int, tile, carry, loop: bool = False):
    """carry after tile(d, carry) for the column tiles d = pl.ds(t * width, width), t < count: unrolled, or (loop) as
    a `fori_loop`, where one tile's values are live at a time and Triton can pipeline the next tile's loads
    (`num_stages`)."""
    if loop and count > 1:
        return jax.lax.fori_loop(0, count, lambda t, c: tile(pl.ds(pl.multiple_of(t * width, width), width), c), carry)
    for t in range(count):
        carry = tile(pl.ds(t * width, width), carry)
    return carry


def compiler_params(num_warps: int = 4, num_stages: int = 1):
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def bf16_head(x, rounded: bool = False):
    """fp32 x cut to bf16's 8 significant bits, as fp32 (its low 16 bits cleared: truncated, or rounded to nearest
    even), by integer operations: a convert to bf16 and back is one that XLA may drop as excess precision (in the
    interpreter on a GPU), leaving x - head zero."""
    bits = jax.lax.bitcast_convert_type(x, jnp.int32)
    if rounded:
        bits = bits + jnp.int32(0x7FFF) + ((bits >> 16) & 1)
    return jax.lax.bitcast_convert_type(bits & jnp.int32(-65536), jnp.float32)


def split_bf16(x):
    """fp32 x as bf16 parts (hi, lo) with hi + lo = x to about 16 mantissa bits (hi: x rounded to bf16)."""
    hi = bf16_head(x, rounded=True)
    return hi.astype(jnp.bfloat16), (x - hi).astype(jnp.bfloat16)


def dot(a, b, precision, *, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul with fp32 accumulation. precision: "bf16" casts both operands to bf16 (tensor cores), "tf32"
    keeps fp32 operands at TF32, "bf16x3" splits fp32 operands into bf16 parts (three tensor-core products, about
    16 mantissa bits), "ieee" is exact fp32 (HIGHEST: no tensor cores), "bf16x2" splits a into bf16 parts and
    takes b in bf16 (two tensor-core products: for a b that bf16 holds exactly, such as bf16 inputs, the numbers of
    "bf16x3")."""
    if precision == "bf16x2":
        hi, lo = split_bf16(a.astype(jnp.float32))
        part = lambda x: dot(x, b, "bf16", trans_a=trans_a, trans_b=trans_b)
        return part(hi) + part(lo)
    if precision == "bf16x3":
        a, b, prec = a.astype(jnp.float32), b.astype(jnp.float32), jax.lax.DotAlgorithmPreset.BF16_BF16_F32_X3
    elif precision == "bf16":
        a, b, prec = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None
    elif precision == "tf32":
        a, b, prec = a.astype(jnp.float32), b.astype(jnp.float32), jax.lax.Precision.DEFAULT
    else:
        a, b, prec = a.astype(jnp.float32), b.astype(jnp.float32), jax.lax.Precision.HIGHEST
    dims = (((0,) if trans_a else (1,)), ((1,) if trans_b else (0,)))
    return jax.lax.dot_general(a, b, (dims, ((), ())), precision=prec, preferred_element_type=jnp.float32)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
