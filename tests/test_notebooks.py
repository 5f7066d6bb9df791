"""The notebooks (jupytext percent-format .py) run at their small size and their asserted findings hold."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ("online_learning", "retrieval", "decay")


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_small(name, tmp_path):
    env = dict(os.environ, LINEATTN_NB_SIZE="small", LINEATTN_NB_FIGURES=str(tmp_path), MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    res = subprocess.run([sys.executable, f"{name}.py"], cwd=ROOT / "notebooks", env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    assert f"{name.replace('_', '-')} notebook: all findings hold" in res.stdout
    assert list(tmp_path.glob("*.png")), "no figure saved"


def test_notebooks_are_percent_format():
    for name in NOTEBOOKS:
        text = (ROOT / "notebooks" / f"{name}.py").read_text()
        assert "format_name: percent" in text and "# %% [markdown]" in text
