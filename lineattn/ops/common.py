"""Small helpers shared by the backends. Backends see validated fp32 inputs:

    q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] or None (additive write);
    g None | [B, T, H] (scalar: fixed/head) | [B, T, H, K] (channel) | [B, T, H, K, V] (element);
    initial_state [B, H, K, V]
and return (o [B, T, H, V], final_state [B, H, K, V]), both fp32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# fp32 matmuls on GPU default to TF32; the reference paths must be exact.
PRECISION = jax.lax.Precision.HIGHEST


def einsum(spec: str, *operands: jax.Array) -> jax.Array:
    return jnp.einsum(spec, *operands, precision=PRECISION)


def log_decay_as_state(g: jax.Array | None) -> jax.Array | None:
    """The log gate broadcastable against a per-token state [..., K, V]."""
    if g is None:
        return None
    if g.ndim == 3:  # scalar per head
        return g[..., None, None]
    if g.ndim == 4:  # per key channel: scales rows of S
        return g[..., None]
    return g  # per element
