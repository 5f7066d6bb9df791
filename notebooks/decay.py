# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
# ---

# %% [markdown]
# # Decay: how long a written key-value pair survives under each gate granularity
#
# A pair written at step `t` is read at step `t + d` through the product of the gates in between:
# `S_{t+d}^T q` holds it with weight `prod_{s=t+1}^{t+d} alpha_s` — a scalar per head (`fixed`, `head`), a vector
# over key channels (`channel`: every key channel forgets at its own rate), or a matrix (`element`). That product,
# as a function of the distance `d`, is the rule's *relative-position weighting*: what RoPE does for attention,
# the gates do for linear attention.
#
# 1. Impulse responses with synthetic gates, run through `lineattn.ops` and checked against the closed form.
# 2. Decay spectra (half-lives per key channel) of KDA's gate at initialisation.
# 3. Trained gates from the language models of the LM ablation (`configs/ablate_lm.yaml`): the half-life
#    spectrum per layer and the distance -> weight curve on held-out text.
#
# Size knob: `LINEATTN_NB_SIZE=small` (CI) or `full` (default). Part 3 reads the trained models' run directories
# at `full` size (`LINEATTN_NB_LM_RUNS`, default `runs/ablate/ablate_lm`) and saves what it measures to
# `notebooks/data/trained_gates.npz`; at `small` size it reads that file.

# %%
from _common import DATA, SMALL, save

import os
from pathlib import Path

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np

from lineattn import ops
from lineattn.layers.linear_attention import _init_A_log, _init_dt_bias, _retnet_A_log

rng = np.random.default_rng(0)
T = 256 if SMALL else 1024
H, K, V = 4, 16, 8

# %% [markdown]
# ## 1. Impulse responses
#
# Write one pair `(k_0, v_0)` at step 0 with an additive rule, write nothing afterwards (`k = 0`), and read
# with `q = e_i` (key channel `i`) at every step. The read is `sum_j S_t[i, j]`, i.e. the weight of channel `i`.
# Gates: `none`; `fixed` (RetNet's per-head `gamma_h = 1 - 2^(-5-h)`); `head` and `channel` drawn from KDA's
# gate (`lower_bound * sigmoid(exp(A_log) (x + dt_bias))` with `x ~ N(0, 1)`, initial `A_log`, `dt_bias`);
# `element` the same per state element.

# %%
def kda_like_gate(shape_tail, T, key):
    """log gates [1, T, H, *shape_tail] from KDA's safe gate at initialisation, with x ~ N(0, 1)."""
    k1, k2, k3 = jax.random.split(key, 3)
    A_log = _init_A_log(k1, H)
    dt_bias = _init_dt_bias(k2, (H, *shape_tail))
    x = jax.random.normal(k3, (1, T, H, *shape_tail))
    return ops.safe_gate(x, A_log, dt_bias, -5.0)


key = jax.random.key(0)
gates = {
    "none": None,
    "fixed": -jnp.exp(_retnet_A_log(H)),
    "head": kda_like_gate((), T, key),
    "channel": kda_like_gate((K,), T, key),
    "element": kda_like_gate((K * V,), T, key).reshape(1, T, H, K, V),
}

impulse = {}
for gate, g in gates.items():
    # batch row i reads key channel i (q = e_i); every row writes the same pair at step 0 and nothing after
    k = np.zeros((K, T, H, K), np.float32)
    k[:, 0] = 1.0 / np.sqrt(K)
    v = np.zeros((K, T, H, V), np.float32)
    v[:, 0] = 1.0                                               # S_0 = k_0 v_0^T = 1 / sqrt(K) everywhere
    q = np.broadcast_to(np.eye(K, dtype=np.float32)[:, None, None, :], (K, T, H, K))
    gb = g if g is None or gate == "fixed" else jnp.broadcast_to(g, (K, *g.shape[1:]))
    o, _ = ops.linear_attention(("additive", gate), jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), gb,
                                scale=1.0, backend="recurrent")
    reads = np.asarray(o).mean(-1) * np.sqrt(K)                 # [K, T, H]: S_t[i, :] / S_0[i, :], mean over V
    impulse[gate] = np.moveaxis(reads, 0, -1)                   # [T, H, K]: weight of channel i after t steps

