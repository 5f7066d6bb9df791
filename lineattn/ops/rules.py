"""The update-rule spec: write mode x gate granularity, in one place.

Every rule is an affine update of a state S [K, V] (fp32):

    delta:     S_t = (I - b_t k_t k_t^T) D_t(S_{t-1}) + b_t k_t v_t^T
    additive:  S_t = D_t(S_{t-1}) + k_t v_t^T
    output:    o_t = scale * S_t^T q_t

and the gate granularity picks D_t (log-space gate g = log(alpha) <= 0):

    none     D_t(S) = S                         g is None
    fixed    D_t(S) = exp(g_h) S                g [H]          (one constant per head)
    head     D_t(S) = exp(g_t) S                g [B, T, H]
    channel  D_t(S) = Diag(exp(g_t)) S          g [B, T, H, K] (scales key rows)
    element  D_t(S) = exp(g_t) * S              g [B, T, H, K, V]
"""

from __future__ import annotations

import dataclasses
from typing import Literal

WriteMode = Literal["additive", "delta"]
GateGranularity = Literal["none", "fixed", "head", "channel", "element"]

WRITE_MODES: tuple[str, ...] = ("additive", "delta")
GATES: tuple[str, ...] = ("none", "fixed", "head", "channel", "element")


@dataclasses.dataclass(frozen=True)
class Rule:
    """One update rule.

    Attributes:
      write: "additive" (S += k v^T) or "delta" (S += b k (v - S^T k)^T).
      gate: forget-gate granularity, see the module docstring.
      normalize: vanilla linear attention (Katharopoulos et al.): feature map
        phi(x) = elu(x) + 1 on q and k, and the output divided by
        phi(q)^T z_t with z_t = sum_s phi(k_s). Only for additive rules; with a
        gate, z decays with the state. The normaliser z is carried as one extra
        value column of the state, so such a rule's state is [K, V + 1].
    """

    write: WriteMode
    gate: GateGranularity
    normalize: bool = False

    def __post_init__(self):
        if self.write not in WRITE_MODES:
            raise ValueError(f"rule write mode must be one of {WRITE_MODES}, got {self.write!r}")
        if self.gate not in GATES:
            raise ValueError(f"rule gate granularity must be one of {GATES}, got {self.gate!r}")
        if self.normalize and self.write != "additive":
            raise ValueError("normalize=True (vanilla linear attention) needs write='additive'")

    @property
    def has_chunk_form(self) -> bool:
        """A chunk form of the [K, V] state itself. The per-element gate does not factor over key channels; its
        `chunk` backend runs each value column as a channel-gate rule (`lineattn.ops.columns`), exact but 13-20x
        slower than its recurrence on a CPU, so `auto` does not pick it."""
        return self.gate != "element"

    @property
    def has_scan_form(self) -> bool:
        """Additive rules scan token by token; delta rules scan chunk-level affine pairs."""
        return self.write == "additive" or self.gate != "element"


RULES: dict[str, Rule] = {
    # additive write
    "linear_attn": Rule("additive", "none", normalize=True),  # phi = elu+1 and the denominator
    "norm_attn": Rule("additive", "none"),  # no denominator; the layer normalises the output
    "retnet": Rule("additive", "fixed"),
    "simple_gla": Rule("additive", "head"),
    "gla": Rule("additive", "channel"),
    "element": Rule("additive", "element"),
    # delta write
    "deltanet": Rule("delta", "none"),
    "delta_fixed": Rule("delta", "fixed"),
    "gdn": Rule("delta", "head"),
    "kda": Rule("delta", "channel"),
    "delta_element": Rule("delta", "element"),
}


def resolve_rule(rule: str | Rule | tuple[str, str]) -> Rule:
    """A rule from its name (see `RULES`), a `Rule`, or a `(write, gate)` pair."""
    if isinstance(rule, Rule):
        return rule
    if isinstance(rule, str):
        if rule not in RULES:
            raise ValueError(f"unknown rule {rule!r}; expected one of {sorted(RULES)} or a (write, gate) pair")
        return RULES[rule]
    if isinstance(rule, tuple) and len(rule) == 2:
        return Rule(*rule)
    raise ValueError(f"rule must be a name, a Rule or a (write, gate) pair, got {rule!r}")
