"""lineattn's Pallas kernels beside jax-linear-attention (Mosaic GPU) and FLA (Triton), same inputs, same run.

    python benchmarks/bench_pallas_kda.py --out $OUT          # on the H200 (see benchmarks/h200_issue2.sh)

For each shape: bf16 q, k (L2-normalised), v, beta; fp32 g in (-5, 0); H = 16, K = V = 128. First every
implementation's forward output is compared with lineattn's XLA chunk form in fp32 on the same rounded inputs (max
relative error and relative RMS error); then forward and forward+backward (o and the five gradients of sum(o * do),
`bench_kda.forward_backward`; before run 12 only the gradients, which let XLA drop lineattn's forward state pass) are
timed (JAX: jit, warm-up, median of --iters calls ended by block_until_ready, the implementations in turn over
--rounds rounds of --iters / --rounds calls each, so that drift of the machine during the run slows all alike
(`bench_kda.time_interleaved`; --rounds 1, the default, times each implementation's calls at once, as every run before
run 44); FLA: triton do_bench median). Then GDN, the decode step (B = 256 requests, one token, fp32 state [B, 16, 128,
128] updated in place: TB/s of state read + write, from the wall clock of 50 steps in one jitted loop, and from the
kernel's device time in a profiler trace of that loop), and one long sequence. Writes <out>/<date>-<device>-kda.json
(`bench_kda.device_tag`: h200, h100, ...; before session 49 always h200): a list of {"op", "impl", "mode", "B", "T",
"H", "K", "V", "ms", "device", "versions", ...} records ("rounds_ms": each round's median), rewritten after every
record so a cut-short run keeps what it measured (the JAX rows of a shape are written together, once all are timed).
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

sys.path.insert(0, str(Path(__file__).parent))
from bench_kda import (device_tag, forward_backward, kernel_times, make_inputs, rel_err, time_interleaved,  # noqa: E402
                       time_jax, versions)

from lineattn import ops  # noqa: E402
from lineattn.ops.pallas.common import compiler_params, interpret_mode  # noqa: E402
from lineattn.ops.pallas.decode import decode_step  # noqa: E402
from lineattn.train.metrics import device_memory  # noqa: E402

H, K, V = 16, 128, 128
RECORDS: list[dict] = []


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / np.sqrt(np.mean(b**2)))


def record(out, **rec):
    rec = dict(rec, device=str(jax.devices()[0].device_kind), versions=versions())
    RECORDS.append(rec)
    extra = {k: v for k, v in rec.items() if k not in ("device", "versions", "op", "impl", "mode", "B", "T", "H",
                                                       "K", "V", "ms")}
    print(f"  {rec['op']:4s} {rec['impl']:24s} {rec['mode']:7s} B={rec['B']:<4d} T={rec['T']:<6d} "
          f"{rec['ms']:9.3f} ms  {extra}", flush=True)
    if out:
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{datetime.date.today().isoformat()}-{device_tag(rec['device'])}-kda.json"
        path.write_text(json.dumps(RECORDS, indent=1))


def pallas_variant(rule, backward, scalar_gate=None):
    """lineattn's pallas backend with the given backward and `api.SCALAR_GATE` (None: as set; module switches read
    at trace)."""
    from lineattn.ops.pallas import api as pallas_api

    def f(q, k, v, g, b):
        saved = pallas_api.BACKWARD, pallas_api.SCALAR_GATE
        pallas_api.BACKWARD = backward
        pallas_api.SCALAR_GATE = saved[1] if scalar_gate is None else scalar_gate
        try:
            return ops.linear_attention(rule, q, k, v, g, b, backend="pallas")[0]
        finally:
            pallas_api.BACKWARD, pallas_api.SCALAR_GATE = saved

    return f


def jax_kda_impls(op):
    gate = "channel" if op == "kda" else "head"
    rule = "kda" if op == "kda" else "gdn"
    from lineattn.ops.pallas import api as pallas_api
    impls = {  # "lineattn-pallas": the defaults (pallas.api.BACKWARD); the others by name
        "lineattn-pallas": pallas_variant(rule, pallas_api.BACKWARD),
        "lineattn-pallas-kernels-mml2": pallas_variant(rule, "kernels-mml2"),
        "lineattn-chunk": lambda q, k, v, g, b: ops.linear_attention(rule, q, k, v, g, b, backend="chunk")[0],
    }
    if gate == "head" and not pallas_api.SCALAR_GATE:  # the scalar-gate Gram kernels beside the default
        impls["lineattn-pallas-scalar"] = pallas_variant(rule, pallas_api.BACKWARD, True)
    try:
        import jla.ops as jla_ops
        kind = "kda" if gate == "channel" else "gated_deltanet"
        impls["jla-mosaic_gpu"] = lambda q, k, v, g, b: jla_ops.linear_attention(
            kind, q, k, v, g=g, beta=b, impl="mosaic_gpu")[0]
    except ImportError as err:
        print(f"jla unavailable: {err}")
    return impls


def fla_fn(op):
    try:
        if op == "kda":
            from fla.ops.kda import chunk_kda
            return chunk_kda
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
        return chunk_gated_delta_rule
    except ImportError as err:
        print(f"FLA unavailable: {err}")
        return None


def bench_shape(op, B, T, a, skip, fla_modes):
    x, _ = make_inputs(B, T, H, K, V, "bfloat16")
    if op == "gdn":
        x["g"] = np.ascontiguousarray(x["g"][..., 0])
    bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
    args = [bf("q"), bf("k"), bf("v"), jnp.asarray(x["g"]), bf("beta")]
    do = jnp.asarray(x["do"], jnp.bfloat16)
    impls = {n: f for n, f in jax_kda_impls(op).items() if n not in skip}
    ref_args = [y.astype(jnp.float32) for y in args]
    reference = np.asarray(jax.jit(jax_kda_impls(op)["lineattn-chunk"])(*ref_args), np.float32)
    timed, errs = {}, {}
    for name, f in impls.items():
        fwd = jax.jit(f)
        try:
            o = np.asarray(fwd(*args).astype(jnp.float32))
        except Exception as exc:
            print(f"{name} {op} B={B} T={T}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
            continue
        errs[name] = dict(max_rel_err=rel_err(o, reference), rel_rms_err=rel_rms(o, reference))
        modes = {"fwd": fwd}
        if not (name == "lineattn-chunk" and op == "gdn"):
            modes["fwdbwd"] = jax.jit(forward_backward(f, do))
        for mode, jitted in modes.items():
            timed[(name, mode, "jit")] = jitted
            if a.aot:  # the same program through an ahead-of-time compiled executable
                timed[(name, mode, "aot")] = jitted.lower(*args).compile()
    failed = lambda key, exc: print(f"{key[0]} {key[1]}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    for (name, mode, harness), (ms, rounds_ms) in time_interleaved(timed, args, a.iters, a.rounds, failed).items():
        record(a.out, op=op, impl=name, mode=mode, B=B, T=T, H=H, K=K, V=V, ms=ms, dtype="bfloat16",
               rounds_ms=[round(t, 3) for t in rounds_ms], **errs[name], **({"harness": harness} if a.aot else {}))
    fn = fla_fn(op) if fla_modes else None
    if fn is None:
        return
    import torch
    import triton
    t = lambda arr, dt: torch.tensor(np.asarray(arr), device="cuda", dtype=dt)
    q, k, v = (t(x[n], torch.bfloat16).requires_grad_() for n in "qkv")
    g = t(x["g"], torch.float32).requires_grad_()
    beta = t(x["beta"], torch.bfloat16).requires_grad_()
    dot = t(x["do"], torch.bfloat16)
    o = fn(q, k, v, g, beta)[0]
    errs = dict(max_rel_err=rel_err(o.float().detach().cpu().numpy(), reference),
                rel_rms_err=rel_rms(o.float().detach().cpu().numpy(), reference))

    def fwdbwd():
        for p in (q, k, v, g, beta):
            p.grad = None
        fn(q, k, v, g, beta)[0].backward(dot)

    for mode, f in (("fwd", lambda: fn(q, k, v, g, beta)), ("fwdbwd", fwdbwd)):
        if mode in fla_modes:
            ms = triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
            record(a.out, op=op, impl="fla", mode=mode, B=B, T=T, H=H, K=K, V=V, ms=float(ms), dtype="bfloat16", **errs)


def _copy_kernel(s_ref, out_ref):
    out_ref[...] = s_ref[...]


def copy_state(state, block_v, warps, state_layout="kv", v_tiles="blocks"):
    """The decode step's memory traffic alone: every [K, block_v] tile of the state [B, H, K, V] (every [block_v, K]
    tile of [B, H, V, K] with state_layout "vk"; with v_tiles "strided", V rows j, j + V / block_v, ...) read and
    written back in place, on the decode kernel's grid with the V tiles first (the bandwidth ceiling of that
    tiling)."""
    B, H = state.shape[:2]
    if state_layout == "kv" and v_tiles != "blocks":
        raise ValueError(f"copy_state: v_tiles {v_tiles!r} needs state_layout 'vk' (as decode_step does)")
    if state_layout == "kv":
        K, V = state.shape[2:]
        spec = pl.BlockSpec((None, None, K, block_v), lambda j, h, b: (b, h, 0, j))
    else:
        V, K = state.shape[2:]
        spec = (pl.BlockSpec((None, None, block_v, K), lambda j, h, b: (b, h, j, 0)) if v_tiles == "blocks" else
                pl.BlockSpec((None, None, block_v, None, K), lambda j, h, b: (b, h, 0, j, 0)))  # (decode_step's view)
    view = state.reshape(B, H, block_v, V // block_v, K) if v_tiles == "strided" else state
    copied = pl.pallas_call(_copy_kernel, grid=(V // block_v, H, B), in_specs=[spec], out_specs=spec,
                            out_shape=jax.ShapeDtypeStruct(view.shape, state.dtype), input_output_aliases={0: 0},
                            compiler_params=compiler_params(num_warps=warps, num_stages=1), name="copy_state",
                            interpret=interpret_mode(None))(view)
    return copied.reshape(state.shape)


def parse_decode_config(config: str) -> tuple[int, int, str]:
    """A --decode config, <block_v>x<warps>[letters] (e.g. "64x8fts"), as (block_v, warps, letters)."""
    m = re.fullmatch(r"(\d+)x(\d+)([fucsti]*)", config)
    if not m:
        raise ValueError(f"a --decode config is <block_v>x<warps> then letters from 'fucsti', got {config!r}")
    return int(m.group(1)), int(m.group(2)), m.group(3)


def decode_options(block_v: int, warps: int, letters: str) -> dict:
    """decode_step's launch options for a --decode config's letters (f the V tiles first, u readout "updated", s
    "stored", t state_layout "vk", i v_tiles "strided"; c, a copy in place of the step, is the caller's)."""
    return dict(block_v=block_v, num_warps=warps, v_fastest="f" in letters,
                readout="updated" if "u" in letters else "stored" if "s" in letters else "decayed",
                state_layout="vk" if "t" in letters else "kv", v_tiles="strided" if "i" in letters else "blocks")


def bench_decode(a, B=256, tokens=1):
    x, _ = make_inputs(B, tokens, H, K, V, "bfloat16", seed=3)
    bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
    q, k, v, beta = bf("q"), bf("k"), bf("v"), bf("beta")
    g = jnp.asarray(x["g"])
    rng = np.random.default_rng(4)
    s0 = rng.standard_normal((B, H, K, V)).astype(np.float32) * 0.1
    state_bytes = B * H * K * V * 4
    ref_o, ref_s = ops.chunk_kda(q, k, v, g, beta, initial_state=jnp.asarray(s0), output_final_state=True,
                                 backend="recurrent")
    steps = 50
    for block_v, warps, flags in a.decode_configs:
        opts = decode_options(block_v, warps, flags)
        # (the state stored transposed, [B, H, V, K], with "t": the same values, swapped in and out)
        layout = (lambda s: jnp.swapaxes(s, -1, -2)) if "t" in flags else (lambda s: s)
        if "c" in flags:  # the copy ceiling of this tiling: the same grid, the state read and written, no math
            step = lambda q, k, v, g, b, s, opts=opts: (None, copy_state(s, opts["block_v"], opts["num_warps"],
                                                                         opts["state_layout"], opts["v_tiles"]))
        else:
            step = lambda q, k, v, g, b, s, opts=opts: decode_step(q, k, v, g, b, s, **opts)
        o, s1 = jax.jit(step)(q, k, v, g, beta, layout(jnp.asarray(s0)))
        errs = {} if o is None else dict(max_rel_err_o=rel_err(o.astype(jnp.float32), ref_o),
                                         max_rel_err_state=rel_err(layout(s1), ref_s))
        # `steps` decode steps inside one jit, the state carried (and updated in place) through a fori_loop: the
        # time per step is device time, without the host round trip of one call per token.
        many = jax.jit(lambda s, step=step: jax.lax.fori_loop(0, steps, lambda i, s: step(q, k, v, g, beta, s)[1],
                                                              s), donate_argnums=0)
        s = many(s1)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            s = jax.block_until_ready(many(s))
            times.append(time.perf_counter() - start)
        ms = 1e3 * float(np.median(times)) / steps
        # The kernel's device time from a profiler trace of the same loop: the wall clock above also holds the
        # loop's per-step overhead, which FLA's do_bench (CUDA events around queued calls) does not see.
        with tempfile.TemporaryDirectory() as tmp:
            with jax.profiler.trace(tmp):
                s = jax.block_until_ready(many(s))
            times_ns = kernel_times(tmp)
            kernel_ms = times_ns.get("lineattn_decode_step", times_ns.get("copy_state", float("nan"))) / steps / 1e6
        name = (f"lineattn-pallas-decode-bv{block_v}-w{warps}" + ("-vfirst" if opts["v_fastest"] else "")
                + ("-updated" if "u" in flags else "") + ("-stored" if "s" in flags else "")
                + ("-vk" if "t" in flags else "") + ("-strided" if "i" in flags else "")
                + ("-copy" if "c" in flags else ""))
        record(a.out, op="kda", impl=name, mode="decode", B=B, T=tokens, H=H, K=K, V=V, ms=ms,
               state_TBps=2 * state_bytes / (ms * 1e-3) / 1e12, kernel_ms=kernel_ms,
               kernel_state_TBps=2 * state_bytes / (kernel_ms * 1e-3) / 1e12, **errs)
    try:
        import torch
        import triton
        from fla.ops.kda import fused_recurrent_kda
    except ImportError as err:
        print(f"FLA decode unavailable: {err}")
        return
    tt = lambda arr, dt: torch.tensor(np.asarray(arr, np.float32), device="cuda", dtype=dt)
    qt, kt, vt, bt = (tt(x[n], torch.bfloat16) for n in ("q", "k", "v", "beta"))
    gt = tt(x["g"], torch.float32)
    st = tt(s0, torch.float32)
    fla = lambda: fused_recurrent_kda(qt, kt, vt, gt, bt, initial_state=st, output_final_state=True)
    o = fla()[0]
    ms = triton.testing.do_bench(fla, warmup=10, rep=50, return_mode="median")
    record(a.out, op="kda", impl="fla-fused_recurrent", mode="decode", B=B, T=tokens, H=H, K=K, V=V, ms=float(ms),
           state_TBps=2 * state_bytes / (ms * 1e-3) / 1e12,
           max_rel_err_o=rel_err(o.float().cpu().numpy(), ref_o))
    # The device's own copy ceilings for the same bytes (torch's copy kernels, do_bench): into another buffer, and
    # read-modify-write in place as the decode step does (the "copy limit")
    dst = torch.empty_like(st)
    for name, fn in [("torch-copy", lambda: dst.copy_(st)), ("torch-inplace-scale", lambda: st.mul_(1.0))]:
        ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
        record(a.out, op="kda", impl=name, mode="decode", B=B, T=tokens, H=H, K=K, V=V, ms=float(ms),
               state_TBps=2 * state_bytes / (ms * 1e-3) / 1e12)


def bench_tuning(a, B, T):
    """The forward's two kernels apart, and its launch settings (warps per kernel, V tile of the state pass)."""
    from lineattn.ops.pallas.chunk_fwd import forward
    x, _ = make_inputs(B, T, H, K, V, "bfloat16", seed=6)
    bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
    args = [bf("q"), bf("k"), bf("v"), jnp.asarray(x["g"]), bf("beta"), jnp.zeros((B, H, K, V), jnp.float32)]
    for warps in a.warps:
        for only_intra in (True, False):
            for bv in ([None] if only_intra else a.block_vs):
                f = jax.jit(lambda *xs, w=warps, o=only_intra, bv=bv: forward(
                    *xs, scale=K**-0.5, warps=w, only_intra=o, block_v=bv))
                try:
                    ms = time_jax(f, args, a.iters)
                except Exception as exc:
                    print(f"tuning {warps} {bv} {only_intra}: failed: {type(exc).__name__}: {str(exc)[:300]}")
                    continue
                name = f"lineattn-pallas-{'intra' if only_intra else 'fwd'}-w{warps[0]}x{warps[1]}-bv{bv}"
                record(a.out, op="kda", impl=name, mode="fwd-tuning", B=B, T=T, H=H, K=K, V=V, ms=ms)


def bench_long(a, T):
    x, _ = make_inputs(1, T, H, K, V, "bfloat16", seed=5)
    bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
    args = [bf("q"), bf("k"), bf("v"), jnp.asarray(x["g"]), bf("beta")]
    do = jnp.asarray(x["do"], jnp.bfloat16)
    f = lambda *xs: ops.chunk_kda(*xs, backend="pallas")[0]
    for mode, fn in (("fwd", jax.jit(f)), ("fwdbwd", jax.jit(forward_backward(f, do)))):
        try:
            ms = time_jax(fn, args, 3)
            mem = device_memory(jax.devices()[:1])[0] or {}   # the peak so far: this process's largest step
            record(a.out, op="kda", impl="lineattn-pallas", mode=mode, B=1, T=T, H=H, K=K, V=V, ms=ms,
                   dtype="bfloat16", peak_gib=round(mem.get("peak_bytes_in_use", 0) / 2**30, 2) or None)
        except Exception as exc:
            print(f"long T={T} {mode}: failed: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--rounds", type=int, default=1,
                   help="JAX implementations timed in turn in this many rounds of --iters / rounds calls each (the "
                        "median over all calls): drift of the machine then slows all alike; 1: each in one go")
    p.add_argument("--shapes", default="8x4096,1x32768")
    p.add_argument("--aot", action="store_true",
                   help="also time each JAX implementation's program through `jax.jit(f).lower(*args).compile()` "
                        "(as ab_pallas_kda.py does), in turn with the jit calls; records then carry 'harness'")
    p.add_argument("--skip", nargs="*", default=[])
    p.add_argument("--fla", default="fwd,fwdbwd", help="FLA modes to time ('' for none): autotuning is slow")
    p.add_argument("--fla-shapes", default="8x4096,1x32768", help="shapes at which FLA is timed")
    p.add_argument("--tune-shapes", default="8x4096,1x32768")
    p.add_argument("--gdn", action="store_true")
    p.add_argument("--no-kda", action="store_true", help="time GDN (--gdn) at --shapes without KDA there")
    p.add_argument("--decode", default="64x4f,64x4fu,64x8f,32x4f,64x4fc",
                   help="decode block_v x num_warps configs, then letters: f the V tiles first in the launch order, "
                        "u o read from the updated state (readout='updated'), s o read after the state's stores "
                        "(readout='stored'), t the state stored transposed "
                        "(state_layout='vk'), i its V rows strided (v_tiles='strided'), c a plain copy of the state")
    p.add_argument("--long", type=int, default=0, help="also time one sequence of this length (0: no)")
    p.add_argument("--tune", action="store_true", help="time the forward's kernels apart and launch settings")
    p.add_argument("--warps", default="4x4,8x4,4x8,8x8")
    p.add_argument("--block-vs", default="0,16,32,64", help="V tiles of the state pass (0: the default rule)")
    a = p.parse_args()
    a.decode_configs = [parse_decode_config(c) for c in a.decode.split(",") if c]
    fla_modes = [m for m in a.fla.split(",") if m]
    a.warps = [tuple(map(int, w.split("x"))) for w in a.warps.split(",") if w]
    a.block_vs = [int(b) or None for b in a.block_vs.split(",") if b]
    print(f"{jax.devices()[0].device_kind}; {versions()}", flush=True)
    shapes = [s for s in a.shapes.split(",") if s]    # --shapes= (empty): e.g. only --long
    for shape in [] if a.no_kda else shapes:
        B, T = map(int, shape.split("x"))
        bench_shape("kda", B, T, a, a.skip, fla_modes if shape in a.fla_shapes.split(",") else [])
    if a.decode_configs:
        bench_decode(a)
    if a.tune:
        for shape in a.tune_shapes.split(","):
            bench_tuning(a, *map(int, shape.split("x")))
    if a.gdn:
        for shape in shapes:
            B, T = map(int, shape.split("x"))
            fla_gdn = ["fwd"] if fla_modes and shape in a.fla_shapes.split(",") else []
            bench_shape("gdn", B, T, a, a.skip + ["lineattn-chunk"], fla_gdn)
    if a.long:
        bench_long(a, a.long)
    ms = {(r["op"], r["impl"], r["mode"], r["B"], r["T"], r.get("harness", "jit")): r["ms"] for r in RECORDS}
    print("\npeer ms / lineattn-pallas ms (same run):")
    for (op, impl, mode, B, T, harness), t in sorted(ms.items()):
        ours = ms.get((op, "lineattn-pallas", mode, B, T, harness))
        if ours and impl != "lineattn-pallas" and mode != "decode":
            print(f"  {op} B={B} T={T} {mode:7s} {impl:18s} {t / ours:.2f}x" + (f" ({harness})" if a.aot else ""))


if __name__ == "__main__":
    main()
