"""The decode state: one explicit pytree for the whole model, passed in and returned by prefill and step."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lineattn.layers import KVCache, LinearState


class DecodeState(NamedTuple):
    """Everything decode carries between calls.

    layers: one entry per block: `LinearState(conv [B, W - 1, C], recurrent [B, H, K, V] fp32)` for linear layers
      (constant size in the context length), `KVCache(k, v [B, max_len, N_kv, D])` for attention layers.
    slot: int32 [], the next cache slot (tokens consumed so far, padding included).
    start: int32 [B], each request's first slot: left padding before it is never attended to, and its RoPE
      position is slot - start.
    """

    layers: tuple
    slot: jax.Array
    start: jax.Array

    @property
    def positions(self) -> jax.Array:
        """int32 [B]: the position the next token of each request will have."""
        return self.slot - self.start


def init_state(model, batch: int, max_len: int) -> DecodeState:
    """An empty state for `batch` requests of up to `max_len` tokens (prompt + generated, padding included)."""
    if batch < 1 or max_len < 1:
        raise ValueError(f"batch and max_len must be >= 1, got batch={batch}, max_len={max_len}")
    dtype = model.cfg.compute_dtype
    layers = tuple(block.mixer.init_state(batch, max_len, dtype) for block in model.blocks)
    return DecodeState(layers, jnp.zeros((), jnp.int32), jnp.zeros((batch,), jnp.int32))


def state_bytes(state: DecodeState) -> list[dict]:
    """Bytes held per layer: [{"layer": i, "kind": "linear" | "attention", "bytes": n}, ...]."""
    rows = []
    for i, layer in enumerate(state.layers):
        kind = "attention" if isinstance(layer, KVCache) else "linear"
        rows.append({"layer": i, "kind": kind, "bytes": sum(x.nbytes for x in jax.tree.leaves(layer))})
    return rows


__all__ = ["DecodeState", "KVCache", "LinearState", "init_state", "state_bytes"]
