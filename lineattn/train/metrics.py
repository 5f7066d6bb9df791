"""Run metrics: an append-only JSONL file (one object per logged step) and the loss-curve PNG."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np


def _plain(v: Any) -> Any:
    if isinstance(v, (np.generic,)):
        v = v.item()
    if hasattr(v, "shape") and getattr(v, "shape", None) == ():
        v = np.asarray(v).item()
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)   # JSON has no NaN/inf
    return v


class MetricsWriter:
    """Appends one JSON object per call to `path` and flushes it (a crash loses nothing already written)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", buffering=1)

    def write(self, record: dict[str, Any]) -> None:
        self._f.write(json.dumps({k: _plain(v) for k, v in record.items()}) + "\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def read_metrics(path: str | Path, *, latest_only: bool = True) -> list[dict[str, Any]]:
    """Records in step order. A resumed run re-logs the steps after its checkpoint; with `latest_only` the last
    record of each step wins (the one of the run that went on). A torn last line is skipped."""
    records = []
    path = Path(path)
    if not path.exists():
        return records
    for line in path.read_text().splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    if not latest_only:
        return records
    by_step: dict[int, dict[str, Any]] = {}
    for r in records:
        if "step" in r:
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def plot_losses(metrics_path: str | Path, out_path: str | Path, *, title: str = "") -> Path:
    """Training loss (and validation loss where logged) against step, to a PNG."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    tr = [(r["step"], r["loss"]) for r in recs if isinstance(r.get("loss"), (int, float))]
    if tr:
        ax.plot(*zip(*tr), label="train loss", lw=1.2)
    va = [(r["step"], r["val_loss"]) for r in recs if isinstance(r.get("val_loss"), (int, float))]
    if va:
        ax.plot(*zip(*va), "o-", label="validation loss", ms=4)
    ax.set_xlabel("optimiser step")
    ax.set_ylabel("cross-entropy (nats / token)")
    ax.set_title(title or Path(metrics_path).parent.name)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path)
    plt.close(fig)
    return out_path


def device_memory(devices) -> list[dict | None]:
    """`memory_stats()` per device (None where the platform keeps none, e.g. CPU)."""
    out = []
    for d in devices:
        try:
            s = d.memory_stats()
        except Exception:  # noqa: BLE001 - a platform without stats
            s = None
        out.append({k: s.get(k) for k in ("peak_bytes_in_use", "bytes_in_use", "bytes_limit")} if s else None)
    return out
