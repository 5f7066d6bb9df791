"""Per-kernel device time of one KDA forward and one forward+backward, from a JAX profiler trace.

    python benchmarks/profile_pallas_kda.py --out $OUT [--impls lineattn,jla,noop] [--shape 8x4096] [--rule gdn]
        [--configs "default;chunk_bwd.PASS_PREC=bf16+chunk_bwd.WY_PREC=tf32"] [--check] [--sync]

lineattn runs through `ops.linear_attention(..., backend="pallas")`, as the bench times it (`lineattn_fwd`).
Each implementation is compiled and run once, then traced for --iters calls; the trace's GPU planes are read back
with `jax.profiler.ProfileData` and every kernel's time is summed over the traced calls and divided by --iters,
so each row is one kernel's device time per call. --configs profiles lineattn once per configuration, each
setting module constants of `lineattn.ops.pallas` (`module.NAME=value`, joined by '+'); --check first compares
each configuration's o and five gradients with the XLA chunk form in fp32 on the same inputs (relative RMS).
--sync ends each traced call by block_until_ready, as the bench times them: the stream's idle time then shows
the gaps inside a call and, before its first kernel, the latency between calls; the impl "noop" (q * 2) gives that
latency alone. --rule gdn profiles Gated DeltaNet instead (the same inputs with a head gate, g[..., 0]; jla's
gated_deltanet).
Kernels named by lineattn (`name=` of its `pallas_call`s: `lineattn_chunk_gram`, ...) and XLA fusions (pads,
transposes, sums) appear under their own names. Writes <out>/<date>-<device>-<rule>-profile.json (<device> by
`bench_kda.device_tag`: h200, h100, ...; before session 49 always h200): {impl: {mode: {"per_call_ms": {kernel:
ms}, "total_ms": ..., "wall_ms": ..., "idle_before_ms": {kernel: ms the stream stood idle just before it, per
call}, "idle_ms": ..., and with --host "host_ms": {"thread: event": ms per call, the 40 longest host events},
"timeline": [the last call's events from its start, host and device: (ms after, ms long, name)]}}}.
--ncu runs each implementation's forward and forward+backward once (each of --configs for lineattn; and with --decode
B one decode step of B requests: lineattn's kernel with each --readouts and FLA's `fused_recurrent_kda`), with no
trace and no JSON, for Nsight Compute to read the kernels' counters: `NCU=1 bash benchmarks/h200_issue2.sh` wraps it
in `ncu`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).parent))
from bench_kda import (call_timeline, device_tag, forward_backward, host_times, kernel_gaps,  # noqa: E402
                       kernel_times, make_inputs, versions)

import numpy as np  # noqa: E402

from lineattn import ops  # noqa: E402
from lineattn.ops import chunk as xla_chunk  # noqa: E402
from lineattn.ops.pallas import tuning  # noqa: E402

f32 = jnp.float32


def profile(fn, args, iters: int, sync: bool = False, trace_dir: Path | None = None,
            host_detail: bool = False) -> dict:
    """Kernel times of `iters` calls in a trace; with sync each call is ended by block_until_ready (the bench's
    timing), so the stream's idle time shows the gaps a call's own launches leave and, between calls, each call's
    dispatch and sync latency; wall_ms is then the median call (else the mean of calls launched back to back).
    trace_dir: keep the trace there (host and device planes) instead of in a temporary folder. host_detail: trace
    the host's events in detail (level 3) and no Python calls (whose tracing would slow the calls timed), and
    return the longest host events per call (`host_times`) and the last call's timeline (`call_timeline`)."""
    jax.block_until_ready(fn(*args))  # compile and warm up outside the trace
    with tempfile.TemporaryDirectory() as tmp:
        tmp = str(trace_dir) if trace_dir else tmp
        options = jax.profiler.ProfileOptions()
        if host_detail:
            options.python_tracer_level, options.host_tracer_level = 0, 3
        with jax.profiler.trace(tmp, profiler_options=options):
            t0, calls = time.perf_counter(), []
            for _ in range(iters):
                out = fn(*args)
                if sync:
                    jax.block_until_ready(out)
                    calls.append(time.perf_counter() - t0)
                    t0 = time.perf_counter()
            jax.block_until_ready(out)
            wall = (time.perf_counter() - t0) * 1e3 / iters if not sync else float(np.median(calls)) * 1e3
        totals = kernel_times(tmp)
        gaps = kernel_gaps(tmp)
        host = host_times(tmp) if host_detail else {}
        timeline = call_timeline(tmp) if host_detail else []
    per_call = {name: ns / iters / 1e6 for name, ns in sorted(totals.items(), key=lambda kv: -kv[1])}
    idle = {name: ns / iters / 1e6 for name, ns in sorted(gaps.items(), key=lambda kv: -kv[1])}
    host_ms = {name: ns / iters / 1e6 for name, ns in sorted(host.items(), key=lambda kv: -kv[1])[:40]}
    return {"per_call_ms": per_call, "total_ms": sum(per_call.values()), "wall_ms": wall, "idle_before_ms": idle,
            "idle_ms": sum(idle.values()), "host_ms": host_ms, "timeline": timeline[:200]}


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b**2)), 1e-30))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--shape", default="8x4096")
    p.add_argument("--impls", default="lineattn,jla")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--top", type=int, default=25, help="rows printed per profile")
    p.add_argument("--configs", default="default", help="';'-separated lineattn configurations (see above)")
    p.add_argument("--check", action="store_true", help="compare with the XLA chunk form in fp32 first")
    p.add_argument("--sync", action="store_true", help="end each traced call by block_until_ready (see profile)")
    p.add_argument("--host", action="store_true",
                   help="print each call's host events (ms per call, by thread) and the last call's timeline")
    p.add_argument("--timeline", type=int, default=80, help="with --host: the timeline's rows printed")
    p.add_argument("--keep-traces", action="store_true", help="keep each trace under <out>/traces/<impl>-<mode>")
    p.add_argument("--rule", default="kda", choices=["kda", "gdn"])
    p.add_argument("--ncu", action="store_true", help="run each mode once, for Nsight Compute (see above)")
    p.add_argument("--decode", type=int, default=0, help="with --ncu: also one decode step of this batch")
    p.add_argument("--modes", default="fwd,fwdbwd", help="with --ncu: the modes run")
    p.add_argument("--readouts", default="decayed,updated", help="with --decode: the decode kernel's read-outs")
    p.add_argument("--decode-tiles", default="default",
                   help="with --decode: the decode kernel's V tile x warps, e.g. 64x4,32x4 ('default': its own)")
    a = p.parse_args()
    if a.ncu:
        return run_once_for_ncu(a)
    B, T = map(int, a.shape.split("x"))
    H, K = 16, 128
    x, _ = make_inputs(B, T, H, K, K, "bfloat16")
    bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
    q, k, v, beta, do = bf("q"), bf("k"), bf("v"), bf("beta"), bf("do")
    g = jnp.asarray(x["g"] if a.rule == "kda" else x["g"][..., 0])
    h0 = jnp.zeros((B, H, K, K), f32)
    scale = K**-0.5
    impls = {}
    if "lineattn" in a.impls:
        for config in a.configs.split(";"):
            impls["lineattn-pallas" + ("" if config == "default" else f" [{config}]")] = (lineattn_fwd(a.rule, h0),
                                                                                         config)
    if "noop" in a.impls:  # a call of next to no device time: the latency of a call ended by block_until_ready
        impls["noop"] = (lambda q, k, v, g, b: q * 2, "default")
    if "jla" in a.impls:
        import jla.ops as jla_ops

        kind = "kda" if a.rule == "kda" else "gated_deltanet"
        impls["jla"] = (lambda q, k, v, g, b: jla_ops.linear_attention(kind, q, k, v, g=g, beta=b,
                                                                        impl="mosaic_gpu")[0], "default")
    device = jax.devices()[0].device_kind
    print(f"{device}; {versions()}; {a.rule} B={B} T={T} H={H} K=V={K}", flush=True)
    result = {"device": device, "versions": versions(), "rule": a.rule, "B": B, "T": T, "H": H, "K": K, "V": K}
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"{datetime.date.today()}-{device_tag(device)}-{a.rule}-profile.json"
    ref = None
    if a.check:
        def xla_loss(*xs):
            o, _ = xla_chunk.chunk(*xs, scale=scale, initial_state=h0, chunk_size=64)
            return jnp.sum(o * do.astype(f32)), o

        (_, o_ref), grads_ref = jax.jit(jax.value_and_grad(xla_loss, argnums=tuple(range(5)), has_aux=True))(
            *[y.astype(f32) for y in (q, k, v, g, beta)])
        ref = [np.asarray(o_ref)] + [np.asarray(x) for x in grads_ref]
    for name, (fwd, config) in impls.items():
        try:
            with tuning.override(tuning.parse(config)):
                modes = {"fwd": jax.jit(fwd), "fwdbwd": jax.jit(forward_backward(fwd, do))}
                if ref is not None:
                    got = [modes["fwd"](q, k, v, g, beta)] + list(modes["fwdbwd"](q, k, v, g, beta)[1])
                    errors = {n: rel_rms(np.asarray(x, np.float32), r)
                              for n, x, r in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), got, ref)}
                    result.setdefault(name, {})["rel_rms"] = errors
                    print(f"{name}: rel RMS vs the XLA chunk form in fp32: "
                          + " ".join(f"{n} {e:.1e}" for n, e in errors.items()))
                for mode, fn in modes.items():
                    keep = a.out / "traces" / f"{name.split()[0]}-{mode}" if a.keep_traces else None
                    rec = profile(fn, (q, k, v, g, beta), a.iters, a.sync, keep, a.host)
                    result.setdefault(name, {})[mode] = rec
                    print(f"{name} {mode}: kernels {rec['total_ms']:.3f} ms per call "
                          f"(wall {rec['wall_ms']:.3f} ms, stream idle {rec['idle_ms']:.3f} ms)")
                    for kname, ms in list(rec["per_call_ms"].items())[:a.top]:
                        print(f"   {ms:8.3f}  {kname[:110]}")
                    idle = list(rec["idle_before_ms"].items())[:6]
                    print("   stream idle before: " + ", ".join(f"{kname[:40]} {ms:.3f}" for kname, ms in idle))
                    if a.host:
                        for hname, ms in list(rec["host_ms"].items())[:a.top]:
                            print(f"   host {ms:8.3f}  {hname[:120]}")
                        print("   the last call's timeline (ms from its PjitFunction's start, ms long, event):")
                        for t, d, ename in rec["timeline"][:a.timeline]:
                            print(f"   {t:8.3f} {d:8.3f}  {ename[:110]}")
                    path.write_text(json.dumps(result, indent=1))
        except Exception as err:  # e.g. a launch setting beyond the shared memory: recorded, then the next one
            result.setdefault(name, {})["error"] = str(err)[:300]
            print(f"{name}: failed: {str(err)[:300]}")
            path.write_text(json.dumps(result, indent=1))


