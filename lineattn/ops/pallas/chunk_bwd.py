"""Backward of the chunkwise form with the two sequential passes over chunks as Pallas kernels.

Per chunk (../shared/CHUNK_ALGORITHM.md, "Backward"), with E = U - W S0 recomputed from the saved S0:

    dE  = M^T dO + Kg dS                       (dS: cotangent of the chunk's outgoing state)
    dU  = dE,  dW = -dE S0^T,  dQin = dO S0^T,  dM = dO E^T,  dKg = E dS^T,  d e^(G_C) = rowsum(S0 * dS)
    dS0 = Qin^T dO + Diag(e^(G_C)) dS - W^T dE  (handed to the previous chunk)

`states` runs the forward pass again and writes every chunk's incoming state S0 (fp32, K*V/C values per token
and head); `reverse` runs the reverse pass, one program per (batch, head, V tile), and writes the cotangents of
the chunk terms (those that sum over V as one partial per V tile, summed afterwards) and d(initial state).
The intra-chunk part, terms -> (dq, dk, dv, dg, dbeta), is parallel over chunks and is left to XLA: the VJP
of `lineattn.ops.chunk.chunk_terms` (exact fp32). So this backward = XLA intra-chunk VJP + Pallas state passes.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.chunk import ChunkTerms, chunk_terms, pad_to_chunks
from lineattn.ops.pallas.chunk_fwd import pick_block_v
from lineattn.ops.pallas.common import compiler_params, dot, interpret_mode

f32 = jnp.float32


def _states_kernel(kg_ref, w_ref, u_ref, dend_ref, h0_ref, s0_ref, *, C, K, N, prec, delta):
    def body(n, S):
        s0_ref[pl.ds(n * K, K), :] = S
        t = pl.ds(n * C, C)
        E = u_ref[t, :].astype(f32)
        if delta:
            E = E - dot(w_ref[t, :], S, prec)
        return S * dend_ref[:, pl.ds(n, 1)] + dot(kg_ref[t, :], E, prec, trans_a=True)

    jax.lax.fori_loop(0, N, body, h0_ref[...].astype(f32))


def _reverse_kernel(qin_ref, kg_ref, w_ref, u_ref, m_ref, dend_ref, s0_ref, do_ref, dht_ref,
                    du_ref, dqin_ref, dkg_ref, dw_ref, dm_ref, ddend_ref, dh0_ref, *, C, K, N, prec, delta):
    def body(i, dS):
        n = N - 1 - i
        t = pl.ds(n * C, C)
        S0 = s0_ref[pl.ds(n * K, K), :]
        Qin, Kg, M = qin_ref[t, :], kg_ref[t, :], m_ref[t, :]
        dO = do_ref[t, :].astype(f32)
        E = u_ref[t, :].astype(f32)
        if delta:
            W = w_ref[t, :]
            E = E - dot(W, S0, prec)
        dE = dot(M, dO, prec, trans_a=True) + dot(Kg, dS, prec)
        du_ref[t, :] = dE
        dqin_ref[t, :] = dot(dO, S0, prec, trans_b=True)
        dm_ref[t, :] = dot(dO, E, prec, trans_b=True)
        dkg_ref[t, :] = dot(E, dS, prec, trans_b=True)
        ddend_ref[:, pl.ds(n, 1)] = jnp.sum(S0 * dS, axis=1, keepdims=True)
        dS_prev = dot(Qin, dO, prec, trans_a=True) + dS * dend_ref[:, pl.ds(n, 1)]
        if delta:
            dw_ref[t, :] = -dot(dE, S0, prec, trans_b=True)
            dS_prev = dS_prev - dot(W, dE, prec, trans_a=True)
        return dS_prev

    dh0_ref[...] = jax.lax.fori_loop(0, N, body, dht_ref[...].astype(f32))


def state_passes(terms: ChunkTerms, h0, do, dht, *, exact: bool, interpret=None, block_v=None):
    """The Pallas passes: cotangents of `terms` (a ChunkTerms of [B, H, N, C, .] arrays) and d(h0).

    do: [B, Tp, H, V] (Tp = N * C), dht: [B, H, K, V]. Returns (ChunkTerms of cotangents, dh0)."""
    B, H, N, C, K = terms.Qin_BHNCK.shape
    V = terms.U_BHNCV.shape[-1]
    Tp = N * C
    delta = terms.W_BHNCK is not None
    interpret = interpret_mode(interpret)
    prec = "ieee" if exact else "tf32"
    flat = lambda x: x.reshape(B, H, Tp, x.shape[-1])
    qin, kg, m, u = map(flat, (terms.Qin_BHNCK, terms.Kg_BHNCK, terms.M_BHNCC, terms.U_BHNCV))
    w = flat(terms.W_BHNCK) if delta else jnp.zeros((B, H, Tp, K), f32)
    dend = terms.decay_end
    if dend is None:
        dend = jnp.ones((B, H, N, K), f32)
    elif dend.ndim == 3:
        dend = jnp.broadcast_to(dend[..., None], (B, H, N, K))
    dend_KN = jnp.swapaxes(dend, -1, -2)
    BV = block_v or pick_block_v(B * H, V)
    NV = V // BV
    whole = lambda D: pl.BlockSpec((None, None, Tp, D), lambda b, h, j: (b, h, 0, 0))
    vtile = pl.BlockSpec((None, None, Tp, BV), lambda b, h, j: (b, h, 0, j))
    state = pl.BlockSpec((None, None, K, BV), lambda b, h, j: (b, h, 0, j))
    states = pl.BlockSpec((None, None, N * K, BV), lambda b, h, j: (b, h, 0, j))
    kn = pl.BlockSpec((None, None, K, N), lambda b, h, j: (b, h, 0, 0))

    s0 = pl.pallas_call(
        functools.partial(_states_kernel, C=C, K=K, N=N, prec=prec, delta=delta),
        grid=(B, H, NV),
        in_specs=[whole(K), whole(K), vtile, kn, state],
        out_specs=states,
        out_shape=jax.ShapeDtypeStruct((B, H, N * K, V), f32),
        compiler_params=compiler_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="lineattn_chunk_bwd_states",
    )(kg, w, u, dend_KN, h0.astype(f32))

    part = lambda D: pl.BlockSpec((None, None, None, Tp, D), lambda b, h, j: (j, b, h, 0, 0))
    part_shape = lambda D: jax.ShapeDtypeStruct((NV, B, H, Tp, D), f32)
    du, dqin, dkg, dw, dm, ddend, dh0 = pl.pallas_call(
        functools.partial(_reverse_kernel, C=C, K=K, N=N, prec=prec, delta=delta),
        grid=(B, H, NV),
        in_specs=[whole(K), whole(K), whole(K), vtile, whole(C), kn, states,
                  pl.BlockSpec((None, Tp, None, BV), lambda b, h, j: (b, 0, h, j)), state],
        out_specs=[vtile, part(K), part(K), part(K), part(C),
                   pl.BlockSpec((None, None, None, K, N), lambda b, h, j: (j, b, h, 0, 0)), state],
        out_shape=[jax.ShapeDtypeStruct((B, H, Tp, V), f32), part_shape(K), part_shape(K), part_shape(K),
                   part_shape(C), jax.ShapeDtypeStruct((NV, B, H, K, N), f32),
                   jax.ShapeDtypeStruct((B, H, K, V), f32)],
        compiler_params=compiler_params(num_warps=4, num_stages=2),
        interpret=interpret,
        name="lineattn_chunk_bwd_reverse",
    )(qin, kg, w, u, m, dend_KN, s0, do, dht.astype(f32))

    chunked = lambda x: x.reshape(B, H, N, C, x.shape[-1])
    ddend = jnp.swapaxes(ddend.sum(0), -1, -2)  # [B, H, N, K]
    if terms.decay_end is None:
        ddend = None
    elif terms.decay_end.ndim == 3:
        ddend = ddend.sum(-1)
    cot = ChunkTerms(chunked(dqin.sum(0)), chunked(dm.sum(0)), chunked(dkg.sum(0)), ddend, chunked(du),
                     chunked(dw.sum(0)) if delta else None)
    return cot, dh0


def backward(q, k, v, g, beta, h0, do, dht, *, scale: float, chunk_size: int, interpret=None):
    """(dq, dk, dv, dg, dbeta, dh0) of the chunk form, in the inputs' dtypes (dbeta None for additive rules)."""
    T = q.shape[1]
    exact = q.dtype == f32
    x32 = [None if x is None else x.astype(f32) for x in pad_to_chunks(q, k, v, g, beta, chunk_size)]
    names = [i for i, x in enumerate(x32) if x is not None]

    def terms_of(*args):
        full = list(x32)
        for i, a in zip(names, args):
            full[i] = a
        return chunk_terms(*full, scale=scale, chunk_size=chunk_size)

    terms, vjp = jax.vjp(terms_of, *[x32[i] for i in names])
    pad = -T % chunk_size
    do = jnp.pad(do.astype(f32), [(0, 0), (0, pad), (0, 0), (0, 0)])
    cot, dh0 = state_passes(terms, h0, do, dht, exact=exact, interpret=interpret)
    grads = [None] * 5
    for i, d in zip(names, vjp(cot)):
        grads[i] = d[:, :T]
    dtypes = [None if x is None else x.dtype for x in (q, k, v, g, beta)]
    return (*(None if d is None else d.astype(dt) for d, dt in zip(grads, dtypes)), dh0.astype(h0.dtype))
