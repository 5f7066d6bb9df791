"""Training throughput of a config: tokens/s, achieved FLOP/s and MFU of the jitted train step.

    python scripts/perf.py --config configs/shakespeare.yaml [--set k=v ...] [--device cpu|gpu] [--steps 10]
    python scripts/perf.py --config configs/hybrid_125m.yaml --device gpu --out perf_h200.json

The batches are random tokens of the config's shape (no corpus needed), packed as one document per row; the step
is the trainer's own (same sharding over all visible devices of the kind). FLOPs per token come from
`lineattn.models.flops_per_token` (training = 3 x forward). MFU divides by the device's peak: a known accelerator's
dense peak for the model's dtype, `--peak-flops`, or on CPU (`--measure-peak`, the default there) the FLOP/s of a
large fp32 matmul measured on the spot, so CPU MFU reads "fraction of what this CPU does on a plain matmul".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--steps", type=int, default=10, help="timed steps (after 2 warm-up steps)")
    p.add_argument("--peak-flops", type=float, help="peak FLOP/s per device for MFU")
    p.add_argument("--measure-peak", action=argparse.BooleanOptionalAction, default=None,
                   help="measure a fp32 matmul's FLOP/s as the peak (default: on for cpu, off for gpu)")
    p.add_argument("--out", help="write the result as JSON here")
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", {"cpu": "cpu", "gpu": "cuda"}[args.device])

    import jax
    import jax.numpy as jnp
    import numpy as np

    from lineattn.train.config import load_config
    from lineattn.train.trainer import Trainer, peak_flops

    cfg = load_config(args.config, args.overrides + ["log.plot=false", "train.checkpoint_every=0"])
    T, B = cfg.data.seq_len, cfg.data.batch_size

    class RandomTokens:
        kind = "synthetic"

        def __init__(self, vocab):
            self.vocab_size = vocab

        def batch(self, step):
            rng = np.random.default_rng(step)
            tokens = rng.integers(0, self.vocab_size, (B, T + 1), dtype=np.int32)
            return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "mask": np.ones((B, T), np.float32),
                    "segment_ids": np.ones((B, T), np.int32)}

        def data_position(self, step):
            return {"rows_consumed": step * B}

    vocab = int(cfg.model.get("vocab_size", 256))
    with tempfile.TemporaryDirectory() as run_dir:
        tr = Trainer(cfg, run_dir, source=RandomTokens(vocab), log_fn=lambda s: None)
        batches = [tr.put(tr.source.batch(i)) for i in range(2)]
        t0 = time.perf_counter()
        state, m = tr._train_step(tr.state, batches[0])
        jax.block_until_ready(m)
        compile_s = time.perf_counter() - t0
        state, m = tr._train_step(state, batches[1])
        jax.block_until_ready(m)
        times = []
        for i in range(args.steps):
            t0 = time.perf_counter()
            state, m = tr._train_step(state, batches[i % 2])
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t0)
        tr.state = state
        tr.close()

    dev = jax.devices()[0]
    n_dev = tr.mesh.devices.size
    dtype = getattr(tr.bundle.config, "dtype", "float32")
    peak = args.peak_flops or peak_flops(cfg, dev, dtype)
    peak_source = "given" if args.peak_flops else ("table" if peak else None)
    measure = args.measure_peak if args.measure_peak is not None else (args.device == "cpu")
    if measure and peak is None:
        n = 2048
        a = jnp.ones((n, n), jnp.float32)
        mm = jax.jit(lambda x: x @ x)
        mm(a).block_until_ready()
        ts = []
        for _ in range(5):
            t0 = time.perf_counter()
            mm(a).block_until_ready()
            ts.append(time.perf_counter() - t0)
        peak, peak_source = 2 * n**3 / min(ts), "measured fp32 matmul"
    step_s = statistics.median(times)
    tokens_per_s = B * T / step_s
    flops = tr.bundle.train_flops_per_token
    result = {
        "config": args.config, "overrides": args.overrides, "device": dev.device_kind, "devices": n_dev,
        "params": tr.num_params, "dtype": dtype, "batch_size": B, "seq_len": T, "tokens_per_step": B * T,
        "compile_s": round(compile_s, 2), "step_s_median": step_s, "step_s_min": min(times),
        "tokens_per_s": tokens_per_s, "train_flops_per_token": flops,
        "achieved_flops": tokens_per_s * flops if flops else None,
        "peak_flops_per_device": peak, "peak_source": peak_source,
        "mfu": tokens_per_s * flops / (peak * n_dev) if flops and peak else None,
    }
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
