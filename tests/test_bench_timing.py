"""The benchmarks' helpers (benchmarks/bench_kda.py): interleaved rounds, medians, failures, result file names."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
import bench_kda  # noqa: E402


class FakeClock:
    """time.perf_counter for bench_kda that only the timed functions advance."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_time_interleaved_takes_turns_and_medians(monkeypatch):
    # Three functions, 6 calls each in 3 rounds: each round calls every function (a warm-up, then 2 timed calls)
    # before the next round starts; a function taking 1 s (clock time) then 3 s from the second round on has the
    # median of all its calls (3 s = 3000 ms) and its rounds' medians [1000, 3000, 3000]; one that raises in the
    # second round is reported through on_error and left out, the others still timed (without on_error: raised).
    clock = FakeClock()
    monkeypatch.setattr(bench_kda.time, "perf_counter", clock)
    calls = []

    def make(key, seconds):
        def fn(*args):
            calls.append(key)
            if key == "bad" and calls.count("bad") > 3:
                raise RuntimeError("no kernel for this shape")
            clock.now += seconds()
            return 0.0
        return fn

    drifting = lambda: 1.0 if calls.count("drift") <= 3 else 3.0  # (the first round's three calls take 1 s)
    fns = {"fixed": make("fixed", lambda: 0.5), "drift": make("drift", drifting), "bad": make("bad", lambda: 2.0)}
    errors = []
    got = bench_kda.time_interleaved(fns, (), iters=6, rounds=3, on_error=lambda key, exc: errors.append(key))
    assert calls[:9] == ["fixed"] * 3 + ["drift"] * 3 + ["bad"] * 3
    assert calls[9:15] == ["fixed"] * 3 + ["drift"] * 3 and calls[15] == "bad"
    assert calls[16:] == ["fixed"] * 3 + ["drift"] * 3
    assert errors == ["bad"] and set(got) == {"fixed", "drift"}
    assert got["fixed"] == (500.0, [500.0, 500.0, 500.0])
    assert got["drift"] == (3000.0, [1000.0, 3000.0, 3000.0])
    with pytest.raises(RuntimeError, match="no kernel"):  # without on_error a failure is not dropped silently
        bench_kda.time_interleaved(fns, (), iters=6, rounds=3)


def test_time_interleaved_needs_rounds_dividing_iters():
    with pytest.raises(ValueError, match="rounds must be >= 1 and divide iters = 10"):
        bench_kda.time_interleaved({"f": lambda: 0.0}, (), iters=10, rounds=3)
    with pytest.raises(ValueError, match="rounds must be"):
        bench_kda.time_interleaved({"f": lambda: 0.0}, (), iters=10, rounds=0)


@pytest.mark.parametrize("kind, tag", [("NVIDIA H200", "h200"), ("NVIDIA H100 80GB HBM3", "h100"),
                                       ("NVIDIA A100-SXM4-80GB", "a100"), ("cpu", "cpu"), ("TPU v5 lite", "v5")])
def test_device_tag_names_the_card_a_run_used(kind, tag):
    # Result files carry the device's model, so an H100 given for an H200 does not write "...-h200-kda.json"
    # (the memory size "80GB" is not a model: a model starts with a letter).
    assert bench_kda.device_tag(kind) == tag


def test_device_tag_defaults_to_the_first_jax_device():
    tag = bench_kda.device_tag()
    assert tag == bench_kda.device_tag(bench_kda.jax.devices()[0].device_kind) and tag.isalnum() and tag.islower()


def test_decode_copy_ceiling_returns_the_state_in_every_tiling():
    # bench_pallas_kda's copy ('c' in a --decode config) reads and writes every tile of the state in place on the
    # decode step's grid: in each layout and V tiling (interpreted on the CPU) it must give the state back as it was.
    import jax.numpy as jnp
    import numpy as np

    import bench_pallas_kda
    state = jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 32, 64)), jnp.float32)  # [B, H, ., .]
    for letters in ("fc", "ftc", "ftic"):
        block_v, warps, letters = bench_pallas_kda.parse_decode_config(f"16x4{letters}")
        opts = bench_pallas_kda.decode_options(block_v, warps, letters)
        copied = bench_pallas_kda.copy_state(state, block_v, warps, opts["state_layout"], opts["v_tiles"])
        np.testing.assert_array_equal(np.asarray(copied), np.asarray(state))
    assert bench_pallas_kda.decode_options(16, 4, "fti")["v_tiles"] == "strided"
    with pytest.raises(ValueError, match="needs state_layout 'vk'"):
        bench_pallas_kda.copy_state(state, 16, 4, "kv", "strided")
