"""Context parallelism (`ops.context_parallel_attention`) against the single-device chunk form.

The multi-device checks need `XLA_FLAGS=--xla_force_host_platform_device_count=8` before jax starts, so each runs
this file as a script in a subprocess (`python tests/test_context_parallel.py <case>`), which prints its relative
errors as JSON on its last line. Per device count (2, 4, 8), one compiled function covers all five rules with and
without packing, and one more the single-device reference (compiled once a session: the subprocesses use the
session's compilation cache); XLA's backend optimisation and LLVM's expensive passes are off in the subprocess
(as in tests/conftest.py: the same arithmetic, compiled faster).
fp32, metric max|x - x_ref| / max|x_ref|, tolerance 1e-5 on o, the final state and the gradients of q, k, v, g,
beta and the initial state. Gates are mild (log decay in (-0.05, 0)), so every state
really crosses device boundaries: scaling the carried state by 0.999 gives errors of about 1e-3.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

TOL = 1e-5
RULES = ("kda", "gdn", "deltanet", "gla", "simple_gla", "retnet", "linear_attn")  # every gate but element
T, H, K, V, CHUNK = 128, 2, 16, 16, 16
# Packed documents: an empty one, one of a single token, one ending and one starting exactly at the middle device
# boundary (64), and others crossing the boundaries of 2, 4 and 8 devices (multiples of 64, 32, 16).
CU_SEQLENS = (0, 21, 21, 50, 51, 64, 100, 128)
ROOT = Path(__file__).resolve().parent.parent


def _run_worker(*args: str) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0 "
               "--xla_llvm_disable_expensive_passes=true", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, __file__, *args], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (f"worker {args} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n"
                                  f"{proc.stderr[-6000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _assert_errors(errors: dict):
    worst = {case: max(errs.values()) for case, errs in errors.items()}
    bad = {case: errs for case, errs in errors.items() if not max(errs.values()) <= TOL}
    assert not bad, f"relative max error above {TOL}: {bad}"
    print(json.dumps(worst, indent=1))


@pytest.mark.parametrize("devices", ["2,8", "4"])  # two workers of about equal cost; each compiles the reference once
def test_matches_single_device(devices):
    errors = _run_worker("match", devices)
    assert len(errors) == 2 * len(RULES) * len(devices.split(","))
    _assert_errors(errors)


def test_train_step_with_context_axis_matches_without():
    # A tiny KDA layer's SGD step inside an outer shard_map (mesh=None, the trainer's way), data x context mesh.
    _assert_errors(_run_worker("train"))


def test_errors_name_the_argument():
    assert _run_worker("errors") == {"ok": {"checked": 1.0}}


# ---------------------------------------------------------------------------------------------------------------
# Worker side: runs in a subprocess with 8 simulated CPU devices.


def _worker_match(device_counts: list[int]) -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from conftest import GRAD_ARGS, make_inputs, rel_err
    from lineattn import ops

    configs = []
    for rule in RULES:
        for cu in (None, CU_SEQLENS):
            B, num_seqs = (2, None) if cu is None else (1, len(cu) - 1)
            x = make_inputs(rule, B=B, T=T, H=H, K=K, V=V, num_seqs=num_seqs, seed=len(configs), g_low=-0.05)
            args = {n: x[n] for n in GRAD_ARGS if x[n] is not None}
            rng = np.random.default_rng(100 + len(configs))
            cotangents = (jnp.asarray(rng.standard_normal(x["v"].shape), jnp.float32),
                          jnp.asarray(rng.standard_normal(x["initial_state"].shape), jnp.float32))
            configs.append((f"{rule}/{'packed' if cu else 'batched'}", rule, cu, args, cotangents))

    def loss_and_outputs(all_args, attention):
        total, outputs = 0.0, []
        for (_, rule, cu, _, (do, dht)), a in zip(configs, all_args):
            o, ht = attention(rule, a["q"], a["k"], a["v"], a.get("g"), a.get("beta"), initial_state=a["initial_state"],
                              output_final_state=True, cu_seqlens=cu, chunk_size=CHUNK)
            total = total + jnp.sum(o * do) + jnp.sum(ht * dht)
            outputs.append({"o": o, "ht": ht})
        return total, outputs

    def run(attention):
        fn = jax.jit(jax.value_and_grad(lambda a: loss_and_outputs(a, attention), has_aux=True))
        (_, outputs), grads = fn([c[3] for c in configs])
        return [dict(out, **{"d" + n: g for n, g in grad.items()}) for out, grad in zip(outputs, grads)]

    sharded = {}
    for P in device_counts:
        mesh = Mesh(np.array(jax.devices()[:P]), ("context",))
        sharded[P] = run(lambda *a, **kw: ops.context_parallel_attention(*a, mesh=mesh, axis_name="context", **kw))
    # The reference last: the workers for "2,8" and "4" compile the same one, and under pytest-xdist they run at
    # once; the one that gets here second finds it in the shared compilation cache (see `__main__`).
    single = run(lambda *a, **kw: ops.linear_attention(*a, backend="chunk", **kw))
    errors = {}
    for P in device_counts:
        for (name, *_), s, r in zip(configs, sharded[P], single):
            errors[f"P={P}/{name}"] = {key: rel_err(s[key], r[key]) for key in r}
    return errors


def _tiny_layer(params, x, attention, cu):
    """One KDA layer with projections: the loss of a regression on the layer's output."""
    import jax
    import jax.numpy as jnp

    B, T_, _ = x.shape
    unit = lambda z: z / jnp.linalg.norm(z, axis=-1, keepdims=True)
    heads = lambda z: z.reshape(B, T_, H, -1)
    q, k = unit(heads(x @ params["wq"])), unit(heads(x @ params["wk"]))
    v = heads(x @ params["wv"])
    g = -0.05 * jax.nn.sigmoid(heads(x @ params["wg"]))
    beta = jax.nn.sigmoid(x @ params["wb"])
    o, _ = attention("kda", q, k, v, g, beta, cu_seqlens=cu, chunk_size=CHUNK)
    return o.reshape(B, T_, H * V) @ params["wo"]


