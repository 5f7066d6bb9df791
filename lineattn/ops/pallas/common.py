"""Helpers shared by the Pallas kernels (Triton backend of `jax.experimental.pallas`).

On a machine without a GPU every `pallas_call` here runs with `interpret=True` (slow, sequential grid: for
tests). Inside a kernel there is no value slicing in the Triton backend, so every sub-block is loaded from its
ref, and rows or columns are picked out of a register tile with masks and reductions.
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
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


def compiler_params(num_warps: int = 4, num_stages: int = 1):
    return pl_triton.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def dot(a, b, precision, *, trans_a: bool = False, trans_b: bool = False):
    """2-D matmul with fp32 accumulation. precision: "bf16" casts both operands to bf16 (tensor cores), "tf32"
    keeps fp32 operands at TF32, "bf16x3" splits fp32 operands into bf16 parts (three tensor-core products, about
    16 mantissa bits), "ieee" is exact fp32 (HIGHEST: no tensor cores)."""
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
