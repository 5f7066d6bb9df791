"""States at chosen positions from one forward pass equal the oracle's states after that many tokens."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import make_inputs, rel_err
from lineattn import ops

# Chunk starts and ends, inside chunks, the first and last token, and the initial state (64-token chunks, T = 150).
POSITIONS = [0, 1, 37, 64, 100, 128, 149, 150]
ARGS = ("q", "k", "v", "g", "beta", "initial_state")


def attention(rule, x, **kwargs):
    """`ops.linear_attention(rule, ...)` on the inputs x, under `jax.jit` (one compile, where eagerly every op of
    the chunk path compiles on its own)."""
    run = lambda q, k, v, g, beta, h0: ops.linear_attention(rule, q, k, v, g, beta, initial_state=h0, **kwargs)
    return jax.jit(run)(*(x[n] for n in ARGS))


@functools.partial(jax.jit, static_argnums=(0, 2))
def oracle_state_after(rule, x, p):
    """The oracle's state after the first p tokens (a fixed gate [H] is not per token), jitted (one compile per rule,
    shapes and p, shared by the tests on the same inputs)."""
    if p == 0:
        return x["initial_state"]
    first = lambda a: a if a is None or a.ndim == 1 else a[:, :p]
    args = (first(x[n]) for n in ("q", "k", "v", "g", "beta"))
    _, state = ops.linear_attention(rule, *args, initial_state=x["initial_state"], output_final_state=True,
                                    backend="recurrent")
    return state


@pytest.mark.parametrize("rule, backend", [(r, "chunk") for r in ("kda", "gdn", "deltanet", "gla", "simple_gla",
                                                                  "retnet", "linear_attn")]
                         + [("kda", "recurrent"), ("delta_element", "auto"), ("element", "auto")])
def test_checkpoints_equal_the_oracle_states(rule, backend):
    x = make_inputs(rule, B=2, T=150, H=2, K=32, V=24)
    o, final, states = attention(rule, x, output_final_state=True, checkpoint_positions=POSITIONS, backend=backend)
    assert states.shape == (len(POSITIONS), *final.shape)
    for i, p in enumerate(POSITIONS):
        assert rel_err(states[i], oracle_state_after(rule, x, p)) <= 2e-5, f"position {p}"
    o_plain, _ = attention(rule, x, backend="recurrent")
    assert rel_err(o, o_plain) <= 2e-5


def test_checkpoint_positions_are_checked():
    x = make_inputs("kda", B=1, T=20)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match=r"ints in \[0, T = 20\]"):
        ops.linear_attention("kda", *args, checkpoint_positions=[5, 21])
    with pytest.raises(ValueError, match="at least one position"):  # (the recurrent backend failed to stack none)
        ops.linear_attention("kda", *args, checkpoint_positions=[], backend="recurrent")
    with pytest.raises(ValueError, match="cannot export states"):
        ops.linear_attention("kda", *args, checkpoint_positions=[5], backend="scan")
    with pytest.raises(ValueError, match="cu_seqlens"):
        ops.linear_attention("kda", *args, checkpoint_positions=[5], cu_seqlens=[0, 10, 20])


@pytest.mark.parametrize("rule", ["kda", "gdn", "deltanet", "gla"])
def test_pallas_checkpoints_equal_the_oracle_states(rule):
    """The Pallas state pass exports chunk-start states; the in-chunk advance uses the kernels' W and U."""
    x = make_inputs(rule, B=2, T=150, H=2, K=32, V=16)
    o, final, states = attention(rule, x, output_final_state=True, checkpoint_positions=POSITIONS, backend="pallas")
    for i, p in enumerate(POSITIONS):
        assert rel_err(states[i], oracle_state_after(rule, x, p)) <= 2e-5, f"position {p}"
    o_ref, final_ref = attention(rule, x, output_final_state=True, backend="recurrent")
    assert rel_err(o, o_ref) <= 2e-5 and rel_err(final, final_ref) <= 2e-5


