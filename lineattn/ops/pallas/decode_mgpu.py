"""The decode step as a Mosaic GPU kernel (TMA; Hopper): one CTA per state tile, the tile held in SMEM.

`decode._decode_kernel` (Triton) loads its [K, BV] tile into registers: at 128 registers a thread, four programs
fit an SM, so at most 128 KB of the state is in flight an SM. Here each CTA (one warpgroup) brings its tile into
SMEM by TMA, computes from SMEM in column pieces of `piece` (few registers), writes the tile back into SMEM and
sends it out by TMA: SMEM, not registers, bounds the tiles an SM holds (six of 32 KB). Per token, in fp32:
    S <- Diag(e^g) S,   r = beta (v - k^T S)  (delta write; v for the additive one),   o = q^T S + (q . k) r,
    S <- S + k r^T
(both reductions on the decayed state: `decode.decode_step`'s readout "decayed"). The state is a mutable ref,
updated in place. Without a GPU it runs in the Mosaic GPU interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lineattn.ops.pallas.solve_mgpu import _ROW, _copy_in, _interpret_params, _load, _smem

f32 = jnp.float32
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column of a WGMMA-layout array


def fits(K: int, V: int, block_v: int, piece: int) -> bool:
    """Whether the kernel takes these sizes: K 64 or 128 (a warpgroup's rows), V tiles of 32-128 dividing V and
    pieces of 8 or more dividing the tile."""
    return K in (64, 128) and block_v in (32, 64, 128) and V % block_v == 0 and piece >= 8 and block_v % piece == 0


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "piece", "split", "interpret"))
def decode_step_mosaic(q, k, v, g, beta, state, *, scale: float, block_v: int = 64, piece: int = 32,
                       split: bool = True, interpret: bool | None = None):
    """T new tokens per request from `state` (updated in place under jit with it donated).

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] fp32 log decay; beta [B, T, H] (None: the additive write);
    state [B, H, K, V] fp32. block_v: the V tile of a CTA; piece: the columns computed at a time, each in its own
    SMEM buffer; split: each piece on its own barrier, computed as soon as it arrives and sent out as soon as it is
    computed (else the whole tile arrives, then is computed, then leaves). Returns (o [B, T, H, V] in q's dtype,
    the new state)."""
    B, T, H, K = q.shape
    V, bv = v.shape[-1], block_v
    if not fits(K, V, bv, piece):
        raise ValueError(f"decode_step_mosaic takes K 64 or 128 and V tiles of 32, 64 or 128 dividing V, computed in "
                         f"pieces of 8 or more dividing the tile; got K={K}, V={V}, block_v={bv}, piece={piece}")
    delta = beta is not None
    if beta is None:
        beta = jnp.zeros((B, T, H), f32)  # (unused)
    o_row = max(bv, 128 // q.dtype.itemsize)  # o leaves by TMA from SMEM rows of 128 bytes at least
    npieces = bv // piece

    def body(q_g, k_g, v_g, g_g, beta_g, s_g, o_g, q_s, k_s, v_s, g_s, st_s, o_s, tok_bar, piece_bar):
        j, h, b = jax.lax.axis_index("j"), jax.lax.axis_index("h"), jax.lax.axis_index("b")
        cols = lambda c: pl.ds(j * bv + c * piece, piece)
        for c in range(npieces):
            plgpu.copy_gmem_to_smem(s_g.at[b, h, :, cols(c)], st_s.at[c], piece_bar.at[c if split else 0])
        _copy_in(((q_g.at[b, :, h], q_s), (k_g.at[b, :, h], k_s), (v_g.at[b, :, h], v_s), (g_g.at[b, :, h], g_s)),
                 tok_bar.at[0])
        rows = lambda ref, t: jax.lax.broadcast_in_dim(
            plgpu.load(ref.at[t], layout=_ROW, optimized=False).astype(f32), (K, piece), [0])
        for c in range(npieces):
            if split or c == 0:
                plgpu.barrier_wait(piece_bar.at[c if split else 0])
            S = _load(st_s.at[c])
            for t in range(T):  # T is small (1 token, or a few draft tokens)
                q_t, k_t = rows(q_s, t), rows(k_s, t)
                S = S * jnp.exp(rows(g_s, t))
                qS = jnp.sum(S * q_t, axis=0)
                r = plgpu.load(v_s.at[t, cols(c)], layout=_COL, optimized=False).astype(f32)
                if delta:  # (beta: one scalar from GMEM; a TMA block of it would be under 128 bytes)
                    r = beta_g[b, t, h].astype(f32) * (r - jnp.sum(S * k_t, axis=0))
                o = qS + jnp.sum(q_t * k_t, axis=0) * r
                o_s.at[t, pl.ds(c * piece, piece)][...] = (scale * o).astype(o_s.dtype)
                S = S + k_t * jax.lax.broadcast_in_dim(r, (K, piece), [1])
            st_s.at[c][...] = S
            if split:
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(st_s.at[c], s_g.at[b, h, :, cols(c)])
        plgpu.commit_smem()
        if not split:
            for c in range(npieces):
                plgpu.copy_smem_to_gmem(st_s.at[c], s_g.at[b, h, :, cols(c)])
        for t in range(T):
            plgpu.copy_smem_to_gmem(o_s.at[t, pl.ds(0, bv)], o_g.at[b, t, h, pl.ds(j * bv, bv)])
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    scratch = [plgpu.SMEM((T, K), q.dtype), plgpu.SMEM((T, K), k.dtype), plgpu.SMEM((T, V), v.dtype),
               plgpu.SMEM((T, K), f32), _smem((npieces, K, piece), f32), plgpu.SMEM((T, o_row), q.dtype),
               plgpu.Barrier(num_arrivals=4, num_barriers=1),
               plgpu.Barrier(num_arrivals=1 if split else npieces, num_barriers=npieces if split else 1)]
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((B, T, H, V), q.dtype), grid=(V // bv, H, B),
                          grid_names=("j", "h", "b"), scratch_types=scratch,
                          interpret=_interpret_params(interpret), kernel_name="lineattn_decode_mosaic")
    state_ref = jax.new_ref(state)  # the kernel writes each tile back into the buffer it read it from
    o = kernel(q, k, v, g.astype(f32), beta, state_ref)
    return o, jax.freeze(state_ref)
