"""Argument checks shared by ops, layers, models and decode: each raises a ValueError naming the argument."""

from __future__ import annotations

import math
import numbers

import jax
import numpy as np


def is_concrete(x) -> bool:
    """An array with values: not a tracer under jit, nor a shape-only struct (value checks skip the others)."""
    return not isinstance(x, (jax.core.Tracer, jax.ShapeDtypeStruct))


def check_int(name: str, value, minimum: int = 1, *, optional: bool = False) -> None:
    """ValueError naming `name` unless `value` is an int (Python or NumPy, not a bool) >= minimum (or None when
    `optional`)."""
    if optional and value is None:
        return
    if not isinstance(value, numbers.Integral) or isinstance(value, (bool, np.bool_)) or value < minimum:
        want = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"{name} must be {want}{' or None' if optional else ''}, got {value!r}")


def check_real(name: str, value, ok, want: str) -> None:
    """ValueError naming `name` unless `value` is a finite real number (not a bool) with ok(value); `want` says
    the range, e.g. "> 0"."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or not ok(value):
        raise ValueError(f"{name} must be a finite number {want}, got {value!r}")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
