"""Serving mechanisms on the CPU: time to first token with and without the prefix cache (the reference article's
A/B/C example), and speculative vs plain greedy decoding (tokens/s, acceptance rate).

    python benchmarks/bench_serving.py --out benchmarks/results                          # random models
    python benchmarks/bench_serving.py --run-dir runs/shakespeare --out benchmarks/results  # after `make train`

Without --run-dir the target is random-initialised, with noise on every parameter so its greedy continuations
vary (an untrained model otherwise repeats one token), and the prompts are random bytes: the draft then agrees
with the target about as often as chance, which times the mechanism at its worst. With --run-dir the target is
that run's trained model and the requests and prompts are held-out text (its validation plays), so the
acceptance rate is what an early-exit draft of a trained model gets. The draft shares the target's embedding,
first --draft-layers blocks and final norm. Each measurement is run twice and the second run is reported (the
first compiles). Writes <out>/<date>-cpu-serving[-trained-draft<L>x<n>].json.
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


def trained(run_dir, batch):
    """The run's model, 3200 tokens of its held-out text (the A/B/C requests) and [batch, 32] prompts from it."""
    from lineattn.train.corpus import shakespeare_works, split_works
    from lineattn.train.tokenizer import ByteTokenizer
    from lineattn.train.trainer import load_run
    cfg, bundle, _ = load_run(run_dir)
    if cfg.data.source != "shakespeare":
        raise ValueError(f"--run-dir must be a byte-level Shakespeare run, got data.source {cfg.data.source!r}")
    _, val = split_works(shakespeare_works(), tuple(cfg.data.val_plays))
    held_out = ByteTokenizer().encode(b"".join(val[name] for name in sorted(val)))
    starts = np.linspace(10_000, len(held_out) - 100, batch).astype(int)  # past the title pages
    return bundle.model, np.asarray(held_out[:3200]), np.stack([held_out[s : s + 32] for s in starts])


def twice(fn):
    fn()
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def ttft_rows(model, block_size, hash_block_size, text):
    """The A/B/C example: B and C share A's first 1300 tokens. text [>= 3200] int: the tokens to draw from."""
    A = text[:2000]
    B = np.concatenate([A[:1300], text[2000:2700]])
    C = np.concatenate([A[:1300], text[2700:3200]])

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


def spec_rows(target, draft_layers, num_draft, new_tokens, prompts):
    """Plain greedy vs speculative greedy decoding of prompts [B, T0] (both emit the same tokens, asserted)."""
    draft = truncated_draft(target, draft_layers)
    batch = prompts.shape[0]
    prompts = jnp.asarray(prompts)
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
    p.add_argument("--run-dir", type=Path, default=None,
                   help="a trained byte-level run (`make train`): its model and held-out text instead of random ones")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    if args.run_dir is None:
        cfg = ModelConfig(vocab_size=256, width=args.width, num_layers=args.layers, num_heads=2)
        model = perturbed(HybridLM(cfg, rngs=nnx.Rngs(0)), 0)
        rng = np.random.default_rng(0)
        text = rng.integers(0, cfg.vocab_size, 3200)
        prompts = np.random.default_rng(1).integers(0, cfg.vocab_size, (args.batch, 32))
        source = "random model, random tokens"
    else:
        model, text, prompts = trained(args.run_dir, args.batch)
        cfg = model.cfg
        source = f"trained model {args.run_dir}, held-out text"
    pattern = ":".join(str(cfg.layer_pattern.count(m)) + " " + m for m in dict.fromkeys(cfg.layer_pattern))
    record = dict(op="serving", device=jax.devices()[0].platform, width=cfg.width, layers=cfg.num_layers,
                  pattern=pattern, source=source, versions=versions())
    print(f"{source}: width {cfg.width}, {cfg.num_layers} layers ({pattern})")
    print("prefix cache, A/B/C (block 640, hash block 64)")
    record["ttft"] = ttft_rows(model, 640, 64, text)
    for r in record["ttft"]:
        print(f"  {r['request']}: {r['tokens']} tokens, hit {r['hit']:>4}, junction {r['junction']}: "
              f"TTFT cold {r['ttft_cold_ms']:8.1f} ms, with cache {r['ttft_cached_ms']:8.1f} ms")
    record["speculative"] = spec_rows(model, args.draft_layers, args.num_draft, args.new_tokens, prompts)
    for r in record["speculative"]:
        extra = f", acceptance {r['acceptance_rate']:.2f}" if "acceptance_rate" in r else ""
        print(f"  {r['mode']}: {r['tokens_per_s']:.1f} tokens/s{extra}")
    if args.out:
        tag = f"-trained-draft{args.draft_layers}x{args.num_draft}" if args.run_dir else ""
        write_results(args.out, f"{record['device']}-serving{tag}", record)


if __name__ == "__main__":
    main()
