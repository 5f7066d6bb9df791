"""Host-side cost of one call, lineattn's Pallas forward (and forward+backward) beside jla's and a trivial `q * 2`.

    PYTHONPATH=$PWD/.site:$PWD python3 benchmarks/dispatch_probe.py     (on the GPU machine, .whl installed)

KDA and GDN at 8 x 4096 x 16 x 128, bf16. For each call it prints: whether JAX's C++ fast path dispatches it (read by
wrapping the private `jax._src.pjit._get_fastpath_data`: a call outside the fast path runs Python on every call),
the median time for the call to return without waiting (dispatch), the median call ended by `block_until_ready`
(the benchmark's timing) and the mean of 30 calls launched back to back (device-bound when dispatch keeps ahead).
"""
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import pjit

sys.path.insert(0, str(Path(__file__).parent))
from bench_kda import forward_backward  # noqa: E402
from lineattn import ops  # noqa: E402

seen = {}  # the last compiled call's fast-path verdict and its executable's effects
orig = pjit._get_fastpath_data


def spy(executable, out_tree, args_flat, out_flat, effects, *a, **k):
    """JAX's own verdict, recorded in `seen` for a call that produced arrays (not a trace)."""
    r = orig(executable, out_tree, args_flat, out_flat, effects, *a, **k)
    u = getattr(executable, "unsafe_call", None)
    if out_flat and type(out_flat[0]).__name__ == "ArrayImpl":
        seen["info"] = dict(fast=r is not None, effects=str(effects), ordered=getattr(u, "ordered_effects", None),
                            unordered=getattr(u, "has_unordered_effects", None),
                            host_cb=getattr(u, "has_host_callbacks", None), exe=type(executable).__name__,
                            call=type(u).__name__)
    return r


def main():
    pjit._get_fastpath_data = spy
    B, T, H, K = 8, 4096, 16, 128
    r = np.random.default_rng(0)
    q = jnp.asarray(r.standard_normal((B, T, H, K)) / np.sqrt(K), jnp.bfloat16)
    beta = jnp.asarray(r.random((B, T, H)), jnp.bfloat16)
    do = jnp.asarray(r.standard_normal((B, T, H, K)), jnp.bfloat16)
    impls = {}
    for rule, kind in (("gdn", "gated_deltanet"), ("kda", "kda")):
        g = jnp.asarray(-5 * r.random((B, T, H, K) if rule == "kda" else (B, T, H)), jnp.float32)
        args = (q, q, q, g, beta)
        impls[f"lineattn-{rule}"] = (lambda q, k, v, g, b, rule=rule: ops.linear_attention(
            rule, q, k, v, g, b, backend="pallas")[0], args)
        try:
            import jla.ops as jla_ops
            impls[f"jla-{rule}"] = (lambda q, k, v, g, b, kind=kind: jla_ops.linear_attention(
                kind, q, k, v, g=g, beta=b, impl="mosaic_gpu")[0], args)
        except ImportError:
            pass
    impls["noop"] = (lambda q, k, v, g, b: q * 2, impls["lineattn-gdn"][1])
    for name, (f, args) in impls.items():
        for mode, fn in (("fwd", jax.jit(f)), ("fwdbwd", jax.jit(forward_backward(f, do)))):
            seen.clear()
            jax.block_until_ready(fn(*args))
            info = seen.get("info")
            jax.block_until_ready(fn(*args))
            disp, sync = [], []
            for _ in range(20):
                t0 = time.perf_counter()
                out = fn(*args)
                t1 = time.perf_counter()
                jax.block_until_ready(out)
                t2 = time.perf_counter()
                disp.append(t1 - t0)
                sync.append(t2 - t0)
            t0 = time.perf_counter()
            for _ in range(30):
                out = fn(*args)
            jax.block_until_ready(out)
            b2b = (time.perf_counter() - t0) / 30
            ms = lambda x: f"{1e3 * float(np.median(x)):.3f}"
            print(f"{name:14s} {mode:6s} dispatch {ms(disp)} ms, sync call {ms(sync)} ms, "
                  f"back to back {1e3 * b2b:.3f} ms; {info}", flush=True)


if __name__ == "__main__":
    main()
