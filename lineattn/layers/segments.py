"""Which tokens belong together: packed documents (training) and left-padded prompts (decode).

`segment_ids` [B, T] int labels the document of every token; 0 marks padding. Tokens only see earlier tokens of
their own segment: the linear state is reset where a segment starts, the short conv ignores taps from another
segment, attention masks other segments, and positions restart at 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# Added to the log gate at a segment start: exp(-120 + g) underflows to exactly 0 in fp32 (the smallest subnormal
# is e^-103), so the carried state is wiped. Small enough that in-chunk cumsums round at ~1e-5, not at ulp(1e3).
RESET_LOG_GATE = -120.0


def segment_starts(segment_ids_BT: jax.Array) -> jax.Array:
    """bool [B, T]: token t opens a new segment (differs from token t - 1). Token 0 never does: it continues
    whatever state the caller carries in (a fresh state is zero anyway)."""
    changed = segment_ids_BT[:, 1:] != segment_ids_BT[:, :-1]
    return jnp.concatenate([jnp.zeros_like(changed[:, :1]), changed], axis=1)


def positions_in_segment(segment_ids_BT: jax.Array, offset_B: jax.Array | None = None) -> jax.Array:
    """int32 [B, T]: index of each token within its segment (plus offset_B for the first segment)."""
    B, T = segment_ids_BT.shape
    t = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
    starts = segment_starts(segment_ids_BT)
    first_index = jax.lax.cummax(jnp.where(starts, t, 0), axis=1)
    positions = t - first_index
    if offset_B is not None:
        in_first_segment = first_index == 0
        positions = positions + jnp.where(in_first_segment, offset_B[:, None], 0)
    return positions


def check_segment_ids(segment_ids, tokens_shape) -> None:
    if segment_ids is None:
        return
    if segment_ids.shape != tuple(tokens_shape) or not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be an integer array of shape {tuple(tokens_shape)} like tokens, got "
                         f"{segment_ids.dtype} {tuple(segment_ids.shape)}")
