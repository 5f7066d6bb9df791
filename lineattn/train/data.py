"""Data sources for the trainer: every batch is a pure function of (seed, step), so a resumed run sees the same data.

A source gives `batch(step)` (the rows of optimiser step `step`, as NumPy arrays `tokens`, `targets`, `mask` and,
for packed text, `segment_ids`), `eval_batches(max_rows)` (a fixed validation set) and `data_position(step)`
(how far into the training data a run that has taken `step` steps is).
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np

from lineattn.train import corpus, synthetic
from lineattn.train.config import DataConfig
from lineattn.train.packing import pack_documents, rows_to_examples
from lineattn.train.tokenizer import ByteTokenizer

Batch = dict[str, np.ndarray]
MODEL_KEYS = ("tokens", "targets", "mask", "segment_ids")


class TextSource:
    """Byte-level text: each work is `<bos> bytes <eos>`, packed (split) into rows of `seq_len + 1`.

    Training rows are visited in a fresh permutation each epoch (seeded by `seed` and the epoch), `batch_size` rows
    per step; the validation rows (held-out works) in order.
    """

    kind = "text"

    def __init__(self, train_docs: dict[str, bytes], val_docs: dict[str, bytes], *, seq_len: int, batch_size: int,
                 seed: int = 0, tokenizer: ByteTokenizer | None = None):
        self.tokenizer = tok = tokenizer or ByteTokenizer()
        self.vocab_size = tok.vocab_size
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        enc = lambda docs: [tok.encode(t, bos=True, eos=True) for t in docs.values()]
        self.train_rows, self.train_seg = pack_documents(enc(train_docs), seq_len + 1, pad_id=tok.pad_id)
        self.val_rows, self.val_seg = pack_documents(enc(val_docs), seq_len + 1, pad_id=tok.pad_id)
        if len(self.train_rows) == 0:
            raise ValueError("no training text")
        self._perm_cache: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perm_cache:
            self._perm_cache = {epoch: np.random.default_rng([self.seed, epoch]).permutation(len(self.train_rows))}
        return self._perm_cache[epoch]

    def data_position(self, step: int) -> dict[str, int]:
        rows = step * self.batch_size
        return {"rows_consumed": rows, "epoch": rows // len(self.train_rows),
                "row_in_epoch": rows % len(self.train_rows)}

    def batch(self, step: int) -> Batch:
        n = len(self.train_rows)
        idx = np.arange(step * self.batch_size, (step + 1) * self.batch_size)
        epochs, pos = idx // n, idx % n
        rows = np.array([self._perm(int(e))[p] for e, p in zip(epochs, pos)])
        return rows_to_examples(self.train_rows[rows], self.train_seg[rows])

    def eval_batches(self, max_rows: int | None = None) -> Iterator[Batch]:
        n = len(self.val_rows) if max_rows is None else min(max_rows, len(self.val_rows))
        for i in range(0, n, self.batch_size):
            j = min(i + self.batch_size, n)
            yield rows_to_examples(self.val_rows[i:j], self.val_seg[i:j])


class SyntheticSource:
    """MQAR or NIAH rows generated on the fly: training step `s` uses RNG `(seed, 0, s)`, validation `(seed, 1, i)`."""

    kind = "synthetic"

    def __init__(self, task: str, *, seq_len: int, batch_size: int, seed: int = 0, **task_kwargs):
        self.task, self.task_kwargs = task, task_kwargs
        self.make = {"mqar": synthetic.mqar, "niah": synthetic.niah}[task]
        self.vocab_size = task_kwargs["vocab_size"]
        self.seq_len, self.batch_size, self.seed = seq_len, batch_size, seed
        self.make(np.random.default_rng(0), 1, seq_len, **task_kwargs)   # raise now if the task does not fit

    def _gen(self, stream: int, index: int, n: int) -> Batch:
        ex = self.make(np.random.default_rng([self.seed, stream, index]), n, self.seq_len, **self.task_kwargs)
        out = {k: v for k, v in ex.items() if k in MODEL_KEYS}
        out["segment_ids"] = np.ones_like(out["tokens"])   # one document per row (same batch layout as text)
        return out

    def data_position(self, step: int) -> dict[str, int]:
        return {"rows_consumed": step * self.batch_size}

    def batch(self, step: int) -> Batch:
        return self._gen(0, step, self.batch_size)

    def eval_batches(self, max_rows: int | None = None) -> Iterator[Batch]:
        n = max_rows or self.batch_size
        for i in range(math.ceil(n / self.batch_size)):
            yield self._gen(1, i, min(self.batch_size, n - i * self.batch_size))


def make_source(cfg: DataConfig):
    if cfg.source == "shakespeare":
        works = corpus.shakespeare_works(cfg.cache_dir)
        train, val = corpus.split_works(works, cfg.val_plays)
        return TextSource(train, val, seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed)
    if cfg.source == "mqar":
        m = cfg.mqar
        return SyntheticSource("mqar", seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                               vocab_size=m.vocab_size, num_kv_pairs=m.num_kv_pairs, power_a=m.power_a,
                               random_non_queries=m.random_non_queries)
    if cfg.source == "niah":
        return SyntheticSource("niah", seq_len=cfg.seq_len, batch_size=cfg.batch_size, seed=cfg.seed,
                               vocab_size=cfg.niah.vocab_size, num_distractors=cfg.niah.num_distractors)
    raise ValueError(f"data.source: unknown source {cfg.source!r}")