def _worker_train() -> dict:
    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import Mesh, PartitionSpec

    from conftest import rel_err
    from lineattn import ops

    D = 12
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[0]), jnp.float32)
    params = {"wq": normal(D, H * K), "wk": normal(D, H * K), "wv": normal(D, H * V), "wg": normal(D, H * K),
              "wb": normal(D, H), "wo": normal(H * V, D)}
    optimizer = optax.sgd(0.5)
    errors = {}
    for name, axes, B, cu in (("shard_map/data2xcontext4/batched", {"data": 2, "context": 4}, 2, None),
                              ("shard_map/context8/packed", {"context": 8}, 1, CU_SEQLENS),
                              ("jit/data2xcontext4/batched", {"data": 2, "context": 4}, 2, None)):
        x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
        y = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
        mesh = Mesh(np.array(jax.devices()).reshape(tuple(axes.values())), tuple(axes))
        data = PartitionSpec("data" if "data" in axes else None, "context")

        def local_loss(params, x, y):  # this device's share of the summed squared error
            sharded = lambda *a, **kw: ops.context_parallel_attention(*a, axis_name="context", **kw)
            return jax.lax.psum(jnp.sum((_tiny_layer(params, x, sharded, cu) - y) ** 2), tuple(axes))

        if name.startswith("shard_map"):  # the layer runs inside the caller's shard_map (mesh=None)
            # check_vma=False: lineattn.ops.triangular's loop starts from an unvarying carry.
            sharded_loss = jax.shard_map(local_loss, mesh=mesh, in_specs=(PartitionSpec(), data, data),
                                         out_specs=PartitionSpec(), check_vma=False)
        else:  # a plain jitted step on global arrays; the op brings its own shard_map (mesh=..., batch_axes=...)
            attention = lambda *a, **kw: ops.context_parallel_attention(*a, mesh=mesh, batch_axes="data", **kw)
            sharded_loss = lambda p, x, y: jnp.sum((_tiny_layer(p, x, attention, cu) - y) ** 2)
        single_loss = lambda p, x, y: jnp.sum((_tiny_layer(p, x, ops.linear_attention, cu) - y) ** 2)

        def step(loss_fn):
            loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params, x, y)
            updates, _ = optimizer.update(grads, optimizer.init(params), params)
            return loss, grads, optax.apply_updates(params, updates)

        (l1, g1, p1), (l0, g0, p0) = step(sharded_loss), step(single_loss)
        errors[name] = {"loss": rel_err(l1, l0), **{"d" + n: rel_err(g1[n], g0[n]) for n in g0},
                        **{"new_" + n: rel_err(p1[n], p0[n]) for n in p0}}
    return errors


