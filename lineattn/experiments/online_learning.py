"""The online-learning reading of the update rules, checked numerically with `jax.grad`.

The state S [K, V] is a fast-weight linear model that recalls r(S, k) = S^T k for a key k. Each rule is one
optimiser step on a per-token loss (the reference article's "Linear Attention as Online Learning" section,
written here in lineattn's [K, V] layout, so the article's S k is our S^T k):

    additive write   S + k v^T                = S - 1 * grad_S L_add(S),   L_add = -<v, r(S, k)>
    delta write      S + b k (v - S^T k)^T    = S - b * grad_S L_rec(S),   L_rec = 1/2 ||r(S, k) - v||^2
    GDN / KDA        decay first, then the delta step from the decayed state D(S)
    decay            alpha S = S - b * grad_S (lam/2 ||S||^2)            with alpha = 1 - b lam   (weight decay)
                     Diag(alpha) S = S - b * grad_S (1/2 sum_i lam_i ||S[i, :]||^2)   (per key channel)

Every check compares the rule as lineattn runs it (`lineattn.ops.linear_attention`, the fp32 oracle, or the chunk
path for whole sequences) with the gradient step built by `jax.grad`, as a relative max error
max|x - ref| / max|ref|. `checks()` returns the rows; `main()` prints them as a table.
"""

from __future__ import annotations

import dataclasses
import functools
import sys

import jax
import jax.numpy as jnp
import numpy as np

from lineattn import ops

jax.config.update("jax_default_matmul_precision", "highest")

TOL = 2e-6          # fp32: every identity holds to a few ulps
B, H, K, V = 2, 3, 32, 16


@dataclasses.dataclass(frozen=True)
class Check:
    name: str          # short id, used by the tests
    claim: str         # what is checked
    value: float       # measured (relative max error, or the quantity named in `claim`)
    bound: float       # passes when value <= bound (op "<=") or value >= bound (op ">=")
    op: str = "<="

    @property
    def ok(self) -> bool:
        if not np.isfinite(self.value):
            return False
        return self.value <= self.bound if self.op == "<=" else self.value >= self.bound


def rel_err(x, ref) -> float:
    x, ref = np.asarray(x, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(x - ref)) / max(np.max(np.abs(ref)), 1e-30))


# --- losses on one head's state S [K, V] --------------------------------------------------------------------

def recall(S, k):
    """r(S, k): the value the fast weights return for key k."""
    return S.T @ k


def loss_additive(S, k, v):
    return -jnp.vdot(v, recall(S, k))


def loss_reconstruction(S, k, v):
    return 0.5 * jnp.sum((recall(S, k) - v) ** 2)


def l2_penalty(S, lam):
    """lam/2 ||S||^2 for a scalar lam; 1/2 sum_i lam_i ||S[i, :]||^2 for lam [K] (per key channel); elementwise
    for lam [K, V]."""
    lam = jnp.asarray(lam)
    if lam.ndim == 1:
        lam = lam[:, None]
    return 0.5 * jnp.sum(lam * S * S)


def per_head(fn):
    """Map a one-head function over [B, H] leading axes."""
    return jax.vmap(jax.vmap(fn))


def sgd_step(loss, lr):
    """S - lr * grad_S loss(S, ...), per head."""
    def step(S, *args):
        return S - lr(*args) * jax.grad(loss)(S, *args)
    return step


# --- the rule as lineattn runs it -----------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("rule", "backend"))  # (one compile a call form, not one an op)
def rule_step(rule, S, k, v, g=None, beta=None, backend="recurrent"):
    """One token of `rule` from initial state S [B, H, K, V]; returns the new state."""
    q = k[:, None]  # any query; the state is what is compared
    g1 = None if g is None else (g if g.ndim == 1 else g[:, None])
    b1 = None if beta is None else beta[:, None]
    _, ht = ops.linear_attention(rule, q, k[:, None], v[:, None], g1, b1, initial_state=S,
                                 output_final_state=True, backend=backend)
    return ht


