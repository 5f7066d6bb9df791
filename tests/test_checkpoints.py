"""States at chosen positions from one forward pass equal the oracle's states after that many tokens."""

from __future__ import annotations

import pytest

from conftest import make_inputs, rel_err
from lineattn import ops

# Chunk starts and ends, inside chunks, the first and last token, and the initial state (64-token chunks, T = 150).
POSITIONS = [0, 1, 37, 64, 100, 128, 149, 150]


def oracle_state_after(rule, x, p):
    """The oracle's state after the first p tokens (a fixed gate [H] is not per token)."""
    if p == 0:
        return x["initial_state"]
    first = lambda a: a if a is None or a.ndim == 1 else a[:, :p]
    args = (first(x[n]) for n in ("q", "k", "v", "g", "beta"))
    _, state = ops.linear_attention(rule, *args, initial_state=x["initial_state"], output_final_state=True,
                                    backend="recurrent")
    return state


@pytest.mark.parametrize("rule, backend", [(r, "chunk") for r in ("kda", "gdn", "deltanet", "gla", "simple_gla",
                                                                  "retnet", "linear_attn")]
                         + [("kda", "recurrent"), ("delta_element", "auto"), ("element", "auto")])
def test_checkpoints_equal_the_oracle_states(rule, backend):
    x = make_inputs(rule, B=2, T=150, H=2, K=32, V=24)
    o, final, states = ops.linear_attention(rule, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                            initial_state=x["initial_state"], output_final_state=True,
                                            checkpoint_positions=POSITIONS, backend=backend)
    assert states.shape == (len(POSITIONS), *final.shape)
    for i, p in enumerate(POSITIONS):
        assert rel_err(states[i], oracle_state_after(rule, x, p)) <= 2e-5, f"position {p}"
    o_plain, _ = ops.linear_attention(rule, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                      initial_state=x["initial_state"], backend="recurrent")
    assert rel_err(o, o_plain) <= 2e-5


def test_checkpoint_positions_are_checked():
    x = make_inputs("kda", B=1, T=20)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match=r"ints in \[0, T = 20\]"):
        ops.linear_attention("kda", *args, checkpoint_positions=[5, 21])
    with pytest.raises(ValueError, match="cannot export states"):
        ops.linear_attention("kda", *args, checkpoint_positions=[5], backend="scan")
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.linear_attention("kda", *args, checkpoint_positions=[5], cu_seqlens=[0, 10, 20])
