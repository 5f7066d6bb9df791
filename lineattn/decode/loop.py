"""Prefill, one-token steps and a jitted generation loop over an explicit `DecodeState`."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from lineattn.decode.state import DecodeState, init_state


def prefill(model, tokens_BT, state: DecodeState, *, lengths=None):
    """Runs a block of tokens through the chunk path, continuing from `state`.

    tokens [B, T] int. lengths [B] (optional) starts new requests: row b's prompt is its last lengths[b] tokens,
    the rest is left padding that no later token sees. Without it, every token continues its request (splitting a
    prompt across prefill calls gives the same result as one call).
    Returns (logits [B, T, vocab] fp32, new state).
    """
    B, T = tokens_BT.shape
    segment_ids, start = None, state.start
    if lengths is not None:
        lengths = jnp.asarray(lengths, jnp.int32)
        if lengths.shape != (B,):
            raise ValueError(f"lengths must be [B] = [{B}], got {tuple(lengths.shape)}")
        first = T - lengths
        segment_ids = (jnp.arange(T)[None, :] >= first[:, None]).astype(jnp.int32)
        start = state.slot + first
    logits, layers, _ = model.forward_cached(tokens_BT, state.layers, slot=state.slot, start=start,
                                             segment_ids=segment_ids)
    return logits, DecodeState(layers, state.slot + T, start)


def prefill_with_snapshots(model, tokens_BT, state: DecodeState, checkpoints):
    """`prefill` that also returns each linear layer's state after each of `checkpoints` tokens of this call
    (concrete ints in [0, T]; one pass, positions need not be chunk-aligned).

    Returns (logits, new state, snapshots): snapshots[i] is a `LinearState` with a leading [P] axis for linear
    block i, None for attention blocks (their KV cache holds every slot).
    """
    T = tokens_BT.shape[1]
    checkpoints = tuple(int(p) for p in checkpoints)
    if any(not 0 <= p <= T for p in checkpoints):
        raise ValueError(f"checkpoints must be token counts in [0, {T}], got {checkpoints}")
    logits, layers, snapshots = model.forward_cached(tokens_BT, state.layers, slot=state.slot, start=state.start,
                                                     checkpoints=checkpoints)
    return logits, DecodeState(layers, state.slot + T, state.start), snapshots


def step(model, token_B, state: DecodeState):
    """One token per request: a recurrent update per linear layer, one KV-cache read per attention layer.

    token [B] int -> (logits [B, vocab] fp32, new state).
    """
    if token_B.ndim != 1:
        raise ValueError(f"token must be [B], got shape {tuple(token_B.shape)}")
    logits, state = prefill(model, token_B[:, None], state)
    return logits[:, 0], state


def sample(logits_BV, rng, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """Samples one id per row; temperature 0 is greedy. top_k keeps the k largest logits, top_p the smallest set
    whose probability reaches p."""
    if temperature == 0:
        return jnp.argmax(logits_BV, axis=-1).astype(jnp.int32)
    logits = logits_BV / temperature
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_desc = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_desc, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(mass_before < top_p, sorted_desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return jax.random.categorical(rng, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames=("graphdef", "max_new_tokens", "temperature", "top_k", "top_p"))
def _generate(graphdef, params, prompts_BT, lengths_B, rng, *, max_new_tokens, temperature, top_k, top_p):
    model = nnx.merge(graphdef, params)
    B, T0 = prompts_BT.shape
    # Left-align: request b's tokens end at column T0 - 1, so every request decodes at the same slot.
    shift = T0 - lengths_B
    left = jax.vmap(lambda row, s: jnp.roll(row, s))(prompts_BT, shift)
    state = init_state(model, B, T0 + max_new_tokens)
    logits, state = prefill(model, left, state, lengths=lengths_B)
    keys = jax.random.split(rng, max_new_tokens)
    token = sample(logits[:, -1], keys[0], temperature=temperature, top_k=top_k, top_p=top_p)

    def body(carry, key):
        token, state = carry
        logits, state = step(model, token, state)
        nxt = sample(logits, key, temperature=temperature, top_k=top_k, top_p=top_p)
        return (nxt, state), token

    (last, _), tokens = jax.lax.scan(body, (token, state), keys[1:])
    new = jnp.concatenate([tokens.T, last[:, None]], axis=1)
    return jnp.concatenate([prompts_BT, new], axis=1)


def generate(model, prompts, max_new_tokens: int, *, prompt_lengths=None, temperature: float = 1.0,
             top_k: int | None = None, top_p: float | None = None, rng=None):
    """Generates `max_new_tokens` tokens for a batch of prompts in one jitted loop that carries a `DecodeState`.

    prompts [B, T0] int, right-padded when prompt_lengths [B] is given (row b's prompt is prompts[b, :len_b]).
    Returns [B, T0 + max_new_tokens]: the prompts as given, then the new tokens.
    """
    prompts = jnp.asarray(prompts)
    if prompts.ndim != 2 or not jnp.issubdtype(prompts.dtype, jnp.integer):
        raise ValueError(f"prompts must be an integer array [B, T0], got {prompts.dtype} {tuple(prompts.shape)}")
    B, T0 = prompts.shape
    lengths = jnp.full((B,), T0, jnp.int32) if prompt_lengths is None else jnp.asarray(prompt_lengths, jnp.int32)
    if lengths.shape != (B,) or int(lengths.min()) < 1 or int(lengths.max()) > T0:
        raise ValueError(f"prompt_lengths must be [B] = [{B}] with values in [1, {T0}], got {prompt_lengths!r}")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if top_k is not None and not 1 <= top_k <= model.cfg.vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size], got {top_k}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    rng = jax.random.key(0) if rng is None else rng
    graphdef, params = nnx.split(model)
    return _generate(graphdef, params, prompts, lengths, rng, max_new_tokens=max_new_tokens,
                     temperature=float(temperature), top_k=top_k, top_p=top_p)
