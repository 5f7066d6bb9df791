"""Which tokens belong together: packed documents (training) and left-padded prompts (decode).

`segment_ids` [B, T] int labels the document of every token; 0 marks padding. Tokens only see earlier tokens of
their own segment: the linear state is reset where a segment starts, the short conv ignores taps from another
segment, attention masks other segments, and positions restart at 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lineattn.ops import LOG_GATE_FLOOR

# Added to the log gate at a segment start: exp(-120 + g) underflows to exactly 0 in fp32 (the smallest subnormal
# is e^-103), so the carried state is wiped. The ops raise the sum back to their floor, -120 too, so in-chunk
# cumsums round at ~1e-5, not at ulp(1e3).
RESET_LOG_GATE = LOG_GATE_FLOOR


def segment_starts(segment_ids_BT: jax.Array, first_B: jax.Array | None = None) -> jax.Array:
    """bool [B, T]: token t opens a new segment (differs from token t - 1). Token 0 never does: it continues
    whatever state the caller carries in (a fresh state is zero anyway), unless `first_B` (bool [B]) says it does
    (context parallelism: the slice's first token against the previous device's last, `context_segment_starts`)."""
    changed = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
    first = jnp.zeros_like(changed[:, :1]) if first_B is None else first_B[:, None]
    return jnp.concatenate([first, changed], axis=1)


# -- Context parallelism: the sequence axis is sharded over a mesh axis; each device holds a slice [B, T/P, ...].

def previous_tail(x_BT: jax.Array, n: int, axis_name: str) -> jax.Array:
    """The previous device's last n entries along axis 1 (the halo before this device's slice); zeros on the first
    device of `axis_name`. Inside a shard_map that binds `axis_name`."""
    if n > x_BT.shape[1]:
        raise ValueError(f"context parallelism needs at least {n} tokens per device, got {x_BT.shape[1]}")
    P = jax.lax.axis_size(axis_name)
    return jax.lax.ppermute(x_BT[:, x_BT.shape[1] - n :], axis_name, [(i, i + 1) for i in range(P - 1)])


def context_segment_starts(segment_ids_BT: jax.Array, axis_name: str) -> jax.Array:
    """`segment_starts` of the global sequence, on this device's slice: its first token starts a segment when it
    differs from the previous device's last token (never on the first device, like token 0 on one device)."""
    before_B = previous_tail(segment_ids_BT, 1, axis_name)[:, 0]
    first_B = (jax.lax.axis_index(axis_name) > 0) & (segment_ids_BT[:, 0] != before_B)
    return segment_starts(segment_ids_BT, first_B)


def context_positions(segment_ids_BT: jax.Array | None, batch_T: tuple[int, int], axis_name: str) -> jax.Array:
    """int32 [B, T/P]: global positions of this device's tokens, restarting at each segment (the slice of
    `positions_in_segment` of the whole sequence). Gathers the segment ids (small) over `axis_name`."""
    B, T_loc = batch_T
    start = jax.lax.axis_index(axis_name) * T_loc
    if segment_ids_BT is None:
        return jnp.broadcast_to(start + jnp.arange(T_loc, dtype=jnp.int32), (B, T_loc))
    every_BT = jax.lax.all_gather(segment_ids_BT, axis_name, axis=1, tiled=True)
    return jax.lax.dynamic_slice_in_dim(positions_in_segment(every_BT), start, T_loc, axis=1)


def positions_in_segment(segment_ids_BT: jax.Array) -> jax.Array:
    """int32 [B, T]: index of each token within its segment."""
    B, T = segment_ids_BT.shape
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    first_index = jax.lax.cummax(jnp.where(segment_starts(segment_ids_BT), t, 0), axis=1)
    return t - first_index


def check_segment_ids(segment_ids, tokens_shape) -> None:
    if segment_ids is None:
        return
    if segment_ids.shape != tuple(tokens_shape) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be an integer array of shape {tuple(tokens_shape)} like tokens, got "
                         f"{segment_ids.dtype} {tuple(segment_ids.shape)}")
