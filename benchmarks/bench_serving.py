"""Serving mechanisms on the CPU: time to first token with and without the prefix cache (the reference article's
A/B/C example), and speculative vs plain greedy decoding (tokens/s, acceptance rate).

    python benchmarks/bench_serving.py --out benchmarks/results

Models are random-initialised, with noise on every parameter so their greedy continuations vary (an untrained
model otherwise repeats one token). The draft shares the target's embedding and first layers. Each measurement
is run twice and the second run is reported (the first compiles). Writes <out>/<date>-cpu-serving.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from bench_kda import versions, write_results
from lineattn import decode
from lineattn.decode.prefix_cache import PrefixCache
from lineattn.decode.speculative import speculative_generate
from lineattn.models import HybridLM, ModelConfig


def perturbed(model, seed, std=0.3):
    graph, params = nnx.split(model)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return nnx.merge(graph, jax.tree.unflatten(tree, [x + std * jax.random.normal(k, x.shape)
                                                      for x, k in zip(leaves, keys)]))


def truncated_draft(target, num_layers):
    """A draft with the target's embedding, first `num_layers` blocks and final norm."""
    draft = HybridLM(dataclasses.replace(target.cfg, num_layers=num_layers), rngs=nnx.Rngs(0))
    params = nnx.to_pure_dict(nnx.state(target, nnx.Param))
    params["blocks"] = {i: params["blocks"][i] for i in range(num_layers)}
    nnx.replace_by_pure_dict(state := nnx.state(draft, nnx.Param), params)
    nnx.update(draft, state)
    return draft


def twice(fn):
    fn()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def ttft_rows(model, block_size, hash_block_size):
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    A = rng.integers(0, vocab, 2000)
    B = np.concatenate([A[:1300], rng.integers(0, vocab, 700)])
    C = np.concatenate([A[:1300], rng.integers(0, vocab, 500)])

    jit_prefill = nnx.jit(decode.prefill)  # the cache's prefill is jitted too

    def cold(tokens):
        logits, _ = jit_prefill(model, jnp.asarray(tokens)[None], decode.init_state(model, 1, len(tokens)))
        return jax.block_until_ready(logits)

    def cached():
        cache, out = PrefixCache(model, block_size=block_size, hash_block_size=hash_block_size), []
        for tokens in (A, B, C):
            start = time.perf_counter()
            logits, _, info = cache.prefill(tokens, max_len=len(tokens))
            jax.block_until_ready(logits)
            out.append((time.perf_counter() - start, info))
        return out

    _, with_cache = twice(cached)
    rows = []
    for name, tokens, (secs, info) in zip("ABC", (A, B, C), with_cache):
        cold_secs, _ = twice(lambda: cold(tokens))
        rows.append(dict(request=name, tokens=len(tokens), hit=info.hit, junction=info.junction,
                         ttft_cold_ms=1e3 * cold_secs, ttft_cached_ms=1e3 * secs))
    return rows


def spec_rows(target, draft_layers, num_draft, new_tokens, batch):
    draft = truncated_draft(target, draft_layers)
    prompts = jnp.asarray(np.random.default_rng(1).integers(0, target.cfg.vocab_size, (batch, 32)))
    plain_s, plain = twice(lambda: jax.block_until_ready(decode.generate(target, prompts, new_tokens, temperature=0)))
    spec_s, (out, stats) = twice(lambda: speculative_generate(target, draft, prompts, new_tokens,
                                                              num_draft=num_draft))
    assert np.array_equal(np.asarray(out), np.asarray(plain[:, 32:])), "greedy speculative != greedy"
    return [dict(mode="plain greedy", tokens_per_s=batch * new_tokens / plain_s),
            dict(mode=f"speculative, draft = first {draft_layers} layers, n = {num_draft}",
                 tokens_per_s=batch * new_tokens / spec_s, acceptance_rate=stats["acceptance_rate"],
                 rounds=stats["rounds"])]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--draft-layers", type=int, default=2)
    p.add_argument("--num-draft", type=int, default=4)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    cfg = ModelConfig(vocab_size=256, width=args.width, num_layers=args.layers, num_heads=2)
    model = perturbed(HybridLM(cfg, rngs=nnx.Rngs(0)), 0)
    record = dict(op="serving", device=jax.devices()[0].platform, width=args.width, layers=args.layers,
                  versions=versions())
    print(f"prefix cache, A/B/C (block 640, hash block 64), width {args.width}, {args.layers} layers (3 KDA : 1 attn)")
    record["ttft"] = ttft_rows(model, 640, 64)
    for r in record["ttft"]:
        print(f"  {r['request']}: {r['tokens']} tokens, hit {r['hit']:>4}, junction {r['junction']}: "
              f"TTFT cold {r['ttft_cold_ms']:8.1f} ms, with cache {r['ttft_cached_ms']:8.1f} ms")
    record["speculative"] = spec_rows(model, args.draft_layers, args.num_draft, args.new_tokens, args.batch)
    for r in record["speculative"]:
        extra = f", acceptance {r['acceptance_rate']:.2f}" if "acceptance_rate" in r else ""
        print(f"  {r['mode']}: {r['tokens_per_s']:.1f} tokens/s{extra}")
    if args.out:
        write_results(args.out, f"{record['device']}-serving", record)


if __name__ == "__main__":
    main()
