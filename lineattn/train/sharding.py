"""Device mesh and shardings: data parallel over `data`, FSDP (parameters and optimiser state split) over `fsdp`,
context parallelism (the sequence split) over `context`.

The batch dimension is split over data and fsdp. A parameter (and its Adam moments) is split over `fsdp` along its
largest dimension that `fsdp` divides, and replicated when there is none; XLA inserts the all-gathers and
reduce-scatters. With fsdp = 1 this is plain data parallelism. With context > 1 the sequence dimension of the batch
is split over `context` too (the trainer then runs the model under `jax.shard_map`, see `lineattn.train.trainer`);
`context` is the last mesh axis, so a sequence's slices sit on neighbouring devices.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from lineattn.train.config import ConfigError, MeshConfig

BATCH_AXES = ("data", "fsdp")
CONTEXT_AXIS = "context"
MESH_AXES = (*BATCH_AXES, CONTEXT_AXIS)


def make_mesh(cfg: MeshConfig, devices: list | None = None) -> Mesh:
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    inner = cfg.fsdp * cfg.context
    if n % inner:
        raise ConfigError(f"mesh.fsdp: fsdp * context = {cfg.fsdp} * {cfg.context} does not divide the {n} devices")
    data = n // inner if cfg.data == -1 else cfg.data
    if data * inner > n:
        raise ConfigError(f"mesh.data: data * fsdp * context = {data * inner} is more than the {n} devices")
    return Mesh(np.array(devices[: data * inner]).reshape(data, cfg.fsdp, cfg.context), MESH_AXES)


def param_spec(shape: tuple[int, ...], fsdp: int) -> P:
    if fsdp == 1 or not shape:
        return P()
    dims = [d for d in range(len(shape)) if shape[d] % fsdp == 0 and shape[d] >= fsdp]
    if not dims:
        return P()
    d = max(dims, key=lambda i: (shape[i], -i))
    spec = [None] * len(shape)
    spec[d] = "fsdp"
    return P(*spec)


def state_shardings(mesh: Mesh, tree: Any) -> Any:
    """A NamedSharding per leaf of `tree` (arrays or ShapeDtypeStructs), by the FSDP rule above."""
    fsdp = mesh.shape["fsdp"]
    return jax.tree.map(lambda x: NamedSharding(mesh, param_spec(tuple(x.shape), fsdp)), tree)


def batch_spec(mesh: Mesh) -> P:
    """Rows [B, T] split over the batch axes; with context parallelism, T over `context` too."""
    return P(BATCH_AXES, CONTEXT_AXIS) if mesh.shape[CONTEXT_AXIS] > 1 else P(BATCH_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, batch_spec(mesh))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def put_batch(batch: dict[str, np.ndarray], sharding: NamedSharding) -> dict[str, jax.Array]:
    """Host arrays (the same global batch on every process) -> global arrays split over the batch axes."""
    return {k: jax.make_array_from_callback(v.shape, sharding, lambda idx, v=v: v[idx]) for k, v in batch.items()}


def check_batch(mesh: Mesh, batch_size: int, grad_accum: int, seq_len: int | None = None) -> None:
    n = mesh.shape["data"] * mesh.shape["fsdp"]
    if batch_size % (n * grad_accum):
        raise ConfigError(f"data.batch_size: {batch_size} must be a multiple of data x fsdp devices x "
                          f"train.grad_accum = {n} x {grad_accum}")
    context = mesh.shape[CONTEXT_AXIS]
    if seq_len is not None and seq_len % context:
        raise ConfigError(f"data.seq_len: {seq_len} must be a multiple of mesh.context = {context}")
