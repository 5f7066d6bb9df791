"""Times KDA forward and forward+backward for every lineattn backend beside the peers, on the same inputs.

    python benchmarks/bench_kda.py --device cpu --T 2048 --H 4 --K 64 --V 64 --out benchmarks/results
    python benchmarks/bench_kda.py --device gpu --B 8 --T 4096 --H 16 --K 128 --V 128 --dtype bfloat16 --out $OUT

Inputs (../shared/BENCHMARKING.md): q, k L2-normalised and v in --dtype; log gate g in (-5, 0) fp32; beta in (0, 1).
Before timing, every implementation's output is compared with lineattn's chunk output (max relative error).
JAX: jit, one warm-up, median of --iters calls ended by block_until_ready. FLA (GPU only): triton do_bench median.
Writes <out>/<date>-<device>-kda-B<B>-T<T>.json (<device> by `device_tag`: cpu, h200, h100, ...): a list of {"op",
"impl", "mode", "B", "T", "H", "K", "V", "ms", "device", "versions", "max_rel_err"} records.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import glob
import importlib.metadata
import json
import re
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from lineattn import ops


def make_inputs(B, T, H, K, V, dtype, seed=0):
    rng = np.random.default_rng(seed)
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    return dict(
        q=unit(rng.standard_normal((B, T, H, K))).astype(np.float32),
        k=unit(rng.standard_normal((B, T, H, K))).astype(np.float32),
        v=rng.standard_normal((B, T, H, V)).astype(np.float32),
        g=rng.uniform(-5.0, 0.0, (B, T, H, K)).astype(np.float32),
        beta=rng.uniform(0.0, 1.0, (B, T, H)).astype(np.float32),
        do=rng.standard_normal((B, T, H, V)).astype(np.float32),
    ), dtype


def jax_impls(device):
    """name -> f(q, k, v, g, beta) -> o, for lineattn's backends and jax-linear-attention's ops."""
    impls = {
        f"lineattn-{b}": (lambda b: lambda q, k, v, g, beta: ops.chunk_kda(q, k, v, g, beta, backend=b)[0])(b)
        for b in ("chunk", "scan", "recurrent")
    }
    try:
        import jla.ops as jla_ops
    except ImportError:
        print("jax-linear-attention not installed: its rows are skipped (pip install -e '.[bench]')")
        return impls
    for impl in ("chunked",) + (("mosaic_gpu",) if device == "gpu" else ()):
        impls[f"jla-{impl}"] = (lambda impl: lambda q, k, v, g, beta: jla_ops.linear_attention(
            "kda", q, k, v, g=g, beta=beta, impl=impl)[0])(impl)
    return impls


def forward_backward(f, do):
    """(q, k, v, g, beta) -> (o, the five gradients of sum(o * do)): the attention part of a training step. o is
    returned because a model uses it: from the gradients of a loss linear in o alone, XLA would drop whatever only
    computes o (lineattn's forward state pass; a peer whose backward reads its forward's outputs keeps it)."""
    def step(*xs):
        o, vjp = jax.vjp(f, *xs)
        return o, vjp(do.astype(o.dtype))
    return step


def call_times(fn, args, iters):
    """Seconds of each of `iters` calls of fn(*args), each ended by `block_until_ready`, after one warm-up call."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return times


def time_jax(fn, args, iters):
    """Milliseconds: the median of `call_times`."""
    return 1e3 * float(np.median(call_times(fn, args, iters)))


