"""Times the decode step's kernels side by side on the H200 (B = 256, H = 16, K = V = 128, one token): the Triton
kernel, the Mosaic GPU kernel (`decode_mgpu`) at several V tiles and pieces, and the copy ceiling of the Triton
grid; kernel times from a profiler trace of 50 steps in one jit, `--rounds` rounds interleaved. Each kernel's
o and new state are first compared with the fp32 recurrence."""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_kda import kernel_times, make_inputs, rel_err  # noqa: E402
from bench_pallas_kda import copy_state  # noqa: E402

from lineattn import ops  # noqa: E402
from lineattn.ops.pallas.decode import decode_step  # noqa: E402
from lineattn.ops.pallas.decode_mgpu import decode_step_mosaic  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--configs", default="t64,c64,m64p32,m64p32n,m128p32,m64p64",
                   help="t<bv>[s<sub_v>][w<warps>]: Triton, c<bv>: copy, m<bv>p<piece>: Mosaic (n: not split)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=None)
    p.add_argument("--batch", type=int, default=256)
    a = p.parse_args()
    B, T, H, K, V, steps = a.batch, 1, 16, 128, 128, 50
    x, _ = make_inputs(B, T, H, K, V, "bfloat16", seed=3)
    bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
    q, k, v, beta, g = bf("q"), bf("k"), bf("v"), bf("beta"), jnp.asarray(x["g"])
    s0 = np.random.default_rng(4).standard_normal((B, H, K, V)).astype(np.float32) * 0.1
    ref_o, ref_s = ops.chunk_kda(q, k, v, g, beta, initial_state=jnp.asarray(s0), output_final_state=True,
                                 backend="recurrent")
    fns = {}
    for c in a.configs.split(","):
        if c[0] == "t":  # t<bv>[s<sub_v>][w<warps>]
            m = re.fullmatch(r"t(\d+)(?:s(\d+))?(?:w(\d+))?", c)
            fns[c] = lambda s, m=m: decode_step(q, k, v, g, beta, s, block_v=int(m[1]), sub_v=int(m[2] or m[1]),
                                                num_warps=int(m[3] or 4))
        elif c[0] == "c":
            fns[c] = lambda s, bv=int(c[1:]): (None, copy_state(s, bv, 4))
        else:
            bv, piece = map(int, c[1:].rstrip("n").split("p"))
            fns[c] = lambda s, bv=bv, piece=piece, split=not c.endswith("n"): decode_step_mosaic(
                q, k, v, g, beta, s, scale=K**-0.5, block_v=bv, piece=piece, split=split)
    state_bytes = B * H * K * V * 4
    results = {c: [] for c in fns}
    errors = {}
    loops = {}
    for c, f in fns.items():
        o, s1 = jax.jit(f)(jnp.asarray(s0))
        errs = "" if o is None else f"o {rel_err(o.astype(jnp.float32), ref_o):.2e} state {rel_err(s1, ref_s):.2e}"
        print(c, errs, flush=True)
        errors[c] = errs
        loops[c] = jax.jit(lambda s, f=f: jax.lax.fori_loop(0, steps, lambda i, s: f(s)[1], s), donate_argnums=0)
    for r in range(a.rounds):
        for c, many in loops.items():
            s = jax.block_until_ready(many(jnp.asarray(s0)))
            with tempfile.TemporaryDirectory() as tmp:
                with jax.profiler.trace(tmp):
                    s = jax.block_until_ready(many(s))
                times = kernel_times(tmp)
            name = [n for n in times if "decode" in n or "copy" in n] or list(times)
            ms = max(sum(times[n] for n in name), 1.0) / steps / 1e6
            results[c].append(ms)
            print(f"round {r} {c}: {ms * 1e3:.1f} us  {2 * state_bytes / (ms * 1e-3) / 1e12:.3f} TB/s  {name}",
                  flush=True)
    summary = {c: dict(kernel_ms=float(np.median(t)), TBps=2 * state_bytes / (float(np.median(t)) * 1e-3) / 1e12,
                       errors=errors[c])
               for c, t in results.items()}
    print(json.dumps(summary, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
