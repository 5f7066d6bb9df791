"""The Pallas kernels' tuning constants (launch settings, tiles, precisions, variants) set by name, for sweeps.

Each constant is a module attribute of `lineattn.ops.pallas` read when a call is traced (`chunk_bwd.WY_WARPS`,
`gram.GRAM_IMPL`, `chunk.SAVE_STATES`, ...; the kernel notes, ops/pallas/README.md, list them). `override`
sets some for the duration of a block:

    with tuning.override({"chunk_bwd.WY_WARPS": 8, "solve.SOLVE_IMPL": "triton"}):
        o, ht = ops.chunk_kda(q, k, v, g, beta, backend="pallas")

and `parse` reads the benchmarks' command-line form, "chunk_bwd.WY_WARPS=8+solve.SOLVE_IMPL=triton".
"""

from __future__ import annotations

import contextlib
import importlib
import pkgutil
from collections.abc import Iterator, Mapping

import jax


def parse(config: str) -> dict[str, bool | int | str]:
    """{"module.NAME": value} from 'module.NAME=value' items joined by '+' ('default' or '': none); "True" and
    "False" become bools (the string "False" would read as true), integer values ints, the rest stay strings."""
    settings: dict[str, bool | int | str] = {}
    bools = {"True": True, "False": False}
    for item in ([] if config in ("", "default") else config.split("+")):
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"a setting is 'module.NAME=value', got {item!r} in {config!r}")
        settings[name] = bools[value] if value in bools else int(value) if value.lstrip("-").isdigit() else value
    return settings


def _target(name: str):
    """(module, attribute) of 'module.NAME', with a ValueError naming what does not exist."""
    module_name, _, attr = name.rpartition(".")
    if not module_name:
        raise ValueError(f"a setting's name is 'module.NAME' (e.g. 'chunk_bwd.WY_WARPS'), got {name!r}")
    try:
        module = importlib.import_module(f"lineattn.ops.pallas.{module_name}")
    except ModuleNotFoundError:
        raise ValueError(f"no module lineattn.ops.pallas.{module_name} (setting {name!r})") from None
    if not hasattr(module, attr) or not attr.isupper():
        homes = [f"{m}.{attr}" for m in _modules()
                 if attr.isupper() and hasattr(importlib.import_module(f"lineattn.ops.pallas.{m}"), attr)]
        hint = f"; it is {' or '.join(homes)}" if homes else ""
        raise ValueError(f"no tuning constant {attr!r} in lineattn.ops.pallas.{module_name} (setting {name!r}{hint})")
    return module, attr


def _modules() -> list[str]:
    """The names of lineattn.ops.pallas's modules (where a constant named under the wrong module may live: the Gram
    and solve constants moved out of chunk_fwd, the Gram gradients' out of chunk_bwd, on 2026-12-04)."""
    return sorted(info.name for info in pkgutil.iter_modules(importlib.import_module("lineattn.ops.pallas").__path__))


@contextlib.contextmanager
def override(settings: Mapping[str, object]) -> Iterator[None]:
    """Sets `lineattn.ops.pallas.<module>.<NAME>` for each "module.NAME" in settings inside the block and restores
    the previous values after it. JAX's caches are cleared on entry and exit when anything is set: a function
    jitted outside the block keeps the constants of its first trace otherwise."""
    targets = {name: _target(name) for name in settings}  # every name checked before any is set
    old = {name: getattr(*target) for name, target in targets.items()}
    try:
        for name, (module, attr) in targets.items():
            setattr(module, attr, settings[name])
        if settings:
            jax.clear_caches()
        yield
    finally:
        for name, (module, attr) in targets.items():
            setattr(module, attr, old[name])
        if settings:
            jax.clear_caches()
