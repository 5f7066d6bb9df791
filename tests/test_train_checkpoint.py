"""Checkpoints: save and restore exactly, refuse corrupt or half-written ones clearly, keep earlier ones usable."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from lineattn.train.checkpoint import Checkpointer, CheckpointError
from lineattn.train.metrics import MetricsWriter, plot_losses, read_metrics


def _state(step):
    key = jax.random.key(step)
    return {"params": {"w": jax.random.normal(key, (8, 16)), "b": jnp.arange(5, dtype=jnp.bfloat16) + step},
            "step": jnp.asarray(step, jnp.int32), "rng": jax.random.key_data(key)}


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


@pytest.fixture
def three_checkpoints(tmp_path):
    ck = Checkpointer(tmp_path / "ckpt", keep=5)
    for s in (2, 4, 6):
        ck.save(s, _state(s), {"data_position": {"rows_consumed": 10 * s}})
    ck.wait()
    yield ck
    ck.close()


def _largest_array_file(step_dir: Path) -> Path:
    files = [p for p in (step_dir / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    return max(files, key=lambda p: p.stat().st_size)


def test_round_trip_bitwise(three_checkpoints):
    ck = three_checkpoints
    assert ck.steps() == [2, 4, 6]
    state, meta = ck.restore(6, _abstract(_state(0)))
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(_state(6))):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert meta["data_position"] == {"rows_consumed": 60} and meta["step"] == 6


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")   # orbax's reader, after the failure
def test_corrupt_checkpoint_is_refused_and_earlier_stays_usable(three_checkpoints):
    ck = three_checkpoints
    f = _largest_array_file(ck.directory / "6")
    data = bytearray(f.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 16):
        data[i] ^= 0x5A          # flipped bits: orbax alone restores these silently
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as e:
        ck.restore(6, _abstract(_state(0)))
    msg = str(e.value)
    assert "step 6" in msg and "corrupt" in msg and "--resume-step 4" in msg, msg
    f.write_bytes(bytes(data[:40]))   # truncated file: the reader itself fails
    with pytest.raises(CheckpointError, match="corrupt or incomplete"):
        ck.restore(6, _abstract(_state(0)))
    state, meta = ck.restore(4, _abstract(_state(0)))
    np.testing.assert_array_equal(np.asarray(state["params"]["w"]), np.asarray(_state(4)["params"]["w"]))
    assert ck.set_aside_after(4) == [6] and ck.steps() == [2, 4]
    assert (ck.directory.parent / "ckpt_set_aside" / "6").is_dir()


def test_half_written_checkpoint(three_checkpoints):
    ck = three_checkpoints
    # A copy interrupted part-way: the step folder exists but its state and metadata do not.
    shutil.copytree(ck.directory / "6", ck.directory / "8")
    shutil.rmtree(ck.directory / "8" / "state")
    (ck.directory / "8" / "_CHECKPOINT_METADATA").unlink()
    with pytest.raises(CheckpointError, match=r"step 8\) is incomplete .*--resume-step 6"):
        ck.restore(8, _abstract(_state(0)))
    ck.restore(6, _abstract(_state(0)))
    # orbax's own in-flight folders (killed saves) are never listed as steps.
    (ck.directory / "10.orbax-checkpoint-tmp-123").mkdir()
    assert 10 not in ck.steps()


def test_wrong_structure_is_refused(three_checkpoints):
    other = {"params": {"w": jnp.zeros((8, 16))}, "step": jnp.zeros((), jnp.int32),
             "rng": jnp.zeros((2,), jnp.uint32)}
    with pytest.raises(CheckpointError):
        three_checkpoints.restore(6, _abstract(other))


def test_metrics_jsonl_append_and_plot(tmp_path):
    path = tmp_path / "metrics.jsonl"
    with MetricsWriter(path) as w:
        for s in (1, 2, 3):
            w.write({"step": s, "loss": 3.0 - 0.1 * s, "lr": np.float32(1e-3)})
    with MetricsWriter(path) as w:            # a resumed run re-logs step 3 and goes on
        w.write({"step": 3, "loss": 2.5, "val_loss": 2.6})
        w.write({"step": 4, "loss": float("nan")})
    with open(path, "a") as f:
        f.write('{"step": 5, "lo')            # torn last line
    assert len(read_metrics(path, latest_only=False)) == 5
    recs = read_metrics(path)
    assert [r["step"] for r in recs] == [1, 2, 3, 4] and recs[2]["loss"] == 2.5 and recs[3]["loss"] == "nan"
    out = plot_losses(path, tmp_path / "loss.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
