"""Segments of chunks for the sequential state passes of a few long sequences: the rule for their count, their
block specs (shared by the forward's state pass and the backward's passes) and the short chain in XLA that joins
them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from lineattn.ops.pallas.common import is_pow2

f32 = jnp.float32

# Segments: for a few long sequences (B * H too small to fill the GPU with V tiles of 64), the state passes run
# each sequence as `nseg` segments of chunks in parallel (`pick_segments`). A forward that saves for the backward
# (`chunk_fwd.PASS_SEGMENTS`) runs its pass from a zero start on V + K columns (`chunk_fwd.segment_starts`): each
# segment's offset and, on the K extra columns started at I with U = 0, its map P_s (S_end = P_s S_start + c_s);
# a short fp32 chain in XLA gives every segment's true start, and the full pass runs from those. The backward's
# reverse pass from a zero end then needs V columns only (the state cotangent's offsets; P_s^T from the forward);
# without the forward's maps it forms P_s^T itself on K extra columns (no dO). The same sums in another order (the
# products at PASS_PREC). Where they fit (V tiles of 64, bf16, `chunk_fwd.PASS_IMPL`) the passes are the Mosaic
# GPU kernels of `state_mgpu`, a CTA per (sequence, segment, head, V tile). H200, 1 x 32768 x 16 x 128 bf16, 8
# segments, kernel time of fwd+bwd (run21c-d): passes 0.476 + 0.339 (forward, Triton) and 0.442 + 0.302
# (reverse) with the maps shared against 0.817 (forward unsegmented) and 0.441 + 0.528 (reverse forming its own
# maps), then the Mosaic passes 0.308 and 0.264: fwd+bwd 5.611 -> 5.433 -> 5.088 ms (jla 6.376). (Run10a, the
# first segmented backward: states 0.84 -> 0.15 + 0.28 ms, reverse 1.80 -> 0.53 + 0.44.) SEGMENT_MIN_PROGRAMS:
# the grid size the segments aim for.
SEGMENT_PASSES, MIN_SEGMENT_CHUNKS, SEGMENT_MIN_PROGRAMS = True, 8, 256


def pick_segments(programs: int, N: int, V: int) -> int:
    """Segments per sequence for the state passes: doubled while the grid (with V tiles of 64) has
    fewer than SEGMENT_MIN_PROGRAMS programs and each segment keeps a power of two of at least MIN_SEGMENT_CHUNKS
    chunks (1 when SEGMENT_PASSES is off or the grid is large enough)."""
    nseg = 1
    while (SEGMENT_PASSES and programs * nseg * max(V // 64, 1) < SEGMENT_MIN_PROGRAMS
           and N % (2 * nseg) == 0 and is_pow2(N // (2 * nseg)) and N // (2 * nseg) >= MIN_SEGMENT_CHUNKS):
        nseg *= 2
    return nseg


def block_specs(Tp: int, N: int, K: int, nseg: int, BV: int):
    """Block specs of segment s on a grid (B, H, nseg, V tiles): whole(D) [Ts, D] of [B, H, Tp, D] (Ts = Tp / nseg),
    a V tile [Ts, BV], a segment's state [K, BV] of [B, H, nseg, K, V], the per-chunk states [Ns K, BV] of
    [B, H, N K, V], e^(G_C) [K, Ns] of [B, H, K, N] (Ns = N / nseg) and a V tile [Ts, BV] of the token-major
    [B, Tp, H, V] (o, do)."""
    Ts, Ns = Tp // nseg, N // nseg
    whole = lambda D: pl.BlockSpec((None, None, Ts, D), lambda b, h, s, j: (b, h, s, 0))
    vtile = pl.BlockSpec((None, None, Ts, BV), lambda b, h, s, j: (b, h, s, j))
    state = pl.BlockSpec((None, None, None, K, BV), lambda b, h, s, j: (b, h, s, 0, j))
    states = pl.BlockSpec((None, None, Ns * K, BV), lambda b, h, s, j: (b, h, s, j))
    kn = pl.BlockSpec((None, None, K, Ns), lambda b, h, s, j: (b, h, 0, s))
    tokens = pl.BlockSpec((None, Ts, None, BV), lambda b, h, s, j: (b, s, h, j))
    return whole, vtile, state, states, kn, tokens


def zero_starts(B: int, H: int, nseg: int, K: int, V: int, map_columns: int):
    """The zero-start passes' start [B, H, nseg, K, V + map_columns] fp32: zeros for the V columns of the offsets,
    then the identity's first map_columns columns, whose ends are (columns of) each segment's map."""
    eye = jnp.broadcast_to(jnp.eye(K, map_columns, dtype=f32), (B, H, nseg, K, map_columns))
    return jnp.concatenate([jnp.zeros((B, H, nseg, K, V), f32), eye], axis=-1)


def chain(PT, offsets, first, *, reverse):
    """The segments' true starts [B, H, nseg, K, V] from their transposed maps PT [B, H, nseg, K, K] and zero-start
    offsets: forward x_0 = first, x_(s+1) = P_s x_s + offset_s; reverse (state cotangents at the segments' ends)
    x_(nseg-1) = first, x_(s-1) = P_s^T x_s + offset_s."""
    nseg = PT.shape[2]
    mm = lambda a, x, eq: jnp.einsum(eq, a, x, precision=jax.lax.Precision.HIGHEST)
    xs = [first.astype(f32)]
    for s in (range(nseg - 1) if not reverse else range(nseg - 1, 0, -1)):
        xs.append(mm(PT[:, :, s], xs[-1], "bhij,bhjv->bhiv" if reverse else "bhji,bhjv->bhiv") + offsets[:, :, s])
    return jnp.stack(xs[::-1] if reverse else xs, axis=2)
