"""Pure update-rule ops in the FLA layout [B, T, H, D]. See `linear_attention` for the contract."""

from lineattn.ops.api import (
    BACKENDS,
    chunk_delta_rule,
    chunk_gated_delta_rule,
    chunk_gla,
    chunk_kda,
    chunk_simple_gla,
    linear_attention,
    select_backend,
)
from lineattn.ops.context_parallel import context_parallel_attention
from lineattn.ops.gates import LOG_GATE_FLOOR, safe_gate, softplus_gate
from lineattn.ops.rules import GATES, RULES, WRITE_MODES, Rule, resolve_rule

__all__ = [
    "BACKENDS", "GATES", "LOG_GATE_FLOOR", "RULES", "WRITE_MODES", "Rule", "chunk_delta_rule",
    "chunk_gated_delta_rule", "chunk_gla", "chunk_kda", "chunk_simple_gla", "context_parallel_attention",
    "linear_attention", "resolve_rule", "safe_gate", "select_backend", "softplus_gate",
]
