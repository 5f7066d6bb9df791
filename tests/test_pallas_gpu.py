"""GPU only (skipped without one): the Pallas kernels compiled at the benchmark's head dims, bf16, long sequence.

T = 16384 (a ragged tail: T - 3), K = V = 128, H = 2, bf16 q, k, v, beta; reference: the XLA chunk form in fp32 on
the same rounded inputs (itself tested against the oracle to 1e-4). Relative RMS tolerances as FLA's tests.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import grad_jaxpr, loss_and_grads, make_inputs
from lineattn import ops
from lineattn.ops.pallas import common, tuning
from lineattn.ops.pallas.common import on_gpu
from lineattn.ops.pallas.decode import decode_step

pytestmark = pytest.mark.skipif(not on_gpu(), reason="needs a GPU")

RMS = {"o": 5e-3, "ht": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dinitial_state": 8e-3, "dg": 2e-2, "dbeta": 2e-2}


def _rel_rms(actual, expected):
    a, e = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    return float(np.sqrt(np.mean((a - e) ** 2)) / max(np.sqrt(np.mean(e**2)), 1e-30))


def _run(rule, x, backend, variant=None):
    """o, ht and the gradients (`conftest.loss_and_grads`) as one dict; variant None: the defaults; else
    (`pallas.api.BACKWARD`, {tuning constants}), e.g. ("kernels-saved", {"api.SCALAR_GATE": True})."""
    with tuning.override({} if variant is None else {"api.BACKWARD": variant[0], **variant[1]}):
        o, ht, grads = loss_and_grads(rule, x, backend=backend)
    return {"o": o, "ht": ht, **grads}


def _bf16_and_rounded(inputs):
    """bf16 q, k, v, beta (the rest as given), and the same values back in fp32 (the reference's inputs)."""
    bf16 = {n: x.astype(jnp.bfloat16) if n in ("q", "k", "v", "beta") and x is not None else x
            for n, x in inputs.items()}
    return bf16, {n: None if x is None else x.astype(jnp.float32) for n, x in bf16.items()}


# The defaults (None: kernels-saved) and the other variants. DeltaNet and GLA with the defaults: what `auto`
# needs before it takes the kernels for them (`pallas.api.AUTO_RULES`).
BROADCAST = {"api.SCALAR_GATE": False}  # a head gate through the per-channel kernels
VARIANTS = [("kda", None), ("gdn", None), ("deltanet", None), ("gla", None), ("kda", ("xla", {})),
            ("kda", ("kernels-mml2", {})), ("gdn", ("kernels-mml2", {})), ("gdn", ("kernels-saved", BROADCAST)),
            ("kda", ("kernels-saved", {"chunk_bwd.COT_DTYPE": "float32"})),
            ("kda", ("kernels-saved", {"solve.SOLVE_IMPL": "triton"})),  # the default off Hopper
            ("kda", ("kernels-saved", {"solve_mgpu.LHS_REGS": False})),
            ("kda", ("kernels-saved", {"gram.GRAM_IMPL": "triton"})),
            ("kda", ("kernels-saved", {"chunk.SAVE_STATES": False})),
            ("gdn", ("kernels-saved", {"chunk.SAVE_STATES": False})),
            ("kda", ("kernels-saved", {"gram_bwd.GRADS_SPLIT": False})),
            ("kda", ("kernels-saved", {"chunk_bwd.WY_COT_DTYPE": "float32"})),
            ("kda", ("kernels-saved", {"chunk_fwd.ZERO_START_IMPL": "triton"})),  # the default off Hopper
            ("kda", ("kernels-saved", {"segments.SEGMENT_PASSES": False})),  # the defaults: 32 segments of 8 chunks
            ("gdn", ("kernels-saved", {"segments.SEGMENT_PASSES": False}))]


def _variant_id(rule, variant):
    if variant is None:
        return f"{rule}-default"
    return "-".join([rule, variant[0], *(f"{n.split('.')[1]}={v}" for n, v in variant[1].items())])


@pytest.mark.parametrize("rule,variant", VARIANTS, ids=[_variant_id(r, v) for r, v in VARIANTS])
def test_pallas_long_bf16_head_dim_128(rule, variant):
    bf16, rounded = _bf16_and_rounded(make_inputs(rule, B=1, T=16384 - 3, H=2, K=128, V=128, seed=11))
    got, want = _run(rule, bf16, "pallas", variant), _run(rule, rounded, "chunk")
    errors = {n: _rel_rms(got[n], want[n]) for n in want}
    print(rule, variant, {n: f"{e:.1e}" for n, e in errors.items()})
    assert all(np.all(np.isfinite(np.asarray(got[n], np.float32))) for n in got)
    assert set(got) == set(want) and len(got) >= 6
    assert all(errors[n] <= RMS[n] for n in errors), errors


@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_pallas_fp32_beta_head_dim_128(rule):
    # bf16 q, k, v with beta in fp32, which the kernels take as given (`test_pallas_takes_fp32_beta_as_given`):
    # B = 2, T = 4096 - 3, K = V = 128 against the XLA chunk form in fp32 on the same inputs, the forward that saves
    # for the backward and the forward alone (its own forms); dbeta in fp32.
    x = make_inputs(rule, B=2, T=4096 - 3, H=2, K=128, V=128, seed=12)
    mixed = {n: v.astype(jnp.bfloat16) if n in ("q", "k", "v") else v for n, v in x.items()}
    got = _run(rule, mixed, "pallas")
    want = _run(rule, {n: v if v is None else v.astype(jnp.float32) for n, v in mixed.items()}, "chunk")
    alone = jax.jit(lambda *a: ops.linear_attention(rule, *a, backend="pallas", initial_state=x["initial_state"])[0])
    got["o alone"], want["o alone"] = alone(*(mixed[n] for n in ("q", "k", "v", "g", "beta"))), want["o"]
    errors = {n: _rel_rms(got[n], want[n]) for n in want}
    print(rule, "fp32 beta", {n: f"{e:.1e}" for n, e in errors.items()})
    assert got["dbeta"].dtype == jnp.float32 and set(got) == set(want) and len(got) >= 6
    assert all(errors[n] <= RMS[n.split()[0]] for n in errors), errors


@pytest.mark.parametrize("rule,B,T", [("kda", 4, 1024 - 3), ("gdn", 4, 1024 - 3), ("kda", 1, 4096 - 3)])
def test_pallas_mosaic_state_passes_head_dim_128(rule, B, T):
    # Enough (batch, head) pairs for V tiles of 64 (B * H = 128: 256 programs; B = 1, T = 4093: 4 segments of 16
    # chunks, `segments`): with the default PASS_IMPL "auto" the forward's state pass and the backward's reverse
    # pass run as the Mosaic GPU kernels (`state_mgpu`), in segments the forward's zero-start pass too
    # (ZERO_START_IMPL "auto"); ragged T, K = V = 128, bf16, against the XLA chunk form in fp32 with FLA's bounds.
    bf16, rounded = _bf16_and_rounded(make_inputs(rule, B=B, T=T, H=32, K=128, V=128, seed=13))
    jaxpr = grad_jaxpr(rule, bf16, backend="pallas")
    assert "lineattn_state_pass_mosaic" in jaxpr and "lineattn_reverse_pass_mosaic" in jaxpr
    assert ("lineattn_zero_start_pass_mosaic" in jaxpr) == (B == 1)
    assert "lineattn_chunk_state_pass_local" not in jaxpr
    got, want = _run(rule, bf16, "pallas"), _run(rule, rounded, "chunk")
    errors = {n: _rel_rms(got[n], want[n]) for n in want}
    print(rule, "mosaic passes", {n: f"{e:.1e}" for n, e in errors.items()})
    assert all(errors[n] <= RMS[n] for n in errors), errors


@pytest.mark.parametrize("rule", ["kda", "gdn"])
def test_gates_below_the_floor_head_dim_128(rule):
    # Log gates below ops.LOG_GATE_FLOOR (-inf, -1e30 and -1000 at a few tokens, two of them a chunk's first row)
    # through the defaults' forward+backward: the compiled kernels raise g to the floor as they load it, and the dg
    # kernel reads an int8 mask of g < floor (formed in XLA, `chunk.below_floor`). B = 2, T = 4093, H = 2, K = V =
    # 128, bf16: every output within FLA's bounds of the XLA chunk form in fp32 (which raises g in XLA), dg exactly 0
    # below the floor, and the floor in XLA (GATE_FLOOR "xla", no mask) within 1e-4 (the kernels compile apart:
    # rounding flips; H100 run44b and H200 run45d: 0, and 4.7e-6 on KDA's dg).
    x = make_inputs(rule, B=2, T=4096 - 3, H=2, K=128, V=128, seed=17)
    g = np.array(x["g"])
    g[:, [3, 640, 1000, 2047]] = -np.inf
    g[:, [64, 3001]] = -1e30
    g[:, [1500, 4092]] = -1000.0
    bf16, rounded = _bf16_and_rounded(dict(x, g=jnp.asarray(g)))
    got, want = _run(rule, bf16, "pallas"), _run(rule, rounded, "chunk")
    errors = {n: _rel_rms(got[n], want[n]) for n in want}
    print(rule, "gates below the floor", {n: f"{e:.1e}" for n, e in errors.items()})
    assert all(np.all(np.isfinite(np.asarray(got[n], np.float32))) for n in got)
    assert all(errors[n] <= RMS[n] for n in errors), errors
    assert np.all(np.asarray(got["dg"])[g < ops.LOG_GATE_FLOOR] == 0.0)
    other = _run(rule, bf16, "pallas", ("kernels-saved", {"chunk.GATE_FLOOR": "xla"}))
    errors = {n: _rel_rms(other[n], got[n]) for n in got}
    print(rule, "GATE_FLOOR xla", {n: f"{e:.1e}" for n, e in errors.items()})
    assert all(e <= 1e-4 for e in errors.values()), errors


def _forward_alone(rule, rounded):
    """The jitted Pallas forward alone, x -> (o, final state), and its reference: the XLA chunk form in fp32 on the
    rounded inputs."""
    forward = lambda x, backend: ops.linear_attention(rule, x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                      initial_state=x["initial_state"], output_final_state=True,
                                                      backend=backend)
    return jax.jit(lambda x: forward(x, "pallas")), forward(rounded, "chunk")


@pytest.mark.parametrize("rule", ["gdn", "kda"])
def test_forward_alone_mosaic_pass_forms_head_dim_128(rule):
    # A forward alone (no gradient) with V tiles of 64 on the Mosaic state pass, with the defaults: the pass applies
    # R = (I + A)^-1 to the raw v (`chunk_fwd.INVERSE_IN_PASS`; the solve writes R alone) and, for GDN, the gate's
    # row factors to the raw q and k (ROW_GATE). B = 4, T = 1021 (ragged), H = 32, K = V = 128, bf16: o and the
    # final state within FLA's bounds of the XLA chunk form in fp32 for each setting, and within 1.5e-3 of the pass
    # over Qin, Kg, W and U (both off). Each setting's pass runs as 128 CTAs of two compute warpgroups
    # (`state_mgpu.PASS_WARPGROUPS`); the defaults also as 256 CTAs of one, which must give the same o and state to
    # 1e-6 (the same products in the same order; a race between the warpgroups would show here).
    bf16, rounded = _bf16_and_rounded(make_inputs(rule, B=4, T=1024 - 3, H=32, K=128, V=128, seed=14))
    fwd, want = _forward_alone(rule, rounded)
    text = str(jax.make_jaxpr(fwd)(bf16))
    assert "lineattn_state_pass_mosaic" in text and "lineattn_inverse_mosaic" in text
    got = {}
    settings = [(True, True), (True, False), (False, False)] if rule == "gdn" else [(True, True), (True, False)]
    with tuning.override({"state_mgpu.PASS_WARPGROUPS": 1}):
        one_warpgroup = fwd(bf16)
    for row_gate, inverse in settings:
        with tuning.override({"chunk_fwd.ROW_GATE": row_gate, "chunk_fwd.INVERSE_IN_PASS": inverse}):
            got[row_gate, inverse] = fwd(bf16)
        errors = {n: _rel_rms(got[row_gate, inverse][i], want[i]) for i, n in enumerate(("o", "ht"))}
        print(rule, "forward alone, ROW_GATE, INVERSE_IN_PASS", (row_gate, inverse),
              {n: f"{e:.1e}" for n, e in errors.items()})
        assert all(e <= RMS[n] for n, e in errors.items()), errors
    assert all(_rel_rms(got[key][i], got[settings[-1]][i]) <= 1.5e-3 for key in got for i in range(2))
    assert all(_rel_rms(got[True, True][i], one_warpgroup[i]) <= 1e-6 for i in range(2))


@pytest.mark.parametrize("factors", ["default", "halves"])
@pytest.mark.parametrize("gates", ["lower_bound", "cuts", "uniform"])
def test_forward_alone_extreme_gates_head_dim_128(gates, factors):
    # KDA's forward alone with the defaults (its Gram kernel forming the gate's cumsum G itself,
    # `gram.GRAM_FORMS_G`; the inverse applied in the Mosaic pass) under extreme gates: every log gate at the
    # lower bound -5 (a 16-row block then spans 75 nats, inside the fast path's limit), or uniform in (-5, 0) with a
    # -1000 cut every 300 tokens (their chunks are flagged for the exact rewrite, which reads the G the Gram kernel
    # writes for them) and runs of gates at 0; and gates uniform in (-5, 0). With `gram.GRAM_FACTORS = "halves"`
    # too (32-row halves: at the lower bound a half's rows lie up to 80 nats from its middle row, inside HALF_LIMIT).
    # B = 4, T = 1021 (ragged), H = 32, K = V = 128, bf16: o and the final state within FLA's bounds of the XLA
    # chunk form in fp32.
    x = make_inputs("kda", B=4, T=1024 - 3, H=32, K=128, V=128, seed=16)
    g = np.array(x["g"])
    if gates == "lower_bound":
        g[:] = -5.0
    elif gates == "cuts":
        g[:, 150::300] = -1000.0
        g[:, 400:480] = 0.0
    bf16, rounded = _bf16_and_rounded(dict(x, g=jnp.asarray(g)))
    fwd, want = _forward_alone("kda", rounded)
    with tuning.override({} if factors == "default" else {"gram.GRAM_FACTORS": factors}):
        assert "lineattn_chunk_gram_g" in str(jax.make_jaxpr(fwd)(bf16))
        got = fwd(bf16)
    errors = {n: _rel_rms(got[i], want[i]) for i, n in enumerate(("o", "ht"))}
    print("kda forward alone, gates", gates, factors, {n: f"{e:.1e}" for n, e in errors.items()})
    assert all(e <= RMS[n] for n, e in errors.items()), errors


@pytest.mark.parametrize("rule,forms", [("gdn", False), ("kda", False), ("gdn", True), ("kda", True)])
def test_forward_alone_in_segments_head_dim_128(rule, forms):
    # `chunk_fwd.PASS_SEGMENTS = "always"` (the default since run35a; GDN at 1 x 32768 1.233 ms a call against 1.539):
    # a forward alone on few (batch, head) pairs (B = 1, H = 16; the Mosaic forms of a forward alone need 64) runs its
    # state pass in 8 segments of 8 chunks (the Mosaic zero-start pass, then the state pass from each segment's true
    # start) instead of one unsegmented pass ("save" segments only a forward that saves for the backward). T = 4093
    # (ragged), K = V = 128, bf16, a non-zero h0: o and the final state within FLA's bounds of the XLA chunk form in
    # fp32 and within 1.5e-3 of the unsegmented forward. forms: with `chunk_fwd.FORMS_IN_SEGMENTS` True (the default
    # "scalar" takes them for GDN alone), the segments' zero-start pass and state pass in the forms of the
    # unsegmented forward alone (no W, U written).
    bf16, rounded = _bf16_and_rounded(make_inputs(rule, B=1, T=4096 - 3, H=16, K=128, V=128, seed=15))
    fwd, want = _forward_alone(rule, rounded)
    with tuning.override({"chunk_fwd.PASS_SEGMENTS": "save"}):
        assert "lineattn_zero_start_pass_mosaic" not in str(jax.make_jaxpr(fwd)(bf16))
        unsegmented = fwd(bf16)
    with tuning.override({"chunk_fwd.FORMS_IN_SEGMENTS": forms}):
        text = str(jax.make_jaxpr(fwd)(bf16))
        assert "lineattn_zero_start_pass_mosaic" in text and ("lineattn_inverse_mosaic" in text) == forms
        got = fwd(bf16)
    errors = {n: _rel_rms(got[i], want[i]) for i, n in enumerate(("o", "ht"))}
    print(rule, "forward alone in segments", "(forms)" * forms, {n: f"{e:.1e}" for n, e in errors.items()})
    assert all(e <= RMS[n] for n, e in errors.items()), errors
    assert all(_rel_rms(got[i], unsegmented[i]) <= 1.5e-3 for i in range(2))


@pytest.mark.parametrize("B,v_fastest,variant", [(8, False, {}), (64, False, {}), (64, True, {}),
                                                 (64, True, dict(readout="updated")),
                                                 (8, True, dict(state_layout="vk")),
                                                 (64, True, dict(state_layout="vk")),
                                                 (64, True, dict(readout="stored")),
                                                 (64, True, dict(state_layout="vk", readout="stored", num_warps=4)),
                                                 (64, True, dict(state_layout="vk", readout="decayed", num_warps=4)),
                                                 (64, True, dict(state_layout="vk", v_tiles="strided"))])
def test_decode_step_head_dim_128(B, v_fastest, variant):
    # B = 8: 64 programs, V tile 32; B = 64: V tile 64 (the large-batch default), also with the V tiles first, with
    # o read from the updated state (before or after the state's stores), and with the state stored transposed
    # ([B, H, V, K]; by default on 8 warps with o read after the stores, also on 4 warps with either readout, and
    # with each program's V rows strided).
    x = make_inputs("kda", B=B, T=4, H=4, K=128, V=128, seed=12)
    o_ref, ht_ref = ops.chunk_kda(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                  output_final_state=True, backend="recurrent")
    kv = (lambda s: jnp.swapaxes(s, -1, -2)) if variant.get("state_layout") == "vk" else (lambda s: s)
    o, ht, states = decode_step(x["q"], x["k"], x["v"], x["g"], x["beta"], kv(x["initial_state"]),
                                output_states=True, v_fastest=v_fastest, **variant)
    for got, want in ((o, o_ref), (kv(ht), ht_ref), (kv(states[:, -1]), ht_ref)):
        assert _rel_rms(got, want) < 1e-5


@pytest.mark.parametrize("fast,interpret", [(True, False), (False, False), (True, True)])
def test_kernel_exp_against_fp64(fast, interpret):
    # `common.exp` inside a Triton kernel: with FAST_EXP compiled for the GPU it is PTX's ex2.approx (a multiply's
    # rounding of x log2(e) included: relative error <= 1e-5 up to e^88); interpreted, or with FAST_EXP off,
    # jnp.exp. Results below fp32's normal range (x < -87.3) may flush to 0; -inf gives 0.
    x = np.concatenate([np.linspace(-87.0, 88.0, 1023), [-np.inf]]).astype(np.float32).reshape(8, 128)

    def kernel(x_ref, o_ref, o0_ref):
        o_ref[...] = common.exp(x_ref[...])
        o0_ref[...] = jnp.broadcast_to(common.exp(jnp.sum(x_ref[4, :4])), o0_ref.shape)  # (a 0-d x)

    with tuning.override({"common.FAST_EXP": fast}):
        got, got0 = common.pallas_call(kernel, interpret=interpret, out_shape=(
            jax.ShapeDtypeStruct(x.shape, jnp.float32), jax.ShapeDtypeStruct((16,), jnp.float32)))(jnp.asarray(x))
    got, want = np.asarray(got, np.float64), np.exp(x.astype(np.float64))
    assert got.ravel()[-1] == 0.0
    assert np.allclose(np.asarray(got0), np.exp(np.sum(x[4, :4], dtype=np.float64)), rtol=1e-5, atol=0)
    finite = np.isfinite(x)
    assert np.max(np.abs(got[finite] / want[finite] - 1)) <= 1e-5
