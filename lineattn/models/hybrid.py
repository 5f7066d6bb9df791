"""The hybrid LM: embedding, pre-norm residual blocks (mixer + SwiGLU, or mixer only when mlp_ratio is 0), final
norm, tied or separate head."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineattn.checks import is_concrete
from lineattn.layers import Attention, LinearAttention, SwiGLU, rms_norm
from lineattn.layers.segments import check_segment_ids, context_positions, positions_in_segment
from lineattn.models.config import ATTENTION_MIXERS, ModelConfig


def _make_mixer(cfg: ModelConfig, mixer, rngs: nnx.Rngs):
    kw = dict(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=jnp.dtype(cfg.param_dtype))
    if mixer in ATTENTION_MIXERS:
        rope = mixer == "attention_rope" or (mixer == "attention" and cfg.rope)
        return Attention(cfg.width, cfg.num_heads, cfg.kv_heads, cfg.head_k_dim, rope=rope, rope_theta=cfg.rope_theta,
                         **kw)
    return LinearAttention(cfg.width, cfg.num_heads, cfg.head_k_dim, cfg.value_dim, mixer, conv_size=cfg.conv_size,
                           gate_fn=cfg.gate_fn, lower_bound=cfg.lower_bound, backend=cfg.backend, **kw)


class Block(nnx.Module):
    """x + mixer(norm(x)), then x + mlp(norm(x)); without an MLP (mlp_ratio 0) mlp and mlp_norm are None."""

    def __init__(self, cfg: ModelConfig, mixer, *, rngs: nnx.Rngs):
        kw = dict(rngs=rngs, dtype=cfg.compute_dtype, param_dtype=jnp.dtype(cfg.param_dtype))
        self.mixer_norm = rms_norm(cfg.width, **kw)
        self.mlp_norm = nnx.data(rms_norm(cfg.width, **kw) if cfg.has_mlp else None)
        self.mixer = _make_mixer(cfg, mixer, rngs)
        self.mlp = nnx.data(SwiGLU(cfg.width, cfg.mlp_hidden, **kw) if cfg.has_mlp else None)

    def __call__(self, x_BTD, *, positions, segment_ids, state=None, slot=None, start=None, checkpoints=(),
                 context_axis=None):
        """x [B, T, width] -> (x + mixer + MLP [B, T, width], the mixer's new decode state or None, its snapshots
        or None); the keywords go to the mixer (see `LinearAttention` and `Attention`)."""
        y, state, snapshots = self.mixer(self.mixer_norm(x_BTD), positions=positions, segment_ids=segment_ids,
                                         state=state, slot=slot, start=start, checkpoints=checkpoints,
                                         context_axis=context_axis)
        x_BTD = x_BTD + y
        if self.mlp is not None:
            x_BTD = x_BTD + self.mlp(self.mlp_norm(x_BTD))
        return x_BTD, state, snapshots


def check_tokens(tokens, vocab_size):
    """ValueError unless tokens is an integer array [B, T] whose ids (when concrete) lie in [0, vocab_size)."""
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an integer array [B, T], got {tokens.dtype} {tuple(tokens.shape)}")
    if is_concrete(tokens) and tokens.size:  # ids can only be checked when concrete
        ids = np.asarray(tokens)  # (np.min of a jax.Array calls its .min, a traced op inside a jit)
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= vocab_size:
            raise ValueError(f"tokens must be ids in [0, {vocab_size}), got values in [{lo}, {hi}]")


class HybridLM(nnx.Module):
    """A decoder-only LM whose layers mix linear-attention rules and softmax attention (see `ModelConfig`).

    `model(tokens [B, T], segment_ids=None) -> logits [B, T, vocab] (fp32)`. `segment_ids` [B, T] packs documents:
    a token sees only earlier tokens with the same id (0 = padding). Out-of-range ids raise a ValueError when
    the tokens are concrete; under jit they are not checked, and their logits are NaN.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        dtype, param_dtype = cfg.compute_dtype, jnp.dtype(cfg.param_dtype)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.width, dtype=dtype, param_dtype=param_dtype, rngs=rngs,
                               embedding_init=nnx.initializers.normal(1.0))
        self.blocks = nnx.List([Block(cfg, m, rngs=rngs) for m in cfg.mixers])
        self.final_norm = rms_norm(cfg.width, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.lm_head = nnx.data(None if cfg.tie_embeddings else nnx.Linear(
            cfg.width, cfg.vocab_size, use_bias=False, dtype=dtype, param_dtype=param_dtype, rngs=rngs))

    def _embed(self, tokens_BT):
        """Embeddings [B, T, width]; an id out of [0, vocab) gives NaN (negative ids are sent past the end, where
        the lookup fills NaN, instead of wrapping around as jnp.take's negative indices do)."""
        return self.embed(jnp.where(tokens_BT < 0, self.cfg.vocab_size, tokens_BT))

    def _logits(self, x_BTD):
        x_BTD = self.final_norm(x_BTD)
        logits = self.embed.attend(x_BTD) * self.cfg.width**-0.5 if self.lm_head is None else self.lm_head(x_BTD)
        return logits.astype(jnp.float32)

    def __call__(self, tokens_BT, *, segment_ids=None, context_axis: str | None = None):
        """context_axis: context parallelism. Called inside a `jax.shard_map` (check_vma=False) that shards the
        sequence over that mesh axis, tokens and segment_ids are this device's slice [B, T/P] (device d holds
        tokens d T/P .. (d + 1) T/P - 1) and so are the logits; every layer exchanges what it needs across the
        axis (see `lineattn.train.trainer`). None (default): the whole sequence on one device."""
        check_tokens(tokens_BT, self.cfg.vocab_size)
        check_segment_ids(segment_ids, tokens_BT.shape)
        if context_axis is not None:
            positions = context_positions(segment_ids, tokens_BT.shape, context_axis)
        elif segment_ids is None:
            positions = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1], dtype=jnp.int32), tokens_BT.shape)
        else:
            positions = positions_in_segment(segment_ids)
        x = self._embed(tokens_BT)
        for block in self.blocks:
            x, _, _ = block(x, positions=positions, segment_ids=segment_ids, context_axis=context_axis)
        return self._logits(x)

    def forward_cached(self, tokens_BT, layer_states, *, slot, start, segment_ids=None, checkpoints=()):
        """Runs tokens at cache slots [slot, slot + T) continuing from `layer_states` (one per block).

        start [B]: each request's first slot (its RoPE position 0, and the first KV slot it may attend to).
        checkpoints: token counts within this call (concrete ints in [0, T]) at which linear layers snapshot.
        Returns (logits [B, T, vocab] fp32, new layer states, snapshots per block: LinearState stacked over the
        checkpoints, or None for attention blocks). Used by `lineattn.decode`.
        """
        check_tokens(tokens_BT, self.cfg.vocab_size)
        check_segment_ids(segment_ids, tokens_BT.shape)
        T = tokens_BT.shape[1]
        positions = (slot + jnp.arange(T, dtype=jnp.int32))[None, :] - start[:, None]
        x = self._embed(tokens_BT)
        new_states, snapshots = [], []
        for block, state in zip(self.blocks, layer_states, strict=True):
            x, state, snaps = block(x, positions=positions, segment_ids=segment_ids, state=state, slot=slot,
                                    start=start, checkpoints=checkpoints)
            new_states.append(state)
            snapshots.append(snaps)
        return self._logits(x), tuple(new_states), tuple(snapshots)
