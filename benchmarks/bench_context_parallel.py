"""Context parallelism vs one device for KDA forward + backward: time and peak memory per device.

Two modes. Each step timed is one jitted forward + backward: o and the gradients of q, k, v, g, beta for the loss
sum(o * do), with `ops.context_parallel_attention` (the sequence sharded over P devices) or
`ops.linear_attention` on one device. B = 1 (one sequence).

**scaling** (the default on CPU): T grows with the simulated CPU devices.

    python benchmarks/bench_context_parallel.py --T-per-device 1024 --devices 1 2 4 8 --out benchmarks/results

For P in --devices, T = P x --T-per-device tokens of KDA (fp32, H=4, K=V=64 by default) over P simulated CPU devices
(`--xla_force_host_platform_device_count`), beside `ops.linear_attention(backend="chunk")` on one device at the
same T.

- memory: XLA's own accounting of the compiled program (`compiled.memory_analysis()`), which for a sharded
  program is per device: arguments + outputs + temporaries - aliased bytes (an upper bound of the live peak).
- time: median wall-clock ms over --iters calls, plus the process CPU time per call divided by P
  ("cpu-ms / device"). The simulated devices share this machine's cores, so wall time measures the total work of
  all P devices; CPU time per device is the proxy for what each device would spend on its own.
- max_rel_err: the sharded output against the single-device output.

Writes <out>/<date>-cpu-context-parallel.json: a list of records, one per (impl, P).

**series** (the default with --platform gpu): issue 8, run 2. The issue asks for context-parallel KDA forward +
backward on 2 GPUs for one sequence of T = 524288, equal to the 1-GPU result where that fits, with the time and
memory per GPU, and the scaling against T on 1 GPU. Defaults on GPU: KDA, B=1, H=16, K=V=128, chunk 64, bf16 q, k,
v, beta and do (--dtype float32 for all-fp32), fp32 log gate g in (--g-low, 0) = (-0.1, 0) (mild, so that states
really cross the device boundary); q, k L2-normalised. Inputs are generated on the devices (threefry, the same
values whatever the sharding).

    python benchmarks/bench_context_parallel.py --platform gpu --out $OUT
    python benchmarks/bench_context_parallel.py --platform gpu --dtype float32 --single-T 65536 --cp-T 131072

Jobs, in this order (each in its own process with --isolate, the default on GPU, so that a crash is recorded
and the rest still runs, and each process's memory high-water mark belongs to its own job):

1. the one-device series (`ops.linear_attention(backend=--backend)`, "chunk": the XLA form that the context-
   parallel op shards) at each --single-T, ascending, in one process; after a size that does not fit, the
   larger ones are recorded as skipped;
2. context parallel on --cp-devices devices at each --cp-T; then, in the same process, the one-device result at
   that T (one call) and the relative errors of o and of every gradient against it ("where that fits");
3. for each --cp-T without a comparison (one device did not fit), context parallel again at the largest
   --single-T that fitted, with the comparison, so that the equality is checked on these devices anyway;
4. for each --cp-T where context parallel itself did not fit: the same T with fewer heads (--fallback-H, default
   8 then 4; memory is linear in H), stopping at the first that runs and is compared with one device.

A crash or timeout in the one-device series ends it (the larger sizes are recorded as skipped).

Before running a job, its compiled program's memory (XLA's `memory_analysis`) is checked against the device's
free memory (`memory_stats()`): a job that cannot fit is recorded as "oom-predicted" without running. That memory
is linear in T and H, so a size whose extrapolation (from the sizes compiled before, per token x head) does not
fit is "oom-predicted" without even compiling (the larger one-device sizes, the one-device reference of a
fewer-heads job, a fewer-heads job itself), which saves the compile time. A job that runs out of memory anyway is
"oom"; other failures "error", "crashed" (the process died) or "timeout"; jobs past
--budget-s are "skipped". A JAX compilation cache shared by the jobs (a temporary folder) saves compiling the
one-device program twice. Every record has "status"; the JSON is rewritten after every job.

Per record: ms (median of --iters calls after one warm-up, each ended by block_until_ready) and ms_all;
compile_s; XLA's per-device memory (peak_bytes_per_device = arguments + outputs + temporaries - aliased);
device_memory, per device used: `memory_stats()` peak_bytes_in_use (the process high-water mark), bytes_in_use,
bytes_limit, where the platform has them (GPUs do, CPUs do not); for context parallel, max_rel_err and
rel_rms_err per output (o, dq, dk, dv, dg, dbeta) against one device.

--compile-only stops each job after compiling (status "compiled", no fallbacks): XLA's memory figures without
running anything, e.g. the GPU defaults on simulated CPU devices (`--mode series --H 16 --K 128 --dtype bfloat16
--single-T 65536 131072 262144 524288 --cp-T 524288 --compile-only`; XLA:CPU's buffer accounting, not the GPU's).

Writes <out>/<date>-<platform>-context-parallel-series.json (--name to change) and prints a table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile

DEFAULT_DEVICES = [1, 2, 4, 8]
if __name__ == "__main__":  # the device platform (and the simulated device count) must be set before jax starts
    _pre = argparse.ArgumentParser(add_help=False)
    _pre.add_argument("--devices", type=int, nargs="+", default=DEFAULT_DEVICES)
    _pre.add_argument("--platform", choices=("cpu", "gpu"), default="cpu")
    _pre.add_argument("--mode", choices=("scaling", "series"))
    _pre.add_argument("--cp-devices", type=int, default=2)
    _known = _pre.parse_known_args()[0]
    if _known.platform == "cpu":
        _series = (_known.mode or "scaling") == "series"
        _count = _known.cp_devices if _series else max(_known.devices)
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={_count}"
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    else:
        os.environ.setdefault("JAX_PLATFORMS", "cuda")

import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_kda, when imported from elsewhere

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from bench_kda import forward_backward, versions, write_results
from lineattn import ops
from lineattn.train.metrics import device_memory

OUTPUTS = ("o", "dq", "dk", "dv", "dg", "dbeta")
GIB = 2**30


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


# ---------------------------------------------------------------------------------------------------------------
# series mode: the pieces (importable; tests run them on simulated CPU devices)
# ---------------------------------------------------------------------------------------------------------------

def input_structs(T, H, K, V, dtype, sharding) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Abstract (q, k, v, g, beta, do): B = 1; g fp32, the rest in `dtype`."""
    dt = jnp.dtype(dtype)
    shapes = ((1, T, H, K), dt), ((1, T, H, K), dt), ((1, T, H, V), dt), ((1, T, H, K), jnp.float32), \
        ((1, T, H), dt), ((1, T, H, V), dt)
    return tuple(jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in shapes)


