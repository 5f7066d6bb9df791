"""A prefix-state cache for hybrid models, after the reference article's account of vLLM's hybrid cache.

Prompts are cut into hash blocks of `hash_block_size` tokens, each hashed with its parent's hash, so a hash names a
whole prefix. Two kinds of entries, one LRU pool under a byte budget:

- attention KV, per physical block of `block_size` tokens, registered when the block is full; a prompt's partial
  last block is registered at its last hash boundary (the "partial tail block");
- linear-layer snapshots (conv + recurrent state of every linear layer), only at chosen boundaries ("align" mode):
  the last block boundary a prefill reaches, the prompt's last hash boundary, and junctions.

Lookup: attention matches block by block from the left; linear layers take the rightmost boundary with a snapshot
inside that match; the hit is where both agree. A junction (Marconi-style): when attention matches further than
the linear layers (a shared prefix that ends mid-prompt), the request exports its linear state at the end of the
attention match in the same prefill pass, so the next request with that prefix hits there. Entries are compared
by tokens, not only by hash. Entries are JAX arrays, never mutated: a request that continues from a snapshot
builds its own state from it.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineattn.decode.loop import prefill_with_snapshots
from lineattn.decode.state import DecodeState, init_state
from lineattn.layers import Attention, KVCache
from lineattn.models.hybrid import check_tokens


# One compile per (prompt remainder length, export positions): eager dispatch of the chunk path costs far more.
_prefill_with_snapshots = nnx.jit(prefill_with_snapshots, static_argnums=3)


def chain_hash(parent: bytes, block_tokens: np.ndarray) -> bytes:
    """The hash of a block given its parent's hash: names the whole prefix up to the block's end."""
    return hashlib.blake2b(parent + np.asarray(block_tokens, np.int64).tobytes(), digest_size=16).digest()


@dataclasses.dataclass(eq=False)
class Entry:
    key: tuple[str, bytes]  # (kind, hash of tokens[:end])
    kind: str  # "kv" or "snapshot"
    begin: int  # first token covered (kv); = end for a snapshot
    end: int  # the boundary: the entry belongs to the prefix tokens[:end]
    prefix: np.ndarray  # tokens[:end], compared on every hit
    payload: tuple  # kv: ((k, v) [n, N_kv, D] per attention layer); snapshot: LinearState [1, ...] per linear layer
    nbytes: int
    refs: int = 0


@dataclasses.dataclass
class PrefillInfo:
    """What one cached prefill did (token counts)."""

    hit: int  # tokens served from the cache
    attention_hit: int  # how far attention KV matched
    linear_hit: int  # the rightmost matching snapshot within it
    junction: int | None  # set when attention matched further than the linear layers
    exported: tuple[int, ...]  # positions whose linear state this prefill exported
    registered: tuple[tuple[str, int, int], ...]  # (kind, begin, end) of new entries


class PrefixCache:
    """Prefix cache for one `HybridLM`, serving one request per `prefill` call (batch 1).

    Args:
      model: the HybridLM.
      block_size: physical block (tokens) of attention KV, and the "align" boundary for snapshots.
      hash_block_size: hashing granularity (divides block_size); finer values let a prompt's tail be cached.
      budget_bytes: the pool's size (>= 0); least-recently-used entries with no reference are evicted to make room,
        and an entry that cannot fit is not registered (a later request just misses).
    """

    def __init__(self, model, *, block_size: int, hash_block_size: int | None = None, budget_bytes: int = 1 << 30):
        hash_block_size = hash_block_size or block_size
        if block_size < 1 or hash_block_size < 1 or block_size % hash_block_size:
            raise ValueError(f"hash_block_size ({hash_block_size}) must divide block_size ({block_size})")
        if budget_bytes < 0:
            raise ValueError(f"budget_bytes must be >= 0, got {budget_bytes}")
        self.model, self.block_size, self.hash_block_size, self.budget_bytes = (model, block_size, hash_block_size,
                                                                                 budget_bytes)
        self.attention_layers = [i for i, b in enumerate(model.blocks) if isinstance(b.mixer, Attention)]
        self.linear_layers = [i for i, b in enumerate(model.blocks) if not isinstance(b.mixer, Attention)]
        self.entries: collections.OrderedDict[tuple[str, bytes], Entry] = collections.OrderedDict()  # LRU first
        self.junctions: list[int] = []
        self.nbytes = 0

    # -- hashing and lookup -------------------------------------------------------------------------------------

    def boundary_hashes(self, tokens: np.ndarray) -> dict[int, bytes]:
        """{end: hash of tokens[:end]} for every hash boundary end <= len(tokens)."""
        hashes, parent, hb = {}, b"", self.hash_block_size
        for end in range(hb, len(tokens) + 1, hb):
            parent = hashes[end] = chain_hash(parent, tokens[end - hb : end])
        return hashes

    def _get(self, kind, hashes, end, tokens):
        entry = self.entries.get((kind, hashes.get(end, b"")))
        if entry is None or entry.end != end or not np.array_equal(entry.prefix, tokens[:end]):
            return None  # absent, or a hash collision: never serve another prefix
        return entry

    def _attention_match(self, tokens, hashes):
        """(matched length, the KV entries covering it, left to right)."""
        if not self.attention_layers:
            return len(tokens), []
        bs, hb, matched, used = self.block_size, self.hash_block_size, 0, []
        while matched + bs <= len(tokens) and (e := self._get("kv", hashes, matched + bs, tokens)):
            matched, used = matched + bs, used + [e]
        for end in range(min(matched + bs - hb, len(tokens) // hb * hb), matched, -hb):  # a partial tail block
            if e := self._get("kv", hashes, end, tokens):
                return end, used + [e]
        return matched, used

    def lookup(self, tokens):
        """(hit, attention_hit, linear_hit, entries used). The hit leaves at least one token to compute."""
        tokens = np.asarray(tokens)
        hashes = self.boundary_hashes(tokens)
        attention_hit, kv_entries = self._attention_match(tokens, hashes)
        limit = min(attention_hit, len(tokens) - 1)
        if not self.linear_layers:
            return limit, attention_hit, 0, kv_entries
        for end in range(limit // self.hash_block_size * self.hash_block_size, 0, -self.hash_block_size):
            if snap := self._get("snapshot", hashes, end, tokens):
                return end, attention_hit, end, kv_entries + [snap]
        return 0, attention_hit, 0, kv_entries

    # -- the pool -----------------------------------------------------------------------------------------------

    def _register(self, kind, key, begin, end, tokens, payload) -> Entry | None:
        """Adds an entry (pinned: refs = 1, the caller releases it), evicting unpinned LRU entries to make room."""
        if (kind, key) in self.entries:
            return None
        nbytes = sum(x.nbytes for x in jax.tree.leaves(payload))
        for k in [k for k, e in self.entries.items() if e.refs == 0]:  # LRU first
            if self.nbytes + nbytes <= self.budget_bytes:
                break
            self.nbytes -= self.entries.pop(k).nbytes
        if self.nbytes + nbytes > self.budget_bytes:
            return None
        entry = Entry((kind, key), kind, begin, end, np.array(tokens[:end]), payload, nbytes, refs=1)
        self.entries[entry.key] = entry
        self.nbytes += nbytes
        return entry

    def _touch(self, entries):
        """Marks entries used, the longest prefix first, so eviction takes a chain's tail before its head."""
        for e in sorted(entries, key=lambda e: e.end, reverse=True):
            if self.entries.get(e.key) is e:
                self.entries.move_to_end(e.key)

    # -- prefill ------------------------------------------------------------------------------------------------

    def _state_from(self, hit, used, max_len) -> DecodeState:
        state = init_state(self.model, 1, max_len)
        if hit == 0:
            return state
        layers = list(state.layers)
        kv_entries = [e for e in used if e.kind == "kv"]
        for j, i in enumerate(self.attention_layers):
            k = jnp.concatenate([e.payload[j][0] for e in kv_entries])[:hit]
            v = jnp.concatenate([e.payload[j][1] for e in kv_entries])[:hit]
            cache = layers[i]
            layers[i] = KVCache(cache.k.at[0, :hit].set(k), cache.v.at[0, :hit].set(v))
        snap = next((e for e in used if e.kind == "snapshot"), None)
        for j, i in enumerate(self.linear_layers):
            layers[i] = snap.payload[j]
        return DecodeState(tuple(layers), jnp.asarray(hit, jnp.int32), state.start)

    def prefill(self, tokens, max_len: int):
        """Prefills one prompt (tokens [T] int ids in [0, vocab_size), 1 <= T <= max_len) through the cache.

        Returns (logits [T - hit, vocab] for the tokens computed, DecodeState for decoding on, PrefillInfo).
        """
        tokens = np.asarray(tokens)
        T = len(tokens) if tokens.ndim else 0
        if tokens.ndim != 1 or not np.issubdtype(tokens.dtype, np.integer) or T < 1 or max_len < T:
            raise ValueError(f"tokens must be an integer array [T] with 1 <= T <= max_len ({max_len}), got "
                             f"{tokens.dtype} {tokens.shape}")
        check_tokens(tokens[None], self.model.cfg.vocab_size)  # before anything is looked up or registered
        hit, attention_hit, linear_hit, used = self.lookup(tokens)
        for e in used:
            e.refs += 1
        new = []
        try:
            state = self._state_from(hit, used, max_len)
            bs, hb = self.block_size, self.hash_block_size
            junction = attention_hit if self.linear_layers and self.attention_layers and attention_hit > hit else None
            if junction is not None:
                self.junctions.append(junction)
            exports = {T // bs * bs, T // hb * hb} | ({junction} if junction else set())
            exports = tuple(sorted(p for p in exports if hit < p <= T)) if self.linear_layers else ()
            logits, state, snapshots = _prefill_with_snapshots(self.model, jnp.asarray(tokens[hit:])[None], state,
                                                               tuple(p - hit for p in exports))
            new = self._register_prefill(tokens, state, snapshots, exports)
        finally:
            for e in used + new:
                e.refs -= 1
        self._touch(used + new)
        registered = tuple((e.kind, e.begin, e.end) for e in new)
        return logits[0], state, PrefillInfo(hit, attention_hit, linear_hit, junction, exports, registered)

    def _register_prefill(self, tokens, state, snapshots, exports) -> list[Entry]:
        T, bs, hb = len(tokens), self.block_size, self.hash_block_size
        hashes = self.boundary_hashes(tokens)
        registered = []
        if self.attention_layers:
            ends = list(range(bs, T + 1, bs))
            if T % bs >= hb:
                ends.append(T // hb * hb)  # the partial tail block, at its last hash boundary
            for end in ends:
                begin = (end - 1) // bs * bs
                payload = tuple((state.layers[i].k[0, begin:end], state.layers[i].v[0, begin:end])
                                for i in self.attention_layers)
                if entry := self._register("kv", hashes[end], begin, end, tokens, payload):
                    registered.append(entry)
        for n, p in enumerate(exports):
            if p % hb:
                continue  # only hash boundaries can be looked up
            payload = tuple(jax.tree.map(lambda x: x[n], snapshots[i]) for i in self.linear_layers)
            if entry := self._register("snapshot", hashes[p], p, p, tokens, payload):
                registered.append(entry)
        return registered
