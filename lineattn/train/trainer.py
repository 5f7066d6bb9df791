"""The trainer: Flax NNX model, optax AdamW, a jitted (and sharded) train step with gradient accumulation,
orbax checkpoints with exact resume, JSONL metrics, a progress bar and the loss plot.

The train state is one pytree `{"params", "opt_state", "step", "rng"}`; the model's graph is split off once
(`nnx.split`) and merged back inside the jitted step, so the step is a pure function of (state, batch), and the
batch of step `s` is a pure function of (data seed, s). Resuming therefore replays the same computation: on CPU
the loss curve of a resumed run equals that of an uninterrupted one bit for bit.

Context parallelism (`mesh.context` > 1): the batch's sequence axis is split over the mesh axis `context`, and the
loss sums run under a `jax.shard_map` that is manual over every mesh axis (`model_sums`): each device gets its
rows' slice [B / (data fsdp), T / context] and the parameters whole (in_spec P(): with fsdp > 1, XLA gathers them
at the boundary and reduce-scatters their gradients on the way back), calls the model with
`context_axis="context"` (each layer exchanges what it needs: conv halos, linear-attention state pairs, attention
keys and values), and psums its masked loss / token-count / hit sums over all axes. Gradients are autodiff through
the shard_map; everything outside it (optimiser, FSDP state) stays automatic.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import yaml
from flax import nnx

from lineattn.train import sharding as shd
from lineattn.train.checkpoint import Checkpointer, CheckpointError
from lineattn.train.config import Config, ConfigError, config_diff, dump_yaml, to_dict
from lineattn.train.data import make_source
from lineattn.train.metrics import MetricsWriter, plot_losses
from lineattn.train.optim import make_optimizer

# Config keys that may change when a run is resumed (the rest must match the run directory's config.yaml).
RESUMABLE_CHANGES = ("train.steps", "train.checkpoint_every", "train.keep_checkpoints", "train.async_checkpoint",
                     "train.eval_every", "log.", "mesh.", "data.cache_dir", "data.eval_rows")

# Dense peak FLOP/s per device for MFU, by device kind and compute dtype (fp32 matmuls run as TF32 on GPUs).
PEAK_FLOPS = {"H200": {"bfloat16": 989e12, "float32": 494e12}, "H100": {"bfloat16": 989e12, "float32": 494e12},
              "A100": {"bfloat16": 312e12, "float32": 156e12}}


@dataclass
class ModelBundle:
    """What the trainer needs from a model: the module, its config (a dataclass, saved with the run) and the
    training FLOPs per token (forward + backward) for MFU, when known."""
    model: nnx.Module
    config: Any = None
    train_flops_per_token: float | None = None


ModelFactory = Callable[[Config], ModelBundle]


class DivergedError(FloatingPointError):
    """A step's loss or gradient norm is not finite (checked at every logged, evaluated or checkpointed step)."""


def default_model_factory(cfg: Config) -> ModelBundle:
    """`lineattn.models.HybridLM(ModelConfig(**cfg.model))`, initialised from `train.seed`."""
    from lineattn import models
    mcfg = cfg.model_config(models.ModelConfig)
    model = models.HybridLM(mcfg, rngs=nnx.Rngs(cfg.train.seed))
    flops = None
    if hasattr(models, "flops_per_token"):
        flops = float(models.flops_per_token(mcfg, cfg.data.seq_len))   # training FLOPs (3 x forward)
    return ModelBundle(model, mcfg, flops)


def peak_flops(cfg: Config, device: Any, compute_dtype: str = "float32") -> float | None:
    """Peak FLOP/s of one device: `log.peak_flops`, else the table above (None for unknown devices, e.g. CPUs)."""
    if cfg.log.peak_flops is not None:
        return cfg.log.peak_flops
    for name, table in PEAK_FLOPS.items():
        if name in getattr(device, "device_kind", ""):
            return table.get(compute_dtype, table["float32"])
    return None


