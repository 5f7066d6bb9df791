"""Causal softmax attention with GQA, RoPE or NoPE, and a KV cache for decode."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lineattn.checks import check_bool, check_int, check_real
from lineattn.layers.basic import check_input, dense, rotary
from lineattn.layers.segments import check_segment_ids


class KVCache(NamedTuple):
    """Keys and values of every cache slot: [B, S, N_kv, D] each (S = max_len)."""

    k: jax.Array
    v: jax.Array


class Attention(nnx.Module):
    """Softmax attention. `rope=False` is NoPE (Kimi Linear's full-attention layers carry no positions)."""

    def __init__(self, width: int, num_heads: int, num_kv_heads: int, head_dim: int, *, rope: bool = True,
                 rope_theta: float = 10000.0, rngs: nnx.Rngs, dtype=None, param_dtype=jnp.float32):
        for name, value in (("width", width), ("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            check_int(name, value)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        check_bool("rope", rope)
        if rope:
            check_real("rope_theta", rope_theta, lambda t: t > 0, "> 0")
            if head_dim % 2:
                raise ValueError(f"head_dim must be even with rope (rotary embeddings), got {head_dim}")
        self.width, self.num_heads, self.num_kv_heads, self.head_dim = width, num_heads, num_kv_heads, head_dim
        self.rope, self.rope_theta, self.dtype = rope, rope_theta, dtype
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_proj = dense(width, num_heads * head_dim, **kw)
        self.k_proj = dense(width, num_kv_heads * head_dim, **kw)
        self.v_proj = dense(width, num_kv_heads * head_dim, **kw)
        self.o_proj = dense(num_heads * head_dim, width, **kw)

    def init_state(self, batch: int, max_len: int, dtype=jnp.float32) -> KVCache:
        """An empty KV cache: k and v [batch, max_len, num_kv_heads, head_dim] zeros."""
        zeros = jnp.zeros((batch, max_len, self.num_kv_heads, self.head_dim), dtype)
        return KVCache(zeros, zeros)

    def __call__(self, x_BTD, *, positions, segment_ids=None, state: KVCache | None = None, slot=None, start=None,
                 checkpoints=(), context_axis: str | None = None):
        """x [B, T, width] -> (y [B, T, width], updated KVCache or None, None).

        Without a cache: causal within each segment of `segment_ids`. With a cache, x's keys/values are written at
        slots [slot, slot + T) and each query sees the slots from start[b] (the request's first token) to its own.
        The third output is for interface parity with `LinearAttention` (no snapshots: the cache holds every slot).
        context_axis: context parallelism (no cache, inside a shard_map binding that mesh axis): x, positions
        (global) and segment_ids are this device's slice [B, T/P] of the sequence; keys, values and segment ids
        are all-gathered over the axis and the causal mask uses global positions.
        """
        check_input(x_BTD, self.width)
        B, T, _ = x_BTD.shape
        check_segment_ids(segment_ids, (B, T))
        if tuple(jnp.shape(positions)) != (B, T):
            raise ValueError(f"positions must be [B, T] = [{B}, {T}], got shape {tuple(jnp.shape(positions))}")
        if state is not None:
            want = (B, state.k.shape[1] if state.k.ndim == 4 else -1, self.num_kv_heads, self.head_dim)
            if state.k.shape != want or state.v.shape != want:
                raise ValueError(f"state (KVCache) k and v must be [B, S, N_kv, D] = [{B}, S, {self.num_kv_heads}, "
                                 f"{self.head_dim}], got {tuple(state.k.shape)} and {tuple(state.v.shape)}")
        q = self.q_proj(x_BTD).reshape(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x_BTD).reshape(B, T, self.num_kv_heads, self.head_dim)
        if self.rope:
            q, k = rotary(q, positions, self.rope_theta), rotary(k, positions, self.rope_theta)
        t = jnp.arange(T)
        if context_axis is not None:
            if state is not None:
                raise ValueError("Attention: context_axis is for training forwards, without a KV cache")
            every = lambda x: jax.lax.all_gather(x, context_axis, axis=1, tiled=True)  # [B, T, ...] -> [B, P T, ...]
            k, v = every(k), every(v)
            q_pos, k_pos = jax.lax.axis_index(context_axis) * T + t, jnp.arange(k.shape[1])
            mask = k_pos[None, :] <= q_pos[:, None]
            if segment_ids is not None:
                mask = mask & (segment_ids[:, :, None] == every(segment_ids)[:, None, :])
            mask = jnp.broadcast_to(mask, (B, T, k.shape[1]))
        elif state is None:
            mask = t[:, None] >= t[None, :]
            if segment_ids is not None:
                mask = mask & (segment_ids[:, :, None] == segment_ids[:, None, :])
            mask = jnp.broadcast_to(mask, (B, T, T))
        else:
            k_all = jax.lax.dynamic_update_slice(state.k, k.astype(state.k.dtype), (0, slot, 0, 0))
            v_all = jax.lax.dynamic_update_slice(state.v, v.astype(state.v.dtype), (0, slot, 0, 0))
            state = KVCache(k_all, v_all)
            k, v = k_all.astype(q.dtype), v_all.astype(q.dtype)
            q_slot, k_slot = slot + t, jnp.arange(k.shape[1])
            causal = k_slot[None, :] <= q_slot[:, None]
            mask = (causal & (k_slot[None, None, :] >= start[:, None, None])) | (k_slot == q_slot[:, None])
        o = jax.nn.dot_product_attention(q, k, v, mask=mask[:, None])
        return self.o_proj(o.reshape(B, T, -1)), state, None
