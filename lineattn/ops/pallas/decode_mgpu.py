"""The decode step as a Mosaic GPU kernel (TMA; Hopper): `decode.decode_step`'s work where its `impl` picks it.

The Triton kernel runs one program per state tile, which loads its tile, computes and stores it: while it computes
no load of its own is in flight, and the copy of the state on that grid alone stays below the HBM's rate (H200
run13c: 4.12 TB/s). Here a fixed number of CTAs (`programs`) each walk their share of the [K, block_v] tiles
(tile p, p + programs, ...: CTAs side by side take neighbouring tiles) through `plgpu.emit_pipeline`: the next tiles
come in by TMA while one is computed, and the updated tile leaves by TMA while the next is computed. Per token, in
fp32 registers (WGMMA layout, one warpgroup):
    S <- Diag(e^g) S,   r = beta (v - k^T S)  (delta write; v for the additive one),   S <- S + k r^T,   o = q^T S
(o read from the updated state: `decode_step`'s readout "updated"). The state is updated in place (the pallas_call
aliases it to the new state). Without a GPU it runs in the Mosaic GPU interpreter.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from lineattn.ops.pallas.solve_mgpu import _ROW, _interpret_params, _load, _smem

f32 = jnp.float32
_COL = plgpu.Layout.WGMMA.reduce(0)  # one value per column of a WGMMA-layout array
V_TILES = (16, 32, 64)


def fits(T: int, H: int, K: int, V: int, block_v: int) -> bool:
    """Whether the kernel takes these sizes: K 64 or 128 (a warpgroup's rows), V at least 64 and a V tile in
    V_TILES dividing it (TMA copies of at least 128 bytes a pipeline slot)."""
    del T, H
    return K in (64, 128) and V >= 64 and block_v in V_TILES and V % block_v == 0


def _programs(tiles: int, programs: int) -> int:
    """The largest divisor of `tiles` not above `programs`: every CTA walks the same number of tiles (a tile taken
    twice would be updated twice, the state being updated in place)."""
    return max(d for d in range(1, min(tiles, programs) + 1) if tiles % d == 0)


@functools.partial(jax.jit, static_argnames=("scale", "block_v", "programs", "stages", "interpret"))
def decode_step_mosaic(q, k, v, g, beta, state, *, scale: float, block_v: int = 64, programs: int = 128,
                       stages: int = 2, interpret: bool | None = None):
    """T new tokens per request from `state` (updated in place under jit with it donated).

    q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] fp32 log decay; beta [B, T, H] (None: the additive write);
    state [B, H, K, V] fp32. block_v: the V tile; programs: the CTAs (at most; a divisor of the tile count
    B H V / block_v); stages: the tiles in flight through the input pipeline. Returns (o [B, T, H, V] in q's dtype,
    the new state)."""
    B, T, H, K = q.shape
    V, bv = v.shape[-1], block_v
    delta = beta is not None
    if beta is None:
        beta = jnp.zeros((B, T, H), f32)  # (unused: as the Triton kernel)
    if not fits(T, H, K, V, bv):
        raise ValueError(f"decode_step_mosaic takes K 64 or 128, V >= 64 and block_v in {V_TILES} dividing V; got "
                         f"K={K}, V={V}, block_v={bv}")
    nj = V // bv
    tiles = B * H * nj
    P = _programs(tiles, programs)
    steps = tiles // P
    state_smem = _smem((K, bv), f32)
    # o leaves by TMA one token row at a time from rows of at least 128 bytes (a TMA copy's SMEM alignment)
    o_row = max(bv, 128 // q.dtype.itemsize)

    def body(q_g, k_g, v_g, g_g, beta_g, s_g, o_g, o_s, st_s):
        p = jax.lax.axis_index("p")

        def tile(i):  # (request, head, V tile) of this CTA's i-th tile; the V tiles of one state side by side
            t = i * P + p
            return t // (H * nj), (t // nj) % H, t % nj

        def step(idx, q_s, k_s, v_s, g_s, s_s):
            i = idx[0]
            b, h, j = tile(i)
            slot = i % 2
            cols = pl.ds(j * bv, bv)
            # this slot's copies out (two tiles back) must have read it: the last tile's may still be in flight
            plgpu.wait_smem_to_gmem(T + 1, wait_read_only=True)
            rows = lambda ref, t: jax.lax.broadcast_in_dim(
                plgpu.load(ref.at[t], layout=_ROW, optimized=False).astype(f32), (K, bv), [0])
            S = _load(s_s)
            for t in range(T):  # T is small (1 token, or a few draft tokens)
                S = S * jnp.exp(rows(g_s, t))
                k_t = rows(k_s, t)
                r = plgpu.load(v_s.at[t, cols], layout=_COL, optimized=False).astype(f32)
                if delta:  # (beta: one scalar from GMEM; a TMA block of it would be under 128 bytes)
                    r = beta_g[b, t, h].astype(f32) * (r - jnp.sum(S * k_t, axis=0))
                S = S + k_t * jax.lax.broadcast_in_dim(r, (K, bv), [1])
                o_s.at[slot * T + t, pl.ds(0, bv)][...] = (scale * jnp.sum(S * rows(q_s, t), axis=0)).astype(o_s.dtype)
            st_s.at[slot][...] = S
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(st_s.at[slot], s_g.at[b, h, :, cols])
            for t in range(T):
                plgpu.copy_smem_to_gmem(o_s.at[slot * T + t, pl.ds(0, bv)], o_g.at[b, t, h, cols])

        at = lambda f: lambda i: f(*tile(i))
        token_rows = lambda D: plgpu.BlockSpec((None, T, None, D), at(lambda b, h, j: (b, 0, h, 0)))
        # (v's whole row [T, V], the tile's columns read from SMEM: a slot of 128 bytes at least)
        in_specs = [token_rows(K), token_rows(K), token_rows(V), token_rows(K),
                    plgpu.BlockSpec((None, None, K, bv), at(lambda b, h, j: (b, h, 0, j)),
                                    transforms=state_smem.transforms)]
        plgpu.emit_pipeline(step, grid=(steps,), in_specs=in_specs, max_concurrent_steps=stages)(
            q_g, k_g, v_g, g_g, s_g)
        plgpu.wait_smem_to_gmem(0)

    # SMEM at K = 128, block_v = 64, T = 1, stages = 2: two input slots of (state 32 KB, q, k, g, v: 1.3 KB)
    # and two output slots of (state, o): 131 KB, one CTA an SM; block_v = 32: 66 KB, three.
    kernel = plgpu.kernel(body, out_type=jax.ShapeDtypeStruct((B, T, H, V), q.dtype), grid=(P,), grid_names=("p",),
                          scratch_types=[plgpu.SMEM((2 * T, o_row), q.dtype), _smem((2, K, bv), f32)],
                          interpret=_interpret_params(interpret), kernel_name="lineattn_decode_mosaic")
    # the state as a mutable ref: the kernel writes its tiles back into the buffer it read them from
    state_ref = jax.new_ref(state)
    o = kernel(q, k, v, g.astype(f32), beta, state_ref)
    return o, jax.freeze(state_ref)