def lineattn_fwd(rule, h0):
    """(q, k, v, g, beta) -> o through `ops.linear_attention(..., backend="pallas")`, the path the bench times (before
    session 45 the profiles called `chunk_pallas` directly and missed what the API ran around it: the gate floor's
    XLA pass of sessions 42-44)."""
    return lambda q, k, v, g, b: ops.linear_attention(rule, q, k, v, g, b, initial_state=h0, backend="pallas")[0]


def run_once_for_ncu(a):
    """Each implementation's modes once (compiled first: XLA launches nothing while compiling a Pallas kernel)."""
    B, T = map(int, a.shape.split("x"))
    H, K = 16, 128
    x, _ = make_inputs(B, T, H, K, K, "bfloat16")
    bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
    args = (bf("q"), bf("k"), bf("v"), jnp.asarray(x["g"] if a.rule == "kda" else x["g"][..., 0]), bf("beta"))
    h0 = jnp.zeros((B, H, K, K), f32)
    fns = {}
    if "lineattn" in a.impls:
        for config in a.configs.split(";"):
            fns[f"lineattn [{config}]"] = (lineattn_fwd(a.rule, h0), config)
    if "jla" in a.impls:
        import jla.ops as jla_ops

        kind = "kda" if a.rule == "kda" else "gated_deltanet"
        fns["jla"] = (lambda q, k, v, g, b: jla_ops.linear_attention(kind, q, k, v, g=g, beta=b,
                                                                     impl="mosaic_gpu")[0], "default")
    for name, (fwd, config) in fns.items():
        with tuning.override(tuning.parse(config)):
            for mode in a.modes.split(","):
                fn = jax.jit(fwd if mode == "fwd" else forward_backward(fwd, bf("do")))
                compiled = fn.lower(*args).compile()
                print(f"ncu: {name} {mode}", flush=True)
                jax.block_until_ready(compiled(*args))
    if a.decode:
        from lineattn.ops.pallas.decode import decode_step

        x, _ = make_inputs(a.decode, 1, H, K, K, "bfloat16", seed=3)
        step_args = [jnp.asarray(x[n], jnp.bfloat16) for n in ("q", "k", "v")] + [jnp.asarray(x["g"]),
                                                                              jnp.asarray(x["beta"], jnp.bfloat16)]
        state = jnp.zeros((a.decode, H, K, K), f32)
        tiles = [{}] if a.decode_tiles == "default" else [
            dict(block_v=int(bv), num_warps=int(w)) for bv, w in (t.split("x") for t in a.decode_tiles.split(","))]
        for readout in a.readouts.split(","):
            for tile in tiles:
                step = jax.jit(lambda *xs, r=readout, t=tile: decode_step(*xs, readout=r, **t))
                compiled = step.lower(*step_args, state).compile()
                print(f"ncu: decode readout={readout} {tile or 'default tile'}", flush=True)
                jax.block_until_ready(compiled(*step_args, state))
        try:
            import torch
            from fla.ops.kda import fused_recurrent_kda
        except ImportError as err:
            print(f"FLA decode unavailable: {err}")
            return
        tt = lambda n, dt: torch.tensor(np.asarray(x[n], np.float32), device="cuda", dtype=dt)
        print("ncu: fla fused_recurrent_kda", flush=True)
        fused_recurrent_kda(tt("q", torch.bfloat16), tt("k", torch.bfloat16), tt("v", torch.bfloat16),
                            tt("g", torch.float32), tt("beta", torch.bfloat16),
                            initial_state=torch.zeros((a.decode, H, K, K), device="cuda"), output_final_state=True)
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
