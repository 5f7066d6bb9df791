"""The blockwise (I + A)^-1 against float64 NumPy inversion."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from lineattn.ops.triangular import unit_lower_inverse


@pytest.mark.parametrize("C", [16, 32, 64, 128])
def test_unit_lower_inverse_matches_numpy(C):
    rng = np.random.default_rng(C)
    k = rng.standard_normal((3, C, 32))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    # The delta rule's A: beta_i k_i . k_j below the diagonal (|A_ij| <= 1).
    A = np.tril(np.einsum("bik,bjk->bij", k, k), -1) * rng.uniform(0, 1, (3, C, 1))
    L = A + np.eye(C)
    X = unit_lower_inverse(jnp.asarray(L, jnp.float32))
    expected = np.linalg.inv(L)
    assert rel_err(X, expected) < 1e-5
    assert np.allclose(np.triu(np.asarray(X), 1), 0)  # stays lower triangular


def test_unit_lower_inverse_rejects_sizes_that_do_not_halve_to_16():
    with pytest.raises(ValueError, match="C = 16"):
        unit_lower_inverse(jnp.eye(48))
