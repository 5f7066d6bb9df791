"""Shared set-up for the notebooks: the size knob, the figure folder, JAX precision."""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import matplotlib  # noqa: E402

matplotlib.use(os.environ.get("MPLBACKEND", "Agg"))
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

# LINEATTN_NB_SIZE: "small" (CI, seconds) or "full" (by hand, minutes)
SIZE = os.environ.get("LINEATTN_NB_SIZE", "full")
if SIZE not in ("small", "full"):
    raise ValueError(f"LINEATTN_NB_SIZE must be 'small' or 'full', got {SIZE!r}")
SMALL = SIZE == "small"
# LINEATTN_NB_FIGURES: where figures go. Default: notebooks/figures at the full size (the committed figures), and
# notebooks/figures/small (not tracked) at the small size, so a quick run does not overwrite the committed ones.
FIGURES = Path(os.environ.get("LINEATTN_NB_FIGURES")
               or ROOT / "notebooks" / "figures" / ("small" if SMALL else ""))
FIGURES.mkdir(parents=True, exist_ok=True)
DATA = ROOT / "notebooks" / "data"


def save(fig, name: str) -> Path:
    path = FIGURES / name
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"saved {path}")
    return path
