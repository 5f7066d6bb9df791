"""The XLA ops outside the Pallas kernels in the programs the H200 bench times, listed without a GPU.

    python scripts/xla_passes.py [--rules kda,gdn] [--shapes 8x4096,1x32768] [--min-mb 4]

XLA cannot fuse an op into a Pallas kernel, so every op of the jitted program that is not a kernel and touches a
large array is a pass through device memory of its own, which a profile of the kernels alone does not show (sessions
42-45: an XLA `where` over the fp32 gate, 268 MB read and written per call at (8, 4096)). This traces the bench's
forward and forward+backward (`ops.linear_attention(..., backend="pallas")`, as `bench_pallas_kda.py` calls it, bf16,
H = 16, K = V = 128) with a Hopper GPU faked (the kernels are traced, never compiled, so the Mosaic GPU paths are taken
as on an H200), and prints, in program order, each kernel and each other op whose largest operand or result exceeds
--min-mb. Reshapes and squeezes (layout only) and pads of width zero (XLA drops them) are marked "free".
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import ClosedJaxpr, Jaxpr, Literal

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from bench_kda import forward_backward  # noqa: E402

from lineattn import ops  # noqa: E402

KERNELS = ("pallas_call", "mpmd_map")  # (a Mosaic GPU `plgpu.kernel` traces to mpmd_map)
H, K, V = 16, 128, 128


def _bytes(var) -> int:
    aval = var.aval
    return int(np.prod(aval.shape)) * aval.dtype.itemsize if hasattr(aval, "shape") else 0


def free(eqn) -> bool:
    """Whether XLA runs the op without a pass of its own: a reshape or squeeze (a bitcast) or a pad of width 0."""
    if eqn.primitive.name in ("reshape", "squeeze", "expand_dims"):
        return True
    return eqn.primitive.name == "pad" and all(tuple(c) == (0, 0, 0) for c in eqn.params["padding_config"])


def sub_jaxprs(eqn) -> list:
    """The jaxprs in an equation's parameters (a call's body, a custom VJP's forward, a loop's body, ...)."""
    return [p.jaxpr if isinstance(p, ClosedJaxpr) else p for p in eqn.params.values()
            if isinstance(p, (ClosedJaxpr, Jaxpr))]


def program_ops(jaxpr) -> list[tuple[str, object, int]]:
    """("kernel" | "op", the equation, its largest operand or result in bytes) for every kernel and every other op of
    `jaxpr` in order, calls (pjit, custom_vjp_call, ...) opened, kernels not."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in KERNELS:
            found.append(("kernel", eqn, 0))
            continue
        subs = sub_jaxprs(eqn)
        if subs and eqn.primitive.name not in ("cond", "while", "scan"):
            for sub in subs:
                found += program_ops(sub)
            continue
        size = max([_bytes(v) for v in eqn.invars if not isinstance(v, Literal)] + [_bytes(v) for v in eqn.outvars])
        found.append(("op", eqn, size))
    return found


def passes(found, min_bytes: float) -> list[tuple[object, int]]:
    """(equation, bytes) for each op of `program_ops`' list, not a kernel and not `free`, over min_bytes."""
    return [(eqn, size) for kind, eqn, size in found if kind == "op" and size > min_bytes and not free(eqn)]


def bench_programs(rule: str, B: int, T: int):
    """{"fwd": jaxpr, "fwdbwd": jaxpr} of the bench's two calls for `rule` ("kda": a channel gate; "gdn": a head
    gate) at [B, T, 16, 128], traced as on an H200 (`common.on_gpu` and `hopper` faked for the trace only)."""
    from lineattn.ops.pallas import common

    S = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16
    g = S((B, T, H, K) if rule == "kda" else (B, T, H), jnp.float32)
    args = (S((B, T, H, K), bf16), S((B, T, H, K), bf16), S((B, T, H, V), bf16), g, S((B, T, H), bf16))
    forward = lambda *xs: ops.linear_attention(rule, *xs, backend="pallas")[0]
    saved = common.on_gpu, common.hopper
    common.on_gpu = common.hopper = lambda: True
    try:
        return {"fwd": jax.make_jaxpr(forward)(*args).jaxpr,
                "fwdbwd": jax.make_jaxpr(forward_backward(forward, jnp.zeros((B, T, H, V), bf16)))(*args).jaxpr}
    finally:
        common.on_gpu, common.hopper = saved


def describe(eqn) -> str:
    if eqn.primitive.name in KERNELS:
        name = eqn.params.get("name_and_src_info") or eqn.params.get("name") or ""
        return f"{eqn.primitive.name} {str(name).split(' ')[0]}".rstrip()
    shapes = ", ".join(f"{v.aval.dtype}{list(v.aval.shape)}" for v in eqn.outvars)
    return f"{eqn.primitive.name} -> {shapes}"


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rules", default="kda,gdn")
    p.add_argument("--shapes", default="8x4096,1x32768")
    p.add_argument("--min-mb", type=float, default=4.0)
    a = p.parse_args()
    for rule in a.rules.split(","):
        for shape in a.shapes.split(","):
            B, T = map(int, shape.split("x"))
            for mode, jaxpr in bench_programs(rule, B, T).items():
                found = program_ops(jaxpr)
                print(f"== {rule} {mode} {shape}: {sum(kind == 'kernel' for kind, _, _ in found)} kernels, "
                      f"{len(passes(found, a.min_mb * 1e6))} other ops over {a.min_mb:g} MB")
                for kind, eqn, size in found:
                    if kind == "kernel" or size > a.min_mb * 1e6:
                        mark = "" if kind == "kernel" else f"   {size / 1e6:.0f} MB" + (" (free)" * free(eqn))
                        print(f"  {describe(eqn)}{mark}")


if __name__ == "__main__":
    main()
