"""Every fast backend against the fp32 `lax.scan` oracle: outputs, final state and all six gradients.

Tolerance: relative max error (max |x - x_oracle| / max |x_oracle|) <= 1e-4 in fp32 on CPU. Seen: about 1e-6 on
outputs and states, up to 1e-6 on most gradients and 2e-5 on the fixed gate's dg [H], a sum over every token and state entry.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from conftest import assert_close, loss_and_grads, make_inputs
from lineattn import ops

TOL = 1e-4
# The ragged-length, gate-extreme and cut-gate tests share these shapes (inputs are arguments of the jitted function,
# so the same (rule, backend) compiles to the same program for all three: XLA's compile, most of the time, happens
# once, in-process through `_PROGRAMS` below, across pytest-xdist workers through the session's cache).
SHAPE = dict(B=2, T=150, H=2, K=32, V=24)
FAST_PATHS = [
    (name, backend)
    for name, rule in ops.RULES.items()
    for backend in ("chunk", "scan")
    if backend == "chunk" or rule.has_scan_form   # chunk: the per-element gate by value columns
]


# the jitted programs by rule, backend, options and shapes (`conftest.loss_and_grads`' programs): a case that runs a
# program again (the oracle for chunk and scan; the gate extremes and cut gates, on the ragged case's shapes) skips
# tracing and lowering as well as XLA's compile
_PROGRAMS = {}


def _compare(rule, backend, inputs, tol=TOL, cu_seqlens=None, **kwargs):
    o, ht, grads = loss_and_grads(rule, inputs, backend=backend, cu_seqlens=cu_seqlens, programs=_PROGRAMS, **kwargs)
    o_ref, ht_ref, grads_ref = loss_and_grads(rule, inputs, backend="recurrent", cu_seqlens=cu_seqlens,
                                              programs=_PROGRAMS)
    assert_close({"o": o, "ht": ht, **grads}, {"o": o_ref, "ht": ht_ref, **grads_ref}, tol, f"{rule}/{backend}")


@pytest.mark.parametrize("rule,backend", FAST_PATHS)
def test_matches_oracle_ragged_length_nonzero_state(rule, backend):
    # T = 150: two full chunks and a ragged one; H > 1, K != V, non-zero initial state.
    _compare(rule, backend, make_inputs(rule, **SHAPE))


@pytest.mark.parametrize("rule,backend", FAST_PATHS)
def test_matches_oracle_varlen(rule, backend):
    cu_seqlens = np.array([0, 37, 37, 130, 201])  # includes an empty sequence and one crossing chunk edges
    inputs = make_inputs(rule, B=1, T=201, H=2, K=32, V=16, num_seqs=4, seed=3)
    _compare(rule, backend, inputs, cu_seqlens=cu_seqlens)


EXTREME_RULES = [(n, b) for n, b in FAST_PATHS if ops.RULES[n].gate in ("head", "channel", "element")]


@pytest.mark.parametrize("rule,backend", EXTREME_RULES)
@pytest.mark.parametrize("gate", ["lower_bound", "zero"])
def test_matches_oracle_at_gate_extremes(rule, backend, gate):
    # Every token at the safe gate's lower bound (-5: a chunk's cumulative decay reaches -320), or at 0.
    low, high = (-5.0, -5.0) if gate == "lower_bound" else (0.0, 0.0)
    _compare(rule, backend, make_inputs(rule, **SHAPE, g_low=low, g_high=high, seed=5))


@pytest.mark.parametrize("rule,backend", EXTREME_RULES)
def test_cut_gates_are_finite_and_exact(rule, backend):
    # g = -1000 at a few tokens cuts the sequence there (exp underflows to exactly 0). The API raises such gates to
    # ops.LOG_GATE_FLOOR (-120) first, so the chunk path's cumsum across a cut rounds at ulp(120), not ulp(1000), and
    # the fp32 tolerance holds (before the floor: 1e-3).
    inputs = make_inputs(rule, **SHAPE, seed=7, g_low=-1.0)
    g = np.array(inputs["g"])
    g[:, [3, 40, 64, 99]] = -1000.0
    inputs["g"] = g
    _compare(rule, backend, inputs, tol=TOL)


@pytest.mark.parametrize("chunk_size", [16, 32, 128])
@pytest.mark.parametrize("rule", ["kda", "gdn", "gla"])
def test_chunk_size(rule, chunk_size):
    _compare(rule, "chunk", make_inputs(rule, T=90, seed=2), chunk_size=chunk_size)


@pytest.mark.parametrize("rule", ["element", "delta_element"])
def test_element_chunk_by_value_columns_exports_the_oracles_states(rule):
    # the per-element gate's chunk backend runs V channel-gate rules of value dim 1 (lineattn.ops.columns);
    # the state exports come back in the [P, B, H, K, V] layout
    # (jitted: eagerly, each of the chunk form's ops compiles on its own)
    x = make_inputs(rule, B=2, T=50, H=2, K=8, V=6, seed=4)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"])
    run = lambda backend, **kw: jax.jit(lambda q, k, v, g, beta, h0: ops.linear_attention(
        rule, q, k, v, g, beta, initial_state=h0, output_final_state=True, checkpoint_positions=[0, 17, 50],
        backend=backend, **kw))(*args)
    o, ht, states = run("chunk", chunk_size=16)
    o_ref, ht_ref, states_ref = run("recurrent")
    assert_close({"o": o, "ht": ht, "states": states}, {"o": o_ref, "ht": ht_ref, "states": states_ref}, TOL, rule)
    np.testing.assert_array_equal(states[0], x["initial_state"])
    assert ops.select_backend(ops.RULES[rule], "auto") != "chunk"      # slower on a CPU: auto does not pick it
