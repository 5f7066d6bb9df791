"""The per-element gate as a per-channel gate on each value column.

With a per-element gate, column j of the state evolves on its own: decay by exp(g[..., :, j]) (a per-key-channel
gate), then the additive write k v_j or the delta write beta k (v_j - k^T S[:, j]), and the read q^T S[:, j] is
output channel j. So the rule on [K, V] is V rules with a channel gate on [K, 1] sharing q, k and beta: run as
V times more heads of value dim 1, any channel-gate backend (the chunk form, with its (I + A)^-1 solve) runs it
exactly. The cost is the chunk form's intra-chunk work once per column (about chunk_size times the recurrence's
FLOPs), in parallel over chunks instead of one token at a time.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def per_value_column(fn):
    """Wraps a channel-gate backend `fn(q, k, v, g, beta, *, scale, initial_state, **kw) -> (o, S, *states)` into
    one for the per-element gate g [B, T, H, K, V] (shapes as in `lineattn.ops.common`; the extra outputs are
    state exports [P, B, H, K, V])."""

    @functools.wraps(fn)
    def run(q, k, v, g, beta, *, scale: float, initial_state: jax.Array, **kwargs):
        B, T, H, K = q.shape
        V = v.shape[-1]

        def shared(x):  # [B, T, H, ...] -> [B, T, H * V, ...]: the same for every column of a head
            return jnp.broadcast_to(x[:, :, :, None], (B, T, H, V, *x.shape[3:])).reshape(B, T, H * V, *x.shape[3:])

        def state(S):  # [..., H * V, K, 1] -> [..., H, K, V]
            return jnp.moveaxis(S.reshape(*S.shape[:-3], H, V, K), -2, -1)

        o, final_state, *states = fn(
            shared(q), shared(k), v.reshape(B, T, H * V, 1), jnp.swapaxes(g, -1, -2).reshape(B, T, H * V, K),
            None if beta is None else shared(beta), scale=scale,
            initial_state=jnp.moveaxis(initial_state, -1, 2).reshape(B, H * V, K, 1), **kwargs)
        return (o.reshape(B, T, H, V), state(final_state), *map(state, states))

    return run
