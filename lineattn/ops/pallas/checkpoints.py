"""Serving checkpoints (the state after chosen token counts) from the Pallas forward, in the same pass.

The state pass writes the incoming fp32 state S0 of every chunk that holds a requested position (`export_chunks`
of `chunk_fwd.forward`); `lineattn.ops.checkpoints.advance_in_chunk` then advances S0 over the chunk's first r
tokens in closed form with the kernels' own WY terms, E = U - W S0 (E = V for the additive write): a small XLA
epilogue over P chunks, no second pass over the prompt. Gradients (rarely wanted from a prefill) are the XLA chunk
form's VJP, as with the "xla" backward of `chunk.chunk_pallas`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from lineattn.ops import checkpoints as xla_checkpoints
from lineattn.ops import chunk as chunk_form
from lineattn.ops.common import einsum
from lineattn.ops.pallas.chunk_fwd import forward

f32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def chunk_pallas_checkpoints(q, k, v, g, beta, h0, scale, chunk_size, positions, interpret=None):
    """(o [B, T, H, V] in q's dtype, final state [B, H, K, V], states [P, B, H, K, V] fp32 after each of
    `positions` (a tuple of token counts in [0, T])). Other arguments as `chunk_fwd.forward`."""
    C = chunk_size
    p = np.asarray(positions, np.int64)
    n, _ = xla_checkpoints.chunk_of(p, C)
    chunks = tuple(sorted(set(int(x) for x in n)))
    o, ht, S0_BHXKV, w, u = forward(q, k, v, g, beta, h0, scale=scale, chunk_size=C, interpret=interpret,
                                    export_chunks=chunks)
    S0_PBHKV = jnp.moveaxis(S0_BHXKV[:, :, np.searchsorted(chunks, n)], 2, 0)
    _, k_pad, v_pad, g_pad, _ = chunk_form.pad_to_chunks(q, k, v, g, beta, C)
    in_chunks = lambda x_BHTD: x_BHTD.reshape(*x_BHTD.shape[:2], -1, C, x_BHTD.shape[-1])[:, :, n]
    if beta is None:
        E_PBHCV = jnp.moveaxis(chunk_form._to_chunks(v_pad.astype(f32), C)[:, :, n], 2, 0)
    else:
        w_PBHCK, u_PBHCV = (jnp.moveaxis(in_chunks(x).astype(f32), 2, 0) for x in (w, u))
        E_PBHCV = u_PBHCV - einsum("pbhck,pbhkv->pbhcv", w_PBHCK, S0_PBHKV)
    states = xla_checkpoints.advance_in_chunk(p, C, S0_PBHKV, E_PBHCV, k_pad.astype(f32), g_pad, h0.astype(f32))
    return o, ht, states


def _fwd(q, k, v, g, beta, h0, scale, chunk_size, positions, interpret):
    out = chunk_pallas_checkpoints(q, k, v, g, beta, h0, scale, chunk_size, positions, interpret)
    return out, (q, k, v, g, beta, h0)


def _bwd(scale, chunk_size, positions, interpret, residuals, cotangents):
    as_f32 = lambda x: None if x is None else x.astype(f32)

    def xla(q, k, v, g, beta, h0):
        return xla_checkpoints.chunk_checkpoints(q, k, v, g, beta, scale=scale, initial_state=h0,
                                                 chunk_size=chunk_size, positions=np.asarray(positions, np.int64))

    _, vjp = jax.vjp(xla, *map(as_f32, residuals))
    grads = vjp(tuple(map(as_f32, cotangents)))
    return tuple(None if x is None else dx.astype(x.dtype) for dx, x in zip(grads, residuals))


chunk_pallas_checkpoints.defvjp(_fwd, _bwd)
