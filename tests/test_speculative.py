"""Speculative decoding: greedy equals the target for every acceptance pattern, rollback equals token-by-token
decoding, and sampling reproduces the target's distribution."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from lineattn import decode
from lineattn.decode import speculative as spec
from lineattn.layers import KVCache
from lineattn.models import HybridLM
from test_models import tiny, tokens


def perturbed(model, seed, std):
    """A copy with noise on every parameter: random-init models are nearly input-independent, and noise gives
    them varied greedy continuations (and a draft that agrees with the target only sometimes)."""
    graph, params = nnx.split(model)
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return nnx.merge(graph, jax.tree.unflatten(tree, [x + std * jax.random.normal(k, x.shape)
                                                      for x, k in zip(leaves, keys)]))


TARGET = perturbed(HybridLM(tiny(["kda", "attention", "gdn"]), rngs=nnx.Rngs(0)), 0, 0.3)
N = 3  # drafts per round

# Jitted: one compile per shape (eager, every op of the chunk path and the verify block is compiled on its own).
forward = nnx.jit(lambda model, x: model(x))
prefill = nnx.jit(decode.prefill)
step = nnx.jit(decode.step)
verify = nnx.jit(spec.verify)
judge = jax.jit(spec.judge, static_argnames="temperature")


def one_request_state(model, prompt, max_len):
    _, state = prefill(model, prompt, decode.init_state(model, 1, max_len))
    return state


@pytest.mark.parametrize("accepted", range(N + 1))
def test_every_acceptance_pattern_emits_the_greedy_tokens_and_rolls_back(accepted):
    prompt = tokens(1, 10)
    greedy = decode.generate(TARGET, prompt, N + 2, temperature=0)[0, 10:]
    x0, truth = greedy[0], greedy[1:]
    # Drafts agree with the target's greedy tokens for `accepted` positions, then go wrong.
    drafts = jnp.where(jnp.arange(N) < accepted, truth[:N], (truth[:N] + 1) % 64)
    state = one_request_state(TARGET, prompt, 20)
    logits, after = verify(TARGET, jnp.concatenate([x0[None], drafts])[None], spec.enter(state))
    a, nxt = judge(logits[0], drafts, None, None, temperature=0)
    assert int(a) == accepted
    assert int(nxt) == int(truth[accepted])  # the correction (or bonus) token is the greedy one
    # Rollback by index equals decoding the accepted inputs one at a time.
    rolled = spec.current(spec.accept(after, a))
    for token in [x0, *drafts[:accepted]]:
        _, state = step(TARGET, token[None], state)
    assert int(rolled.slot) == int(state.slot) == 10 + accepted + 1
    for mine, ref in zip(rolled.layers, state.layers):
        if isinstance(ref, KVCache):  # slots past the accepted tokens hold rejected keys, masked until rewritten
            ref, mine = jax.tree.map(lambda x: x[:, : 10 + accepted + 1], (ref, mine))
        for x, y in zip(jax.tree.leaves(mine), jax.tree.leaves(ref)):
            assert rel_err(x, y) <= 1e-5


def test_padded_entry_state_is_the_plain_state():
    # speculative_generate's loop carries a pool of n + 1 states from the start: entering pads it, and the state
    # it selects is still exactly the prefill's.
    state = one_request_state(TARGET, tokens(1, 10), 20)
    entered = spec.enter(state, num_draft=N)
    assert all(x.pool.shape[1] == N + 1 for x in entered.layers if not isinstance(x, KVCache))
    for x, y in zip(jax.tree.leaves(spec.current(entered)), jax.tree.leaves(state)):
        np.testing.assert_array_equal(x, y)


def test_greedy_speculative_generate_equals_target_greedy():
    draft = perturbed(TARGET, 1, 0.05)  # agrees often, not always
    prompts = tokens(2, 12, seed=3)
    out, stats = spec.speculative_generate(TARGET, draft, prompts, 16, num_draft=N)
    np.testing.assert_array_equal(out, decode.generate(TARGET, prompts, 16, temperature=0)[:, 12:])
    assert 0 < stats["acceptance_rate"] < 1


def test_sampled_tokens_follow_the_target_distribution():
    # Vocabulary of 4: the first token a round emits (accepted draft or correction) must be distributed as the
    # target's next-token distribution, whatever the draft proposes.
    cfg = dict(vocab_size=4, width=16, num_heads=2)
    target = perturbed(HybridLM(tiny(["kda", "attention"], **cfg), rngs=nnx.Rngs(0)), 0, 0.5)
    draft = perturbed(HybridLM(tiny(["gdn"], **cfg), rngs=nnx.Rngs(1)), 1, 0.5)
    prompt, x0 = jnp.array([[1, 2, 3, 0, 1]]), jnp.array(2)
    t_state, d_state = one_request_state(target, prompt, 12), one_request_state(draft, prompt, 12)
    with_x0 = jnp.concatenate([prompt, x0[None, None]], axis=1)
    p = jax.nn.softmax(forward(target, with_x0)[0, -1] / 0.9)
    n = 6000
    run = jax.jit(jax.vmap(lambda key: spec.spec_round(target, draft, spec.enter(t_state), spec.enter(d_state), x0,
                                                       key, num_draft=2, temperature=0.9)[:2]))
    emitted, a = run(jax.random.split(jax.random.key(0), n))
    freq = np.bincount(np.asarray(emitted[:, 0]), minlength=4) / n
    np.testing.assert_allclose(freq, p, atol=4 * np.sqrt(0.25 / n))
    assert 0 < float(jnp.mean(a)) < 2  # drafts were both accepted and rejected


def test_bad_arguments():
    with pytest.raises(ValueError, match="vocab_size"):
        spec.speculative_generate(TARGET, HybridLM(tiny(["kda"], vocab_size=32), rngs=nnx.Rngs(0)), tokens(1, 4), 4)
    with pytest.raises(ValueError, match="num_draft"):
        spec.speculative_generate(TARGET, TARGET, tokens(1, 4), 4, num_draft=0)


@pytest.mark.parametrize("kwargs", [dict(temperature=-1.0), dict(temperature=float("nan")), dict(top_k=0),
                                    dict(top_p=0.0), dict(num_draft=2.5), dict(max_new_tokens=0)],
                         ids=lambda kw: "{}={}".format(*next(iter(kw.items()))))
def test_bad_sampling_and_count_arguments(kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        spec.speculative_generate(TARGET, TARGET, tokens(1, 4), **{"max_new_tokens": 4, **kwargs})


@pytest.mark.parametrize("bad_id", [64, -1])
def test_out_of_range_prompt_ids_raise(bad_id):
    with pytest.raises(ValueError, match="prompts"):
        spec.speculative_generate(TARGET, TARGET, tokens(1, 4).at[0, 2].set(bad_id), 4)


def test_accepted_must_be_in_0_to_num_draft():
    entered = spec.enter(one_request_state(TARGET, tokens(1, 10), 20), num_draft=N)
    for bad in (N + 1, -1, 1.5):
        with pytest.raises(ValueError, match="accepted"):
            spec.accept(entered, bad)
    assert int(spec.accept(entered, N).accepted) == N
    with pytest.raises(ValueError, match="state"):
        spec.enter(decode.init_state(TARGET, 2, 8))  # one request only