def generate_inputs(T, H, K, V, dtype, sharding, *, seed=0, g_low=-0.1) -> tuple[jax.Array, ...]:
    """(q, k, v, g, beta, do) generated on the device(s) of `sharding`, the same values for every sharding."""
    dt = jnp.dtype(dtype)

    def gen(key):
        kq, kk, kv, kg, kb, kd = jax.random.split(key, 6)
        unit = lambda x: x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True))
        normal = lambda k, shape: jax.random.normal(k, shape, jnp.float32)
        return (unit(normal(kq, (1, T, H, K))).astype(dt), unit(normal(kk, (1, T, H, K))).astype(dt),
                normal(kv, (1, T, H, V)).astype(dt),
                jax.random.uniform(kg, (1, T, H, K), jnp.float32, g_low, 0.0),
                jax.random.uniform(kb, (1, T, H), jnp.float32).astype(dt), normal(kd, (1, T, H, V)).astype(dt))

    return jax.jit(gen, out_shardings=(sharding,) * 6)(jax.random.key(seed))


def kda_fn(kind: str, *, mesh: Mesh | None = None, chunk: int = 64, backend: str = "chunk"):
    """(q, k, v, g, beta) -> o: context parallel over `mesh`'s "context" axis, or one device with `backend`."""
    if kind == "cp":
        return lambda q, k, v, g, beta: ops.context_parallel_attention("kda", q, k, v, g, beta, mesh=mesh,
                                                                       chunk_size=chunk)[0]
    return lambda q, k, v, g, beta: ops.linear_attention("kda", q, k, v, g, beta, backend=backend,
                                                         chunk_size=chunk)[0]


