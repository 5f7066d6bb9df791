"""Depthwise causal short convolution + SiLU, with an explicit decode state."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from lineattn.checks import check_int
from lineattn.layers.basic import check_input
from lineattn.layers.segments import check_segment_ids, previous_tail


def _zero_padding(x_BTC, segment_ids):
    """Padding tokens (segment id 0) enter the conv as zeros."""
    return x_BTC if segment_ids is None else jnp.where(segment_ids[..., None] != 0, x_BTC, 0)


class ShortConv(nnx.Module):
    """y_t = silu(sum_w weight[w] * x_{t - W + 1 + w}) per channel, causal, no bias.

    One conv over the concatenated q/k/v channels equals three separate ones (the conv is depthwise). The decode
    state is the last W - 1 *pre-conv* inputs, [B, W - 1, C]: the conv outputs are never stored.
    """

    def __init__(self, channels: int, kernel_size: int = 4, *, rngs: nnx.Rngs, param_dtype=jnp.float32):
        check_int("channels", channels)
        check_int("kernel_size", kernel_size)
        self.channels, self.kernel_size = channels, kernel_size
        bound = kernel_size**-0.5  # fan-in of a depthwise tap set
        self.weight = nnx.Param(jax.random.uniform(rngs.params(), (kernel_size, channels), param_dtype, -bound, bound))

    def init_state(self, batch: int, dtype=jnp.float32) -> jax.Array:
        """Zero past inputs [batch, kernel_size - 1, channels]."""
        return jnp.zeros((batch, self.kernel_size - 1, self.channels), dtype)

    def check_inputs(self, x_BTC, segment_ids=None, state=None) -> None:
        """ValueError unless x is [B, T, C], segment_ids [B, T] and the state None or [B, W - 1, C] (static shapes)."""
        check_input(x_BTC, self.channels, "x", "C")
        check_segment_ids(segment_ids, x_BTC.shape[:2])
        if state is not None:
            self.check_state(state, x_BTC.shape[0])

    def check_state(self, state, batch: int, name: str = "state") -> None:
        """ValueError naming `name` unless the conv state is [batch, kernel_size - 1, channels]."""
        want = (batch, self.kernel_size - 1, self.channels)
        if tuple(state.shape) != want:
            raise ValueError(f"{name} must be [B, W - 1, C] = {list(want)} (the conv's last inputs), got shape "
                             f"{tuple(state.shape)}")

    def window(self, x_BTC, *, segment_ids=None, state=None):
        """The inputs the conv reads: [B, W - 1 + T, C], the state (or zeros) then x with padding zeroed.
        The conv state after p tokens of x is window[:, p : p + W - 1]."""
        self.check_inputs(x_BTC, segment_ids, state)
        B, T, C = x_BTC.shape
        x_BTC = _zero_padding(x_BTC, segment_ids)
        past = jnp.zeros((B, self.kernel_size - 1, C), x_BTC.dtype) if state is None else state.astype(x_BTC.dtype)
        return jnp.concatenate([past, x_BTC], axis=1)

    def __call__(self, x_BTC: jax.Array, *, segment_ids=None, state=None, context_axis: str | None = None):
        """x [B, T, C] -> (silu(conv(x)) [B, T, C], new state [B, W - 1, C] or None when state is None).

        segment_ids [B, T] (0 = padding): padding inputs count as zeros and taps never cross a segment start.
        `state` holds the inputs before x (treated as x's first segment).
        context_axis: x is this device's slice of a sequence sharded over that mesh axis (inside shard_map, with
        state=None); the inputs before it are the previous device's last W - 1 and their segment ids (a halo
        through `ppermute`; zeros on the first device).
        """
        self.check_inputs(x_BTC, segment_ids, state)
        B, T, C = x_BTC.shape
        W = self.kernel_size
        past_ids = None
        if context_axis is not None and W > 1:
            if state is not None:
                raise ValueError("ShortConv: context_axis is for training forwards, without a decode state")
            halo = previous_tail(_zero_padding(x_BTC, segment_ids), W - 1, context_axis)
            if segment_ids is not None:
                past_ids = previous_tail(segment_ids, W - 1, context_axis)
        else:
            halo = state
        ext_BSC = self.window(x_BTC, segment_ids=segment_ids, state=halo)  # S = W - 1 + T
        weight = self.weight[...].astype(x_BTC.dtype)
        if segment_ids is not None:
            if past_ids is None:
                past_ids = jnp.broadcast_to(segment_ids[:, :1], (B, W - 1))
            ext_seg = jnp.concatenate([past_ids, segment_ids], axis=1)
        y_BTC = jnp.zeros(x_BTC.shape, ext_BSC.dtype)
        for w in range(W):  # tap w looks W - 1 - w tokens back
            tap = ext_BSC[:, w : w + T]
            if segment_ids is not None:
                tap = jnp.where((ext_seg[:, w : w + T] == segment_ids)[..., None], tap, 0)
            y_BTC = y_BTC + weight[w] * tap
        new_state = None if state is None else ext_BSC[:, T:].astype(state.dtype)
        return jax.nn.silu(y_BTC), new_state