def model_sums(graphdef: Any, rest: Any, mesh: Any = None) -> Callable[[Any, dict[str, jax.Array]], dict]:
    """`(params, batch) -> token_sums` of the model on a batch: the model on the whole arrays, or, when `mesh`
    has a `context` axis of size > 1, under a shard_map manual over every mesh axis (see the module doc)."""
    def sums(params, batch, context_axis=None):
        model = nnx.merge(graphdef, params, rest)
        kw = {} if context_axis is None else {"context_axis": context_axis}
        return token_sums(model(batch["tokens"], segment_ids=batch.get("segment_ids"), **kw), batch)

    if mesh is None or mesh.shape.get(shd.CONTEXT_AXIS, 1) == 1:
        return sums

    def local(params, batch):   # this device's slice; the sums over every device
        return jax.tree.map(lambda x: jax.lax.psum(x, tuple(mesh.axis_names)), sums(params, batch, shd.CONTEXT_AXIS))

    # check_vma=False: lineattn.ops.triangular's loop (inside context_parallel_attention) starts from an unvarying
    # carry, which the varying-axes check refuses.
    return jax.shard_map(local, mesh=mesh, in_specs=(shd.P(), shd.batch_spec(mesh)), out_specs=shd.P(),
                         check_vma=False)


@partial(jax.jit, static_argnums=0)
def eval_sums(graphdef: Any, params: Any, rest: Any, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Validation sums of one batch (one jitted function for the trainer and `lineattn eval`)."""
    model = nnx.merge(graphdef, params, rest)
    return token_sums(model(batch["tokens"], segment_ids=batch.get("segment_ids")), batch)


def pad_rows(batch: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """Pad a short (last) validation batch with all-zero rows, which score nothing (mask 0)."""
    n = batch["tokens"].shape[0]
    if n >= rows:
        return batch
    return {k: np.concatenate([v, np.zeros((rows - n, *v.shape[1:]), v.dtype)]) for k, v in batch.items()}


def token_sums(logits: jax.Array, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    """Masked sums over logits [B, T, vocab] and batch["targets"], batch["mask"] [B, T]: cross-entropy (nats),
    scored tokens, argmax hits (scalars)."""
    logits = logits.astype(jnp.float32)
    nll = optax.softmax_cross_entropy_with_integer_labels(logits, batch["targets"])
    m = batch["mask"].astype(jnp.float32)
    hit = (jnp.argmax(logits, axis=-1) == batch["targets"]).astype(jnp.float32)
    return {"nll": jnp.sum(nll * m), "count": jnp.sum(m), "correct": jnp.sum(hit * m)}


class Trainer:
    """Set up (or resume) a run in `run_dir`; `run()` trains to `cfg.train.steps`.

    `model_factory(cfg) -> ModelBundle` defaults to the hybrid LM; `source` defaults to `make_source(cfg.data)`.
    """

    def __init__(self, cfg: Config, run_dir: str | Path, *, model_factory: ModelFactory | None = None,
                 source: Any = None, resume_step: int | None = None, devices: list | None = None,
                 log_fn: Callable[[str], None] | None = None):
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        self.is_main = jax.process_index() == 0
        self.log_fn = log_fn or (lambda s: print(s, flush=True))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self._check_same_run()

        self.source = source if source is not None else make_source(cfg.data)
        self.bundle = (model_factory or default_model_factory)(cfg)
        vocab = _model_vocab(self.bundle)
        if vocab is not None and vocab < self.source.vocab_size:
            raise ConfigError(f"model.vocab_size: {vocab} is smaller than the data's vocabulary "
                              f"({self.source.vocab_size} for data.source={cfg.data.source})")
        if self.is_main:
            self._write_config()

        self.mesh = shd.make_mesh(cfg.mesh, devices)
        shd.check_batch(self.mesh, cfg.data.batch_size, cfg.train.grad_accum, cfg.data.seq_len)
        self.batch_sharding = shd.batch_sharding(self.mesh)
        self.graphdef, params, self.rest = nnx.split(self.bundle.model, nnx.Param, ...)
        self._sums = model_sums(self.graphdef, self.rest, self.mesh)
        self._eval_sums = jax.jit(self._sums)
        self.num_params = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(params))
        self.tx, self.lr_fn = make_optimizer(cfg.optim, cfg.schedule, cfg.train.steps)

        state = {"params": params, "opt_state": self.tx.init(params), "step": jnp.zeros((), jnp.int32),
                 "rng": jax.random.key_data(jax.random.key(cfg.train.seed))}
        self.state_sharding = shd.state_shardings(self.mesh, state)
        self.abstract_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                                           state, self.state_sharding)
        self.checkpointer = Checkpointer(self.run_dir / "checkpoints", keep=cfg.train.keep_checkpoints,
                                         async_save=cfg.train.async_checkpoint)
        self.state, self.start_step = self._restore_or_init(state, resume_step)
        self._train_step = self._make_train_step()

    # -- set-up ------------------------------------------------------------------------------------------------

    def _check_same_run(self) -> None:
        saved = self.run_dir / "config.yaml"
        if not saved.exists() or not (self.run_dir / "checkpoints").exists():
            return
        old = yaml.safe_load(saved.read_text()) or {}
        new = self.cfg.to_dict()
        if isinstance(old.get("model"), dict):   # the saved one is resolved (all ModelConfig fields)
            new = {**new, "model": {**old["model"], **new["model"]}}
        diff = [k for k in config_diff(old, new) if not any(k == p or k.startswith(p) for p in RESUMABLE_CHANGES)]
        if diff:
            raise ConfigError(f"{diff[0]}: differs from the config of the run in {self.run_dir} "
                              f"({', '.join(diff[:6])}{' ...' if len(diff) > 6 else ''}); resume with the same "
                              f"config or use a new --run-dir")

    def _write_config(self) -> None:
        resolved = self.cfg.to_dict()
        if self.bundle.config is not None and dataclasses.is_dataclass(self.bundle.config):
            resolved["model"] = to_dict(self.bundle.config)
        tmp = self.run_dir / "config.yaml.tmp"
        tmp.write_text(dump_yaml(resolved))
        tmp.replace(self.run_dir / "config.yaml")

    def _restore_or_init(self, state: Any, resume_step: int | None) -> tuple[Any, int]:
        steps = self.checkpointer.steps()
        if resume_step is not None:
            if resume_step not in steps:
                raise CheckpointError(f"--resume-step {resume_step}: no such checkpoint in "
                                      f"{self.checkpointer.directory} (have {steps})")
            step = resume_step
        elif steps:
            step = steps[-1]
        else:
            return jax.device_put(state, self.state_sharding), 0
        restored, meta = self.checkpointer.restore(step, self.abstract_state)
        if resume_step is not None:
            aside = self.checkpointer.set_aside_after(step)
            if aside:
                self.log_fn(f"set aside checkpoints {aside} (resuming from step {step})")
        self.log_fn(f"resumed from {self.checkpointer.directory / str(step)} (step {step}, data position "
                    f"{meta.get('data_position')})")
        return restored, int(step)

    # -- the steps -----------------------------------------------------------------------------------------------

    def _loss_sums(self, params: Any, batch: dict[str, jax.Array]) -> tuple[jax.Array, dict[str, jax.Array]]:
        sums = self._sums(params, batch)
        return sums["nll"], sums

    def _make_train_step(self):
        accum = self.cfg.train.grad_accum
        grad_fn = jax.value_and_grad(self._loss_sums, has_aux=True)
        micro_sharding = shd.NamedSharding(self.mesh, shd.P(None, *shd.batch_spec(self.mesh)))

        def train_step(state, batch):
            params = state["params"]
            if accum == 1:
                (_, sums), grads = grad_fn(params, batch)
            else:
                # Micro-batch i holds rows i, i + accum, ...: every micro-batch is split over all devices.
                micro = jax.tree.map(lambda x: jax.lax.with_sharding_constraint(
                    x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1), micro_sharding), batch)

                def body(carry, mb):
                    g_acc, s_acc = carry
                    (_, s), g = grad_fn(params, mb)
                    return (jax.tree.map(jnp.add, g_acc, g), jax.tree.map(jnp.add, s_acc, s)), None

                zeros = jax.tree.map(jnp.zeros_like, params)
                zsums = {k: jnp.zeros((), jnp.float32) for k in ("nll", "count", "correct")}
                (grads, sums), _ = jax.lax.scan(body, (zeros, zsums), micro)
            denom = jnp.maximum(sums["count"], 1.0)
            grads = jax.tree.map(lambda g: g / denom, grads)
            updates, opt_state = self.tx.update(grads, state["opt_state"], params)
            new_state = {"params": optax.apply_updates(params, updates), "opt_state": opt_state,
                         "step": state["step"] + 1,
                         "rng": jax.random.key_data(jax.random.split(jax.random.wrap_key_data(state["rng"]))[0])}
            metrics = {"loss": sums["nll"] / denom, "accuracy": sums["correct"] / denom,
                       "grad_norm": optax.global_norm(grads), "lr": self.lr_fn(state["step"]),
                       "scored_tokens": sums["count"]}
            return new_state, metrics

        return jax.jit(train_step, in_shardings=(self.state_sharding, self.batch_sharding),
                       out_shardings=(self.state_sharding, shd.replicated(self.mesh)), donate_argnums=0)

    def put(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """A host batch (tokens, targets, mask [B, T], ...) on the devices, split as the train step expects."""
        return shd.put_batch(batch, self.batch_sharding)

    # -- eval ----------------------------------------------------------------------------------------------------

    def evaluate(self, max_rows: int | None = None) -> dict[str, float]:
        """Validation loss (nats per scored token), plus bits per byte for text and accuracy for recall tasks."""
        totals = {"nll": 0.0, "count": 0.0, "correct": 0.0}
        for batch in self.source.eval_batches(max_rows):
            batch = self.put(pad_rows(batch, self.cfg.data.batch_size))   # one compiled shape
            sums = jax.device_get(self._eval_sums(self.state["params"], batch))
            for k in totals:
                totals[k] += float(sums[k])
        return _eval_record(totals, self.source.kind)

    # -- the loop ------------------------------------------------------------------------------------------------

    def save(self, step: int) -> None:
        """Checkpoint the train state after `step`, with the data position and the config."""
        meta = {"data_position": self.source.data_position(step), "config": self.cfg.to_dict(),
                "time": time.time()}
        self.checkpointer.save(step, self.state, meta)

    def _check_finite(self, step: int, m: dict[str, float], writer) -> None:
        """Stops the run (DivergedError) at a step whose loss or gradient norm is not finite: its parameters, and
        every later step's, would be NaN. The record still goes to metrics.jsonl."""
        if math.isfinite(m["loss"]) and math.isfinite(m["grad_norm"]):
            return
        if writer:
            writer.write({"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"]})
        self.checkpointer.wait()
        last = self.checkpointer.latest_step()
        raise DivergedError(f"step {step}: loss {m['loss']}, grad_norm {m['grad_norm']}: not finite, so the run "
                            f"stopped before saving this step's parameters (latest checkpoint: "
                            f"{'none' if last is None else f'step {last}'}); try a lower optim.lr or more "
                            "schedule.warmup_steps")

    def run(self, until: int | None = None) -> dict[str, Any]:
        """Train from the current step to `cfg.train.steps` (or stop after step `until`, as if interrupted).

        Returns the last logged record (with the final eval when the run reached `train.steps`)."""
        cfg = self.cfg
        total = cfg.train.steps
        stop = total if until is None else min(until, total)
        mode = cfg.log.progress
        if mode == "auto":
            mode = "bar" if sys.stderr.isatty() else "lines"
        if not self.is_main:
            mode = "none"
        writer = MetricsWriter(self.run_dir / "metrics.jsonl") if self.is_main else None
        tokens_per_step = cfg.data.batch_size * cfg.data.seq_len
        peak = peak_flops(cfg, self.mesh.devices.flat[0], getattr(self.bundle.config, "dtype", "float32"))
        peak = peak * self.mesh.devices.size if peak else None
        flops = self.bundle.train_flops_per_token
        if self.start_step == 0 and mode != "none":
            self.log_fn(f"{self.num_params / 1e6:.2f}M parameters, {self.mesh.devices.size} device(s) "
                        f"(mesh {dict(self.mesh.shape)}), {tokens_per_step} tokens per step, {total} steps")
        bar = None
        if mode == "bar":
            from tqdm.auto import tqdm
            bar = tqdm(total=total, initial=self.start_step, unit="step", dynamic_ncols=True)
        last: dict[str, Any] = {}
        step = self.start_step
        t_mark, steps_mark, paused = time.perf_counter(), step, 0.0
        compile_s = None
        try:
            while step < stop:
                batch = self.put(self.source.batch(step))
                self.state, metrics = self._train_step(self.state, batch)
                step += 1
                if compile_s is None:
                    jax.block_until_ready(metrics)
                    compile_s = time.perf_counter() - t_mark
                    t_mark, steps_mark = time.perf_counter(), step   # do not count compilation in tokens/s
                if bar is not None:
                    bar.update(1)
                is_log = step % cfg.log.every == 0 or step == stop
                is_eval = (cfg.train.eval_every and step % cfg.train.eval_every == 0) or step == total
                is_save = (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or step == stop
                if is_log or is_eval or is_save:
                    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
                    self._check_finite(step, m, writer)
                if is_log or is_eval:
                    now = time.perf_counter()
                    elapsed = now - t_mark - paused
                    record = {"step": step, "loss": m["loss"], "lr": m["lr"], "grad_norm": m["grad_norm"]}
                    if self.source.kind != "text":
                        record["accuracy"] = m["accuracy"]
                    if step > steps_mark and elapsed > 0:
                        record["tokens_per_s"] = (step - steps_mark) * tokens_per_step / elapsed
                        if flops and peak:
                            record["mfu"] = record["tokens_per_s"] * flops / peak
                    elif compile_s is not None and step == steps_mark:
                        record["compile_s"] = compile_s
                    t_mark, steps_mark, paused = now, step, 0.0
                    if is_eval:
                        t0 = time.perf_counter()
                        record.update(self.evaluate(None if step == total and self.source.kind == "text"
                                                    else cfg.data.eval_rows))
                        paused += time.perf_counter() - t0
                    if writer:
                        writer.write(record)
                    last = record
                    if bar is not None:
                        bar.set_postfix(loss=f"{m['loss']:.3f}", refresh=False)
                    elif mode == "lines":
                        self.log_fn(format_record(record, total))
                if is_save:
                    t0 = time.perf_counter()
                    self.save(step)
                    paused += time.perf_counter() - t0
        finally:
            if bar is not None:
                bar.close()
            self.checkpointer.wait()
            if writer:
                writer.close()
        if step >= total and self.is_main:
            if cfg.log.plot:
                plot_losses(self.run_dir / "metrics.jsonl", self.run_dir / "loss.png")
            if not last:   # nothing left to train: report the final eval anyway
                last = {"step": step, **self.evaluate(None if self.source.kind == "text" else cfg.data.eval_rows)}
        return last

    def close(self) -> None:
        """Wait for pending checkpoint writes and release the checkpointer."""
        self.checkpointer.close()


def evaluate_model(model: nnx.Module, source: Any, *, batch_size: int, max_rows: int | None = None
                   ) -> dict[str, float]:
    """Single-device evaluation of `model` on `source`'s validation set (the `lineattn eval` command)."""
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    totals = {"nll": 0.0, "count": 0.0, "correct": 0.0}
    for batch in source.eval_batches(max_rows):
        sums = jax.device_get(eval_sums(graphdef, params, rest, pad_rows(batch, batch_size)))
        for k in totals:
            totals[k] += float(sums[k])
    return _eval_record(totals, source.kind)


def _eval_record(totals: dict[str, float], kind: str) -> dict[str, Any]:
    denom = max(totals["count"], 1.0)
    out: dict[str, Any] = {"val_loss": totals["nll"] / denom}
    if kind == "text":
        out["val_bpb"] = out["val_loss"] / math.log(2)
    else:
        out["val_accuracy"] = totals["correct"] / denom
    out["val_tokens"] = int(totals["count"])
    return out


def _model_vocab(bundle: ModelBundle) -> int | None:
    return getattr(bundle.config, "vocab_size", None)


def format_record(r: dict[str, Any], total: int) -> str:
    """One metrics record as the trainer's progress line ("step 10/450 loss 2.3456 lr ...")."""
    parts = [f"step {r['step']:>{len(str(total))}}/{total}"]
    for key, fmt in (("loss", "loss {:.4f}"), ("accuracy", "acc {:.3f}"), ("lr", "lr {:.2e}"),
                     ("grad_norm", "gnorm {:.3f}"), ("tokens_per_s", "{:,.0f} tok/s"), ("mfu", "MFU {:.2%}"),
                     ("compile_s", "compiled in {:.1f}s"), ("val_loss", "val_loss {:.4f}"),
                     ("val_bpb", "val_bpb {:.4f}"), ("val_accuracy", "val_acc {:.3f}")):
        if isinstance(r.get(key), (int, float)):
            parts.append(fmt.format(r[key]))
    return "  ".join(parts)


def train(cfg: Config, run_dir: str | Path, *, until: int | None = None, **kwargs) -> dict[str, Any]:
    """Train (or resume) the run in `run_dir` to `cfg.train.steps` (or stop after step `until`); kwargs go to
    `Trainer` (model_factory, source, resume_step, devices, log_fn). Returns the last logged record."""
    trainer = Trainer(cfg, run_dir, **kwargs)
    try:
        return trainer.run(until)
    finally:
        trainer.close()


def load_run(run_dir: str | Path, *, step: int | None = None, overrides: tuple[str, ...] = (),
             model_factory: ModelFactory | None = None) -> tuple[Config, ModelBundle, dict[str, Any]]:
    """The model of a run directory with the parameters of its checkpoint `step` (default: the latest)."""
    from lineattn.train.config import load_config
    run_dir = Path(run_dir)
    cfg = load_config(run_dir / "config.yaml", overrides)
    bundle = (model_factory or default_model_factory)(cfg)
    graphdef, params, rest = nnx.split(bundle.model, nnx.Param, ...)
    tx, _ = make_optimizer(cfg.optim, cfg.schedule, cfg.train.steps)
    state = {"params": params, "opt_state": tx.init(params), "step": jnp.zeros((), jnp.int32),
             "rng": jax.random.key_data(jax.random.key(0))}
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    ck = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints, async_save=False)
    try:
        steps = ck.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint in {ck.directory}")
        step = steps[-1] if step is None else step
        restored, meta = ck.restore(step, abstract)
    finally:
        ck.close()
    bundle.model = nnx.merge(graphdef, restored["params"], rest)
    return cfg, bundle, meta


__all__ = ["ModelBundle", "Trainer", "default_model_factory", "evaluate_model", "format_record", "load_run", "model_sums",
           "token_sums", "train"]
