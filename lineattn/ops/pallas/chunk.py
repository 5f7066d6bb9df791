"""The Pallas chunk backend as a differentiable function (`jax.custom_vjp`).

Forward: the two Pallas kernels of `chunk_fwd`. Backward (first version, NOT a Pallas kernel yet): it saves only
the inputs and recomputes through the XLA chunk form, `jax.vjp(lineattn.ops.chunk.chunk)` in fp32, so the
gradients are the XLA chunk path's (exact fp32) and cost its forward+backward time and memory. A Pallas backward
following CHUNK_ALGORITHM.md's backward is the next step (issue [kernels]).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lineattn.ops.chunk import chunk as xla_chunk
from lineattn.ops.pallas.chunk_fwd import forward

f32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8))
def chunk_pallas(q, k, v, g, beta, h0, scale, chunk_size=64, interpret=None):
    """(o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32). Arguments as `chunk_fwd.forward`."""
    return forward(q, k, v, g, beta, h0, scale=scale, chunk_size=chunk_size, interpret=interpret)


def _fwd(q, k, v, g, beta, h0, scale, chunk_size, interpret):
    out = forward(q, k, v, g, beta, h0, scale=scale, chunk_size=chunk_size, interpret=interpret)
    return out, (q, k, v, g, beta, h0)


def _bwd(scale, chunk_size, interpret, residuals, cotangents):
    del interpret
    do, dht = cotangents
    as_f32 = lambda x: None if x is None else x.astype(f32)

    def xla(q, k, v, g, beta, h0):
        return xla_chunk(q, k, v, g, beta, scale=scale, initial_state=h0, chunk_size=chunk_size)

    _, vjp = jax.vjp(xla, *map(as_f32, residuals))
    grads = vjp((do.astype(f32), dht.astype(f32)))
    return tuple(None if x is None else dx.astype(x.dtype) for dx, x in zip(grads, residuals))


chunk_pallas.defvjp(_fwd, _bwd)