def _inputs(seed=0):
    rng = np.random.default_rng(seed)
    S = jnp.asarray(rng.normal(size=(B, H, K, V)), jnp.float32)
    k = rng.normal(size=(B, H, K))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.float32)
    v = jnp.asarray(rng.normal(size=(B, H, V)), jnp.float32)
    beta = jnp.asarray(rng.uniform(0.05, 1.0, size=(B, H)), jnp.float32)
    alpha_head = rng.uniform(0.3, 1.0, size=(B, H))
    alpha_chan = rng.uniform(0.3, 1.0, size=(B, H, K))
    alpha_elem = rng.uniform(0.3, 1.0, size=(B, H, K, V))
    log = lambda a: jnp.asarray(np.log(a), jnp.float32)
    return dict(S=S, k=k, v=v, beta=beta, g_head=log(alpha_head), g_chan=log(alpha_chan), g_elem=log(alpha_elem),
                alpha_head=jnp.asarray(alpha_head, jnp.float32), alpha_chan=jnp.asarray(alpha_chan, jnp.float32),
                alpha_elem=jnp.asarray(alpha_elem, jnp.float32))


def _unit(rng, shape):
    x = rng.normal(size=shape)
    return x / np.linalg.norm(x, axis=-1, keepdims=True)


def checks(seed: int = 0) -> list[Check]:
    x = _inputs(seed)
    S, k, v, beta = x["S"], x["k"], x["v"], x["beta"]
    a_h, a_c, a_e = x["alpha_head"], x["alpha_chan"], x["alpha_elem"]
    out: list[Check] = []
    add = lambda name, claim, value, bound=TOL, op="<=": out.append(Check(name, claim, float(value), bound, op))

    one = lambda *args: 1.0
    gd_add = per_head(sgd_step(loss_additive, one))
    gd_rec = per_head(lambda S_, k_, v_, b_: S_ - b_ * jax.grad(loss_reconstruction)(S_, k_, v_))

    # 1. the writes are gradient steps
    add("additive_write", "additive write = S - 1 * grad(-<v, S^T k>)",
        rel_err(rule_step("norm_attn", S, k, v), gd_add(S, k, v)))
    add("delta_write", "delta write = S - beta * grad(1/2 ||S^T k - v||^2)",
        rel_err(rule_step("deltanet", S, k, v, beta=beta), gd_rec(S, k, v, beta)))

    # 2. gated delta rules: decay first, then the step from the decayed state
    decayed_h = a_h[..., None, None] * S
    decayed_c = a_c[..., None] * S
    decayed_e = a_e * S
    add("gdn_decay_then_step", "GDN = delta step from alpha S (decay first)",
        rel_err(rule_step("gdn", S, k, v, x["g_head"], beta), gd_rec(decayed_h, k, v, beta)))
    add("kda_decay_then_step", "KDA = delta step from Diag(alpha) S",
        rel_err(rule_step("kda", S, k, v, x["g_chan"], beta), gd_rec(decayed_c, k, v, beta)))
    add("delta_element_decay_then_step", "per-element delta = delta step from alpha * S",
        rel_err(rule_step("delta_element", S, k, v, x["g_elem"], beta), gd_rec(decayed_e, k, v, beta)))
    gdn_on_undecayed = per_head(lambda S_, k_, v_, b_, a_: a_ * S_ - b_ * jax.grad(loss_reconstruction)(S_, k_, v_))
    gap = rel_err(rule_step("gdn", S, k, v, x["g_head"], beta), gdn_on_undecayed(S, k, v, beta, a_h))
    add("gdn_order_matters", "GDN != decay with the error taken before decay (relative gap > 0, as the article "
        "says)", gap, 1e-3, ">=")

    # 3. decay = weight decay (L2 penalty) with alpha = 1 - beta lam
    lam_h = (1 - a_h) / beta
    wd = per_head(lambda S_, b_, l_: S_ - b_ * jax.grad(l2_penalty)(S_, l_))
    add("scalar_decay_is_weight_decay", "alpha S = S - beta grad(lam/2 ||S||^2), alpha = 1 - beta lam",
        rel_err(decayed_h, wd(S, beta, lam_h)))
    lam_c = (1 - a_c) / beta[..., None]
    add("channel_decay_is_channel_weight_decay", "Diag(alpha) S = S - beta grad(1/2 sum_i lam_i ||S[i,:]||^2)",
        rel_err(decayed_c, wd(S, beta, lam_c)))
    lam_e = (1 - a_e) / beta[..., None, None]
    add("element_decay_is_element_weight_decay", "alpha * S = S - beta grad(1/2 sum lam_ij S_ij^2)",
        rel_err(decayed_e, wd(S, beta, lam_e)))
    # SGD on L_rec + L2 from the old state = decay, with the reconstruction error of the *undecayed* state
    sgd_l2 = per_head(lambda S_, k_, v_, b_, l_: S_ - b_ * jax.grad(
        lambda W: loss_reconstruction(W, k_, v_) + l2_penalty(W, l_))(S_))
    add("l2_sgd_step", "S - beta grad(L_rec + lam/2||S||^2) = alpha S - beta grad L_rec(S)",
        rel_err(sgd_l2(S, k, v, beta, lam_h), gdn_on_undecayed(S, k, v, beta, a_h)))
    # GDN / KDA = the split step: first the weight-decay step, then the data step at the decayed point
    split = per_head(lambda S_, k_, v_, b_, l_: (lambda W: W - b_ * jax.grad(loss_reconstruction)(W, k_, v_))(
        S_ - b_ * jax.grad(l2_penalty)(S_, l_)))
    add("kda_split_step", "KDA = weight-decay step (per key channel), then the reconstruction step",
        rel_err(rule_step("kda", S, k, v, x["g_chan"], beta), split(S, k, v, beta, lam_c)))
    # additive rules: the additive gradient does not depend on S, so the order does not matter (lr 1, lam = 1-alpha)
    gd_add_l2 = per_head(lambda S_, k_, v_, l_: S_ - jax.grad(
        lambda W: loss_additive(W, k_, v_) + l2_penalty(W, l_))(S_))
    add("simple_gla_is_l2_step", "simple GLA = S - grad(-<v,S^T k> + lam/2||S||^2), lam = 1 - alpha",
        rel_err(rule_step("simple_gla", S, k, v, x["g_head"]), gd_add_l2(S, k, v, 1 - a_h)))
    add("gla_is_channel_l2_step", "GLA = S - grad(-<v,S^T k> + 1/2 sum_i lam_i||S[i,:]||^2), lam = 1 - alpha",
        rel_err(rule_step("gla", S, k, v, x["g_chan"]), gd_add_l2(S, k, v, 1 - a_c)))

    # 4. unit keys: exact overwrite, orthogonal queries, contraction
    ones = jnp.ones_like(beta)
    for rule, g in (("deltanet", None), ("gdn", x["g_head"]), ("kda", x["g_chan"])):
        S1 = rule_step(rule, S, k, v, g, ones)
        add(f"{rule}_overwrite", f"{rule}, ||k|| = 1, beta = 1: r(S_new, k) = v",
            rel_err(jnp.einsum("bhkv,bhk->bhv", S1, k), v))
    rng = np.random.default_rng(seed + 1)
    q = rng.normal(size=k.shape)
    kk = np.asarray(k, np.float64)
    q = jnp.asarray(q - np.sum(q * kk, -1, keepdims=True) * kk, jnp.float32)   # q orthogonal to k
    read = lambda S_: jnp.einsum("bhkv,bhk->bhv", S_, q)
    add("deltanet_orthogonal_read", "DeltaNet: a query orthogonal to k reads the same as before",
        rel_err(read(rule_step("deltanet", S, k, v, beta=beta)), read(S)))
    add("kda_orthogonal_read", "KDA: a query orthogonal to k reads the decayed value (Diag(alpha) S)^T q",
        rel_err(read(rule_step("kda", S, k, v, x["g_chan"], beta)), read(decayed_c)))

    n = 4000
    kk = jnp.asarray(_unit(rng, (n, K)), jnp.float32)
    bb = jnp.asarray(rng.uniform(0, 1, n), jnp.float32).at[:8].set(1.0).at[8:16].set(0.0)
    aa = jnp.asarray(rng.uniform(0, 1, (n, K)), jnp.float32).at[16:24].set(1.0)
    transition = jnp.eye(K) - bb[:, None, None] * kk[:, :, None] * kk[:, None, :]
    transition = transition * aa[:, None, :]           # (I - b k k^T) Diag(alpha)
    norms = np.asarray(jnp.linalg.norm(transition, ord=2, axis=(1, 2)))
    add("contraction", f"max spectral norm of (I - b k k^T) Diag(alpha) over {n} draws, 0<=b,alpha<=1, ||k||=1",
        norms.max(), 1 + 1e-5)
    big = 2.5
    t_big = (jnp.eye(K) - big * kk[:1, :, None] * kk[:1, None, :])
    add("contraction_needs_small_beta", f"beta = {big} (outside [0, 2]) breaks it: spectral norm |1 - beta| > 1",
        float(jnp.linalg.norm(t_big[0], ord=2)), 1.0 + 1e-3, ">=")

    # 5. a whole sequence: the chunk path = T online gradient steps (decay, then the step), from S_0
    T = 45
    keys = jnp.asarray(_unit(rng, (B, T, H, K)), jnp.float32)
    vals = jnp.asarray(rng.normal(size=(B, T, H, V)), jnp.float32)
    bet = jnp.asarray(rng.uniform(0.05, 1, (B, T, H)), jnp.float32)
    gch = jnp.asarray(np.log(rng.uniform(0.5, 1, (B, T, H, K))), jnp.float32)
    _, ht = jax.jit(lambda *a: ops.linear_attention("kda", *a, initial_state=S, output_final_state=True,
                                                    backend="chunk"))(keys, keys, vals, gch, bet)

    def online(S_, xs):
        k_, v_, b_, g_ = xs
        return gd_rec(jnp.exp(g_)[..., None] * S_, k_, v_, b_), None

    S_T, _ = jax.lax.scan(online, S, tuple(jnp.moveaxis(a, 1, 0) for a in (keys, vals, bet, gch)))
    add("kda_sequence_chunk", f"KDA chunk path over T = {T} = {T} online steps (decay, then grad step)",
        rel_err(ht, S_T), 1e-5)
    return out


def format_table(rows: list[Check]) -> str:
    lines = ["| check | claim | measured | passes when | ok |", "|---|---|---|---|---|"]
    for r in rows:
        value = f"{r.value:.2e}" if abs(r.value) < 1e-2 else f"{r.value:.8f}"
        claim = r.claim.replace("|", "\\|")
        lines.append(f"| {r.name} | {claim} | {value} | {r.op} {r.bound:.7g} | {'yes' if r.ok else 'NO'} |")
    return "\n".join(lines)


def report(rows: list[Check]) -> str:
    bad = [r.name for r in rows if not r.ok]
    return (f"Online-learning identity, fp32, B={B} H={H} K={K} V={V}; measured = relative max error "
            f"max|x - ref| / max|ref| unless the claim names another quantity\n\n{format_table(rows)}\n\n"
            f"{len(rows) - len(bad)}/{len(rows)} checks pass" + (f"; failing: {', '.join(bad)}" if bad else ""))


def main(argv=None) -> int:
    rows = checks()
    print(report(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
