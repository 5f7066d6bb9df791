"""Token-level `lax.scan` oracle for every rule, in fp32: the ground truth for the fast paths."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from lineattn.ops.common import einsum, log_decay_as_state


def recurrent(q, k, v, g, beta, *, scale: float, initial_state: jax.Array):
    """Runs the rule one token at a time (see `lineattn.ops.common` for the shapes).

    One step: decay S, then (delta) write b_t k_t (v_t - S^T k_t)^T or (additive) k_t v_t^T,
    then read o_t = scale * S^T q_t.
    """
    log_decay = log_decay_as_state(g)
    time_major = lambda x: None if x is None else jnp.moveaxis(x, 1, 0)
    xs = tuple(map(time_major, (q, k, v, log_decay, beta)))

    def step(S_BHKV, x):
        q_BHK, k_BHK, v_BHV, log_decay_t, beta_BH = x
        if log_decay_t is not None:
            S_BHKV = jnp.exp(log_decay_t) * S_BHKV
        if beta_BH is None:
            write_BHV = v_BHV
        else:
            recalled_BHV = einsum("bhkv,bhk->bhv", S_BHKV, k_BHK)
            write_BHV = beta_BH[..., None] * (v_BHV - recalled_BHV)
        S_BHKV = S_BHKV + einsum("bhk,bhv->bhkv", k_BHK, write_BHV)
        o_BHV = scale * einsum("bhkv,bhk->bhv", S_BHKV, q_BHK)
        return S_BHKV, o_BHV

    final_state, o_TBHV = jax.lax.scan(step, initial_state, xs)
    return jnp.moveaxis(o_TBHV, 0, 1), final_state
