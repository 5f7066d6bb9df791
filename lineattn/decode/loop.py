"""Prefill, one-token steps and a jitted generation loop over an explicit `DecodeState`."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from lineattn.decode.state import DecodeState, init_state
from lineattn.layers import KVCache
from lineattn.checks import check_int, is_concrete
from lineattn.models.hybrid import check_tokens
from lineattn.ops.checkpoints import check_positions


def _layout(layer):
    """(tree structure, leaf shapes) of one layer's state; a KV cache's max_len axis is left out."""
    kv = isinstance(layer, KVCache)
    shapes = [tuple(x.shape[:1] + x.shape[2:] if kv else x.shape) for x in jax.tree.leaves(layer)]
    return jax.tree.structure(layer), shapes


def check_state(model, state, batch: int, num_tokens: int) -> None:
    """ValueError unless `state` is a DecodeState of `model` for `batch` requests whose KV caches hold
    `num_tokens` more tokens (slot + T <= max_len; the slot is checked only when concrete). Static shapes only."""
    want = jax.eval_shape(lambda: tuple(block.mixer.init_state(batch, 1) for block in model.blocks))
    layers = getattr(state, "layers", None)
    if not isinstance(layers, tuple) or len(layers) != len(want):
        raise ValueError(f"state must be a DecodeState of this model ({len(want)} layers), got "
                         f"{type(state).__name__} with {len(layers) if isinstance(layers, tuple) else 'no'} layers")
    if tuple(state.start.shape) != (batch,):
        raise ValueError(f"state must be for the tokens' batch B = {batch}, got state.start {tuple(state.start.shape)}")
    for i, (have, w) in enumerate(zip(layers, want)):
        if _layout(have) != _layout(w):
            raise ValueError(f"state must be a DecodeState of this model for B = {batch}: layer {i} holds "
                             f"{_layout(have)[1]}, expected {_layout(w)[1]} (KV caches without their max_len axis)")
    caps = [layer.k.shape[1] for layer in layers if isinstance(layer, KVCache)]
    if caps:
        slot = int(state.slot) if is_concrete(state.slot) else 0
        if slot + num_tokens > min(caps):
            raise ValueError(f"tokens: {num_tokens} tokens from slot {slot} overflow the KV cache: slot + T must be "
                             f"<= max_len = {min(caps)} (init_state's max_len)")


def check_prompts(prompts, vocab_size: int) -> jax.Array:
    """prompts as an array; a ValueError unless int [B, T0] with ids in [0, vocab_size) (ids when concrete)."""
    prompts = jnp.asarray(prompts)
    try:
        check_tokens(prompts, vocab_size)
    except ValueError as err:
        raise ValueError(f"prompts: {err}") from None
    return prompts


def check_sampling(temperature, top_k, top_p, vocab_size: int) -> None:
    """ValueError unless temperature is finite and >= 0, top_k None or an int in [1, vocab_size], top_p None or
    in (0, 1]. Shared by `sample`, `generate` and `speculative_generate`; NaN fails every check."""
    if not 0 <= temperature < math.inf:
        raise ValueError(f"temperature must be finite and >= 0 (0: greedy), got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer))
                              or not 1 <= top_k <= vocab_size):
        raise ValueError(f"top_k must be None or an int in [1, vocab_size = {vocab_size}], got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")


def _check_lengths(name: str, lengths, B: int, T: int) -> jax.Array:
    """lengths as int32 [B]; a ValueError unless integers [B] in [1, T] (values checked when concrete)."""
    lengths = jnp.asarray(lengths)
    bad = lengths.shape != (B,) or not jnp.issubdtype(lengths.dtype, jnp.integer)
    if not bad and is_concrete(lengths) and B:
        values = np.asarray(lengths)
        bad = values.min() < 1 or values.max() > T
    if bad:
        shown = lengths if is_concrete(lengths) else tuple(lengths.shape)
        raise ValueError(f"{name} must be [B] = [{B}] integers in [1, {T}], got {lengths.dtype} {shown}")
    return lengths.astype(jnp.int32)


def _check_call(model, tokens_BT, state) -> tuple[int, int]:
    check_tokens(tokens_BT, model.cfg.vocab_size)
    B, T = tokens_BT.shape
    check_state(model, state, B, T)
    return B, T


def prefill(model, tokens_BT, state: DecodeState, *, lengths=None):
    """Runs a block of tokens through the model, continuing from `state`: linear layers take the chunk path, or
    for a block of at most 16 tokens (`layers.linear_attention.SHORT_BLOCK`) the decode kernel or the recurrence.

    tokens [B, T] int ids in [0, vocab_size), with state.slot + T <= init_state's max_len when the model has
    attention layers. lengths [B] (optional) ints in [1, T] start new requests: row b's prompt is its last
    lengths[b] tokens, the rest is left padding that no later token sees. Without it, every token continues its
    request (splitting a prompt across prefill calls gives the same result as one call). Values (ids, slot,
    lengths) are checked when concrete. Returns (logits [B, T, vocab] fp32, new state).
    """
    B, T = _check_call(model, tokens_BT, state)
    segment_ids, start = None, state.start
    if lengths is not None:
        lengths = _check_lengths("lengths", lengths, B, T)
        first = T - lengths
        segment_ids = (jnp.arange(T)[None, :] >= first[:, None]).astype(jnp.int32)
        start = state.slot + first
    logits, layers, _ = model.forward_cached(tokens_BT, state.layers, slot=state.slot, start=start,
                                             segment_ids=segment_ids)
    return logits, DecodeState(layers, state.slot + T, start)


def prefill_with_snapshots(model, tokens_BT, state: DecodeState, checkpoints):
    """`prefill` that also returns each linear layer's state after each of `checkpoints` tokens of this call
    (concrete ints in [0, T]; one pass, positions need not be chunk-aligned). tokens and state as for `prefill`.

    Returns (logits, new state, snapshots): snapshots[i] is a `LinearState` with a leading [P] axis for linear
    block i, None for attention blocks (their KV cache holds every slot).
    """
    _, T = _check_call(model, tokens_BT, state)
    try:
        checkpoints = tuple(int(p) for p in check_positions(checkpoints, T)) if len(checkpoints) else ()
    except (TypeError, ValueError) as err:  # check_positions names its own argument
        raise ValueError(f"checkpoints must be a 1-D sequence of ints in [0, T = {T}], got {checkpoints!r}") from err
    logits, layers, snapshots = model.forward_cached(tokens_BT, state.layers, slot=state.slot, start=state.start,
                                                     checkpoints=checkpoints)
    return logits, DecodeState(layers, state.slot + T, state.start), snapshots


def step(model, token_B, state: DecodeState):
    """One token per request: a recurrent update per linear layer, one KV-cache read per attention layer.

    token [B] int ids -> (logits [B, vocab] fp32, new state); the state must have a free KV-cache slot.
    """
    if token_B.ndim != 1 or not jnp.issubdtype(token_B.dtype, jnp.integer):
        raise ValueError(f"token must be [B] integer ids, got {token_B.dtype} {tuple(token_B.shape)}")
    logits, state = prefill(model, token_B[:, None], state)
    return logits[:, 0], state


def sample(logits_BV, rng, *, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None):
    """Samples one id per row of logits [B, vocab] with the JAX key `rng`: int32 [B]. temperature (finite, >= 0):
    0 is greedy. top_k (in [1, vocab]) keeps the k largest logits, top_p (in (0, 1]) the smallest set whose
    probability reaches p."""
    if logits_BV.ndim != 2:
        raise ValueError(f"logits must be [B, vocab], got shape {tuple(logits_BV.shape)}")
    check_sampling(temperature, top_k, top_p, logits_BV.shape[-1])
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

    prompts [B, T0] int ids in [0, vocab_size), right-padded when prompt_lengths [B] (ints in [1, T0]) is given
    (row b's prompt is prompts[b, :len_b]). max_new_tokens an int >= 1; temperature, top_k, top_p as for `sample`.
    Returns [B, T0 + max_new_tokens]: the prompts as given, then the new tokens.
    """
    prompts = check_prompts(prompts, model.cfg.vocab_size)
    B, T0 = prompts.shape
    lengths = jnp.full((B,), T0, jnp.int32) if prompt_lengths is None else prompt_lengths
    lengths = _check_lengths("prompt_lengths", lengths, B, T0)
    check_int("max_new_tokens", max_new_tokens)
    check_sampling(temperature, top_k, top_p, model.cfg.vocab_size)
    rng = jax.random.key(0) if rng is None else rng
    graphdef, params = nnx.split(model)
    return _generate(graphdef, params, prompts, lengths, rng, max_new_tokens=int(max_new_tokens),
                     temperature=float(temperature), top_k=top_k, top_p=top_p)
