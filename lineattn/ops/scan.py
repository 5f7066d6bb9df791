"""`jax.lax.associative_scan` forms: log depth in the sequence length.

- Additive rules, token level: each token is the affine map S -> a_t * S + k_t v_t^T with a diagonal (scalar,
  per-channel or per-element) decay a_t, and these compose as (a1, b1) then (a2, b2) = (a2 a1, a2 b1 + b2).
  Materialises every state [B, T, H, K, V]: a reference form, not a fast one.
- Delta rules, chunk level: each chunk is S0 -> T S0 + D with T = Diag(e^(G_C)) - Kg^T W [K, K] and
  D = Kg^T U [K, V] (stage 1 of `lineattn.ops.chunk`); the pairs compose as (T2 T1, T2 D1 + D2), giving every
  chunk's incoming state at once, then stage 3 reads out the outputs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lineattn.ops import chunk as chunk_form
from lineattn.ops.common import einsum, log_decay_as_state


def _compose_diagonal(first, second):
    a1, b1 = first
    a2, b2 = second
    return a1 * a2, a2 * b1 + b2


def _compose_affine(first, second):
    T1, D1 = first
    T2, D2 = second
    return einsum("...ij,...jk->...ik", T2, T1), einsum("...ij,...jv->...iv", T2, D1) + D2


def additive_token_scan(q, k, v, g, *, scale: float, initial_state: jax.Array):
    log_decay = log_decay_as_state(g)
    B, T, H = q.shape[:3]
    decay = jnp.ones((B, T, H, 1, 1), q.dtype) if log_decay is None else jnp.exp(log_decay)
    write_BTHKV = einsum("bthk,bthv->bthkv", k, v)
    # Fold the initial state into the first token's write.
    write_BTHKV = write_BTHKV.at[:, 0].add(decay[:, 0] * initial_state)
    _, S_BTHKV = jax.lax.associative_scan(_compose_diagonal, (decay, write_BTHKV), axis=1)
    o = scale * einsum("bthkv,bthk->bthv", S_BTHKV, q)
    return o, S_BTHKV[:, -1]


def chunk_transitions(terms: chunk_form.ChunkTerms):
    """The affine pair (T [B, H, N, K, K], D [B, H, N, K, V]) of every chunk."""
    K = terms.Kg_BHNCK.shape[-1]
    decay = terms.decay_end
    if decay is None:
        T = jnp.broadcast_to(jnp.eye(K, dtype=terms.Kg_BHNCK.dtype), (*terms.Kg_BHNCK.shape[:3], K, K))
    elif decay.ndim == 3:
        T = decay[..., None, None] * jnp.eye(K, dtype=decay.dtype)
    else:
        T = decay[..., None] * jnp.eye(K, dtype=decay.dtype)
    if terms.W_BHNCK is not None:
        T = T - einsum("bhnck,bhncj->bhnkj", terms.Kg_BHNCK, terms.W_BHNCK)
    D = einsum("bhnck,bhncv->bhnkv", terms.Kg_BHNCK, terms.U_BHNCV)
    return T, D


def chunk_states_associative(terms: chunk_form.ChunkTerms, initial_state_BHKV):
    """Stage 2 by associative scan: S0 of every chunk [B, H, N, K, V] and the final state."""
    T, D = chunk_transitions(terms)
    T_cum, D_cum = jax.lax.associative_scan(_compose_affine, (T, D), axis=2)
    # The state after chunk n is T_cum[n] S_init + D_cum[n]; chunk n starts from the state after chunk n - 1.
    S_end = einsum("bhnij,bhjv->bhniv", T_cum, initial_state_BHKV) + D_cum
    S0 = jnp.concatenate([initial_state_BHKV[:, :, None], S_end[:, :, :-1]], axis=2)
    return S0, S_end[:, :, -1]


def delta_chunk_scan(q, k, v, g, beta, *, scale: float, initial_state: jax.Array, chunk_size: int = 64):
    T = q.shape[1]
    padded = chunk_form.pad_to_chunks(q, k, v, g, beta, chunk_size)
    terms = chunk_form.chunk_terms(*padded, scale=scale, chunk_size=chunk_size)
    S0, final_state = chunk_states_associative(terms, initial_state)
    return chunk_form.chunk_outputs(terms, S0)[:, :T], final_state


def scan(q, k, v, g, beta, *, scale: float, initial_state: jax.Array, chunk_size: int = 64):
    """Associative-scan backend (see `lineattn.ops.common` for the shapes)."""
    if beta is None:
        return additive_token_scan(q, k, v, g, scale=scale, initial_state=initial_state)
    if g is not None and g.ndim == 5:
        raise ValueError("the delta rule with a per-element gate has no scan form; use backend='recurrent'")
    return delta_chunk_scan(q, k, v, g, beta, scale=scale, initial_state=initial_state, chunk_size=chunk_size)
