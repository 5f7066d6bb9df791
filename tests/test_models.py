"""Layers and the hybrid LM: packing, conv, config and input errors, gradients, bf16."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import rel_err
from lineattn import ops
from lineattn.layers import Attention, LinearAttention, ShortConv
from lineattn.models import HybridLM, ModelConfig, count_params, flops_per_token


def tiny(pattern, num_layers=None, **kw):
    kw = {"vocab_size": 64, "width": 32, "num_heads": 2, **kw}
    return ModelConfig(num_layers=num_layers or len(pattern), layer_pattern=tuple(pattern), **kw)


def tokens(B, T, vocab=64, seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, (B, T)), jnp.int32)


@nnx.jit
def forward(model, x, segment_ids=None):
    return model(x, segment_ids=segment_ids)


# One mixer per gate granularity and write mode, and the two classic variants.
PACKING_MIXERS = ["attention", "linear_attn", "norm_attn", "retnet", "simple_gla", "gla", "element", "deltanet",
                  "delta_fixed", "gdn", "kda", "delta_element"]


@pytest.mark.parametrize("mixer", PACKING_MIXERS)
def test_packed_documents_do_not_see_each_other(mixer):
    # Three documents packed in one row (lengths 30, 47, 23, the middle one crossing the 64-token chunk edge)
    # give the same logits as each document alone.
    model = HybridLM(tiny([mixer]), rngs=nnx.Rngs(0))
    lengths = [30, 47, 23]
    docs = [tokens(1, n, seed=i) for i, n in enumerate(lengths)]
    segment_ids = jnp.concatenate([jnp.full((1, n), i + 1, jnp.int32) for i, n in enumerate(lengths)], axis=1)
    packed = forward(model, jnp.concatenate(docs, axis=1), segment_ids)
    # Each document alone: one batch, right-padded (causal, so padding after a document cannot reach it).
    batch = jnp.concatenate([jnp.pad(d, ((0, 0), (0, max(lengths) - n))) for d, n in zip(docs, lengths)])
    out = forward(model, batch)
    alone = jnp.concatenate([out[i : i + 1, :n] for i, n in enumerate(lengths)], axis=1)
    assert rel_err(packed, alone) <= 1e-4  # fp32 fast paths' tolerance (README, "Accuracy"); ~1e-6 seen


def test_short_conv_matches_direct_convolution_and_carries_state():
    conv = ShortConv(6, 4, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 11, 6))
    w = np.asarray(conv.weight[...])
    xp = np.concatenate([np.zeros((2, 3, 6)), np.asarray(x)], axis=1)
    direct = sum(w[j] * xp[:, j : j + 11] for j in range(4))
    expected = direct / (1 + np.exp(-direct))
    y, _ = conv(x)
    assert rel_err(y, expected) <= 1e-6
    # In two pieces through the state: same outputs, and the state is the last W - 1 inputs.
    y1, s1 = conv(x[:, :5], state=conv.init_state(2))
    y2, s2 = conv(x[:, 5:], state=s1)
    assert rel_err(jnp.concatenate([y1, y2], axis=1), expected) <= 1e-6
    np.testing.assert_array_equal(s2, x[:, -3:])


def test_every_parameter_gets_a_gradient():
    cfg = tiny(["kda", "gdn", "element", "attention"], num_kv_heads=1)
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    x = tokens(2, 40)

    def loss(model):
        logits = model(x[:, :-1])
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), x[:, 1:, None], axis=-1))

    grads = nnx.jit(nnx.grad(loss))(model)
    for path, g in jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(grads)):
        assert np.all(np.isfinite(g)), path
        assert np.max(np.abs(g)) > 0, f"no gradient reaches {jax.tree_util.keystr(path)}"


def test_bf16_compute_tracks_fp32():
    cfg = tiny(["kda", "kda", "kda", "attention"])
    x = tokens(2, 70)
    fp32 = forward(HybridLM(cfg, rngs=nnx.Rngs(0)), x)
    bf16 = forward(HybridLM(ModelConfig(**{**cfg.__dict__, "dtype": "bfloat16"}), rngs=nnx.Rngs(0)), x)
    assert bf16.dtype == jnp.float32
    assert rel_err(bf16, fp32) <= 3e-2


def test_layer_pattern_repeats_and_accepts_pairs():
    cfg = ModelConfig(vocab_size=8, width=16, num_layers=5, num_heads=2,
                      layer_pattern=["kda", ["additive", "channel"], "attention_nope"])
    assert cfg.mixers == ("kda", ("additive", "channel"), "attention_nope", "kda", ("additive", "channel"))
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    assert model.blocks[1].mixer.rule == ops.Rule("additive", "channel")
    assert not model.blocks[2].mixer.rope


def test_param_count_and_flops():
    cfg = ModelConfig(vocab_size=50, width=32, num_layers=2, num_heads=2, layer_pattern=("gdn", "attention"),
                      conv_size=4, mlp_ratio=2.0)
    model = HybridLM(cfg, rngs=nnx.Rngs(0))
    D, H, K, F = 32, 2, 16, 64
    norms = 2 * D * 2 + D  # two per block, the final one
    mlp = 3 * D * F
    gdn = (D * H * K * 3 + 4 * H * 3 * K  # q, k, v projections and the conv taps
           + D * H + D * H + 2 * H  # beta and gate projections, A_log and dt_bias
           + K + D * K + K * H * K + H * K * D)  # o_norm, output gate (low rank), output projection
    attention = 4 * D * H * K
    assert count_params(model) == 50 * D + norms + 2 * mlp + gdn + attention
    # Attention FLOPs grow with the context, the linear layer's do not.
    assert flops_per_token(cfg, 2048) - flops_per_token(cfg, 1024) == pytest.approx(3 * 4 * H * K * 1024 / 2)


def test_mlp_ratio_zero_means_no_mlp():
    # mlp_ratio 0: blocks are norm + mixer only. No MLP (or MLP norm) parameters, FLOPs without the MLP matmuls,
    # and the forward of a model with an MLP whose output projection is zero (the ablation runner's old zero MLP).
    pattern, x = ("gdn", "attention"), tokens(2, 40)
    bare = HybridLM(tiny(pattern, mlp_ratio=0), rngs=nnx.Rngs(1))
    full = HybridLM(tiny(pattern, mlp_ratio=2.0), rngs=nnx.Rngs(0))
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(nnx.state(bare, nnx.Param))]
    assert paths and not any("mlp" in p for p in paths)
    D, F, L = 32, 64, 2
    assert count_params(full) - count_params(bare) == L * (3 * D * F + D)   # SwiGLU and its norm, per block
    assert flops_per_token(full.cfg, 128) - flops_per_token(bare.cfg, 128) == pytest.approx(3 * L * 2 * 3 * D * F)

    nnx.update(full, nnx.state(bare, nnx.Param))                 # every shared parameter from the bare model
    for block in full.blocks:
        block.mlp.down.kernel[...] = 0.0
    want = forward(full, x)
    assert rel_err(forward(bare, x), want) == 0.0
    assert rel_err(forward(HybridLM(tiny(pattern, mlp_ratio=2.0), rngs=nnx.Rngs(0)), x), want) > 1e-2

    grads = nnx.jit(nnx.grad(lambda m: jnp.mean(m(x) ** 2)))(bare)  # the mixers still train
    assert all(np.max(np.abs(g)) > 0 for g in jax.tree.leaves(grads))


def test_mlp_hidden():
    assert tiny(["kda"], mlp_ratio=0).mlp_hidden == 0 and not tiny(["kda"], mlp_ratio=0).has_mlp
    assert tiny(["kda"], mlp_ratio=8 / 3).mlp_hidden == 88          # 85.3 rounded up to a multiple of 8
    assert tiny(["kda"], mlp_ratio=0.001).mlp_hidden == 8           # a tiny positive ratio still has an MLP


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(width=30, num_heads=4), "width \\(30\\) must be divisible by num_heads"),
        (dict(layer_pattern=("kda", "mamba")), "unknown mixer 'mamba'"),
        (dict(layer_pattern=(("delta", "diagonal"),)), "gate granularity"),
        (dict(layer_pattern=()), "layer_pattern must be a non-empty"),
        (dict(num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(num_layers=0), "num_layers must be a positive int"),
        (dict(gate_fn="relu"), "gate_fn"),
        (dict(mlp_ratio=-1.0), "mlp_ratio must be a finite number >= 0"),
        (dict(mlp_ratio=float("nan")), "mlp_ratio must be a finite number >= 0"),
        (dict(mlp_ratio=float("inf")), "mlp_ratio must be a finite number >= 0"),
        (dict(rope_theta=0.0), "rope_theta must be a finite number > 0"),
        (dict(rope_theta=-5.0), "rope_theta must be a finite number > 0"),
        (dict(rope_theta="1e4"), "rope_theta must be a finite number > 0"),
        (dict(lower_bound=float("-inf")), "lower_bound must be a finite number < 0"),
        (dict(lower_bound=0.0), "lower_bound must be a finite number < 0"),
        # bools are not ints, and only bools are bools (the YAML loader's rules, for direct construction too)
        (dict(head_dim=True), "head_dim must be a positive int or None, got True"),
        (dict(head_v_dim=True), "head_v_dim must be a positive int or None, got True"),
        (dict(num_kv_heads=True), "num_kv_heads must be a positive int or None, got True"),
        (dict(conv_size=True), "conv_size must be an int >= 0, got True"),
        (dict(rope="no"), "rope must be True or False"),
        (dict(tie_embeddings="false"), "tie_embeddings must be True or False"),
        (dict(dtype="float8"), "dtype must be one of"),
        (dict(backend="cuda"), "backend must be one of"),
    ],
)
def test_bad_configs_name_the_field(kwargs, match):
    base = dict(vocab_size=64, width=32, num_layers=2, num_heads=4)
    with pytest.raises(ValueError, match=match):
        ModelConfig(**{**base, **kwargs})


def test_bad_inputs_raise():
    model = HybridLM(tiny(["kda", "attention"]), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, 64\)"):
        model(jnp.array([[1, 64]]))
    bad = jnp.array([[1, 64]])  # concrete tokens closed over inside a jit are still checked (not traced)
    with pytest.raises(ValueError, match=r"tokens must be ids in \[0, 64\)"):
        nnx.jit(lambda m: m(bad))(model)
    # Under jit ids are not checked: an out-of-range one gets NaN logits (a negative one no longer wraps around).
    under_jit = nnx.jit(lambda m, t: m(t))
    for ids, finite in (([[-1]], False), ([[64]], False), ([[63]], True)):
        assert bool(np.isfinite(under_jit(model, jnp.array(ids))).all()) == finite, ids
    with pytest.raises(ValueError, match=r"tokens must be an integer array \[B, T\]"):
        model(jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"tokens must be an integer array"):
        model(jnp.ones((1, 3)))
    with pytest.raises(ValueError, match="segment_ids must be an integer array of shape"):
        model(tokens(1, 5), segment_ids=jnp.ones((1, 4), jnp.int32))


@pytest.mark.parametrize("make, match", [
    (lambda r: LinearAttention(16, 0, 8, 8, "kda", rngs=r), "num_heads must be a positive int"),
    (lambda r: LinearAttention(0, 2, 8, 8, "kda", rngs=r), "width must be a positive int"),
    (lambda r: LinearAttention(16, 2, -1, 8, "kda", rngs=r), "head_k_dim must be a positive int"),
    (lambda r: LinearAttention(16, 2, 8, 0, "kda", rngs=r), "head_v_dim must be a positive int"),
    (lambda r: LinearAttention(16, 2, 8, 8, "kda", conv_size=-2, rngs=r), "conv_size must be an int >= 0"),
    (lambda r: LinearAttention(16, 2, 8, 8, "kda", lower_bound=1.0, rngs=r), "lower_bound must be a finite"),
    (lambda r: Attention(16, 2, 0, 8, rngs=r), "num_kv_heads must be a positive int"),
    (lambda r: Attention(16, 2, 3, 8, rngs=r), "multiple of num_kv_heads"),
    (lambda r: Attention(16, 2, 1, 7, rngs=r), "head_dim must be even with rope"),
    (lambda r: Attention(16, 2, 1, 8, rope_theta=0.0, rngs=r), "rope_theta must be a finite number > 0"),
    (lambda r: ShortConv(8, 0, rngs=r), "kernel_size must be a positive int"),
])
def test_layer_constructors_check_sizes(make, match):
    with pytest.raises(ValueError, match=match):
        make(nnx.Rngs(0))


def test_layer_calls_check_input_state_and_segment_shapes():
    la = LinearAttention(16, 2, 8, 8, "kda", rngs=nnx.Rngs(0))  # conv state [B, 3, 2 * (8 + 8 + 8)]
    x, state = jnp.ones((1, 6, 16)), la.init_state(1)
    for bad in (jnp.ones((1, 6, 12)), jnp.ones((6, 16))):
        with pytest.raises(ValueError, match=r"x must be \[B, T, width\] = \[B, T, 16\]"):
            la(bad)
    for conv in (jnp.zeros((1, 2, 48)), jnp.zeros((1, 3, 40)), jnp.zeros((2, 3, 48)), None):
        with pytest.raises(ValueError, match="state.conv"):
            la(x, state=state._replace(conv=conv))
    with pytest.raises(ValueError, match=r"state.recurrent must be \[B, H, K, V\] = \[1, 2, 8, 8\]"):
        la(x, state=state._replace(recurrent=jnp.zeros((1, 2, 8, 4))))
    with pytest.raises(ValueError, match="segment_ids must be an integer array of shape"):
        la(x, segment_ids=jnp.ones((1, 5), jnp.int32))
    with pytest.raises(ValueError, match="checkpoints need a state"):
        la(x, checkpoints=(2,))
    conv = ShortConv(8, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"x must be \[B, T, C\] = \[B, T, 8\]"):
        conv(jnp.ones((1, 6, 5)))
    with pytest.raises(ValueError, match=r"state must be \[B, W - 1, C\] = \[1, 3, 8\]"):
        conv(jnp.ones((1, 6, 8)), state=jnp.zeros((1, 2, 8)))
    at = Attention(16, 2, 1, 8, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"positions must be \[B, T\]"):
        at(x, positions=jnp.arange(5)[None])
    with pytest.raises(ValueError, match="x must be"):
        at(jnp.ones((1, 6, 12)), positions=jnp.arange(6)[None])
