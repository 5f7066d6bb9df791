"""Run configs: YAML (or TOML) files mapped onto frozen dataclasses, with dotted command-line overrides.

The loader is generic: `from_dict(cls, mapping)` builds any (nested) frozen dataclass, checks every value against
the field's type annotation and raises `ConfigError` naming the dotted key for an unknown key, a missing required
key or a bad value. The `model` section stays a plain mapping in `Config` and is built into
`lineattn.models.ModelConfig` with the same loader when the model is made (`Config.model_config()`), so this file
does not depend on the model code.
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml


class ConfigError(ValueError):
    """A config problem; the message starts with the dotted key it is about."""


def _join(prefix: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{prefix}[{key}]"
    return f"{prefix}.{key}" if prefix else str(key)


def check(condition: bool, key: str, message: str) -> None:
    """For `__post_init__`: raise a ConfigError about `key` (relative to the dataclass) unless `condition`."""
    if not condition:
        raise ConfigError(f"{key}: {message}")


# ---------------------------------------------------------------------------------------------------------------
# Generic loader
# ---------------------------------------------------------------------------------------------------------------

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _coerce(tp: Any, value: Any, key: str) -> Any:
    """Check `value` against annotation `tp` and convert it (lists -> tuples, ints -> floats, mappings -> dataclasses)."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return from_dict(tp, value, key)
    if origin is Literal:
        if not any(type(value) is type(a) and value == a for a in args):
            raise ConfigError(f"{key}: expected one of {list(args)}, got {value!r}")
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None:
            if type(None) in args:
                return None
            raise ConfigError(f"{key}: must not be null")
        errors = []
        for arm in args:
            if arm is type(None):
                continue
            try:
                return _coerce(arm, value, key)
            except ConfigError as e:
                errors.append(str(e).removeprefix(f"{key}: "))
        raise ConfigError(f"{key}: {value!r} fits none of {_type_name(tp)} ({'; '.join(errors)})")
    if value is None:
        raise ConfigError(f"{key}: must not be null (expected {_type_name(tp)})")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if tp is int:
        if isinstance(value, str):  # YAML 1.1 reads 1e6 as a string
            try:
                value = float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected an integer, got {value!r}") from None
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            value = int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 as a string
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{key}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if origin is tuple or tp is tuple:
        if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        if not args:
            return tuple(value)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, _join(key, i)) for i, v in enumerate(value))
        if len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} items, got {len(value)}")
        return tuple(_coerce(a, v, _join(key, i)) for i, (a, v) in enumerate(zip(args, value)))
    if origin in (dict, Mapping) or tp in (dict, Mapping):
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        vt = args[1] if args else Any
        return {str(k): _coerce(vt, v, _join(key, str(k))) for k, v in value.items()}
    if isinstance(tp, type):
        if not isinstance(value, tp):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported annotation {tp!r}")


def from_dict(cls: type, data: Any, prefix: str = "") -> Any:
    """Build dataclass `cls` from a mapping; errors name the dotted key (prefixed with `prefix`)."""
    if isinstance(data, cls):
        return data
    where = prefix or "config"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping of {cls.__name__} fields, got {data!r}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ConfigError(f"{_join(prefix, str(unknown[0]))}: unknown key (valid keys in {where}: "
                          f"{', '.join(sorted(fields))})")
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{_join(prefix, missing[0])}: required key is missing")
    kwargs = {name: _coerce(hints[name], value, _join(prefix, name)) for name, value in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise ConfigError(_join(prefix, str(e)) if prefix else str(e)) from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {e}") from None


def to_dict(obj: Any) -> Any:
    """Dataclasses -> plain dicts, tuples -> lists (YAML-safe)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {str(k): to_dict(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_dict(v) for v in obj]
    return obj


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that raises on a key repeated in one mapping (PyYAML silently keeps the last one)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            first_line = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` then a key overriding it is fine
                    continue
                key, line = self.construct_object(key_node, deep=True), key_node.start_mark.line + 1
                try:
                    if key in first_line:
                        raise yaml.constructor.ConstructorError(
                            problem=f"duplicate key {key!r} on line {line} (first on line {first_line[key]})",
                            problem_mark=key_node.start_mark)
                    first_line[key] = line
                except TypeError:  # an unhashable key: the base class raises its own error
                    continue
        return super().construct_mapping(node, deep)


def parse_override(text: str) -> tuple[str, Any]:
    """`"model.width=512"` -> `("model.width", 512)`; the value is read as YAML (`[a, b]`, `true`, `null`, ...)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {text!r}: expected KEY=VALUE with a dotted key, e.g. model.width=512")
    try:
        value = yaml.load(raw, Loader=_UniqueKeyLoader) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"{key}: cannot read override value {raw!r}: {e}") from None
    return key, value


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Apply `key.sub=value` overrides to a raw (not yet validated) config mapping; returns a new mapping."""
    out = _deep_copy(raw)
    for text in overrides:
        key, value = parse_override(text)
        parts = key.split(".")
        node = out
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"{'.'.join(parts[:i + 1])}: is a value, not a section (override {text!r})")
            node = child
        node[parts[-1]] = value
    return out


def _deep_copy(x: Any) -> Any:
    if isinstance(x, Mapping):
        return {k: _deep_copy(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_deep_copy(v) for v in x]
    return x


def read_file(path: str | Path) -> dict[str, Any]:
    """Read a YAML (.yaml/.yml) or TOML (.toml) file into a mapping; a key repeated in one mapping is an error."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    text = path.read_text()
    try:
        data = tomllib.loads(text) if path.suffix == ".toml" else yaml.load(text, Loader=_UniqueKeyLoader)
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"config file {str(path)!r} is not valid {'TOML' if path.suffix == '.toml' else 'YAML'}: "
                          f"{e}") from None
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ConfigError(f"config file {str(path)!r}: expected a mapping at the top level")
    return dict(data)


