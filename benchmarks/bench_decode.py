"""Decode-step time against context length: all-KDA, a 3:1 KDA hybrid and all-attention models of one size.

    python benchmarks/bench_decode.py --contexts 1024 4096 16384 --out benchmarks/results

For each model and context C the state is built at slot C (its contents do not change the cost), then one jitted
`lineattn.decode.step` is timed (median of --iters calls). The KV cache is allocated at C + 1 slots: the attention
step reads every allocated slot, so its cost follows the context. Prints the table and the state bytes per layer,
and writes <out>/<date>-<device>-decode.json (`bench_kda.device_tag`: cpu, h200, h100, ...).
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from bench_kda import device_tag, time_jax, versions, write_results
from lineattn import decode
from lineattn.models import HybridLM, ModelConfig, count_params


def step_ms(model, batch, context, iters):
    state = decode.init_state(model, batch, context + 1)
    state = state._replace(slot=jnp.asarray(context, jnp.int32))
    graphdef, params = nnx.split(model)

    @jax.jit
    def run(params, token, state):
        return decode.step(nnx.merge(graphdef, params), token, state)[0]

    token = jnp.zeros((batch,), jnp.int32)
    return time_jax(run, (params, token, state), iters), decode.state_bytes(state)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    base = ModelConfig(vocab_size=256, width=args.width, num_layers=args.layers, num_heads=args.heads)
    configs = {"all-kda": dataclasses.replace(base, layer_pattern=("kda",)), "hybrid-3kda:1attn": base,
               "all-attention": dataclasses.replace(base, layer_pattern=("attention",))}
    device = jax.devices()[0].platform
    records = []
    print(f"decode step, batch {args.batch}, width {args.width}, {args.layers} layers, {args.heads} heads ({device})")
    print(f"{'model':>20} {'params':>9} " + " ".join(f"{'C=' + str(c):>10}" for c in args.contexts) + "   (ms)")
    for name, cfg in configs.items():
        model = HybridLM(cfg, rngs=nnx.Rngs(0))
        times = []
        for context in args.contexts:
            ms, layer_bytes = step_ms(model, args.batch, context, args.iters)
            times.append(ms)
            records.append(dict(op="decode_step", impl=f"lineattn-{name}", mode="decode", B=args.batch, T=context,
                                width=args.width, layers=args.layers, ms=ms, device=device, versions=versions(),
                                state_bytes_per_layer=layer_bytes))
        print(f"{name:>20} {count_params(model):>9} " + " ".join(f"{t:>10.3f}" for t in times))
    print("\nstate bytes per layer (batch 1):")
    for r in records:
        if r["B"] == args.batch:
            per_layer = ", ".join(f"{x['kind'][0]}{x['layer']}={x['bytes'] / args.batch / 1024:.0f}K"
                                  for x in r["state_bytes_per_layer"])
            print(f"  {r['impl']:>30} C={r['T']:>6}: {per_layer}")
    if args.out:
        write_results(args.out, f"{device_tag()}-decode", records)


if __name__ == "__main__":
    main()
