"""The recurrent state at chosen token positions, from the same forward pass (serving: prefix-cache snapshots).

`positions` are token counts (state after p tokens; 0 is the initial state, T the final one), concrete ints in
[0, T], need not be chunk-aligned. The chunk form has every chunk's incoming state S0 (stage 2); a state after r
tokens of chunk n is S0 advanced over those r tokens, in closed form with the chunk's residuals E = U - W S0:

    S(nC + r) = Diag(e^(G_r)) S0_n + sum_{j < r} (k_j e^(G_r - G_j)) E_j^T      (G_r = in-chunk cumsum to token r)

E_j depends only on tokens <= j ((I + A)^-1 is lower triangular), so this is exact, and every exponent is <= 0.
Backends use the internal convention of `lineattn.ops.common`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from lineattn.ops import chunk as chunk_form
from lineattn.ops.common import einsum
from lineattn.ops.recurrent import recurrent


def check_positions(positions, T: int) -> np.ndarray:
    """`positions` as a sorted-as-given int array; a ValueError unless one or more concrete ints in [0, T]."""
    try:
        p = np.asarray(positions)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as err:
        raise ValueError("checkpoint_positions must be concrete ints (a list or NumPy array)") from err
    if p.ndim == 1 and p.size == 0:  # (np.asarray([]) is float: say what is wrong)
        raise ValueError("checkpoint_positions must hold at least one position (None exports no states)")
    if p.ndim != 1 or not np.issubdtype(p.dtype, np.integer) or p.min() < 0 or p.max() > T:
        raise ValueError(f"checkpoint_positions must be a 1-D list of ints in [0, T = {T}], got {positions!r}")
    return p.astype(np.int64)


def chunk_of(positions: np.ndarray, C: int) -> tuple[np.ndarray, np.ndarray]:
    """Position p > 0 ends inside chunk n = (p - 1) // C after r = p - n C of its tokens (1 <= r <= C); p = 0 is
    read from chunk 0 (and replaced by the initial state)."""
    p = np.maximum(positions, 1)
    n = (p - 1) // C
    return n, p - n * C


def advance_in_chunk(positions, C, S0_PBHKV, E_PBHCV, k_padded, g_padded, initial_state):
    """States [P, B, H, K, V] after each position, from the incoming state S0 of its chunk and the chunk's
    residuals E (the closed form in the module docstring). k_padded [B, Tp, H, K] and g_padded (None, [B, Tp, H]
    or [B, Tp, H, K]) are the inputs padded to whole chunks."""
    n, r = chunk_of(positions, C)
    k_PBHCK = jnp.moveaxis(chunk_form._to_chunks(k_padded, C)[:, :, n], 2, 0)
    before_PC = jnp.asarray(np.arange(C)[None, :] < r[:, None])
    if g_padded is None:
        weights_PBHCK = k_PBHCK * before_PC[:, None, None, :, None]
        states = S0_PBHKV + einsum("pbhck,pbhcv->pbhkv", weights_PBHCK, E_PBHCV)
    else:
        G = jnp.moveaxis(jnp.cumsum(chunk_form._to_chunks(g_padded, C), axis=3)[:, :, n], 2, 0)  # [P, B, H, C(, K)]
        G_r = jnp.take_along_axis(G, jnp.asarray(r - 1).reshape(-1, 1, 1, 1, *(1,) * (G.ndim - 4)), axis=3)
        mask = before_PC.reshape(-1, 1, 1, C, *(1,) * (G.ndim - 4))
        decay_CK = jnp.exp(jnp.where(mask, G_r - G, -jnp.inf))  # e^(G_r - G_j), j < r
        weights_PBHCK = k_PBHCK * (decay_CK[..., None] if G.ndim == 4 else decay_CK)
        S0_decayed = S0_PBHKV * (jnp.exp(G_r)[..., 0, None, None] if G.ndim == 4 else jnp.exp(G_r)[..., 0, :, None])
        states = S0_decayed + einsum("pbhck,pbhcv->pbhkv", weights_PBHCK, E_PBHCV)
    return jnp.where(jnp.asarray(positions == 0)[:, None, None, None, None], initial_state[None], states)


def chunk_checkpoints(q, k, v, g, beta, *, scale, initial_state, chunk_size, positions):
    """(o [B, T, H, V], final state, states [P, B, H, K, V]) by the chunk form plus the closed form above."""
    T, C = q.shape[1], chunk_size
    padded = chunk_form.pad_to_chunks(q, k, v, g, beta, C)
    terms = chunk_form.chunk_terms(*padded, scale=scale, chunk_size=C)
    S0_BHNKV, final_state = chunk_form.chunk_states_sequential(terms, initial_state)
    o = chunk_form.chunk_outputs(terms, S0_BHNKV)[:, :T]
    E_BHNCV = chunk_form.chunk_residual(terms, S0_BHNKV)
    n, _ = chunk_of(positions, C)
    S0_PBHKV, E_PBHCV = (jnp.moveaxis(x[:, :, n], 2, 0) for x in (S0_BHNKV, E_BHNCV))
    states = advance_in_chunk(positions, C, S0_PBHKV, E_PBHCV, padded[1], padded[3], initial_state)
    return o, final_state, states


def recurrent_checkpoints(q, k, v, g, beta, *, scale, initial_state, positions):
    """The oracle run piece by piece between the positions (the oracle is sequential anyway)."""
    cuts = sorted(set(int(x) for x in positions) | {0, q.shape[1]})
    S, outs, at = initial_state, [], {0: initial_state}
    piece = lambda x, a, b: None if x is None else x[:, a:b]
    for a, b in zip(cuts[:-1], cuts[1:]):
        o, S = recurrent(*(piece(x, a, b) for x in (q, k, v, g, beta)), scale=scale, initial_state=S)
        outs.append(o)
        at[b] = S
    return jnp.concatenate(outs, axis=1), S, jnp.stack([at[int(x)] for x in positions])
