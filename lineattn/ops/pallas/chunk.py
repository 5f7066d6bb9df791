"""The Pallas chunk backend as a differentiable function (`jax.custom_vjp`).

Forward: the two Pallas kernels of `chunk_fwd`. The forward saves only the inputs; the backward recomputes.
Three backwards, chosen by the static `backward` argument:
  - "xla" (the default, the one the H200 tests ran): `jax.vjp` of the XLA chunk form (`lineattn.ops.chunk.chunk`)
    in fp32: exact, but its time and memory are the XLA path's. No Pallas kernel in it.
  - "passes": `chunk_bwd.backward`: the XLA VJP of the intra-chunk terms (parallel over chunks) with the two
    sequential passes over chunks (forward states, reverse cotangent pass) as Pallas kernels.
  - "kernels": `chunk_bwd.backward_kernels`: no XLA autodiff. The terms are recomputed by the Pallas gram kernel
    plus XLA for (I + A)^-1, U, W; the state passes as above; the WY part of the backward as XLA algebra; the
    gradients of the gated Gram matrices as two Pallas kernels (row and column sides).
"passes" and "kernels" are tested on CPU (interpret mode) against the oracle and lower to Triton IR for sm_90,
but have not yet been compiled or timed on a GPU. Memory: the forward saves nothing but its inputs (FLA saves the
two intra-chunk matrices); the "kernels" backward holds, transiently, about 2,200 fp32 values per token and head
at K = V = 128, C = 64 (recomputed terms, per-V-tile cotangent partials, Gram gradients; 256 of them are the
per-chunk states K*V/C).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lineattn.ops.chunk import chunk as xla_chunk
from lineattn.ops.pallas import chunk_bwd
from lineattn.ops.pallas.chunk_fwd import forward

f32 = jnp.float32


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10))
def chunk_pallas(q, k, v, g, beta, h0, scale, chunk_size=64, interpret=None, backward="kernels", intra="split"):
    """(o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32). Arguments as `chunk_fwd.forward`;
    backward: "kernels", "xla" or "passes" (see the module docstring); intra: "split" or "fused"
    (`chunk_fwd.forward`)."""
    return forward(q, k, v, g, beta, h0, scale=scale, chunk_size=chunk_size, interpret=interpret, intra=intra)


def _fwd(q, k, v, g, beta, h0, scale, chunk_size, interpret, backward, intra):
    if backward == "kernels-saved":  # the forward's intra-chunk terms are kept for the backward
        o, ht, saved = forward(q, k, v, g, beta, h0, scale=scale, chunk_size=chunk_size, interpret=interpret,
                               intra=intra, save=True)
        return (o, ht), (q, k, v, g, beta, h0, saved)
    out = forward(q, k, v, g, beta, h0, scale=scale, chunk_size=chunk_size, interpret=interpret, intra=intra)
    return out, (q, k, v, g, beta, h0)


def _bwd(scale, chunk_size, interpret, backward, intra, residuals, cotangents):
    do, dht = cotangents
    if backward == "kernels-saved":
        return chunk_bwd.backward_fast(*residuals[:6], do, dht, scale=scale, chunk_size=chunk_size,
                                       interpret=interpret, saved=residuals[6],
                                       gram_diag="mm" if intra == "mm2" else "mml")
    if backward == "passes":
        return chunk_bwd.backward(*residuals, do, dht, scale=scale, chunk_size=chunk_size, interpret=interpret)
    if backward in ("kernels-mm2", "kernels-mml2"):
        return chunk_bwd.backward_fast(*residuals, do, dht, scale=scale, chunk_size=chunk_size, interpret=interpret,
                                       gram_diag=backward[8:-1])
    if backward in chunk_bwd.KERNELS_DIAG:
        return chunk_bwd.backward_kernels(*residuals, do, dht, scale=scale, chunk_size=chunk_size,
                                          interpret=interpret, diag=chunk_bwd.KERNELS_DIAG[backward])
    as_f32 = lambda x: None if x is None else x.astype(f32)

    def xla(q, k, v, g, beta, h0):
        return xla_chunk(q, k, v, g, beta, scale=scale, initial_state=h0, chunk_size=chunk_size)

    _, vjp = jax.vjp(xla, *map(as_f32, residuals))
    grads = vjp((do.astype(f32), dht.astype(f32)))
    return tuple(None if x is None else dx.astype(x.dtype) for dx, x in zip(grads, residuals))


chunk_pallas.defvjp(_fwd, _bwd)
