"""The ablation runner (lineattn.experiments.ablate): grid, resume, outputs, summaries."""

import json

import pytest
import yaml

from lineattn.experiments import ablate

TINY = {
    "name": "tiny",
    "task": "tiny MQAR",
    "metric": "val_accuracy",
    "no_mlp": True,
    "base": {
        "model": {"vocab_size": 32, "width": 16, "num_layers": 1, "num_heads": 1, "conv_size": 0},
        "data": {"source": "mqar", "seq_len": 16, "batch_size": 4, "eval_rows": 8,
                 "mqar": {"vocab_size": 32, "num_kv_pairs": 2}},
        "schedule": {"warmup_steps": 1},
        "train": {"steps": 2, "checkpoint_every": 0, "async_checkpoint": False},
        "log": {"every": 1, "progress": "none", "plot": False},
    },
    "grid": {"writes": ["delta"], "gates": ["head"], "attention": True, "seeds": [0], "lrs": [1e-2]},
}


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "ablate_tiny.yaml"
    path.write_text(yaml.safe_dump(TINY))
    return path


def test_cells_and_run_configs(config):
    cfg = ablate.load_ablate_config(config)
    keys = [c.key for c in ablate.cells(cfg)]
    assert keys == ["default/delta-head/lr0.01/seed0", "default/attention/lr0.01/seed0"]
    c = ablate.cells(cfg)[0]
    tc = ablate.run_config(cfg, c)
    assert tc.model["layer_pattern"] == [["delta", "head"]] and tc.optim.lr == 1e-2 and tc.train.seed == 0
    assert ablate.run_config(cfg, ablate.cells(cfg)[1]).model["layer_pattern"] == ["attention"]
    assert [c.key for c in ablate.select(ablate.cells(cfg), (1, 2))] == keys[1:]
    assert [c.key for c in ablate.select(ablate.cells(cfg), only="*/attention/*")] == keys[1:]


def test_bad_config_names_the_key(tmp_path, capsys):
    bad = dict(TINY, grid=dict(TINY["grid"], gates=["per-row"]))
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert ablate.main(["--config", str(path), "--list"]) == 2
    assert "grid.gates: 'per-row' is not one of" in capsys.readouterr().err


def test_grid_runs_resumes_and_writes_outputs(config, tmp_path, monkeypatch, capsys):
    runs, out = tmp_path / "runs", tmp_path / "out"
    args = ["--config", str(config), "--runs-dir", str(runs), "--out", str(out)]
    assert ablate.main(args + ["--only", "*/attention/*"]) == 0       # a partly finished grid ...
    assert ablate.main(args + ["--list"]) == 0
    listed = capsys.readouterr().out
    assert "done  default/attention/lr0.01/seed0" in listed and "todo  default/delta-head/lr0.01/seed0" in listed
    assert ablate.main(args) == 0                                      # ... is finished without redoing a cell
    out_text = capsys.readouterr().out
    assert "default/attention/lr0.01/seed0: val_accuracy" in out_text and "already done" in out_text

    records = json.loads((out / "results.json").read_text())
    assert {(r["write"], r["gate"]) for r in records} == {("delta", "head"), ("attention", "attention")}
    for r in records:
        assert {"task", "write", "gate", "seed", "lr", "metric", "value"} <= set(r)
    assert records[0]["metric"] == "val_accuracy"
    table = (out / "table.md").read_text()
    assert "| delta | head | Gated DeltaNet |" in table and "| attention | attention |" in table
    assert (out / "plot.png").stat().st_size > 0
    assert (out / "runs/default/delta-head/lr0.01/seed0/metrics.jsonl").exists()

    # finished cells are never trained again; a changed config is refused rather than mixed in
    import lineattn.train.trainer as trainer
    monkeypatch.setattr(trainer, "Trainer", lambda *a, **k: pytest.fail("a finished cell was trained again"))
    assert ablate.main(args) == 0
    assert ablate.main(args + ["--set", "train.steps=3"]) == 2
    assert "used another config" in capsys.readouterr().err


def test_summary_picks_best_lr_by_seed_mean():
    rec = lambda lr, seed, value, metric="val_loss": {"task": "t", "write": "delta", "gate": "channel", "seed": seed,
                                                     "lr": lr, "metric": metric, "value": value}
    records = [rec(1e-3, 0, 2.0), rec(1e-3, 1, 2.2), rec(3e-3, 0, 1.9), rec(3e-3, 1, 2.5)]
    s = ablate.summarize(records, "val_loss")[("t", "delta", "channel")]
    assert s["best_lr"] == 1e-3 and s["mean"] == pytest.approx(2.1) and s["std"] == pytest.approx(0.1)
    acc = [rec(1e-3, 0, 0.5, "val_accuracy"), rec(3e-3, 0, 0.9, "val_accuracy")]
    assert ablate.summarize(acc, "val_accuracy")[("t", "delta", "channel")]["best_lr"] == 3e-3
