"""Hybrid LMs built from a layer pattern of linear-attention rules and softmax attention."""

from lineattn.models.config import ATTENTION_MIXERS, ModelConfig, mixer_names
from lineattn.models.hybrid import Block, HybridLM
from lineattn.models.stats import count_params, flops_per_token

__all__ = ["ATTENTION_MIXERS", "Block", "HybridLM", "ModelConfig", "count_params", "flops_per_token", "mixer_names"]