def fwd_bwd(f):
    """jit of (q, k, v, g, beta, do) -> (o, dq, dk, dv, dg, dbeta): the forward and the gradients of sum(o * do)."""
    def step(q, k, v, g, beta, do):
        o, vjp = jax.vjp(f, q, k, v, g, beta)
        return (o, *vjp(do.astype(o.dtype)))
    return jax.jit(step)


def free_bytes(devices) -> int | None:
    stats = device_memory(devices)
    if any(s is None or s.get("bytes_limit") is None for s in stats):
        return None
    return min(s["bytes_limit"] - (s.get("bytes_in_use") or 0) for s in stats)


def available_bytes(devices, memory_limit_gib: float | None = None) -> int | None:
    """Free bytes on the fullest of `devices`, capped at --memory-limit-gib; None when unknown (CPU, no limit)."""
    free = free_bytes(devices)
    if memory_limit_gib is not None:
        free = min(free, int(memory_limit_gib * GIB)) if free is not None else int(memory_limit_gib * GIB)
    return free


def bytes_per_token_head(records, impl: str, devices: int) -> float | None:
    """XLA's per-device bytes per (token x head) of the compiled programs of `impl` on `devices` devices (the
    largest seen). The memory of these programs is linear in T and in H (51, 102, 204, 409 GiB for T = 64K .. 512K
    at H=16 on XLA:CPU), so this extrapolates to sizes not compiled yet."""
    units = [r["peak_bytes_per_device"] / (r["T"] * r["H"]) for r in records
             if r.get("impl") == impl and r.get("devices") == devices and r.get("peak_bytes_per_device")]
    return max(units) if units else None


def predicted_oom(kind, T, estimate, free, basis, **kw) -> dict:
    """The record of a job not compiled because its extrapolated memory exceeds the free memory."""
    rec = skipped(kind, T, f"extrapolated from {basis}: needs ~{fmt_bytes(estimate)} per device, {fmt_bytes(free)} "
                  f"free: not compiled", **kw)
    rec.update(status="oom-predicted", peak_bytes_per_device_estimate=int(estimate), free_bytes_before=free)
    return rec


def failure_status(err: BaseException) -> str:
    text = f"{type(err).__name__} {err}".lower()
    return "oom" if ("resource_exhausted" in text or "out of memory" in text or "oom" in text.split()) else "error"


