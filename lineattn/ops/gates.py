"""Forget-gate parameterisations in log space (g = log alpha <= 0), differentiable in every argument.

`dt_bias` fixes the granularity: [H] gives one gate per head from x [..., H]; [H, D] gives one gate per channel
from x [..., H, D]. `A_log` is [H] (one rate per head).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

# Log gates below this are raised to it before any recurrence: e^-120 is 0 in fp32, so the recurrence gives the same
# numbers, while the chunk forms' in-chunk cumsums stay finite (-inf - -inf is NaN) and keep their precision (a
# cumsum through -1e30 would absorb every later gate of its chunk).
LOG_GATE_FLOOR = -120.0


def floor_gate(g):
    """g with values below LOG_GATE_FLOOR raised to it (NaN stays NaN; the gradient passes where g >= the floor).
    Also used inside the Pallas kernels, on each tile of g they load."""
    return None if g is None else jnp.where(g < LOG_GATE_FLOOR, LOG_GATE_FLOOR, g)


def _rate(x, A_log, dt_bias):
    """exp(A_log) shaped to broadcast against x, after checking the three shapes agree."""
    if A_log.ndim != 1:
        raise ValueError(f"A_log must have shape [H], got {A_log.shape}")
    if dt_bias.ndim not in (1, 2) or dt_bias.shape[0] != A_log.shape[0]:
        raise ValueError(f"dt_bias must be [H] or [H, D] with H = {A_log.shape[0]}, got {dt_bias.shape}")
    if x.shape[x.ndim - dt_bias.ndim :] != dt_bias.shape:
        raise ValueError(f"x must end in dt_bias's shape {dt_bias.shape}, got {x.shape}")
    return jnp.exp(A_log).reshape(A_log.shape + (1,) * (dt_bias.ndim - 1))


def safe_gate(x: jax.Array, A_log: jax.Array, dt_bias: jax.Array, lower_bound: float = -5.0) -> jax.Array:
    """KDA's bounded gate g = lower_bound * sigmoid(exp(A_log) * (x + dt_bias)), in (lower_bound, 0).

    x [..., H] with dt_bias [H] (a gate per head) or x [..., H, D] with dt_bias [H, D] (a gate per channel); A_log
    [H]; returns g in x's shape. lower_bound: a finite number < 0."""
    if not -math.inf < lower_bound < 0:  # false for NaN too
        raise ValueError(f"lower_bound must be a finite number < 0, got {lower_bound}")
    return lower_bound * jax.nn.sigmoid(_rate(x, A_log, dt_bias) * (x + dt_bias))


def softplus_gate(x: jax.Array, A_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """Mamba2 / Gated DeltaNet gate g = -exp(A_log) * softplus(x + dt_bias), in (-inf, 0); shapes as `safe_gate`."""
    return -_rate(x, A_log, dt_bias) * jax.nn.softplus(x + dt_bias)
