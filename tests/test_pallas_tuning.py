"""`lineattn.ops.pallas.tuning`: the kernels' tuning constants set by name for a block, then restored."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import pytest

from conftest import make_inputs
from lineattn import ops
from lineattn.ops.pallas import chunk_bwd, gram, tuning


def test_parse_reads_the_benchmarks_form():
    assert tuning.parse("default") == {} and tuning.parse("") == {}
    assert tuning.parse("chunk_bwd.WY_WARPS=8+solve.SOLVE_IMPL=triton+gram.LIMIT=-3") == {
        "chunk_bwd.WY_WARPS": 8, "solve.SOLVE_IMPL": "triton", "gram.LIMIT": -3}
    # a bool constant set to "False" must turn it off (the string would read as true)
    assert tuning.parse("chunk.SAVE_STATES=False+common.FAST_EXP=True") == {
        "chunk.SAVE_STATES": False, "common.FAST_EXP": True}
    with pytest.raises(ValueError, match="module.NAME=value"):
        tuning.parse("chunk_bwd.WY_WARPS")


def test_override_sets_restores_and_retraces():
    x = make_inputs("kda", B=1, T=40, H=1, K=16, V=16, seed=2)
    # Jitted before the block: without clearing JAX's caches its first trace (the default Gram stage, whose exact
    # fix-up kernel is `lineattn_chunk_gram_exact`) would be reused inside the block.
    fwd = jax.jit(lambda q: ops.chunk_kda(q, x["k"], x["v"], x["g"], x["beta"], backend="pallas")[0])
    kernels = lambda: str(jax.make_jaxpr(fwd)(x["q"]))
    assert "lineattn_chunk_gram_exact" in kernels()
    defaults = (gram.GRAM_IMPL, chunk_bwd.WY_WARPS)
    with tuning.override({"gram.GRAM_IMPL": "triton", "chunk_bwd.WY_WARPS": 2}):
        assert (gram.GRAM_IMPL, chunk_bwd.WY_WARPS) == ("triton", 2)
        assert "lineattn_chunk_gram_exact" not in kernels()
    assert (gram.GRAM_IMPL, chunk_bwd.WY_WARPS) == defaults
    assert "lineattn_chunk_gram_exact" in kernels()
    with tuning.override({"gram.GRAM_IMPL": "mosaic"}), pytest.raises(ValueError, match="GRAM_IMPL must be"):
        kernels()  # (a Gram stage that is not there, e.g. the removed "mosaic", is an error, not a fallback)
    with pytest.raises(RuntimeError), tuning.override({"chunk_bwd.WY_WARPS": 2}):
        raise RuntimeError  # restored when the block raises too
    assert chunk_bwd.WY_WARPS == defaults[1]


@pytest.mark.parametrize("name, match", [("WY_WARPS", "module.NAME"), ("chunk_bwdd.WY_WARPS", "no module"),
                                         ("chunk_bwd.WY_WARP", "no tuning constant"),
                                         ("chunk_bwd.backward_fast", "no tuning constant"),
                                         ("chunk_fwd.GRAM_PREC", "it is gram.GRAM_PREC\\)"),  # (moved there)
                                         ("chunk_bwd.GRADS_SPLIT", "it is gram_bwd.GRADS_SPLIT\\)")])
def test_override_names_a_misspelt_setting_and_sets_nothing(name, match):
    default = chunk_bwd.WY_WARPS
    with pytest.raises(ValueError, match=match), tuning.override({"chunk_bwd.WY_WARPS": 2, name: 1}):
        pass
    assert chunk_bwd.WY_WARPS == default


def test_every_setting_named_in_the_gpu_tests_and_scripts_exists():
    # The GPU tests and the H200 scripts name settings as "module.NAME" strings that only the GPU runs read: each must
    # resolve here, on the CPU, or a rename (as of the Gram and solve constants out of chunk_fwd) fails only there.
    root = Path(__file__).resolve().parents[1]
    sources = [root / "tests" / "test_pallas_gpu.py", *sorted((root / "benchmarks").glob("*.py")),
               *sorted((root / "benchmarks").glob("h200_*.sh"))]
    modules = "|".join(tuning._modules())
    named = {m for path in sources for m in re.findall(rf"\b(?:{modules})\.[A-Z][A-Z0-9_]+\b", path.read_text())}
    assert len(named) > 10  # (the pattern finds them)
    for name in sorted(named):
        tuning._target(name)  # a ValueError names the one that does not exist
