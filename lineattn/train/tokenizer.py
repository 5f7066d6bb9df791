"""Byte-level tokenizer: ids 0-255 are the bytes of UTF-8 text, then a few specials."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255; `pad` = 256, `bos` = 257, `eos` = 258; `vocab_size` = 259."""

    num_bytes = 256
    pad_id = 256
    bos_id = 257
    eos_id = 258
    vocab_size = 259
    specials = {"<pad>": pad_id, "<bos>": bos_id, "<eos>": eos_id}

    def encode(self, text: str | bytes, *, bos: bool = False, eos: bool = False) -> np.ndarray:
        """int32 [n] ids of the text's UTF-8 bytes, with bos before and eos after when asked."""
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        ids = np.frombuffer(data, dtype=np.uint8).astype(np.int32)
        parts = ([np.array([self.bos_id], np.int32)] if bos else []) + [ids] + \
                ([np.array([self.eos_id], np.int32)] if eos else [])
        return np.concatenate(parts) if len(parts) > 1 else ids

    def decode(self, ids: Iterable[int], *, stop_at_eos: bool = True) -> str:
        """Bytes back to text (invalid UTF-8 is replaced); specials are dropped, and text ends at the first eos."""
        out = bytearray()
        for i in np.asarray(list(ids) if not isinstance(ids, np.ndarray) else ids).reshape(-1).tolist():
            if i == self.eos_id and stop_at_eos:
                break
            if 0 <= i < self.num_bytes:
                out.append(i)
        return out.decode("utf-8", errors="replace")