def time_interleaved(fns, args, iters, rounds, on_error=None):
    """{key: (median ms over all calls, [each round's median ms])} for the functions fns {key: fn}, timed in turn:
    `rounds` rounds, each giving every function iters / rounds calls (`call_times`, a warm-up call first), so that a
    machine whose speed drifts during the run (a host's load, clocks) slows all of them alike, not the ones timed
    last. With on_error, a function that raises is dropped from the later rounds and from the result after
    on_error(key, exc); without, its exception propagates."""
    if rounds < 1 or iters % rounds:
        raise ValueError(f"rounds must be >= 1 and divide iters = {iters}, got {rounds}")
    times = {key: [] for key in fns}
    for _ in range(rounds):
        for key in list(times):
            try:
                times[key].append(call_times(fns[key], args, iters // rounds))
            except Exception as exc:  # (a peer may fail on a shape: the others are still timed)
                if on_error is None:
                    raise
                del times[key]
                on_error(key, exc)
    return {key: (1e3 * float(np.median(np.concatenate(ts))), [1e3 * float(np.median(t)) for t in ts])
            for key, ts in times.items()}


def _planes(trace_dir: str):
    """The planes (host, each device) of the traces in trace_dir."""
    from jax.profiler import ProfileData

    for path in glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True):
        yield from ProfileData.from_file(path).planes


def _stream_events(trace_dir: str):
    """The kernel events of each device stream in the trace in trace_dir, as lists of (start ns, end ns, name)
    sorted by start (stream lines only, so that the 'XLA Ops' / 'XLA Modules' summary lines are not counted
    twice)."""
    for plane in _planes(trace_dir):
        if plane.name.startswith("/device:"):
            for line in plane.lines:
                if line.name.startswith("Stream"):
                    yield sorted((e.start_ns, e.end_ns, e.name) for e in line.events)


def _host_events(trace_dir: str):
    """(start ns, duration ns, "thread: name") of every host event in the trace in trace_dir."""
    for plane in _planes(trace_dir):
        if plane.name.startswith("/host:"):
            for line in plane.lines:
                yield from ((e.start_ns, e.duration_ns, f"{line.name}: {e.name}") for e in line.events)


def host_times(trace_dir: str) -> dict[str, float]:
    """{"thread: event": total ns} of the host's events in the trace in trace_dir (nested events each count their
    whole span): where a call's host time goes (dispatch, the executable's launches, the wait)."""
    totals: dict[str, float] = collections.defaultdict(float)
    for _, duration, name in _host_events(trace_dir):
        totals[name] += duration
    return totals


def call_timeline(trace_dir: str, marker: str = "PjitFunction") -> list[tuple[float, float, str]]:
    """The last call's events, host threads and device streams alike, from the start of the last host event whose
    name starts with marker to the trace's end, as (ms after that start, ms long, "thread: name") sorted by start."""
    events = list(_host_events(trace_dir))
    events += [(start, end - start, f"stream: {name}") for stream in _stream_events(trace_dir)
               for start, end, name in stream]
    starts = [t for t, _, name in events if name.split(": ", 1)[1].startswith(marker)]
    if not starts:
        return []
    t0 = max(starts)
    return sorted(((t - t0) / 1e6, d / 1e6, name) for t, d, name in events if t >= t0)


def kernel_times(trace_dir: str) -> dict[str, float]:
    """{kernel name: total ns} over the device streams of the trace in trace_dir."""
    totals: dict[str, float] = collections.defaultdict(float)
    for events in _stream_events(trace_dir):
        for start, end, name in events:
            totals[name] += end - start
    return totals


def kernel_gaps(trace_dir: str) -> dict[str, float]:
    """{kernel name: total ns its stream was idle just before it} over the trace in trace_dir (calls of one
    function): where launch gaps sit between the kernels of a call. The gaps before the stream's first kernel
    name (each call's first kernel) are the time between calls, reported as '(between calls)'."""
    gaps: dict[str, float] = collections.defaultdict(float)
    for events in _stream_events(trace_dir):
        for (_, prev_end, _), (start, _, name) in zip(events, events[1:]):
            gaps["(between calls)" if name == events[0][2] else name] += max(start - prev_end, 0)
    return gaps


def rel_err(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def fla_rows(x, dtype, reference_o):
    """FLA's chunk_kda through torch (GPU only): (name, mode, ms, max_rel_err) rows."""
    try:
        import torch
        import triton
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError as err:
        print(f"FLA not available ({err}): its rows are skipped")
        return []
    tdt = {"bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
    t = lambda a, dt: torch.tensor(a, device="cuda", dtype=dt)
    q, k, v = (t(x[n], tdt).requires_grad_() for n in "qkv")
    g = t(x["g"], torch.float32).requires_grad_()
    beta = t(x["beta"], tdt).requires_grad_()
    do = t(x["do"], tdt)
    fwd = lambda: fla_chunk_kda(q, k, v, g, beta)[0]
    o = fwd()
    err = rel_err(o.float().detach().cpu().numpy(), reference_o)

    def fwdbwd():
        for p in (q, k, v, g, beta):
            p.grad = None
        fla_chunk_kda(q, k, v, g, beta)[0].backward(do)

    rows = []
    for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
        ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        rows.append(("fla", mode, float(ms), err))
    return rows


def write_results(out: Path, name: str, records) -> Path:
    """Writes `records` as <out>/<today>-<name>.json and says where."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{datetime.date.today().isoformat()}-{name}.json"
    path.write_text(json.dumps(records, indent=1, default=str))
    print(f"wrote {path}")
    return path


def device_tag(kind: str | None = None) -> str:
    """The device's model for result file names ("h200" for "NVIDIA H200", "h100" for "NVIDIA H100 80GB HBM3",
    "cpu"), from `kind` or the first JAX device's `device_kind`: a GPU run names the card it really ran on."""
    kind = (jax.devices()[0].device_kind if kind is None else kind).lower().replace("nvidia", "")
    model = re.search(r"\b[a-z]+\d+[a-z]*\b", kind)  # (a letter first: "80gb" is a memory size, not a model)
    return model.group(0) if model else re.sub(r"[^a-z0-9]+", "-", kind).strip("-") or "device"


def versions():
    out = {"jax": jax.__version__}
    for pkg in ("lineattn", "jax-linear-attention", "flash-linear-attention", "torch", "triton"):
        try:
            out[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "gpu"], default="cpu")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, default=2048)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--K", type=int, default=64)
    p.add_argument("--V", type=int, default=64)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--skip", nargs="*", default=[], help="implementation names to leave out")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--out", type=Path, help="folder for the results JSON")
    a = p.parse_args()

    x, dtype = make_inputs(a.B, a.T, a.H, a.K, a.V, a.dtype)
    jdt = jnp.dtype(dtype)
    args = [jnp.asarray(x[n], jdt) for n in "qkv"] + [jnp.asarray(x["g"]), jnp.asarray(x["beta"], jdt)]
    do = jnp.asarray(x["do"], jdt)
    device = str(jax.devices()[0].device_kind)
    print(f"KDA B={a.B} T={a.T} H={a.H} K={a.K} V={a.V} {dtype} on {device} ({jax.devices()[0].platform})")

    impls = {n: f for n, f in jax_impls(a.device).items() if n not in a.skip}
    reference_o = np.asarray(jax.jit(impls["lineattn-chunk"])(*args), np.float32)
    rows = []
    for name, f in impls.items():
        fwd = jax.jit(f)
        err = rel_err(fwd(*args).astype(jnp.float32), reference_o)
        fwdbwd = jax.jit(forward_backward(f, do))
        for mode, fn in (("fwd", fwd), ("fwdbwd", fwdbwd)):
            try:
                ms = time_jax(fn, args, a.iters)
            except Exception as exc:  # a peer that cannot run this case is reported, not fatal
                print(f"{name} {mode}: failed: {type(exc).__name__}: {str(exc)[:200]}")
                continue
            rows.append((name, mode, ms, err))
            print(f"  {name:22s} {mode:7s} {ms:9.2f} ms   max rel err vs lineattn-chunk {err:.1e}", flush=True)
    if a.device == "gpu" and not a.no_fla:
        for row in fla_rows(x, a.dtype, reference_o):
            rows.append(row)
            print(f"  {row[0]:22s} {row[1]:7s} {row[2]:9.2f} ms   max rel err vs lineattn-chunk {row[3]:.1e}")

    ms = {(n, m): t for n, m, t, _ in rows}
    print("\nspeed-up of lineattn-chunk (peer ms / our ms, same run):")
    for peer in sorted({n for n, _, _, _ in rows if not n.startswith("lineattn")}):
        for mode in ("fwd", "fwdbwd"):
            if (peer, mode) in ms and ("lineattn-chunk", mode) in ms:
                print(f"  vs {peer:14s} {mode:7s} {ms[(peer, mode)] / ms[('lineattn-chunk', mode)]:.2f}x")

    if a.out:
        tag = device_tag(device)  # (before session 49 "h200" on an H200, else --device: "gpu" on an H100)
        records = [dict(op="kda", impl=n, mode=m, B=a.B, T=a.T, H=a.H, K=a.K, V=a.V, dtype=a.dtype, ms=t,
                        max_rel_err=e, device=device, versions=versions()) for n, m, t, e in rows]
        write_results(a.out, f"{tag}-kda-B{a.B}-T{a.T}", records)


if __name__ == "__main__":
    main()