# the closed form: the product of the gates after the write (an element gate: averaged over V)
for gate, g in gates.items():
    if g is None:
        expected = np.ones((T, H, K))
    else:
        g = np.asarray(g, np.float64)
        if gate == "fixed":
            expected = np.exp(np.arange(T)[:, None] * g[None, :])[..., None] * np.ones((T, H, K))
        else:
            cum = np.cumsum(g[0], axis=0) - g[0, :1]               # the write at step 0 is not decayed at step 0
            cum = cum if gate != "head" else cum[..., None] * np.ones(K)
            expected = np.exp(cum).mean(-1) if gate == "element" else np.exp(cum)
    err = np.abs(impulse[gate] - expected).max()
    assert err < 1e-5, (gate, err)

# %%
fig, axes = plt.subplots(1, 5, figsize=(19, 3.4), sharey=True)
d = np.arange(T)
for ax, (gate, resp) in zip(axes, impulse.items()):
    if gate in ("channel", "element"):
        for i in range(K):
            ax.semilogy(d, resp[:, 0, i] + 1e-30, lw=0.8)
        ax.set_title(f"{gate}: head 0, each key channel")
    else:
        for h in range(H):
            ax.semilogy(d, resp[:, h, 0] + 1e-30, label=f"head {h}")
        ax.set_title(gate)
        ax.legend(fontsize=7)
    ax.set_ylim(1e-6, 2)
    ax.set_xlabel("distance d (tokens)")
axes[0].set_ylabel("weight of a pair written d steps ago")
fig.suptitle("Impulse response of the state under synthetic gates (KDA's gate at initialisation for head/channel/element)")
fig.tight_layout()
save(fig, "decay_impulse.png")

assert np.all(impulse["none"] > 1 - 1e-5)
fixed = impulse["fixed"][:, :, 0]
assert np.all(np.diff(fixed, axis=0) <= 1e-7) and fixed[-1, 0] < fixed[-1, -1]   # slower decay for later heads

# %% [markdown]
# ## 2. Per-channel decay spectra at initialisation
#
# The half-life of a channel with log gate `g` is `ln 2 / (-g)` tokens. KDA's initialisation (`A_log ~ log U(1, 16)`,
# `dt` log-uniform in `[1e-3, 1e-1]`) spreads the channels of a head over a wide range of memory lengths: a
# multi-scale memory inside one head, which a per-head gate cannot give.

# %%
g_chan = np.asarray(gates["channel"][0], np.float64)             # [T, H, K]
half_life = np.log(2) / np.maximum(-g_chan.mean(0), 1e-12)        # [H, K], from the mean log gate
fig, ax = plt.subplots(figsize=(6, 3.4))
ax.hist(np.log10(half_life.ravel()), bins=24)
ax.set_xlabel("log10 half-life (tokens)")
ax.set_ylabel("key channels")
ax.set_title("KDA gate at initialisation: per-channel half-lives")
fig.tight_layout()
save(fig, "decay_spectrum_init.png")
spread = half_life.max(1) / half_life.min(1)
assert np.all(spread > 3), spread                                 # channels of one head differ in memory length

# %% [markdown]
# ## 3. Trained gates
#
# For each linear model of the LM ablation with a data-dependent or fixed gate, run held-out text (Macbeth)
# through the model and record each layer's log gate at every token. Per layer we report the half-life spectrum
# of its key channels and the *distance -> weight* curve `w(d) = mean_t prod_{s=t+1}^{t+d} alpha_s`, averaged
# over heads and channels (for the channel gate, the mean over channels of the per-channel product).
#
# The committed `trained_gates.npz` comes from the CPU-sized LM ablation (2 layers, width 64, 300 steps; see
# `experiments/results/ablate_lm/cpu_reduced/README.md`): short training, so many channel gates are still near their
# initial value `g ~ 0` (no decay). What it shows: RetNet's fixed decays forget within ~100 tokens, the
# data-dependent gates keep most of the state over the whole context on average, and within one KDA / GLA head
# the key channels span half-lives from one token to "never".

# %%
TRAINED = DATA / "trained_gates.npz"
LM_RUNS = Path(os.environ.get("LINEATTN_NB_LM_RUNS", "runs/ablate/ablate_lm"))
TRAINED_MIXERS = ("additive-fixed", "additive-head", "additive-channel", "delta-head", "delta-channel")
DISTANCES = np.unique(np.round(np.geomspace(1, 512, 24)).astype(int))


