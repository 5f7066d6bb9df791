"""Gate-granularity ablations: write mode {additive, delta} x gate {none, fixed, head, channel, element}, with
softmax attention as a reference row, over task settings, seeds and a small learning-rate sweep.

    python -m lineattn.experiments.ablate --config configs/ablate_mqar.yaml [--set train.steps=200 ...]
        [--runs-dir runs/ablate/<name>] [--out experiments/results/<name>] [--only GLOBS] [--shard I/N | --claim]
        [--threads N] [--report-only] [--list]

Every run is one `lineattn.train.trainer.Trainer` run in its own directory (`<runs-dir>/<setting>/<cell>/lr<lr>/
seed<seed>`: config.yaml, metrics.jsonl, checkpoints). A finished run leaves `result.json` there and is never
redone; an unfinished one resumes from its last checkpoint. Parallel workers over one runs dir either take fixed
shares (`--shard I/N`: every N-th group of seeds) or a queue (`--claim`: the next unclaimed group; see
experiments/run_grid_device.sh); every invocation ends by collecting all finished runs into `--out`:

    results.json   a list of {"task", "write", "gate", "seed", "lr", "metric", "value", ...}; write = gate =
                   "attention" for the reference row; one record per run and metric (the primary metric first)
    table.md       per task: mean +- std over seeds at the best learning rate of each cell (best by the mean of
                   the primary metric), and the mean of every learning rate
    plot.png       the table as bars; curves.png: the primary metric over steps (eval_every) at the best lr
    runs/<task>/<cell>/lr<lr>/seed<s>/metrics.jsonl   the per-run metrics (small; checkpoints stay in runs-dir)

The ablation config (YAML) has `name`, `task`, `metric` ("val_accuracy" | "val_loss" | "val_bpb"), `base` (a
`lineattn train` config: model, data, optim, schedule, train, log; `model.mlp_ratio: 0` builds blocks without an
MLP, as in Zoology's MQAR models) and `grid` (writes, gates, attention, seeds, lrs, rows, settings: a list of
{name, set: [KEY=VALUE overrides of base]}). `rows` maps a row (its name in the run keys: "attention",
"delta-channel", ...) to {lrs: its own learning-rate sweep, replacing `lrs`; set: KEY=VALUE overrides of base for
that row only, applied after the setting's}; the table lists them under each task. The model of a linear cell is
`base.model` with `layer_pattern: [[write, gate]]` (every layer the same rule); the reference row uses
`layer_pattern: [attention]` (so base and the `set` overrides must not set it).
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from lineattn.ops.rules import GATES, WRITE_MODES
from lineattn.train.config import (ConfigError, apply_overrides, from_dict, load_config, read_file)

ATTENTION = "attention"
HIGHER_IS_BETTER = {"val_accuracy": True, "val_loss": False, "val_bpb": False}


def row_name(write: str, gate: str) -> str:
    """A grid row's name in run keys and `grid.rows`: "<write>-<gate>", or "attention" for the reference row."""
    return ATTENTION if write == ATTENTION else f"{write}-{gate}"


@dataclass(frozen=True)
class Setting:
    """A task variant: dotted overrides of the base config (e.g. data.seq_len=512)."""
    name: str
    set: tuple[str, ...] = ()

    def __post_init__(self):
        if not self.name or "/" in self.name:
            raise ConfigError(f"name: must be a non-empty name without '/', got {self.name!r}")


@dataclass(frozen=True)
class RowConfig:
    """What one row of the grid does differently: its own lr sweep and base overrides (e.g. for the attention row)."""
    lrs: tuple[float, ...] | None = None
    set: tuple[str, ...] = ()

    def __post_init__(self):
        if self.lrs is not None and (not self.lrs or any(lr <= 0 for lr in self.lrs)):
            raise ConfigError(f"lrs: must be a non-empty list of positive numbers, got {list(self.lrs)}")


@dataclass(frozen=True)
class GridConfig:
    writes: tuple[str, ...] = WRITE_MODES
    gates: tuple[str, ...] = GATES
    attention: bool = True                     # the softmax-attention reference row
    seeds: tuple[int, ...] = (0,)
    lrs: tuple[float, ...] = (3e-3,)
    rows: dict[str, RowConfig] = field(default_factory=dict)   # row name -> its own lrs / overrides
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
        names = self.row_names()
        for row in self.rows:
            if row not in names:
                raise ConfigError(f"rows.{row}: not a row of this grid (rows: {names})")

    def row_names(self) -> list[str]:
        """Row names, as in the run keys: "<write>-<gate>" for every pair, then "attention"."""
        return [row_name(w, g) for w in self.writes for g in self.gates] + ([ATTENTION] if self.attention else [])

    def lrs_of(self, row: str) -> tuple[float, ...]:
        own = self.rows.get(row)
        return own.lrs if own is not None and own.lrs is not None else self.lrs

    def set_of(self, row: str) -> tuple[str, ...]:
        return self.rows[row].set if row in self.rows else ()

    def all_lrs(self) -> list[float]:
        return sorted(set(self.lrs).union(*(self.lrs_of(r) for r in self.row_names())))


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
        return row_name(self.write, self.gate)

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
    firsts = {}                   # the first cell of every setting and of every row with overrides ...
    for c in cells(cfg):
        firsts.setdefault((c.setting.name, c.mixer if c.mixer in cfg.grid.rows else None), c)
    for c in firsts.values():     # ... must give a valid train config (checked before any run starts)
        run_config(cfg, c)
    return cfg


