"""What `backend="pallas"` accepts, what `backend="auto"` hands to it, and the call itself."""

from __future__ import annotations

import jax.numpy as jnp

from lineattn.ops.gates import floor_gate
from lineattn.ops.pallas.common import is_pow2, on_gpu

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
GATES = ("none", "fixed", "head", "channel")  # a head gate is a channel gate equal across K (see SCALAR_GATE)

# What the GPU tests (tests/test_pallas*.py run on the H200, plus benchmarks/bench_pallas_*.py) cover: `auto`
# picks the kernels only inside this set, on a GPU. The defaults below (mml2 / kernels-saved) ran on the H200
# (2026-12-01 run5; again after the kernels changed: run7e/f, run8d, and run9b/d for the final settings) for KDA,
# GDN (scalar-gate kernels) and GLA at K = V = 128, bf16, chunk 64, T = 16381 with an initial state (run9b: KDA o
# 3.3e-3, GDN 3.1e-3, GLA 2.4e-3 of the 5e-3 budget), and in fp32 at K = V = 32, chunk 32 with -1000 gates, -5
# gates and varlen (run9a: the CPU suite's tests of those, compiled on the H200).
# DeltaNet passed too but at the edge (o 4.9e-3, run9b: no decay lets rounding accumulate), so `auto` keeps it on
# the XLA chunk path; K = 32 in bf16 and chunk 32 in bf16 have not run with these defaults on a GPU.
AUTO_RULES = (("delta", "channel"), ("delta", "head"), ("additive", "channel"))  # kda, gdn, gla
AUTO_DIMS = (128,)  # head dims the GPU tests of the defaults ran in bf16
AUTO_CHUNKS = (64,)

# The backward `backend="pallas"` uses (see `lineattn.ops.pallas.chunk`): "kernels-saved" (the forward keeps its
# intra-chunk terms; every stage a Pallas kernel; 7.25 ms fwd+bwd at 8 x 4096 x 16 x 128 on the H200, run9c),
# "kernels-mml2" (the same, recomputing the terms: no extra memory), "xla" (autodiff of the XLA chunk form,
# 40.7 ms); see `chunk.py`. Read when a call is traced.
BACKWARD = "kernels-saved"
# Gates equal across K (GDN's head gate, DeltaNet's none) through the scalar Gram kernels (`gram.gram_scalar`,
# `gram_bwd.gram_grads_scalar`: one program per chunk, the decay factored out of the products) instead of the
# per-channel ones with the gate broadcast over K (False). H200, GDN 8 x 4096 x 16 x 128 bf16 (run9a profile):
# kernels fwd 1.24 / fwd+bwd 5.68 ms against 2.10 / 7.08, the same errors against the fp32 XLA chunk form (o
# 3.1e-3, dg 4.1e-3 against 5.3e-3). Read when a call is traced.
SCALAR_GATE = True


def unsupported(rule, dtype, K: int, V: int, chunk_size) -> str | None:
    """Why the kernels cannot run this call, or None."""
    if rule.gate not in GATES:
        return f"gate {rule.gate!r} has no kernel (gates: {GATES})"
    if rule.normalize:
        return "the normalised rule (linear_attn) has no kernel"
    if jnp.dtype(dtype) not in DTYPES:
        return f"q must be bfloat16 or float32, got {jnp.dtype(dtype)}"
    if not (is_pow2(K) and 16 <= K <= 256 and is_pow2(V) and 16 <= V <= 256):
        return f"K and V must be powers of two in [16, 256], got K={K}, V={V}"
    if chunk_size not in (16, 32, 64):
        return f"chunk_size must be 16, 32 or 64, got {chunk_size}"
    return None


def auto_ok(rule, dtype, K, V, chunk_size) -> bool:
    """`auto` takes the kernels only on a GPU, for rules, dtypes and head dims the GPU tests cover."""
    return (on_gpu() and (rule.write, rule.gate) in AUTO_RULES and not rule.normalize and K in AUTO_DIMS
            and V in AUTO_DIMS and chunk_size in AUTO_CHUNKS and unsupported(rule, dtype, K, V, chunk_size) is None)


def _kernel_gate(g, shape, scalar=None):
    """The kernels' gate, fp32: [B, T, H, K] for a channel gate; for one equal across K (a head gate, or zeros
    for no gate) [B, T, H] when `scalar` (None: SCALAR_GATE; the scalar Gram kernels), else broadcast over K."""
    if g is None:
        g = jnp.zeros(shape[:3], jnp.float32)
    if g.ndim == 3 and not (SCALAR_GATE if scalar is None else scalar):
        g = jnp.broadcast_to(g[..., None], shape)
    return g.astype(jnp.float32)


def run(q, k, v, g, beta, *, scale: float, initial_state, chunk_size: int = 64):
    """Backend entry (`lineattn.ops.common` shapes; q, k, v in one dtype, beta bf16 or fp32, g fp32 or None; g may
    lie below `ops.LOG_GATE_FLOOR`: the kernels raise it, see `chunk.GATE_FLOOR`)."""
    from lineattn.ops.pallas import chunk

    if chunk.GATE_FLOOR == "xla":
        g = floor_gate(g)
    return chunk.chunk_pallas(q, k, v, _kernel_gate(g, q.shape), beta, initial_state, float(scale), chunk_size, None,
                              BACKWARD)


def run_checkpoints(q, k, v, g, beta, *, scale: float, initial_state, positions, chunk_size: int = 64):
    """`run` that also returns the states after `positions` tokens, [P, B, H, K, V] fp32 (see
    `lineattn.ops.pallas.checkpoints`; its in-chunk advance takes the per-channel gate)."""
    from lineattn.ops.pallas.checkpoints import chunk_pallas_checkpoints

    g = floor_gate(g)  # (in XLA: this serving path's in-chunk advance and backward read g too)
    return chunk_pallas_checkpoints(q, k, v, _kernel_gate(g, q.shape, scalar=False), beta, initial_state,
                                    float(scale), chunk_size, tuple(int(p) for p in positions), None)
