"""The trainer end to end on the real hybrid LM (tiny): golden losses, learning on text and MQAR, bitwise resume,
corrupt-checkpoint handling, and the `lineattn` CLI.

All runs share one model and batch shape, so with the persistent compilation cache (set up below) the train step
compiles once per process.
"""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from flax import nnx

from lineattn.train.checkpoint import CheckpointError
from lineattn.train.config import ConfigError, load_config
from lineattn.train.data import TextSource

from lineattn.train.testing import BASE, CACHE_DIR, enable_compile_cache, golden_text_source

# Losses of the golden run (steps 1, 4, 8, 12). After an intended change to the model's init or forward pass,
# regenerate with: python -m lineattn.train.testing
GOLDEN = {1: 6.0740867, 4: 4.6978412, 8: 3.6884208, 12: 3.4217803}


@pytest.fixture(scope="module")
def compile_cache():
    enable_compile_cache(CACHE_DIR)   # every trainer here compiles the same step: compile it once
    return CACHE_DIR


def _cfg(**sections):
    return load_config(base={k: {**BASE.get(k, {}), **sections.get(k, {})} for k in {*BASE, *sections}})


def _losses(run_dir):
    from lineattn.train.metrics import read_metrics
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl")}


def _golden_run(run_dir):
    from lineattn.train.trainer import Trainer
    trainer = Trainer(_cfg(), run_dir, source=golden_text_source(), log_fn=lambda s: None)
    last = trainer.run()
    params = jax.device_get(trainer.state["params"])
    trainer.close()
    return last, params


def _check_golden(run_dir, last):
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, 13))
    got = {s: round(losses[s], 7) for s in GOLDEN}
    assert got == pytest.approx(GOLDEN, rel=2e-5), f"golden losses changed: {got}"
    assert losses[12] < losses[1] - 1.5                      # learns the text
    assert last["val_loss"] < 4.0 and last["val_bpb"] == pytest.approx(last["val_loss"] / np.log(2))
    for name in ("config.yaml", "metrics.jsonl", "loss.png"):
        assert (run_dir / name).is_file()
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["model"]["conv_size"] == 4 and saved["train"]["steps"] == 12   # resolved: model defaults filled in
    rec = json.loads((run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert {"step", "loss", "lr", "grad_norm", "tokens_per_s"} <= set(rec)


def _check_resume_is_bitwise(golden_dir, golden_params, run_dir):
    from lineattn.train.trainer import Trainer, train
    train(_cfg(), run_dir, until=6, source=golden_text_source(), log_fn=lambda s: None)
    # A crash after step 6, before its checkpoint: the run must go back to step 4 and replay 5 and 6.
    shutil.rmtree(run_dir / "checkpoints" / "6")
    trainer = Trainer(_cfg(), run_dir, source=golden_text_source(), log_fn=lambda s: None)
    assert trainer.start_step == 4
    trainer.run()
    params = jax.device_get(trainer.state["params"])
    trainer.close()
    assert _losses(run_dir) == _losses(golden_dir)           # identical floats, every step
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(golden_params)):
        np.testing.assert_array_equal(a, b)


def _check_corrupt_latest_checkpoint(run_dir):
    from lineattn.train.trainer import Trainer
    files = [p for p in (run_dir / "checkpoints" / "12" / "state").rglob("*") if p.is_file() and p.parent.name == "d"]
    f = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"step 12\) is corrupt.*--resume-step 8"):
        Trainer(_cfg(), run_dir, source=golden_text_source(), log_fn=lambda s: None)
    trainer = Trainer(_cfg(), run_dir, source=golden_text_source(), resume_step=8, log_fn=lambda s: None)
    assert trainer.start_step == 8 and int(trainer.state["step"]) == 8
    trainer.close()
    assert not (run_dir / "checkpoints" / "12").exists() and (run_dir / "checkpoints_set_aside" / "12").is_dir()


def _check_other_config_is_refused(run_dir):
    from lineattn.train.trainer import Trainer
    with pytest.raises(ConfigError, match=r"^optim.lr: differs from the config of the run"):
        Trainer(_cfg(optim={"lr": 1e-3}), run_dir, source=golden_text_source(), log_fn=lambda s: None)


def _check_cli_generate(run_dir, capsys):
    # `lineattn generate` at temperature 0 prints the prompt and the greedy continuation from the checkpoint asked
    # for, the same bytes as decode.generate on the model that load_run restores
    from lineattn import decode
    from lineattn.train.cli import main
    from lineattn.train.tokenizer import ByteTokenizer
    from lineattn.train.trainer import load_run
    capsys.readouterr()
    assert main(["generate", "--run-dir", str(run_dir), "--step", "8", "--prompt", "the king", "--max-new-tokens",
                 "12", "--temperature", "0"]) == 0
    printed = capsys.readouterr().out
    _, bundle, meta = load_run(run_dir, step=8)
    tok = ByteTokenizer()
    prompt = tok.encode("the king", bos=True)[None]
    greedy = np.asarray(decode.generate(bundle.model, prompt, 12, temperature=0.0))[0, prompt.shape[1]:]
    assert meta["step"] == 8 and printed == "the king" + tok.decode(greedy) + "\n"


