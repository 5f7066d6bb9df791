"""Shared set-up of the trainer tests: one tiny config, a deterministic text corpus, the compilation cache.

`python -m lineattn.train.testing` prints the golden losses pinned in tests/test_train_trainer.py.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

# One model and batch shape for every trainer test: 2 layers (KDA, attention), width 32, 8 rows of 32 tokens.
BASE = {
    "model": {"vocab_size": 264, "width": 32, "num_layers": 2, "num_heads": 2, "layer_pattern": ["kda", "attention"]},
    "data": {"source": "shakespeare", "seq_len": 32, "batch_size": 8, "eval_rows": 16,
             "mqar": {"vocab_size": 64, "num_kv_pairs": 4}},
    "optim": {"lr": 1.0e-2},
    "schedule": {"warmup_steps": 2},
    "train": {"steps": 12, "checkpoint_every": 4, "seed": 0},
    "log": {"every": 1, "progress": "none", "plot": True},
}

WORDS = ("the king and queen of denmark speak to the ghost upon the castle wall at night while the "
         "soldiers keep their watch and horatio doubts").split()


def golden_text_source():
    """A small deterministic corpus (first-order word chain over a fixed vocabulary), four docs train, one val."""
    from lineattn.train.data import TextSource
    rng = np.random.default_rng(1234)
    docs = {}
    for d in range(5):
        i, words = int(rng.integers(len(WORDS))), []
        for _ in range(300):
            i = (i + int(rng.choice([1, 2, 3], p=[0.7, 0.2, 0.1]))) % len(WORDS)
            words.append(WORDS[i])
        docs[f"doc{d}"] = (" ".join(words) + ".\n").encode()
    val = {"doc4": docs.pop("doc4")}
    return TextSource(docs, val, seq_len=BASE["data"]["seq_len"], batch_size=BASE["data"]["batch_size"], seed=0)


def enable_compile_cache(path: str) -> None:
    """JAX's persistent compilation cache at `path` (every compile, however small), in this process."""
    import jax
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    try:   # the cache is set up on first use; make it read the new settings
        from jax._src import compilation_cache
        compilation_cache.reset_cache()
    except (ImportError, AttributeError):
        pass


CACHE_DIR = os.path.join(tempfile.gettempdir(), f"lineattn-test-jax-cache-{os.getuid()}")


def _print_golden() -> None:
    import tempfile as tf
    from lineattn.train.config import load_config
    from lineattn.train.metrics import read_metrics
    from lineattn.train.trainer import train
    with tf.TemporaryDirectory() as d:
        train(load_config(base=BASE), d, source=golden_text_source(), log_fn=lambda s: None)
        losses = {r["step"]: r["loss"] for r in read_metrics(os.path.join(d, "metrics.jsonl"))}
    print("GOLDEN = {" + ", ".join(f"{s}: {losses[s]:.7f}" for s in (1, 4, 8, 12)) + "}")


def sharded_step_check(meshes=(("data", 8, 1), ("fsdp", 2, 4))) -> dict:
    """Train steps of the tiny config on 1 device and on each mesh (name, data, fsdp[, context]) from the same init;
    returns the largest differences (after 3 steps: after one, Adam's update is nearly sign(grad) and hides them). Needs XLA_FLAGS=--xla_force_host_platform_device_count=8 (set before JAX
    starts), so tests run it in a subprocess."""
    import tempfile as tf

    import jax

    from lineattn.train.config import load_config
    from lineattn.train.trainer import Trainer

    def one_step(devices, data, fsdp, context=1):
        cfg = load_config(base={**BASE, "mesh": {"data": data, "fsdp": fsdp, "context": context}})
        with tf.TemporaryDirectory() as d:
            src = golden_text_source()
            tr = Trainer(cfg, d, source=src, devices=devices, log_fn=lambda s: None)
            state = tr.state
            for step in range(3):
                state, metrics = tr._train_step(state, tr.put(src.batch(step)))
            out = jax.device_get((state["params"], metrics))
            shardings = {str(x.sharding.spec) for x in jax.tree.leaves(state["params"])}
            tr.close()
        return out, shardings

    assert jax.device_count() == 8, jax.device_count()
    (ref_params, ref_m), _ = one_step(jax.devices()[:1], -1, 1)
    report = {"devices": jax.device_count()}
    for name, *axes in meshes:
        (params, m), specs = one_step(jax.devices(), *axes)
        diffs = [float(np.max(np.abs(np.asarray(a) - np.asarray(b))) / max(float(np.max(np.abs(b))), 1e-30))
                 for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params))]
        report[name] = {"loss": float(m["loss"]), "ref_loss": float(ref_m["loss"]),
                        "grad_norm": float(m["grad_norm"]), "ref_grad_norm": float(ref_m["grad_norm"]),
                        "max_rel_param_diff": max(diffs), "param_specs": sorted(specs)}
    return report


if __name__ == "__main__":
    import json
    import sys
    if sys.argv[1:] == ["sharded"]:
        if os.environ.get("LINEATTN_TEST_CACHE"):
            enable_compile_cache(os.environ["LINEATTN_TEST_CACHE"])
        print(json.dumps(sharded_step_check()))
    else:
        _print_golden()