def test_pallas_checkpoints_bf16_and_gradients():
    """bf16 inputs: states within FLA's relative-RMS tolerance of the fp32 oracle; the gradient of a loss on the
    exported states equals the chunk form's (same positions, fp32)."""
    x = make_inputs("kda", B=1, T=100, H=2, K=32, V=32)
    positions = [0, 37, 64, 100]
    rms = lambda a, b: float(np.sqrt(np.mean((np.asarray(a) - np.asarray(b)) ** 2) / np.mean(np.asarray(b) ** 2)))
    bf = {n: x[n].astype(jnp.bfloat16) for n in ("q", "k", "v", "beta")}
    _, _, states = attention("kda", dict(x, **bf), checkpoint_positions=positions, backend="pallas")
    rounded = dict(x, **{n: b.astype(jnp.float32) for n, b in bf.items()})
    for i, p in enumerate(positions):
        assert rms(states[i], oracle_state_after("kda", rounded, p)) <= 5e-3, f"position {p}"

    weights = jax.random.normal(jax.random.key(0), (len(positions), 1, 2, 32, 32))

    def loss(backend, q, k, v, g, beta, h0):
        _, _, s = ops.linear_attention("kda", q, k, v, g, beta, initial_state=h0, checkpoint_positions=positions,
                                       backend=backend)
        return jnp.sum(s * weights)

    args = [x[n] for n in ("q", "k", "v", "g", "beta", "initial_state")]
    grads = jax.jit(jax.grad(lambda *a: loss("pallas", *a), argnums=tuple(range(6))))(*args)
    grads_ref = jax.jit(jax.grad(lambda *a: loss("recurrent", *a), argnums=tuple(range(6))))(*args)
    for name, got, want in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads, grads_ref):
        assert rel_err(got, want) <= 1e-4, name


def test_pallas_checkpoints_lower_for_sm90(fake_h200):
    """The state pass with exported chunk states (a `pl.when` per exported chunk) lowers to Triton IR for sm_90."""
    from lineattn.ops.pallas.checkpoints import chunk_pallas_checkpoints

    S = jax.ShapeDtypeStruct
    B, T, H, K, V = 1, 150, 2, 128, 128
    args = (S((B, T, H, K), jnp.bfloat16), S((B, T, H, K), jnp.bfloat16), S((B, T, H, V), jnp.bfloat16),
            S((B, T, H, K), jnp.float32), S((B, T, H), jnp.bfloat16), S((B, H, K, V), jnp.float32))
    f = lambda *a: chunk_pallas_checkpoints(*a, K**-0.5, 64, tuple(POSITIONS), False)
    text = jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    # Gram (forming the gate's cumsum itself, `gram.GRAM_FORMS_G`), its exact fix-up, solve, the inversion of A's
    # diagonal blocks (`solve.DIAG_INVERSE`), the state pass
    assert text.count("__gpu$xla.gpu.triton") == 5
    assert "lineattn_chunk_gram_g" in text and "lineattn_chunk_cumsum" not in text


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (the compiled kernels at K = V = 128)")
@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_pallas_checkpoints_on_gpu_bf16_head_dim_128(rule):
    positions = [0, 1, 64, 700, 1023, 1984, 2000]
    x = make_inputs(rule, B=2, T=2000, H=2, K=128, V=128, seed=3)
    bf = {n: x[n].astype(jnp.bfloat16) for n in ("q", "k", "v", "beta")}
    _, _, states = ops.linear_attention(rule, bf["q"], bf["k"], bf["v"], x["g"], bf["beta"],
                                        initial_state=x["initial_state"], checkpoint_positions=positions,
                                        backend="pallas")
    rounded = dict(x, **{n: b.astype(jnp.float32) for n, b in bf.items()})
    _, _, want = ops.linear_attention(rule, *(rounded[n] for n in ("q", "k", "v", "g", "beta")),
                                      initial_state=x["initial_state"], checkpoint_positions=positions,
                                      backend="chunk")
    for i, p in enumerate(positions):
        err = float(np.sqrt(np.mean((np.asarray(states[i]) - np.asarray(want[i])) ** 2) / np.mean(np.asarray(want[i]) ** 2)))
        print(rule, p, f"{err:.1e}")
        assert err <= 5e-3, f"position {p}: relative RMS {err:.1e}"
