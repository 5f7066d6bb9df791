"""lineattn's conventions (log gate, default scale, [K, V] state, gradients) against flash-linear-attention.

The case was computed by FLA 0.6.0's chunk_kda on an H200 with TF32 dots, so FLA is itself ~2e-3 off the exact
result; tolerance 5e-3 relative max error (relative to the reference's max |value|).
"""

from __future__ import annotations

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import rel_err
from lineattn import ops

# ../shared beside the checkout; LINEATTN_SHARED points elsewhere (the GPU machine gets a carried copy).
SHARED = Path(os.environ.get("LINEATTN_SHARED", Path(__file__).resolve().parents[2] / "shared"))
REF = SHARED / "fla_reference" / "ref_kda_T200.npz"


@pytest.mark.parametrize("backend", ["chunk", "scan", "recurrent"])
def test_chunk_kda_reproduces_fla(backend):
    if not REF.exists():
        pytest.fail(f"FLA reference case missing: {REF} (../shared beside the checkout)")
    ref = np.load(REF)
    names = ["q", "k", "v", "g", "beta", "h0"]
    args = [jnp.asarray(ref["in_" + n]) for n in names]

    def loss(q, k, v, g, beta, h0):
        o, ht = ops.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend=backend)
        return jnp.sum(o * ref["in_do"]) + jnp.sum(ht * ref["in_dht"]), (o, ht)

    (_, (o, ht)), grads = jax.jit(jax.value_and_grad(loss, argnums=tuple(range(6)), has_aux=True))(*args)
    got = {"o": o, "ht": ht, **{"d" + n: gr for n, gr in zip(names, grads)}}
    errors = {n: rel_err(got[n], ref[n]) for n in got}
    assert max(errors.values()) <= 5e-3, errors
