"""The Pallas chunk backend as a differentiable function (`jax.custom_vjp`).

Forward: the kernels of `chunk_fwd.forward` (intra-chunk stage, then the state pass). Backwards, chosen by the
static `backward` argument (H200 times: fwd+bwd at B = 8, T = 4096, H = 16, K = V = 128, bf16; runs in
benchmarks/results/README.md):
  - "kernels-saved" (the default; 6.08 ms with o returned, run12b; 15.5 ms in run5 before the chunk-gradient and WY
    kernels were tiled): the forward also keeps its intra-chunk terms Qin, Kg, W, U, M (input dtype), e^(G_C), KK
    and R = (I + A)^-1 (fp32), and (SAVE_STATES, below) every chunk's incoming state and E: about 2.5 KB per token
    and head at K = V = 128, C = 64 in bf16, on top of the inputs. A channel gate's in-chunk cumsum G (fp32) is kept
    in place of g, as FLA does (the same size as an fp32 g), so the backward need not recompute it (XLA merged the
    two gate-cumsum kernels of a jitted forward+backward only while their kernels lowered alike). Where the state
    pass runs in segments (a few long sequences, `segments`), the segments' K x K maps as well (fp32, nseg per head).
    `chunk_bwd.backward_fast` then runs only kernels: (for a scalar gate) gate cumsum, the reverse state pass, the
    chunk gradients, the WY backward, the Gram gradients with the row-local combine (and its exact rewrite of
    flagged chunks), dg's reverse cumsum (for a scalar gate, on the Gram gradients' sums over K, in XLA).
  - "kernels-mml2": `chunk_bwd.backward_fast` recomputing the terms (Gram kernel, whole-chunk solve writing R):
    the forward saves only its inputs. (The "kernels-mm2" form with the 3-D exact Gram path was removed as
    redundant.)
  - "xla" (40.7 ms): `jax.vjp` of the XLA chunk form (`lineattn.ops.chunk.chunk`) in fp32. No Pallas kernel.
g is [B, T, H, K] (a channel gate) or [B, T, H] (equal across K: the scalar Gram kernels; dg comes back in g's
shape). Transient memory of `backward_fast`: about 6 KB per token and head at K = V = 128, C = 64 (per-chunk
states, state cotangents K*V/C and E in bf16, cotangents of the terms (dU, dW in bf16, the rest fp32: see
`chunk_bwd.COT_DTYPE`), Gram gradients).
g may hold values below `ops.LOG_GATE_FLOOR` (-inf too): the kernels raise them to it as they load g, and dg is 0
there, as for `jnp.where(g < floor, floor, g)` (see GATE_FLOOR).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lineattn.ops.chunk import chunk as xla_chunk
from lineattn.ops.gates import LOG_GATE_FLOOR, floor_gate
from lineattn.ops.pallas import chunk_bwd
from lineattn.ops.pallas.chunk_fwd import forward, saved_gate

f32 = jnp.float32


BACKWARDS = ("kernels-saved", "kernels-mml2", "xla")
# "kernels-saved" with SAVE_STATES: the forward's state pass also writes every chunk's incoming state and
# E = U - W S0 (`chunk_bwd.STATES_DTYPE`; K V / C + V values per token and head: 768 B at K = V = 128, chunk 64,
# bf16), and the backward skips its own states pass, at the cost of those writes. Read when a call is traced.
# H200, 8 x 4096 (run12a): the state pass 0.47 ms against 0.35, the backward's states pass (0.27 ms) gone. (Where
# the caller needs o, as a model does, that is 0.15 ms less; with the gradients of a loss linear in o alone, XLA
# drops the forward's state pass without SAVE_STATES, which then looks 0.2 ms faster.)
SAVE_STATES = True
# Where a log gate below ops.LOG_GATE_FLOOR is raised to it on the way into the kernels. "kernels" (the default): as
# the kernels load g (`gates.floor_gate` in `gram`), with no XLA pass over g; under differentiation the forward also
# keeps where g < floor (int8, one byte per value of g, as autodiff of the `jnp.where` kept; `below_floor`) and the dg
# kernel zeroes dg there. "xla": `pallas.api.run` raises g in XLA first and the custom VJP keeps no mask (the form of
# sessions 42-44; for A/B timing). A channel gate at (8, 4096) is 268 MB of fp32: that pass read and wrote it in every
# forward call, plus its transpose over dg in the backward, outside the kernels the profiles timed. KDA 8 x 4096 bf16,
# interleaved wall clocks: forward 1.124 ms against 1.228, forward+backward 4.606 against 4.730 (H200, run45b); 1.300
# against 1.482 and 5.329 against 5.628 (H100, run44b). (The mask written by the Gram kernel from its loads of g, in
# place of `below_floor`'s XLA pass, was slower on both: 4.659 ms on the H200, 5.466 on the H100; removed.) Read when
# a call is traced.
GATE_FLOOR = "kernels"


def _check(backward):
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if GATE_FLOOR not in ("kernels", "xla"):
        raise ValueError(f"chunk.GATE_FLOOR must be 'kernels' or 'xla', got {GATE_FLOOR!r}")


def below_floor(g):
    """int8 1 where g < ops.LOG_GATE_FLOOR (where the raised gate's gradient is 0), in g's shape; None with
    GATE_FLOOR "xla" (g comes in raised)."""
    return (g < LOG_GATE_FLOOR).astype(jnp.int8) if GATE_FLOOR == "kernels" else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def chunk_pallas(q, k, v, g, beta, h0, scale, chunk_size=64, interpret=None, backward="kernels-saved"):
    """(o [B, T, H, V] in q's dtype, final state [B, H, K, V] fp32). Arguments as `chunk_fwd.forward`;
    backward: see the module docstring."""
    _check(backward)
    return forward(q, k, v, g, beta, h0, scale=scale, chunk_size=chunk_size, interpret=interpret)


def _fwd(q, k, v, g, beta, h0, scale, chunk_size, interpret, backward):
    _check(backward)
    if backward == "xla":  # (its backward raises g itself, by autodiff of `floor_gate`)
        out = forward(q, k, v, g, beta, h0, scale=scale, chunk_size=chunk_size, interpret=interpret)
        return out, ((q, k, v, g, beta, h0), None, None)
    if backward == "kernels-saved":  # the forward's intra-chunk terms are kept for the backward
        o, ht, saved = forward(q, k, v, g, beta, h0, scale=scale, chunk_size=chunk_size, interpret=interpret,
                               save=True, states_dtype=chunk_bwd.STATES_DTYPE if SAVE_STATES else None)
        below = below_floor(g)
        if saved_gate(saved)[0] is not None:  # G saved in g's place (the backward needs g's rank and dtype only)
            g = jnp.zeros((0,) * g.ndim, g.dtype)
        return (o, ht), ((q, k, v, g, beta, h0), below, saved)
    below = below_floor(g)
    out = forward(q, k, v, g, beta, h0, scale=scale, chunk_size=chunk_size, interpret=interpret)
    return out, ((q, k, v, g, beta, h0), below, None)


def _bwd(scale, chunk_size, interpret, backward, residuals, cotangents):
    inputs, below, saved = residuals
    do, dht = cotangents
    if backward != "xla":
        return chunk_bwd.backward_fast(*inputs, do, dht, scale=scale, chunk_size=chunk_size, interpret=interpret,
                                       saved=saved, below=below)
    as_f32 = lambda x: None if x is None else x.astype(f32)

    def xla(q, k, v, g, beta, h0):
        return xla_chunk(q, k, v, floor_gate(g), beta, scale=scale, initial_state=h0, chunk_size=chunk_size)

    _, vjp = jax.vjp(xla, *map(as_f32, inputs))
    grads = vjp((do.astype(f32), dht.astype(f32)))
    return tuple(None if x is None else dx.astype(x.dtype) for dx, x in zip(grads, inputs))


chunk_pallas.defvjp(_fwd, _bwd)
