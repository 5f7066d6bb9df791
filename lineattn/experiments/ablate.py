"""Gate-granularity ablations: write mode {additive, delta} x gate {none, fixed, head, channel, element}, with
softmax attention as a reference row, over task settings, seeds and a small learning-rate sweep.

    python -m lineattn.experiments.ablate --config configs/ablate_mqar.yaml [--set train.steps=200 ...]
        [--runs-dir runs/ablate/<name>] [--out experiments/results/<name>] [--shard I/N] [--report-only]

Every run is one `lineattn.train.trainer.Trainer` run in its own directory (`<runs-dir>/<setting>/<cell>/lr<lr>/
seed<seed>`: config.yaml, metrics.jsonl, checkpoints). A finished run leaves `result.json` there and is never
redone; an unfinished one resumes from its last checkpoint. `--shard I/N` runs every N-th run (for parallel
workers); every invocation ends by collecting all finished runs into `--out`:

    results.json   a list of {"task", "write", "gate", "seed", "lr", "metric", "value", ...}; write = gate =
                   "attention" for the reference row; one record per run and metric (the primary metric first)
    table.md       per task: mean +- std over seeds at the best learning rate of each cell (best by the mean of
                   the primary metric), and the mean of every learning rate
    plot.png       the table as bars; curves.png: the primary metric over steps (eval_every) at the best lr
    runs/<task>/<cell>/lr<lr>/seed<s>/metrics.jsonl   the per-run metrics (small; checkpoints stay in runs-dir)

The ablation config (YAML) has `name`, `task`, `metric` ("val_accuracy" | "val_loss" | "val_bpb"), `base` (a
`lineattn train` config: model, data, optim, schedule, train, log; `model.mlp_ratio: 0` builds blocks without an
MLP, as in Zoology's MQAR models) and `grid` (writes, gates, attention, seeds, lrs, settings: a list of {name, set: [KEY=VALUE
overrides of base]}). The model of a linear cell is `base.model` with `layer_pattern: [[write, gate]]` (every layer
the same rule); the reference row uses `layer_pattern: [attention]`.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import json
import math
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lineattn.ops.rules import GATES, WRITE_MODES
from lineattn.train.config import (ConfigError, apply_overrides, from_dict, load_config, read_file, to_dict)

ATTENTION = "attention"
HIGHER_IS_BETTER = {"val_accuracy": True, "val_loss": False, "val_bpb": False}


@dataclass(frozen=True)
class Setting:
    """A task variant: dotted overrides of the base config (e.g. data.seq_len=512)."""
    name: str
    set: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: must be a non-empty name without '/', got {self.name!r}")


@dataclass(frozen=True)
class GridConfig:
    writes: tuple[str, ...] = WRITE_MODES
    gates: tuple[str, ...] = GATES
    attention: bool = True                     # the softmax-attention reference row
    seeds: tuple[int, ...] = (0,)
    lrs: tuple[float, ...] = (3e-3,)
    settings: tuple[Setting, ...] = (Setting("default"),)

    def __post_init__(self):
        for w in self.writes:
            if w not in WRITE_MODES:
                raise ConfigError(f"writes: {w!r} is not one of {list(WRITE_MODES)}")
        for g in self.gates:
            if g not in GATES:
                raise ConfigError(f"gates: {g!r} is not one of {list(GATES)}")
        if not self.seeds or not self.lrs or not self.settings:
            raise ConfigError("seeds, lrs and settings must not be empty")
        if any(lr <= 0 for lr in self.lrs):
            raise ConfigError(f"lrs: must be positive, got {list(self.lrs)}")
        names = [s.name for s in self.settings]
        if len(set(names)) != len(names):
            raise ConfigError(f"settings: names must be distinct, got {names}")


@dataclass(frozen=True)
class AblateConfig:
    name: str
    task: str
    metric: Literal["val_accuracy", "val_loss", "val_bpb"]
    base: dict[str, Any] = field(default_factory=dict)
    grid: GridConfig = field(default_factory=GridConfig)


@dataclass(frozen=True)
class Cell:
    """One run of the grid."""
    setting: Setting
    write: str
    gate: str
    lr: float
    seed: int

    @property
    def mixer(self) -> str:
        return ATTENTION if self.write == ATTENTION else f"{self.write}-{self.gate}"

    @property
    def key(self) -> str:
        return f"{self.setting.name}/{self.mixer}/lr{self.lr:g}/seed{self.seed}"


def load_ablate_config(path: str | Path, overrides: tuple[str, ...] = ()) -> AblateConfig:
    """Read the ablation YAML; `overrides` (KEY=VALUE) apply to the base train config."""
    raw = read_file(path)
    raw.setdefault("name", Path(path).stem)
    if "no_mlp" in raw:
        raise ConfigError("no_mlp: replaced by base.model.mlp_ratio: 0 (blocks without an MLP)")
    if "base" in raw:
        raw["base"] = apply_overrides(raw["base"] or {}, overrides)
    elif overrides:
        raw["base"] = apply_overrides({}, overrides)
    cfg = from_dict(AblateConfig, raw)
    for s in cfg.grid.settings:   # every setting must give a valid train config (checked before any run starts)
        run_config(cfg, Cell(s, cfg.grid.writes[0] if cfg.grid.writes else ATTENTION,
                             cfg.grid.gates[0] if cfg.grid.gates else ATTENTION, cfg.grid.lrs[0], cfg.grid.seeds[0]))
    return cfg


def cells(cfg: AblateConfig) -> list[Cell]:
    g = cfg.grid
    mixers = [(w, gate) for w in g.writes for gate in g.gates] + ([(ATTENTION, ATTENTION)] if g.attention else [])
    return [Cell(s, w, gate, lr, seed) for s in g.settings for (w, gate) in mixers for lr in g.lrs for seed in g.seeds]


def run_config(cfg: AblateConfig, cell: Cell):
    """The `lineattn train` config of one cell."""
    base = apply_overrides(cfg.base, cell.setting.set)
    base.setdefault("model", {})
    base["model"]["layer_pattern"] = [ATTENTION] if cell.write == ATTENTION else [[cell.write, cell.gate]]
    base.setdefault("optim", {})["lr"] = cell.lr
    base.setdefault("train", {})["seed"] = cell.seed
    base.setdefault("data", {})["seed"] = cell.seed
    try:
        return load_config(base=base)
    except ConfigError as e:
        raise ConfigError(f"base (setting {cell.setting.name!r}): {e}") from None


# ---------------------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------------------

def run_dir_of(runs_dir: Path, cell: Cell) -> Path:
    return runs_dir / cell.key


def _fingerprint(train_cfg) -> dict[str, Any]:
    """What a run computes (compared before a finished run is reused). "no_mlp" is kept so that runs made before
    `model.mlp_ratio: 0` existed (when the runner swapped every MLP for a zero module and said so under this key)
    keep their fingerprints where they had an MLP; those without one differ (their model config had no
    mlp_ratio, and their initialisation drew keys for the unused MLPs), so they are not resumed."""
    d = train_cfg.to_dict()
    for volatile in ("log", "mesh"):
        d.pop(volatile, None)
    d["data"].pop("cache_dir", None)
    for k in ("checkpoint_every", "keep_checkpoints", "async_checkpoint"):   # do not change what a run computes
        d["train"].pop(k, None)
    d["no_mlp"] = float(d["model"].get("mlp_ratio", 1.0)) == 0
    return d


def run_cell(cfg: AblateConfig, cell: Cell, runs_dir: Path, log=print) -> dict[str, Any]:
    """Train one cell (or resume it, or return its saved result)."""
    from lineattn.train.trainer import Trainer
    train_cfg = run_config(cfg, cell)
    rd = run_dir_of(runs_dir, cell)
    done = rd / "result.json"
    fp = _fingerprint(train_cfg)
    if done.exists():
        saved = json.loads(done.read_text())
        if saved.get("config") != fp:
            raise ConfigError(f"{cell.key}: the finished run in {rd} used another config; use a new --runs-dir "
                              "(or delete that run)")
        return saved
    t0 = time.perf_counter()
    trainer = Trainer(train_cfg, rd, log_fn=lambda s: None)
    try:
        last = trainer.run()
        num_params = trainer.num_params
    finally:
        trainer.close()
    result = {"key": cell.key, "task": cell.setting.name, "write": cell.write, "gate": cell.gate, "lr": cell.lr,
              "seed": cell.seed, "steps": train_cfg.train.steps, "num_params": num_params,
              "wall_s": round(time.perf_counter() - t0, 1),
              "final": {k: v for k, v in last.items() if isinstance(v, (int, float))}, "config": fp}
    tmp = done.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(done)
    return result


def select(all_cells: list[Cell], shard: tuple[int, int] = (0, 1), only: str | None = None) -> list[Cell]:
    """Cells whose key matches one of the comma-separated globs in `only`, then every N-th from I (shard I/N)."""
    if only:
        pats = [p.strip() for p in only.split(",") if p.strip()]
        all_cells = [c for c in all_cells if any(fnmatch.fnmatch(c.key, p) for p in pats)]
    return all_cells[shard[0]::shard[1]]


def run_grid(cfg: AblateConfig, runs_dir: Path, *, shard: tuple[int, int] = (0, 1), only: str | None = None,
             log=print) -> list[dict]:
    todo = select(cells(cfg), shard, only)
    results = []
    for i, cell in enumerate(todo):
        already = (run_dir_of(runs_dir, cell) / "result.json").exists()
        r = run_cell(cfg, cell, runs_dir, log)
        m = r["final"].get(cfg.metric)
        log(f"[{i + 1}/{len(todo)}] {cell.key}: {cfg.metric} {m:.4f} "
            f"({'already done' if already else f'{r['wall_s']:.0f} s'})" if m is not None else
            f"[{i + 1}/{len(todo)}] {cell.key}: no {cfg.metric}")
        results.append(r)
    return results


# ---------------------------------------------------------------------------------------------------------------
# Collecting: results.json, table.md, plot.png, curves.png
# ---------------------------------------------------------------------------------------------------------------

def collect(cfg: AblateConfig, runs_dir: Path) -> list[dict[str, Any]]:
    """Records of every finished run of the grid (unfinished ones are left out)."""
    metrics = [cfg.metric] + [m for m in ("val_accuracy", "val_loss", "val_bpb") if m != cfg.metric]
    records = []
    for cell in cells(cfg):
        done = run_dir_of(runs_dir, cell) / "result.json"
        if not done.exists():
            continue
        r = json.loads(done.read_text())
        for m in metrics:
            if m in r["final"]:
                records.append({"task": r["task"], "write": r["write"], "gate": r["gate"], "seed": r["seed"],
                                "lr": r["lr"], "metric": m, "value": r["final"][m], "steps": r["steps"],
                                "num_params": r["num_params"], "wall_s": r["wall_s"]})
    return records


def summarize(records: list[dict], metric: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    """Per (task, write, gate): the best lr (by the seed mean of `metric`) with mean, std and seeds there, and
    the mean of every lr."""
    hib = HIGHER_IS_BETTER[metric]
    by: dict[tuple, dict[float, list[tuple[int, float]]]] = {}
    for r in records:
        if r["metric"] == metric:
            by.setdefault((r["task"], r["write"], r["gate"]), {}).setdefault(r["lr"], []).append((r["seed"], r["value"]))
    out = {}
    for key, per_lr in by.items():
        means = {lr: float(np.mean([v for _, v in vs])) for lr, vs in per_lr.items()}
        best = (max if hib else min)(means, key=lambda lr: means[lr])
        vals = [v for _, v in sorted(per_lr[best])]
        out[key] = {"best_lr": best, "mean": means[best], "std": float(np.std(vals)) if len(vals) > 1 else 0.0,
                    "values": vals, "seeds": [s for s, _ in sorted(per_lr[best])], "lr_means": means}
    return out


def _order(cfg: AblateConfig):
    g = cfg.grid
    rows = [(w, gate) for w in g.writes for gate in g.gates] + ([(ATTENTION, ATTENTION)] if g.attention else [])
    return rows


RULE_NAMES = {("additive", "none"): "linear attn (no gate)", ("additive", "fixed"): "RetNet",
              ("additive", "head"): "simple GLA / Mamba2", ("additive", "channel"): "GLA",
              ("additive", "element"): "per-element (ours)", ("delta", "none"): "DeltaNet",
              ("delta", "fixed"): "delta + fixed decay", ("delta", "head"): "Gated DeltaNet",
              ("delta", "channel"): "KDA", ("delta", "element"): "delta per-element (ours)",
              (ATTENTION, ATTENTION): "softmax attention"}


def _fmt(metric: str, x: float) -> str:
    return f"{100 * x:.1f}" if metric == "val_accuracy" else f"{x:.4f}"


def table_md(cfg: AblateConfig, records: list[dict]) -> str:
    summ = summarize(records, cfg.metric)
    unit = " (%)" if cfg.metric == "val_accuracy" else ""
    lrs = sorted(cfg.grid.lrs)
    lines = [f"# {cfg.name}: {cfg.task}, {cfg.metric}{unit}", "",
             f"Mean ± std over seeds {list(cfg.grid.seeds)} at each cell's best learning rate (best by the seed mean; "
             f"{'higher' if HIGHER_IS_BETTER[cfg.metric] else 'lower'} is better). Learning rates swept: {lrs}. "
             "Cells not yet run are left out.", ""]
    tasks = [s.name for s in cfg.grid.settings]
    for task in tasks:
        rows = [(w, g) for (w, g) in _order(cfg) if (task, w, g) in summ]
        if not rows:
            continue
        steps = next((r["steps"] for r in records if r["task"] == task), "?")
        lines += [f"## {task} ({steps} steps)", "",
                  "| write | gate | rule | " + cfg.metric + unit + " | best lr | seeds | " +
                  " | ".join(f"lr {lr:g}" for lr in lrs) + " |",
                  "|---|---|---|---|---|---|" + "---|" * len(lrs)]
        for w, g in rows:
            s = summ[(task, w, g)]
            per_lr = " | ".join(_fmt(cfg.metric, s["lr_means"][lr]) if lr in s["lr_means"] else "–" for lr in lrs)
            lines.append(f"| {w} | {g} | {RULE_NAMES.get((w, g), '')} | {_fmt(cfg.metric, s['mean'])} ± "
                         f"{_fmt(cfg.metric, s['std'])} | {s['best_lr']:g} | {len(s['values'])} | {per_lr} |")
        lines.append("")
    return "\n".join(lines)


def plot(cfg: AblateConfig, records: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summ = summarize(records, cfg.metric)
    tasks = [s.name for s in cfg.grid.settings if any(k[0] == s.name for k in summ)]
    if not tasks:
        return
    fig, axes = plt.subplots(1, len(tasks), figsize=(5.5 * len(tasks), 3.8), squeeze=False)
    scale = 100 if cfg.metric == "val_accuracy" else 1
    gates = list(cfg.grid.gates)
    for ax, task in zip(axes[0], tasks):
        width = 0.8 / max(len(cfg.grid.writes), 1)
        for j, w in enumerate(cfg.grid.writes):
            xs, ys, es = [], [], []
            for i, g in enumerate(gates):
                s = summ.get((task, w, g))
                if s:
                    xs.append(i + (j - (len(cfg.grid.writes) - 1) / 2) * width)
                    ys.append(scale * s["mean"])
                    es.append(scale * s["std"])
            ax.bar(xs, ys, width, yerr=es, label=w, capsize=2)
        s = summ.get((task, ATTENTION, ATTENTION))
        if s:
            ax.axhline(scale * s["mean"], color="k", ls="--", lw=1, label="attention")
        ax.set_xticks(range(len(gates)), gates)
        ax.set_xlabel("gate granularity")
        ax.set_ylabel(cfg.metric + (" (%)" if scale == 100 else ""))
        ax.set_title(task)
        if cfg.metric != "val_accuracy":
            vals = [scale * v["mean"] for k, v in summ.items() if k[0] == task]
            lo, hi = min(vals), max(vals)
            ax.set_ylim(lo - 0.15 * (hi - lo + 1e-9), hi + 0.15 * (hi - lo + 1e-9))
        ax.legend(fontsize=8)
    fig.suptitle(f"{cfg.name}: mean ± std over seeds at the best lr per cell")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _read_jsonl(path: Path) -> list[dict]:
    from lineattn.train.metrics import read_metrics
    return read_metrics(path)


def plot_curves(cfg: AblateConfig, records: list[dict], runs_dir: Path, path: Path) -> bool:
    """The primary metric over training steps (from eval_every) for every cell at its best lr, seed-mean."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    summ = summarize(records, cfg.metric)
    tasks = [s for s in cfg.grid.settings if any(k[0] == s.name for k in summ)]
    fig, axes = plt.subplots(1, max(len(tasks), 1), figsize=(5.5 * max(len(tasks), 1), 3.8), squeeze=False)
    drew = False
    scale = 100 if cfg.metric == "val_accuracy" else 1
    for ax, setting in zip(axes[0], tasks):
        for w, g in _order(cfg):
            s = summ.get((setting.name, w, g))
            if not s:
                continue
            curves = []
            for seed in s["seeds"]:
                rd = run_dir_of(runs_dir, Cell(setting, w, g, s["best_lr"], seed))
                pts = [(r["step"], r[cfg.metric]) for r in _read_jsonl(rd / "metrics.jsonl") if cfg.metric in r]
                if pts:
                    curves.append(pts)
            if not curves:
                continue
            n = min(len(c) for c in curves)
            steps = [p[0] for p in curves[0][:n]]
            mean = np.mean([[p[1] for p in c[:n]] for c in curves], axis=0)
            if w == ATTENTION:
                style = dict(color="k", ls="--")
            else:
                gi = list(GATES).index(g)
                style = dict(color=f"C{gi}", ls="-" if w == "delta" else ":", marker="o" if w == "delta" else None,
                             ms=3)
            ax.plot(steps, scale * mean, label=RULE_NAMES.get((w, g), f"{w}-{g}"), **style)
            drew = drew or len(steps) > 1
        ax.set_title(setting.name)
        ax.set_xlabel("step")
        ax.set_ylabel(cfg.metric + (" (%)" if scale == 100 else ""))
        ax.legend(fontsize=7)
    fig.tight_layout()
    if drew:
        fig.savefig(path, dpi=110)
    plt.close(fig)
    return drew


