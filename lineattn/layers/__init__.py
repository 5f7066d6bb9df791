"""Flax NNX layers: short conv, linear-attention mixer, softmax attention, SwiGLU, norms."""

from lineattn.layers.attention import Attention, KVCache
from lineattn.layers.basic import SwiGLU, rms_norm, rotary
from lineattn.layers.conv import ShortConv
from lineattn.layers.linear_attention import LinearAttention, LinearState

__all__ = ["Attention", "KVCache", "LinearAttention", "LinearState", "ShortConv", "SwiGLU", "rms_norm", "rotary"]
