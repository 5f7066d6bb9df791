"""AdamW with warm-up + cosine, global-norm clipping, and a weight-decay mask that skips norms, biases and gates."""

from __future__ import annotations

from typing import Any

import jax
import optax

from lineattn.train.config import OptimConfig, ScheduleConfig

# A parameter is not decayed when a path component is one of these, ends with "bias" or contains "norm";
# nor when it has fewer than 2 dimensions (scales, biases, per-head constants).
NO_DECAY_NAMES = frozenset({"A_log", "dt_bias", "bias", "b", "scale", "D"})


def _key_name(k: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def decays(path: tuple, leaf: Any) -> bool:
    """Whether the parameter at `path` (a JAX key path) gets weight decay."""
    names = [_key_name(k) for k in path if _key_name(k) != "value"]
    if getattr(leaf, "ndim", 0) < 2:
        return False
    for n in names:
        if n in NO_DECAY_NAMES or n.endswith("bias") or "norm" in n.lower():
            return False
    return True


def weight_decay_mask(params: Any) -> Any:
    return jax.tree_util.tree_map_with_path(decays, params)


def learning_rate_schedule(optim: OptimConfig, schedule: ScheduleConfig, total_steps: int) -> optax.Schedule:
    warmup = min(schedule.warmup_steps, max(total_steps, 1))
    end = optim.lr * schedule.min_lr_ratio
    if schedule.kind == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, optim.lr, warmup), optax.constant_schedule(optim.lr)],
                                    [warmup]) if warmup else optax.constant_schedule(optim.lr)
    return optax.warmup_cosine_decay_schedule(0.0, optim.lr, warmup, max(total_steps, warmup + 1), end)


def make_optimizer(optim: OptimConfig, schedule: ScheduleConfig, total_steps: int
                   ) -> tuple[optax.GradientTransformation, optax.Schedule]:
    lr = learning_rate_schedule(optim, schedule, total_steps)
    parts = [optax.clip_by_global_norm(optim.clip_norm)] if optim.clip_norm is not None else []
    parts.append(optax.adamw(lr, b1=optim.b1, b2=optim.b2, eps=optim.eps, weight_decay=optim.weight_decay,
                             mask=weight_decay_mask))
    return optax.chain(*parts), lr