def run_case(kind: str, T: int, *, P: int = 1, H: int, K: int, V: int, dtype: str, chunk: int = 64,
             backend: str = "chunk", iters: int = 5, seed: int = 0, g_low: float = -0.1, keep_outputs: bool = False,
             check_memory: bool = True, memory_limit_gib: float | None = None, compile_only: bool = False,
             devices=None) -> tuple[dict, tuple | None]:
    """One forward + backward job: compile (abstract inputs), check the memory, generate the inputs, time it.

    kind "cp": `ops.context_parallel_attention` over the first P devices; "single": one device (the first).
    Returns (record, outputs of the last call when keep_outputs and it ran, else None). Never raises for a
    failure of the job itself: the record's status says what happened.
    """
    devices = list(jax.devices() if devices is None else devices)[: P if kind == "cp" else 1]
    n = len(devices)
    impl = "context_parallel" if kind == "cp" else f"single_device_{backend}"
    rec = dict(op="kda", impl=impl, mode="fwdbwd", status="ok", devices=n, B=1, T=T, T_per_device=T // n, H=H, K=K,
               V=V, chunk=chunk, dtype=str(jnp.dtype(dtype)), g_low=g_low,
               device=f"{devices[0].device_kind} ({devices[0].platform}) x {n}" if devices else None)
    outs = None
    try:
        if kind == "cp" and n != P:
            raise ValueError(f"context parallel on {P} devices needs {P}, have {n}")
        if kind == "cp":
            mesh = Mesh(np.array(devices), ("context",))
            sharding = NamedSharding(mesh, PartitionSpec(None, "context"))
            f = kda_fn("cp", mesh=mesh, chunk=chunk)
        else:
            sharding = SingleDeviceSharding(devices[0])
            f = kda_fn("single", chunk=chunk, backend=backend)
        start = time.perf_counter()
        compiled = fwd_bwd(f).lower(*input_structs(T, H, K, V, dtype, sharding)).compile()
        rec["compile_s"] = time.perf_counter() - start
        rec.update(memory(compiled))
        if compile_only:
            rec["status"] = "compiled"
            return rec, None
        free = available_bytes(devices, memory_limit_gib)
        rec["free_bytes_before"] = free
        if check_memory and free is not None and rec.get("peak_bytes_per_device", 0) > free:
            rec["status"] = "oom-predicted"
            rec["error"] = (f"XLA's memory analysis needs {fmt_bytes(rec['peak_bytes_per_device'])} per device, "
                            f"{fmt_bytes(free)} free: not run")
            return rec, None
        args = generate_inputs(T, H, K, V, dtype, sharding, seed=seed, g_low=g_low)
        jax.block_until_ready(args)
        start = time.perf_counter()
        outs = jax.block_until_ready(compiled(*args))  # warm-up (kept when iters == 0)
        rec["first_call_ms"] = 1e3 * (time.perf_counter() - start)
        wall = []
        for _ in range(iters):
            outs = None  # free the previous outputs before the next call
            start = time.perf_counter()
            outs = jax.block_until_ready(compiled(*args))
            wall.append(1e3 * (time.perf_counter() - start))
        rec["ms"] = float(np.median(wall)) if wall else None
        rec["ms_all"] = wall
        rec["device_memory"] = device_memory(devices)
        del args
        if not keep_outputs:
            outs = None
    except Exception as err:  # noqa: BLE001 - recorded, the series goes on
        rec["status"] = failure_status(err)
        rec["error"] = f"{type(err).__name__}: {str(err)[:3000]}"
        rec["device_memory"] = device_memory(devices)
        outs = None
    return rec, outs


@jax.jit
def _diff_sums(a, b):
    a, b = a.astype(jnp.float32), b.astype(jnp.float32)
    d = a - b
    return jnp.max(jnp.abs(d)), jnp.max(jnp.abs(b)), jnp.sum(d * d), jnp.sum(b * b)


def compare(host_outputs, reference) -> tuple[dict, dict]:
    """max |x - ref| / max |ref| and ||x - ref|| / ||ref|| per output; x on the host (NumPy), ref on a device."""
    max_rel, rms_rel = {}, {}
    for name, x, ref in zip(OUTPUTS, host_outputs, reference):
        x = jax.device_put(x, next(iter(ref.devices())))
        dmax, rmax, d2, r2 = (float(v) for v in _diff_sums(x, ref))
        del x
        max_rel[name] = dmax / max(rmax, 1e-30)
        rms_rel[name] = (d2 / max(r2, 1e-30)) ** 0.5
    return max_rel, rms_rel


def cp_job(T, *, P, compare_single=True, reference_unit: float | None = None, **kw) -> list[dict]:
    """Context parallel at T on P devices; then (compare_single) one device at T, one call, and the errors.

    The context-parallel outputs go to the host before the one-device run, so its memory is its own.
    `reference_unit` (bytes per token x head of the one-device program, from other sizes) skips compiling the
    one-device program when it cannot fit."""
    rec, outs = run_case("cp", T, P=P, keep_outputs=compare_single, **kw)
    records = [rec]
    if outs is None:
        return records
    host = jax.device_get(outs)
    del outs
    gc.collect()
    free = available_bytes(jax.devices()[:1], kw.get("memory_limit_gib"))
    estimate = reference_unit * T * kw["H"] if reference_unit else None
    if estimate and kw.get("check_memory", True) and free is not None and estimate > free:
        ref_rec, ref = predicted_oom("single", T, estimate, free, "the one-device series", **kw), None
    else:
        ref_rec, ref = run_case("single", T, keep_outputs=True, **{**kw, "iters": 0})
    ref_rec["role"] = f"reference for context_parallel T={T} (one untimed call after it, same process)"
    records.append(ref_rec)
    if ref is None:
        rec["compare_status"] = f"one device at T={T}: {ref_rec['status']}"
        return records
    try:
        rec["max_rel_err"], rec["rel_rms_err"] = compare(host, ref)
        rec["compared_with"] = ref_rec["impl"]
        rec["compare_status"] = "ok"
    except Exception as err:  # noqa: BLE001
        rec["compare_status"] = f"failed: {type(err).__name__}: {str(err)[:1000]}"
    return records


