"""Public op API: FLA-compatible names, `[B, T, H, D]` layout, explicit keyword arguments.

    o, final_state = linear_attention("kda", q, k, v, g, beta, initial_state=h0, output_final_state=True)

Outputs have q's dtype; states are fp32 `[N, H, K, V]` (N = B, or the number of sequences with `cu_seqlens`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from lineattn.checks import check_real, is_concrete
from lineattn.ops import checkpoints, varlen
from lineattn.ops.columns import per_value_column
from lineattn.ops.chunk import SUB_CHUNK, chunk
from lineattn.ops.gates import floor_gate
from lineattn.ops.pallas import api as pallas_api
from lineattn.ops.recurrent import recurrent
from lineattn.ops.rules import Rule, resolve_rule
from lineattn.ops.scan import scan

BACKENDS = ("auto", "recurrent", "chunk", "scan", "pallas")
_NORMALIZER_EPS = 1e-6


def _shape_error(name, expected, x):
    got = "None" if x is None else f"{x.dtype} {tuple(x.shape)}"
    return ValueError(f"{name} must be {expected}, got {got}")


def _check_float(name, x, expected):
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise _shape_error(name, f"a floating-point array {expected}", x)


def _validate(rule: Rule, q, k, v, g, beta, initial_state, cu_seqlens, backend, chunk_size, scale=None):
    """Raises a ValueError naming the first bad argument; returns cu_seqlens as NumPy (or None)."""
    if q is None or q.ndim != 4:
        raise _shape_error("q", "[B, T, H, K]", q)
    B, T, H, K = q.shape
    for name, x, expected in (("q", q, "[B, T, H, K]"), ("k", k, f"[{B}, {T}, {H}, {K}] like q"),
                              ("v", v, f"[{B}, {T}, {H}, V]")):
        if x is None or x.ndim != 4 or x.shape[:3] != (B, T, H) or (name == "k" and x.shape != q.shape):
            raise _shape_error(name, expected, x)
        _check_float(name, x, expected)
    if T == 0 or K == 0:
        raise _shape_error("q", "[B, T, H, K] with T >= 1 and K >= 1", q)
    V = v.shape[-1]
    if V == 0:
        raise _shape_error("v", "[B, T, H, V] with V >= 1", v)
    if scale is not None:
        check_real("scale", scale, lambda s: True, "(or None)")
    expected_g = {
        "none": None,
        "fixed": ((H,), f"[H] = [{H}] (one log decay per head)"),
        "head": ((B, T, H), f"[B, T, H] = [{B}, {T}, {H}]"),
        "channel": ((B, T, H, K), f"[B, T, H, K] = [{B}, {T}, {H}, {K}]"),
        "element": ((B, T, H, K, V), f"[B, T, H, K, V] = [{B}, {T}, {H}, {K}, {V}]"),
    }[rule.gate]
    if expected_g is None:
        if g is not None:
            raise _shape_error("g", "None for a rule with gate='none'", g)
    elif g is None or tuple(g.shape) != expected_g[0]:
        raise _shape_error("g", f"{expected_g[1]} for gate={rule.gate!r}", g)
    else:
        _check_float("g", g, expected_g[1])
        # (only where g has values: a traced g is not checked; a constant under jit is, once, when traced)
        if is_concrete(g):
            with jax.ensure_compile_time_eval():
                if not bool(jnp.all(g <= 0)):
                    raise ValueError(f"g must be a log decay <= 0 (no NaN), got max {float(jnp.max(g))}; the chunk "
                                     "forms assume it")
    if rule.write == "delta":
        if beta is None or tuple(beta.shape) != (B, T, H):
            raise _shape_error("beta", f"[B, T, H] = [{B}, {T}, {H}] for the delta write", beta)
        _check_float("beta", beta, "[B, T, H]")
    elif beta is not None:
        raise _shape_error("beta", "None for the additive write", beta)

    num_seqs, cu = B, None
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs packed inputs with B == 1, got B = {B}")
        cu = varlen.concrete_cu_seqlens(cu_seqlens, T)
        num_seqs = len(cu) - 1
    state_V = V + 1 if rule.normalize else V
    if initial_state is not None:
        expected = f"[N, H, K, V] = [{num_seqs}, {H}, {K}, {state_V}]"
        if tuple(initial_state.shape) != (num_seqs, H, K, state_V):
            raise _shape_error("initial_state", expected, initial_state)
        _check_float("initial_state", initial_state, expected)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "scan" and not rule.has_scan_form:
        raise ValueError(f"backend='scan': {rule} has no scan form; use 'recurrent'")
    if backend == "pallas":
        reason = pallas_api.unsupported(rule, q.dtype, K, V, chunk_size)
        if reason:
            raise ValueError(f"backend='pallas': {reason}; use 'chunk'")
        if not _one_dtype(q, k, v):  # (casting one to another's would round it silently)
            raise ValueError(f"backend='pallas': q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, "
                             f"v {v.dtype}; cast them, or use 'chunk' (fp32)")
    blocks = chunk_size // SUB_CHUNK if isinstance(chunk_size, int) else 0
    if not (blocks > 0 and chunk_size % SUB_CHUNK == 0 and blocks & (blocks - 1) == 0):
        raise ValueError(f"chunk_size must be {SUB_CHUNK} * 2^m (16, 32, 64, 128, ...), got {chunk_size!r}")
    return cu


def _one_dtype(q, k, v) -> bool:
    """Whether q, k and v share a dtype (the Pallas kernels take them in one)."""
    return q.dtype == k.dtype == v.dtype


def select_backend(rule: Rule, backend: str, *, dtype=None, K=None, V=None, chunk_size=64) -> str:
    """`auto` picks the fastest backend tested for the rule (and, for the Pallas kernels, for the dtype, head
    dims and device: see `lineattn.ops.pallas.api.auto_ok`); otherwise the named one."""
    if backend != "auto":
        return backend
    if dtype is not None and pallas_api.auto_ok(rule, dtype, K, V, chunk_size):
        return "pallas"
    if rule.has_chunk_form:
        return "chunk"
    return "scan" if rule.has_scan_form else "recurrent"


def linear_attention(
    rule: str | Rule | tuple[str, str],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None = None,
    beta: jax.Array | None = None,
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens=None,
    backend: str = "auto",
    chunk_size: int = 64,
    checkpoint_positions=None,
) -> tuple[jax.Array, jax.Array | None] | tuple[jax.Array, jax.Array | None, jax.Array]:
    """Any update rule, by name (see `lineattn.ops.rules.RULES`), `Rule`, or `(write, gate)` pair.

    Args:
      q, k: [B, T, H, K]. v: [B, T, H, V].
      g: log decay (<= 0): None (gate 'none'), [H] ('fixed'), [B, T, H] ('head'), [B, T, H, K] ('channel'),
        [B, T, H, K, V] ('element'). A positive or NaN value is a ValueError where g is concrete (not under jit);
        values below LOG_GATE_FLOOR (-120, -inf included) act as it (e^-120 is 0 in fp32).
      beta: [B, T, H] write strength for delta rules; None for additive rules.
      scale: query scale, default K ** -0.5.
      initial_state: [N, H, K, V] (V + 1 for the normalised rule), N = B or the number of sequences.
      output_final_state: return the final state [N, H, K, V] (fp32; V + 1 for the normalised rule); otherwise
        None.
      cu_seqlens: int [N + 1] sequence boundaries of packed inputs (B == 1); must be concrete (NumPy, list).
        Each sequence starts from its own initial state and returns its own final state.
      backend: "auto" | "recurrent" | "chunk" | "scan" | "pallas".
      chunk_size: tokens per chunk for the chunk, scan and pallas backends (16 * 2^m; pallas: 16, 32 or 64;
        default 64).
      checkpoint_positions: concrete ints in [0, T]: also return the fp32 state after each of these many tokens,
        from the same pass (need not be chunk-aligned; see `lineattn.ops.checkpoints`). Backends "chunk",
        "pallas" and "recurrent" ("auto": "pallas" where it would run the kernels anyway, else "chunk" where the
        rule has a chunk form, else "recurrent"); not with cu_seqlens.

    Returns:
      (o [B, T, H, V] in q's dtype, final_state or None), plus states [P, B, H, K, V] when checkpoint_positions
      is given.
    """
    rule = resolve_rule(rule)
    cu = _validate(rule, q, k, v, g, beta, initial_state, cu_seqlens, backend, chunk_size, scale)
    B, T, H, K = q.shape
    V = v.shape[-1]
    out_dtype = q.dtype
    if scale is None:
        scale = K**-0.5
    # (dtype None: auto takes no kernels for q, k, v of mixed dtypes)
    name = select_backend(rule, backend, dtype=q.dtype if _one_dtype(q, k, v) else None, K=K, V=V,
                          chunk_size=chunk_size)
    positions = None
    if checkpoint_positions is not None:
        if cu is not None:
            raise ValueError("checkpoint_positions: not supported with cu_seqlens (positions of which sequence?)")
        positions = checkpoints.check_positions(checkpoint_positions, T)
        if backend == "auto" and name != "pallas":
            name = "chunk" if rule.has_chunk_form else "recurrent"
        elif name not in ("chunk", "recurrent", "pallas"):
            raise ValueError(f"checkpoint_positions: backend {name!r} cannot export states; use 'chunk', 'pallas' "
                             "or 'recurrent'")
    if name != "pallas":  # (the kernels raise g to the floor as they load it: `pallas.chunk.GATE_FLOOR`)
        g = floor_gate(g)
    f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
    if name == "pallas":  # the kernels take q, k, v in one dtype (bf16 or fp32), beta bf16 or fp32, an fp32 gate
        if beta is not None and beta.dtype not in pallas_api.DTYPES:
            beta = f32(beta)
        g = f32(g)
    else:
        q, k, v, g, beta = map(f32, (q, k, v, g, beta))
    if rule.gate == "fixed":
        g = jnp.broadcast_to(g, (B, T, H))
    if rule.normalize:
        q, k = jax.nn.elu(q) + 1.0, jax.nn.elu(k) + 1.0
        v = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)  # the normaliser z rides as a value column

    layout = None
    if cu is not None:
        layout = varlen.PackedLayout(cu)
        q, k, v, g, beta = map(layout.pad, (q, k, v, g, beta))
    if initial_state is None:
        initial_state = jnp.zeros((q.shape[0], H, K, v.shape[-1]), jnp.float32)

    fn = {"recurrent": recurrent, "chunk": functools.partial(chunk, chunk_size=chunk_size),
          "scan": functools.partial(scan, chunk_size=chunk_size),
          "pallas": functools.partial(pallas_api.run, chunk_size=chunk_size)}[name]
    if positions is not None:
        fn = {"recurrent": functools.partial(checkpoints.recurrent_checkpoints, positions=positions),
              "chunk": functools.partial(checkpoints.chunk_checkpoints, chunk_size=chunk_size, positions=positions),
              "pallas": functools.partial(pallas_api.run_checkpoints, chunk_size=chunk_size, positions=positions)}[name]
    if name == "chunk" and rule.gate == "element":  # V channel-gate rules of value dim 1 (lineattn.ops.columns)
        fn = per_value_column(fn)
    o, final_state, *states = fn(q, k, v, g, beta, scale=scale, initial_state=f32(initial_state))

    if layout is not None:
        o = layout.unpad(o)
    if rule.normalize:
        o = o[..., :V] / (o[..., V:] + _NORMALIZER_EPS)
    return (o.astype(out_dtype), final_state if output_final_state else None, *states)  # states: [P, B, H, K, V]


# FLA's names and positional signatures; keyword arguments and returns as `linear_attention`.


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              backend="auto", chunk_size=64):
    """KDA (delta write, per-channel gate). q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log decay, beta
    [B, T, H] -> (o [B, T, H, V], final state [N, H, K, V] or None), as `linear_attention`."""
    return linear_attention("kda", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend,
                            chunk_size=chunk_size)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, backend="auto", chunk_size=64):
    """Gated DeltaNet (delta write, per-head gate). q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] log decay, beta
    [B, T, H] -> (o [B, T, H, V], final state [N, H, K, V] or None), as `linear_attention`."""
    return linear_attention("gdn", q, k, v, g, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend,
                            chunk_size=chunk_size)


def chunk_delta_rule(q, k, v, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     backend="auto", chunk_size=64):
    """DeltaNet (delta write, no gate). q, k [B, T, H, K]; v [B, T, H, V]; beta [B, T, H] -> (o [B, T, H, V], final
    state [N, H, K, V] or None), as `linear_attention`."""
    return linear_attention("deltanet", q, k, v, None, beta, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend,
                            chunk_size=chunk_size)


def chunk_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              backend="auto", chunk_size=64):
    """GLA (additive write, per-channel gate). q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H, K] log decay -> (o
    [B, T, H, V], final state [N, H, K, V] or None), as `linear_attention`."""
    return linear_attention("gla", q, k, v, g, None, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend,
                            chunk_size=chunk_size)


def chunk_simple_gla(q, k, v, g, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                     backend="auto", chunk_size=64):
    """Simple GLA (additive write, per-head gate). q, k [B, T, H, K]; v [B, T, H, V]; g [B, T, H] log decay -> (o
    [B, T, H, V], final state [N, H, K, V] or None), as `linear_attention`."""
    return linear_attention("simple_gla", q, k, v, g, None, scale=scale, initial_state=initial_state,
                            output_final_state=output_final_state, cu_seqlens=cu_seqlens, backend=backend,
                            chunk_size=chunk_size)
