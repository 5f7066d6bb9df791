"""Decode: prefill + step equals one forward pass, for every mixer; padding, splitting, state contents, sampling."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from lineattn import decode
from lineattn.layers import KVCache, LinearState
from lineattn.models import HybridLM, ModelConfig
from test_models import tiny, tokens

MIXERS = ["attention", "attention_nope", "linear_attn", "norm_attn", "retnet", "simple_gla", "gla", "element",
          "deltanet", "delta_fixed", "gdn", "kda", "delta_element"]
HYBRID = ["kda", "kda", "kda", "attention"]
# fp32: a prefill runs the layers' chunk form, a step the recurrence, so logits and states agree to the fast paths'
# tolerance against the oracle (README, "Accuracy"; about 1e-6 seen).
TOL = 1e-4

# Jitted: one compile per shape beats op-by-op dispatch of the chunk path on CPU.
forward = nnx.jit(lambda model, x: model(x))
prefill = nnx.jit(decode.prefill)
step = nnx.jit(decode.step)
prefill_with_snapshots = nnx.jit(decode.prefill_with_snapshots, static_argnums=3)  # the checkpoints are static


def prefill_then_steps(model, x, prompt_len, max_len=None):
    state = decode.init_state(model, x.shape[0], max_len or x.shape[1])
    logits, state = prefill(model, x[:, :prompt_len], state)
    out = [logits]
    for t in range(prompt_len, x.shape[1]):
        step_logits, state = step(model, x[:, t], state)
        out.append(step_logits[:, None])
    return jnp.concatenate(out, axis=1), state


# (pattern, other ModelConfig fields): every mixer, the hybrid, the softplus gate, RoPE forced where rope is off
CASES = {**{m: ([m], {}) for m in MIXERS}, "hybrid_3to1": (HYBRID, {}),
         "kda_softplus": (["kda"], dict(gate_fn="softplus")), "gdn_softplus": (["gdn"], dict(gate_fn="softplus")),
         "attention_rope_with_rope_off": (["attention_rope", "attention"], dict(rope=False))}


@pytest.mark.parametrize("case", CASES)
def test_prefill_then_steps_equals_one_forward(case):
    # A 70-token prompt (not a multiple of the 64-token chunk), then 4 single-token steps.
    pattern, kwargs = CASES[case]
    model = HybridLM(tiny(pattern, **kwargs), rngs=nnx.Rngs(0))
    x = tokens(2, 74)
    incremental, state = prefill_then_steps(model, x, 70, max_len=80)
    assert rel_err(incremental, forward(model, x)) <= TOL
    assert int(state.slot) == 74


def test_prompts_of_different_lengths_in_one_batch():
    # Left-padded prefill with lengths, then steps: each row equals its request run alone.
    model = HybridLM(tiny(["kda", "attention", "gdn", "attention_nope"], num_kv_heads=1), rngs=nnx.Rngs(0))
    lengths, new = [70, 33, 5], 3
    seqs = [tokens(1, n + new, seed=i) for i, n in enumerate(lengths)]
    T0 = max(lengths)
    padded = jnp.concatenate([jnp.pad(s[:, :n], ((0, 0), (T0 - n, 0)), constant_values=7)
                              for s, n in zip(seqs, lengths)])
    state = decode.init_state(model, 3, T0 + new)
    logits, state = prefill(model, padded, state, lengths=jnp.array(lengths))
    last = [logits[:, -1]]
    for j in range(new):
        step_logits, state = step(model, jnp.concatenate([s[:, n + j] for s, n in zip(seqs, lengths)]), state)
        last.append(step_logits)
    np.testing.assert_array_equal(state.positions, np.array(lengths) + new)
    # Each request alone: one right-padded batch (causal, so the padding after a request cannot reach it).
    alone = forward(model, jnp.concatenate([jnp.pad(s, ((0, 0), (0, T0 - n))) for s, n in zip(seqs, lengths)]))
    for b, n in enumerate(lengths):
        assert rel_err(jnp.stack([l[b] for l in last]), alone[b, n - 1 : n + new]) <= TOL, f"request {b}"


def test_split_prefill_equals_one_prefill():
    model = HybridLM(tiny(HYBRID), rngs=nnx.Rngs(0))
    x = tokens(2, 50)
    one_logits, one = prefill(model, x, decode.init_state(model, 2, 64))
    state = decode.init_state(model, 2, 64)
    l1, state = prefill(model, x[:, :19], state)
    l2, state = prefill(model, x[:, 19:], state)
    assert rel_err(jnp.concatenate([l1, l2], axis=1), one_logits) <= TOL
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(one)):
        assert rel_err(a, b) <= TOL


def test_state_after_prefill_is_the_conv_inputs_and_the_oracle_state():
    cfg = tiny(["kda", "attention"])
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    oracle = HybridLM(ModelConfig(**{**cfg.__dict__, "backend": "recurrent"}), rngs=nnx.Rngs(0))
    x = tokens(2, 70)
    _, state = prefill(model, x, decode.init_state(model, 2, 70))
    _, oracle_state = prefill(oracle, x, decode.init_state(oracle, 2, 70))
    linear, kv = state.layers
    assert isinstance(linear, LinearState) and isinstance(kv, KVCache)
    # Conv state = the last W - 1 pre-conv inputs (the q/k/v projections of the normed embeddings).
    block = model.blocks[0]
    h = block.mixer_norm(model.embed(x))
    m = block.mixer
    pre_conv = jnp.concatenate([m.q_proj(h), m.k_proj(h), m.v_proj(h)], axis=-1)
    assert rel_err(linear.conv, pre_conv[:, -(cfg.conv_size - 1) :]) <= 1e-6
    assert linear.recurrent.dtype == jnp.float32
    assert rel_err(linear.recurrent, oracle_state.layers[0].recurrent) <= TOL


def test_state_size_per_layer():
    # width 32, 2 heads of K = V = 16, conv 4: a KDA layer holds the conv's last 3 inputs of q, k, v (3 x 2 x 48
    # fp32) and the state (2 x 16 x 16 fp32) at any context length; attention K and V (2 x 16 fp32 each) per slot.
    model = HybridLM(tiny(HYBRID), rngs=nnx.Rngs(0))
    for max_len in (1024, 4096):
        rows = decode.state_bytes(decode.init_state(model, 1, max_len))
        assert [r["kind"] for r in rows] == ["linear"] * 3 + ["attention"]
        assert [r["bytes"] for r in rows] == [4 * (3 * 2 * 48 + 2 * 16 * 16)] * 3 + [4 * 2 * 2 * 16 * max_len]


def test_greedy_generate_follows_the_model_and_handles_ragged_prompts():
    model = HybridLM(tiny(HYBRID), rngs=nnx.Rngs(0))
    prompts = tokens(2, 9)
    lengths = [9, 4]
    out = decode.generate(model, prompts, 6, prompt_lengths=lengths, temperature=0)
    assert out.shape == (2, 15)
    np.testing.assert_array_equal(out[:, :9], prompts)
    # Teacher-forced greedy choices on each generated sequence reproduce every generated token.
    seqs = jnp.stack([jnp.concatenate([prompts[b, :n], out[b, 9:], prompts[b, n:]]) for b, n in enumerate(lengths)])
    logits = forward(model, seqs)
    for b, n in enumerate(lengths):
        np.testing.assert_array_equal(jnp.argmax(logits[b, n - 1 : n + 5], axis=-1), out[b, 9:])
    # The padded request generates what it generates alone.
    alone = decode.generate(model, prompts[1:, :4], 6, temperature=0)
    np.testing.assert_array_equal(alone[0, 4:], out[1, 9:])


def test_sampling_filters():
    logits = jnp.log(jnp.array([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    keys = jax.random.split(jax.random.key(0), 20000)
    draw = jax.vmap(lambda k, **kw: decode.sample(logits, k, **kw)[0])
    counts = lambda ids: np.bincount(np.asarray(ids), minlength=5) / len(ids)
    np.testing.assert_array_equal(decode.sample(logits, keys[0], temperature=0), [0])
    np.testing.assert_array_equal(decode.sample(logits, keys[0], top_k=1), [0])
    # Plain, top-k = 3, and top-p = 0.8 (the smallest set reaching 0.8 is {0, 1, 2}); 4 sigma at n = 20000 < 0.015.
    np.testing.assert_allclose(counts(draw(keys)), [0.4, 0.3, 0.15, 0.1, 0.05], atol=0.015)
    top3 = np.array([0.4, 0.3, 0.15, 0, 0]) / 0.85
    np.testing.assert_allclose(counts(jax.vmap(lambda k: decode.sample(logits, k, top_k=3)[0])(keys)), top3,
                               atol=0.015)
    np.testing.assert_allclose(counts(jax.vmap(lambda k: decode.sample(logits, k, top_p=0.8)[0])(keys)), top3,
                               atol=0.015)


def test_bad_decode_inputs_raise():
    model = HybridLM(tiny(HYBRID), rngs=nnx.Rngs(0))
    state = decode.init_state(model, 2, 16)
    with pytest.raises(ValueError, match=r"lengths must be \[B\] = \[2\]"):
        decode.prefill(model, tokens(2, 4), state, lengths=jnp.array([4]))
    with pytest.raises(ValueError, match=r"token must be \[B\]"):
        decode.step(model, tokens(2, 1), state)
    with pytest.raises(ValueError, match="prompt_lengths must be"):
        decode.generate(model, tokens(2, 4), 3, prompt_lengths=[5, 2])
    with pytest.raises(ValueError, match="top_p must be in"):
        decode.generate(model, tokens(2, 4), 3, top_p=1.5)


@pytest.fixture(scope="module")
def hybrid():
    return HybridLM(tiny(HYBRID), rngs=nnx.Rngs(0))


def test_kv_cache_overflow_raises_and_an_exact_fill_matches_one_forward():
    # Past max_len the KV write used to clamp silently; filling the cache exactly still equals one forward pass.
    model = HybridLM(tiny(["attention"]), rngs=nnx.Rngs(0))
    x = tokens(1, 8)
    l1, state = prefill(model, x[:, :6], decode.init_state(model, 1, 8))
    with pytest.raises(ValueError, match="max_len = 8"):
        decode.prefill(model, x[:, :3], state)  # eager, so the slot (6) is checked
    with pytest.raises(ValueError, match="max_len = 8"):
        prefill(model, tokens(1, 9), decode.init_state(model, 1, 8))  # T alone is too long: caught under jit too
    l2, state = decode.prefill(model, x[:, 6:], state)
    assert rel_err(jnp.concatenate([l1, l2], axis=1), forward(model, x)) <= TOL
    with pytest.raises(ValueError, match="max_len = 8"):
        decode.step(model, x[:, 0], state)


@pytest.mark.parametrize("lengths", [[9], [0], [-2], [2.7]])
def test_lengths_must_be_ints_in_1_to_T(hybrid, lengths):
    with pytest.raises(ValueError, match="lengths must be"):
        decode.prefill(hybrid, tokens(1, 6), decode.init_state(hybrid, 1, 16), lengths=lengths)
    with pytest.raises(ValueError, match="prompt_lengths must be"):
        decode.generate(hybrid, tokens(1, 6), 2, prompt_lengths=lengths)


@pytest.mark.parametrize("bad_id", [64, -1])
def test_out_of_range_prompt_ids_raise_before_generate(hybrid, bad_id):
    with pytest.raises(ValueError, match="prompts"):
        decode.generate(hybrid, tokens(1, 4).at[0, 1].set(bad_id), 2, temperature=0)


BAD_SAMPLING = [dict(temperature=-1.0), dict(temperature=float("nan")), dict(temperature=float("inf")),
                dict(top_k=0), dict(top_k=65), dict(top_k=2.5), dict(top_p=0.0), dict(top_p=2.0),
                dict(top_p=float("nan"))]


@pytest.mark.parametrize("kwargs", BAD_SAMPLING, ids=lambda kw: "{}={}".format(*next(iter(kw.items()))))
def test_bad_sampling_parameters_raise(hybrid, kwargs):
    name = next(iter(kwargs))
    with pytest.raises(ValueError, match=name):
        decode.sample(jnp.zeros((1, 64)), jax.random.key(0), **kwargs)
    with pytest.raises(ValueError, match=name):
        decode.generate(hybrid, tokens(1, 4), 2, **kwargs)


def test_sampling_bounds_are_accepted():
    logits, key = jnp.log(jnp.array([[0.4, 0.3, 0.15, 0.1, 0.05]])), jax.random.key(1)
    np.testing.assert_array_equal(decode.sample(logits, key, top_k=5, top_p=1.0), decode.sample(logits, key))


@pytest.mark.parametrize("checkpoints", [[2.7], None, [7], [-1]])
def test_snapshot_checkpoints_must_be_ints_in_0_to_T(hybrid, checkpoints):
    with pytest.raises(ValueError, match="checkpoints"):
        decode.prefill_with_snapshots(hybrid, tokens(1, 6), decode.init_state(hybrid, 1, 16), checkpoints)


def test_mismatched_state_and_bad_shapes_raise(hybrid):
    x, state = tokens(1, 6), decode.init_state(hybrid, 1, 16)
    reordered = HybridLM(tiny(["attention", "kda", "kda", "kda"]), rngs=nnx.Rngs(0))  # as many layers
    single = HybridLM(tiny(["kda"]), rngs=nnx.Rngs(0))
    cases = [("state", lambda: decode.prefill(hybrid, x, decode.init_state(hybrid, 2, 16))),
             ("state", lambda: decode.prefill(hybrid, x, decode.init_state(reordered, 1, 16))),
             ("state", lambda: decode.prefill(hybrid, x, decode.init_state(single, 1, 16))),
             ("state", lambda: decode.step(hybrid, jnp.array([1, 2]), state)),
             ("tokens", lambda: decode.prefill(hybrid, x[0], state)),
             ("token", lambda: decode.step(hybrid, jnp.array([1.0]), state)),
             ("max_new_tokens", lambda: decode.generate(hybrid, x, 2.5))]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()


@pytest.mark.parametrize("mixer", ["kda", "gdn", "retnet", "gla"])
def test_pallas_decode_kernel_step_equals_the_oracle_step(mixer):
    # backend="pallas" sends one-token steps through the Pallas decode kernel (interpret mode on CPU); the state
    # after a prefill is taken from the oracle model, then one step each way.
    cfg = tiny([mixer, "attention"], head_dim=16)
    oracle = HybridLM(ModelConfig(**{**cfg.__dict__, "backend": "recurrent"}), rngs=nnx.Rngs(0))
    kernel = HybridLM(ModelConfig(**{**cfg.__dict__, "backend": "pallas"}), rngs=nnx.Rngs(0))
    mixer_layer = kernel.blocks[0].mixer
    assert mixer_layer._decode_kernel_ok(mixer_layer.rule, jnp.float32)  # the step below really runs the kernel
    x = tokens(2, 9)
    _, state = prefill(oracle, x[:, :8], decode.init_state(oracle, 2, 9))
    want_logits, want = step(oracle, x[:, 8], state)
    got_logits, got = step(kernel, x[:, 8], state)
    assert rel_err(got_logits, want_logits) <= 1e-5
    assert rel_err(got.layers[0].recurrent, want.layers[0].recurrent) <= 1e-5


@pytest.mark.parametrize("mixer", ["kda", "gdn"])
def test_pallas_verify_block_through_the_decode_kernel(mixer):
    # A speculative verify block (5 tokens from a state, the state after each kept) on a backend="pallas" model
    # runs the decode kernel with output_states (interpret mode on CPU): logits and every snapshot equal the
    # oracle model's.
    cfg = tiny([mixer, "attention"], head_dim=16)
    oracle = HybridLM(ModelConfig(**{**cfg.__dict__, "backend": "recurrent"}), rngs=nnx.Rngs(0))
    kernel = HybridLM(ModelConfig(**{**cfg.__dict__, "backend": "pallas"}), rngs=nnx.Rngs(0))
    assert kernel.blocks[0].mixer._decode_kernel_ok(kernel.blocks[0].mixer.rule, jnp.float32)
    x = tokens(2, 13)
    _, state = prefill(oracle, x[:, :8], decode.init_state(oracle, 2, 13))
    with jax.default_matmul_precision("highest"):
        want_logits, want_state, want = prefill_with_snapshots(oracle, x[:, 8:], state, tuple(range(6)))
        got_logits, got_state, got = prefill_with_snapshots(kernel, x[:, 8:], state, tuple(range(6)))
    assert rel_err(got_logits, want_logits) <= 1e-5
    assert rel_err(got[0].recurrent, want[0].recurrent) <= 1e-5
    assert rel_err(got_state.layers[0].recurrent, want_state.layers[0].recurrent) <= 1e-5


def test_pallas_prefill_snapshots_equal_the_oracle_models():
    # backend="pallas": the prefill's chunk kernels export the linear layers' states at the checkpoints (interpret
    # mode on CPU); they equal the oracle model's states after that many tokens, conv windows included.
    cfg = tiny(["kda", "attention"], head_dim=16)
    oracle = HybridLM(ModelConfig(**{**cfg.__dict__, "backend": "recurrent"}), rngs=nnx.Rngs(0))
    kernel = HybridLM(ModelConfig(**{**cfg.__dict__, "backend": "pallas"}), rngs=nnx.Rngs(0))
    x = tokens(2, 100)
    checkpoints = (0, 7, 64, 83, 100)  # chunk 64: inside the first chunk, its end, inside the ragged second one
    # On a GPU the models' own fp32 matmuls default to TF32, which alone moves the logits by ~2e-4 (H200 run,
    # 2026-12-01: 1.8e-4 at the default precision, pass at "highest"); the ops already use HIGHEST.
    with jax.default_matmul_precision("highest"):
        got_logits, _, got = prefill_with_snapshots(kernel, x, decode.init_state(kernel, 2, 100), checkpoints)
        want_logits, _, want = prefill_with_snapshots(oracle, x, decode.init_state(oracle, 2, 100), checkpoints)
    assert rel_err(got_logits, want_logits) <= TOL
    for i, p in enumerate(checkpoints):
        assert rel_err(got[0].recurrent[i], want[0].recurrent[i]) <= TOL, f"recurrent state after {p} tokens"
        assert rel_err(got[0].conv[i], want[0].conv[i]) == 0.0, f"conv window after {p} tokens"
