"""Small building blocks: RMSNorm, SwiGLU MLP, rotary embeddings, and the layers' input-shape check."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lineattn.checks import check_int

RMS_EPS = 1e-6


def check_input(x, width: int, name: str = "x", dim: str = "width") -> None:
    """ValueError unless x is [B, T, width] (static shapes: free under jit); `dim` names the last axis."""
    if x.ndim != 3 or x.shape[-1] != width:
        raise ValueError(f"{name} must be [B, T, {dim}] = [B, T, {width}], got shape {tuple(x.shape)}")


def dense(in_features: int, out_features: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32, std=None):
    """A bias-free linear layer, normal(0, std) init (default std = in_features^-0.5)."""
    std = in_features**-0.5 if std is None else std
    return nnx.Linear(in_features, out_features, use_bias=False, rngs=rngs, dtype=dtype, param_dtype=param_dtype,
                      kernel_init=nnx.initializers.normal(std))


def rms_norm(features: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32):
    """An RMSNorm over the last axis (`features` wide), epsilon RMS_EPS."""
    return nnx.RMSNorm(features, epsilon=RMS_EPS, rngs=rngs, dtype=dtype, param_dtype=param_dtype)


class SwiGLU(nnx.Module):
    """down(silu(gate(x)) * up(x)); hidden size `hidden`."""

    def __init__(self, width: int, hidden: int, *, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32):
        check_int("width", width)
        check_int("hidden", hidden)
        make = functools.partial(dense, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.gate, self.up, self.down = make(width, hidden), make(width, hidden), make(hidden, width)

    def __call__(self, x_BTD):
        """x [B, T, width] -> [B, T, width]."""
        return self.down(jax.nn.silu(self.gate(x_BTD)) * self.up(x_BTD))


def rotary(x_BTND: jax.Array, positions_BT: jax.Array, theta: float = 10000.0) -> jax.Array:
    """Rotary position embedding (rotate-half convention) of x [B, T, N, D] (D even) at positions [B, T], computed
    in fp32; returns [B, T, N, D] in x's dtype."""
    D = x_BTND.shape[-1]
    if D % 2:
        raise ValueError(f"rotary embeddings need an even head dim, got {D}")
    inv_freq = theta ** (-jnp.arange(0, D, 2, dtype=jnp.float32) / D)
    angle_BTF = positions_BT[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angle_BTF)[:, :, None], jnp.sin(angle_BTF)[:, :, None]
    x = x_BTND.astype(jnp.float32)
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTND.dtype)
