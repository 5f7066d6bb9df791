"""Config loading: YAML/TOML onto frozen dataclasses, dotted overrides, errors that name the key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from lineattn.train.config import (Config, ConfigError, apply_overrides, config_diff, dump_yaml, from_dict,
                                   load_config, parse_override, read_file)

ROOT = Path(__file__).resolve().parents[1]
# The trainer's configs (configs/ablate_*.yaml belong to the ablation runner and have their own schema).
CONFIGS = [ROOT / "configs" / f"{name}.yaml" for name in ("tiny", "shakespeare", "mqar", "niah", "hybrid_125m")]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, Config)
    cfg.model_config()   # the model section builds a lineattn.models.ModelConfig


@pytest.mark.parametrize("name, params", [("shakespeare", 0.93e6), ("hybrid_125m", 118e6)])
def test_shipped_models_have_the_sizes_the_readme_gives(name, params):
    # the README's "0.93M parameters, 450 steps of 4,096 tokens" and "118M parameters" (counted on shapes only)
    from flax import nnx
    from lineattn.models import HybridLM, count_params
    cfg = load_config(ROOT / f"configs/{name}.yaml")
    model = nnx.eval_shape(lambda: HybridLM(cfg.model_config(), rngs=nnx.Rngs(0)))
    assert round(count_params(model) / params, 2) == 1.0
    if name == "shakespeare":
        assert cfg.data.batch_size * cfg.data.seq_len == 4096 and cfg.train.steps == 450


def test_tiny_overrides_and_types():
    cfg = load_config(ROOT / "configs/tiny.yaml", ["train.steps=7", "model.width=48", "optim.lr=1e-3",
                                                   "data.val_plays=[hamlet, lear]", "optim.clip_norm=null"])
    assert cfg.train.steps == 7 and cfg.model["width"] == 48
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)      # YAML 1.1 reads 1e-3 as a string
    assert cfg.data.val_plays == ("hamlet", "lear") and cfg.optim.clip_norm is None
    assert cfg.model_config().width == 48
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train.steps = 3


def test_toml_and_round_trip(tmp_path):
    (tmp_path / "c.toml").write_text('[train]\nsteps = 3\n[model]\nvocab_size = 264\nwidth = 32\nnum_layers = 1\n'
                                     'num_heads = 2\n')
    cfg = load_config(tmp_path / "c.toml")
    assert cfg.train.steps == 3
    (tmp_path / "c.yaml").write_text(dump_yaml(cfg))
    assert load_config(tmp_path / "c.yaml") == cfg


@pytest.mark.parametrize("overrides, key, words", [
    (["train.stepz=3"], "train.stepz", "unknown key"),
    (["bogus.x=1"], "bogus", "unknown key"),
    (["train.steps=ten"], "train.steps", "integer"),
    (["train.steps=2.5"], "train.steps", "integer"),
    (["train.steps=-1"], "train.steps", ">= 0"),
    (["data.seed=-1"], "data.seed", ">= 0"),
    (["train.seed=-1"], "train.seed", ">= 0"),
    (["optim.lr=0"], "optim.lr", "positive"),
    (["optim.lr=fast"], "optim.lr", "number"),
    (["log.progress=loud"], "log.progress", "one of"),
    (["train.async_checkpoint=1"], "train.async_checkpoint", "true or false"),
    (["data.val_plays=hamlet"], "data.val_plays", "list"),
    (["data.mqar.num_kv_pairs=0"], "data.mqar.num_kv_pairs", "at least 1"),
    (["data.batch_size=6", "train.grad_accum=4"], "train.grad_accum", "divide"),
    (["train.steps.x=1"], "train.steps", "not a section"),
    (["model.widht=64"], "model.widht", "unknown key"),
    (["model.width=wide"], "model.width", "integer"),
    (["model.layer_pattern=[kda, nonsense]"], "model", "layer_pattern"),
    (["mesh.context=4", "data.seq_len=8"], "data.seq_len", "2 per device"),
])
def test_errors_name_the_key(overrides, key, words):
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "configs/tiny.yaml", overrides)
    msg = str(e.value)
    assert msg.startswith(key) and words in msg, msg


def test_missing_file_and_bad_yaml(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    (tmp_path / "bad.yaml").write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(tmp_path / "list.yaml")


def test_duplicate_yaml_keys_name_the_key_and_line(tmp_path):
    tiny = (ROOT / "configs/tiny.yaml").read_text()
    path = tmp_path / "dup.yaml"
    path.write_text(tiny.replace("  width: 64\n", "  width: 64\n  width: 32\n", 1))
    line = tiny.splitlines().index("  width: 64") + 2
    with pytest.raises(ConfigError, match=f"duplicate key 'width' on line {line}"):
        load_config(path)
    path.write_text(tiny + "optim:\n  lr: 1.0\n")   # a second section, not merged into the first
    with pytest.raises(ConfigError, match="duplicate key 'optim'"):
        load_config(path)
    path.write_text("a: &a {x: 1, y: 2}\nb:\n  <<: *a\n  x: 3\n")   # a merge key's values may be overridden
    assert read_file(path)["b"] == {"x": 3, "y": 2}
    with pytest.raises(ConfigError, match="duplicate key 'x'"):
        parse_override("model.x={x: 1, x: 2}")


def test_override_parsing():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a=x=y") == ("a", "x=y")
    for bad in ("a.b", "=3", "a..b=1"):
        with pytest.raises(ConfigError, match="KEY=VALUE"):
            parse_override(bad)
    raw = {"train": {"steps": 1}}
    assert apply_overrides(raw, ["train.seed=4", "log.every=2"]) == {"train": {"steps": 1, "seed": 4},
                                                                      "log": {"every": 2}}
    assert raw == {"train": {"steps": 1}}   # not modified in place


@dataclasses.dataclass(frozen=True)
class Inner:
    xs: tuple[int, ...] = ()
    pair: tuple[str, float] = ("a", 1.0)


@dataclasses.dataclass(frozen=True)
class Outer:
    inner: Inner
    name: str | None = None


def test_generic_loader_nested_optional_tuple():
    out = from_dict(Outer, {"inner": {"xs": [1, 2], "pair": ["b", 2]}})
    assert out == Outer(Inner((1, 2), ("b", 2.0)))
    with pytest.raises(ConfigError, match=r"^inner\.xs\[1\]: expected an integer"):
        from_dict(Outer, {"inner": {"xs": [1, "z"]}})
    with pytest.raises(ConfigError, match=r"^inner: required key is missing"):
        from_dict(Outer, {})
    assert config_diff({"a": {"b": 1, "c": 2}}, {"a": {"b": 1, "c": 3}, "d": 0}) == ["a.c", "d"]


def test_cli_reports_config_errors(tmp_path):
    res = subprocess.run([sys.executable, "-m", "lineattn.train.cli", "train", "--config",
                          str(ROOT / "configs/tiny.yaml"), "--set", "train.stepz=1", "--run-dir", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 2
    assert "config error: train.stepz: unknown key" in res.stderr
