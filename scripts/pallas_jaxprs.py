"""The jaxprs of the Pallas forward and forward+backward as a Hopper GPU traces them, for comparing two trees.

    git worktree add /tmp/before REV
    (cd /tmp/before && PYTHONPATH=.:tests python /path/to/this/scripts/pallas_jaxprs.py /tmp/before.txt)
    python scripts/pallas_jaxprs.py /tmp/after.txt && cmp /tmp/before.txt /tmp/after.txt

Each case's jaxpr holds every kernel's body (Triton and Mosaic GPU), its grid, block specs and compiler settings, so
two trees that write the same file launch the same kernels on the GPU: a check, without a GPU, that a refactor
changed no kernel. Source locations are stripped (they move with the code). The GPU is faked (`common.hopper`; the
kernels are traced, never compiled), so the Mosaic GPU paths are taken as on an H200. Cases: KDA and GDN in bf16,
forward alone and forward+backward, a few short sequences (B H = 128: unsegmented, V tiles of 64) and one long one
(B H = 16: the passes in segments), KDA's recomputing backward and KDA in fp32 (the Triton passes).
"""

from __future__ import annotations

import argparse
import re
import sys

import jax
import jax.numpy as jnp

from lineattn.ops.pallas import chunk_fwd, common
from lineattn.ops.pallas.chunk import chunk_pallas

CASES = [  # name, B, T, H, dtype, head gate, backward, with the gradients
    ("kda bf16 fwd+bwd", 2, 200, 64, jnp.bfloat16, False, "kernels-saved", True),
    ("kda bf16 fwd+bwd recomputing", 2, 200, 64, jnp.bfloat16, False, "kernels-mml2", True),
    ("gdn bf16 fwd+bwd", 2, 200, 64, jnp.bfloat16, True, "kernels-saved", True),
    ("kda fp32 fwd+bwd", 1, 130, 2, jnp.float32, False, "kernels-saved", True),
    ("kda bf16 fwd", 2, 200, 64, jnp.bfloat16, False, "kernels-saved", False),
    ("gdn bf16 fwd", 2, 200, 64, jnp.bfloat16, True, "kernels-saved", False),
    ("kda bf16 fwd long", 1, 4096, 16, jnp.bfloat16, False, "kernels-saved", False),
    ("kda bf16 fwd+bwd long", 1, 4096, 16, jnp.bfloat16, False, "kernels-saved", True),
    ("gdn bf16 fwd+bwd long", 1, 4096, 16, jnp.bfloat16, True, "kernels-saved", True),
]


def case_jaxpr(B, T, H, dtype, head_gate, backward, grad, K=128, V=128) -> str:
    """The jaxpr text of `chunk_pallas` (with value_and_grad over all six inputs when grad), locations stripped."""
    S = jax.ShapeDtypeStruct
    g = S((B, T, H) if head_gate else (B, T, H, K), jnp.float32)
    args = (S((B, T, H, K), dtype), S((B, T, H, K), dtype), S((B, T, H, V), dtype), g, S((B, T, H), dtype),
            S((B, H, K, V), jnp.float32))

    def loss(*a):
        o, ht = chunk_pallas(*a, K**-0.5, 64, False, backward)
        return jnp.sum(o.astype(jnp.float32)) + jnp.sum(ht)

    fn = jax.value_and_grad(loss, argnums=tuple(range(6))) if grad else loss
    return re.sub(r"[\w./-]+\.py(:\d+)*", "<src>", str(jax.make_jaxpr(fn)(*args)))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the file to write")
    a = p.parse_args()
    common.hopper = lambda: True
    if hasattr(chunk_fwd, "hopper"):  # (trees before 2026-12-04 asked a copy imported into chunk_fwd)
        chunk_fwd.hopper = lambda: True
    parts = []
    for name, *case in CASES:
        text = case_jaxpr(*case)
        kernels = sorted(set(re.findall(r"name=(lineattn_\w+)", text)))
        print(f"{name}: {len(text)} characters, kernels {', '.join(kernels)}", file=sys.stderr, flush=True)
        parts.append(f"==== {name}\n{text}")
    with open(a.out, "w") as f:
        f.write("\n".join(parts))


if __name__ == "__main__":
    main()