def single_series(Ts, **kw) -> list[dict]:
    """One device at each T (ascending); after a size that does not fit, the larger ones are skipped."""
    records, too_big = [], None
    for T in sorted(Ts):
        if too_big is not None:
            records.append(skipped("single", T, f"T={too_big} did not fit on one device", **kw))
            continue
        unit = bytes_per_token_head(records, f"single_device_{kw.get('backend', 'chunk')}", 1)
        free = available_bytes(jax.devices()[:1], kw.get("memory_limit_gib"))
        if unit and kw.get("check_memory", True) and not kw.get("compile_only") and free is not None \
                and unit * T * kw["H"] > free:
            rec = predicted_oom("single", T, unit * T * kw["H"], free, "the smaller sizes", **kw)
        else:
            rec, _ = run_case("single", T, **kw)
        records.append(rec)
        if rec["status"] in ("oom", "oom-predicted"):
            too_big = T
    return records


def skipped(kind, T, why, *, P=1, backend="chunk", H=None, K=None, V=None, dtype=None, chunk=None, **_) -> dict:
    return dict(op="kda", impl="context_parallel" if kind == "cp" else f"single_device_{backend}", mode="fwdbwd",
                status="skipped", error=why, devices=P if kind == "cp" else 1, B=1, T=T, H=H, K=K, V=V, chunk=chunk,
                dtype=str(jnp.dtype(dtype)) if dtype else None)


def job_kw(job: dict, common: dict) -> dict:
    """The keyword arguments of a job: the common ones, with the job's own H where it has one."""
    return {**common, **({"H": job["H"]} if job.get("H") else {})}


def run_job(job: dict, common: dict) -> list[dict]:
    if job["kind"] == "cp":
        return cp_job(job["T"], P=job["P"], compare_single=job.get("compare", True),
                      reference_unit=job.get("reference_unit"), **job_kw(job, common))
    return single_series(job["Ts"], **job_kw(job, common))


def expected_records(job, common) -> list[tuple[str, int]]:
    return [("cp", job["T"])] if job["kind"] == "cp" else [("single", T) for T in sorted(job["Ts"])]


def run_isolated(job: dict, common: dict, a, timeout: float) -> list[dict]:
    """`run_job` in a child process (this script with --child); a crash or timeout becomes a record."""
    with tempfile.TemporaryDirectory() as d:
        spec, out = Path(d) / "job.json", Path(d) / "records.jsonl"
        spec.write_text(json.dumps({"job": job, "common": common}))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--platform", a.platform, "--mode", "series",
               "--cp-devices", str(a.cp_devices), "--child", str(spec), "--child-out", str(out)]
        status, tail = None, ""
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True,
                                  timeout=max(timeout, 1.0) if timeout < 1e6 else None)
            tail = (proc.stdout[-2000:] + proc.stderr[-4000:]).strip()
            if proc.returncode:
                status = "crashed"
                tail = f"exit code {proc.returncode}: {tail}"
        except subprocess.TimeoutExpired as err:
            status = "timeout"
            text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
            tail = f"killed after {timeout:.0f} s: {text(err.stdout)[-1000:]}{text(err.stderr)[-2000:]}"
        records = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    if status:
        done = {(("cp" if r["impl"] == "context_parallel" else "single"), r["T"]) for r in records
                if r.get("role") is None}
        missing = [(k, T) for k, T in expected_records(job, common) if (k, T) not in done]
        for i, (k, T) in enumerate(missing):
            r = skipped(k, T, tail[-3000:], P=job.get("P", 1), **job_kw(job, common))
            r["status"] = status if i == 0 else "skipped"
            if i:
                r["error"] = f"the process died at T={missing[0][1]}"
            records.append(r)
    return records


