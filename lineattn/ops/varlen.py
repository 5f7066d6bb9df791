"""Varlen packing as a layout change: packed [1, T_total, ...] <-> padded [N, T_max, ...].

Every backend then handles `cu_seqlens` the same way: each sequence gets its own row and initial state, and the
zero padding after its last token (k = 0, v = 0, b = 0, g = 0) leaves its state unchanged.
"""

from __future__ import annotations

import numpy as np
import jax
import jax.numpy as jnp


def concrete_cu_seqlens(cu_seqlens, total_len: int) -> np.ndarray:
    """Checks `cu_seqlens` and returns it as a NumPy int array [N + 1]."""
    try:
        cu = np.asarray(cu_seqlens)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError) as err:
        raise ValueError(
            "cu_seqlens must be concrete (a NumPy array, list or concrete jax array): it fixes the padded layout. "
            "Under jax.jit pass it as a static argument, e.g. a tuple."
        ) from err
    if cu.ndim != 1 or cu.shape[0] < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise ValueError(f"cu_seqlens must be a 1-D integer array [N + 1] with N >= 1, got {cu.dtype} {cu.shape}")
    if cu[0] != 0 or cu[-1] != total_len:
        raise ValueError(f"cu_seqlens must start at 0 and end at T = {total_len}, got {cu[0]} ... {cu[-1]}")
    if np.any(np.diff(cu) < 0):
        raise ValueError(f"cu_seqlens must be non-decreasing, got {cu.tolist()}")
    return cu.astype(np.int64)


class PackedLayout:
    """Index maps between the packed sequence and one padded row per sequence."""

    def __init__(self, cu: np.ndarray):
        lengths = np.diff(cu)
        self.num_seqs = len(lengths)
        self.max_len = max(int(lengths.max()), 1)
        pos = np.arange(self.max_len)
        self.valid_NT = pos[None, :] < lengths[:, None]
        # packed index of padded slot (n, t); padded slots point at token 0 and are zeroed.
        self.gather_NT = np.where(self.valid_NT, cu[:-1, None] + pos[None, :], 0)
        seq_of_token = np.repeat(np.arange(self.num_seqs), lengths)
        self.scatter_row = seq_of_token
        self.scatter_col = np.arange(cu[-1]) - cu[:-1][seq_of_token]

    def pad(self, x):
        """[1, T_total, ...] -> [N, T_max, ...], zeros after each sequence's end."""
        if x is None:
            return None
        rows = x[0][self.gather_NT]
        mask = self.valid_NT.reshape(*self.valid_NT.shape, *([1] * (rows.ndim - 2)))
        return jnp.where(mask, rows, jnp.zeros((), rows.dtype))

    def unpad(self, x):
        """[N, T_max, ...] -> [1, T_total, ...]."""
        return x[self.scatter_row, self.scatter_col][None]
