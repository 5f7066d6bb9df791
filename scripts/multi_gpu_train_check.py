"""Loss equality and throughput of the train step: one device vs sharded meshes on the same batches (issue 8, run 1).

    python scripts/multi_gpu_train_check.py --config configs/hybrid_125m.yaml --device gpu --steps 10 \\
        --meshes 1 fsdp=2 data=2 --set model.backend=chunk --out train_check.json
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python scripts/multi_gpu_train_check.py \\
        --config configs/shakespeare.yaml --set model.width=64 --set data.seq_len=64 --set data.batch_size=8 --steps 4

Issue 8 asks for the FSDP (and data-parallel) training step of the ~125M 3:1 KDA hybrid on 2 GPUs: the loss equals
the 1-GPU run on the same global batch (within bf16 tolerance), tokens/s per GPU and the scaling efficiency vs 1 GPU.

For each mesh in --meshes ("1": one device; "fsdp=2": data 1 x fsdp 2; "data=2": data 2 x fsdp 1; "data=2,fsdp=2";
`mesh.context` stays 1), in one process and in that order: the trainer (`lineattn.train.Trainer`, same config, so
the same `train.seed` and initial parameters) on the first data x fsdp devices, its jitted train step compiled once
(`compile_s`, XLA's per-device memory), then --steps optimiser steps on the same global batches, each step timed to
its metrics on the host. The batches are rows of a fixed random first-order Markov chain over the vocabulary
(`--branch` successors per token, so the loss falls from ln(vocab) towards ln(branch) and updates matter), one batch
per step, a pure function of (--data-seed, step): no corpus needed.

Recorded per mesh: the per-step loss and gradient norm, step times, tokens/s (global batch tokens / median step time,
the first step left out), tokens/s per device, MFU (peak per device from the trainer's table or --peak-flops), the
device memory (`memory_stats()` where the platform keeps it: the process high-water mark so far, so a later mesh's
figure includes the earlier ones' on device 0). Against the first mesh (the reference, "1" by default): per-step
|loss difference|, its max, the relative max, the first step's (same parameters: pure forward numerics), the
relative gradient-norm difference, the largest relative parameter difference after the last step (max |p - p_ref|
/ max |p_ref| per tensor), `loss_equal` (max relative loss difference <= --loss-rtol: default 1e-2 with a bf16
compute dtype, 1e-5 otherwise), the speedup and the scaling efficiency = tokens/s / (devices x reference tokens/s
per device). A mesh that fails is recorded with its error and the others still run; the JSON is rewritten after
every mesh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import numpy as np


def parse_mesh(spec: str) -> dict[str, int]:
    """'1' -> one device; 'fsdp=2', 'data=2', 'data=2,fsdp=2' -> mesh sizes (the others 1)."""
    if spec.strip() == "1":
        return {"data": 1, "fsdp": 1, "context": 1}
    sizes = {"data": 1, "fsdp": 1, "context": 1}
    for part in spec.split(","):
        key, _, value = part.partition("=")
        key = key.strip()
        if key not in ("data", "fsdp") or not value.strip().isdigit() or int(value) < 1:
            raise ValueError(f"mesh {spec!r}: expected '1' or data=N / fsdp=N joined by ','")
        sizes[key] = int(value)
    return sizes


class MarkovTokens:
    """Rows of a fixed random first-order Markov chain: each token has `branch` equally likely successors.

    `batch(step)` is a pure function of (seed, step); the trainer's source interface (kind, vocab_size, batch,
    data_position) without a validation set."""

    kind = "synthetic"

    def __init__(self, vocab_size: int, batch_size: int, seq_len: int, *, seed: int = 0, branch: int = 4):
        self.vocab_size, self.batch_size, self.seq_len, self.seed, self.branch = vocab_size, batch_size, seq_len, \
            seed, branch
        self.successors = np.random.default_rng(seed).integers(0, vocab_size, (vocab_size, branch))

    def batch(self, step: int) -> dict[str, np.ndarray]:
        B, T = self.batch_size, self.seq_len
        rng = np.random.default_rng((self.seed, step))
        pick = rng.integers(0, self.branch, (B, T))
        tokens = np.empty((B, T + 1), np.int32)
        tokens[:, 0] = rng.integers(0, self.vocab_size, B)
        for t in range(T):
            tokens[:, t + 1] = self.successors[tokens[:, t], pick[:, t]]
        return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((B, T), np.float32),
                "segment_ids": np.ones((B, T), np.int32)}

    def data_position(self, step: int) -> dict:
        return {"rows_consumed": step * self.batch_size}


def run_mesh(cfg, spec: str, source, steps: int, *, devices=None, peak_flops_per_device=None,
             keep_params: bool = True) -> tuple[dict, list | None]:
    """`steps` train steps of `cfg` on mesh `spec`; returns (record, final parameters as NumPy leaves or None)."""
    import jax

    from lineattn.train.trainer import Trainer, peak_flops

    sizes = parse_mesh(spec)
    n = sizes["data"] * sizes["fsdp"]
    devices = list(jax.devices() if devices is None else devices)
    rec = {"mesh": spec, "mesh_shape": sizes, "devices": n, "status": "ok"}
    if len(devices) < n:
        rec.update(status="error", error=f"needs {n} devices, {len(devices)} visible")
        return rec, None
    devices = devices[:n]
    rec["device"] = devices[0].device_kind
    cfg = dataclass_replace_mesh(cfg, sizes)
    B, T = cfg.data.batch_size, cfg.data.seq_len
    params = None
    try:
        with tempfile.TemporaryDirectory() as run_dir:
            tr = Trainer(cfg, run_dir, source=source, devices=devices, log_fn=lambda s: None)
            try:
                rec["mesh_axes"] = dict(tr.mesh.shape)
                rec["params"] = tr.num_params
                batches = [tr.put(source.batch(i)) for i in range(steps)]
                start = time.perf_counter()
                compiled = tr._train_step.lower(tr.state, batches[0]).compile()
                rec["compile_s"] = time.perf_counter() - start
                m = compiled.memory_analysis()
                if m is not None:
                    rec["xla_bytes_per_device"] = {k: int(getattr(m, f"{k}_size_in_bytes", 0))
                                                   for k in ("argument", "output", "temp", "alias")}
                state, losses, grad_norms, times = tr.state, [], [], []
                for b in batches:
                    start = time.perf_counter()
                    state, metrics = compiled(state, b)
                    metrics = jax.device_get(metrics)
                    times.append(time.perf_counter() - start)
                    losses.append(float(metrics["loss"]))
                    grad_norms.append(float(metrics["grad_norm"]))
                tr.state = state
                if keep_params:
                    params = [np.asarray(x) for x in jax.tree.leaves(jax.device_get(state["params"]))]
                rec["param_specs"] = sorted({str(x.sharding.spec) for x in jax.tree.leaves(state["params"])})
                flops = tr.bundle.train_flops_per_token
                dtype = getattr(tr.bundle.config, "dtype", "float32")
                peak = peak_flops_per_device or peak_flops(cfg, devices[0], dtype)
            finally:
                tr.close()
        timed = times[1:] or times
        step_s = statistics.median(timed)
        tps = B * T / step_s
        rec.update(losses=losses, grad_norms=grad_norms, step_s=times, step_s_median=step_s, step_s_min=min(timed),
                   tokens_per_step=B * T, tokens_per_s=tps, tokens_per_s_per_device=tps / n, dtype=dtype,
                   train_flops_per_token=flops, peak_flops_per_device=peak,
                   mfu=tps * flops / (peak * n) if flops and peak else None)
    except Exception as err:  # noqa: BLE001 - recorded; the other meshes still run
        text = f"{type(err).__name__}: {err}"
        rec.update(status="oom" if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() else "error",
                   error=text[:3000], traceback=traceback.format_exc()[-3000:])
        params = None
    from lineattn.train.metrics import device_memory
    rec["device_memory"] = device_memory(devices)
    return rec, params


def dataclass_replace_mesh(cfg, sizes: dict[str, int]):
    import dataclasses
    return dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=sizes["data"], fsdp=sizes["fsdp"],
                                                             context=1))


def compare(ref: dict, rec: dict, ref_params, params, rtol: float) -> dict:
    """Loss / gradient-norm / parameter differences of `rec` against `ref`, and the throughput ratios."""
    out: dict = {"reference": ref["mesh"]}
    if rec.get("status") != "ok" or ref.get("status") != "ok":
        out["status"] = "not compared (a run failed)"
        return out
    a, b = np.asarray(rec["losses"]), np.asarray(ref["losses"])
    diff = np.abs(a - b)
    ga, gb = np.asarray(rec["grad_norms"]), np.asarray(ref["grad_norms"])
    out.update(
        loss_abs_diff=diff.tolist(), max_abs_loss_diff=float(diff.max()),
        max_rel_loss_diff=float(np.max(diff / np.maximum(np.abs(b), 1e-30))),
        first_step_abs_loss_diff=float(diff[0]),
        max_rel_grad_norm_diff=float(np.max(np.abs(ga - gb) / np.maximum(np.abs(gb), 1e-30))),
        loss_rtol=rtol)
    out["loss_equal"] = out["max_rel_loss_diff"] <= rtol
    if params is not None and ref_params is not None:
        out["max_rel_param_diff"] = max(
            float(np.max(np.abs(x.astype(np.float64) - y.astype(np.float64))) / max(float(np.max(np.abs(y))), 1e-30))
            for x, y in zip(params, ref_params))
    out["speedup"] = rec["tokens_per_s"] / ref["tokens_per_s"]
    out["scaling_efficiency"] = rec["tokens_per_s"] / (rec["devices"] * ref["tokens_per_s_per_device"])
    out["status"] = "ok"
    return out


def train_check(cfg, meshes, steps: int, *, branch: int = 4, data_seed: int = 0, loss_rtol: float | None = None,
                peak_flops_per_device: float | None = None, devices=None, on_update=None, log=print) -> dict:
    """Run `meshes` (the first is the reference) on the same batches; the report (module doc)."""
    import jax

    if steps < 2:
        raise ValueError("--steps must be >= 2 (the first step is left out of the timing)")
    vocab = int(cfg.model.get("vocab_size", 256))
    source = MarkovTokens(vocab, cfg.data.batch_size, cfg.data.seq_len, seed=data_seed, branch=branch)
    dtype = str(cfg.model.get("dtype", "float32"))
    rtol = loss_rtol if loss_rtol is not None else (1e-2 if dtype == "bfloat16" else 1e-5)
    report = {"steps": steps, "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len,
              "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len, "compute_dtype": dtype,
              "data": f"Markov chain over {vocab} tokens, {branch} successors each (seed {data_seed})",
              "visible_devices": len(jax.devices() if devices is None else devices),
              "device": (jax.devices() if devices is None else devices)[0].device_kind,
              "jax": jax.__version__, "runs": {}, "comparisons": {}}
    ref, ref_params = None, None
    for spec in meshes:
        log(f"mesh {spec}: compiling and running {steps} steps ...")
        rec, params = run_mesh(cfg, spec, source, steps, devices=devices,
                               peak_flops_per_device=peak_flops_per_device)
        report["runs"][spec] = rec
        if rec["status"] == "ok":
            log(f"  compile {rec['compile_s']:.1f} s, {rec['tokens_per_s']:,.0f} tokens/s "
                f"({rec['tokens_per_s_per_device']:,.0f} per device), losses {[round(x, 4) for x in rec['losses']]}")
        else:
            log(f"  {rec['status']}: {rec.get('error', '')[:500]}")
        if ref is None:
            ref, ref_params = rec, params
        else:
            c = compare(ref, rec, ref_params, params, rtol)
            report["comparisons"][spec] = c
            if c["status"] == "ok":
                log(f"  vs {ref['mesh']}: max |loss diff| {c['max_abs_loss_diff']:.2e} "
                    f"(rel {c['max_rel_loss_diff']:.2e}, first step {c['first_step_abs_loss_diff']:.2e}), "
                    f"params rel {c.get('max_rel_param_diff', 0):.2e}, speedup {c['speedup']:.2f}x, "
                    f"scaling efficiency {c['scaling_efficiency']:.1%}")
        del params
        if on_update:
            on_update(report)
    return report


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--meshes", nargs="+", default=["1", "fsdp=2", "data=2"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--branch", type=int, default=4, help="successors per token of the Markov data")
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--loss-rtol", type=float, help="default: 1e-2 for bf16 compute, 1e-5 otherwise")
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s per device for MFU (default: the trainer's table)")
    p.add_argument("--out", help="write the report as JSON here")
    args = p.parse_args(argv)
    os.environ.setdefault("JAX_PLATFORMS", {"cpu": "cpu", "gpu": "cuda"}[args.device])

    import jax

    from lineattn.train.config import load_config

    cfg = load_config(args.config, args.overrides + ["log.plot=false", "log.progress=none",
                                                     "train.checkpoint_every=0"])
    print(f"{len(jax.devices())} {jax.devices()[0].platform} device(s) ({jax.devices()[0].device_kind}); "
          f"{args.config} {args.overrides}; {cfg.data.batch_size} x {cfg.data.seq_len} tokens per step; "
          f"meshes {args.meshes}", flush=True)

    def write(report):
        report = {"config": args.config, "overrides": args.overrides, "command": " ".join(sys.argv), **report}
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(report, indent=1, default=str))
        return report

    report = train_check(cfg, args.meshes, args.steps, branch=args.branch, data_seed=args.data_seed,
                         loss_rtol=args.loss_rtol, peak_flops_per_device=args.peak_flops, on_update=write,
                         log=lambda s: print(s, flush=True))
    report = write(report)
    print("\n| mesh | devices | status | compile s | tokens/s | tokens/s per device | MFU | max rel loss diff | "
          "scaling efficiency |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec, r in report["runs"].items():
        c = report["comparisons"].get(spec, {})
        f = lambda x, fmt: fmt.format(x) if isinstance(x, (int, float)) else "-"
        print(f"| {spec} | {r['devices']} | {r['status']} | {f(r.get('compile_s'), '{:.1f}')} | "
              f"{f(r.get('tokens_per_s'), '{:,.0f}')} | {f(r.get('tokens_per_s_per_device'), '{:,.0f}')} | "
              f"{f(r.get('mfu'), '{:.2%}')} | {f(c.get('max_rel_loss_diff'), '{:.2e}')} | "
              f"{f(c.get('scaling_efficiency'), '{:.1%}')} |")
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
