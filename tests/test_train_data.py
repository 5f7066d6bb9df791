"""Data: byte tokenizer, packing with segment ids, MQAR and NIAH generators, data sources, corpus split."""

from __future__ import annotations

import numpy as np
import pytest

from lineattn.train import synthetic
from lineattn.train.config import DataConfig
from lineattn.train.corpus import split_works
from lineattn.train.data import SyntheticSource, TextSource, make_source
from lineattn.train.packing import pack_documents, rows_to_examples
from lineattn.train.tokenizer import ByteTokenizer


def test_byte_tokenizer_round_trip():
    tok = ByteTokenizer()
    text = "Wherefore art thou, Romeo? — ça va ✓"
    ids = tok.encode(text, bos=True, eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and ids.dtype == np.int32
    assert ids[1:-1].max() < 256 and len(ids) == len(text.encode()) + 2
    assert tok.decode(ids) == text
    assert tok.decode([104, 105, tok.eos_id, 106]) == "hi"
    assert tok.decode([0xE2, 0x82]) == "\ufffd"   # a cut multi-byte character does not raise
    assert tok.vocab_size == 259 and len({tok.pad_id, tok.bos_id, tok.eos_id}) == 3


def test_pack_split_segments_and_mask():
    docs = [np.arange(1, 6), np.arange(10, 13), np.arange(20, 29)]   # lengths 5, 3, 9 -> 17 tokens
    tokens, seg = pack_documents(docs, 6, pad_id=-1, split=True)
    assert tokens.shape == (3, 6)
    np.testing.assert_array_equal(tokens.reshape(-1)[:17], np.concatenate(docs))
    np.testing.assert_array_equal(seg, [[1, 1, 1, 1, 1, 2], [1, 1, 2, 2, 2, 2], [1, 1, 1, 1, 1, 0]])
    ex = rows_to_examples(tokens, seg)
    assert ex["tokens"].shape == (3, 5)
    # The target of a doc's last token is the next doc's first: not scored; nor is padding.
    np.testing.assert_array_equal(ex["mask"], [[1, 1, 1, 1, 0], [1, 0, 1, 1, 1], [1, 1, 1, 1, 0]])
    np.testing.assert_array_equal(ex["segment_ids"], seg[:, :-1])


def test_pack_whole_documents():
    docs = [np.arange(1, 4), np.arange(10, 15), np.arange(20, 22), np.arange(30, 38)]   # 3, 5, 2, 8
    tokens, seg = pack_documents(docs, 6, pad_id=0, split=False)
    np.testing.assert_array_equal(tokens, [[1, 2, 3, 0, 0, 0], [10, 11, 12, 13, 14, 0], [20, 21, 0, 0, 0, 0],
                                           [30, 31, 32, 33, 34, 35], [36, 37, 0, 0, 0, 0]])
    np.testing.assert_array_equal(seg[:, 0], 1)
    assert (seg[tokens == 0] == 0).all() and (seg[tokens != 0] > 0).all()
    # Every input document appears whole and in order.
    np.testing.assert_array_equal(tokens[tokens != 0], np.concatenate(docs))


def test_mqar_matches_zoology_layout():
    rng = np.random.default_rng(0)
    V, T, K = 64, 64, 6
    ex = synthetic.mqar(rng, 200, T, vocab_size=V, num_kv_pairs=K, random_non_queries=False)
    tok, tgt, mask = ex["tokens"], ex["targets"], ex["mask"]
    assert tok.shape == tgt.shape == mask.shape == (200, T)
    keys, values = tok[:, 0:2 * K:2], tok[:, 1:2 * K:2]
    assert ((keys >= 1) & (keys < V // 2)).all() and ((values >= V // 2) & (values < V)).all()
    assert all(len(set(r)) == K for r in keys)                  # distinct keys per example
    assert (mask.sum(1) == K).all() and (mask[:, :2 * K] == 0).all()
    for b in range(200):
        qpos = np.nonzero(mask[b])[0]
        assert ((qpos - 2 * K) % 2 == 0).all()                   # queries at the first token of a slot
        kv = dict(zip(keys[b], values[b]))
        assert [kv[k] for k in tok[b, qpos]] == list(tgt[b, qpos])   # each query's target is its key's value
        rest = np.ones(T, bool)
        rest[qpos] = False
        rest[:2 * K] = False
        assert (tok[b, rest] == 0).all()
    # Power-law gaps: queries cluster right after the context.
    gaps = (np.nonzero(mask)[1] - 2 * K) // 2
    assert np.mean(gaps < (T - 2 * K) // 4) > 0.5
    noisy = synthetic.mqar(np.random.default_rng(0), 4, T, vocab_size=V, num_kv_pairs=K)
    assert (noisy["tokens"][:, 2 * K:] != 0).mean() > 0.9
    with pytest.raises(ValueError, match="seq_len"):
        synthetic.mqar(rng, 1, 16, vocab_size=V, num_kv_pairs=8)


def test_niah_layout():
    rng = np.random.default_rng(1)
    V, T = 64, 48
    ex = synthetic.niah(rng, 100, T, vocab_size=V, num_distractors=2)
    tok, tgt, mask = ex["tokens"], ex["targets"], ex["mask"]
    assert (mask[:, -1] == 1).all() and mask.sum() == 100
    assert (tok[:, -2] == synthetic.NIAH_QUERY).all()
    for b in range(100):
        starts = np.nonzero(tok[b, :-2] == synthetic.NIAH_NEEDLE)[0]
        assert len(starts) == 3
        needles = {tok[b, s + 1]: tok[b, s + 2] for s in starts}
        assert len(needles) == 3 and needles[tok[b, -1]] == tgt[b, -1]
    depth = ex["needle_depth"]
    assert depth.min() < 0.2 and depth.max() > 0.8                # depth covers the haystack


def test_synthetic_source_is_a_function_of_step():
    src = SyntheticSource("mqar", seq_len=32, batch_size=4, seed=3, vocab_size=64, num_kv_pairs=4)
    a, b = src.batch(7), src.batch(7)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    assert not np.array_equal(src.batch(8)["tokens"], a["tokens"])
    ev = list(src.eval_batches(10))
    assert [e["tokens"].shape[0] for e in ev] == [4, 4, 2]
    assert set(a) == {"tokens", "targets", "mask", "segment_ids"}


def test_text_source_epochs_and_holdout():
    works = {f"play{i}": (f"Play {i}. " * (20 + i)).encode() for i in range(5)}
    train, val = split_works(works, ("play3",))
    assert set(val) == {"play3"} and "play3" not in train
    with pytest.raises(ValueError, match="data.val_plays: unknown work 'hamlet'"):
        split_works(works, ("hamlet",))
    src = TextSource(train, val, seq_len=16, batch_size=4, seed=0)
    n = len(src.train_rows)
    seen = np.concatenate([src.batch(s)["tokens"] for s in range(-(-n // 4))])[:n]
    # One epoch visits every row once.
    assert sorted(map(bytes, seen.astype(np.uint16))) == sorted(map(bytes, src.train_rows[:, :-1].astype(np.uint16)))
    np.testing.assert_array_equal(src.batch(2)["tokens"], src.batch(2)["tokens"])
    assert src.data_position(3) == {"rows_consumed": 12, "epoch": 12 // n, "row_in_epoch": 12 % n}
    val_rows = np.concatenate([b["tokens"] for b in src.eval_batches()])
    assert val_rows.shape[0] == len(src.val_rows)
    tok = ByteTokenizer()
    assert tok.decode(val_rows[0]).startswith("Play 3.")


def test_make_source_synthetic():
    # data.source = niah gives needle-in-a-haystack rows: each ends with the query and the needle's key, and its
    # one scored target is the value written after that key
    src = make_source(DataConfig(source="niah", seq_len=32, batch_size=2))
    batch = src.batch(0)
    assert batch["tokens"].shape == (2, 32) and src.vocab_size == 256
    for tokens, targets, mask in zip(batch["tokens"], batch["targets"], batch["mask"]):
        assert tokens[-2] == synthetic.NIAH_QUERY and mask.sum() == 1 and mask[-1] == 1
        needle = [i for i in range(len(tokens) - 2)
                  if tokens[i] == synthetic.NIAH_NEEDLE and tokens[i + 1] == tokens[-1]]
        assert len(needle) == 1 and targets[-1] == tokens[needle[0] + 2]
