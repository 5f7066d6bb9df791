"""The Pallas kernels (`backend="pallas"`, the decode step) against the fp32 oracle.

Without a GPU the kernels run with `interpret=True` (sequential grid), so the shapes are tiny: T = 80 (not a
chunk multiple), chunk 32, K = V = 32. On the H200 the same tests run compiled, with the grid in parallel.

Tolerances: fp32 inputs, relative max error <= 1e-4 (as every backend). bf16 inputs (q, k, v, beta in bf16, g and
states fp32) against the oracle on the same rounded inputs, relative RMS error as FLA's tests: <= 5e-3 for o and
the final state, <= 8e-3 for dq, dk, dv, dh0, <= 2e-2 for dg and dbeta.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import assert_close, grad_jaxpr, load_script, loss_and_grads, make_inputs
from lineattn import ops
from lineattn.ops.pallas import api as pallas_api
from lineattn.ops.pallas import chunk as pallas_chunk
from lineattn.ops.pallas.common import on_gpu
from lineattn.ops.pallas.decode import decode_step
from lineattn.ops.recurrent import recurrent

xla_passes = load_script("xla_passes")  # (its `sub_jaxprs`)
TOL = 1e-4
SMALL = dict(T=80, H=2, K=32, V=32)
BF16_RMS = {"o": 5e-3, "ht": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dinitial_state": 8e-3, "dg": 2e-2,
            "dbeta": 2e-2}


def _compare(rule, inputs, tol=TOL, cu_seqlens=None, chunk_size=32, got=None):
    """The kernels against the oracle on the same inputs (or `got`, the kernels' (o, ht, grads) computed already
    under the same settings); returns the kernels' results."""
    got = got or loss_and_grads(rule, inputs, backend="pallas", cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    o, ht, grads = got
    o_ref, ht_ref, grads_ref = loss_and_grads(rule, inputs, backend="recurrent", cu_seqlens=cu_seqlens)
    assert_close({"o": o, "ht": ht, **grads}, {"o": o_ref, "ht": ht_ref, **grads_ref}, tol, f"{rule}/pallas")
    return got


def _cut(g):
    """g [B, T, ...] with log 0, -1e30, -1000 and ops.LOG_GATE_FLOOR itself at tokens 3, 20, 32 and 61 (32: a chunk's
    first row at chunk 32)."""
    cuts = np.array([-np.inf, -1e30, -1000.0, ops.LOG_GATE_FLOOR]).reshape((-1,) + (1,) * (g.ndim - 2))
    return g.at[:, jnp.array([3, 20, 32, 61])].set(jnp.asarray(cuts, g.dtype))


@pytest.mark.parametrize("rule", ["kda", "gdn", "deltanet", "gla"])
def test_pallas_matches_oracle_fp32(rule):
    # T = 80: two full chunks of 32 and a ragged one; H = 2; non-zero initial state; all six gradients.
    _compare(rule, make_inputs(rule, B=2, **SMALL))


@pytest.mark.parametrize("rule,backward,chunk_size", [("kda", "xla", 64), ("gdn", "xla", 32),
                                                     ("kda", "kernels-mml2", 64), ("gdn", "kernels-mml2", 32),
                                                     ("gla", "kernels-mml2", 32), ("kda", "kernels-saved", 64),
                                                     ("gla", "kernels-saved", 32)])
def test_pallas_variants_chunk_64_unequal_dims(rule, backward, chunk_size, monkeypatch):
    # Chunk 64 or 32, K != V, and every backward (the default is kernels-saved).
    monkeypatch.setattr(pallas_api, "BACKWARD", backward)
    _compare(rule, make_inputs(rule, B=1, T=80, H=2, K=32, V=64, seed=9), chunk_size=chunk_size)


@pytest.mark.parametrize("gate,backward", [("lower_bound", "kernels-mml2"), ("lower_bound", "kernels-saved"),
                                           ("zero", None), ("cut", "kernels-mml2"), ("cut", "kernels-saved")])
def test_pallas_gate_extremes(gate, backward, monkeypatch):
    # Every token at -5 (a chunk's cumulative decay reaches -160 at chunk 32; a 16-row block's rows are then exactly
    # 40 nats from its middle row: the Gram kernels' fast path at its limit), at 0, or cuts at a few tokens (`_cut`:
    # the kernels raise gates below ops.LOG_GATE_FLOOR, -120, to it as they load g, so the in-chunk cumsum rounds at
    # ulp(120), not ulp(1000), and the fp32 tolerance holds, as for the chunk backend; dg is 0 below the floor, as the
    # oracle's; the Gram kernels take their exact path in the blocks that hold a cut).
    low, high = {"lower_bound": (-5.0, -5.0), "zero": (0.0, 0.0), "cut": (-1.0, 0.0)}[gate]
    inputs = make_inputs("kda", B=1, **SMALL, g_low=low, g_high=high, seed=5)
    if gate == "cut":
        inputs["g"] = _cut(inputs["g"])
    if backward is not None:
        monkeypatch.setattr(pallas_api, "BACKWARD", backward)
    _compare("kda", inputs)


@pytest.mark.parametrize("rule,gate,backward", [("gdn", None, "kernels-saved"), ("deltanet", None, "kernels-saved"),
                                               ("gdn", "lower_bound", "kernels-saved"), ("gdn", "cut", "kernels-saved"),
                                               ("gdn", None, "kernels-mml2"), ("deltanet", None, "kernels-mml2")])
def test_pallas_scalar_gate_kernels(rule, gate, backward, monkeypatch):
    # `api.SCALAR_GATE`: GDN and DeltaNet through the one-program-per-chunk Gram kernels (forward and gradients),
    # chunk 32 and 64, T = 80 ragged, initial state; head gates at -5 per token, or cut at a few tokens (`_cut`).
    monkeypatch.setattr(pallas_api, "SCALAR_GATE", True)
    monkeypatch.setattr(pallas_api, "BACKWARD", backward)
    low, high = {None: (-5.0, 0.0), "lower_bound": (-5.0, -5.0), "cut": (-1.0, 0.0)}[gate]
    inputs = make_inputs(rule, B=2, T=80, H=2, K=32, V=64, g_low=low, g_high=high, seed=14)
    if gate == "cut":
        inputs["g"] = _cut(inputs["g"])
    for chunk_size in (32, 64):
        _compare(rule, inputs, chunk_size=chunk_size)
    jaxpr = grad_jaxpr(rule, inputs, backend="pallas")  # the scalar kernels ran, not the broadcast path
    assert "lineattn_chunk_gram_scalar" in jaxpr and "lineattn_gram_bwd_scalar" in jaxpr
    assert "lineattn_chunk_gram\n" not in jaxpr and "lineattn_chunk_gram " not in jaxpr


@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_gate_floor_in_the_kernels_equals_the_floor_in_xla(rule, monkeypatch):
    # `chunk.GATE_FLOOR`: "kernels" (the default) hands g to the kernels as given; they raise it to the floor as they
    # load it, and dg is zeroed below the floor by the dg kernel (a channel gate, reading an int8 mask formed in XLA)
    # or in XLA (a head gate). "xla" raises g in XLA first, as the API did before. With cuts down to -inf (`_cut`),
    # T = 80 ragged: the same o, final state and gradients bit for bit, dg exactly 0 below the floor; KDA's "xla"
    # backward (autodiff of the XLA chunk form, which raises g itself) against the oracle too. ("kernels-mml2" passes
    # the mask to the same dg kernel as "kernels-saved"; `test_pallas_gate_extremes` runs both with these cuts
    # against the oracle.)
    inputs = make_inputs(rule, B=1, T=80, H=2, K=16, V=16, g_low=-1.0, seed=21)
    inputs["g"] = _cut(inputs["g"])
    below = np.asarray(inputs["g"]) < ops.LOG_GATE_FLOOR
    results = {}
    for floor in ("kernels", "xla"):
        monkeypatch.setattr(pallas_chunk, "GATE_FLOOR", floor)
        o, ht, grads = results[floor] = loss_and_grads(rule, inputs, backend="pallas", chunk_size=32)
        assert np.all(np.asarray(grads["dg"])[below] == 0.0), floor

    def same(a, b, msg):  # (compiled on a GPU, each form's kernels round alike only to fp32: H100, 1.2e-7 apart)
        if on_gpu():
            np.testing.assert_array_less(_rel_rms(a, b), 1e-5, err_msg=msg)
        else:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=msg)

    for name, got, want in zip(["o", "ht", "grads"], results["kernels"], results["xla"]):
        jax.tree.map(lambda a, b: same(a, b, name), got, want)
    _compare(rule, inputs, got=results["kernels"])
    if rule == "kda":
        monkeypatch.setattr(pallas_chunk, "GATE_FLOOR", "kernels")
        monkeypatch.setattr(pallas_api, "BACKWARD", "xla")
        assert np.all(np.asarray(_compare(rule, inputs, chunk_size=32)[2]["dg"])[below] == 0.0)


def test_gate_floor_unknown_is_a_value_error(monkeypatch):
    monkeypatch.setattr(pallas_chunk, "GATE_FLOOR", "kernel")
    x = make_inputs("kda", B=1, T=16, H=1, K=16, V=16)
    with pytest.raises(ValueError, match="chunk.GATE_FLOOR must be 'kernels' or 'xla', got 'kernel'"):
        ops.linear_attention("kda", x["q"], x["k"], x["v"], x["g"], x["beta"], backend="pallas")


def _consumers(jaxpr, var) -> list[str]:
    """The primitives that read `var` in a jaxpr, following it into calls (pjit, custom_vjp_call, ...: a sub-jaxpr
    taking the equation's operands one for one) but not into a pallas_call (a kernel reads it there)."""
    found = []
    for eqn in jaxpr.eqns:
        calls = [j for j in xla_passes.sub_jaxprs(eqn) if len(j.invars) == len(eqn.invars)]
        for slot in [i for i, x in enumerate(eqn.invars) if x is var]:
            if eqn.primitive.name == "pallas_call" or not calls:
                found.append(eqn.primitive.name)
            else:
                found += _consumers(calls[0], calls[0].invars[slot])
    return found


def test_pallas_forward_hands_its_inputs_to_the_kernels_untouched(monkeypatch):
    # Any XLA op on an input before the kernels is a pass through device memory of its own, outside every kernel (a
    # channel gate is [B, T, H, K] fp32: 268 MB at 8 x 4096 x 16 x 128). So KDA's forward alone (T a multiple of the
    # chunk) reads q, k, v, g and beta in kernels only: with GATE_FLOOR "kernels" the Gram kernel (`gram.gram_chunks`)
    # raises g to the floor as it loads it; with "xla" the floor's own ops read g first (the walk sees them). So does
    # its forward+backward (the gradients of every input and the initial state) but for one XLA `lt` on g, which
    # forms the mask of g below the floor for the dg kernel (`chunk.below_floor`: by measurement, faster than the
    # Gram kernel storing it, run44-45).
    x = make_inputs("kda", B=1, T=64, H=2, K=16, V=16)
    names = ("q", "k", "v", "g", "beta")

    def loss(*a):
        o, ht = ops.linear_attention("kda", *a, backend="pallas", output_final_state=True)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    readers = {}
    for floor in ("kernels", "xla"):
        monkeypatch.setattr(pallas_chunk, "GATE_FLOOR", floor)
        for mode, fn in (("fwd", lambda *a: ops.linear_attention("kda", *a, backend="pallas")[0]),
                         ("fwdbwd", jax.grad(loss, argnums=(0, 1, 2, 3, 4)))):  # (new functions: make_jaxpr caches)
            closed = jax.make_jaxpr(fn)(*[x[n] for n in names])
            readers[floor, mode] = {n: _consumers(closed.jaxpr, v) for n, v in zip(names, closed.jaxpr.invars)}
    for mode in ("fwd", "fwdbwd"):
        found = readers["kernels", mode]
        assert all(r and set(r) == ({"pallas_call", "lt"} if (n, mode) == ("g", "fwdbwd") else {"pallas_call"})
                   for n, r in found.items()), (mode, found)
        assert "pallas_call" not in readers["xla", mode]["g"], mode  # (raised in XLA, then read by kernels)


