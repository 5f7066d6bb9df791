"""Shared helpers: random inputs for any rule, the relative error metric, and the oracle comparison."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

# Tests run tiny shapes many times: XLA CPU compile time dominates, and skipping LLVM's optimisation cuts it
# about 4x (same arithmetic, slower code). Set before JAX starts; a caller's own XLA_FLAGS come after and win.
os.environ["XLA_FLAGS"] = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                           + os.environ.get("XLA_FLAGS", ""))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from lineattn import ops  # noqa: E402
from lineattn.train.testing import enable_compile_cache  # noqa: E402

# Many tests compile the same computation again (the oracle on the same inputs for each backend, the same kernels
# from new closures): a compilation cache on disk for one test session, shared by the pytest-xdist workers (their
# controller makes it and removes it at the end; a run starts cold, as CI does; set LINEATTN_TEST_JAX_CACHE to keep
# one). This 2-core CPU, `make test` (2 workers): 569 s against 694 s without it.
_CACHE_ENV = "LINEATTN_TEST_JAX_CACHE"


def pytest_configure(config):
    if not hasattr(config, "workerinput") and _CACHE_ENV not in os.environ:  # the controller (or a lone process)
        os.environ[_CACHE_ENV] = tempfile.mkdtemp(prefix="lineattn-jax-cache-")
        config._lineattn_jax_cache = os.environ[_CACHE_ENV]
    enable_compile_cache(os.environ[_CACHE_ENV])


def pytest_unconfigure(config):
    if getattr(config, "_lineattn_jax_cache", None):
        shutil.rmtree(config._lineattn_jax_cache, ignore_errors=True)
        del os.environ[_CACHE_ENV]


# Gradient arguments of the op, in order, and which of them a rule takes.
GRAD_ARGS = ("q", "k", "v", "g", "beta", "initial_state")


def rel_err(actual, expected) -> float:
    """Relative max error: max |actual - expected| / max |expected|."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.max(np.abs(actual - expected)) / max(np.max(np.abs(expected)), 1e-30))


def make_inputs(rule, *, B=2, T=150, H=2, K=32, V=24, seed=0, g_low=-5.0, g_high=0.0, num_seqs=None):
    """Random fp32 inputs for `rule`: L2-normalised q, k; beta in (0, 1); log gates uniform in (g_low, g_high)."""
    rule = ops.resolve_rule(rule)
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    V_state = V + 1 if rule.normalize else V
    x = {
        "q": f32(unit(rng.standard_normal((B, T, H, K)))),
        "k": f32(unit(rng.standard_normal((B, T, H, K)))),
        "v": f32(rng.standard_normal((B, T, H, V))),
        "initial_state": f32(0.5 * rng.standard_normal((num_seqs or B, H, K, V_state))),
    }
    if rule.normalize:  # keep the normaliser's column positive, as a real state's is
        x["initial_state"] = x["initial_state"].at[..., -1].set(jnp.abs(x["initial_state"][..., -1]))
    gate_shape = {"none": None, "fixed": (H,), "head": (B, T, H), "channel": (B, T, H, K),
                  "element": (B, T, H, K, V)}[rule.gate]
    x["g"] = None if gate_shape is None else f32(rng.uniform(g_low, g_high, gate_shape))
    x["beta"] = f32(rng.uniform(0.0, 1.0, (B, T, H))) if rule.write == "delta" else None
    return x


