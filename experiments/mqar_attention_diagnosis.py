"""Why the softmax-attention row of configs/ablate_mqar.yaml stayed at 7.5 %: quick CPU runs of one model.

    PYTHONPATH=. python experiments/mqar_attention_diagnosis.py '{"name": "tied"}' '{"name": "untied", "tie": false}'

Each JSON argument is one run: the MQAR model of the ablation (2 layers, no MLP, width 128, 2 heads) with one
layer pattern, trained by a plain loop with the trainer's optimiser (AdamW b2 0.95, wd 0.1, clip 1, warm-up then
cosine to 0.1 lr) on fresh MQAR batches, printing (step, train loss, held-out accuracy on 256 examples) every
100 steps. Keys: T, kv, steps, lr, wd, batch, heads, pattern, tie, warmup, seed. The numbers are in
experiments/results/ablate_mqar/README.md.
"""

import json
import sys
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from lineattn.models import HybridLM, ModelConfig
from lineattn.train import synthetic


def run(name, T=64, kv=8, steps=600, lr=3e-3, wd=0.1, batch=64, heads=2, pattern=("attention",), tie=True,
        warmup=50, seed=0):
    cfg = ModelConfig(vocab_size=256, width=128, num_layers=2, num_heads=heads, layer_pattern=tuple(pattern),
                      mlp_ratio=0, tie_embeddings=tie)
    model = HybridLM(cfg, rngs=nnx.Rngs(seed))
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, warmup, steps, lr * 0.1)
    opt = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                           optax.adamw(sched, 0.9, 0.95, weight_decay=wd)), wrt=nnx.Param)

    def loss_fn(m, x, y, mask):
        logits = m(x)
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, y)
        hit = jnp.argmax(logits, -1) == y
        return (nll * mask).sum() / mask.sum(), (hit * mask).sum() / mask.sum()

    @nnx.jit
    def step(m, o, x, y, mask):
        (loss, acc), g = nnx.value_and_grad(loss_fn, has_aux=True)(m, x, y, mask)
        o.update(m, g)
        return loss, acc

    evaluate = nnx.jit(loss_fn)
    rng = np.random.default_rng(seed)
    val = synthetic.mqar(np.random.default_rng(12345), 256, T, vocab_size=256, num_kv_pairs=kv)
    t0, hist = time.time(), []
    for s in range(1, steps + 1):
        b = synthetic.mqar(rng, batch, T, vocab_size=256, num_kv_pairs=kv)
        loss, _ = step(model, opt, b["tokens"], b["targets"], b["mask"])
        if s % 100 == 0 or s == steps:
            _, acc = evaluate(model, val["tokens"], val["targets"], val["mask"])
            hist.append((s, round(float(loss), 3), round(float(acc), 3)))
            print(f"  {name} step {s}: loss {hist[-1][1]}, accuracy {hist[-1][2]} ({time.time() - t0:.0f} s)",
                  flush=True)
    print(name, f"{time.time() - t0:.0f}s", hist, flush=True)


if __name__ == "__main__":
    for spec in sys.argv[1:]:
        kw = json.loads(spec)
        run(kw.pop("name"), **kw)
