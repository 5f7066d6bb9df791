"""What `backend="pallas"` accepts, what `backend="auto"` hands to it, and the call itself."""

from __future__ import annotations

import jax.numpy as jnp

from lineattn.ops.pallas.common import is_pow2, on_gpu

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
GATES = ("none", "fixed", "head", "channel")  # a head gate is a channel gate equal across K

# What the GPU tests (tests/test_pallas*.py run on the H200, plus benchmarks/bench_pallas_kda.py) cover: `auto`
# picks the kernels only inside this set, on a GPU.
AUTO_RULES = (("delta", "channel"), ("delta", "head"), ("delta", "none"), ("additive", "channel"))  # kda gdn deltanet gla
AUTO_DIMS = (32, 128)  # head dims the GPU tests ran: K = V = 32 (fp32, bf16), K = V = 128 (bf16, T = 16384)
AUTO_CHUNKS = (32, 64)

# The backward `backend="pallas"` uses (see `lineattn.ops.pallas.chunk`): "kernels" (no XLA autodiff; the
# fastest on the H200, 29.8 vs 40.7 ms fwd+bwd at 8 x 4096), "xla" (autodiff of the XLA chunk form) or "passes"
# (Pallas state passes, XLA autodiff of the intra-chunk terms; timed on the H200, not in its tests). Read when a
# call is traced.
BACKWARD = "kernels"
# The forward's intra-chunk stage: "split" (a program per 16-row block, then one per chunk for the solve, 2 warps;
# the faster on the H200: 5.0 vs 8.3 ms at 8 x 4096) or "fused" (one program per chunk). Both GPU-tested.
INTRA = "split"


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
    return (on_gpu() and (rule.write, rule.gate) in AUTO_RULES and not rule.normalize and K in AUTO_DIMS and V in AUTO_DIMS
            and chunk_size in AUTO_CHUNKS and unsupported(rule, dtype, K, V, chunk_size) is None)


def _channel_gate(g, shape):
    """The kernels' gate: [B, T, H, K] fp32 (no gate: zeros; a head gate: equal across K)."""
    if g is None:
        return jnp.zeros(shape, jnp.float32)
    return jnp.broadcast_to(g[..., None] if g.ndim == 3 else g, shape).astype(jnp.float32)


def run(q, k, v, g, beta, *, scale: float, initial_state, chunk_size: int = 64):
    """Backend entry (`lineattn.ops.common` shapes; q, k, v, beta in one dtype, g fp32 or None)."""
    from lineattn.ops.pallas.chunk import chunk_pallas

    return chunk_pallas(q, k, v, _channel_gate(g, q.shape), beta, initial_state, float(scale), chunk_size, None,
                        BACKWARD, INTRA)


def run_checkpoints(q, k, v, g, beta, *, scale: float, initial_state, positions, chunk_size: int = 64):
    """`run` that also returns the states after `positions` tokens, [P, B, H, K, V] fp32 (see
    `lineattn.ops.pallas.checkpoints`)."""
    from lineattn.ops.pallas.checkpoints import chunk_pallas_checkpoints

    return chunk_pallas_checkpoints(q, k, v, _channel_gate(g, q.shape), beta, initial_state, float(scale),
                                    chunk_size, tuple(int(p) for p in positions), None, INTRA)
