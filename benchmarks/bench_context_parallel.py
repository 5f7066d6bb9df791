"""Context parallelism vs one device: peak memory per device and step time as the sequence grows with the devices.

    python benchmarks/bench_context_parallel.py --T-per-device 1024 --devices 1 2 4 8 --out benchmarks/results

For P in --devices, T = P x --T-per-device tokens of KDA (B=1, fp32): `ops.context_parallel_attention` with the
sequence sharded over P simulated CPU devices (`--xla_force_host_platform_device_count`), beside
`ops.linear_attention(backend="chunk")` on one device at the same T. Each is one jitted forward + backward
(gradients of q, k, v, g, beta for the loss sum(o * do)).

- memory: XLA's own accounting of the compiled program (`compiled.memory_analysis()`), which for a sharded
  program is per device: arguments + outputs + temporaries - aliased bytes (an upper bound of the live peak).
- time: median wall-clock ms over --iters calls, plus the process CPU time per call divided by P
  ("cpu-ms / device"). The simulated devices share this machine's cores, so wall time measures the total work of
  all P devices; CPU time per device is the proxy for what each device would spend on its own.
- max_rel_err: the sharded output against the single-device output.

Writes <out>/<date>-cpu-context-parallel.json: a list of records, one per (impl, P).
"""

from __future__ import annotations

import argparse
import os

DEFAULT_DEVICES = [1, 2, 4, 8]
if __name__ == "__main__":  # the simulated device count must be set before jax starts
    _pre = argparse.ArgumentParser(add_help=False)
    _pre.add_argument("--devices", type=int, nargs="+", default=DEFAULT_DEVICES)
    _count = max(_pre.parse_known_args()[0].devices)
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_count}"

import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from bench_kda import write_results
from lineattn import ops


def make_inputs(T, H, K, V, seed=0):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    f32 = lambda x: jnp.asarray(x, jnp.float32)
    return (f32(unit(rng.standard_normal((1, T, H, K)))), f32(unit(rng.standard_normal((1, T, H, K)))),
            f32(rng.standard_normal((1, T, H, V))), f32(rng.uniform(-0.1, 0.0, (1, T, H, K))),
            f32(rng.uniform(0.0, 1.0, (1, T, H)))), f32(rng.standard_normal((1, T, H, V)))


def memory(compiled) -> dict:
    m = compiled.memory_analysis()
    if m is None:
        return {}
    arg, out, tmp, alias = (int(getattr(m, f"{n}_size_in_bytes", 0)) for n in ("argument", "output", "temp", "alias"))
    return {"peak_bytes_per_device": arg + out + tmp - alias, "temp_bytes_per_device": tmp,
            "argument_bytes_per_device": arg, "output_bytes_per_device": out}


def time_it(fn, args, iters):
    jax.block_until_ready(fn(*args))
    wall, cpu = [], []
    for _ in range(iters):
        w, c = time.perf_counter(), time.process_time()
        jax.block_until_ready(fn(*args))
        wall.append(time.perf_counter() - w)
        cpu.append(time.process_time() - c)
    return 1e3 * float(np.median(wall)), 1e3 * float(np.median(cpu))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--devices", type=int, nargs="+", default=DEFAULT_DEVICES)
    p.add_argument("--T-per-device", type=int, default=1024)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--V", type=int, default=64)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--out", type=Path, help="folder for the results JSON")
    a = p.parse_args()
    cores = os.cpu_count()
    print(f"KDA B=1 H={a.H} K=V={a.K}/{a.V} chunk={a.chunk} fp32, fwd+bwd; {len(jax.devices())} simulated CPU devices "
          f"on {cores} cores; T = P x {a.T_per_device}")

    records = []
    for P in a.devices:
        T = P * a.T_per_device
        (q, k, v, g, beta), do = make_inputs(T, a.H, a.K, a.V)
        mesh = Mesh(np.array(jax.devices()[:P]), ("context",))
        impls = {
            "single_device_chunk": (1, lambda *x: ops.linear_attention("kda", *x, chunk_size=a.chunk)[0]),
            "context_parallel": (P, lambda *x: ops.context_parallel_attention("kda", *x, mesh=mesh,
                                                                               chunk_size=a.chunk)[0]),
        }
        reference = None
        for name, (devices, f) in impls.items():
            o = np.asarray(jax.jit(f)(q, k, v, g, beta))
            reference = o if reference is None else reference
            err = float(np.max(np.abs(o - reference)) / np.max(np.abs(reference)))
            step = jax.jit(jax.grad(lambda *x: jnp.sum(f(*x) * do), argnums=(0, 1, 2, 3, 4)))
            start = time.perf_counter()
            compiled = step.lower(q, k, v, g, beta).compile()
            compile_s = time.perf_counter() - start
            ms, cpu_ms = time_it(compiled, (q, k, v, g, beta), a.iters)
            rec = dict(op="kda", impl=name, mode="fwdbwd", devices=devices, B=1, T=T, T_per_device=T // devices,
                       H=a.H, K=a.K, V=a.V, chunk=a.chunk, dtype="float32", ms=ms, cpu_ms_per_device=cpu_ms / devices,
                       compile_s=compile_s, max_rel_err=err, **memory(compiled),
                       device=f"cpu, {len(jax.devices())} simulated devices on {cores} cores",
                       versions={"jax": jax.__version__})
            records.append(rec)
            mib = rec.get("peak_bytes_per_device", float("nan")) / 2**20
            print(f"  {name:20s} P={devices} T={T:6d} T/P={T // devices:6d}  peak/device {mib:8.1f} MiB  "
                  f"wall {ms:9.1f} ms  cpu/device {cpu_ms / devices:9.1f} ms  err {err:.1e}", flush=True)

    print("\n| P | T | T/P | single device: peak MiB | wall ms | context parallel: peak MiB / device | wall ms | "
          "cpu ms / device |")
    print("|---|---|---|---|---|---|---|---|")
    by = {(r["impl"], r["T"]): r for r in records}
    for P in a.devices:
        T = P * a.T_per_device
        s, c = by[("single_device_chunk", T)], by[("context_parallel", T)]
        mb = lambda r: r.get("peak_bytes_per_device", float("nan")) / 2**20
        print(f"| {P} | {T} | {T // P} | {mb(s):.1f} | {s['ms']:.1f} | {mb(c):.1f} | {c['ms']:.1f} | "
              f"{c['cpu_ms_per_device']:.1f} |")

    if a.out:
        write_results(a.out, "cpu-context-parallel", records)


if __name__ == "__main__":
    main()
