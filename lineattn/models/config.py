"""The hybrid LM's configuration: one frozen dataclass, validated on construction."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from lineattn import ops
from lineattn.checks import check_bool, check_int, check_real

ATTENTION_MIXERS = ("attention", "attention_rope", "attention_nope")
DTYPES = ("float32", "bfloat16", "float16")


def mixer_names() -> tuple[str, ...]:
    """The names a layer_pattern entry may take: the attention mixers, then every rule of `ops.RULES`."""
    return ATTENTION_MIXERS + tuple(ops.RULES)


def _as_mixer(entry):
    """A layer-pattern entry: an attention name, a rule name, or a (write, gate) pair (list from YAML is fine)."""
    if isinstance(entry, str):
        if entry in ATTENTION_MIXERS or entry in ops.RULES:
            return entry
        raise ValueError(f"layer_pattern: unknown mixer {entry!r}; expected one of {mixer_names()} "
                         "or a (write, gate) pair")
    if isinstance(entry, (tuple, list)) and len(entry) == 2 and all(isinstance(e, str) for e in entry):
        ops.Rule(*entry)  # raises a ValueError naming the bad write mode / gate
        return tuple(entry)
    raise ValueError(f"layer_pattern: entry {entry!r} must be a mixer name or a (write, gate) pair")


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A hybrid LM: `layer_pattern` repeats to fill `num_layers` (e.g. 3 KDA : 1 attention, Kimi Linear's ratio);
    a pattern longer than `num_layers` is cut to its first `num_layers` entries (the default's 4 with 2 layers: no
    attention layer).

    Attributes:
      vocab_size, width, num_layers, num_heads: the usual.
      layer_pattern: mixer names ("attention" follows `rope`; "attention_rope" / "attention_nope" force it; any
        rule of `lineattn.ops.RULES`) or (write, gate) pairs.
      head_dim: key dim of linear heads and head dim of attention (default width // num_heads).
      head_v_dim: value dim of linear heads (default head_dim).
      num_kv_heads: attention key/value heads, GQA (default num_heads).
      mlp_ratio: SwiGLU hidden size = mlp_ratio * width rounded up to a multiple of 8; 0 means no MLP (every block
        is only norm + mixer, as in Zoology's MQAR models).
      conv_size: short-conv kernel of linear layers (0 disables it).
      gate_fn, lower_bound: forget-gate parameterisation ("safe" = lower_bound * sigmoid(.), or "softplus");
        lower_bound is finite and < 0.
      rope, rope_theta: rotary embeddings for "attention" layers (rope_theta finite and > 0).
      tie_embeddings: the output head reuses the embedding matrix.
      dtype, param_dtype: compute and parameter dtypes.
      backend: `lineattn.ops` backend of the linear layers ("auto" picks the fastest tested one).
    """

    vocab_size: int
    width: int
    num_layers: int
    num_heads: int
    layer_pattern: tuple = ("kda", "kda", "kda", "attention")
    head_dim: int | None = None
    head_v_dim: int | None = None
    num_kv_heads: int | None = None
    mlp_ratio: float = 8 / 3
    conv_size: int = 4
    gate_fn: str = "safe"
    lower_bound: float = -5.0
    rope: bool = True
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    backend: str = "auto"

    def __post_init__(self):
        # Exact types (True is not 1, "no" is not False) and ranges; the YAML loader builds this class, so config
        # files get the same checks (after its YAML-1.1 conversions, e.g. "1e4" -> 10000.0).
        for name in ("vocab_size", "width", "num_layers", "num_heads"):
            check_int(name, getattr(self, name))
        for name in ("head_dim", "head_v_dim", "num_kv_heads"):
            check_int(name, getattr(self, name), optional=True)
        check_int("conv_size", self.conv_size, 0)
        for name in ("rope", "tie_embeddings"):
            check_bool(name, getattr(self, name))
        check_real("mlp_ratio", self.mlp_ratio, lambda r: r >= 0, ">= 0 (0 = no MLP)")
        check_real("lower_bound", self.lower_bound, lambda b: b < 0, "< 0")
        check_real("rope_theta", self.rope_theta, lambda t: t > 0, "> 0")
        if self.head_dim is None and self.width % self.num_heads:
            raise ValueError(f"width ({self.width}) must be divisible by num_heads ({self.num_heads}), "
                             "or set head_dim")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.kv_heads})")
        pattern = self.layer_pattern
        if isinstance(pattern, str) or not isinstance(pattern, (tuple, list)) or not pattern:
            raise ValueError(f"layer_pattern must be a non-empty list of mixers, got {pattern!r}")
        object.__setattr__(self, "layer_pattern", tuple(_as_mixer(e) for e in pattern))
        if self.gate_fn not in ("safe", "softplus"):
            raise ValueError(f"gate_fn must be 'safe' or 'softplus', got {self.gate_fn!r}")
        for name in ("dtype", "param_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        if self.backend not in ops.BACKENDS:
            raise ValueError(f"backend must be one of {ops.BACKENDS}, got {self.backend!r}")
        if self.has_rope and self.head_k_dim % 2:
            raise ValueError(f"rotary attention needs an even head_dim, got {self.head_k_dim}")

    @property
    def head_k_dim(self) -> int:
        return self.head_dim or self.width // self.num_heads

    @property
    def value_dim(self) -> int:
        return self.head_v_dim or self.head_k_dim

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def has_mlp(self) -> bool:
        return self.mlp_ratio > 0

    @property
    def mlp_hidden(self) -> int:
        """The SwiGLU hidden size (0 without an MLP; at least 8 with one)."""
        if not self.has_mlp:
            return 0
        return -(-max(1, int(round(self.mlp_ratio * self.width))) // 8) * 8

    @property
    def mixers(self) -> tuple:
        """The mixer of every layer (the pattern repeated, truncated to num_layers)."""
        return tuple(self.layer_pattern[i % len(self.layer_pattern)] for i in range(self.num_layers))

    @property
    def has_rope(self) -> bool:
        return any(m == "attention_rope" or (m == "attention" and self.rope) for m in self.mixers)

    @property
    def compute_dtype(self):
        return jnp.dtype(self.dtype)