def write_outputs(cfg: AblateConfig, runs_dir: Path, out: Path) -> list[dict]:
    records = collect(cfg, runs_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(records, indent=1))
    (out / "table.md").write_text(table_md(cfg, records))
    if records:
        plot(cfg, records, out / "plot.png")
        plot_curves(cfg, records, runs_dir, out / "curves.png")
    for cell in cells(cfg):   # per-run metrics (small) beside the results; checkpoints stay in runs_dir
        src = run_dir_of(runs_dir, cell)
        if (src / "result.json").exists():
            dst = out / "runs" / cell.key
            dst.mkdir(parents=True, exist_ok=True)
            for name in ("metrics.jsonl", "result.json"):
                if (src / name).exists():
                    shutil.copyfile(src / name, dst / name)
    return records


# ---------------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------------

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="lineattn ablate", description="Run a write-mode x gate-granularity grid.")
    p.add_argument("--config", required=True, help="ablation YAML (configs/ablate_*.yaml)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override of the base train config, e.g. --set train.steps=200 (repeatable)")
    p.add_argument("--runs-dir", help="where the runs live (default runs/ablate/<name>); finished runs are reused")
    p.add_argument("--out", help="results folder (default experiments/results/<name>)")
    p.add_argument("--shard", default="0/1", metavar="I/N", help="run only cells I, I+N, I+2N, ... (parallel workers)")
    p.add_argument("--only", metavar="GLOBS", help="only cells whose key (setting/write-gate/lrX/seedN) matches one "
                   "of these comma-separated globs, e.g. '*/delta-*/*'")
    p.add_argument("--report-only", action="store_true", help="only collect finished runs into --out")
    p.add_argument("--list", action="store_true", help="print the cells and whether each is finished, then exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = load_ablate_config(args.config, tuple(args.overrides))
        i, _, n = args.shard.partition("/")
        shard = (int(i), int(n or 1))
        if not 0 <= shard[0] < shard[1]:
            raise ConfigError(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}")
    except (ConfigError, ValueError) as e:
        print(f"lineattn ablate: config error: {e}", file=sys.stderr)
        return 2
    runs_dir = Path(args.runs_dir or os.path.join("runs", "ablate", cfg.name))
    out = Path(args.out or os.path.join("experiments", "results", cfg.name))
    if args.list:
        for c in select(cells(cfg), shard, args.only):
            print(("done  " if (run_dir_of(runs_dir, c) / "result.json").exists() else "todo  ") + c.key)
        return 0
    if not args.report_only:
        total = len(cells(cfg))
        print(f"{cfg.name}: {total} runs ({len(select(cells(cfg), shard, args.only))} selected), "
              f"runs in {runs_dir}", flush=True)
        try:
            run_grid(cfg, runs_dir, shard=shard, only=args.only, log=lambda s: print(s, flush=True))
        except ConfigError as e:
            print(f"lineattn ablate: config error: {e}", file=sys.stderr)
            return 2
    records = write_outputs(cfg, runs_dir, out)
    print(f"{len(records)} records -> {out}/results.json, table.md, plot.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