def test_pallas_scalar_gate_bf16_and_varlen(monkeypatch):
    # The scalar path in bf16 against the fp32 oracle (FLA's tolerances, as the channel path's test) and packed.
    monkeypatch.setattr(pallas_api, "SCALAR_GATE", True)
    test_pallas_bf16_against_fp32_oracle("gdn", None, monkeypatch)
    cu_seqlens = np.array([0, 37, 37, 101])
    _compare("gdn", make_inputs("gdn", B=1, T=101, H=1, K=32, V=32, num_seqs=3, seed=3), cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("rule", ["gdn", "simple_gla"])
def test_scalar_gram_gradients_take_dg_from_the_matrices(rule):
    # `gram_bwd.GRADS_SCALAR_GRAM_DG` (the default): the scalar Gram-gradient kernel takes dg's share of the Gram
    # matrices from dM * M + dKK * KK (M, KK formed in the kernel; the additive write has no KK), not from its four
    # products summed over K. fp32, B = 1, T = 150 ragged, H = 2, K = 64, V = 32, gates in (-5, 0), chunk 64, an
    # initial state: every output and gradient within 1e-4 of the oracle and within 2e-5 of the products' form (CPU:
    # dg 2e-7 to 6e-7 apart, the rest equal); bf16 (plain bf16 products, the default) within FLA's tolerances of the
    # oracle.
    from lineattn.ops.pallas import tuning
    x = make_inputs(rule, B=1, T=150, H=2, K=64, V=32, seed=31)
    got = {}
    for gram_dg in (True, False):
        with tuning.override({"gram_bwd.GRADS_SCALAR_GRAM_DG": gram_dg}):
            o, ht, grads = loss_and_grads(rule, x, backend="pallas", chunk_size=64)
            got[gram_dg] = {"o": o, "ht": ht, **grads}
            assert "lineattn_gram_bwd_scalar" in grad_jaxpr(rule, x, backend="pallas", chunk_size=64)
    o, ht, grads = loss_and_grads(rule, x, backend="recurrent")
    want = {"o": o, "ht": ht, **grads}
    assert "dg" in want
    for name in want:
        assert _rel_rms(got[True][name], want[name]) <= 1e-4, name
        assert _rel_rms(got[True][name], got[False][name]) <= 2e-5, name
    _assert_bf16_close(rule, x, chunk_size=64)


@pytest.mark.parametrize("trans_a", [False, True])
def test_kernel_dot_precisions(trans_a):
    # `common.dot`: "bf16x2" (a split into bf16 parts, b taken in bf16; an option of the scalar Gram gradients, the
    # bf16 inputs as right operands) against fp64: for a bf16 b as accurate as "bf16x3" (relative max error below
    # 2e-5), where "bf16" is off by over 1e-3.
    from lineattn.ops.pallas.common import dot
    rng = np.random.default_rng(0)
    a = jnp.asarray(rng.standard_normal((64, 64)), jnp.float32)
    b = jnp.asarray(rng.standard_normal((64, 32)), jnp.bfloat16)
    want = (np.asarray(a, np.float64).T if trans_a else np.asarray(a, np.float64)) @ np.asarray(b, np.float64)
    err = lambda p: np.max(np.abs(np.asarray(dot(a, b, p, trans_a=trans_a)) - want)) / np.max(np.abs(want))
    assert err("bf16x2") < 2e-5 and err("bf16x3") < 2e-5 and err("bf16") > 1e-3


def test_pallas_head_gate_broadcast_and_retrace(monkeypatch):
    # A head gate through the per-channel kernels (`api.SCALAR_GATE = False`: the gate broadcast over K), and the
    # jitted forward retracing when a module constant changes after a first call with the same shapes: with
    # PASS_MIN_PROGRAMS lowered to B * H = 4, the state pass's V tile is the whole V = 32 (grid (B, H, segments, V
    # tiles) 2 x 2 x 1 x 2 -> 2 x 2 x 1 x 1).
    from lineattn.ops.pallas import chunk_fwd
    monkeypatch.setattr(pallas_api, "SCALAR_GATE", False)
    inputs = make_inputs("gdn", B=2, **SMALL, seed=16)
    _compare("gdn", inputs)
    x = inputs
    # A new function object per trace (make_jaxpr caches by function, as jit does).
    trace = lambda: str(jax.make_jaxpr(lambda q: ops.linear_attention("gdn", q, x["k"], x["v"], x["g"], x["beta"],
                                                                      backend="pallas")[0])(x["q"]))
    jaxpr = trace()
    assert "lineattn_chunk_gram_g" in jaxpr  # (the per-channel Gram kernel, forming G itself: GRAM_FORMS_G)
    assert "lineattn_chunk_gram_scalar" not in jaxpr
    grid = lambda text: text.split("lineattn_chunk_state_pass")[0].rsplit("grid=", 1)[-1].split(")")[0] + ")"
    assert grid(jaxpr).replace(" ", "").startswith("(2,2,1,2)")
    monkeypatch.setattr(chunk_fwd, "PASS_MIN_PROGRAMS", 4)
    assert grid(trace()).replace(" ", "").startswith("(2,2,1,1)")


def test_pallas_varlen():
    cu_seqlens = np.array([0, 37, 37, 101])  # an empty sequence, one crossing chunk edges
    _compare("kda", make_inputs("kda", B=1, T=101, H=1, K=32, V=32, num_seqs=3, seed=3), cu_seqlens=cu_seqlens)


def _rel_rms(actual, expected):
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.sqrt(np.mean((a - e) ** 2)) / max(np.sqrt(np.mean(e**2)), 1e-30))


@pytest.mark.parametrize("rule,backward", [("kda", None), ("kda", "kernels-mml2"), ("gdn", "kernels-mml2"),
                                           ("gdn", None)])
def test_pallas_bf16_against_fp32_oracle(rule, backward, monkeypatch):
    if backward is not None:
        monkeypatch.setattr(pallas_api, "BACKWARD", backward)
    _assert_bf16_close(rule, make_inputs(rule, B=1, **SMALL, seed=6), chunk_size=32)


def _assert_bf16_close(rule, inputs, chunk_size, got=None):
    """The kernels on bf16 q, k, v, beta against the oracle on the same rounded values (FLA's tolerances); `got`:
    the kernels' (o, ht, grads) on those bf16 inputs computed already under the same settings."""
    rounded = {n: None if x is None else x.astype(jnp.bfloat16).astype(jnp.float32) if n in "qkv beta" else x
               for n, x in inputs.items()}
    bf16 = {n: None if x is None else x.astype(jnp.bfloat16) if n in "qkv beta" else x for n, x in inputs.items()}
    o, ht, grads = got or loss_and_grads(rule, bf16, backend="pallas", chunk_size=chunk_size)
    o_ref, ht_ref, grads_ref = loss_and_grads(rule, rounded, backend="recurrent")
    assert o.dtype == jnp.bfloat16 and ht.dtype == jnp.float32
    got = {"o": o, "ht": ht, **grads}
    want = {"o": o_ref, "ht": ht_ref, **grads_ref}
    errors = {n: _rel_rms(got[n], want[n]) for n in want}
    assert all(errors[n] <= BF16_RMS[n] for n in want), errors


def _diagonal_blocks_inverted(A, C, n=16):
    """A [B, H, Tp, C] (strictly lower per chunk) with each n x n diagonal block L replaced by (I + L)^-1 - I (fp64
    inverse): the form `solve.invert_diagonal_blocks` writes."""
    A = np.array(A, np.float64)
    for r0 in range(0, A.shape[2], n):
        c0 = r0 % C
        L = A[:, :, r0:r0 + n, c0:c0 + n]
        A[:, :, r0:r0 + n, c0:c0 + n] = np.linalg.inv(np.eye(n) + L) - np.eye(n)
    return jnp.asarray(A, jnp.float32)


@pytest.mark.parametrize("with_r,gate,diag_inverse", [(False, "channel", 0), (True, "channel", 0),
                                                      (True, "scalar", 0), (False, "channel", 16),
                                                      (False, "channel", 32), (True, "channel", 32)])