def loss_and_grads(rule, inputs, *, backend, cu_seqlens=None, seed=1, programs=None, **kwargs):
    """o, final state and the gradients of sum(o * do) + sum(ht * dht) w.r.t. every input the rule takes.

    One jitted call computes all three through `jax.vjp` (one compilation; an eager forward beside a jitted
    gradient compiled every op twice). programs: a dict that keeps the jitted call by rule, backend, options and
    input shapes, so that a test running the same program on other values skips tracing and compiling it again
    (not for calls whose module constants change between them, as the Pallas tests' do)."""
    names = tuple(n for n in GRAD_ARGS if inputs[n] is not None)
    args = [inputs[n] for n in names]
    cu = None if cu_seqlens is None else tuple(int(c) for c in cu_seqlens)
    key = (rule, backend, names, cu, seed, tuple(sorted(kwargs.items())), tuple((a.shape, a.dtype) for a in args))
    if programs is not None and key in programs:
        o, ht, grads = programs[key](*args)
        return o, ht, dict(zip(["d" + n for n in names], grads))

    def run(*a):
        x = dict(zip(names, a))
        return ops.linear_attention(rule, x["q"], x["k"], x["v"], x.get("g"), x.get("beta"),
                                    initial_state=x["initial_state"], output_final_state=True,
                                    cu_seqlens=None if cu is None else np.array(cu), backend=backend, **kwargs)

    o_shape, ht_shape = jax.eval_shape(run, *args)
    rng = np.random.default_rng(seed)
    do = jnp.asarray(rng.standard_normal(o_shape.shape), jnp.float32)
    dht = jnp.asarray(rng.standard_normal(ht_shape.shape), jnp.float32)

    def forward_and_grads(*a):
        (o, ht), pullback = jax.vjp(run, *a)
        return o, ht, pullback((do.astype(o.dtype), dht.astype(ht.dtype)))

    program = jax.jit(forward_and_grads)
    if programs is not None:
        programs[key] = program
    o, ht, grads = program(*args)
    return o, ht, dict(zip(["d" + n for n in names], grads))


def grad_jaxpr(rule, x, **kwargs) -> str:
    """The jaxpr (as text) of the gradient of sum(o) with respect to q, for `ops.linear_attention(rule, ...)` on the
    inputs x (q, k, v, g, beta): which kernels a backend's forward and backward run (their `name=`s appear in it)."""
    loss = lambda q: jnp.sum(ops.linear_attention(rule, q, x["k"], x["v"], x["g"], x["beta"], **kwargs)[0]
                             .astype(jnp.float32))
    return str(jax.make_jaxpr(jax.grad(loss))(x["q"]))


def pallas_value_and_grad(backward: str, chunk_size: int = 64):
    """fn(q, k, v, g, beta, h0): the value and gradients of sum(o) + sum(ht) through `chunk_pallas` as traced for a
    GPU (interpret False; for jaxprs and lowering, not for running on a CPU), with respect to each input that is not
    None (beta None: the additive write); scale K ** -0.5."""
    from lineattn.ops.pallas.chunk import chunk_pallas

    def loss(q, k, v, g, beta, h0):
        o, ht = chunk_pallas(q, k, v, g, beta, h0, q.shape[-1] ** -0.5, chunk_size, False, backward)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    def value_and_grads(*args):
        return jax.value_and_grad(loss, argnums=tuple(i for i, a in enumerate(args) if a is not None))(*args)

    return value_and_grads


def assert_close(actual: dict, expected: dict, tol: float, context: str = ""):
    errors = {name: rel_err(actual[name], expected[name]) for name in expected}
    for name, value in expected.items():
        assert np.all(np.isfinite(np.asarray(actual[name]))), f"{context}: {name} has non-finite values"
    bad = {name: err for name, err in errors.items() if not err <= tol}
    assert not bad, f"{context}: relative max error above {tol}: {bad} (all: {errors})"


def load_script(name: str):
    """The module scripts/<name>.py (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def fake_h200(monkeypatch):
    """Pallas Triton lowers for an H200 (sm_90a) on a host without a GPU (lowering tests only)."""
    try:
        from jax._src.pallas.triton import gpu_info, pallas_call_registration
    except ImportError as err:  # a failure, not a skip: a skip would drop every lowering test unseen
        pytest.fail(f"private Pallas Triton hooks moved (JAX is pinned at 0.11.2; mend this fixture): {err}")
    info = gpu_info.GpuInfo(gpu_version=None, arch_name="sm_90a", compute_capability=90)
    monkeypatch.setattr(pallas_call_registration.gpu_info_lib, "get_gpu_info", lambda: info)
