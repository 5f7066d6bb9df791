"""The op API: named FLA ops, backend dispatch, gate helpers, and clear errors for bad input."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_inputs, rel_err
from lineattn import ops


@pytest.mark.parametrize(
    "op,rule,gated,delta",
    [(ops.chunk_kda, "kda", True, True), (ops.chunk_gated_delta_rule, "gdn", True, True),
     (ops.chunk_delta_rule, "deltanet", False, True), (ops.chunk_gla, "gla", True, False),
     (ops.chunk_simple_gla, "simple_gla", True, False)],
)
def test_named_ops_are_their_rules(op, rule, gated, delta):
    x = make_inputs(rule, T=40)
    gates = [x["g"]] * gated + [x["beta"]] * delta
    o, ht = op(x["q"], x["k"], x["v"], *gates, initial_state=x["initial_state"], output_final_state=True)
    o_ref, ht_ref = ops.linear_attention(rule, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                         initial_state=x["initial_state"], output_final_state=True,
                                         backend="recurrent")
    assert rel_err(o, o_ref) < 1e-5 and rel_err(ht, ht_ref) < 1e-5
    assert op(x["q"], x["k"], x["v"], *gates)[1] is None  # no final state unless asked
    assert ht.dtype == jnp.float32


def test_rule_given_as_pair_or_rule_is_the_named_rule():
    x = make_inputs("kda", T=20)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    by_name = ops.linear_attention("kda", *args)[0]
    assert rel_err(ops.linear_attention(("delta", "channel"), *args)[0], by_name) == 0
    assert rel_err(ops.linear_attention(ops.Rule("delta", "channel"), *args)[0], by_name) == 0


def test_auto_backend_choice():
    assert ops.select_backend(ops.RULES["kda"], "auto") == "chunk"
    assert ops.select_backend(ops.RULES["element"], "auto") == "scan"
    assert ops.select_backend(ops.RULES["delta_element"], "auto") == "recurrent"


def test_default_scale_is_inverse_sqrt_k():
    x = make_inputs("gla", T=10, K=16)
    args = (x["q"], x["k"], x["v"], x["g"])
    assert rel_err(ops.chunk_gla(*args)[0], ops.chunk_gla(*args, scale=0.25)[0]) == 0


def test_safe_gate_formula_bounds_and_gradients():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((3, 4, 2, 8)) * 5, jnp.float32)  # [B, T, H, K]
    A_log = jnp.asarray(rng.standard_normal(2), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal((2, 8)), jnp.float32)
    g = ops.safe_gate(x, A_log, dt_bias, lower_bound=-5.0)
    expected = -5.0 / (1 + np.exp(-np.exp(np.asarray(A_log))[:, None] * (np.asarray(x) + np.asarray(dt_bias))))
    assert rel_err(g, expected) < 1e-6
    assert float(g.min()) >= -5.0 and float(g.max()) <= 0.0
    # gradients of sum(w g) against the closed form: with u = e^A_log (x + dt_bias) and s = sigmoid(u),
    # dg/dx = dg/d dt_bias = -5 s (1 - s) e^A_log and dg/dA_log = -5 s (1 - s) u (float64)
    w = rng.standard_normal(x.shape)
    a = np.exp(np.asarray(A_log, np.float64))[:, None]
    u = a * (np.asarray(x, np.float64) + np.asarray(dt_bias, np.float64))
    ds = -5.0 * w * (1 / (1 + np.exp(-u))) * (1 - 1 / (1 + np.exp(-u)))
    grads = jax.grad(lambda *args: jnp.sum(w * ops.safe_gate(*args)), argnums=(0, 1, 2))(x, A_log, dt_bias)
    for got, want in zip(grads, (ds * a, (ds * u).sum(axis=(0, 1, 3)), (ds * a).sum(axis=(0, 1)))):
        assert rel_err(got, want) < 1e-5


def test_softplus_gate_formula_and_gradients():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((3, 4, 2)), jnp.float32)  # [B, T, H]: one gate per head
    A_log = jnp.asarray(rng.standard_normal(2), jnp.float32)
    dt_bias = jnp.asarray(rng.standard_normal(2), jnp.float32)
    g = ops.softplus_gate(x, A_log, dt_bias)
    expected = -np.exp(np.asarray(A_log)) * np.log1p(np.exp(np.asarray(x) + np.asarray(dt_bias)))
    assert rel_err(g, expected) < 1e-6 and float(g.max()) < 0
    # dg/dx = dg/d dt_bias = -e^A_log sigmoid(x + dt_bias), dg/dA_log = g (float64)
    w = rng.standard_normal(x.shape)
    a, z = np.exp(np.asarray(A_log, np.float64)), np.asarray(x, np.float64) + np.asarray(dt_bias, np.float64)
    dz = -w * a / (1 + np.exp(-z))
    grads = jax.grad(lambda *args: jnp.sum(w * ops.softplus_gate(*args)), argnums=(0, 1, 2))(x, A_log, dt_bias)
    for got, want in zip(grads, (dz, (w * -a * np.log1p(np.exp(z))).sum(axis=(0, 1)), dz.sum(axis=(0, 1)))):
        assert rel_err(got, want) < 1e-5


def test_gate_helpers_reject_mismatched_shapes():
    with pytest.raises(ValueError, match="dt_bias"):
        ops.safe_gate(jnp.zeros((2, 3, 4)), jnp.zeros(3), jnp.zeros(4))
    with pytest.raises(ValueError, match="x must end"):
        ops.softplus_gate(jnp.zeros((2, 3, 5)), jnp.zeros(4), jnp.zeros(4))
    with pytest.raises(ValueError, match="lower_bound"):
        ops.safe_gate(jnp.zeros((2, 4)), jnp.zeros(4), jnp.zeros(4), lower_bound=1.0)


@pytest.mark.parametrize("lower_bound", [float("-inf"), float("nan"), 0.0, 2.0])
def test_safe_gate_needs_a_finite_negative_lower_bound(lower_bound):
    with pytest.raises(ValueError, match="lower_bound must be a finite number < 0"):
        ops.safe_gate(jnp.zeros((2, 4)), jnp.zeros(4), jnp.zeros(4), lower_bound=lower_bound)


def _kda(**overrides):
    x = make_inputs("kda", B=1, T=12, H=2, K=8, V=4)
    x.update(overrides)
    init = x.pop("initial_state")
    extra = x.pop("extra", {})
    return ops.linear_attention("kda", x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=init, **extra)


BAD_INPUTS = {
    "q rank": (dict(q=jnp.zeros((12, 2, 8))), r"q must be \[B, T, H, K\]"),
    "k shape": (dict(k=jnp.zeros((1, 12, 2, 4))), r"k must be \[1, 12, 2, 8\]"),
    "v mismatched T": (dict(v=jnp.zeros((1, 11, 2, 4))), r"v must be \[1, 12, 2, V\]"),
    "int q": (dict(q=jnp.zeros((1, 12, 2, 8), jnp.int32), k=jnp.zeros((1, 12, 2, 8), jnp.int32)), "floating"),
    "g per head for kda": (dict(g=jnp.zeros((1, 12, 2))), r"g must be \[B, T, H, K\]"),
    "g missing": (dict(g=None), r"g must be \[B, T, H, K\]"),
    "beta missing": (dict(beta=None), "beta must be"),
    "beta wrong": (dict(beta=jnp.zeros((1, 12))), r"beta must be \[B, T, H\]"),
    "initial_state": (dict(initial_state=jnp.zeros((1, 2, 4, 8))), r"initial_state must be \[N, H, K, V\] = \[1, 2, 8, 4\]"),
    "cu_seqlens with B > 1": (dict(q=jnp.zeros((2, 6, 2, 8))), None),
    "non-monotonic cu_seqlens": (dict(extra=dict(cu_seqlens=np.array([0, 8, 5, 12]))), "non-decreasing"),
    "cu_seqlens end": (dict(extra=dict(cu_seqlens=np.array([0, 5, 10]))), "end at T = 12"),
    "initial_state per sequence": (dict(extra=dict(cu_seqlens=np.array([0, 5, 12]))), r"initial_state must be \[N, H, K, V\] = \[2,"),
    "unknown backend": (dict(extra=dict(backend="cuda")), "backend must be one of"),
    "chunk_size": (dict(extra=dict(chunk_size=48)), r"chunk_size must be 16 \* 2\^m"),
    "positive g": (dict(g=jnp.full((1, 12, 2, 8), 0.5)), r"g must be a log decay <= 0"),
    "NaN g": (dict(g=jnp.full((1, 12, 2, 8), jnp.nan)), r"g must be a log decay <= 0"),
    "K zero": (dict(q=jnp.zeros((1, 12, 2, 0)), k=jnp.zeros((1, 12, 2, 0)), g=jnp.zeros((1, 12, 2, 0))), "K >= 1"),
    "V zero": (dict(v=jnp.zeros((1, 12, 2, 0)), initial_state=None), "V >= 1"),
    "scale string": (dict(extra=dict(scale="0.5")), "scale must be a finite number"),
    "scale per head": (dict(extra=dict(scale=jnp.ones(2))), "scale must be a finite number"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_value_error_naming_the_argument(case):
    overrides, pattern = BAD_INPUTS[case]
    if case == "cu_seqlens with B > 1":
        x = make_inputs("kda", B=2, T=6, H=2, K=8, V=4)
        with pytest.raises(ValueError, match="B == 1"):
            ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=np.array([0, 3, 6]))
        return
    with pytest.raises(ValueError, match=pattern):
        _kda(**overrides)


def test_rule_specific_errors():
    x = make_inputs("gla", B=1, T=12, H=2, K=8, V=4)
    with pytest.raises(ValueError, match="beta must be None for the additive write"):
        ops.linear_attention("gla", x["q"], x["k"], x["v"], x["g"], jnp.zeros((1, 12, 2)))
    with pytest.raises(ValueError, match="g must be None"):
        ops.linear_attention("norm_attn", x["q"], x["k"], x["v"], x["g"])
    e = make_inputs("delta_element", B=1, T=12, H=2, K=8, V=4)
    with pytest.raises(ValueError, match="no scan form"):
        ops.linear_attention("delta_element", e["q"], e["k"], e["v"], e["g"], e["beta"], backend="scan")
    with pytest.raises(ValueError, match="unknown rule"):
        ops.linear_attention("mamba", x["q"], x["k"], x["v"])
    with pytest.raises(ValueError, match="normalize=True"):
        ops.Rule("delta", "none", normalize=True)
    with pytest.raises(TypeError):  # explicit signatures: a stray positional is a TypeError
        ops.chunk_gla(x["q"], x["k"], x["v"], x["g"], None, None)


def test_traced_cu_seqlens_gets_a_clear_error():
    x = make_inputs("gla", B=1, T=12, H=2, K=8, V=4)
    f = jax.jit(lambda cu: ops.chunk_gla(x["q"], x["k"], x["v"], x["g"], cu_seqlens=cu)[0])
    with pytest.raises(ValueError, match="cu_seqlens must be concrete"):
        f(jnp.array([0, 5, 12]))