def _worker_errors() -> dict:
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh, PartitionSpec

    from conftest import make_inputs
    from lineattn import ops

    mesh = Mesh(np.array(jax.devices()[:4]), ("context",))
    x = make_inputs("kda", B=1, T=64, H=H, K=K, V=V)
    call = lambda **kw: ops.context_parallel_attention(
        "kda", **{**{n: x[n] for n in ("q", "k", "v", "g", "beta")}, "mesh": mesh, "chunk_size": CHUNK, **kw})
    cases = [
        (dict(q=x["q"][:, :62], k=x["k"][:, :62], v=x["v"][:, :62], g=x["g"][:, :62], beta=x["beta"][:, :62]),
         "T divisible by the 4 devices"),
        (dict(axis_name="sequence"), "axis_name 'sequence' is not an axis"),
        (dict(batch_axes="context"), "batch_axes 'context' must name mesh axes"),
        (dict(mesh=Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "context")), batch_axes="data"),
         "B divisible by the 2 devices on batch_axes 'data'"),
        (dict(mesh=None), "needs an enclosing jax.shard_map"),
        (dict(g=x["g"][..., 0]), "g must be [B, T, H, K]"),
        (dict(initial_state=jnp.zeros((2, H, K, V))), "initial_state must be [N, H, K, V] = [1,"),
        (dict(cu_seqlens=[0, 30, 60]), "cu_seqlens must start at 0 and end at T = 64"),
        (dict(chunk_size=24), "chunk_size must be"),
        (dict(g=-x["g"]), "g must be a log decay <= 0"),
        (dict(scale="0.5"), "scale must be a finite number"),
    ]
    for kwargs, message in cases:
        try:
            call(**kwargs)
        except ValueError as err:
            assert message in str(err), f"{kwargs.keys()}: {err}"
        else:
            raise AssertionError(f"no ValueError for {kwargs.keys()}")
    try:
        ops.context_parallel_attention("element", x["q"], x["k"], x["v"], jnp.zeros((1, 64, H, K, V)), mesh=mesh)
    except ValueError as err:
        assert "needs a rule with a chunk form" in str(err), err
    else:
        raise AssertionError("no ValueError for the per-element gate")
    # Inside shard_map, errors speak of the global shapes.
    local = jax.shard_map(lambda q: call(q=q, mesh=None), mesh=mesh, in_specs=PartitionSpec(None, "context"),
                          out_specs=PartitionSpec(None, "context"), check_vma=False)
    try:
        local(x["q"][..., :8])
    except ValueError as err:
        assert "global shapes" in str(err) and "k must be [1, 64, 2, 8]" in str(err), err
    else:
        raise AssertionError("no ValueError inside shard_map")
    return {"ok": {"checked": 1.0}}


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if os.environ.get("LINEATTN_TEST_JAX_CACHE"):  # the pytest session's compilation cache (tests/conftest.py)
        from lineattn.train.testing import enable_compile_cache

        enable_compile_cache(os.environ["LINEATTN_TEST_JAX_CACHE"])
    case = sys.argv[1]
    workers = {"match": lambda: _worker_match([int(p) for p in sys.argv[2].split(",")]), "train": _worker_train,
               "errors": _worker_errors}
    result = workers[case]()
    print(json.dumps(result))
