"""The Pallas kernels lower to Triton IR for an sm_90 GPU, checked on a machine without one.

The Triton backend asks the local GPU for its compute capability; here that query is replaced by an H200's
(a private JAX hook, `jax._src.pallas.triton`: the test skips if it moves). This catches an operation or a block
shape the Triton lowering refuses (non-power-of-two loads, value slicing, reverse cumsum, ...) without GPU time;
the Triton-to-PTX compile itself is only exercised on the GPU.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from conftest import load_script, pallas_value_and_grad
from lineattn.ops.pallas.chunk import chunk_pallas
from lineattn.ops.pallas.decode import decode_step

S = jax.ShapeDtypeStruct


def _lowered(T, dtype, backward, head_gate=False):
    """The lowered text of value_and_grad through `chunk_pallas` (B = 1, H = 2, K = V = 128), for the GPU;
    head_gate: g [B, T, H] (the scalar-gate kernels)."""
    B, H, K, V = 1, 2, 128, 128
    g = S((B, T, H) if head_gate else (B, T, H, K), jnp.float32)
    args = (S((B, T, H, K), dtype), S((B, T, H, K), dtype), S((B, T, H, V), dtype), g,
            S((B, T, H), dtype), S((B, H, K, V), jnp.float32))
    return jax.jit(pallas_value_and_grad(backward)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("backward", ["xla", "kernels-mml2", "kernels-saved"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
def test_chunk_kernels_lower_for_sm90(fake_h200, dtype, backward):
    text = _lowered(100, dtype, backward)
    # forward: gram (forming the gate's cumsum itself, `gram.GRAM_FORMS_G`), its exact fix-up, solve, state pass
    # (no Hopper here: the Triton solve), and the
    # inversion of A's diagonal blocks (`solve.DIAG_INVERSE`; in the forward that saves for the backward,
    # "kernels-saved", by `DIAG_INVERSE_SAVE`: so in every count of this file with "kernels-saved"); backward "xla":
    # none; "kernels-mml2": cumsum, gram, solve, states, reverse, chunk grads, WY, Gram gradients with the combine,
    # their exact rewrite, dg; "kernels-saved": the same without the cumsum, Gram, solve and states (the forward's G,
    # terms and states are kept)
    expected = 5 + {"xla": 0, "kernels-mml2": 10, "kernels-saved": 6}[backward]
    assert text.count("__gpu$xla.gpu.triton") == expected


@pytest.mark.parametrize("backward", ["kernels-saved", "kernels-mml2"])
def test_scalar_gate_kernels_lower_for_sm90(fake_h200, backward):
    # A head gate (GDN): the one-program-per-chunk Gram kernel and Gram-gradient kernel in place of the 16-row ones;
    # the latter also gives dg (no dg kernel). Both forwards invert A's diagonal blocks before the solve
    # (`solve.DIAG_INVERSE`; the saving one, "kernels-saved", by `DIAG_INVERSE_SAVE`).
    text = _lowered(100, jnp.bfloat16, backward, head_gate=True)
    assert "lineattn_chunk_gram_scalar" in text and "lineattn_gram_bwd_scalar" in text
    assert "lineattn_chunk_gram\"" not in text and "lineattn_gram_bwd_combine" not in text
    assert "lineattn_chunk_bwd_dg" not in text
    assert "lineattn_invert_diagonal_blocks" in text
    assert text.count("__gpu$xla.gpu.triton") == 5 + {"kernels-saved": 5, "kernels-mml2": 8}[backward]


def test_segmented_state_passes_lower_for_sm90(fake_h200, monkeypatch):
    # `segments.SEGMENT_PASSES`: T = 1024 is 16 chunks of 64, 2 segments of 8 (B * H = 2); the forward adds the
    # zero-start pass forming the segments' offsets and maps (`chunk_fwd.PASS_SEGMENTS`), the backward the
    # zero-start reverse pass (a 4-D grid, per-segment [K, V] state blocks; the zero-start states pass only without
    # `chunk.SAVE_STATES`: `test_backward_states_pass_lowers_for_sm90`).
    # (The zero-start pass as the Triton kernel: `chunk_fwd.ZERO_START_IMPL` "auto" picks it on this host, the Mosaic
    # one on a Hopper GPU: the next test.)
    from lineattn.ops.pallas import chunk_fwd, segments
    monkeypatch.setattr(segments, "SEGMENT_PASSES", True)
    monkeypatch.setattr(chunk_fwd, "ZERO_START_IMPL", "triton")
    assert segments.pick_segments(2, 16, 128) == 2
    text = _lowered(1024, jnp.bfloat16, "kernels-saved")
    assert "lineattn_chunk_state_pass_local" in text and "lineattn_chunk_bwd_reverse_local" in text
    assert "lineattn_chunk_bwd_states_local" not in text
    assert text.count("__gpu$xla.gpu.triton") == 5 + 1 + 6 + 1


def test_mosaic_zero_start_pass_lowers_for_sm90(fake_h200, monkeypatch):
    # `chunk_fwd.ZERO_START_IMPL = "mosaic"` (what "auto" picks on a Hopper GPU): the forward's zero-start pass in 2
    # segments (T = 1024, as above) as the Mosaic GPU kernel, lowered for the GPU (column tiles of 16 here).
    from lineattn.ops.pallas import chunk_fwd
    monkeypatch.setattr(chunk_fwd, "ZERO_START_IMPL", "mosaic")
    text = _lowered(1024, jnp.bfloat16, "kernels-saved")
    assert "lineattn_zero_start_pass_mosaic" in text and "lineattn_chunk_state_pass_local" not in text
    assert text.count("__gpu$xla.gpu.triton") == 5 + 6 + 1


@pytest.mark.parametrize("head_gate", [False, True])
def test_forward_alone_forms_in_segments_lower_for_sm90(fake_h200, monkeypatch, head_gate):
    # `chunk_fwd.FORMS_IN_SEGMENTS` on a Hopper GPU (faked): a forward alone on few long sequences (B = 1, T = 4096,
    # H = 16: 8 segments of 8 chunks, V tiles of 64) runs the zero-start and state passes in the forms that need no W,
    # U (KDA: the inverse form; GDN: that and the raw q, k), lowered for the GPU; off, the solve forms W and U.
    # "scalar" (the default) takes them for GDN's gate alone.
    from lineattn.ops.pallas import chunk_fwd, common, segments
    monkeypatch.setattr(common, "hopper", lambda: True)
    B, T, H, K, V = 1, 4096, 16, 128, 128
    assert segments.pick_segments(B * H, T // 64, V) == 8
    args = (S((B, T, H, K), jnp.bfloat16), S((B, T, H, K), jnp.bfloat16), S((B, T, H, V), jnp.bfloat16),
            S((B, T, H) if head_gate else (B, T, H, K), jnp.float32), S((B, T, H), jnp.bfloat16),
            S((B, H, K, V), jnp.float32))
    for setting, forms in ((False, False), (True, True), ("scalar", head_gate)):
        monkeypatch.setattr(chunk_fwd, "FORMS_IN_SEGMENTS", setting)
        forward = jax.jit(lambda *a: chunk_pallas(*a, K**-0.5, 64, False, "kernels-saved"))  # (traced anew)
        text = forward.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        assert "lineattn_zero_start_pass_mosaic" in text and "lineattn_state_pass_mosaic" in text
        assert ("lineattn_inverse_mosaic" in text) == forms and ("lineattn_solve_mosaic" in text) == (not forms)
    monkeypatch.setattr(chunk_fwd, "FORMS_IN_SEGMENTS", "channel")
    one_chunk = tuple(S((a.shape[0], 64) + a.shape[2:], a.dtype) if a.ndim < 4 or a.shape[1] == T else a
                      for a in args)  # (unsegmented: the value is checked there too)
    for shapes in (args, one_chunk):
        with pytest.raises(ValueError, match="FORMS_IN_SEGMENTS must be True, False or 'scalar'"):
            jax.jit(lambda *a: chunk_pallas(*a, K**-0.5, 64, False, "kernels-saved")).trace(*shapes)


@pytest.mark.parametrize("v_fastest,variant", [(False, {}), (True, {}), (True, dict(readout="updated")),
                                               (True, dict(state_layout="vk")), (True, dict(readout="stored")),
                                               (True, dict(state_layout="vk", readout="stored")),
                                               (True, dict(state_layout="vk", v_tiles="strided"))])
def test_decode_kernel_lowers_for_sm90(fake_h200, v_fastest, variant):
    B, T, H, K, V = 4, 2, 2, 128, 128
    args = (S((B, T, H, K), jnp.bfloat16), S((B, T, H, K), jnp.bfloat16), S((B, T, H, V), jnp.bfloat16),
            S((B, T, H, K), jnp.float32), S((B, T, H), jnp.bfloat16), S((B, H, K, V), jnp.float32))  # (K = V)
    step = lambda *a: decode_step(*a, output_states=True, interpret=False, v_fastest=v_fastest,
                                   **variant)
    assert "__gpu$xla.gpu.triton" in jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("lhs_regs", [False, True])
def test_mosaic_solve_lowers_for_sm90(fake_h200, monkeypatch, lhs_regs):
    # `solve.SOLVE_IMPL = "auto"` on a Hopper GPU (faked here): the solve as a Mosaic GPU kernel (wgmma)
    # beside the Triton kernels, its left operands from SMEM or (`solve_mgpu.LHS_REGS`, the default, a path the
    # CPU interpreter cannot run) from registers; fp32 inputs keep the Triton solve.
    from lineattn.ops.pallas import common, solve_mgpu
    monkeypatch.setattr(common, "hopper", lambda: True)
    monkeypatch.setattr(solve_mgpu, "LHS_REGS", lhs_regs)
    text = _lowered(100, jnp.bfloat16, "kernels-saved")
    assert "lineattn_solve_mosaic" in text and "lineattn_chunk_solve_full" not in text
    assert text.count("__gpu$xla.gpu.triton") == 4 + 6
    assert "lineattn_solve_mosaic" not in _lowered(100, jnp.float32, "kernels-saved")


def test_gram_with_exact_path_inside_lowers_for_sm90(fake_h200, monkeypatch):
    # `gram.GRAM_IMPL = "triton"`: the Gram kernel with its exact path inside, no fix-up kernel.
    from lineattn.ops.pallas import gram
    monkeypatch.setattr(gram, "GRAM_IMPL", "triton")
    for dtype in (jnp.bfloat16, jnp.float32):
        text = _lowered(100, dtype, "kernels-saved")
        assert "lineattn_chunk_gram_exact" not in text  # and no split backward: GRADS_SPLIT needs its spreads
        assert "lineattn_gram_bwd_exact" not in text and text.count("__gpu$xla.gpu.triton") == 5 + 5


@pytest.mark.parametrize("T", [100, 1024])
def test_backward_states_pass_lowers_for_sm90(fake_h200, monkeypatch, T):
    # `chunk.SAVE_STATES = False`: the backward runs its own states pass (T = 1024: segmented, the forward with
    # its zero-start pass for the maps, the backward with the zero-start states pass as well); the default keeps
    # the forward's per-chunk states instead.
    from lineattn.ops.pallas import chunk
    assert "lineattn_chunk_bwd_states" not in _lowered(T, jnp.bfloat16, "kernels-saved")
    monkeypatch.setattr(chunk, "SAVE_STATES", False)
    text = _lowered(T, jnp.bfloat16, "kernels-saved")
    assert "lineattn_chunk_bwd_states" in text
    assert text.count("__gpu$xla.gpu.triton") == 5 + 7 + 3 * (T == 1024)


def test_gram_gradients_unsplit_lower_for_sm90(fake_h200, monkeypatch):
    # `gram_bwd.GRADS_SPLIT = False`: both paths in one Gram-gradient kernel, no exact rewrite kernel.
    from lineattn.ops.pallas import gram_bwd
    monkeypatch.setattr(gram_bwd, "GRADS_SPLIT", False)
    for dtype in (jnp.bfloat16, jnp.float32):
        text = _lowered(100, dtype, "kernels-saved")
        assert "lineattn_gram_bwd_exact" not in text
        assert text.count("__gpu$xla.gpu.triton") == 5 + 5


def _gram_outputs_of_forward(args, name):
    """The lowered text of `chunk_fwd.forward` alone on args (for the GPU), and how many outputs the Triton kernel
    `name` has in it (its only call)."""
    from lineattn.ops.pallas import chunk_fwd
    text = jax.jit(lambda *a: chunk_fwd.forward(*a, scale=0.1, interpret=False)).trace(*args).lower(
        lowering_platforms=("cuda",)).as_text()
    calls = [line for line in text.splitlines() if "custom_call @__gpu$xla.gpu.triton" in line and f'{name}"' in line]
    assert len(calls) == 1, calls
    return text, int(calls[0].split("=")[0].split(":")[1])


@pytest.mark.parametrize("warpgroups", [1, 2])
def test_forward_alone_forms_lower_for_sm90(fake_h200, monkeypatch, warpgroups):
    # A forward alone on a Hopper GPU (faked) with V tiles of 64. GDN: the Mosaic state pass applies the gate's row
    # factors to the raw q and k (`chunk_fwd.ROW_GATE`), so the scalar Gram kernel has two outputs (M, A), not four;
    # with INVERSE_IN_PASS (the default) the solve is `solve_mgpu.inverse_mosaic` (R alone; its left operands from
    # registers, which the CPU interpreter cannot run) and the pass applies it. KDA: the Gram kernel forms G itself
    # (`gram.gram_chunks`, no gate-cumsum kernel); with INVERSE_IN_PASS it writes Kin, e^(G_C), the chunks' flags
    # and (flagged chunks only) G beside M, A, Qin, Kg (eight outputs) and the solve is the inverse alone; without,
    # no Kin and G in every chunk, for the solve (seven). The state
    # pass as CTAs of one or two compute warpgroups (`state_mgpu.PASS_WARPGROUPS`; two set the registers of the memory
    # warpgroup's threads apart by setmaxnreg) fits the shared memory in every form (KDA's inverse form: 464 bytes to
    # spare).
    from lineattn.ops.pallas import chunk_fwd, common, state_mgpu
    monkeypatch.setattr(common, "hopper", lambda: True)
    monkeypatch.setattr(state_mgpu, "PASS_MIN_CTAS", 1)  # (B H = 2 here)
    monkeypatch.setattr(state_mgpu, "PASS_WARPGROUPS", warpgroups)
    monkeypatch.setattr(chunk_fwd, "PASS_MIN_PROGRAMS", 1)
    B, T, H, K, V = 1, 100, 2, 128, 128
    args = (S((B, T, H, K), jnp.bfloat16), S((B, T, H, K), jnp.bfloat16), S((B, T, H, V), jnp.bfloat16),
            S((B, T, H), jnp.float32), S((B, T, H), jnp.bfloat16), S((B, H, K, V), jnp.float32))
    channel_gate = args[:3] + (S((B, T, H, K), jnp.float32),) + args[4:]
    cases = [(args, "lineattn_chunk_gram_scalar", True, True, 2), (args, "lineattn_chunk_gram_scalar", True, False, 2),
             (args, "lineattn_chunk_gram_scalar", False, True, 4),
             (channel_gate, "lineattn_chunk_gram_g", True, True, 8),
             (channel_gate, "lineattn_chunk_gram_g", True, False, 7)]
    for x, kernel, row_gate, inverse, outputs in cases:
        monkeypatch.setattr(chunk_fwd, "ROW_GATE", row_gate)
        monkeypatch.setattr(chunk_fwd, "INVERSE_IN_PASS", inverse)
        text, n = _gram_outputs_of_forward(x, kernel)
        applied = inverse and (row_gate or not kernel.endswith("scalar"))  # (a scalar gate's needs ROW_GATE)
        assert n == outputs and "lineattn_state_pass_mosaic" in text
        assert ("lineattn_chunk_cumsum" in text) == (kernel != "lineattn_chunk_gram_g")
        assert ("lineattn_inverse_mosaic" in text) == applied and ("lineattn_solve_mosaic" in text) != applied
        assert ("setmaxnreg" in text) == (warpgroups == 2)


def test_gram_halves_lower_for_sm90(fake_h200, monkeypatch):
    # `gram.GRAM_FACTORS = "halves"`: the forward alone's Gram kernel on 32-row halves (six [32, 32] products a K
    # tile, M and A stored by quarters) lowers, with its eight outputs, before the inverse and the Mosaic pass.
    from lineattn.ops.pallas import chunk_fwd, common, gram, state_mgpu
    monkeypatch.setattr(common, "hopper", lambda: True)
    monkeypatch.setattr(state_mgpu, "PASS_MIN_CTAS", 1)  # (B H = 2 here)
    monkeypatch.setattr(chunk_fwd, "PASS_MIN_PROGRAMS", 1)
    monkeypatch.setattr(gram, "GRAM_FACTORS", "halves")
    B, T, H, K = 1, 100, 2, 128
    args = (S((B, T, H, K), jnp.bfloat16),) * 3 + (S((B, T, H, K), jnp.float32), S((B, T, H), jnp.bfloat16),
                                                   S((B, H, K, K), jnp.float32))
    text, n = _gram_outputs_of_forward(args, "lineattn_chunk_gram_g")
    assert n == 8 and "lineattn_inverse_mosaic" in text

def test_jaxpr_dump_tells_kernel_settings_apart(monkeypatch):
    # scripts/pallas_jaxprs.py compares two trees' kernels without a GPU (a refactor that changes none writes the same
    # file): its text must be the same for the same settings and differ when a kernel's launch setting (a Triton
    # pipeline depth) or a Mosaic GPU kernel's form (its compute warpgroups) differs, on the faked Hopper GPU's paths.
    from lineattn.ops.pallas import common, tuning
    script = load_script("pallas_jaxprs")
    monkeypatch.setattr(common, "hopper", lambda: True)
    case = dict(B=2, T=100, H=64, dtype=jnp.bfloat16, head_gate=False, backward="kernels-saved", grad=False)
    base = script.case_jaxpr(**case)
    assert "lineattn_state_pass_mosaic" in base and "/lineattn/" not in base  # (Mosaic paths; no source paths)
    assert script.case_jaxpr(**case) == base
    for setting in ({"gram.GRAM_CHUNK_STAGES": 2}, {"state_mgpu.PASS_WARPGROUPS": 1}):
        with tuning.override(setting):
            assert script.case_jaxpr(**case) != base, setting


def test_triton_sass_pairs_each_kernel_with_its_settings_and_ir():
    # scripts/triton_sass.py's first step (no Triton needed): each Triton kernel of a program lowered as for an
    # H200, in program order, with the warps and stages its pallas_call set and its own Triton IR (the second step
    # compiles that IR with upstream Triton, out of CI: it is no dependency). The hooks it sets are restored.
    from lineattn.ops.pallas import common, gram, solve
    script = load_script("triton_sass")
    hopper = common.hopper
    [(name, warps, stages, ir)] = script._lower("decode:32x2fts")
    assert (name, warps, stages) == ("lineattn_decode_step", 2, 1)
    assert "module @lineattn_decode_step" in ir and "tensor<32x128xf32" in ir  # (the [BV, K] tile of the vk layout)
    kernels = script._lower("kda-fwd")
    assert [k[:3] for k in kernels] == [("lineattn_chunk_gram_g", gram.GRAM_CHUNK_WARPS, gram.GRAM_CHUNK_STAGES),
                                        ("lineattn_chunk_gram_exact", gram.GRAM_WARPS, 1),
                                        ("lineattn_invert_diagonal_blocks", solve.DIAG_INVERSE_WARPS, 1)]
    assert all(f"module @{name} " in ir for name, _, _, ir in kernels)
    assert common.hopper is hopper
    with pytest.raises(ValueError, match="decode config"):
        script._lower("decode:64")
    with pytest.raises(ValueError, match="not the copy"):
        script._lower("decode:64x4c")