# ---------------------------------------------------------------------------------------------------------------
# The run config
# ---------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class MQARConfig:
    """Multi-query associative recall (Zoology's generator)."""
    vocab_size: int = 256        # keys from [1, vocab/2), values from [vocab/2, vocab)
    num_kv_pairs: int = 8
    power_a: float = 0.01        # query gaps ~ a * x^(a-1)
    random_non_queries: bool = True

    def __post_init__(self):
        check(self.vocab_size >= 8, "vocab_size", "must be at least 8")
        check(self.num_kv_pairs >= 1, "num_kv_pairs", "must be at least 1")
        check(self.num_kv_pairs < self.vocab_size // 2, "num_kv_pairs", "must be below vocab_size / 2")
        check(0 < self.power_a <= 1, "power_a", "must be in (0, 1]")


@dataclass(frozen=True)
class NIAHConfig:
    """Needle in a haystack: one `marker key value` needle (plus distractors) in random filler, queried at the end."""
    vocab_size: int = 256
    num_distractors: int = 0     # other needles with different keys

    def __post_init__(self):
        check(self.vocab_size >= 16, "vocab_size", "must be at least 16")
        check(self.num_distractors >= 0, "num_distractors", "must be >= 0")


@dataclass(frozen=True)
class DataConfig:
    source: Literal["shakespeare", "mqar", "niah"] = "shakespeare"
    seq_len: int = 256           # tokens per row the model sees
    batch_size: int = 16         # rows per optimiser step (global, over all devices and micro-batches)
    seed: int = 0
    cache_dir: str = "data"      # corpus cache (gitignored); LINEATTN_DATA overrides it
    val_plays: tuple[str, ...] = ("macbeth", "tempest")   # whole plays held out from training (shakespeare)
    eval_rows: int = 64          # validation rows for the periodic eval (the final eval uses all; synthetic: this many)
    mqar: MQARConfig = field(default_factory=MQARConfig)
    niah: NIAHConfig = field(default_factory=NIAHConfig)

    def __post_init__(self):
        check(self.seq_len >= 2, "seq_len", "must be at least 2")
        check(self.seed >= 0, "seed", "must be >= 0")
        check(self.batch_size >= 1, "batch_size", "must be at least 1")
        check(self.eval_rows >= 1, "eval_rows", "must be at least 1")
        if self.source == "mqar":
            check(self.mqar.num_kv_pairs * 4 <= self.seq_len, "mqar.num_kv_pairs",
                  f"4 * num_kv_pairs must be <= seq_len ({self.seq_len})")


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping; weight decay skips norms, biases, A_log, dt_bias and 1-d parameters."""
    lr: float = 3e-3
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float | None = 1.0

    def __post_init__(self):
        check(self.lr > 0, "lr", "must be positive")
        check(0 <= self.b1 < 1, "b1", "must be in [0, 1)")
        check(0 <= self.b2 < 1, "b2", "must be in [0, 1)")
        check(self.eps > 0, "eps", "must be positive")
        check(self.weight_decay >= 0, "weight_decay", "must be >= 0")
        check(self.clip_norm is None or self.clip_norm > 0, "clip_norm", "must be positive or null")


@dataclass(frozen=True)
class ScheduleConfig:
    """Linear warm-up from 0, then cosine to `min_lr_ratio * lr` at `train.steps` (or constant at lr)."""
    kind: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = 100
    min_lr_ratio: float = 0.1

    def __post_init__(self):
        check(self.warmup_steps >= 0, "warmup_steps", "must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, "min_lr_ratio", "must be in [0, 1]")


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1000                     # optimiser steps
    seed: int = 0                         # parameter init and the trainer's RNG
    grad_accum: int = 1                   # micro-batches per optimiser step
    checkpoint_every: int = 200           # 0: only the final checkpoint
    keep_checkpoints: int = 3
    async_checkpoint: bool = True
    eval_every: int = 0                   # 0: only the final eval

    def __post_init__(self):
        check(self.steps >= 0, "steps", "must be >= 0")
        check(self.seed >= 0, "seed", "must be >= 0")
        check(self.grad_accum >= 1, "grad_accum", "must be >= 1")
        check(self.checkpoint_every >= 0, "checkpoint_every", "must be >= 0")
        check(self.keep_checkpoints >= 1, "keep_checkpoints", "must be >= 1")
        check(self.eval_every >= 0, "eval_every", "must be >= 0")


@dataclass(frozen=True)
class LogConfig:
    every: int = 10                       # steps between metrics.jsonl lines
    progress: Literal["auto", "bar", "lines", "none"] = "auto"   # auto: tqdm bar on a TTY, else a line per log
    plot: bool = True                     # loss.png at the end
    peak_flops: float | None = None       # per device, for MFU; null: known accelerators only

    def __post_init__(self):
        check(self.every >= 1, "every", "must be >= 1")
        check(self.peak_flops is None or self.peak_flops > 0, "peak_flops", "must be positive or null")


@dataclass(frozen=True)
class MeshConfig:
    """A `jax.sharding.Mesh` with axes (data, fsdp, context): the batch is split over data and fsdp, parameters
    over `fsdp`, and the sequence over `context` (context parallelism: each device holds seq_len / context tokens)."""
    data: int = -1                        # -1: every device not used by fsdp and context
    fsdp: int = 1
    context: int = 1                      # devices sharing one sequence (data.seq_len must be a multiple)
    distributed: bool = False             # call jax.distributed.initialize() first (multi-host)

    def __post_init__(self):
        check(self.data == -1 or self.data >= 1, "data", "must be -1 or >= 1")
        check(self.fsdp >= 1, "fsdp", "must be >= 1")
        check(self.context >= 1, "context", "must be >= 1")


@dataclass(frozen=True)
class Config:
    """A run's whole config: one section per dataclass below (`model` stays a mapping, checked against
    `lineattn.models.ModelConfig` by `load_config`)."""
    model: dict[str, Any] = field(default_factory=dict)   # lineattn.models.ModelConfig fields
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)

    def __post_init__(self):
        check(self.data.batch_size % self.train.grad_accum == 0, "train.grad_accum",
              f"must divide data.batch_size ({self.data.batch_size})")
        check(self.data.seq_len % self.mesh.context == 0, "mesh.context",
              f"must divide data.seq_len ({self.data.seq_len})")

    def model_config(self, model_config_cls: type | None = None) -> Any:
        """The `model` section as `lineattn.models.ModelConfig` (or `model_config_cls`), checked key by key."""
        if model_config_cls is None:
            from lineattn.models import ModelConfig as model_config_cls
        return from_dict(model_config_cls, self.model, "model")

    def to_dict(self) -> dict[str, Any]:
        return to_dict(self)


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                base: Mapping[str, Any] | None = None, check_model: bool = True) -> Config:
    """Read `path` (or start from `base`), apply overrides, build `Config`.

    With `check_model`, the model section is also checked against `lineattn.models.ModelConfig` when that exists.
    """
    raw = dict(base or {})
    if path is not None:
        raw = read_file(path)
    raw = apply_overrides(raw, overrides)
    cfg = from_dict(Config, raw)
    if check_model:
        try:
            from lineattn.models import ModelConfig
        except ImportError:
            ModelConfig = None
        if ModelConfig is not None:
            model = cfg.model_config(ModelConfig)
            # each device's slice feeds the short conv's halo of the previous W - 1 inputs
            per_device = cfg.data.seq_len // cfg.mesh.context
            if cfg.mesh.context > 1 and per_device < model.conv_size - 1:
                raise ConfigError(f"data.seq_len: {cfg.data.seq_len} tokens over mesh.context = {cfg.mesh.context} "
                                  f"devices leaves {per_device} per device; the short conv needs at least "
                                  f"model.conv_size - 1 = {model.conv_size - 1}")
    return cfg


def dump_yaml(obj: Any) -> str:
    return yaml.safe_dump(to_dict(obj), sort_keys=False, default_flow_style=None)


def config_diff(a: Mapping[str, Any], b: Mapping[str, Any], prefix: str = "") -> list[str]:
    """Dotted keys whose values differ between two plain config mappings."""
    keys = []
    for k in sorted(set(a) | set(b)):
        key = _join(prefix, k)
        va, vb = a.get(k, None), b.get(k, None)
        if isinstance(va, Mapping) and isinstance(vb, Mapping):
            keys += config_diff(va, vb, key)
        elif va != vb:
            keys.append(key)
    return keys
