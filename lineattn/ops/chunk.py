"""XLA chunkwise form (WY representation) for every rule with a chunk form.

Per chunk of C tokens with incoming state S0 (see ../shared/CHUNK_ALGORITHM.md), G = in-chunk cumsum of g:

    Kin = k * e^G,  Kg = k * e^(G_C - G),  Qin = scale * q * e^G
    A_ij = b_i sum_d k_id k_jd e^(G_id - G_jd)   (j < i)      M_ij = scale sum_d q_id k_jd e^(G_id - G_jd)   (j <= i)
    U = (I + A)^-1 Diag(b) V,  W = (I + A)^-1 Diag(b) Kin       (delta; additive has U = V, W = 0)
    E = U - W S0,  O = Qin S0 + M E,  S_C = Diag(e^(G_C)) S0 + Kg^T E

Stage 1 (`chunk_terms`) is parallel over chunks, stage 2 passes the state across chunks (a sequential
`lax.scan` here; `lineattn.ops.scan` composes the same chunks with an associative scan), stage 3
(`chunk_outputs`) is parallel again. Every exponent evaluated is <= 0, so the form is exact for any g <= 0.
Arrays are named by shape: B batch, H heads, N chunks, C chunk length, K/V head dims.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from lineattn.ops.common import einsum
from lineattn.ops.triangular import unit_lower_inverse

SUB_CHUNK = 16


class ChunkTerms(NamedTuple):
    """Everything a chunk needs besides its incoming state. W is None for additive rules."""

    Qin_BHNCK: jax.Array
    M_BHNCC: jax.Array
    Kg_BHNCK: jax.Array
    decay_end: jax.Array | None  # e^(G_C): [B, H, N] (scalar gate) or [B, H, N, K], None if ungated
    U_BHNCV: jax.Array
    W_BHNCK: jax.Array | None


def _masked_exp(exponent, mask):
    # Mask before exp: a masked exponent may be hugely positive, and exp(inf) * 0 would poison gradients.
    return jnp.exp(jnp.where(mask, exponent, -jnp.inf))


def _causal_mask(n: int, strict: bool):
    i = jnp.arange(n)
    return i[:, None] > i[None, :] if strict else i[:, None] >= i[None, :]


def _block_diagonal(blocks_bss):
    """[.., nb, s, s] diagonal blocks -> the [.., nb*s, nb*s] block-diagonal matrix."""
    nb, s = blocks_bss.shape[-3:-1]
    eye = jnp.eye(nb, dtype=blocks_bss.dtype)
    full = blocks_bss[..., :, :, None, :] * eye[:, None, :, None]
    return full.reshape(*blocks_bss.shape[:-3], nb * s, nb * s)


def intra_chunk_grams(qs_CK, k_CK, G_C):
    """The two gated Gram matrices of a chunk (leading batch dims allowed):

        M_ij  = sum_d qs_id k_jd exp(G_id - G_jd)   for j <= i, else 0
        KK_ij = sum_d k_id  k_jd exp(G_id - G_jd)   for j <  i, else 0

    G is None (no gate), [.., C] (one gate per token) or [.., C, K] (per channel). The key side and the decay
    factors are shared by both. Per channel, `exp(G_i - G_j)` overflows once G_i - G_j is large, so the chunk is
    cut into 16-row sub-blocks: an off-diagonal block (row block a > column block b) is anchored at n = the first
    row of block a, `(x_a e^(G_a - G_n)) (k_b e^(G_n - G_b))^T`, both exponents <= 0; the diagonal blocks take
    `exp(G_i - G_j)` pair by pair, masked before the exp. Exact for any g <= 0.
    """
    C = k_CK.shape[-2]
    incl_CC, strict_CC = _causal_mask(C, strict=False), _causal_mask(C, strict=True)
    if G_C is None:
        M = einsum("...ik,...jk->...ij", qs_CK, k_CK)
        KK = einsum("...ik,...jk->...ij", k_CK, k_CK)
        return jnp.where(incl_CC, M, 0.0), jnp.where(strict_CC, KK, 0.0)
    if G_C.ndim == k_CK.ndim - 1:  # one gate per token: the decay pairs are C x C scalars
        decay_CC = _masked_exp(G_C[..., :, None] - G_C[..., None, :], incl_CC)
        M = einsum("...ik,...jk->...ij", qs_CK, k_CK) * decay_CC
        KK = einsum("...ik,...jk->...ij", k_CK, k_CK) * jnp.where(strict_CC, decay_CC, 0.0)
        return M, KK

    s = SUB_CHUNK
    nb = C // s
    K = k_CK.shape[-1]
    lead = k_CK.shape[:-2]
    blocks = lambda x: x.reshape(*lead, nb, s, K)
    G_bsK = blocks(G_C)
    # Off-diagonal blocks, anchored at each row block's first row.
    G_ref_bK = G_C[..., ::s, :]
    row_decay_bsK = jnp.exp(G_bsK - G_ref_bK[..., :, None, :])
    before_ref_bC = jnp.arange(C)[None, :] < (s * jnp.arange(nb))[:, None]  # column j is left of block a
    k_right_bCK = k_CK[..., None, :, :] * _masked_exp(
        G_ref_bK[..., :, None, :] - G_C[..., None, :, :], before_ref_bC[..., None]
    )
    off = lambda x: einsum("...aik,...ajk->...aij", blocks(x) * row_decay_bsK, k_right_bCK).reshape(*lead, C, C)
    # Diagonal blocks, pair by pair.
    pair_decay_bssK = _masked_exp(G_bsK[..., :, None, :] - G_bsK[..., None, :, :], _causal_mask(s, False)[..., None])
    k_pairs_bssK = blocks(k_CK)[..., None, :, :] * pair_decay_bssK
    diag = lambda x: _block_diagonal(jnp.sum(blocks(x)[..., :, None, :] * k_pairs_bssK, axis=-1))
    M = off(qs_CK) + diag(qs_CK)
    KK = off(k_CK) + jnp.where(strict_CC, diag(k_CK), 0.0)
    return M, KK


def _to_chunks(x, C):
    """[B, T, H, ...] (T a multiple of C) -> [B, H, N, C, ...]."""
    B, T, H = x.shape[:3]
    x = jnp.moveaxis(x, 2, 1)
    return x.reshape(B, H, T // C, C, *x.shape[3:])


def _scale_rows(x, factor):
    """Scale token rows [.., C, D] by a per-token scalar [.., C] or per-channel factor [.., C, D]."""
    return x * (factor[..., None] if factor.ndim == x.ndim - 1 else factor)


def chunk_terms(q, k, v, g, beta, *, scale: float, chunk_size: int) -> ChunkTerms:
    """Stage 1: the per-chunk quantities, in parallel over chunks. Inputs [B, T, H, ...], T a multiple of C."""
    if g is not None and g.ndim == 5:
        raise ValueError("the per-element gate (g [B, T, H, K, V]) has no chunk form of one state; the chunk backend "
                         "runs it by value columns (lineattn.ops.columns)")
    C = chunk_size
    q, k, v = (_to_chunks(x, C) for x in (q, k, v))
    if g is None:
        G = decay_end = None
        Qin, Kin, Kg = scale * q, k, k
    else:
        G = jnp.cumsum(_to_chunks(g, C), axis=3)  # [B, H, N, C] or [B, H, N, C, K]
        G_end = G[:, :, :, -1:]
        decay_end = jnp.exp(G_end[:, :, :, 0])
        Qin = _scale_rows(scale * q, jnp.exp(G))
        Kin = _scale_rows(k, jnp.exp(G))
        Kg = _scale_rows(k, jnp.exp(G_end - G))
    M, KK = intra_chunk_grams(scale * q, k, G)
    if beta is None:
        return ChunkTerms(Qin, M, Kg, decay_end, v, None)
    beta = _to_chunks(beta, C)
    A = beta[..., None] * KK
    R = unit_lower_inverse(A + jnp.eye(C, dtype=A.dtype))  # (I + A)^-1
    V = v.shape[-1]
    UW = einsum("...ij,...jd->...id", R, beta[..., None] * jnp.concatenate([v, Kin], axis=-1))
    return ChunkTerms(Qin, M, Kg, decay_end, UW[..., :V], UW[..., V:])


def _decay_state(decay, S_KV):
    """Diag(e^(G_C)) S for a scalar [..] or per-channel [.., K] decay."""
    if decay is None:
        return S_KV
    return S_KV * (decay[..., None, None] if decay.ndim == S_KV.ndim - 2 else decay[..., None])


def chunk_residual(terms: ChunkTerms, S0_KV):
    """E = U - W S0: the residual each token actually writes (U itself for additive rules)."""
    if terms.W_BHNCK is None:
        return terms.U_BHNCV
    return terms.U_BHNCV - einsum("...ck,...kv->...cv", terms.W_BHNCK, S0_KV)


def chunk_states_sequential(terms: ChunkTerms, initial_state_BHKV):
    """Stage 2: S0 of every chunk [B, H, N, K, V] and the final state, one chunk after another."""

    def step(S_BHKV, chunk):
        E = chunk_residual(chunk, S_BHKV)
        S_next = _decay_state(chunk.decay_end, S_BHKV) + einsum("bhck,bhcv->bhkv", chunk.Kg_BHNCK, E)
        return S_next, S_BHKV

    per_chunk = jax.tree.map(lambda x: jnp.moveaxis(x, 2, 0), terms._replace(Qin_BHNCK=None, M_BHNCC=None))
    final_state, S0_NBHKV = jax.lax.scan(step, initial_state_BHKV, per_chunk)
    return jnp.moveaxis(S0_NBHKV, 0, 2), final_state


def chunk_outputs(terms: ChunkTerms, S0_BHNKV):
    """Stage 3: O = Qin S0 + M E for every chunk, as [B, T, H, V] (T padded to a chunk multiple)."""
    E = chunk_residual(terms, S0_BHNKV)
    O = einsum("bhnck,bhnkv->bhncv", terms.Qin_BHNCK, S0_BHNKV) + einsum("bhnij,bhnjv->bhniv", terms.M_BHNCC, E)
    B, H, N, C, V = O.shape
    return jnp.moveaxis(O.reshape(B, H, N * C, V), 1, 2)


def pad_to_chunks(q, k, v, g, beta, chunk_size: int):
    """Zero-pad the time axis to a multiple of C. A padded token (k = 0, b = 0, g = 0) leaves S unchanged."""
    T = q.shape[1]
    pad = -T % chunk_size

    def pad_time(x):
        if x is None or pad == 0:
            return x
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))

    return tuple(map(pad_time, (q, k, v, g, beta)))


def chunk(q, k, v, g, beta, *, scale: float, initial_state: jax.Array, chunk_size: int = 64):
    """The chunkwise form with a sequential state pass (see `lineattn.ops.common` for the shapes)."""
    T = q.shape[1]
    terms = chunk_terms(*pad_to_chunks(q, k, v, g, beta, chunk_size), scale=scale, chunk_size=chunk_size)
    S0, final_state = chunk_states_sequential(terms, initial_state)
    return chunk_outputs(terms, S0)[:, :T], final_state
