"""Every stage of lineattn's Pallas KDA forward and backward timed apart, for the current kernels and variants.

    python benchmarks/bench_pallas_parts.py --out $OUT        # on the H200 (see benchmarks/h200_issue2.sh)

Shape (default B = 8, T = 4096, H = 16, K = V = 128): bf16 q, k (L2-normalised), v, beta; fp32 g in (-5, 0).
First each forward variant's o and each backward variant's six gradients are compared with the XLA chunk form
in fp32 on the same rounded inputs (relative RMS error; a variant over the bf16 budget is marked). Then, each
a jitted call timed as the median of --iters calls ended by block_until_ready:
  forward:  XLA cumsum of the gate; the Gram kernel (M, A, Qin, Kg) per diagonal-block method and warps; the
            solve kernel (W, U); the whole intra stage; the whole forward (the state pass = forward - intra);
  backward: the Gram recompute in fp32, the two state passes (states, reverse), the Gram-gradient kernels per
            method, the whole backward (`backward_kernels`; the XLA algebra = the rest), and forward+backward.
Writes <out>/<date>-h200-pallas-parts.json (a list of {"stage", "variant", "ms", ...}), rewritten after each.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from bench_kda import make_inputs, time_jax, versions  # noqa: E402

from lineattn.ops import chunk as xla_chunk_mod  # noqa: E402
from lineattn.ops.chunk import ChunkTerms  # noqa: E402
from lineattn.ops.pallas import chunk_bwd, chunk_fwd  # noqa: E402
from lineattn.ops.pallas.chunk import chunk_pallas  # noqa: E402
from lineattn.ops.pallas.common import interpret_mode  # noqa: E402

IT = interpret_mode(None)  # compiled on a GPU, interpreted (slow; a smoke test) on CPU

f32 = jnp.float32
RECORDS: list[dict] = []
BUDGET = {"o": 5e-3, "ht": 5e-3, "dq": 8e-3, "dk": 8e-3, "dv": 8e-3, "dh0": 8e-3, "dg": 2e-2, "dbeta": 2e-2}


def rel_rms(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sqrt(np.mean((a - b) ** 2)) / max(np.sqrt(np.mean(b**2)), 1e-30))


def record(a, **rec):  # noqa: D103
    rec = dict(rec, B=a.B, T=a.T, H=a.H, K=a.K, V=a.K, device=str(jax.devices()[0].device_kind))
    RECORDS.append(rec)
    extra = {k: v for k, v in rec.items() if k not in ("stage", "variant", "ms", "B", "T", "H", "K", "V", "device")}
    ms = f"{rec['ms']:8.3f} ms" if rec.get("ms") is not None else " " * 11
    print(f"  {rec['stage']:18s} {rec['variant']:34s} {ms}  {extra if extra else ''}", flush=True)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        path = a.out / f"{datetime.date.today().isoformat()}-h200-pallas-parts.json"
        path.write_text(json.dumps({"versions": versions(), "records": RECORDS}, indent=1))


def timed(a, stage, variant, fn, args, jit=True, **extra):
    try:
        ms = time_jax(jax.jit(fn) if jit else fn, args, a.iters)
    except Exception as exc:  # a variant that does not compile is reported, not fatal
        print(f"  {stage} {variant}: failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
        return None
    record(a, stage=stage, variant=variant, ms=ms, **extra)
    return ms


def headline(a, op, args, do, pairs, check):
    """Forward and forward+backward of each intra/backward pair through `chunk_pallas` (op "gdn": a head gate,
    broadcast over K as `backend="pallas"` does), each checked against the XLA chunk form before it is timed;
    jax-linear-attention's Mosaic GPU kernels beside them."""
    C, scale = 64, a.K**-0.5
    B, T, H, K = a.B, a.T, a.H, a.K
    g_full = args[3] if op == "kda" else jnp.broadcast_to(args[3][..., None], (B, T, H, K))
    kargs = (*args[:3], g_full, *args[4:])
    dof = do.astype(f32)
    names = ("dq", "dk", "dv", "dg", "dbeta")
    ref = None
    if check:
        def xla_loss(*xs):
            o, _ = xla_chunk_mod.chunk(*xs[:5], scale=scale, initial_state=xs[5], chunk_size=C)
            return jnp.sum(o * dof), o

        (_, o_ref), g_ref = jax.jit(jax.value_and_grad(xla_loss, argnums=tuple(range(5)), has_aux=True))(
            *[y.astype(f32) for y in kargs])
        ref = (np.asarray(o_ref), [np.asarray(x) for x in g_ref])
        del o_ref, g_ref
    for intra, bwd in pairs:
        fwd = jax.jit(lambda *xs, intra=intra, bwd=bwd: chunk_pallas(*xs, scale, C, None, bwd, intra)[0])

        def loss(*xs, intra=intra, bwd=bwd):
            return jnp.sum(chunk_pallas(*xs, scale, C, None, bwd, intra)[0].astype(f32) * dof)

        grad = jax.jit(jax.grad(loss, argnums=tuple(range(5))))
        errs = {}
        try:
            if ref is not None:
                errs["rel_rms_o"] = rel_rms(fwd(*kargs).astype(f32), ref[0])
                grads = grad(*kargs)
                errs.update({f"rel_rms_{n}": rel_rms(gr.astype(f32), gw) for n, gr, gw in zip(names, grads, ref[1])})
                errs["finite"] = all(bool(jnp.all(jnp.isfinite(gr.astype(f32)))) for gr in grads)
                errs["ok"] = errs["finite"] and all(errs[f"rel_rms_{n}"] <= BUDGET[n] for n in ("o",) + names)
        except Exception as exc:
            print(f"  {op} {intra}/{bwd}: failed: {type(exc).__name__}: {str(exc)[:400]}", flush=True)
            continue
        timed(a, f"{op}-fwd", f"{intra}", fwd, kargs, jit=False)
        timed(a, f"{op}-fwdbwd", f"{intra}/{bwd}", grad, kargs, jit=False, **errs)
    if a.jla:
        try:
            import jla.ops as jla_ops
            kind = "kda" if op == "kda" else "gated_deltanet"
            f = lambda q, k, v, g, b: jla_ops.linear_attention(kind, q, k, v, g=g, beta=b, impl="mosaic_gpu")[0]
            loss = lambda *xs: jnp.sum(f(*xs).astype(f32) * dof)
            extra = {}
            if ref is not None:
                extra["rel_rms_o"] = rel_rms(jax.jit(f)(*args[:5]).astype(f32), ref[0])
            timed(a, f"{op}-fwd", "jla-mosaic_gpu", f, args[:5], **extra)
            timed(a, f"{op}-fwdbwd", "jla-mosaic_gpu", jax.grad(loss, argnums=tuple(range(5))), args[:5])
        except Exception as err:  # not installed, or no Hopper GPU
            print(f"jla unavailable: {type(err).__name__}: {str(err)[:200]}")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--shape", default="8x4096")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--pairs", default="split/kernels,mml2/kernels-mml2,mml2/kernels-saved",
                   help="intra/backward pairs: forward and forward+backward, checked, then timed")
    p.add_argument("--gdn-pairs", default="mml2/kernels-saved",
                   help="the same for GDN, after the stages ('' for none)")
    p.add_argument("--grams", default="loop:2,mm:2,mml:2", help="forward Gram kernels diag:warps")
    p.add_argument("--solves", default="old:4,full:4,full:8", help="solve kernels: old (16x16 blocks) / full")
    p.add_argument("--bwd-grams", default="mm:4,mml:2,mml:4", help="Gram-gradient kernels diag:warps")
    p.add_argument("--intras", default="split:2,mml2:2",
                   help="forward variants timed as intra stage alone and whole forward (intra:warps)")
    p.add_argument("--block-vs", default="32,128", help="state-pass V tiles besides the default (64 here)")
    p.add_argument("--loops", default="4,16", help="chunks per program of the cumsum and solve kernels to time ('' none)")
    p.add_argument("--stages", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--jla", action="store_true", help="also time jax-linear-attention's Mosaic GPU kernels")
    p.add_argument("--no-check", action="store_true")
    a = p.parse_args()
    a.B, a.T = map(int, a.shape.split("x"))
    a.H, a.K = a.heads, a.dim
    B, T, H, K = a.B, a.T, a.H, a.K
    C, scale = 64, K**-0.5
    N = T // C
    print(f"{jax.devices()[0].device_kind}; {versions()}; B={B} T={T} H={H} K=V={K}", flush=True)

    x, _ = make_inputs(B, T, H, K, K, "bfloat16")
    bf = lambda n: jnp.asarray(x[n], jnp.bfloat16)
    q, k, v, beta = bf("q"), bf("k"), bf("v"), bf("beta")
    g = jnp.asarray(x["g"])
    h0 = jnp.zeros((B, H, K, K), f32)
    do = jnp.asarray(x["do"], jnp.bfloat16)
    args = (q, k, v, g, beta, h0)
    pairs = lambda spec: [tuple(s.split("/")) for s in spec.split(",") if s]

    headline(a, "kda", args, do, pairs(a.pairs), not a.no_check)
    if a.stages:
        stages(a, args, do, pairs)
    if a.gdn_pairs:
        headline(a, "gdn", (q, k, v, g[..., 0], beta, h0), do, pairs(a.gdn_pairs), not a.no_check)


def stages(a, args, do, pairs):
    """Every stage of the forward and the backward timed apart (`main`'s inputs)."""
    B, T, H, K = a.B, a.T, a.H, a.K
    C, scale = 64, K**-0.5
    N = T // C
    q, k, v, g, beta, h0 = args

    # ---- several chunks per program for the cumsum and solve kernels (chunk_fwd.LOOP; not yet GPU-tested) ----
    G0, _ = jax.jit(functools.partial(chunk_fwd.gate_cumsum, C=C, interpret=IT))(g)
    A0 = jax.jit(functools.partial(chunk_fwd.gram_rows, C=C, scale=scale, store=jnp.bfloat16, prec="tf32",
                                   delta=True, diag="mm", warps=2, interpret=IT))(q, k, G0, beta)[1]
    for loop in (int(x) for x in a.loops.split(",") if x):
        timed(a, "fwd-cumsum", f"kernel loop={loop}", functools.partial(
            chunk_fwd.gate_cumsum, C=C, interpret=IT, loop=loop), (g,))
        timed(a, "fwd-solve", f"full-w4 loop={loop}", functools.partial(
            chunk_fwd.solve_full, C=C, store=jnp.bfloat16, prec="tf32", inv_prec="bf16x3", warps=4, interpret=IT,
            loop=loop), (A0, k, v, G0, beta))
        timed(a, "fwd", f"mml2 loop={loop}", functools.partial(chunk_fwd.forward, scale=scale, intra="mml2",
                                                               loop=loop), args)
        saved_loop = chunk_fwd.LOOP
        chunk_fwd.LOOP = loop
        try:
            def loss(*xs):
                return jnp.sum(chunk_pallas(*xs, scale, C, None, "kernels-saved", "mml2")[0].astype(f32)
                               * do.astype(f32))

            timed(a, "fwdbwd", f"mml2/kernels-saved loop={loop}", jax.grad(loss, argnums=tuple(range(5))), args)
        finally:
            chunk_fwd.LOOP = saved_loop

    # ---- forward stages ----
    cumsum = lambda g: jnp.cumsum(g.reshape(B, N, C, H, K), axis=2).reshape(B, T, H, K)
    timed(a, "fwd-cumsum", "xla", lambda g: (cumsum(g), jnp.exp(cumsum(g)[:, C - 1::C])), (g,))
    timed(a, "fwd-cumsum", "kernel", functools.partial(chunk_fwd.gate_cumsum, C=C, interpret=IT), (g,))
    G = jax.jit(cumsum)(g)
    for spec in a.grams.split(","):
        diag, w = spec.split(":")
        timed(a, "fwd-gram", f"{diag}-w{w}", functools.partial(
            chunk_fwd.gram_rows, C=C, scale=scale, store=jnp.bfloat16, prec="tf32", delta=True, diag=diag,
            warps=int(w), interpret=IT), (q, k, G, beta))
    A = jax.jit(functools.partial(chunk_fwd.gram_rows, C=C, scale=scale, store=jnp.bfloat16, prec="tf32",
                                  delta=True, diag="mm", warps=2, interpret=IT))(q, k, G, beta)[1]
    for spec in a.solves.split(","):
        kind, w = spec.split(":")
        if kind == "old":
            fn = functools.partial(chunk_fwd.solve_wu, C=C, store=jnp.bfloat16, prec="tf32", warps=int(w),
                                   interpret=IT)
        else:
            fn = functools.partial(chunk_fwd.solve_full, C=C, store=jnp.bfloat16, prec="tf32", inv_prec="bf16x3",
                                   warps=int(w), interpret=IT)
        timed(a, "fwd-solve", f"{kind}-w{w}", fn, (A, k, v, G, beta))
    for intra, w in [i.split(":") for i in a.intras.split(",") if i]:
        w = (int(w), 4)
        intra_ms = timed(a, "fwd-intra", f"{intra}-w{w[0]}", functools.partial(
            chunk_fwd.forward, scale=scale, intra=intra, only_intra=True, warps=w), args)
        fwd_ms = timed(a, "fwd", f"{intra}-w{w[0]}x{w[1]}", functools.partial(chunk_fwd.forward, scale=scale,
                                                                              intra=intra, warps=w), args)
        if intra_ms and fwd_ms:
            record(a, stage="fwd-state-pass", variant=f"{intra}-w{w[0]}x{w[1]} (fwd - intra)", ms=fwd_ms - intra_ms)
    for bv in (int(b) for b in a.block_vs.split(",") if b):  # the state pass's V tile (forward - intra as above)
        timed(a, "fwd", f"mml2 block_v={bv}", functools.partial(chunk_fwd.forward, scale=scale, intra="mml2",
                                                                block_v=bv), args)

    # ---- backward stages (fp32 operands where `backward_kernels` / `backward_fast` use them) ----
    qf, kf = q.astype(f32), k.astype(f32)
    timed(a, "bwd-gram-recompute", "loop-w4 (kernels)", functools.partial(
        chunk_fwd.gram_rows, C=C, scale=scale, store=f32, prec="tf32", delta=True, diag="loop", warps=4,
        interpret=IT), (qf, kf, G, jnp.ones((B, T, H), f32)))
    timed(a, "bwd-gram-recompute", "mml-w2 (kernels-mml2)", functools.partial(
        chunk_fwd.gram_rows, C=C, scale=scale, store=f32, prec="tf32", delta=True, diag="mml", warps=2,
        interpret=IT), (q, k, G, jnp.ones((B, T, H), q.dtype)))
    timed(a, "bwd-solve", "full-w4 with R", functools.partial(
        chunk_fwd.solve_full, C=C, store=f32, prec="tf32", inv_prec="bf16x3", warps=4, interpret=IT, with_r=True),
        (A, k, v, G, beta))
    rng = np.random.default_rng(2)
    rnd = lambda *s: jnp.asarray(rng.standard_normal(s), f32) * 0.1
    tril = jnp.tril(jnp.ones((C, C), bool))
    terms = ChunkTerms(rnd(B, H, N, C, K), jnp.where(tril, rnd(B, H, N, C, C), 0.0), rnd(B, H, N, C, K),
                       jnp.exp(-rng.uniform(0, 1, (B, H, N, K)).astype(np.float32)), rnd(B, H, N, C, K),
                       rnd(B, H, N, C, K))
    timed(a, "bwd-state-passes", "old (partials)", lambda t, h, d, dh: chunk_bwd.state_passes(
        t, h, d, dh, exact=False, interpret=IT), (terms, h0, do.astype(f32), h0))
    for bv in (64, 32):
        timed(a, "bwd-state-passes", f"split block_v={bv}", lambda t, h, d, dh, bv=bv: chunk_bwd.state_passes_split(
            t, h, d, dh, exact=False, interpret=IT, block_v=bv), (terms, h0, do.astype(f32), h0))
    flatC = lambda m: m.reshape(B, H, T, C)
    dM = flatC(jnp.where(tril, rnd(B, H, N, C, C), 0.0))
    dKK = flatC(jnp.where(jnp.tril(jnp.ones((C, C), bool), -1), rnd(B, H, N, C, C), 0.0))
    timed(a, "bwd-gram-grads", "loop-w4 (kernels)", functools.partial(
        chunk_bwd.gram_grads, C=C, scale=scale, exact=False, interpret=IT), (qf, kf, G, dM, dKK))
    for spec in a.bwd_grams.split(","):
        diag, w = spec.split(":")
        timed(a, "bwd-gram-grads", f"{diag}-w{w}", functools.partial(
            chunk_bwd.gram_grads_fused, C=C, scale=scale, exact=False, interpret=IT, diag=diag, warps=int(w)),
            (q, k, G, dM, dKK))
    for intra, bwd in pairs(a.pairs):
        if bwd in chunk_bwd.KERNELS_DIAG:
            fn = lambda *xs, bwd=bwd: chunk_bwd.backward_kernels(*xs, scale=scale, chunk_size=C,
                                                                 diag=chunk_bwd.KERNELS_DIAG[bwd], interpret=IT)
        elif bwd in ("kernels-mm2", "kernels-mml2"):
            fn = lambda *xs, bwd=bwd: chunk_bwd.backward_fast(*xs, scale=scale, chunk_size=C, gram_diag=bwd[8:-1],
                                                              interpret=IT)
        else:
            continue
        timed(a, "bwd", bwd, fn, (*args, do, h0))

if __name__ == "__main__":
    main()