def test_golden_resume_and_checkpoints(tmp_path, capsys, compile_cache):
    """One test, so that under pytest-xdist one worker compiles the step once for all of these checks."""
    golden_dir = tmp_path / "golden"
    last, golden_params = _golden_run(golden_dir)
    _check_golden(golden_dir, last)
    _check_cli_generate(golden_dir, capsys)
    _check_resume_is_bitwise(golden_dir, golden_params, tmp_path / "resumed")
    shutil.copytree(golden_dir, tmp_path / "other-config")
    _check_other_config_is_refused(tmp_path / "other-config")
    _check_corrupt_latest_checkpoint(golden_dir)


def test_cli_on_mqar_train_resume_eval(tmp_path, capsys, compile_cache):
    from lineattn.train.cli import main
    cfg_file = tmp_path / "c.yaml"
    cfg_file.write_text(yaml.safe_dump({**BASE, "data": {**BASE["data"], "source": "mqar"}}))
    run_dir = tmp_path / "run"
    assert main(["train", "--config", str(cfg_file), "--run-dir", str(run_dir), "--stop-at", "8"]) == 0
    assert main(["train", "--config", str(cfg_file), "--run-dir", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "resumed from" in out and "step 8" in out and "val_acc" in out
    for name in ("metrics.jsonl", "config.yaml", "loss.png"):
        assert (run_dir / name).is_file(), name
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == [4, 8, 12]
    # MQAR learns (slowly: only 4 answers per row are scored).
    losses = [loss for _, loss in sorted(_losses(run_dir).items())]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 0.5
    assert main(["eval", "--run-dir", str(run_dir)]) == 0
    rec = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rec["step"] == 12 and 0 <= rec["val_accuracy"] <= 1 and rec["val_tokens"] == BASE["data"]["eval_rows"] * 4


class StandIn(nnx.Module):
    """A small causal LM (embedding, previous-token mix, MLP, norm) with the parameter names the decay mask skips."""

    def __init__(self, vocab: int, width: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, width, rngs=rngs)
        self.prev = nnx.Linear(width, width, rngs=rngs)
        self.mlp = nnx.Linear(width, width, rngs=rngs)
        self.norm = nnx.RMSNorm(width, rngs=rngs)
        self.A_log = nnx.Param(jnp.zeros((width,)))
        self.dt_bias = nnx.Param(jnp.zeros((width,)))
        self.head = nnx.Linear(width, vocab, rngs=rngs)

    def __call__(self, tokens, segment_ids=None):
        x = self.embed(tokens)
        prev = jnp.pad(x, ((0, 0), (1, 0), (0, 0)))[:, :-1]
        x = x + self.prev(prev) * jnp.exp(self.A_log) + self.dt_bias
        x = x + jax.nn.gelu(self.mlp(self.norm(x)))
        return self.head(x)


def _stand_in(cfg):
    from lineattn.train.trainer import ModelBundle
    return ModelBundle(StandIn(264, 16, nnx.Rngs(cfg.train.seed)))


def test_grad_accumulation_matches_one_big_batch(tmp_path, compile_cache):
    from lineattn.train.trainer import Trainer
    src = golden_text_source()
    one = Trainer(_cfg(), tmp_path / "a", source=src, model_factory=_stand_in, log_fn=lambda s: None)
    acc = Trainer(_cfg(train={"grad_accum": 4}), tmp_path / "b", source=src, model_factory=_stand_in,
                  log_fn=lambda s: None)
    s1, m1 = one._train_step(one.state, one.put(src.batch(0)))
    s2, m2 = acc._train_step(acc.state, acc.put(src.batch(0)))
    assert float(m1["loss"]) == pytest.approx(float(m2["loss"]), rel=1e-6)
    assert float(m1["grad_norm"]) == pytest.approx(float(m2["grad_norm"]), rel=1e-5)
    for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s2["params"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
    one.close(), acc.close()


def test_a_diverging_run_stops_before_saving_non_finite_parameters(tmp_path, compile_cache):
    # lr 1e30: step 1's update makes the parameters ~1e30, so step 2's loss overflows. Checkpoints every step,
    # metrics every 10: the check before step 2's checkpoint stops the run, step 1's checkpoint stays the latest.
    from lineattn.train.trainer import DivergedError, Trainer
    cfg = _cfg(optim={"lr": 1e30}, schedule={"warmup_steps": 0}, train={"checkpoint_every": 1},
               log={"every": 10, "plot": False})
    trainer = Trainer(cfg, tmp_path, source=golden_text_source(), model_factory=_stand_in, log_fn=lambda s: None)
    with pytest.raises(DivergedError, match=r"^step 2: loss .* not finite.*latest checkpoint: step 1\)"):
        trainer.run()
    trainer.close()
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [1]
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])
    assert record["step"] == 2 and record["loss"] in ("nan", "inf", "-inf")  # (JSON has no NaN: a string)


def test_cli_exits_with_4_on_divergence(monkeypatch, capsys):
    from lineattn.train import cli
    from lineattn.train.trainer import DivergedError

    def diverge(args):
        raise DivergedError("step 2: loss nan")
    monkeypatch.setattr(cli, "cmd_train", diverge)
    assert cli.main(["train", "--config", "configs/tiny.yaml"]) == 4
    assert "training diverged: step 2: loss nan" in capsys.readouterr().err


def test_weight_decay_mask():
    from lineattn.train.optim import weight_decay_mask
    params = nnx.state(StandIn(264, 16, nnx.Rngs(0)), nnx.Param)
    mask = {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in p if getattr(k, "name", "") != "value"): m
            for p, m in jax.tree_util.tree_leaves_with_path(weight_decay_mask(params))}
    assert mask == {"A_log": False, "dt_bias": False, "embed/embedding": True, "head/bias": False,
                    "head/kernel": True, "mlp/bias": False, "mlp/kernel": True, "norm/scale": False,
                    "prev/bias": False, "prev/kernel": True}


