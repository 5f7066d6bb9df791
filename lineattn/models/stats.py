"""Parameter count and an estimate of training FLOPs per token (for MFU)."""

from __future__ import annotations

import jax
from flax import nnx

from lineattn.models.config import ATTENTION_MIXERS, ModelConfig


def count_params(model: nnx.Module) -> int:
    """Number of trainable parameters (tied embeddings counted once)."""
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))


def flops_per_token(cfg: ModelConfig, seq_len: int, *, chunk_size: int = 64) -> float:
    """Training FLOPs per token (forward + backward = 3 x forward), an estimate in the usual style:

    forward = 2 x (matmul weights touched per token, the output head included)
            + attention layers: 4 H D x (seq_len + 1) / 2 (scores and weighted values over the causal context)
            + linear layers: per head 4 K V (state read and write) + 2 C (K + V) (the in-chunk matrices, C = chunk).
    Norms, gates' elementwise work and the (I + A)^-1 solve are left out.
    """
    H, K, V, D = cfg.num_heads, cfg.head_k_dim, cfg.value_dim, cfg.width
    attn_weights = D * H * K * 2 + D * cfg.kv_heads * K * 2
    mlp_weights = 3 * D * cfg.mlp_hidden
    forward = 2 * cfg.vocab_size * D
    for mixer in cfg.mixers:
        forward += 2 * mlp_weights
        if mixer in ATTENTION_MIXERS:
            forward += 2 * attn_weights + 4 * H * K * (seq_len + 1) / 2
        else:
            # q, k, v, output gate (low rank) and output projections; gate projections are small and left out.
            linear_weights = D * H * (2 * K + V) + D * V + V * H * V + H * V * D
            forward += 2 * linear_weights + H * (4 * K * V + 2 * chunk_size * (K + V))
    return 3.0 * forward