def layer_gates(model, tokens):
    """Per linear layer: the log gate on `tokens` [1, T] in the op layout ([H] or [1, T, H(, K)])."""
    x = model.embed(tokens)
    positions = jnp.arange(tokens.shape[1])[None]
    out = []
    for block in model.blocks:
        mixer = block.mixer
        if hasattr(mixer, "log_gate"):
            out.append(mixer.log_gate(block.mixer_norm(x)))
        x = block(x, positions=positions, segment_ids=None)[0]     # (x, state, ...) depending on the version
    return out


def weight_vs_distance(g, T):
    """w(d) = mean over t, heads (and channels) of exp(sum_{s=t+1}^{t+d} g_s); g is [H] or [T, H(, K)]."""
    if g.ndim == 1:
        return np.exp(np.outer(DISTANCES, g)).mean(1)
    c = np.concatenate([np.zeros((1, *g.shape[1:])), np.cumsum(g, 0)])   # c[t] = sum_{s<t} g_s
    w = []
    for dd in DISTANCES:
        if dd >= T:
            w.append(np.nan)
            continue
        w.append(np.exp(c[dd + 1:] - c[1:-dd]).mean())
    return np.array(w)


def measure_trained():
    from lineattn.train.corpus import shakespeare_works
    from lineattn.train.tokenizer import ByteTokenizer
    from lineattn.train.trainer import load_run
    text = shakespeare_works(fetch=False)["macbeth"][:20000]
    tok = ByteTokenizer()
    ids = tok.encode(text.decode("latin-1"), bos=True)[:2048]
    out = {}
    for mixer in TRAINED_MIXERS:
        runs = sorted((LM_RUNS).glob(f"*/{mixer}/lr*/seed0"))
        runs = [r for r in runs if (r / "result.json").exists()]
        if not runs:
            continue
        _, bundle, _ = load_run(runs[0])
        for li, g in enumerate(layer_gates(bundle.model, jnp.asarray(ids)[None])):
            g = np.asarray(g, np.float64)
            g = g if g.ndim == 1 else g[0]
            mean_g = g if g.ndim == 1 else g.mean(0)
            out[f"{mixer}/layer{li}/half_life"] = np.log(2) / np.maximum(-mean_g, 1e-12)
            out[f"{mixer}/layer{li}/weight"] = weight_vs_distance(g, len(ids))
    return out


if not SMALL and LM_RUNS.exists():
    measured = measure_trained()
    if measured:
        DATA.mkdir(parents=True, exist_ok=True)
        np.savez(TRAINED, distances=DISTANCES, source=str(LM_RUNS), **measured)
if TRAINED.exists():
    saved = dict(np.load(TRAINED))
    keys = sorted(k for k in saved if k.endswith("/weight"))
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for kname in keys:
        axes[0].semilogx(saved["distances"], saved[kname], marker=".", label=kname.removesuffix("/weight"))
    axes[0].set_xlabel("distance d (tokens)")
    axes[0].set_ylabel("mean weight prod alpha")
    axes[0].set_title("trained gates on held-out text: distance -> weight")
    axes[0].legend(fontsize=6)
    hl_keys = [k for k in saved if k.endswith("/half_life") and "channel" in k]
    for kname in hl_keys:
        axes[1].hist(np.minimum(np.log10(saved[kname].ravel()), 6), bins=24, histtype="step",
                     label=kname.removesuffix("/half_life"))
    axes[1].set_xlabel("log10 half-life (tokens); 6 = a million or more (no decay in practice)")
    axes[1].set_title("trained per-channel gates: half-life spectrum")
    axes[1].legend(fontsize=6)
    fig.tight_layout()
    save(fig, "decay_trained.png")
    for kname in keys:
        w = saved[kname][np.isfinite(saved[kname])]
        assert np.all(np.diff(w) <= 1e-9) and w[0] <= 1.0, kname      # weights fall with distance
    for kname in hl_keys:
        hl = saved[kname]
        assert hl.max() / hl.min() > 3, (kname, hl.min(), hl.max())    # trained channels keep different memories
else:
    print(f"no {TRAINED}: run the LM ablation, then this notebook at full size")
print("decay notebook: all findings hold")
