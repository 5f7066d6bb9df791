"""Synthetic recall tasks: multi-query associative recall (MQAR) and needle in a haystack (NIAH).

Both return `tokens`, `targets` (int32 `[N, T]`) and `mask` (float32 `[N, T]`, 1 where an answer is scored):
the model reads `tokens` and must put `targets` at the masked positions; accuracy is the fraction of masked
positions whose argmax is the target.
"""

from __future__ import annotations

import numpy as np


def _sample_without_replacement(rng: np.random.Generator, n: int, pool: int, k: int,
                                 log_weights: np.ndarray | None = None) -> np.ndarray:
    """`[n, k]` distinct indices in `[0, pool)` per row (weighted sequential sampling via the Gumbel top-k trick)."""
    scores = rng.gumbel(size=(n, pool))
    if log_weights is not None:
        scores = scores + log_weights
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def mqar(rng: np.random.Generator, num_examples: int, seq_len: int, *, vocab_size: int, num_kv_pairs: int,
         power_a: float = 0.01, random_non_queries: bool = True) -> dict[str, np.ndarray]:
    """Zoology's MQAR: `num_kv_pairs` key-value pairs, then the keys queried again after power-law gaps.

    Keys are drawn (distinct per example) from `[1, vocab/2)`, values from `[vocab/2, vocab)`. The context is
    `k1 v1 k2 v2 ...`; the rest of the row is `(seq_len - 2 * num_kv_pairs) / 2` two-token slots, and key `i` is
    queried at the first token of slot `gap_i`, with `gap` drawn without replacement with probability
    `~ a * x^(a - 1)` (x = 1 + slot), so most queries come soon after the context. Only the query positions are
    labelled (with the key's value); the other positions hold 0, or random tokens when `random_non_queries`.
    """
    context = 2 * num_kv_pairs
    space = (seq_len - context) // 2
    half = vocab_size // 2
    if num_kv_pairs > space:
        raise ValueError(f"num_kv_pairs={num_kv_pairs} needs seq_len >= {4 * num_kv_pairs}, got {seq_len}")
    if num_kv_pairs > min(half - 1, vocab_size - half):
        raise ValueError(f"num_kv_pairs={num_kv_pairs} too large for vocab_size={vocab_size}")
    n = num_examples
    keys = 1 + _sample_without_replacement(rng, n, half - 1, num_kv_pairs)
    values = half + _sample_without_replacement(rng, n, vocab_size - half, num_kv_pairs)
    x = np.arange(1, space + 1, dtype=np.float64)
    log_p = np.log(power_a) + (power_a - 1) * np.log(x)
    gaps = _sample_without_replacement(rng, n, space, num_kv_pairs, log_p)
    tokens = np.zeros((n, seq_len), np.int32)
    tokens[:, 0:context:2], tokens[:, 1:context:2] = keys, values
    rows = np.arange(n)[:, None]
    qpos = context + 2 * gaps
    if random_non_queries:
        filler = rng.integers(0, vocab_size, size=(n, seq_len - context), dtype=np.int32)
        tokens[:, context:] = filler
    tokens[rows, qpos] = keys
    targets = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    targets[rows, qpos], mask[rows, qpos] = values, 1.0
    return {"tokens": tokens, "targets": targets, "mask": mask}


NIAH_NEEDLE, NIAH_QUERY, NIAH_FIRST = 1, 2, 3   # token 0 is unused; ordinary tokens start at 3


def niah(rng: np.random.Generator, num_examples: int, seq_len: int, *, vocab_size: int,
         num_distractors: int = 0) -> dict[str, np.ndarray]:
    """Needle in a haystack: `NEEDLE key value` hidden at a uniform depth in random filler, `QUERY key` at the end.

    Keys come from the lower half of the ordinary tokens `[3, vocab)`, values from the upper half, filler from
    all of them. `num_distractors` more needles with other keys (and their own values) are hidden too. The one
    labelled position is the last one (the queried key), whose target is the needle's value.
    """
    lo, hi = NIAH_FIRST, vocab_size
    mid = (lo + hi) // 2
    num_needles = 1 + num_distractors
    slots = (seq_len - 2) // 3
    if num_needles > slots:
        raise ValueError(f"{num_needles} needles do not fit in seq_len={seq_len} (need seq_len >= {3 * num_needles + 2})")
    if num_needles > mid - lo:
        raise ValueError(f"{num_needles} needles need more than {mid - lo} distinct keys (vocab_size={vocab_size})")
    n = num_examples
    rows = np.arange(n)[:, None]
    tokens = rng.integers(lo, hi, size=(n, seq_len), dtype=np.int32)
    keys = lo + _sample_without_replacement(rng, n, mid - lo, num_needles)
    values = rng.integers(mid, hi, size=(n, num_needles), dtype=np.int32)
    starts = 3 * _sample_without_replacement(rng, n, slots, num_needles)
    tokens[rows, starts], tokens[rows, starts + 1], tokens[rows, starts + 2] = NIAH_NEEDLE, keys, values
    tokens[:, -2], tokens[:, -1] = NIAH_QUERY, keys[:, 0]
    targets = np.zeros((n, seq_len), np.int32)
    mask = np.zeros((n, seq_len), np.float32)
    targets[:, -1], mask[:, -1] = values[:, 0], 1.0
    return {"tokens": tokens, "targets": targets, "mask": mask, "needle_depth": starts[:, 0] / max(seq_len - 2, 1)}