def child_main(spec_path: str, out_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    records = run_job(spec["job"], spec["common"])
    with open(out_path, "a") as f:
        for r in records:
            f.write(json.dumps(r, default=str) + "\n")
    return 0


def plan_fallbacks(cp_records, single_records) -> list[int]:
    """For each context-parallel T without a comparison (one device did not fit, or it failed): the largest
    one-device T below it that fitted, once, unless already compared there."""
    fits = sorted(r["T"] for r in single_records if r["status"] == "ok")
    compared = {r["T"] for r in cp_records if r.get("compare_status") == "ok"}
    out = []
    for T in sorted({r["T"] for r in cp_records if r["T"] not in compared}):
        smaller = [t for t in fits if t < T]
        if smaller and smaller[-1] not in compared and smaller[-1] not in out:
            out.append(smaller[-1])
    return out


def run_series(a, common: dict, *, isolate: bool, budget_s: float, on_record=None) -> list[dict]:
    """The jobs of the series mode (module doc) within budget_s seconds; returns every record."""
    deadline = time.perf_counter() + budget_s
    records: list[dict] = []

    def execute(job):
        left = deadline - time.perf_counter()
        if left < 5:
            new = [skipped(k, T, f"out of the time budget ({budget_s:.0f} s)", P=job.get("P", 1),
                           **job_kw(job, common))
                   for k, T in expected_records(job, common)]
        elif isolate:
            new = run_isolated(job, common, a, min(left, a.job_timeout))
        else:
            new = run_job(job, common)
        for r in new:
            r.setdefault("versions", versions())
            print(summary_line(r), flush=True)
        records.extend(new)
        if on_record:
            on_record(records)
        return new

    single = execute({"kind": "single", "Ts": a.single_T}) if a.single_T else []
    single_unit = bytes_per_token_head(records, f"single_device_{a.backend}", 1)
    cp = []
    for T in a.cp_T:
        job = {"kind": "cp", "T": T, "P": a.cp_devices, "reference_unit": single_unit}
        cp += [r for r in execute(job) if r["impl"] == "context_parallel"]
    for T in plan_fallbacks(cp, single):
        execute({"kind": "cp", "T": T, "P": a.cp_devices})
    for T in [r["T"] for r in cp if r["status"] in ("oom", "oom-predicted")]:
        for H in [h for h in a.fallback_H if h < a.H]:  # until one runs and equals one device
            cp_unit = bytes_per_token_head(records, "context_parallel", a.cp_devices)
            free = max((r["free_bytes_before"] for r in records if r.get("free_bytes_before")), default=None)
            if cp_unit and free and a.check_memory and cp_unit * T * H > free:
                rec = predicted_oom("cp", T, cp_unit * T * H, free, "the context-parallel sizes compiled",
                                    **{**common, "H": H, "P": a.cp_devices})
                rec["versions"] = versions()
                print(summary_line(rec), flush=True)
                records.append(rec)
                continue
            new = execute({"kind": "cp", "T": T, "P": a.cp_devices, "H": H, "reference_unit": single_unit})
            if any(r["impl"] == "context_parallel" and r.get("compare_status") == "ok" for r in new):
                break
    if on_record:
        on_record(records)
    return records


def fmt_bytes(b) -> str:
    return f"{b / GIB:.2f} GiB" if b >= GIB / 4 else f"{b / 2**20:.1f} MiB"


def summary_line(r) -> str:
    mib = lambda b: fmt_bytes(b) if isinstance(b, (int, float)) else "-"
    hw = [m.get("peak_bytes_in_use") if m else None for m in (r.get("device_memory") or [])]
    hw = " / ".join(fmt_bytes(b) for b in hw if b is not None) or "-"
    ms = f"{r['ms']:10.1f} ms" if isinstance(r.get("ms"), (int, float)) else "        - ms"
    err = ""
    if r.get("max_rel_err"):
        err = "  max_rel_err " + " ".join(f"{k} {v:.1e}" for k, v in r["max_rel_err"].items())
    elif r.get("compare_status"):
        err = f"  compare: {r['compare_status']}"
    role = "  (reference)" if r.get("role") else ""
    line = (f"  {r['impl']:22s} P={r['devices']} T={r['T']:8d} H={r['H']:<3d} {r['status']:13s} {ms}  "
            f"XLA {mib(r.get('peak_bytes_per_device')):>10s} / device  high-water {hw}{err}{role}")
    if r["status"] != "ok" and r.get("error"):
        line += f"\n      {r['error'][:300]}"
    return line


def print_table(records):
    print("\n| impl | P | T | H | status | ms | XLA peak GiB / device | high-water GiB per device | max rel err "
          "(o, dq, dk, dv, dg, dbeta) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in records:
        if r.get("role"):
            continue
        ms = f"{r['ms']:.1f}" if isinstance(r.get("ms"), (int, float)) else "-"
        pk = r.get("peak_bytes_per_device")
        pk = f"{pk / GIB:.2f}" if pk else "-"
        hw = [m.get("peak_bytes_in_use") if m else None for m in (r.get("device_memory") or [])]
        hw = " / ".join(f"{b / GIB:.2f}" for b in hw if b is not None) or "-"
        err = ", ".join(f"{r['max_rel_err'][k]:.1e}" for k in OUTPUTS) if r.get("max_rel_err") else \
            (r.get("compare_status") or "")
        print(f"| {r['impl']} | {r['devices']} | {r['T']} | {r['H']} | {r['status']} | {ms} | {pk} | {hw} | {err} |")


def main_series(a) -> int:
    gpu = a.platform == "gpu"
    defaults = dict(H=16 if gpu else 2, K=128 if gpu else 32, V=128 if gpu else 32,
                    dtype="bfloat16" if gpu else "float32", iters=5 if gpu else 3,
                    single_T=[65536, 131072, 262144, 524288] if gpu else [1024, 2048],
                    cp_T=[524288] if gpu else [2048])
    for k, v in defaults.items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    isolate = gpu if a.isolate is None else a.isolate
    cache = None
    if isolate and a.compile_cache:
        cache = tempfile.mkdtemp(prefix="jax-cache-")
        os.environ["JAX_COMPILATION_CACHE_DIR"] = cache  # read by the children's jax
    # With --isolate the jobs' processes own the devices: this one does not start a backend (it would hold memory).
    where = "devices in the jobs' processes" if isolate else \
        f"{len(jax.devices())} {jax.devices()[0].platform} device(s) ({jax.devices()[0].device_kind})"
    common = dict(H=a.H, K=a.K, V=a.V, dtype=a.dtype, chunk=a.chunk, backend=a.backend, iters=a.iters, seed=a.seed,
                  g_low=a.g_low, check_memory=a.check_memory, memory_limit_gib=a.memory_limit_gib,
                  compile_only=a.compile_only)
    print(f"KDA fwd+bwd B=1 H={a.H} K={a.K} V={a.V} chunk={a.chunk} {a.dtype}; {where}; "
          f"context parallel on {a.cp_devices} at T={a.cp_T}; one device "
          f"({a.backend}) at T={a.single_T}; {'each job in its own process' if isolate else 'in this process'}; "
          f"budget {a.budget_s:.0f} s, {a.job_timeout:.0f} s per job", flush=True)
    name = a.name or f"{a.platform}-context-parallel-series"
    write = (lambda recs: write_results(a.out, name, recs)) if a.out else None
    records = run_series(a, common, isolate=isolate, budget_s=a.budget_s, on_record=write)
    print_table(records)
    if cache:
        import shutil
        shutil.rmtree(cache, ignore_errors=True)
    return 0


# ---------------------------------------------------------------------------------------------------------------
# scaling mode (simulated CPU devices)
# ---------------------------------------------------------------------------------------------------------------

def main_scaling(a) -> int:
    H, K, V = a.H or 4, a.K or 64, a.V or 64
    cores = os.cpu_count()
    print(f"KDA B=1 H={H} K=V={K}/{V} chunk={a.chunk} fp32, fwd+bwd; {len(jax.devices())} simulated CPU devices "
          f"on {cores} cores; T = P x {a.T_per_device}")

    records = []
    for P in a.devices:
        T = P * a.T_per_device
        (q, k, v, g, beta), do = make_inputs(T, H, K, V)
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
            step = jax.jit(forward_backward(f, do))
            start = time.perf_counter()
            compiled = step.lower(q, k, v, g, beta).compile()
            compile_s = time.perf_counter() - start
            ms, cpu_ms = time_it(compiled, (q, k, v, g, beta), a.iters or 5)
            rec = dict(op="kda", impl=name, mode="fwdbwd", devices=devices, B=1, T=T, T_per_device=T // devices,
                       H=H, K=K, V=V, chunk=a.chunk, dtype="float32", ms=ms, cpu_ms_per_device=cpu_ms / devices,
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
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--platform", choices=("cpu", "gpu"), default="cpu",
                   help="cpu: simulated host devices; gpu: the real GPUs (nothing forced)")
    p.add_argument("--mode", choices=("scaling", "series"), help="default: scaling on cpu, series on gpu")
    p.add_argument("--H", type=int, help="heads (default: scaling 4; series 16 on gpu, 2 on cpu)")
    p.add_argument("--K", type=int, help="key dim (default: scaling 64; series 128 on gpu, 32 on cpu)")
    p.add_argument("--V", type=int, help="value dim (default: as K)")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--iters", type=int, help="timed calls after one warm-up (default: 5; series on cpu: 3)")
    p.add_argument("--out", type=Path, help="folder for the results JSON")
    g = p.add_argument_group("scaling mode")
    g.add_argument("--devices", type=int, nargs="+", default=DEFAULT_DEVICES)
    g.add_argument("--T-per-device", type=int, default=1024)
    g = p.add_argument_group("series mode")
    g.add_argument("--dtype", choices=("bfloat16", "float32"), help="q, k, v, beta, do (g is fp32); default: "
                   "bfloat16 on gpu, float32 on cpu")
    g.add_argument("--single-T", type=int, nargs="*", help="one-device T series (default on gpu: 65536 131072 "
                   "262144 524288)")
    g.add_argument("--cp-T", type=int, nargs="+", help="context-parallel T (default on gpu: 524288)")
    g.add_argument("--cp-devices", type=int, default=2)
    g.add_argument("--fallback-H", type=int, nargs="*", default=[8, 4],
                   help="where context parallel does not fit at a --cp-T: try these head counts (fewer) in turn")
    g.add_argument("--backend", default="chunk", help="the one-device backend (ops.linear_attention)")
    g.add_argument("--g-low", type=float, default=-0.1, help="log gate g ~ U(g_low, 0)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="each job in its own process (default: on for gpu)")
    g.add_argument("--compile-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="with --isolate, a JAX compilation cache shared by the jobs")
    g.add_argument("--check-memory", action=argparse.BooleanOptionalAction, default=True,
                   help="skip a job whose compiled memory exceeds the free device memory")
    g.add_argument("--memory-limit-gib", type=float,
                   help="treat each device as having at most this much free memory (default: its own)")
    g.add_argument("--compile-only", action="store_true",
                   help="compile and record XLA's memory analysis only (status 'compiled'): e.g. the full-size "
                        "programs on simulated CPU devices, an estimate before a GPU run")
    g.add_argument("--budget-s", type=float, default=float("inf"), help="stop starting jobs after this many seconds")
    g.add_argument("--job-timeout", type=float, default=float("inf"), help="seconds per isolated job")
    g.add_argument("--name", help="results file <date>-<name>.json (default <platform>-context-parallel-series)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--child-out", help=argparse.SUPPRESS)
    return p


def main(argv=None) -> int:
    a = parser().parse_args(argv)
    if a.child:
        return child_main(a.child, a.child_out)
    if a.V is None:
        a.V = a.K
    mode = a.mode or ("series" if a.platform == "gpu" else "scaling")
    return main_series(a) if mode == "series" else main_scaling(a)


if __name__ == "__main__":
    sys.exit(main())