def test_mosaic_solve_matches_the_triton_solve(with_r, gate, diag_inverse):
    # `solve_mgpu.solve_mosaic` (Mosaic GPU wgmma kernel, run by its interpreter here) against `solve_full` on the
    # same inputs: two chunks of 64, K = V = 64, bf16; with_r: the backward's form (A the unscaled key Gram,
    # R written); a scalar gate's G [B, Tp, H] in both, and in `solve_full` equal to the same G broadcast over K;
    # diag_inverse: both solves given A with its 16 x 16 or 32 x 32 diagonal blocks inverted (the forward alone's
    # form, the doubling from there on; with with_r the saving forward's, `solve.DIAG_INVERSE_SAVE`: A =
    # Diag(beta) KK so inverted, R written) against `solve_full` on the whole A.
    from lineattn.ops.pallas import gram, solve, solve_mgpu
    rng = np.random.default_rng(21)
    B, Tp, H, K, V, C = 1, 128, 2, 64, 64, 64
    k = rng.standard_normal((B, Tp, H, K))
    k = jnp.asarray(k / np.linalg.norm(k, axis=-1, keepdims=True), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, Tp, H, V)), jnp.bfloat16)
    g = -jnp.asarray(rng.uniform(0, 0.5, (B, Tp, H) + ((K,) if gate == "channel" else ())), jnp.float32)
    G, _ = gram.gate_cumsum(g, C=C, K=K, interpret=True)
    assert G.shape == g.shape
    beta = jnp.asarray(rng.uniform(0, 1, (B, Tp, H)), jnp.bfloat16)
    kc = k.astype(jnp.float32).reshape(B, Tp // C, C, H, K)
    KK = jnp.einsum("bnihk,bnjhk->bhnij", kc, kc) * np.tril(np.ones((C, C)), -1)
    kk = with_r and not diag_inverse
    A = KK.reshape(B, H, Tp, C) * (1.0 if kk else jnp.moveaxis(beta.astype(jnp.float32), 1, 2)[..., None])
    kw = dict(C=C, store=jnp.bfloat16, with_r=with_r, kk=kk)
    run_solve = lambda G, A=A, **d: solve.solve_full(A, k, v, G, beta, prec="bf16", inv_prec="bf16x3", warps=4,
                                                      interpret=True, **kw, **d)
    want = run_solve(G)
    if diag_inverse:
        A_inv = _diagonal_blocks_inverted(A, C, diag_inverse)
        for name, x, y in zip("WU", run_solve(G, A_inv, diag_inverse=diag_inverse), want):
            assert _rel_rms(x, y) <= 1e-3, name
        got = solve_mgpu.solve_mosaic(A_inv, k, v, G, beta, **kw, diag_inverse=diag_inverse)
        with pytest.raises(ValueError, match="diag_inverse"):
            solve_mgpu.solve_mosaic(A_inv, k, v, G, beta, **dict(kw, kk=True), diag_inverse=diag_inverse)
    else:
        got = solve_mgpu.solve_mosaic(A, k, v, G, beta, **kw)  # compiled on a GPU, the interpreter on the CPU
    assert len(got) == len(want) == 2 + with_r
    if gate == "scalar":
        for x, y in zip(want, run_solve(jnp.broadcast_to(G[..., None], G.shape + (K,)))):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    for name, x, y in zip("WUR", got, want):
        # W, U: bf16 outputs (an ulp where the two roundings differ); R: fp32 from bf16x3 products
        assert _rel_rms(x, y) <= (1e-5 if name == "R" else 1e-3), name
    with pytest.raises(ValueError, match="bf16 k, v and store"):
        solve_mgpu.solve_mosaic(A, k.astype(jnp.float32), v, G, beta, interpret=True, **kw)
    with pytest.raises(ValueError, match="K, V multiples of 64"):
        solve_mgpu.solve_mosaic(A, k[..., :32], v, G[..., :32] if gate == "channel" else G, beta, interpret=True,
                                **kw)


@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_saving_forward_inverts_the_diagonal_blocks(rule):
    # `solve.DIAG_INVERSE_SAVE`: the forward that saves for the backward keeps the unscaled key Gram KK and
    # gives its solve Diag(beta) KK with the diagonal blocks inverted (a new array), so the solve's doubling starts
    # from them as a forward alone's does. fp32, chunk 64, T = 80 (ragged), gates at the lower bound (-5 a token):
    # o, the final state and every gradient match the oracle (1e-4) and the whole doubling's numbers (1e-5). (DeltaNet
    # takes GDN's scalar path; every saving forward of the other tests runs this form too, the default.)
    from lineattn.ops.pallas import tuning
    x = make_inputs(rule, B=1, **SMALL, g_low=-5.0, g_high=-5.0, seed=12)
    flat = lambda o, ht, grads: {"o": o, "ht": ht, **grads}
    got = {}
    for on in (True, False):
        with tuning.override({"solve.DIAG_INVERSE_SAVE": on}):
            got[on] = flat(*loss_and_grads(rule, x, backend="pallas", chunk_size=64))
            vjp = jax.make_jaxpr(lambda q: jax.vjp(lambda q: ops.linear_attention(
                rule, q, x["k"], x["v"], x["g"], x["beta"], chunk_size=64, backend="pallas"), q)[0])(x["q"])
            assert ("lineattn_invert_diagonal_blocks" in str(vjp)) == on
    assert_close(got[True], flat(*loss_and_grads(rule, x, backend="recurrent")), TOL, "DIAG_INVERSE_SAVE, oracle")
    assert_close(got[True], got[False], 1e-5, "DIAG_INVERSE_SAVE, the whole doubling")


@pytest.mark.parametrize("rule,gate", [("kda", "lower_bound"), ("kda", "cut"), ("gdn", "lower_bound"), ("gdn", "cut"),
                                       ("deltanet", None)])
def test_forward_alone_inverts_the_diagonal_blocks(rule, gate):
    # `solve.DIAG_INVERSE` (a forward that saves nothing): `invert_diagonal_blocks` replaces each 16 x 16 (or
    # 32 x 32) diagonal block L of A by (I + L)^-1 - I, exact in fp32 (against fp64 inverses), and leaves the rest; the
    # forward alone (chunk 64, T = 80 ragged, fp32, every token at -5 or -1000 cuts, whose chunks the exact fix-up
    # rewrites before the inversion) matches the oracle, through the channel gate's Gram kernels and the scalar
    # gate's (GDN's head gate; DeltaNet's none).
    from lineattn.ops.pallas import solve, tuning
    low, high = (-5.0, -5.0) if gate == "lower_bound" else (-1.0, 0.0)
    x = make_inputs(rule, B=1, **SMALL, g_low=low, g_high=high, seed=8)
    if gate == "cut":
        x["g"] = x["g"].at[:, jnp.array([3, 20, 61])].set(-1000.0)
    C = 64
    if (rule, gate) == ("kda", "lower_bound"):
        rng = np.random.default_rng(4)
        A = jnp.asarray(rng.uniform(-1, 1, (1, 2, 128, C)) * np.tile(np.tri(C, k=-1), (2, 1)), jnp.float32)
        for n in (16, 32):
            want = _diagonal_blocks_inverted(A, C, n)
            np.testing.assert_allclose(solve.invert_diagonal_blocks(A, C=C, interpret=True, block=n), want,
                                       rtol=0, atol=1e-5 * float(np.max(np.abs(want))))
        with pytest.raises(ValueError, match="blocks of 16 or 32"):
            solve.invert_diagonal_blocks(A, C=C, interpret=True, block=64)
        # with beta (`DIAG_INVERSE_SAVE`, A the unscaled KK kept for the backward): Diag(beta) A so inverted, A kept
        beta = jnp.asarray(rng.uniform(0, 1, (1, 128, 2)), jnp.bfloat16)
        scaled = A * jnp.moveaxis(beta.astype(jnp.float32), 1, 2)[..., None]
        kept = np.array(A)
        for n in (16, 32):
            want = _diagonal_blocks_inverted(scaled, C, n)
            np.testing.assert_allclose(solve.invert_diagonal_blocks(A, C=C, interpret=True, block=n, beta=beta),
                                       want, rtol=0, atol=1e-5 * float(np.max(np.abs(want))))
        np.testing.assert_array_equal(A, kept)
        with pytest.raises(ValueError, match=r"beta must be \[B, Tp, H\] = \[1, 128, 2\]"):
            solve.invert_diagonal_blocks(A, C=C, interpret=True, block=32, beta=beta[:, :64])
    forward = jax.jit(lambda q: ops.linear_attention(rule, q, x["k"], x["v"], x["g"], x["beta"], chunk_size=C,
                                                     initial_state=x["initial_state"], output_final_state=True,
                                                     backend="pallas"))
    o_ref, ht_ref = ops.linear_attention(rule, *(x[n] for n in ("q", "k", "v", "g", "beta")), output_final_state=True,
                                         initial_state=x["initial_state"], backend="recurrent")
    with tuning.override({"solve.DIAG_INVERSE": True}):
        assert "lineattn_invert_diagonal_blocks" in str(jax.make_jaxpr(forward)(x["q"]))
        o, ht = forward(x["q"])
    assert_close({"o": o, "ht": ht}, {"o": o_ref, "ht": ht_ref}, TOL, "diag_inverse")


@pytest.mark.parametrize("gate", ["lower_bound", "cut"])
def test_pallas_gram_with_exact_path_inside(gate, monkeypatch):
    # `gram.GRAM_IMPL = "triton"` (not the default "triton-fast"): the exact path behind a `lax.cond` in the
    # Gram kernel, no fix-up kernel: fp32 with gates at -5 per token or -1000 cuts against the oracle, then bf16
    # (chunk 64, K = V = 64).
    from lineattn.ops.pallas import gram
    monkeypatch.setattr(gram, "GRAM_IMPL", "triton")
    test_pallas_gate_extremes(gate, "kernels-saved", monkeypatch)
    x = make_inputs("kda", B=1, **SMALL, seed=5)
    jaxpr = str(jax.make_jaxpr(lambda q: ops.linear_attention("kda", q, x["k"], x["v"], x["g"], x["beta"],
                                                              backend="pallas")[0])(x["q"]))
    assert "lineattn_chunk_gram_exact" not in jaxpr and "lineattn_chunk_gram" in jaxpr
    if gate == "lower_bound":
        _assert_bf16_close("kda", make_inputs("kda", B=1, **dict(SMALL, K=64, V=64), seed=6), chunk_size=64)


@pytest.mark.parametrize("split", [True, False])
def test_pallas_gram_gradients_split_or_not(split, monkeypatch):
    # `gram_bwd.GRADS_SPLIT` (the default): the Gram-gradient kernel's fast path in every block, then the exact
    # path rewrites the chunks that the gate-cumsum kernel flags (-1000 cuts: flagged chunks, whose fast-path
    # values would be wrong); False: both paths in one kernel. fp32 against the oracle, then bf16 at chunk 64
    # (K = V = 64) for False (the default's bf16 case is `test_pallas_bf16_against_fp32_oracle`).
    from lineattn.ops.pallas import gram_bwd
    monkeypatch.setattr(gram_bwd, "GRADS_SPLIT", split)
    test_pallas_gate_extremes("cut", "kernels-saved", monkeypatch)
    x = make_inputs("kda", B=1, **SMALL, seed=5)
    assert ("lineattn_gram_bwd_exact" in grad_jaxpr("kda", x, backend="pallas")) == split
    if not split:
        _assert_bf16_close("kda", make_inputs("kda", B=1, **dict(SMALL, K=64, V=64), seed=6), chunk_size=64)


@pytest.mark.parametrize("gate", ["default", "cut"])
def test_pallas_with_the_mosaic_solve(gate, monkeypatch):
    # `solve.SOLVE_IMPL = "mosaic"` (the default on a Hopper GPU): KDA in bf16 at chunk 64 (T = 80 ragged, K = V =
    # 64) within FLA's bounds of the fp32 oracle, forward and every gradient, and the forward alone (no saved
    # terms); with -1000 cuts as well (the chunks that the fix-up kernel recomputes).
    from lineattn.ops.pallas import solve
    monkeypatch.setattr(solve, "SOLVE_IMPL", "mosaic")
    kernel = "lineattn_solve_mosaic"
    inputs = make_inputs("kda", B=1, **dict(SMALL, K=64, V=64), seed=6)
    if gate == "cut":
        inputs["g"] = inputs["g"].at[:, jnp.array([3, 20, 61])].set(-1000.0)
    x = {n: y.astype(jnp.bfloat16) if n in ("q", "k", "v", "beta") else y for n, y in inputs.items()}
    forward = lambda q: ops.linear_attention("kda", q, x["k"], x["v"], x["g"], x["beta"], chunk_size=64,
                                             initial_state=x["initial_state"], output_final_state=True,
                                             backend="pallas")
    assert kernel in str(jax.make_jaxpr(lambda q: forward(q)[0])(x["q"]))
    _assert_bf16_close("kda", inputs, chunk_size=64)
    rounded = {n: y.astype(jnp.float32) for n, y in x.items()}
    o_ref, ht_ref = ops.linear_attention("kda", *(rounded[n] for n in ("q", "k", "v", "g", "beta")),
                                         initial_state=rounded["initial_state"], output_final_state=True,
                                         backend="recurrent")
    o, ht = jax.jit(forward)(x["q"])
    assert _rel_rms(o, o_ref) <= BF16_RMS["o"] and _rel_rms(ht, ht_ref) <= BF16_RMS["ht"]


def test_mosaic_state_pass_matches_the_triton_pass():
    # `state_mgpu.state_pass_mosaic` (Mosaic GPU, run by its interpreter here) against the Triton state pass on the
    # same intra-chunk terms: B = 2, T = 150 (3 chunks of 64, ragged), H = 2, K = 64, V = 128, a non-zero h0, bf16;
    # o, the final state and the kept per-chunk states and E of the backward's form; through `forward` (PASS_IMPL
    # "mosaic": V tiles of 16 here) and directly with V tiles of 32 and 64. (The CPU test of the Mosaic passes with
    # two sequences: the others take one, as the interpreter's time grows with the CTAs.)
    from lineattn.ops.pallas import chunk_fwd, state_mgpu, tuning
    x = make_inputs("kda", B=2, T=150, H=2, K=64, V=128, seed=22)
    args = tuple(x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")) + (x["g"], x["beta"].astype(jnp.bfloat16),
                                                                          x["initial_state"])
    kw = dict(scale=64**-0.5, interpret=True, save=True, states_dtype="bfloat16")
    want = chunk_fwd.forward(*args, **kw)
    with tuning.override({"chunk_fwd.PASS_IMPL": "mosaic"}):
        got = chunk_fwd.forward(*args, **kw)
    # the same bf16 products with fp32 accumulation in another order (CPU: o 5e-6, the state 3e-8; H200: o 2.3e-5)
    for name, a, b in [("o", got[0], want[0]), ("ht", got[1], want[1]), ("S0", got[2][-2], want[2][-2]),
                       ("E", got[2][-1], want[2][-1])]:
        assert a.shape == b.shape and _rel_rms(a, b) <= 1e-4, name
    qin, kg, w, u, m, dend = got[2][:6]
    for bv in (32, 64):
        o, ht, S0, E = state_mgpu.state_pass_mosaic(qin, kg, w, u, m, jnp.swapaxes(dend, -1, -2), x["initial_state"],
                                                    out_dtype=jnp.bfloat16, keep_dtype=jnp.bfloat16, block_v=bv)
        for name, a, b in [("o", o[:, :150], want[0]), ("ht", ht, want[1]), ("S0", S0, want[2][-2]),
                           ("E", E, want[2][-1])]:
            assert a.shape == b.shape and _rel_rms(a, b) <= 1e-4, (bv, name)
    with pytest.raises(ValueError, match="bf16 matrices"):
        state_mgpu.state_pass_mosaic(qin.astype(jnp.float32), kg, w, u, m, jnp.swapaxes(dend, -1, -2),
                                     x["initial_state"], out_dtype=jnp.bfloat16, interpret=True)
    with pytest.raises(ValueError, match="dend must be"):
        state_mgpu.state_pass_mosaic(qin, kg, w, u, m, dend, x["initial_state"], out_dtype=jnp.bfloat16,
                                     interpret=True)
    with pytest.raises(ValueError, match="block_v in"):
        state_mgpu.state_pass_mosaic(qin, kg, w, u, m, jnp.swapaxes(dend, -1, -2), x["initial_state"],
                                     out_dtype=jnp.bfloat16, block_v=128, interpret=True)
    start = jnp.zeros((2, 2, 1, 64, 128 + 64), jnp.float32)  # (the zero-start pass: V + K columns)
    with pytest.raises(ValueError, match="value_tiles must be"):
        state_mgpu.zero_start_pass_mosaic(kg, w, u, jnp.swapaxes(dend, -1, -2), start, value_tiles=1, block_v=64)
    with tuning.override({"chunk_fwd.PASS_IMPL": "mosaic"}), pytest.raises(ValueError, match="exported"):
        chunk_fwd.forward(*args[:-1], x["initial_state"], scale=1.0, interpret=True, export_chunks=(1,))


def _out_avals(jaxpr_text, name):
    """How many outputs the pallas_call `name` has in a jaxpr's text."""
    after = jaxpr_text[jaxpr_text.index(f"name={name}\n"):]
    return after[after.index("out_avals="):].splitlines()[0].count("ShapedArray")


@pytest.mark.parametrize("rule", ["gdn", "kda"])
def test_mosaic_pass_forms_of_a_forward_alone(rule):
    # A forward alone through the Mosaic state pass (its interpreter here). `chunk_fwd.ROW_GATE` (GDN): the pass reads
    # the raw q and k and applies the gate's row factors, and the scalar Gram kernel writes M and A only (no Qin, Kg).
    # INVERSE_IN_PASS: the solve writes R = (I + A)^-1 alone (`solve_mgpu.inverse_mosaic`) and the pass forms E from R,
    # the raw v and Kin (KDA: an output of the Gram kernel, which then forms G itself, `gram.GRAM_FORMS_G`; GDN:
    # the raw k). bf16, B = 1 (the interpreter's time grows with the CTAs), T = 150 (3 chunks of 64, ragged), H = 2, K =
    # 64, V = 128, a non-zero h0: o and the final state equal those of the pass over Qin, Kg, W and U to rounding (CPU,
    # GDN: o 1.9e-4 / 4.2e-4, the state 6.0e-4 / 7.6e-4 relative RMS; KDA: o 7.1e-4; the bf16 operands differ) and the
    # fp32 form's within FLA's 5e-3 (CPU: 3.2e-3 / 2.1e-3 for GDN, 3.3e-3 / 2.5e-3 for KDA, each way).
    from lineattn.ops.pallas import chunk_fwd, tuning
    x = make_inputs(rule, B=1, T=150, H=2, K=64, V=128, seed=22)
    args = tuple(x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")) + (x["g"], x["beta"].astype(jnp.bfloat16),
                                                                          x["initial_state"])
    fwd = lambda *a: chunk_fwd.forward(*a, scale=64**-0.5, interpret=True)
    want = fwd(*(a.astype(jnp.float32) for a in args))
    got = {}
    settings = [(False, False), (True, False), (True, True)] if rule == "gdn" else [(False, False), (False, True)]
    for row_gate, inverse in settings:
        with tuning.override({"chunk_fwd.PASS_IMPL": "mosaic", "chunk_fwd.ROW_GATE": row_gate,
                              "chunk_fwd.INVERSE_IN_PASS": inverse}):
            got[row_gate, inverse] = fwd(*args)
            text = str(jax.make_jaxpr(fwd)(*args))
        if rule == "gdn":
            assert _out_avals(text, "lineattn_chunk_gram_scalar") == (2 if row_gate else 4)
        else:  # (the Gram kernel forms G itself, GRAM_FORMS_G: no gate-cumsum kernel; Kin for the inverse's form)
            assert _out_avals(text, "lineattn_chunk_gram_g") == (8 if inverse else 7)
            assert "lineattn_chunk_cumsum" not in text
        assert "lineattn_state_pass_mosaic" in text
        assert ("lineattn_inverse_mosaic" in text) == inverse
        assert ("lineattn_chunk_solve_full" in text) == (not inverse)
        for i, name in enumerate(("o", "ht")):
            assert _rel_rms(got[row_gate, inverse][i], want[i]) <= 5e-3, (row_gate, inverse, name)
    for key in settings[1:]:
        for i, name in enumerate(("o", "ht")):
            assert _rel_rms(got[key][i], got[False, False][i]) <= 1.5e-3, (key, name)


@pytest.mark.parametrize("rule", ["gdn", "kda"])
def test_mosaic_pass_forms_in_segments(rule, monkeypatch):
    # `chunk_fwd.FORMS_IN_SEGMENTS`: a forward alone in segments (PASS_SEGMENTS "always"; 4 chunks in 2 segments of
    # 2 here) takes the forms of `test_mosaic_pass_forms_of_a_forward_alone` (GDN: ROW_GATE and INVERSE_IN_PASS;
    # KDA: INVERSE_IN_PASS) in its zero-start pass and its state pass, so its solve writes R alone. bf16, B = 1,
    # T = 250 (ragged), H = 2, K = 64, V = 128, a non-zero h0, gates in (-0.05, 0) (so that the first segment's
    # state reaches the second through its map), the Mosaic passes in their interpreter: o and the final state
    # within FLA's 5e-3 of the fp32 form (CPU: GDN 3.4e-3 / 2.6e-3, KDA 3.6e-3 / 3.2e-3) and within 2.5e-3 of the
    # same forms unsegmented (CPU: 2.0e-3 / 1.5e-3 and 2.0e-3 / 1.3e-3; the segments' chain sums in another order).
    from lineattn.ops.pallas import chunk_fwd, segments, tuning
    monkeypatch.setattr(segments, "MIN_SEGMENT_CHUNKS", 2)
    assert segments.pick_segments(2, 4, 128) == 2
    x = make_inputs(rule, B=1, T=250, H=2, K=64, V=128, seed=23, g_low=-0.05)
    args = tuple(x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")) + (x["g"], x["beta"].astype(jnp.bfloat16),
                                                                          x["initial_state"])
    fwd = lambda *a: chunk_fwd.forward(*a, scale=64**-0.5, interpret=True)
    want = fwd(*(a.astype(jnp.float32) for a in args))
    got = {}
    for segmented in ("always", "never"):
        with tuning.override({"chunk_fwd.PASS_IMPL": "mosaic", "chunk_fwd.ZERO_START_IMPL": "mosaic",
                              "chunk_fwd.FORMS_IN_SEGMENTS": True, "chunk_fwd.PASS_SEGMENTS": segmented}):
            got[segmented] = fwd(*args)
            text = str(jax.make_jaxpr(fwd)(*args))
        assert ("lineattn_zero_start_pass_mosaic" in text) == (segmented == "always")
        assert "lineattn_inverse_mosaic" in text and "lineattn_chunk_solve_full" not in text
        for i, name in enumerate(("o", "ht")):
            assert _rel_rms(got[segmented][i], want[i]) <= 5e-3, (segmented, name)
    for i, name in enumerate(("o", "ht")):
        assert _rel_rms(got["always"][i], got["never"][i]) <= 2.5e-3, name
    with tuning.override({"chunk_fwd.PASS_IMPL": "mosaic", "chunk_fwd.ZERO_START_IMPL": "mosaic"}):
        # (the default, "scalar": the forms in segments for GDN's gate alone)
        assert ("lineattn_inverse_mosaic" in str(jax.make_jaxpr(fwd)(*args))) == (rule == "gdn")


@pytest.mark.parametrize("form", ["plain", "raw_qk", "inverse", "raw_qk+inverse"])
def test_mosaic_pass_two_warpgroups_equal_one(form):
    # `state_mgpu.state_pass_mosaic` as CTAs of two compute warpgroups (each on its own V tile of 64, a third issuing
    # the loads they share; the forward alone's default where 128 CTAs or more remain) against CTAs of one, in each
    # form a forward alone takes: o and the final state equal (the same products in the same order; CPU: bit for
    # bit). Random bf16 terms, B = 1, T = 128 (2 chunks), H = 2, K = 64, V = 128, a non-zero h0.
    from lineattn.ops.pallas import state_mgpu
    B, T, H, K, V, C = 1, 128, 2, 64, 128, 64
    keys = iter(jax.random.split(jax.random.key(7), 12))
    rand = lambda *shape, scale=0.1: (scale * jax.random.normal(next(keys), shape)).astype(jnp.bfloat16)
    by_head, by_token = (lambda D: rand(B, H, T, D)), (lambda D: rand(B, T, H, D))
    rows = lambda: jax.random.uniform(next(keys), (B, H, T), minval=0.2, maxval=1.0)
    dend = jnp.exp(-jax.random.uniform(next(keys), (B, H, T // C, K)))
    h0 = jax.random.normal(next(keys), (B, H, K, V))
    raw, inv = "raw_qk" in form, "inverse" in form
    q, k = (by_token(K), by_token(K)) if raw else (by_head(K), by_head(K))
    w = None if raw and inv else by_head(K)  # (Kin with inverse alone; the raw k with both)
    u = rand(B, T, H, V, scale=1.0) if inv else rand(B, H, T, V, scale=1.0)
    m = by_head(C)
    extra = dict(raw_qk=(rows(), rows()) if raw else None,
                 inverse=(by_head(C), rows(), rows() if raw else None) if inv else None)
    one, two = (state_mgpu.state_pass_mosaic(q, k, w, u, m, dend, h0, out_dtype=jnp.bfloat16, block_v=64,
                                             warpgroups=n, interpret=True, **extra) for n in (1, 2))
    for name, a, b in zip(("o", "ht"), one, two):
        assert a.shape == b.shape and float(jnp.mean(jnp.abs(b.astype(jnp.float32)))) > 0.01, name
        assert _rel_rms(b, a) <= 1e-6, (form, name)


def test_mosaic_pass_forms_reject_bad_arguments():
    # `state_mgpu.state_pass_mosaic`'s raw_qk and inverse forms: a ValueError for kept states, a wrong number of row
    # factors, Kin given beside raw_qk's raw k, no Kin without raw_qk, and one naming each input of the wrong shape
    # (head-major q with raw_qk, v head-major with inverse, row factors per token and channel); the zero-start pass's
    # kg_rows and inverse forms likewise (a head-major k beside kg_rows, v head-major with inverse, Kin beside the
    # raw k).
    from lineattn.ops.pallas import state_mgpu
    q = k = jnp.zeros((2, 192, 2, 64), jnp.bfloat16)
    w, u, m = (jnp.zeros((2, 2, 192, n), jnp.bfloat16) for n in (64, 128, 64))
    rows = [jnp.ones((2, 2, 192), jnp.float32)] * 2
    dend, h0 = jnp.ones((2, 2, 3, 64), jnp.float32), jnp.zeros((2, 2, 64, 128), jnp.float32)
    v = jnp.zeros((2, 192, 2, 128), jnp.bfloat16)
    shapes = "the inputs must be .B, Tp, H, D. .raw."
    bad = [(dict(raw_qk=rows, keep_dtype=jnp.bfloat16), "raw_qk and inverse are forms of a forward alone"),
           (dict(raw_qk=rows[:1]), "raw_qk is two row factors"),
           (dict(raw_qk=rows, inverse=(m, *rows)), "w is None with raw_qk and inverse"),
           (dict(inverse=(m, *rows), w=None, u=v), "w is None with raw_qk and inverse"),
           (dict(raw_qk=rows, q=w), shapes + r".*'q': \(\(2, 2, 192, 64\), \(2, 192, 2, 64\)\)"),
           (dict(inverse=(m, *rows)), shapes + r".*'u': \(\(2, 2, 192, 128\), \(2, 192, 2, 128\)\)"),
           (dict(inverse=(m, rows[0], jnp.ones((2, 2, 192, 64))), u=v), shapes + ".*'b'")]
    for kwargs, message in bad:
        args = dict(q=q, w=w, u=u, out_dtype=jnp.bfloat16, interpret=True) | kwargs
        with pytest.raises(ValueError, match="state_pass_mosaic: " + message):
            state_mgpu.state_pass_mosaic(args.pop("q"), k, args.pop("w"), args.pop("u"), m, dend, h0, **args)
    start = jnp.zeros((2, 2, 1, 64, 128 + 64), jnp.float32)
    for kg, w_, u_, message in [(w, None, v, shapes + ".*'k'"), (k, None, u, shapes + ".*'u'"),
                                (k, w, v, "w is None with kg_rows and inverse")]:
        with pytest.raises(ValueError, match="zero_start_pass_mosaic: " + message):
            state_mgpu.zero_start_pass_mosaic(kg, w_, u_, dend, start, value_tiles=2, block_v=64, interpret=True,
                                              kg_rows=rows[0], inverse=(m, *rows))
    # two compute warpgroups: no kept states, a bf16 o, two V tiles a CTA
    for kwargs in [dict(keep_dtype=jnp.bfloat16), dict(out_dtype=jnp.float32), dict(u=u[..., :64], h0=h0[..., :64]),
                   dict(warpgroups=3)]:
        args = dict(u=u, h0=h0, out_dtype=jnp.bfloat16, block_v=64, warpgroups=2, interpret=True) | kwargs
        with pytest.raises(ValueError, match="warpgroups must be 1, or 2"):
            state_mgpu.state_pass_mosaic(w, w, w, args.pop("u"), m, dend, args.pop("h0"), **args)


@pytest.mark.parametrize("rule,block_v,nseg", [("kda", 64, 1), ("gdn", 16, 1), ("kda", 64, 2)])
def test_pallas_with_the_mosaic_state_pass(rule, block_v, nseg, monkeypatch):
    # `chunk_fwd.PASS_IMPL = "mosaic"`: the forward's state pass (keeping the states for the backward) and the
    # backward's reverse pass through the Mosaic GPU kernels, bf16 at chunk 64 (T = 80 ragged, K = V = 64, non-zero
    # h0; V tiles of 64 with PASS_MIN_PROGRAMS at 1, else 16; nseg 2: T = 200, both passes in 2 segments of 2
    # chunks, `segments`): o, the state and every gradient within FLA's bounds of the fp32 oracle, and equal to the
    # Triton passes' to 1e-4 (the same products; CPU: 0 for the bf16 outputs, at most 4e-8).
    from lineattn.ops.pallas import chunk_fwd, segments
    if block_v == 64:
        monkeypatch.setattr(chunk_fwd, "PASS_MIN_PROGRAMS", 1)
    assert chunk_fwd.pick_block_v(2, 64) == block_v
    monkeypatch.setattr(segments, "MIN_SEGMENT_CHUNKS", 2 if nseg > 1 else 64)
    assert segments.pick_segments(1, 4, 64) == nseg
    inputs = make_inputs(rule, B=1, **dict(SMALL, T=80 if nseg == 1 else 200, K=64, V=64), seed=23)
    x = {n: y.astype(jnp.bfloat16) if n in ("q", "k", "v", "beta") else y for n, y in inputs.items()}
    results = {}
    # in segments also with the forward's zero-start pass as the Mosaic kernel (`chunk_fwd.ZERO_START_IMPL`)
    for impl, zero_start in [("triton", "triton"), ("mosaic", "triton")] + [("mosaic", "mosaic")] * (nseg > 1):
        monkeypatch.setattr(chunk_fwd, "PASS_IMPL", impl)
        monkeypatch.setattr(chunk_fwd, "ZERO_START_IMPL", zero_start)
        results[impl + zero_start] = loss_and_grads(rule, x, backend="pallas", chunk_size=64)
    mosaic = results["mosaictriton"]
    results = {name: {"o": o, "ht": ht, **grads} for name, (o, ht, grads) in results.items()}
    assert ("lineattn_zero_start_pass_mosaic" in grad_jaxpr(rule, x, chunk_size=64, backend="pallas")) == (nseg > 1)
    monkeypatch.setattr(chunk_fwd, "ZERO_START_IMPL", "triton")
    want = results.pop("tritontriton")
    errors = {(name, n): _rel_rms(got[n], want[n]) for name, got in results.items() for n in want}
    assert max(errors.values()) <= 1e-4, errors
    jaxpr = grad_jaxpr(rule, x, chunk_size=64, backend="pallas")
    assert "lineattn_state_pass_mosaic" in jaxpr and "lineattn_reverse_pass_mosaic" in jaxpr
    # in segments, the zero-end reverse pass too (the maps from the forward: V columns only)
    assert jaxpr.count("lineattn_reverse_pass_mosaic") == jaxpr.count("lineattn_state_pass_mosaic") * (1 + (nseg > 1))
    assert "lineattn_chunk_bwd_reverse_local" not in jaxpr
    _assert_bf16_close(rule, inputs, chunk_size=64, got=mosaic)  # the Mosaic passes against the oracle


def test_pass_impl_auto_takes_the_mosaic_passes_where_they_fit(monkeypatch):
    # PASS_IMPL "auto" (the default) as on a Hopper GPU (`hopper` and compiled kernels faked; traced only): the
    # Mosaic GPU passes for bf16 at K = V = 128 with V tiles of 64 (B * H = 128, or 64 in 2 segments); the Triton
    # passes for fp32, for V tiles below 64 (a single short sequence) and for the additive write (GLA); in segments
    # the forward's zero-start pass as the Mosaic kernel as well (ZERO_START_IMPL "auto").
    from lineattn.ops.pallas import api, chunk_bwd, chunk_fwd, common
    monkeypatch.setattr(common, "hopper", lambda: True)
    compiled = lambda interpret: False if interpret is None else bool(interpret)
    monkeypatch.setattr(chunk_fwd, "interpret_mode", compiled)
    monkeypatch.setattr(chunk_bwd, "interpret_mode", compiled)

    def passes(rule, B, H, dtype=jnp.bfloat16, T=256):
        z = jnp.zeros((B, T, H, 128), dtype)
        x = dict(q=z, k=z, v=z, g=jnp.zeros((B, T, H, 128), jnp.float32),
                 beta=None if rule == "gla" else jnp.zeros((B, T, H), dtype))
        jaxpr = grad_jaxpr(rule, x, backend="pallas")
        zero_start = "lineattn_zero_start_pass_mosaic" in jaxpr
        segmented = T == 1024  # (`chunk_fwd.PASS_SEGMENTS` "always": whether or not the forward saves)
        assert zero_start or ("lineattn_chunk_state_pass_local" in jaxpr) == segmented
        return "lineattn_state_pass_mosaic" in jaxpr, "lineattn_reverse_pass_mosaic" in jaxpr, zero_start

    assert passes("kda", 4, 32) == (True, True, False), "the Mosaic passes where they fit"
    # in 2 segments: the forward's zero-start pass too (ZERO_START_IMPL "auto")
    assert passes("kda", 2, 32, T=1024) == (True, True, True), "in 2 segments"
    assert passes("kda", 2, 32, jnp.float32, T=1024) == (False, False, False)
    assert passes("kda", 4, 32, jnp.float32) == (False, False, False)
    assert passes("kda", 1, 16) == (False, False, False)
    assert passes("gla", 4, 32) == (False, False, False)
    monkeypatch.setattr(chunk_fwd, "ZERO_START_IMPL", "triton")
    assert passes("kda", 2, 32, T=1024) == (True, True, False)
    # the backward that recomputes its terms in fp32 ("kernels-mml2"): its passes stay Triton (run22b: in segments
    # they raised for fp32 matrices), while its forward still takes the Mosaic pass (in segments too)
    monkeypatch.setattr(api, "BACKWARD", "kernels-mml2")
    assert passes("kda", 2, 32, T=1024) == (True, False, False)
    assert passes("kda", 4, 32) == (True, False, False)
    monkeypatch.setattr(api, "BACKWARD", "kernels-saved")
    monkeypatch.setattr(chunk_fwd, "ZERO_START_IMPL", "fast")
    with pytest.raises(ValueError, match="ZERO_START_IMPL"):
        passes("kda", 2, 32, T=1024)


@pytest.mark.parametrize("rule", ["kda", "gdn", "gla"])
def test_pallas_segmented_state_passes(rule, monkeypatch):
    # `segments.SEGMENT_PASSES`: the forward's state pass and the backward's reverse pass in 4 segments of 2 chunks
    # (T = 120 ragged, chunk 16), fp32 to 1e-4 of the oracle (every gradient, initial state and final-state
    # cotangent), then bf16. The backward takes the segments' maps from the forward (`chunk_fwd.PASS_SEGMENTS`
    # "save"); with "never" it forms them itself (an unsegmented forward): the same results to 1e-5 in fp32.
    from lineattn.ops.pallas import chunk_fwd, segments
    monkeypatch.setattr(segments, "SEGMENT_PASSES", True)
    monkeypatch.setattr(segments, "MIN_SEGMENT_CHUNKS", 2)
    assert segments.pick_segments(2, 8, 32) == 4 and segments.pick_segments(2, 6, 32) == 1
    inputs = make_inputs(rule, B=1, T=120, H=2, K=32, V=32, seed=17)
    o, ht, grads = _compare(rule, inputs, chunk_size=16)
    jaxpr = grad_jaxpr(rule, inputs, chunk_size=16, backend="pallas")
    # (the states pass is the forward's, `chunk.SAVE_STATES`; segmented without it: `test_pallas_saved_states`)
    assert "lineattn_chunk_bwd_reverse_local" in jaxpr and "lineattn_chunk_bwd_states_local" not in jaxpr
    assert "lineattn_chunk_state_pass_local" in jaxpr
    monkeypatch.setattr(chunk_fwd, "PASS_SEGMENTS", "never")
    assert "lineattn_chunk_state_pass_local" not in grad_jaxpr(rule, inputs, chunk_size=16, backend="pallas")
    o0, ht0, grads0 = loss_and_grads(rule, inputs, backend="pallas", chunk_size=16)
    assert_close({"o": o, "ht": ht, **grads}, {"o": o0, "ht": ht0, **grads0}, 1e-5, f"{rule}/maps from the forward")
    # "always": a forward alone in segments too (its zero-start pass and `segment_starts`), the unsegmented one's o
    # and final state to 1e-5 in fp32
    forward = lambda: ops.linear_attention(rule, *(inputs[n] for n in ("q", "k", "v", "g", "beta")), chunk_size=16,
                                           initial_state=inputs["initial_state"], output_final_state=True,
                                           backend="pallas")
    unsegmented = forward()
    monkeypatch.setattr(chunk_fwd, "PASS_SEGMENTS", "always")
    assert "lineattn_chunk_state_pass_local" in str(jax.make_jaxpr(forward)())
    assert_close(dict(zip(("o", "ht"), forward())), dict(zip(("o", "ht"), unsegmented)), 1e-5,
                 f"{rule}/forward alone in segments")
    monkeypatch.setattr(chunk_fwd, "PASS_SEGMENTS", "sometimes")
    with pytest.raises(ValueError, match="PASS_SEGMENTS"):
        chunk_fwd.pass_segments(2, 8, 32, True, False)
    monkeypatch.setattr(chunk_fwd, "PASS_SEGMENTS", "save")
    _assert_bf16_close(rule, inputs, chunk_size=16)


@pytest.mark.parametrize("rule,segmented", [("kda", True), ("gdn", False)])
def test_pallas_saved_states(rule, segmented, monkeypatch):
    # `chunk.SAVE_STATES` (the default): the forward's state pass keeps every chunk's state and E for the
    # backward, which then runs no states pass of its own; False: the backward's own states pass (segmented: 4
    # segments of 2 chunks at chunk 16, T = 120 ragged). fp32: the same gradients both ways (the same products in
    # the same order) and the oracle's to 1e-4; then bf16 within FLA's bounds without saved states. A channel
    # gate's cumsum G is formed by the forward's Gram kernel (`gram.GRAM_FORMS_G`) and saved: no gate-cumsum
    # kernel in the forward+backward (GDN's runs in both).
    from lineattn.ops.pallas import chunk, segments
    monkeypatch.setattr(segments, "MIN_SEGMENT_CHUNKS", 2 if segmented else 64)
    inputs = make_inputs(rule, B=1, T=120, H=2, K=32, V=32, seed=18)
    C = 16 if segmented else 32
    results = {}
    for save in (True, False):
        monkeypatch.setattr(chunk, "SAVE_STATES", save)
        results[save] = loss_and_grads(rule, inputs, backend="pallas", chunk_size=C)
        jaxpr = grad_jaxpr(rule, inputs, chunk_size=C, backend="pallas")
        assert ("lineattn_chunk_bwd_states" in jaxpr) == (not save)
        assert ("lineattn_chunk_bwd_reverse_local" in jaxpr) == segmented
        assert jaxpr.count("name=lineattn_chunk_cumsum") == (0 if rule == "kda" else 2)
    (o1, ht1, grads1), (o0, ht0, grads0) = results[True], results[False]
    assert_close({"o": o1, "ht": ht1, **grads1}, {"o": o0, "ht": ht0, **grads0}, 1e-6, f"{rule}/saved states")
    _compare(rule, inputs, chunk_size=C, got=results[False])  # (SAVE_STATES is False now)
    _assert_bf16_close(rule, inputs, chunk_size=C)


def test_pallas_kernel_tiles(monkeypatch):
    # The column tiles as module constants (for sweeps): the backward's (`chunk_bwd.WY_BT`, `CHUNK_GRADS_BK`,
    # `CHUNK_GRADS_BV`) 16 wide loop over K = 32 and V = 64 in pieces; the gate cumsum's K tile of 16
    # (`gram.CUMSUM_BK`: two tiles of block spreads) and the state passes' whole V = 128 as one tile
    # (`PASS_MAX_BV`, with PASS_MIN_PROGRAMS low enough to keep it); the Gram gradients' fast path over the
    # chunk's rows in 2 parts (`GRADS_ROW_SPLIT`; 4 asked at chunk 32 gives 2: parts of 16 rows at least), then
    # in 4 at chunk 64. Outputs and gradients still match the oracle.
    from lineattn.ops.pallas import chunk_bwd, chunk_fwd, gram, gram_bwd
    for name in ("WY_BT", "CHUNK_GRADS_BK", "CHUNK_GRADS_BV"):
        monkeypatch.setattr(chunk_bwd, name, 16)
    monkeypatch.setattr(gram_bwd, "GRADS_ROW_SPLIT", 4)
    _compare("kda", make_inputs("kda", B=1, T=80, H=2, K=32, V=64, seed=19))
    _compare("kda", make_inputs("kda", B=1, T=80, H=2, K=32, V=32, seed=21), chunk_size=64)
    monkeypatch.setattr(gram, "CUMSUM_BK", 16)
    monkeypatch.setattr(chunk_fwd, "PASS_MAX_BV", 128)
    monkeypatch.setattr(chunk_fwd, "PASS_MIN_PROGRAMS", 1)
    assert chunk_fwd.pick_block_v(2, 128) == 128
    _compare("kda", make_inputs("kda", B=1, T=80, H=2, K=32, V=128, seed=20))


def _gram_inputs(seed):
    """Inputs of `gram.gram_rows`: two chunks of bf16 q, k (K = 128, rows of norm ~1), the in-chunk cumsum G of
    gates in (-5, 0), and beta in (0, 1); B = 1, H = 2."""
    from lineattn.ops.pallas import gram
    rng = np.random.default_rng(seed)
    B, Tp, H, K, C = 1, 128, 2, 128, 64
    q, k = (jnp.asarray(rng.standard_normal((B, Tp, H, K)) / np.sqrt(K), jnp.bfloat16) for _ in range(2))
    G, _ = gram.gate_cumsum(-jnp.asarray(rng.uniform(0, 5, (B, Tp, H, K)), jnp.float32), C=C, K=K,
                                 interpret=True)
    return q, k, G, jnp.asarray(rng.uniform(0, 1, (B, Tp, H)), jnp.bfloat16)


def test_gram_tile_loop_gives_the_unrolled_numbers():
    # `gram.GRAM_TILE_LOOP` (the default): the fast-path Gram kernel takes its K tiles in a `fori_loop` (pipelined
    # on a GPU, GRAM_STAGES) instead of unrolled. M, A, Qin, Kg and Kin equal the unrolled kernel's bit for bit: two
    # chunks, K = 128 in two tiles of 64 (and four of 32), bf16, gates in (-5, 0).
    from lineattn.ops.pallas import gram, tuning
    q, k, G, beta = _gram_inputs(seed=23)
    K, C = q.shape[-1], 64  # (two chunks of 64)
    for bk in (64, 32):
        run_gram = lambda: gram.gram_rows(q, k, G, beta, C=C, scale=K**-0.5, store=jnp.bfloat16, prec="tf32",
                                           delta=True, warps=2, interpret=True, bk=bk, fast_only=True, kin=True)
        forms = {}
        for loop in (True, False):  # (override clears JAX's caches: each setting traced afresh)
            with tuning.override({"gram.GRAM_TILE_LOOP": loop}):
                forms[loop] = (run_gram(), str(jax.make_jaxpr(run_gram)()))
        (looped, looped_text), (unrolled, unrolled_text) = forms[True], forms[False]
        assert looped_text.count("dot_general") == 2 and unrolled_text.count("dot_general") == 2 * K // bk
        assert len(looped) == len(unrolled) == 5 and float(jnp.max(jnp.abs(unrolled[0].astype(jnp.float32)))) > 0.01
        for name, x, y in zip(("M", "A", "Qin", "Kg", "Kin"), looped, unrolled):
            np.testing.assert_array_equal(np.asarray(x.astype(jnp.float32)), np.asarray(y.astype(jnp.float32)),
                                          err_msg=f"{name}, K tile {bk}")


def test_gram_bf16x2_splits_the_query_side_only():
    # `gram.GRAM_PREC = "bf16x2"`: M's products take the query side in two bf16 parts against bf16 keys, A's
    # take the same bf16 keys once. So A equals the all-bf16 kernel's bit for bit, and M's error against the exact
    # products is about 1/sqrt(2) of bf16's (0.71 here: the keys' rounding alone is left). Two chunks, K = 128, gates
    # in (-5, 0).
    from lineattn.ops.pallas import gram
    q, k, G, beta = _gram_inputs(seed=29)
    K, C = q.shape[-1], 64  # (two chunks of 64)
    M, A = {}, {}
    for prec in ("ieee", "bf16", "bf16x2"):
        M[prec], A[prec] = gram.gram_rows(q, k, G, beta, C=C, scale=K**-0.5, store=jnp.float32, prec=prec,
                                               delta=True, warps=2, interpret=True, fast_only=True)[:2]
    np.testing.assert_array_equal(np.asarray(A["bf16x2"]), np.asarray(A["bf16"]))
    exact = np.asarray(M["ieee"], np.float64)
    err = {p: float(np.sqrt(np.mean((np.asarray(M[p], np.float64) - exact) ** 2) / np.mean(exact**2)))
           for p in ("bf16", "bf16x2")}
    assert err["bf16x2"] < 0.8 * err["bf16"] and err["bf16"] > 1e-3, err


def _gram_chunk_case(dtype, gates):
    """`gram_chunks`' inputs (B = 1, two chunks of 64, H = 2, K = 64; gates uniform in (-5, 0), all at the lower bound
    -5, all 0, uniform with a -1000 cut at row 70, or weak: uniform in (-0.2, 0)), its keyword arguments and the exact
    rewrite of flagged chunks."""
    from lineattn.ops.pallas import gram
    rng = np.random.default_rng(31)
    B, Tp, H, K, C = 1, 128, 2, 64, 64
    unit = lambda x: x / np.linalg.norm(x, axis=-1, keepdims=True)
    q, k = (jnp.asarray(unit(rng.standard_normal((B, Tp, H, K))), dtype) for _ in range(2))
    g = {"uniform": rng.uniform(-5, 0, (B, Tp, H, K)), "lower_bound": np.full((B, Tp, H, K), -5.0),
         "zero": np.zeros((B, Tp, H, K)), "cut": rng.uniform(-5, 0, (B, Tp, H, K)),
         "weak": rng.uniform(-0.2, 0, (B, Tp, H, K))}[gates]
    if gates == "cut":
        g[:, 70] = -1000.0
    g, beta = jnp.asarray(g, jnp.float32), jnp.asarray(rng.uniform(0, 1, (B, Tp, H)), dtype)
    prec = "ieee" if dtype == jnp.float32 else "tf32"
    kw = dict(C=C, scale=K**-0.5, store=jnp.float32 if dtype == jnp.float32 else dtype, prec=prec, interpret=True)
    exact = lambda flags, G, m, A: gram.gram_exact_chunks(flags, q, k, G, beta, m, A, C=C, scale=K**-0.5,
                                                               interpret=True, prec=prec)
    return q, k, g, beta, kw, exact


@pytest.mark.parametrize("dtype,gates", [(jnp.float32, "uniform"), (jnp.float32, "cut"), (jnp.bfloat16, "uniform"),
                                         (jnp.bfloat16, "lower_bound"), (jnp.bfloat16, "zero"),
                                         (jnp.bfloat16, "cut")])
def test_gram_chunks_form_the_gate_cumsum_themselves(dtype, gates):
    # `gram.GRAM_FORMS_G` (the default for a channel gate): `gram_chunks`, one program a chunk, forms the in-chunk
    # cumsum G from the raw g itself (a product with the triangle of ones, g in three bf16 parts) and, with
    # `gram_exact_chunks` after it, gives the M, A, Qin, Kg, Kin, e^(G_C) and chunk flags of the gate-cumsum kernel
    # followed by the 16-row Gram kernel: relative RMS <= 3e-4 (CPU: <= 6e-5, the sums rounding in another order),
    # the flags equal. Gates uniform in (-5, 0), all at the lower bound -5, all 0, and uniform with a -1000 cut at row
    # 70, which flags the second chunk: the G it writes there for the exact rewrite is the cumsum kernel's to fp32
    # rounding. B = 1, two chunks, H = 2, K = 64 in tiles of 16.
    from lineattn.ops.pallas import gram
    from lineattn.ops.pallas.common import SUB
    q, k, g, beta, kw, exact = _gram_chunk_case(dtype, gates)
    C, K = kw["C"], q.shape[-1]
    G, dend, spreads = gram.gate_cumsum(g, C=C, K=K, interpret=True, spreads=True)
    m, A, *rest = gram.gram_rows(q, k, G, beta, delta=True, warps=2, fast_only=True, kin=True, **kw)
    flags = gram.chunk_flags(spreads, C // SUB)
    want = (*exact(flags, G, m, A), *rest, dend)
    m, A, qin, kg, kin, dend, got_flags, got_G = gram.gram_chunks(q, k, g, beta, bk=16, **kw)
    got = (*exact(got_flags, got_G, m, A), qin, kg, kin, jnp.swapaxes(dend, -1, -2))
    np.testing.assert_array_equal(np.asarray(got_flags), np.asarray(flags))
    assert float(jnp.max(flags)) == (1.0 if gates == "cut" else 0.0)
    for name, x, y in zip(("M", "A", "Qin", "Kg", "Kin", "e^(G_C)"), got, want):
        assert _rel_rms(x, y) <= 3e-4, name
    if gates == "cut":  # (G is written in the flagged chunk only)
        np.testing.assert_allclose(np.asarray(got_G[:, C:]), np.asarray(G[:, C:]), rtol=2e-6, atol=1e-5)
    # keep_g (the saving forward and the solve's forms: G in every chunk for them) and without Kin: the same Qin, Kg,
    # e^(G_C) and flags, bit for bit, M and A (after the exact rewrite, which reads its G) within 1e-6 relative RMS
    # in fp32, 3e-4 in bf16 (its keys' factors are GRAM_FACTORS_KEEP_G's, not GRAM_FACTORS'), and G in both chunks to
    # fp32 rounding.
    # (Compared in fp32: the fast path's M and A before the rewrite hold NaNs in a flagged chunk.)
    k_m, k_A, k_qin, k_kg, k_dend, k_flags, kept_G = gram.gram_chunks(q, k, g, beta, bk=16, kin=False,
                                                                           keep_g=True, **kw)
    kept = (*exact(k_flags, kept_G, k_m, k_A), k_qin, k_kg, jnp.swapaxes(k_dend, -1, -2), k_flags)
    for x, y in zip(kept[:2], got[:2]):
        assert _rel_rms(x, y) <= (1e-6 if dtype == jnp.float32 else 3e-4)
    for x, y in zip(kept[2:], (*got[2:4], got[5], got_flags)):
        np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    np.testing.assert_allclose(np.asarray(kept_G), np.asarray(G), rtol=2e-6, atol=1e-5)


@pytest.mark.parametrize("factors", ["next-middle", "middle-keys", "halves"])
@pytest.mark.parametrize("dtype,gates", [(jnp.float32, "weak"), (jnp.float32, "lower_bound"), (jnp.float32, "cut"),
                                         (jnp.bfloat16, "weak"), (jnp.bfloat16, "uniform"), (jnp.bfloat16, "zero")])
def test_gram_factors_through_middle_rows(factors, dtype, gates, monkeypatch):
    # `gram.GRAM_FACTORS` / `GRAM_FACTORS_KEEP_G` against "per-block" (one exp per key and block): "next-middle" (the
    # keys of earlier blocks as two factors <= 1, toward the next block's middle row, then a [1, K] row) and
    # "middle-keys" (every key toward its own block's middle row, then a row e^(G_a' - G_b')), in both of
    # `gram_chunks`' forms (Kin written; G kept). M and A (after the exact rewrite of flagged chunks) within 1e-6
    # relative RMS in fp32 (CPU: <= 6e-8, the factors' roundings), 3e-4 in bf16 (CPU: <= 1.3e-7; on a GPU a rounding
    # flip of an operand); Qin, Kg, Kin, e^(G_C), the flags and the kept G bit for bit. At the lower bound (-5 a
    # token) the middle rows of blocks two apart lie 160 nats apart: the factors underflow to 0 there, as the one exp
    # does. The cut (-1000 at row 70) flags the second chunk. "halves" (the forward alone's form only): 32-row halves,
    # whose rows lie up to 80 nats from their middle row at the lower bound, so the factors' exponents are twice as
    # large and so are their roundings: within 1e-5 in fp32 (CPU: 3.3e-6 at the lower bound, 6e-8 elsewhere; an fp64
    # reference is as far from either form).
    from lineattn.ops.pallas import gram
    q, k, g, beta, kw, exact = _gram_chunk_case(dtype, gates)
    tol = (1e-5 if factors == "halves" else 1e-6) if dtype == jnp.float32 else 3e-4
    for keep_g in (False,) if factors == "halves" else (False, True):
        outs = {}
        for mode in ("per-block", factors):
            monkeypatch.setattr(gram, "GRAM_FACTORS_KEEP_G" if keep_g else "GRAM_FACTORS", mode)
            m, A, *rest, flags, G = gram.gram_chunks(q, k, g, beta, bk=16, kin=not keep_g, keep_g=keep_g, **kw)
            outs[mode] = (*exact(flags, G, m, A), *rest, flags) + ((G,) if keep_g else ())
        assert float(jnp.max(outs[factors][-2 if keep_g else -1])) == (1.0 if gates == "cut" else 0.0)
        for name, x, y in zip(("M", "A"), outs[factors], outs["per-block"]):
            assert np.all(np.isfinite(np.asarray(x, np.float32))), name
            assert _rel_rms(x, y) <= tol, (name, keep_g)
        for x, y in zip(outs[factors][2:], outs["per-block"][2:]):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))


def test_gram_factors_unknown_is_a_value_error(monkeypatch):
    # A misspelt or removed `gram.GRAM_FACTORS` ("middle", removed in session 44) fails when traced, naming the setting;
    # so does "halves" for GRAM_FACTORS_KEEP_G (the backward's exact rewrite reads flags of 16-row blocks).
    from lineattn.ops.pallas import gram
    q, k, g, beta, kw, _ = _gram_chunk_case(jnp.float32, "uniform")
    for name, keep_g, value in (("GRAM_FACTORS", False, "middle"), ("GRAM_FACTORS_KEEP_G", True, "middle"),
                                ("GRAM_FACTORS_KEEP_G", True, "halves")):  # (the backward reads 16-row flags)
        monkeypatch.setattr(gram, name, value)
        with pytest.raises(ValueError, match=f"gram.{name} must be"):
            gram.gram_chunks(q, k, g, beta, bk=16, kin=not keep_g, keep_g=keep_g, **kw)


def test_chunk_cumsum_is_exact_to_fp32():
    # `gram.chunk_cumsum` (the in-chunk cumsum of `gram_chunks` as products with the triangle of ones, g in three
    # bf16 parts) against the cumsum in fp64: within 2e-7 relative (CPU: 6e-8, where fp32's sequential cumsum is
    # within 3e-7) for gates uniform in (-5, 0), in (-1e-3, 0) and in (-1000, 0), 64 rows of 16 channels.
    from lineattn.ops.pallas import gram
    rng = np.random.default_rng(33)
    for low in (-5.0, -1e-3, -1000.0):
        g = rng.uniform(low, 0.0, (64, 16)).astype(np.float32)
        want = np.cumsum(g.astype(np.float64), axis=0)
        got = np.asarray(jax.jit(gram.chunk_cumsum)(jnp.asarray(g)), np.float64)
        assert np.max(np.abs(got - want) / np.abs(want)) <= 2e-7, low


def test_wy_backward_tile_loop_gives_the_unrolled_numbers():
    # `chunk_bwd.WY_TILE_LOOP` (the default since run34a): the WY backward's V and K tiles (WY_BT = 32 of 64 here) in
    # `fori_loop`s give the unrolled kernel's gradients bit for bit (KDA, bf16, T = 100 ragged, a non-zero h0).
    from lineattn.ops.pallas import tuning
    x = make_inputs("kda", B=1, T=100, H=2, K=64, V=64, seed=25)
    x = {n: v.astype(jnp.bfloat16) if n in ("q", "k", "v", "beta") else v for n, v in x.items()}
    got, texts = {}, {}
    for loop in (True, False):  # (override clears JAX's caches: each setting traced afresh)
        with tuning.override({"chunk_bwd.WY_BT": 32, "chunk_bwd.WY_TILE_LOOP": loop}):
            got[loop] = loss_and_grads("kda", x, backend="pallas")
            texts[loop] = grad_jaxpr("kda", x, backend="pallas")
    assert texts[True] != texts[False] and all("lineattn_chunk_wy_bwd" in t for t in texts.values())
    assert float(jnp.max(jnp.abs(got[False][2]["dv"].astype(jnp.float32)))) > 0.01
    for name in got[False][2]:
        np.testing.assert_array_equal(np.asarray(got[True][2][name].astype(jnp.float32)),
                                      np.asarray(got[False][2][name].astype(jnp.float32)), err_msg=name)


def test_last_axis_fastest_keeps_the_grid_as_written(monkeypatch):
    # `common.LAST_AXIS_FASTEST` launches a kernel's grid reversed; its index maps and `common.program_id` still
    # see the grid as written: program (i, j) writes 10 i + j into block (i, j) either way.
    from jax.experimental import pallas as pl
    from lineattn.ops.pallas import common

    def kernel(o_ref):
        o_ref[...] = jnp.full(o_ref.shape, common.program_id(0) * 10 + common.program_id(1), jnp.float32)

    expected = np.broadcast_to((10 * np.arange(2)[:, None] + np.arange(3))[..., None], (2, 3, 8))
    for setting in ("", "*", "other,lineattn_test_ids"):
        monkeypatch.setattr(common, "LAST_AXIS_FASTEST", setting)
        out = common.pallas_call(kernel, grid=(2, 3), in_specs=[],
                                 out_specs=pl.BlockSpec((None, None, 8), lambda i, j: (i, j, 0)),
                                 out_shape=jax.ShapeDtypeStruct((2, 3, 8), jnp.float32), interpret=None,
                                 name="lineattn_test_ids")()
        np.testing.assert_array_equal(np.asarray(out), expected, err_msg=f"LAST_AXIS_FASTEST={setting!r}")


def test_pallas_every_grid_reversed(monkeypatch):
    # Every Triton kernel launched last axis first gives the same numbers as every kernel launched first axis first
    # (the kernels that read their program id included: the Gram rows, its gradients, the state passes), cuts in the
    # gate included.
    from lineattn.ops.pallas import common
    inputs = make_inputs("kda", B=1, T=48, H=2, K=32, V=32, seed=23)
    inputs["g"] = inputs["g"].at[:, 37].set(-1000.0)
    results = []
    for setting in ("", "*"):
        monkeypatch.setattr(common, "LAST_AXIS_FASTEST", setting)
        jax.clear_caches()
        results.append(loss_and_grads("kda", inputs, backend="pallas", chunk_size=32))
    for a, b in zip(*map(jax.tree.leaves, results)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_pallas_fp32_cotangents(rule, monkeypatch):
    # `chunk_bwd.COT_DTYPE = "float32"` (the default stores the chunk gradients' dQin, dKg, dM in bf16).
    from lineattn.ops.pallas import chunk_bwd
    monkeypatch.setattr(chunk_bwd, "COT_DTYPE", "float32")
    test_pallas_bf16_against_fp32_oracle(rule, None, monkeypatch)


def test_pallas_fp32_wy_cotangents(monkeypatch):
    # `chunk_bwd.WY_COT_DTYPE = "float32"` (the default stores the WY backward's dKK and dKin in bf16 for bf16
    # inputs): KDA within FLA's bounds of the oracle at chunk 64, K = V = 64, and fp32 inputs to 1e-4.
    from lineattn.ops.pallas import chunk_bwd
    monkeypatch.setattr(chunk_bwd, "WY_COT_DTYPE", "float32")
    inputs = make_inputs("kda", B=1, **dict(SMALL, K=64, V=64), seed=6)
    _assert_bf16_close("kda", inputs, chunk_size=64)
    _compare("kda", inputs, chunk_size=64)


@pytest.mark.parametrize("rule", ["kda", "gdn", "deltanet"])
def test_decode_step_matches_oracle(rule):
    x = make_inputs(rule, B=3, T=3, H=2, K=32, V=64, seed=8)
    o_ref, ht_ref = recurrent(x["q"], x["k"], x["v"], x["g"], x["beta"], scale=32**-0.5,
                              initial_state=x["initial_state"])
    # Three tokens at once, emitting the state after each; the state buffer is donated and updated in place.
    step = jax.jit(lambda q, k, v, g, b, s: decode_step(q, k, v, g, b, s, output_states=True), donate_argnums=5)
    o, ht, states = step(x["q"], x["k"], x["v"], x["g"], x["beta"], jnp.array(x["initial_state"]))
    assert_close({"o": o, "ht": ht, "last": states[:, -1]}, {"o": o_ref, "ht": ht_ref, "last": ht_ref}, TOL, rule)
    # One token: the state after it is the first emitted state.
    first = lambda x: None if x is None else x[:, :1]
    o1, s1 = decode_step(*(first(x[n]) for n in ("q", "k", "v", "g", "beta")), x["initial_state"])
    assert_close({"o": o1, "s": s1}, {"o": o_ref[:, :1], "s": states[:, 0]}, TOL, rule)
    # The launch variants give the same step: V tiles of 16 with the requests first in the grid; o from the
    # updated state (three tokens: each reads the state the previous one wrote).
    o2, s2 = decode_step(*(first(x[n]) for n in ("q", "k", "v", "g", "beta")), x["initial_state"], block_v=16,
                         v_fastest=False)
    assert_close({"o": o2, "s": s2}, {"o": o_ref[:, :1], "s": states[:, 0]}, TOL, rule)
    o3, s3 = decode_step(*(x[n] for n in ("q", "k", "v", "g", "beta")), x["initial_state"], readout="updated")
    assert_close({"o": o3, "s": s3}, {"o": o_ref, "s": ht_ref}, TOL, rule)
    # The state stored transposed, [B, H, V, K], and o read after the state's stores (three tokens, the states
    # after each, V tiles of 32 and of 16; "stored" also without the states, where only the last token stores);
    # "vk" with each program's V rows strided (V = 64 in tiles of 16: rows j, j + 4, ...).
    vk = lambda s: jnp.swapaxes(s, -1, -2)
    for layout, readout, block_v, v_tiles in [("vk", "decayed", 32, "blocks"), ("vk", "stored", 16, "blocks"),
                                              ("kv", "stored", 32, "blocks"), ("vk", "stored", 16, "strided"),
                                              ("vk", "decayed", 32, "strided")]:
        to = vk if layout == "vk" else (lambda s: s)
        opts = dict(state_layout=layout, readout=readout, block_v=block_v, v_tiles=v_tiles)
        o4, s4, states4 = decode_step(*(x[n] for n in ("q", "k", "v", "g", "beta")), to(x["initial_state"]),
                                      output_states=True, **opts)
        assert_close({"o": o4, "s": to(s4), "states": to(states4)}, {"o": o_ref, "s": ht_ref, "states": states},
                     TOL, rule)
        o5, s5 = decode_step(*(x[n] for n in ("q", "k", "v", "g", "beta")), to(x["initial_state"]), **opts)
        assert_close({"o": o5, "s": to(s5)}, {"o": o_ref, "s": ht_ref}, TOL, rule)
    with pytest.raises(ValueError, match="v_tiles must be 'blocks', or 'strided' with state_layout 'vk'"):
        decode_step(*(x[n] for n in ("q", "k", "v", "g", "beta")), x["initial_state"], v_tiles="strided")
    # Without a readout, each layout takes its fastest: "stored" with "vk", "decayed" with "kv".
    for layout, readout in (("vk", "stored"), ("kv", "decayed")):
        to = vk if layout == "vk" else (lambda s: s)
        step = lambda **kw: decode_step(*(x[n] for n in ("q", "k", "v", "g", "beta")), to(x["initial_state"]),
                                        state_layout=layout, **kw)
        np.testing.assert_array_equal(np.asarray(step()[0]), np.asarray(step(readout=readout)[0]))
    with pytest.raises(ValueError, match="readout"):
        decode_step(*(x[n] for n in ("q", "k", "v", "g", "beta")), x["initial_state"], readout="after")
    with pytest.raises(ValueError, match="state_layout"):
        decode_step(*(x[n] for n in ("q", "k", "v", "g", "beta")), x["initial_state"], state_layout="kvt")
    with pytest.raises(ValueError, match=r"fp32 state \[B, H, V, K\] = \[3, 2, 64, 32\]"):
        decode_step(*(x[n] for n in ("q", "k", "v", "g", "beta")), x["initial_state"], state_layout="vk")


def test_decode_step_rejects_inputs_of_other_shapes():
    # decode_step reads fixed blocks of its inputs: one of another shape (a gate per value column, another T or H)
    # would be read silently wrong, so each is a ValueError naming it.
    x = make_inputs("kda", B=2, T=1, H=2, K=32, V=32, seed=29)
    args = lambda **kw: [kw.get(n, x[n]) for n in ("q", "k", "v", "g", "beta")] + [x["initial_state"]]
    for name, bad in [("q", x["q"].reshape(2, 1, 64)), ("k", jnp.concatenate([x["k"]] * 2, axis=1)),
                      ("v", x["v"][:, :, :1]), ("g", jnp.concatenate([x["g"]] * 2, axis=-1)),
                      ("beta", x["beta"][..., None])]:
        with pytest.raises(ValueError, match=f"decode_step: {name} must be"):
            decode_step(*args(**{name: bad}))
    with pytest.raises(ValueError, match="decode_step: q must be a floating-point array"):
        decode_step(*args(q=x["q"].astype(jnp.int32)))


def test_pallas_backend_selection_and_errors():
    kda = ops.RULES["kda"]
    if not on_gpu():
        assert ops.select_backend(kda, "auto", dtype=jnp.bfloat16, K=128, V=128) == "chunk"
    else:
        assert ops.select_backend(kda, "auto", dtype=jnp.bfloat16, K=128, V=128) == "pallas"
        assert ops.select_backend(kda, "auto", dtype=jnp.bfloat16, K=128, V=128, chunk_size=128) == "chunk"
        assert ops.select_backend(kda, "auto", dtype=jnp.float16, K=128, V=128) == "chunk"
    x = make_inputs("delta_element", B=1, T=8, H=1, K=16, V=16)
    with pytest.raises(ValueError, match="pallas"):
        ops.linear_attention("delta_element", x["q"], x["k"], x["v"], x["g"], x["beta"], backend="pallas")
    x = make_inputs("kda", B=1, T=8, H=1, K=24, V=16)
    with pytest.raises(ValueError, match="powers of two"):
        ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], backend="pallas")


def test_auto_takes_the_kernels_only_where_the_gpu_tests_ran(monkeypatch):
    # As on a GPU: KDA, GDN and GLA at K = V = 128, chunk 64 (their H200 tests); DeltaNet (at the edge of the bf16
    # tolerance there), other head dims, chunk 32 and float16 go to the XLA chunk path.
    monkeypatch.setattr(pallas_api, "on_gpu", lambda: True)
    ok = lambda name, **kw: pallas_api.auto_ok(ops.RULES[name], kw.get("dtype", jnp.bfloat16), kw.get("K", 128),
                                               kw.get("V", 128), kw.get("chunk_size", 64))
    assert ok("kda") and ok("gdn") and ok("gla") and ok("kda", dtype=jnp.float32)
    assert not ok("deltanet") and not ok("kda", K=64) and not ok("kda", chunk_size=32)
    assert not ok("kda", dtype=jnp.float16)


def test_pallas_takes_q_k_v_in_one_dtype(monkeypatch):
    # The kernels take q, k and v in one dtype: a mix is a ValueError under backend="pallas" (casting one to
    # another's dtype would round it silently), and `auto` takes the XLA chunk form (fp32) for it, as on a GPU.
    monkeypatch.setattr(pallas_api, "on_gpu", lambda: True)
    x = make_inputs("kda", B=1, T=70, H=2, K=128, V=128, seed=28)
    args = lambda **kw: [kw.get(n, x[n]) for n in ("q", "k", "v", "g", "beta")]
    mixed = args(q=x["q"].astype(jnp.bfloat16))  # (k, v fp32)
    with pytest.raises(ValueError, match="q, k and v must share one dtype, got q bfloat16, k float32, v float32"):
        ops.chunk_kda(*mixed, backend="pallas")
    kernels = lambda a: [n for n in ("lineattn_chunk_gram", "lineattn_chunk_cumsum")
                         if n in str(jax.make_jaxpr(lambda *a: ops.chunk_kda(*a, backend="auto")[0])(*a))]
    assert kernels(mixed) == [] and kernels(args(**{n: x[n].astype(jnp.bfloat16) for n in ("q", "k", "v")}))


@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_pallas_takes_fp32_beta_as_given(rule):
    # beta in fp32 beside bf16 q, k, v (the layers' sigmoid output) reaches the kernels unrounded (until 2026-12-04
    # it was cast to q's dtype): o, the state and every gradient within FLA's bf16 tolerances of the fp32 XLA chunk
    # form on the same inputs, beta's gradient in fp32, and o apart from the kernels' o with beta rounded to bf16.
    # CPU, T = 150 ragged, K = V = 64: KDA o 3.20e-3 (3.38e-3 with beta rounded, against the same reference), GDN
    # 3.11e-3 (3.45e-3); the two o 3.1e-3 / 2.9e-3 apart.
    x = make_inputs(rule, B=1, T=150, H=2, K=64, V=64, seed=27)
    mixed = {n: v.astype(jnp.bfloat16) if n in ("q", "k", "v") else v for n, v in x.items()}  # (beta fp32)
    o_ref, ht_ref, g_ref = loss_and_grads(rule, {n: v if v is None else v.astype(jnp.float32)
                                                 for n, v in mixed.items()}, backend="chunk")
    o, ht, grads = loss_and_grads(rule, mixed, backend="pallas", chunk_size=64)
    errors = {"o": _rel_rms(o, o_ref), "ht": _rel_rms(ht, ht_ref), **{n: _rel_rms(grads[n], g_ref[n]) for n in g_ref}}
    assert all(errors[n] <= BF16_RMS[n] for n in errors), errors
    assert grads["dbeta"].dtype == jnp.float32
    o_rounded = loss_and_grads(rule, dict(mixed, beta=x["beta"].astype(jnp.bfloat16)), backend="pallas",
                               chunk_size=64)[0]
    assert _rel_rms(o, o_rounded) >= 2e-4, _rel_rms(o, o_rounded)


@pytest.mark.parametrize("backward", ["passes", "kernels", "kernels-mm2"])
def test_pallas_unknown_variants_raise(backward, monkeypatch):
    # A backward name that does not exist (or a removed one) is an error, never a silent fallback.
    monkeypatch.setattr(pallas_api, "BACKWARD", backward)
    x = make_inputs("kda", B=1, T=8, H=1, K=16, V=16)
    with pytest.raises(ValueError, match="backward must be one of"):
        ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], backend="pallas")
