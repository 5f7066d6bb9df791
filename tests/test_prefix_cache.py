"""Prefix-state cache: the reference article's A/B/C example, cache hits equal cold prefills, eviction, collisions."""

from __future__ import annotations

import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from lineattn import decode
from lineattn.decode import prefix_cache as pc
from lineattn.decode.prefix_cache import PrefixCache
from lineattn.models import HybridLM
from test_models import tiny

MODEL = HybridLM(tiny(["kda", "attention"]), rngs=nnx.Rngs(0))
# The cold references, jitted: one compile per prompt length (eager, every op of the chunk path compiled on its own).
prefill = nnx.jit(decode.prefill)


def prompts(seed=0):
    """The article's example: A has 2000 tokens; B and C share A's first 1300, then differ."""
    rng = np.random.default_rng(seed)
    A = rng.integers(0, 64, 2000)
    B = np.concatenate([A[:1300], rng.integers(0, 64, 700)])
    C = np.concatenate([A[:1300], rng.integers(0, 64, 500)])
    return A, B, C


def cold_logits(tokens):
    logits, _ = prefill(MODEL, np.asarray(tokens)[None], decode.init_state(MODEL, 1, len(tokens)))
    return logits[0]


def test_article_example_block_640():
    A, B, C = prompts()
    cache = PrefixCache(MODEL, block_size=640)
    _, _, a = cache.prefill(A, max_len=2000)
    # Align mode: one pass over [0, 2000) exports S only at the last block boundary, 1920; attention keeps 3 blocks.
    assert (a.hit, a.exported) == (0, (1920,))
    assert [r for r in a.registered if r[0] == "kv"] == [("kv", 0, 640), ("kv", 640, 1280), ("kv", 1280, 1920)]
    logits_b, _, b = cache.prefill(B, max_len=2000)
    # Attention matches 1280 but no snapshot lies inside it: B hits 0 and records the junction at 1280.
    assert (b.attention_hit, b.linear_hit, b.hit, b.junction) == (1280, 0, 0, 1280)
    assert 1280 in b.exported and ("snapshot", 1280, 1280) in b.registered
    logits_c, state_c, c = cache.prefill(C, max_len=1800)
    assert (c.hit, c.junction) == (1280, None)
    # A hit then the remainder gives the cold prefill's logits and state.
    cold_logits_c, cold_state = prefill(MODEL, C[None], decode.init_state(MODEL, 1, 1800))
    assert rel_err(logits_c, cold_logits_c[0][1280:]) <= 1e-4
    assert rel_err(state_c.layers[0].recurrent, cold_state.layers[0].recurrent) <= 1e-4
    assert rel_err(logits_b, cold_logits(B)) <= 1e-4


def test_article_example_hash_block_64_caches_the_tail():
    A, _, _ = prompts()
    cache = PrefixCache(MODEL, block_size=640, hash_block_size=64)
    _, _, a = cache.prefill(A, max_len=2000)
    assert a.exported == (1920, 1984)  # 1984 = 31 x 64: the partial tail block
    assert ("kv", 1920, 1984) in a.registered and ("snapshot", 1984, 1984) in a.registered
    follow_up = np.concatenate([A, np.arange(40) % 64])  # the next turn of the conversation
    logits, _, info = cache.prefill(follow_up, max_len=2040)
    assert info.hit == 1984
    assert rel_err(logits, cold_logits(follow_up)[1984:]) <= 1e-4


def test_eviction_under_a_tight_budget_keeps_hits_exact():
    A, B, C = prompts(seed=1)
    A, B, C = A[:700], B[:700], C[:650]  # same shape of example, smaller: block 128, shared 1300 -> 300 tokens
    B[300:] = (B[300:] + 1) % 64
    C[300:] = (C[300:] + 2) % 64
    block = PrefixCache(MODEL, block_size=128)
    _, _, a = block.prefill(A, max_len=700)
    budget = block.nbytes // 2  # room for about half of A's entries
    cache = PrefixCache(MODEL, block_size=128, budget_bytes=budget)
    hits = []
    for tokens in (A, B, C, A, C):
        logits, _, info = cache.prefill(tokens, max_len=700)
        assert cache.nbytes <= budget
        assert rel_err(logits, cold_logits(tokens)[info.hit:]) <= 1e-4
        hits.append(info.hit)
    assert max(hits) > 0  # something was still served


def test_a_hash_collision_is_never_served(monkeypatch):
    monkeypatch.setattr(pc, "chain_hash", lambda parent, block: b"same")  # every prefix collides
    A, B, _ = prompts(seed=2)
    B[:64] = (B[:64] + 1) % 64  # differs from A in the first block
    cache = PrefixCache(MODEL, block_size=64)
    cache.prefill(A[:300], max_len=300)
    logits, _, info = cache.prefill(B[:300], max_len=300)
    assert info.hit == 0 and info.attention_hit == 0
    assert rel_err(logits, cold_logits(B[:300])) <= 1e-4


def test_bad_arguments():
    with pytest.raises(ValueError, match="must divide block_size"):
        PrefixCache(MODEL, block_size=640, hash_block_size=100)
    with pytest.raises(ValueError, match="tokens must be"):
        PrefixCache(MODEL, block_size=64).prefill(np.zeros((2, 3), int), max_len=8)
    with pytest.raises(ValueError, match="budget_bytes"):
        PrefixCache(MODEL, block_size=64, budget_bytes=-1)


@pytest.mark.parametrize("tokens", [[1, 2, 3, 4, 64], [1, 2, 3, 4, -1], [1.7, 2, 3, 4, 5]])
def test_bad_token_ids_raise_before_anything_is_cached(tokens):
    cache = PrefixCache(MODEL, block_size=4)
    with pytest.raises(ValueError, match="tokens"):
        cache.prefill(np.array(tokens), max_len=8)
    assert not cache.entries and cache.nbytes == 0
