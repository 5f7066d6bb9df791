"""Checkpoints with orbax: the train state (model, optimiser, step, RNG) plus a JSON record (data position, config,
checksums), one folder per step under `run_dir/checkpoints/`.

orbax writes each step into a temporary folder and renames it when complete, so a killed save leaves no step that
looks finished. On top of that every record carries two 32-bit checksums per array, checked after restore: a
checkpoint whose files were damaged after the fact is refused with a `CheckpointError` naming the folder and the
array, and the earlier checkpoints stay usable (`restore(step)` for an earlier step; the CLI's `--resume-step`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

FORMAT = 1


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be used; the message names it and the earlier ones."""


def _path_str(path: tuple) -> str:
    parts = []
    for k in path:
        name = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if name != "value":
            parts.append(str(name))
    return "/".join(parts)


@jax.jit
def _leaf_sums(leaves: list[jax.Array]) -> jax.Array:
    out = []
    for x in leaves:
        x = x.reshape(-1)
        bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
        u = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32)
        w = (jnp.arange(u.size, dtype=jnp.uint32) % jnp.uint32(65521)) + jnp.uint32(1)
        out.append(jnp.stack([jnp.sum(u, dtype=jnp.uint32), jnp.sum(u * w, dtype=jnp.uint32)]))
    return jnp.stack(out) if out else jnp.zeros((0, 2), jnp.uint32)


def checksums(tree: Any) -> dict[str, list[int]]:
    """`{leaf path: [sum of the bits, position-weighted sum]}` (mod 2**32), computed on the device."""
    flat = jax.tree_util.tree_leaves_with_path(tree)
    sums = np.asarray(jax.device_get(_leaf_sums([jnp.asarray(x) for _, x in flat])))
    return {_path_str(p): [int(a), int(b)] for (p, _), (a, b) in zip(flat, sums)}


class Checkpointer:
    def __init__(self, directory: str | Path, *, keep: int = 3, async_save: bool = True):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True))

    def steps(self) -> list[int]:
        """Finished checkpoints, oldest first (a save still in flight, or killed, is not listed)."""
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Any, meta: dict[str, Any]) -> None:
        record = dict(meta, step=int(step), format=FORMAT, checksums=checksums(state))
        self.manager.save(int(step), args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                             meta=ocp.args.JsonSave(record)), force=True)

    def wait(self) -> None:
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()

    def _hint(self, step: int) -> str:
        earlier = [s for s in self.steps() if s < step]
        if not earlier:
            return "There is no earlier checkpoint; delete this folder to start again."
        return (f"Earlier checkpoints: {earlier}; resume from one with --resume-step {earlier[-1]} "
                f"(the later ones are then set aside), or delete this folder.")

    def read_meta(self, step: int) -> dict[str, Any]:
        path = self.directory / str(step)
        try:
            meta = json.loads((path / "meta" / "metadata").read_text())
        except FileNotFoundError:
            files = list((path / "meta").glob("*")) if (path / "meta").is_dir() else []
            if len(files) != 1:
                raise CheckpointError(f"checkpoint {path} (step {step}) has no readable record. "
                                      f"{self._hint(step)}") from None
            meta = json.loads(files[0].read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"checkpoint {path} (step {step}): record unreadable ({e}). {self._hint(step)}") \
                from None
        return meta

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restore `step` into the structure, dtypes and shardings of `abstract_state`; check it; return it and its
        record."""
        path = self.directory / str(step)
        if step not in self.steps():
            raise CheckpointError(f"no finished checkpoint for step {step} in {self.directory} "
                                  f"(finished: {self.steps()})")
        missing = [name for name in ("_CHECKPOINT_METADATA", "state", "meta") if not (path / name).exists()]
        if missing:
            raise CheckpointError(f"checkpoint {path} (step {step}) is incomplete (half-written?): no {missing[0]}. "
                                  f"{self._hint(step)}")
        try:
            restored = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
        except Exception as e:  # orbax, tensorstore and JSON errors alike
            raise CheckpointError(f"checkpoint {path} (step {step}) is corrupt or incomplete: "
                                  f"{type(e).__name__}: {str(e).splitlines()[0][:300]}. {self._hint(step)}") from e
        state, meta = restored.state, restored.meta
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or "checksums" not in meta:
            raise CheckpointError(f"checkpoint {path} (step {step}) has no valid record. {self._hint(step)}")
        want, got = meta["checksums"], checksums(state)
        if set(want) != set(got):
            raise CheckpointError(f"checkpoint {path} (step {step}) holds other arrays than this run's state "
                                  f"(e.g. {sorted(set(want) ^ set(got))[:3]}); was the config changed? "
                                  f"{self._hint(step)}")
        bad = [k for k in want if list(want[k]) != list(got[k])]
        if bad:
            raise CheckpointError(f"checkpoint {path} (step {step}) is corrupt: checksum mismatch in {bad[0]}"
                                  f"{f' and {len(bad) - 1} more arrays' if len(bad) > 1 else ''}. "
                                  f"{self._hint(step)}")
        return state, meta

    def set_aside_after(self, step: int) -> list[int]:
        """Move the checkpoints after `step` to `<directory>_set_aside/` (resuming from an earlier one)."""
        later = [s for s in self.steps() if s > step]
        if later:
            self.manager.wait_until_finished()
            aside = self.directory.parent / f"{self.directory.name}_set_aside"
            aside.mkdir(exist_ok=True)
            for s in later:
                dest = aside / str(s)
                if dest.exists():
                    shutil.rmtree(dest)
                shutil.move(str(self.directory / str(s)), str(dest))
            self.manager.reload()
        return later
