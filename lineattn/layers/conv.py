"""Depthwise causal short convolution + SiLU, with an explicit decode state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


class ShortConv(nnx.Module):
    """y_t = silu(sum_w weight[w] * x_{t - W + 1 + w}) per channel, causal, no bias.

    One conv over the concatenated q/k/v channels equals three separate ones (the conv is depthwise). The decode
    state is the last W - 1 *pre-conv* inputs, [B, W - 1, C]: the conv outputs are never stored.
    """

    def __init__(self, channels: int, kernel_size: int = 4, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        if kernel_size < 1:
            raise ValueError(f"kernel_size must be >= 1, got {kernel_size}")
        self.channels, self.kernel_size = channels, kernel_size
        bound = kernel_size**-0.5  # fan-in of a depthwise tap set
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, channels), param_dtype, -bound, bound))

    def init_state(self, batch: int, dtype=jnp.float32) -> jax.Array:
        return jnp.zeros((batch, self.kernel_size - 1, self.channels), dtype)

    def window(self, x_BTC, *, segment_ids=None, state=None):
        """The inputs the conv reads: [B, W - 1 + T, C], the state (or zeros) then x with padding zeroed.
        The conv state after p tokens of x is window[:, p : p + W - 1]."""
        B, T, C = x_BTC.shape
        if segment_ids is not None:
            x_BTC = jnp.where(segment_ids[..., None] != 0, x_BTC, 0)
        past = jnp.zeros((B, self.kernel_size - 1, C), x_BTC.dtype) if state is None else state.astype(x_BTC.dtype)
        return jnp.concatenate([past, x_BTC], axis=1)

    def __call__(self, x_BTC: jax.Array, *, segment_ids=None, state=None):
        """x [B, T, C] -> (silu(conv(x)) [B, T, C], new state [B, W - 1, C] or None when state is None).

        segment_ids [B, T] (0 = padding): padding inputs count as zeros and taps never cross a segment start.
        `state` holds the inputs before x (treated as x's first segment).
        """
        B, T, C = x_BTC.shape
        W = self.kernel_size
        ext_BSC = self.window(x_BTC, segment_ids=segment_ids, state=state)  # S = W - 1 + T
        weight = self.weight[...].astype(x_BTC.dtype)
        if segment_ids is not None:
            ext_seg = jnp.concatenate([jnp.broadcast_to(segment_ids[:, :1], (B, W - 1)), segment_ids], axis=1)
        y_BTC = jnp.zeros(x_BTC.shape, ext_BSC.dtype)
        for w in range(W):  # tap w looks W - 1 - w tokens back
            tap = ext_BSC[:, w : w + T]
            if segment_ids is not None:
                tap = jnp.where((ext_seg[:, w : w + T] == segment_ids)[..., None], tap, 0)
            y_BTC = y_BTC + weight[w] * tap
        new_state = None if state is None else ext_BSC[:, T:].astype(state.dtype)
        return jax.nn.silu(y_BTC), new_state
