"""A/B wall clock of lineattn's Pallas KDA (or GDN) under several configurations, interleaved in one process.

    python benchmarks/ab_pallas_kda.py --out $OUT --configs "default;solve.SOLVE_IMPL=triton" \
        [--rule gdn] [--shapes 8x4096,1x32768] [--rounds 3] [--iters 10]

The same timing as bench_pallas_kda.py (calls each followed by `block_until_ready`: dispatch and launch overheads
included), but every configuration (module constants of `lineattn.ops.pallas`, as profile_pallas_kda.py's --configs)
is compiled ahead of time and the configurations are timed in turn for --rounds rounds of --iters calls
(`bench_kda.time_interleaved`), so that a difference between them is not drift of the machine. Writes
<out>/<date>-<device>-<rule>-ab.json (<device> by `bench_kda.device_tag`: h200, h100, ...; before session 49 always
h200): a list of {"shape", "config", "mode", "ms" (the median over all calls; before session 44 the median of the
rounds' medians), "rounds_ms" (each round's median)}. GDN (--rule gdn) takes the same inputs with the gate's first
channel as its head gate, as bench_pallas_kda.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_kda import device_tag, forward_backward, make_inputs, time_interleaved, versions  # noqa: E402

from lineattn import ops  # noqa: E402
from lineattn.ops.pallas import tuning  # noqa: E402

H, K, V = 16, 128, 128


def compiled_pair(rule, args, do):
    """AOT-compiled forward and forward+backward of `ops.linear_attention(rule, ..., backend="pallas")` under the
    current constants (a compiled executable keeps them after the constants are restored)."""
    f = lambda *xs: ops.linear_attention(rule, *xs, backend="pallas")[0]
    step = forward_backward(f, do)
    return {"fwd": jax.jit(f).lower(*args).compile(), "fwdbwd": jax.jit(step).lower(*args).compile()}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--configs", default="default;solve.SOLVE_IMPL=triton")
    p.add_argument("--rule", default="kda", choices=["kda", "gdn"])
    p.add_argument("--shapes", default="8x4096,1x32768")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    a = p.parse_args()
    device = jax.devices()[0].device_kind
    print(f"{device}; {versions()}", flush=True)
    records = []
    for shape in a.shapes.split(","):
        B, T = map(int, shape.split("x"))
        x, _ = make_inputs(B, T, H, K, V, "bfloat16")
        if a.rule == "gdn":
            x["g"] = np.ascontiguousarray(x["g"][..., 0])
        args = [jnp.asarray(x[n], jnp.bfloat16) for n in "qkv"] + [jnp.asarray(x["g"]),
                                                                 jnp.asarray(x["beta"], jnp.bfloat16)]
        do = jnp.asarray(x["do"], jnp.float32)
        fns = {}
        for config in a.configs.split(";"):
            with tuning.override(tuning.parse(config)):
                fns[config] = compiled_pair(a.rule, args, do)
        calls = {(c, m): fns[c][m] for c in fns for m in ("fwd", "fwdbwd")}
        for (config, mode), (ms, ts) in time_interleaved(calls, args, a.iters * a.rounds, a.rounds).items():
            records.append(dict(shape=shape, config=config, mode=mode, ms=ms, rounds_ms=ts))
            print(f"  {shape:8s} {mode:7s} {ms:7.3f} ms  {config}  (rounds: " + ", ".join(f"{t:.3f}" for t in ts)
                  + ")", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    out = a.out / f"{datetime.date.today()}-{device_tag(device)}-{a.rule}-ab.json"
    out.write_text(json.dumps({"device": device, "versions": versions(),
                               "records": records}, indent=1))


if __name__ == "__main__":
    main()