def cells(cfg: AblateConfig) -> list[Cell]:
    g = cfg.grid
    mixers = [(w, gate) for w in g.writes for gate in g.gates] + ([(ATTENTION, ATTENTION)] if g.attention else [])
    return [Cell(s, w, gate, lr, seed) for s in g.settings for (w, gate) in mixers
            for lr in g.lrs_of(row_name(w, gate)) for seed in g.seeds]


def run_config(cfg: AblateConfig, cell: Cell):
    """The `lineattn train` config of one cell."""
    base = apply_overrides(cfg.base, cell.setting.set + cfg.grid.set_of(cell.mixer))
    try:
        model = base.setdefault("model", {})
        if isinstance(model, dict):  # (anything else: load_config names the problem)
            if "layer_pattern" in model:
                raise ConfigError("model.layer_pattern: the ablation grid sets it ([[write, gate]] for a linear "
                                  "cell, [attention] for the reference row); remove it from base and every `set`")
            model["layer_pattern"] = [ATTENTION] if cell.write == ATTENTION else [[cell.write, cell.gate]]
        base.setdefault("optim", {})["lr"] = cell.lr
        base.setdefault("train", {})["seed"] = cell.seed
        base.setdefault("data", {})["seed"] = cell.seed
        return load_config(base=base)
    except ConfigError as e:
        row = f", row {cell.mixer!r}" if cfg.grid.set_of(cell.mixer) else ""
        raise ConfigError(f"base (setting {cell.setting.name!r}{row}): {e}") from None


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
    d["model"].pop("backend", None)   # nor does the backend: each is exact against the oracle (tests/test_backends)
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
    # (the trainer's lines, with base.log.progress = lines, name the cell: threads interleave them)
    trainer = Trainer(train_cfg, rd, log_fn=lambda s: log(f"  {cell.key}: {s}"))
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


def seed_groups(some: list[Cell]) -> list[list[Cell]]:
    """Consecutive cells that differ only in the seed, as groups (one model and lr: one compiled train step)."""
    groups: list[list[Cell]] = []
    for c in some:
        if groups and (groups[-1][0].setting, groups[-1][0].mixer, groups[-1][0].lr) == (c.setting, c.mixer, c.lr):
            groups[-1].append(c)
        else:
            groups.append([c])
    return groups


def status(cfg: AblateConfig, cell: Cell, runs_dir: Path) -> str:
    """"todo" (not finished), "done", or "other" (finished with another config: collected into the results, but
    not resumed or redone; move it away to run the cell again)."""
    done = run_dir_of(runs_dir, cell) / "result.json"
    if not done.exists():
        return "todo"
    return "done" if json.loads(done.read_text()).get("config") == _fingerprint(run_config(cfg, cell)) else "other"


def select(all_cells: list[Cell], shard: tuple[int, int] = (0, 1), only: str | None = None) -> list[Cell]:
    """Cells whose key matches one of the comma-separated globs in `only` (in the order of the globs, so the first
    glob's cells run first), then every N-th seed group from the I-th (shard I/N): the seeds of one cell stay with
    one worker, which then compiles that model once (with JAX's persistent compilation cache)."""
    if only:
        pats = [p.strip() for p in only.split(",") if p.strip()]
        rank = {c.key: next((i for i, p in enumerate(pats) if fnmatch.fnmatch(c.key, p)), None) for c in all_cells}
        all_cells = sorted((c for c in all_cells if rank[c.key] is not None), key=lambda c: rank[c.key])
    return [c for g in seed_groups(all_cells)[shard[0]::shard[1]] for c in g]


