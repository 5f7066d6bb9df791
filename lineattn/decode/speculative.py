"""Speculative decoding with state rollback by index selection (the reference article's scheme, in JAX).

A verify step runs the target over [x0, d1 .. dn] (x0: the last sampled token, d: the draft's proposals) and keeps
every linear layer's recurrent state after *each* input in a pool of n + 1 slots, and its conv inputs in a window
widened to W - 1 + n + 1 rows. Once a drafts are accepted, the next step starts from the state after a + 1 inputs:
`pool[a]` by index and the conv state at offset a + 1 of the window; rejected states are never copied, only left
behind. Attention layers need no rollback: their KV slots past the accepted tokens are masked and then overwritten.

Everything here works on one request (arrays keep a batch axis of 1); `speculative_generate` vmaps over requests,
since requests accept different numbers of tokens and so sit at different cache slots.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineattn.decode.loop import check_prompts, check_sampling, prefill, prefill_with_snapshots, sample, step
from lineattn.decode.state import DecodeState, init_state
from lineattn.layers import KVCache, LinearState
from lineattn.checks import check_int, is_concrete


class SpecLinearState(NamedTuple):
    """window [1, W - 1 + n + 1, C]: the conv state before the verify inputs, then the inputs (pre-conv).
    pool [1, n + 1, H, K, V]: the recurrent state after each verify input."""

    window: jax.Array
    pool: jax.Array


class SpecState(NamedTuple):
    """One request after a verify step. The state to continue from is the one after `accepted + 1` inputs."""

    layers: tuple  # SpecLinearState | KVCache per block
    base_slot: jax.Array  # [] cache slot of the first verify input
    start: jax.Array  # [1]
    accepted: jax.Array  # [] int32: accepted drafts a (0 .. n)


def enter(state: DecodeState, num_draft: int = 0) -> SpecState:
    """A plain one-request state as a SpecState (as if one input had been verified and accepted with a = 0).
    With num_draft = n the pool and window are padded to the shapes a verify of n + 1 inputs gives (a loop carry)."""
    if tuple(state.start.shape) != (1,):
        raise ValueError(f"state must hold one request (batch 1), got state.start {tuple(state.start.shape)}")
    layers = []
    for layer in state.layers:
        if isinstance(layer, KVCache):
            layers.append(layer)
        else:
            conv, pad = layer.conv, lambda x: jnp.pad(x, [(0, 0), (0, num_draft)] + [(0, 0)] * (x.ndim - 2))
            window = None if conv is None else pad(jnp.concatenate([jnp.zeros_like(conv[:, :1]), conv], axis=1))
            layers.append(SpecLinearState(window, pad(layer.recurrent[:, None])))
    return SpecState(tuple(layers), state.slot - 1, state.start, jnp.zeros((), jnp.int32))


def current(spec: SpecState) -> DecodeState:
    """The state after `accepted + 1` verify inputs, selected by index (no state is copied back to a home slot)."""
    a = spec.accepted
    layers = []
    for layer in spec.layers:
        if isinstance(layer, KVCache):
            layers.append(layer)
            continue
        conv = None
        if layer.window is not None:
            W1 = layer.window.shape[1] - layer.pool.shape[1]
            conv = jax.lax.dynamic_slice_in_dim(layer.window, a + 1, W1, axis=1)
        layers.append(LinearState(conv, jnp.take(layer.pool, a, axis=1)))
    return DecodeState(tuple(layers), spec.base_slot + a + 1, spec.start)


def verify(model, tokens_1N, spec: SpecState):
    """Runs inputs [1, n + 1] from the current state, keeping the state after each. Returns (logits [1, n + 1, V],
    a SpecState whose `accepted` is still to be set with `accept`)."""
    state = current(spec)
    N = tokens_1N.shape[1]
    logits, new, snapshots = prefill_with_snapshots(model, tokens_1N, state, range(1, N + 1))
    layers = []
    for old, layer, snap in zip(state.layers, new.layers, snapshots, strict=True):
        if isinstance(layer, KVCache):
            layers.append(layer)
            continue
        window = None
        if old.conv is not None:  # snapshot p's last row is input p - 1
            window = jnp.concatenate([old.conv, jnp.moveaxis(snap.conv[:, :, -1], 0, 1)], axis=1)
        layers.append(SpecLinearState(window, jnp.moveaxis(snap.recurrent, 0, 1)))
    return logits, SpecState(tuple(layers), state.slot, state.start, jnp.asarray(N - 1, jnp.int32))


def accept(spec: SpecState, accepted) -> SpecState:
    """Sets the accepted drafts a: an int in [0, n] after a verify of n + 1 inputs (checked when concrete; n is
    read from the linear layers' pools, so an attention-only model checks only a >= 0)."""
    if is_concrete(accepted):
        a = np.asarray(accepted)
        n = next((x.pool.shape[1] - 1 for x in spec.layers if isinstance(x, SpecLinearState)), None)
        if a.ndim or not np.issubdtype(a.dtype, np.integer) or a < 0 or (n is not None and a > n):
            raise ValueError(f"accepted must be an int in [0, num_draft{'' if n is None else f' = {n}'}], "
                             f"got {accepted!r}")
    return spec._replace(accepted=jnp.asarray(accepted, jnp.int32))


def _probs(logits, temperature, top_k, top_p):
    """The distribution `sample` draws from, as probabilities [.., V]."""
    logits = logits / temperature
    if top_k is not None:
        logits = jnp.where(logits < jax.lax.top_k(logits, top_k)[0][..., -1:], -jnp.inf, logits)
    if top_p is not None:
        sorted_desc = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        keep = jnp.min(jnp.where(jnp.cumsum(probs, -1) - probs < top_p, sorted_desc, jnp.inf), -1, keepdims=True)
        logits = jnp.where(logits < keep, -jnp.inf, logits)
    return jax.nn.softmax(logits, axis=-1)


def judge(target_logits_NV, drafts_n, draft_probs_nV, key, *, temperature, top_k=None, top_p=None):
    """Acceptance of drafts d1..dn against the target's logits at [x0, d1 .. dn].

    Greedy (temperature 0): d_i is accepted while it equals the target's argmax; the next token is the argmax.
    Sampled: standard speculative sampling: accept d_i with probability min(1, p(d_i) / q(d_i)); at the first
    rejection draw from max(0, p - q) renormalised; if all pass, draw from the target's last distribution. The
    emitted tokens are then distributed exactly as the target's.
    Returns (accepted a, next token: the correction or bonus token).
    """
    n = drafts_n.shape[0]
    idx = jnp.arange(n)
    if temperature == 0:
        ok = drafts_n == jnp.argmax(target_logits_NV[:n], axis=-1)
    else:
        p = _probs(target_logits_NV, temperature, top_k, top_p)
        p_d, q_d = p[idx, drafts_n], draft_probs_nV[idx, drafts_n]
        key, sub = jax.random.split(key)
        ok = jax.random.uniform(sub, (n,)) * q_d < p_d
    a = jnp.argmin(jnp.concatenate([ok, jnp.zeros((1,), bool)]))  # leading accepted drafts
    if temperature == 0:
        return a, jnp.argmax(target_logits_NV[a]).astype(jnp.int32)
    residual = jnp.where(a < n, jnp.maximum(p[a] - draft_probs_nV[jnp.minimum(a, n - 1)], 0.0), p[a])
    token = jax.random.categorical(key, jnp.log(residual))
    return a, token.astype(jnp.int32)


def spec_round(target, draft, t_spec, d_spec, x0, key, *, num_draft, temperature, top_k=None, top_p=None):
    """One round for one request: n draft steps, one target verify, acceptance, rollback of both models.
    Returns (tokens [n + 1] (the first a + 1 are emitted), a, next x0, t_spec, d_spec)."""
    keys = jax.random.split(key, num_draft + 1)

    def draft_step(carry, k):
        tok, state = carry
        logits, state = step(draft, tok[None], state)
        if temperature == 0:
            d, q = jnp.argmax(logits[0]).astype(jnp.int32), jax.nn.one_hot(jnp.argmax(logits[0]), logits.shape[-1])
        else:
            d = sample(logits, k, temperature=temperature, top_k=top_k, top_p=top_p)[0]
            q = _probs(logits[0], temperature, top_k, top_p)
        return (d, state), (d, q)

    _, (drafts, q) = jax.lax.scan(draft_step, (x0, current(d_spec)), keys[:num_draft])
    inputs = jnp.concatenate([x0[None], drafts])[None]
    t_logits, t_spec = verify(target, inputs, t_spec)
    a, nxt = judge(t_logits[0], drafts, q, keys[-1], temperature=temperature, top_k=top_k, top_p=top_p)
    _, d_spec = verify(draft, inputs, d_spec)
    emitted = jnp.where(jnp.arange(num_draft + 1) < a, jnp.concatenate([drafts, drafts[-1:]]), nxt)
    return emitted, a, nxt, accept(t_spec, a), accept(d_spec, a)


@functools.partial(jax.jit, static_argnames=("t_graph", "d_graph", "max_new_tokens", "num_draft", "temperature",
                                             "top_k", "top_p"))
def _generate_loop(t_graph, t_params, d_graph, d_params, t_spec, d_spec, x0, rng, *, max_new_tokens, num_draft,
                   temperature, top_k, top_p):
    """Rounds until every request has max_new_tokens tokens, in one `lax.while_loop` (no host round trip a round).

    Requests advance by a + 1 tokens a round, each at its own position `pos [B]` in `out [B, max_new + n + 1]`;
    a finished request keeps running with the others (its tokens and statistics are no longer recorded)."""
    B, n = x0.shape[0], num_draft

    def one(t_spec, d_spec, x0, key):
        target, draft = nnx.merge(t_graph, t_params), nnx.merge(d_graph, d_params)
        return spec_round(target, draft, t_spec, d_spec, x0, key, num_draft=n, temperature=temperature,
                          top_k=top_k, top_p=top_p)

    def body(carry):
        t_spec, d_spec, x0, out, pos, rng, rounds, proposed, accepted = carry
        rng, key = jax.random.split(rng)
        emitted, a, x0, t_spec, d_spec = jax.vmap(one)(t_spec, d_spec, x0, jax.random.split(key, B))
        active = pos < max_new_tokens
        written = jax.vmap(lambda row, e, p: jax.lax.dynamic_update_slice(row, e, (p,)))(out, emitted, pos)
        out = jnp.where(active[:, None], written, out)  # emitted[a + 1:] is overwritten by the next round
        pos = pos + jnp.where(active, a + 1, 0)
        proposed = proposed + n * active.sum()
        accepted = accepted + jnp.where(active, a, 0).sum()
        return t_spec, d_spec, x0, out, pos, rng, rounds + 1, proposed, accepted

    out = jnp.zeros((B, max_new_tokens + n + 1), jnp.int32).at[:, 0].set(x0)
    zero = jnp.zeros((), jnp.int32)
    carry = (t_spec, d_spec, x0, out, jnp.ones((B,), jnp.int32), rng, zero, zero, zero)
    carry = jax.lax.while_loop(lambda c: jnp.min(c[4]) < max_new_tokens, body, carry)
    _, _, _, out, _, _, rounds, proposed, accepted = carry
    return out[:, :max_new_tokens], rounds, proposed, accepted


_prefill = nnx.jit(prefill)


def _per_request(state: DecodeState, num_draft: int) -> SpecState:
    """[B, ...] state with a shared slot -> a SpecState with a leading request axis (batch 1 inside)."""
    B = state.start.shape[0]
    split = lambda x: x[:, None]
    layers = tuple(jax.tree.map(split, layer) for layer in state.layers)
    per = DecodeState(layers, jnp.broadcast_to(state.slot, (B,)), state.start[:, None])
    return jax.vmap(functools.partial(enter, num_draft=num_draft))(per)


def speculative_generate(target, draft, prompts, max_new_tokens: int, *, num_draft: int = 4,
                         temperature: float = 0.0, top_k=None, top_p=None, rng=None):
    """Generates with a draft model proposing `num_draft` tokens per round and the target verifying them.

    prompts [B, T0] int ids in [0, vocab_size) (one length for all); num_draft and max_new_tokens ints >= 1;
    temperature, top_k, top_p as for `sample`. Greedy at temperature 0: exactly the target's greedy tokens.
    Returns (tokens [B, max_new_tokens], stats {"rounds", "proposed", "accepted", "acceptance_rate"}).
    """
    if target.cfg.vocab_size != draft.cfg.vocab_size:
        raise ValueError(f"draft vocab_size {draft.cfg.vocab_size} != target vocab_size {target.cfg.vocab_size}")
    prompts = check_prompts(prompts, target.cfg.vocab_size)
    check_int("num_draft", num_draft)
    check_int("max_new_tokens", max_new_tokens)
    check_sampling(temperature, top_k, top_p, target.cfg.vocab_size)
    num_draft, max_new_tokens = int(num_draft), int(max_new_tokens)
    B, T0 = prompts.shape
    max_len = T0 + max_new_tokens + num_draft + 1
    rng = jax.random.key(0) if rng is None else rng
    t_logits, t_state = _prefill(target, prompts, init_state(target, B, max_len))
    _, d_state = _prefill(draft, prompts, init_state(draft, B, max_len))
    rng, key = jax.random.split(rng)
    x0 = sample(t_logits[:, -1], key, temperature=temperature, top_k=top_k, top_p=top_p)
    # x0 is the first generated token; it enters both models at the start of the first round.
    t_spec, d_spec = _per_request(t_state, num_draft), _per_request(d_state, num_draft)
    t_graph, t_params = nnx.split(target)
    d_graph, d_params = nnx.split(draft)
    tokens, rounds, proposed, accepted = _generate_loop(
        t_graph, t_params, d_graph, d_params, t_spec, d_spec, x0.astype(jnp.int32), rng,
        max_new_tokens=max_new_tokens, num_draft=num_draft, temperature=float(temperature), top_k=top_k, top_p=top_p)
    rounds, proposed, accepted = int(rounds), int(proposed), int(accepted)
    stats = dict(rounds=rounds, proposed=proposed, accepted=accepted, acceptance_rate=accepted / max(proposed, 1))
    return tokens, stats
