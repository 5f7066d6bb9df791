"""The oracle itself, against independent float64 NumPy code written from the state equation, and the classic
closed forms of the additive ungated rules."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_inputs, rel_err
from lineattn import ops


@functools.partial(jax.jit, static_argnums=0, static_argnames=("backend", "output_final_state", "scale"))
def linear_attention(rule, q, k, v, g=None, beta=None, **kwargs):
    """`ops.linear_attention`, jitted: one compile per call signature (eager, the scan backend's associative scan
    compiles every slice on its own)."""
    return ops.linear_attention(rule, q, k, v, g, beta, **kwargs)


def numpy_rule(rule, q, k, v, g, beta, h0, scale):
    """S_t = (I - b k k^T) D(S) + b k v^T (delta) or D(S) + k v^T (additive); o_t = scale S^T q, in float64."""
    rule = ops.resolve_rule(rule)
    q, k, v, h0 = (np.asarray(x, np.float64) for x in (q, k, v, h0))
    B, T, H, K = q.shape
    o = np.zeros(v.shape)
    S = h0.copy()
    for b in range(B):
        for h in range(H):
            s = S[b, h]
            for t in range(T):
                decay = {"none": lambda: 1.0, "fixed": lambda: np.exp(g[h]), "head": lambda: np.exp(g[b, t, h]),
                         "channel": lambda: np.exp(g[b, t, h])[:, None], "element": lambda: np.exp(g[b, t, h])}
                s = decay[rule.gate]() * s
                if rule.write == "delta":
                    kk = np.outer(k[b, t, h], k[b, t, h])
                    s = (np.eye(K) - beta[b, t, h] * kk) @ s + beta[b, t, h] * np.outer(k[b, t, h], v[b, t, h])
                else:
                    s = s + np.outer(k[b, t, h], v[b, t, h])
                o[b, t, h] = scale * s.T @ q[b, t, h]
            S[b, h] = s
    return o, S


@pytest.mark.parametrize("rule", [n for n, r in ops.RULES.items() if not r.normalize])
def test_oracle_matches_float64_state_equation(rule):
    x = make_inputs(rule, B=1, T=20, H=2, K=8, V=6)
    o, ht = ops.linear_attention(rule, x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                 output_final_state=True, backend="recurrent", scale=0.7)
    g = None if x["g"] is None else np.asarray(x["g"], np.float64)
    beta = None if x["beta"] is None else np.asarray(x["beta"], np.float64)
    o_np, S_np = numpy_rule(rule, x["q"], x["k"], x["v"], g, beta, x["initial_state"], 0.7)
    assert rel_err(o, o_np) < 1e-5 and rel_err(ht, S_np) < 1e-5


@pytest.mark.parametrize("rule,backend", [("kda", "recurrent"), ("kda", "chunk"), ("kda", "scan"), ("kda", "pallas"),
                                          ("gdn", "chunk"), ("gdn", "pallas"), ("gla", "chunk"), ("retnet", "chunk")])
def test_gates_far_below_the_floor_match_the_float64_state_equation(rule, backend):
    # log 0 = -inf, -1e30 and -1000 at a few tokens: e^g is 0 at each, so the state restarts there. In a chunk form's
    # cumsum -inf would give NaN (-inf - -inf) and -1e30 would absorb every later gate of its chunk; every backend
    # raises such gates to ops.LOG_GATE_FLOOR (-120, also 0 once exponentiated in fp32): the XLA ones first, the Pallas
    # kernels as they load g. The gradients stay finite and g's is 0 where it was raised (pallas: K = V = 16, its
    # smallest head dims; interpret mode on the CPU).
    K = V = 16 if backend == "pallas" else 8
    x = make_inputs(rule, B=1, T=100, H=2, K=K, V=V, seed=11, g_low=-1.0)
    g = np.array(x["g"])
    cut = [5, 70, 90] if rule != "retnet" else None
    if cut is None:  # a fixed gate [H]: one head never keeps its state
        g[0] = -np.inf
    else:
        g[:, cut[0]], g[:, cut[1]], g[:, cut[2]] = -np.inf, -1e30, -1000.0
    args = (x["q"], x["k"], x["v"], jnp.asarray(g), x["beta"])
    o, ht = linear_attention(rule, *args, initial_state=x["initial_state"], output_final_state=True,
                             backend=backend, scale=0.7)
    beta = None if x["beta"] is None else np.asarray(x["beta"], np.float64)
    o_np, S_np = numpy_rule(rule, x["q"], x["k"], x["v"], g.astype(np.float64), beta, x["initial_state"], 0.7)
    tol = 1e-5 if backend == "recurrent" else 1e-4  # (the fast paths' fp32 tolerance against the oracle)
    assert rel_err(o, o_np) < tol and rel_err(ht, S_np) < tol

    loss = lambda *a: jnp.sum(ops.linear_attention(rule, *a, initial_state=x["initial_state"], backend=backend)[0])
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    assert all(bool(jnp.all(jnp.isfinite(d))) for d in grads)
    assert bool(jnp.all(jnp.where(jnp.asarray(g) < ops.LOG_GATE_FLOOR, grads[3], 0.0) == 0.0))


@pytest.mark.parametrize("backend", ["recurrent", "chunk", "scan"])
def test_vanilla_linear_attention_is_the_normalised_causal_sum(backend):
    # o_t = sum_{s<=t} (phi(q_t).phi(k_s)) v_s / sum_{s<=t} phi(q_t).phi(k_s), phi = elu + 1.
    x = make_inputs("linear_attn", B=1, T=70, H=2, K=8, V=5)
    o, _ = linear_attention("linear_attn", x["q"], x["k"], x["v"], backend=backend)
    phi = lambda a: np.where(a > 0, a + 1.0, np.exp(a))
    fq, fk, v = phi(np.asarray(x["q"], np.float64)), phi(np.asarray(x["k"], np.float64)), np.asarray(x["v"], np.float64)
    scores = np.tril(np.einsum("bthk,bshk->bhts", fq, fk))
    expected = np.einsum("bhts,bshv->bthv", scores, v) / scores.sum(-1).transpose(0, 2, 1)[..., None]
    assert rel_err(o, expected) < 1e-5


@pytest.mark.parametrize("backend", ["recurrent", "chunk", "scan"])
def test_norm_attention_is_masked_quadratic_attention_without_denominator(backend):
    x = make_inputs("norm_attn", B=1, T=70, H=2, K=8, V=5)
    o, _ = linear_attention("norm_attn", x["q"], x["k"], x["v"], backend=backend, scale=1.0)
    q, k, v = (np.asarray(x[n], np.float64) for n in "qkv")
    expected = np.einsum("bhts,bshv->bthv", np.tril(np.einsum("bthk,bshk->bhts", q, k)), v)
    assert rel_err(o, expected) < 1e-5


def _final_state(rule, g, k, v, backend):
    _, ht = linear_attention(rule, jnp.zeros_like(k), k, v, g, output_final_state=True, backend=backend)
    return ht


@pytest.mark.parametrize("backend", ["recurrent", "chunk", "scan"])
def test_ungated_additive_state_is_order_invariant_and_gated_is_not(backend):
    # The article's remark: with S += k v^T, feeding [A, B] or [B, A] ends in the same state; a forget gate breaks it.
    x = make_inputs("norm_attn", B=1, T=96, H=2, K=8, V=6)
    k, v = x["k"], x["v"]
    swap = lambda a: jnp.concatenate([a[:, 40:], a[:, :40]], axis=1)  # blocks A = [0, 40), B = [40, 96)
    ab = _final_state("norm_attn", None, k, v, backend)
    ba = _final_state("norm_attn", None, swap(k), swap(v), backend)
    assert rel_err(ba, ab) < 1e-6
    g = make_inputs("simple_gla", B=1, T=96, H=2, K=8, V=6, g_low=-0.5)["g"]
    ab_gated = _final_state("simple_gla", g, k, v, backend)
    ba_gated = _final_state("simple_gla", swap(g), swap(k), swap(v), backend)
    assert rel_err(ba_gated, ab_gated) > 0.1


def test_jitted_chunk_kda_takes_bf16_and_returns_bf16_close_to_fp32():
    x = make_inputs("kda", B=1, T=80, H=2, K=16, V=16)
    bf = {n: (a.astype(jnp.bfloat16) if n in "qkv" else a) for n, a in x.items() if a is not None}
    f = jax.jit(lambda q, k, v, g, beta: ops.chunk_kda(q, k, v, g, beta)[0])
    o = f(bf["q"], bf["k"], bf["v"], bf["g"], bf["beta"])
    assert o.dtype == jnp.bfloat16
    o32, _ = ops.chunk_kda(bf["q"].astype(jnp.float32), bf["k"].astype(jnp.float32), bf["v"].astype(jnp.float32),
                           bf["g"], bf["beta"], backend="recurrent")
    assert rel_err(o.astype(jnp.float32), o32) < 1e-2  # bf16 rounding of the output only