def _claim(runs_dir: Path, group: list[Cell]) -> bool:
    """Claim a seed group for this worker (False if another worker has, or once the queue is closed by a file
    `<runs dir>/.claims/closed`): workers sharing a runs dir with --claim take groups from one queue instead of
    fixed shards, so a slow group does not hold up the rest."""
    claims = runs_dir / ".claims"
    claims.mkdir(parents=True, exist_ok=True)
    if (claims / "closed").exists():
        return False
    try:
        # named by the group's first run (not its cell): seeds of one cell queued apart are separate groups
        fd = os.open(claims / group[0].key.replace("/", "__"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True


def run_grid(cfg: AblateConfig, runs_dir: Path, *, shard: tuple[int, int] = (0, 1), only: str | None = None,
             claim: bool = False, threads: int = 1, log=print) -> list[dict]:
    """Run the selected todo cells, seed group by seed group. `threads` > 1 runs that many groups at a time in
    this process (each thread takes the next group no other thread has taken): on a GPU, one process's threads
    share one device context, where separate processes are time-sliced by the driver (on the H200, 12 processes
    each ran at about 1/12 of one process's speed). With `claim`, groups are also claimed against other processes."""
    if threads < 1:
        raise ValueError(f"threads: expected >= 1, got {threads}")
    todo = select(cells(cfg), shard, only)
    position = {c.key: i + 1 for i, c in enumerate(todo)}
    groups = seed_groups(todo)
    taken: set[str] = set()
    lock = threading.Lock()

    def take(group: list[Cell]) -> bool:
        with lock:
            if group[0].key in taken:
                return False
            taken.add(group[0].key)
        return not claim or _claim(runs_dir, group)

    def worker() -> list[dict]:
        results = []
        for group in groups:
            if not take(group):
                continue
            for cell in group:
                already = (run_dir_of(runs_dir, cell) / "result.json").exists()
                head = f"[{position[cell.key]}/{len(todo)}] {cell.key}:"
                if not already:  # a cell trains for minutes with no other output (the configs log nothing)
                    log(f"{head} training")
                r = run_cell(cfg, cell, runs_dir, log)
                m = r["final"].get(cfg.metric)
                log(f"{head} {cfg.metric} {m:.4f} ({'already done' if already else f'{r['wall_s']:.0f} s'})"
                    if m is not None else f"{head} no {cfg.metric}")
                results.append(r)
        return results

    if threads == 1:
        return worker()
    with ThreadPoolExecutor(threads, thread_name_prefix="ablate") as pool:
        futures = [pool.submit(worker) for _ in range(threads)]
        return [r for f in futures for r in f.result()]


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
    lrs = cfg.grid.all_lrs()
    swept = f"{sorted(cfg.grid.lrs)}" + "".join(f"; {row}: {sorted(r.lrs)}" for row, r in cfg.grid.rows.items()
                                                if r.lrs is not None)
    lines = [f"# {cfg.name}: {cfg.task}, {cfg.metric}{unit}", "",
             f"Mean ± std over seeds {list(cfg.grid.seeds)} at each cell's best learning rate (best by the seed mean; "
             f"{'higher' if HIGHER_IS_BETTER[cfg.metric] else 'lower'} is better). Learning rates swept: {swept}. "
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
        own = [f"{row_name(w, g)}: {', '.join(cfg.grid.set_of(row_name(w, g)))}" for w, g in rows
               if cfg.grid.set_of(row_name(w, g))]
        if own:
            lines += ["", "Rows trained with their own overrides of the base config: " + "; ".join(own) + "."]
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
        dst = out / "runs" / cell.key
        if (src / "result.json").exists() and src.resolve() != dst.resolve():   # (--runs-dir <out>/runs: in place)
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
    p.add_argument("--shard", default="0/1", metavar="I/N", help="run only seed groups I, I+N, I+2N, ... (the "
                   "seeds of one row and lr stay together; parallel workers)")
    p.add_argument("--only", metavar="GLOBS", help="only cells whose key (setting/write-gate/lrX/seedN) matches one "
                   "of these comma-separated globs, e.g. '*/delta-*/*' (the first glob's cells first)")
    p.add_argument("--claim", action="store_true", help="parallel workers over one runs dir: each takes the next "
                   "seed group no other worker has claimed (claims live in <runs dir>/.claims; delete it before a "
                   "new parallel invocation)")
    p.add_argument("--threads", type=int, default=1, help="run this many seed groups at a time in this process "
                   "(threads; on one GPU better than as many processes, which the driver time-slices)")
    p.add_argument("--report-only", action="store_true", help="only collect finished runs into --out")
    p.add_argument("--list", action="store_true", help="print the cells and whether each is finished (todo, done, or "
                   "other: finished with another config), then exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        cfg = load_ablate_config(args.config, tuple(args.overrides))
        i, _, n = args.shard.partition("/")
        shard = (int(i), int(n or 1))
        if not 0 <= shard[0] < shard[1]:
            raise ConfigError(f"--shard: expected I/N with 0 <= I < N, got {args.shard!r}")
        if args.threads < 1:
            raise ConfigError(f"--threads: expected >= 1, got {args.threads}")
    except (ConfigError, ValueError) as e:
        print(f"lineattn ablate: config error: {e}", file=sys.stderr)
        return 2
    runs_dir = Path(args.runs_dir or os.path.join("runs", "ablate", cfg.name))
    out = Path(args.out or os.path.join("experiments", "results", cfg.name))
    if args.list:
        for c in select(cells(cfg), shard, args.only):
            print(f"{status(cfg, c, runs_dir):<6}{c.key}")
        return 0
    if not args.report_only:
        total = len(cells(cfg))
        print(f"{cfg.name}: {total} runs ({len(select(cells(cfg), shard, args.only))} selected), "
              f"runs in {runs_dir}", flush=True)
        try:
            run_grid(cfg, runs_dir, shard=shard, only=args.only, claim=args.claim, threads=args.threads,
                     log=lambda s: print(s, flush=True))
        except ConfigError as e:
            print(f"lineattn ablate: config error: {e}", file=sys.stderr)
            return 2
    records = write_outputs(cfg, runs_dir, out)
    print(f"{len(records)} records -> {out}/results.json, table.md, plot.png", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
