"""The ablation runner (lineattn.experiments.ablate): grid, resume, outputs, summaries."""

import json
import threading
from pathlib import Path

import pytest
import yaml

from lineattn.experiments import ablate

ROOT = Path(__file__).resolve().parents[1]

TINY = {
    "name": "tiny",
    "task": "tiny MQAR",
    "metric": "val_accuracy",
    "base": {
        "model": {"vocab_size": 32, "width": 16, "num_layers": 1, "num_heads": 1, "conv_size": 0, "mlp_ratio": 0},
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


def test_rows_have_their_own_lrs_and_overrides(tmp_path):
    path = tmp_path / "rows.yaml"
    rows = {"attention": {"lrs": [1e-3, 3e-4, 1e-2], "set": ["model.tie_embeddings=false", "train.steps=3"]}}
    path.write_text(yaml.safe_dump(dict(TINY, grid=dict(TINY["grid"], lrs=[1e-2, 3e-3], rows=rows))))
    cfg = ablate.load_ablate_config(path)
    keys = [c.key for c in ablate.cells(cfg)]
    assert keys == ["default/delta-head/lr0.01/seed0", "default/delta-head/lr0.003/seed0",
                    "default/attention/lr0.001/seed0", "default/attention/lr0.0003/seed0",
                    "default/attention/lr0.01/seed0"]
    tcs = [ablate.run_config(cfg, c) for c in ablate.cells(cfg)]
    assert [tc.optim.lr for tc in tcs] == [1e-2, 3e-3, 1e-3, 3e-4, 1e-2]
    assert [tc.train.steps for tc in tcs] == [2, 2, 3, 3, 3]
    assert [tc.model.get("tie_embeddings", True) for tc in tcs] == [True, True, False, False, False]
    rec = lambda w, g, lr, v: {"task": "default", "write": w, "gate": g, "seed": 0, "lr": lr,
                               "metric": "val_accuracy", "value": v, "steps": 2}
    table = ablate.table_md(cfg, [rec("delta", "head", 1e-2, 0.5), rec("attention", "attention", 3e-4, 0.9),
                                  rec("attention", "attention", 1e-3, 0.7)])
    assert "Learning rates swept: [0.003, 0.01]; attention: [0.0003, 0.001, 0.01]" in table
    assert "| lr 0.0003 | lr 0.001 | lr 0.003 | lr 0.01 |" in table           # one column per lr of any row
    assert "| attention | attention | softmax attention | 90.0 ± 0.0 | 0.0003 | 1 | 90.0 | 70.0 | – | – |" in table
    assert "own overrides of the base config: attention: model.tie_embeddings=false, train.steps=3." in table


def test_selection_order_seed_groups_and_claims(tmp_path, monkeypatch):
    path = tmp_path / "seeds.yaml"
    path.write_text(yaml.safe_dump(dict(TINY, grid=dict(TINY["grid"], seeds=[0, 1], lrs=[1e-2, 3e-3]))))
    cfg = ablate.load_ablate_config(path)
    keys = lambda cs: [c.key.removeprefix("default/") for c in cs]
    # --only: the first glob's cells first; --shard: every N-th seed group, so seeds stay with one worker
    assert keys(ablate.select(ablate.cells(cfg), only="*/attention/lr0.003/*,*/delta-head/*,*/attention/*")) == [
        "attention/lr0.003/seed0", "attention/lr0.003/seed1", "delta-head/lr0.01/seed0", "delta-head/lr0.01/seed1",
        "delta-head/lr0.003/seed0", "delta-head/lr0.003/seed1", "attention/lr0.01/seed0", "attention/lr0.01/seed1"]
    assert keys(ablate.select(ablate.cells(cfg), (1, 2))) == [
        "delta-head/lr0.003/seed0", "delta-head/lr0.003/seed1", "attention/lr0.003/seed0", "attention/lr0.003/seed1"]
    # --claim: a worker skips the groups another worker has claimed and claims the rest, one group at a time
    ran = []
    monkeypatch.setattr(ablate, "run_cell", lambda cfg, cell, runs_dir, log: ran.append(cell.key) or
                        {"final": {"val_accuracy": 0.5}, "wall_s": 0.0})
    assert ablate._claim(tmp_path / "runs", ablate.cells(cfg)[2:4])          # "another worker" took delta lr 3e-3
    ablate.run_grid(cfg, tmp_path / "runs", only="*/delta-head/*", claim=True, log=lambda s: None)
    assert keys(ablate.cells(cfg))[:2] == [k.removeprefix("default/") for k in ran]
    ablate.run_grid(cfg, tmp_path / "runs", only="*/delta-head/*", claim=True, log=lambda s: None)
    assert len(ran) == 2                                                      # everything is claimed now
    (tmp_path / "runs/.claims/closed").touch()                                # a closed queue hands out nothing
    ablate.run_grid(cfg, tmp_path / "runs", only="*/attention/*", claim=True, log=lambda s: None)
    assert len(ran) == 2
    # the seeds of one cell queued under separate globs are separate groups, each claimable by its own worker
    split = ablate.select(ablate.cells(cfg), only="*/attention/*/seed0,*/attention/*/seed1")
    assert [len(g) for g in ablate.seed_groups(split)] == [1, 1, 1, 1]
    assert all(ablate._claim(tmp_path / "split", g) for g in ablate.seed_groups(split))


@pytest.mark.parametrize("bad, message", [
    (dict(TINY, grid=dict(TINY["grid"], gates=["per-row"])), "grid.gates: 'per-row' is not one of"),
    (dict(TINY, grid=dict(TINY["grid"], rows={"delta-channel": {"lrs": [1e-3]}})),
     "grid.rows.delta-channel: not a row"),
    (dict(TINY, grid=dict(TINY["grid"], rows={"attention": {"lrs": []}})),
     "grid.rows.attention.lrs: must be a non-empty"),
    (dict(TINY, grid=dict(TINY["grid"], rows={"attention": {"set": ["model.width=-1"]}})),
     "base (setting 'default', row 'attention'): "),
    (dict(TINY, no_mlp=True), "no_mlp: replaced by base.model.mlp_ratio: 0"),
])
def test_bad_config_names_the_key(tmp_path, capsys, bad, message):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert ablate.main(["--config", str(path), "--list"]) == 2
    assert message in capsys.readouterr().err


def test_layer_pattern_in_base_or_a_setting_is_an_error(tmp_path):
    # the grid sets every cell's layer_pattern: one in base (or in a `set`) would be silently replaced
    in_base = dict(TINY, base=dict(TINY["base"], model=dict(TINY["base"]["model"], layer_pattern=["kda", "mamba"])))
    in_set = dict(TINY, grid=dict(TINY["grid"], settings=[{"name": "s", "set": ["model.layer_pattern=[kda]"]}]))
    for bad, setting in ((in_base, "default"), (in_set, "s")):
        path = tmp_path / "bad.yaml"
        path.write_text(yaml.safe_dump(bad))
        with pytest.raises(ValueError, match=f"setting '{setting}'.*model.layer_pattern: the ablation grid sets it"):
            ablate.load_ablate_config(path)


def test_grid_runs_resumes_and_writes_outputs(config, tmp_path, monkeypatch, capsys):
    runs, out = tmp_path / "runs", tmp_path / "out"
    args = ["--config", str(config), "--runs-dir", str(runs), "--out", str(out)]
    # a partly finished grid ... (each cell says when it starts; with log.progress=lines the trainer's lines follow,
    # prefixed by the cell)
    assert ablate.main(args + ["--only", "*/attention/*", "--set", "log.progress=lines"]) == 0
    started = capsys.readouterr().out
    assert "] default/attention/lr0.01/seed0: training\n" in started
    assert "\n  default/attention/lr0.01/seed0: " in started
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
    # the committed per-run files regenerate the outputs in place
    assert ablate.main(["--config", str(config), "--runs-dir", str(out / "runs"), "--out", str(out),
                        "--report-only"]) == 0
    assert json.loads((out / "results.json").read_text()) == records

    # finished cells are never trained again; a changed config is refused rather than mixed in
    import lineattn.train.trainer as trainer
    monkeypatch.setattr(trainer, "Trainer", lambda *a, **k: pytest.fail("a finished cell was trained again"))
    assert ablate.main(args) == 0
    assert ablate.main(args + ["--set", "train.steps=3"]) == 2
    assert "used another config" in capsys.readouterr().err
    assert ablate.main(args + ["--set", "train.steps=3", "--list"]) == 0
    assert "other default/attention/lr0.01/seed0" in capsys.readouterr().out


def test_threads_run_every_group_once_with_the_sequential_results(config, tmp_path, monkeypatch):
    cfg = ablate.load_ablate_config(config)
    computed = lambda rs: {r["key"]: {k: v for k, v in r["final"].items() if k not in ("tokens_per_s", "mfu")}
                           for r in rs}                                    # the rest is a function of the run
    seq = computed(ablate.run_grid(cfg, tmp_path / "seq", log=lambda s: None))
    par = computed(ablate.run_grid(cfg, tmp_path / "par", threads=2, log=lambda s: None))
    assert par == seq and len(seq) == 2 and "val_accuracy" in seq["default/attention/lr0.01/seed0"]
    # with a fake run: each of 6 groups runs once, in both threads, and a group's seeds stay in one thread
    path = tmp_path / "six.yaml"
    path.write_text(yaml.safe_dump(dict(TINY, grid=dict(TINY["grid"], seeds=[0, 1], lrs=[1e-2, 3e-3, 1e-3]))))
    cfg = ablate.load_ablate_config(path)
    ran, started, barrier = [], set(), threading.Barrier(2, timeout=10)

    def fake_run(cfg, cell, runs_dir, log):
        if threading.current_thread().name not in started:     # each thread's first run waits for the other's:
            started.add(threading.current_thread().name)       # both run at once (else the barrier breaks)
            barrier.wait()
        ran.append((cell.key, threading.current_thread().name))
        return {"key": cell.key, "final": {"val_accuracy": 0.5}, "wall_s": 0.0}

    monkeypatch.setattr(ablate, "run_cell", fake_run)
    ablate.run_grid(cfg, tmp_path / "fake", threads=2, log=lambda s: None)
    assert sorted(k for k, _ in ran) == sorted(c.key for c in ablate.cells(cfg))
    thread_of = dict(ran)
    assert all(thread_of[k] == thread_of[k.replace("seed1", "seed0")] for k in thread_of)
    with pytest.raises(ValueError, match="threads"):
        ablate.run_grid(cfg, tmp_path / "fake", threads=0)


def test_summary_picks_best_lr_by_seed_mean():
    rec = lambda lr, seed, value, metric="val_loss": {"task": "t", "write": "delta", "gate": "channel", "seed": seed,
                                                     "lr": lr, "metric": metric, "value": value}
    records = [rec(1e-3, 0, 2.0), rec(1e-3, 1, 2.2), rec(3e-3, 0, 1.9), rec(3e-3, 1, 2.5)]
    s = ablate.summarize(records, "val_loss")[("t", "delta", "channel")]
    assert s["best_lr"] == 1e-3 and s["mean"] == pytest.approx(2.1) and s["std"] == pytest.approx(0.1)
    acc = [rec(1e-3, 0, 0.5, "val_accuracy"), rec(3e-3, 0, 0.9, "val_accuracy")]
    assert ablate.summarize(acc, "val_accuracy")[("t", "delta", "channel")]["best_lr"] == 3e-3


def test_cells_without_mlp_build_models_without_mlp(config):
    from flax import nnx
    from lineattn.models import HybridLM, ModelConfig
    cfg = ablate.load_ablate_config(config)
    for cell in ablate.cells(cfg):
        mcfg = ablate.run_config(cfg, cell).model_config(ModelConfig)
        assert mcfg.mlp_ratio == 0 and all(b.mlp is None for b in HybridLM(mcfg, rngs=nnx.Rngs(0)).blocks)


LM_CPU_REDUCTION = ("model.width=64", "model.num_layers=2", "data.seq_len=128", "data.batch_size=16",
                    "data.eval_rows=128", "train.steps=300", "train.eval_every=100", "schedule.warmup_steps=30",
                    "train.checkpoint_every=100")


def test_fingerprints_of_committed_runs():
    # The committed LM runs (with MLP) keep their fingerprints, so their grid can be resumed; the committed MQAR
    # runs (made with the old zero-MLP swap, which drew initialisation keys for the unused MLPs) do not match
    # the mlp_ratio-0 config, so they are never mixed into a resumed grid as if they were the same runs.
    lm = ablate.load_ablate_config(ROOT / "configs/ablate_lm.yaml", LM_CPU_REDUCTION)
    cell = next(c for c in ablate.cells(lm) if c.key == "shakespeare_T256/delta-channel/lr0.003/seed1")
    saved = json.loads((ROOT / "experiments/results/ablate_lm/cpu_reduced/runs" / cell.key / "result.json").read_text())
    assert ablate._fingerprint(ablate.run_config(lm, cell)) == saved["config"]

    mqar = ablate.load_ablate_config(ROOT / "configs/ablate_mqar.yaml", ("train.checkpoint_every=0",))
    cell = next(c for c in ablate.cells(mqar) if c.key == "T256_kv16/delta-none/lr0.003/seed0")
    saved = json.loads((ROOT / "experiments/results/ablate_mqar/runs" / cell.key / "result.json").read_text())
    fp = ablate._fingerprint(ablate.run_config(mqar, cell))
    assert fp != saved["config"] and fp["no_mlp"] and fp["model"]["mlp_ratio"] == 0
    # a finished run stays done when a row later runs on another backend (how, not what, it computes)
    cell = next(c for c in ablate.cells(mqar) if c.key == "T512_kv64/delta-element/lr0.01/seed1")
    other_backend = ablate.load_ablate_config(ROOT / "configs/ablate_mqar.yaml", ("model.backend=chunk",))
    assert ablate._fingerprint(ablate.run_config(other_backend, cell)) == ablate._fingerprint(
        ablate.run_config(mqar, cell))
    assert ablate.run_config(other_backend, cell).model["backend"] == "chunk"


@pytest.mark.parametrize("name", ["ablate_mqar", "ablate_lm"])
def test_committed_grids_are_complete_and_their_reports_follow_from_the_runs(name):
    # The results READMEs call both shipped grids complete: every cell of the shipped config has a committed run
    # (done, or "other": finished with the pre-mlp_ratio MQAR config), and results.json / table.md are what the
    # runner makes from those runs, so the reported numbers cannot drift from the per-run files.
    cfg = ablate.load_ablate_config(ROOT / f"configs/{name}.yaml")
    out = ROOT / "experiments/results" / name
    todo = [c.key for c in ablate.cells(cfg) if ablate.status(cfg, c, out / "runs") == "todo"]
    assert todo == []
    records = ablate.collect(cfg, out / "runs")
    assert records == json.loads((out / "results.json").read_text())
    assert ablate.table_md(cfg, records) == (out / "table.md").read_text()
