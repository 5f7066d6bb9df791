"""Times the per-element-gate rules' backends (forward+backward), to choose one for the ablation grid's
per-element rows: the token-level `recurrent` scan, the additive rule's `associative_scan`, and the `chunk`
backend by value columns (`lineattn/ops/columns.py`) at several chunk sizes.

    python benchmarks/bench_element.py --shapes 8x256 --iters 3                          # CPU, small
    python benchmarks/bench_element.py --shapes 32x256,64x256,64x512 --out $OUT          # the ablations' shapes

H = 2, K = V = 64 (the ablation models' heads), fp32; q, k L2-normalised, log gate in (-5, 0), beta in (0, 1).
Each backend's output is compared with the recurrence's first (max relative error). JAX: jit, one warm-up, median
of --iters calls ended by block_until_ready. Writes <out>/<date>-<device>-element.json: {"op", "impl", "mode",
"B", "T", "H", "K", "V", "ms", "compile_s", "max_rel_err", "device", "versions"} records.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench_kda import device_tag, make_inputs, rel_err, time_jax, versions, write_results
from lineattn import ops

H, K, V = 2, 64, 64


def inputs(rule, B, T, seed=0):
    """bench_kda's inputs, with the log gate drawn per state element [B, T, H, K, V] in (-5, 0)."""
    x, _ = make_inputs(B, T, H, K, V, "float32", seed)
    g = np.random.default_rng(seed + 1).uniform(-5.0, 0.0, (B, T, H, K, V))
    beta = jnp.asarray(x["beta"]) if ops.RULES[rule].write == "delta" else None
    return [jnp.asarray(x["q"]), jnp.asarray(x["k"]), jnp.asarray(x["v"]), jnp.asarray(g, jnp.float32)], beta


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="32x256,64x512", help="BxT, comma-separated")
    p.add_argument("--chunks", default="16,32,64", help="chunk sizes of the chunk backend")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    device = str(jax.devices()[0].device_kind)
    tag = device_tag(device)
    print(f"per-element rules, H={H} K={K} V={V} fp32 on {device}", flush=True)
    records = []
    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        for rule in ("element", "delta_element"):
            x, beta = inputs(rule, B, T)
            backends = [("recurrent", 64)] + ([("scan", 64)] if ops.RULES[rule].has_scan_form else [])
            backends += [("chunk", int(c)) for c in a.chunks.split(",") if c]
            reference = None
            for backend, chunk_size in backends:
                f = lambda q, k, v, g, b=backend, c=chunk_size: ops.linear_attention(
                    rule, q, k, v, g, beta, backend=b, chunk_size=c)[0]
                o = np.asarray(jax.jit(f)(*x))
                reference = o if reference is None else reference
                fwdbwd = jax.jit(jax.grad(lambda *xs, f=f: jnp.sum(jnp.sin(f(*xs))), argnums=(0, 1, 2, 3)))
                start = time.perf_counter()
                jax.block_until_ready(fwdbwd(*x))
                compile_s = time.perf_counter() - start
                ms = time_jax(fwdbwd, x, a.iters)
                impl = backend if backend != "chunk" else f"chunk{chunk_size}"
                err = rel_err(o, reference)
                print(f"  {rule:14s} B={B:<3d} T={T:<4d} {impl:10s} fwdbwd {ms:9.2f} ms  (compile {compile_s:5.1f} s, "
                      f"max rel err vs recurrent {err:.1e})", flush=True)
                records.append(dict(op=rule, impl=f"lineattn-{impl}", mode="fwdbwd", B=B, T=T, H=H, K=K, V=V, ms=ms,
                                    compile_s=round(compile_s, 2), max_rel_err=err, device=device,
                                    versions=versions()))
                if a.out:  # after every record: a run stopped by a timeout keeps what it measured
                    write_results(a.out, f"{tag}-element", records)


if __name__ == "__main__":
    main()
