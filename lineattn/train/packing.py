"""Packing documents into fixed-length rows, with segment ids marking the document boundaries.

Segment ids count documents within a row from 1; 0 marks padding. A row of `seq_len + 1` tokens gives the model
`seq_len` inputs and `seq_len` next-token targets (`row_to_example`); a target is scored only where it belongs to
the same document as its input, so nothing is predicted across a boundary or into padding.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def pack_documents(docs: Sequence[np.ndarray], row_len: int, *, pad_id: int,
                   split: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """Pack token arrays into rows of `row_len`; returns `(tokens [N, row_len], segment_ids [N, row_len])`.

    split=True: concatenate the documents and cut the stream into rows (a document may run on into the next row,
    where it starts a new segment); only the last row is padded.
    split=False: rows hold whole documents, filled greedily in order (a document longer than a row is cut into
    row-sized pieces first); the rest of each row is padding.
    """
    if row_len < 1:
        raise ValueError(f"row_len must be >= 1, got {row_len}")
    docs = [np.asarray(d, np.int32).reshape(-1) for d in docs]
    docs = [d for d in docs if d.size]
    if not docs:
        return np.zeros((0, row_len), np.int32), np.zeros((0, row_len), np.int32)
    if split:
        stream = np.concatenate(docs)
        doc_index = np.repeat(np.arange(len(docs)), [d.size for d in docs])
        n = -(-stream.size // row_len)
        pad = n * row_len - stream.size
        tokens = np.concatenate([stream, np.full(pad, pad_id, np.int32)]).reshape(n, row_len)
        idx = np.concatenate([doc_index, np.full(pad, -1)]).reshape(n, row_len)
        # Segment ids: 1 + number of document starts seen so far within the row.
        starts = np.zeros_like(idx, dtype=bool)
        starts[:, 1:] = idx[:, 1:] != idx[:, :-1]
        seg = 1 + np.cumsum(starts, axis=1)
        seg = np.where(idx < 0, 0, seg).astype(np.int32)
        return tokens, seg
    pieces = [d[i:i + row_len] for d in docs for i in range(0, d.size, row_len)]
    rows_t, rows_s = [], []
    cur_t, cur_s, used = [], [], 0
    for piece in pieces:
        if used + piece.size > row_len:
            rows_t.append(cur_t), rows_s.append(cur_s)
            cur_t, cur_s, used = [], [], 0
        cur_t.append(piece)
        cur_s.append(np.full(piece.size, len(cur_s) + 1, np.int32))
        used += piece.size
    rows_t.append(cur_t), rows_s.append(cur_s)
    tokens = np.full((len(rows_t), row_len), pad_id, np.int32)
    seg = np.zeros((len(rows_t), row_len), np.int32)
    for r, (ts, ss) in enumerate(zip(rows_t, rows_s)):
        t, s = np.concatenate(ts), np.concatenate(ss)
        tokens[r, :t.size], seg[r, :s.size] = t, s
    return tokens, seg


def rows_to_examples(tokens: np.ndarray, segment_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of `T + 1` -> `tokens`, `targets`, `segment_ids` `[N, T]` int32 and `mask` `[N, T]` float32."""
    seg_in, seg_out = segment_ids[:, :-1], segment_ids[:, 1:]
    return {
        "tokens": np.ascontiguousarray(tokens[:, :-1], np.int32),
        "targets": np.ascontiguousarray(tokens[:, 1:], np.int32),
        "segment_ids": np.ascontiguousarray(seg_in, np.int32),
        "mask": ((seg_in == seg_out) & (seg_out > 0)).astype(np.float32),
    }