def test_learning_rate_schedule_warms_up_then_follows_a_cosine_to_min_lr():
    # The README's schedule, written out: linear from 0 over the warm-up, then a half cosine from lr to
    # min_lr_ratio * lr at train.steps, flat after; "constant" stays at lr after the warm-up.
    from lineattn.train.config import OptimConfig, ScheduleConfig
    from lineattn.train.optim import learning_rate_schedule
    lr, end, warm, total = 1e-2, 1e-3, 10, 110
    cosine = learning_rate_schedule(OptimConfig(lr=lr), ScheduleConfig(warmup_steps=warm, min_lr_ratio=0.1), total)
    constant = learning_rate_schedule(OptimConfig(lr=lr), ScheduleConfig(kind="constant", warmup_steps=warm), total)
    for s in (0, 5, 10, 35, 60, 100, 110, 200):
        ramp = lr * s / warm
        half_cos = end + (lr - end) * 0.5 * (1 + np.cos(np.pi * min(s - warm, total - warm) / (total - warm)))
        assert float(cosine(s)) == pytest.approx(ramp if s < warm else half_cos, rel=1e-5, abs=1e-9), s
        assert float(constant(s)) == pytest.approx(ramp if s < warm else lr, rel=1e-5, abs=1e-9), s


def test_optimizer_clips_the_global_norm_before_adamw():
    # With eps = 1 AdamW's first step, -lr g / (|g| + eps) elementwise (no decay), depends on the gradient's scale,
    # so it shows whether g was scaled to the clip norm first.
    from lineattn.train.config import OptimConfig, ScheduleConfig
    from lineattn.train.optim import make_optimizer
    params = {"w": jnp.ones((2, 3))}
    g = {"w": jnp.asarray(np.random.default_rng(0).standard_normal((2, 3)), jnp.float32)}
    norm = float(jnp.linalg.norm(g["w"]))
    for clip in (None, 0.5 * norm, 2.0 * norm):
        tx, _ = make_optimizer(OptimConfig(lr=1.0, eps=1.0, weight_decay=0.0, clip_norm=clip),
                               ScheduleConfig(kind="constant", warmup_steps=0), 10)
        update, _ = tx.update(g, tx.init(params), params)
        scaled = g["w"] * (1.0 if clip is None else min(1.0, clip / norm))
        np.testing.assert_allclose(update["w"], -scaled / (jnp.abs(scaled) + 1.0), rtol=1e-5)


def test_vocab_too_small_is_a_config_error(tmp_path, compile_cache):
    from lineattn.train.trainer import Trainer
    with pytest.raises(ConfigError, match="model.vocab_size: 64 is smaller"):
        Trainer(_cfg(model={"vocab_size": 64}), tmp_path, source=golden_text_source(), log_fn=lambda s: None)


def test_text_source_fixture_is_byte_text():
    src = golden_text_source()
    assert isinstance(src, TextSource) and src.batch(0)["tokens"].shape == (8, 32)
