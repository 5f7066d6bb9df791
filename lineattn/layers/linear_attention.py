"""The linear-attention mixer for every update rule (write mode x gate granularity), with decode state."""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from lineattn import ops
from lineattn.ops import pallas as ops_pallas
from lineattn.ops.pallas import api as pallas_api
from lineattn.checks import check_int, check_real
from lineattn.layers.basic import check_input, dense, rms_norm
from lineattn.layers.conv import ShortConv
from lineattn.layers.segments import RESET_LOG_GATE, check_segment_ids, context_segment_starts, segment_starts

GATE_FNS = ("safe", "softplus")
# Blocks of at most this many tokens continuing a decode state take the decode kernel or the token-level
# recurrence, not the chunk path (see __call__).
SHORT_BLOCK = 16


class LinearState(NamedTuple):
    """Decode state of one linear layer: conv [B, W - 1, C] pre-conv inputs (None without a conv) and the fp32
    recurrent state [B, H, K, V] (V + 1 for vanilla linear attention's normaliser column)."""

    conv: jax.Array | None
    recurrent: jax.Array


def _l2_normalize(x, eps=1e-6):
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.sum(x32 * x32, axis=-1, keepdims=True) + eps)).astype(x.dtype)


def _init_A_log(key, num_heads):
    """Per-head rate A ~ U(1, 16), stored as log A (Mamba2 / Gated DeltaNet / KDA)."""
    return jnp.log(jax.random.uniform(key, (num_heads,), jnp.float32, 1.0, 16.0))


def _init_dt_bias(key, shape):
    """dt ~ log-uniform in [1e-3, 1e-1] (floored at 1e-4), stored through the inverse softplus."""
    log_dt = jax.random.uniform(key, shape, jnp.float32, math.log(1e-3), math.log(1e-1))
    dt = jnp.maximum(jnp.exp(log_dt), 1e-4)
    return dt + jnp.log(-jnp.expm1(-dt))


def _retnet_A_log(num_heads):
    """RetNet's fixed decays gamma_h = 1 - 2^(-5 - h), stored as log(-log gamma) so that g = -exp(A_log)."""
    gamma = 1.0 - 2.0 ** (-5.0 - jnp.arange(num_heads, dtype=jnp.float32))
    return jnp.log(-jnp.log(gamma))


def with_resets(rule: ops.Rule, g, resets_BT, num_heads: int):
    """Adds RESET_LOG_GATE to the log gate where a segment starts, so the carried state is wiped there.

    Rules without a data-dependent gate get a head gate (zero, or the fixed decay) to carry the reset.
    """
    B, T = resets_BT.shape
    cut_BT = jnp.where(resets_BT, RESET_LOG_GATE, 0.0).astype(jnp.float32)
    if rule.gate in ("none", "fixed"):
        base = jnp.zeros((num_heads,), jnp.float32) if g is None else g
        rule = ops.Rule(rule.write, "head", rule.normalize)
        return rule, base + cut_BT[..., None]
    return rule, g + cut_BT.reshape(B, T, *(1,) * (g.ndim - 2))


class LinearAttention(nnx.Module):
    """A linear-attention mixer: projections, short conv + SiLU, (L2-normalised q/k for delta rules), beta,
    forget gate, the update rule from `lineattn.ops`, head-wise RMSNorm times a sigmoid output gate, projection.

    Gates (log space, g <= 0), by granularity:
      fixed    g_h = -exp(A_log_h), one learned constant per head (RetNet initialisation).
      head     g = gate_fn(W x) with one value per head.
      channel  g = gate_fn(W_up W_down x), low rank (width -> K -> H K), one value per key channel (KDA).
      element  as channel, but W_up maps to H K V: one value per state element.
    gate_fn is "safe" (lower_bound * sigmoid(exp(A_log) (x + dt_bias)), KDA) or "softplus"
    (-exp(A_log) softplus(x + dt_bias), Mamba2 / Gated DeltaNet). A_log ~ log U(1, 16) and dt_bias is the inverse
    softplus of dt ~ log-uniform [1e-3, 1e-1], as in the Mamba2 / GDN / KDA releases.
    """

    def __init__(self, width: int, num_heads: int, head_k_dim: int, head_v_dim: int, rule, *, conv_size: int = 4,
                 gate_fn: str = "safe", lower_bound: float = -5.0, backend: str = "auto", rngs: nnx.Rngs,
                 dtype=None, param_dtype=jnp.float32):
        for name, value in (("width", width), ("num_heads", num_heads), ("head_k_dim", head_k_dim),
                            ("head_v_dim", head_v_dim)):
            check_int(name, value)
        check_int("conv_size", conv_size, 0)
        if gate_fn not in GATE_FNS:
            raise ValueError(f"gate_fn must be one of {GATE_FNS}, got {gate_fn!r}")
        check_real("lower_bound", lower_bound, lambda b: b < 0, "< 0")
        if backend not in ops.BACKENDS:
            raise ValueError(f"backend must be one of {ops.BACKENDS}, got {backend!r}")
        self.rule = ops.resolve_rule(rule)
        H, K, V = num_heads, head_k_dim, head_v_dim
        self.width, self.num_heads, self.head_k_dim, self.head_v_dim = width, H, K, V
        self.gate_fn, self.lower_bound, self.backend = gate_fn, lower_bound, backend
        make = functools.partial(dense, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.q_proj, self.k_proj, self.v_proj = make(width, H * K), make(width, H * K), make(width, H * V)
        self.conv = nnx.data(ShortConv(H * (2 * K + V), conv_size, rngs=rngs, param_dtype=param_dtype)
                             if conv_size else None)
        self.b_proj = nnx.data(make(width, H) if self.rule.write == "delta" else None)

        gate = self.rule.gate
        A_log = dt_bias = g_proj = g_up = None
        if gate == "fixed":
            A_log = nnx.Param(_retnet_A_log(H))
        elif gate != "none":
            per_head = {"head": (), "channel": (K,), "element": (K * V,)}[gate]
            if gate == "head":
                g_proj = make(width, H)
            else:
                g_proj, g_up = make(width, K), make(K, H * per_head[0])
            A_log = nnx.Param(_init_A_log(rngs.params(), H))
            dt_bias = nnx.Param(_init_dt_bias(rngs.params(), (H, *per_head)))
        self.A_log, self.dt_bias = nnx.data(A_log), nnx.data(dt_bias)
        self.g_proj, self.g_up = nnx.data(g_proj), nnx.data(g_up)
        self.o_norm = rms_norm(V, rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.o_gate_down, self.o_gate_up = make(width, V), make(V, H * V)
        self.o_proj = make(H * V, width)

    @property
    def state_v_dim(self) -> int:
        return self.head_v_dim + 1 if self.rule.normalize else self.head_v_dim

    def init_state(self, batch: int, max_len: int | None = None, dtype=jnp.float32) -> LinearState:
        """A zero LinearState for `batch` requests (max_len is ignored: the state does not grow with the sequence;
        it is taken so every mixer has the same signature)."""
        conv = None if self.conv is None else self.conv.init_state(batch, dtype)
        S = jnp.zeros((batch, self.num_heads, self.head_k_dim, self.state_v_dim), jnp.float32)
        return LinearState(conv, S)

    def _check_state(self, state: LinearState, B: int) -> None:
        """ValueError unless `state` has the shapes `init_state(B)` gives (static shapes: free under jit)."""
        if self.conv is None:
            if state.conv is not None:
                raise ValueError("state.conv must be None: this layer has no short conv (conv_size 0)")
        else:
            if state.conv is None:
                raise ValueError("state.conv is None but this layer has a short conv: use init_state(batch)")
            self.conv.check_state(state.conv, B, "state.conv")
        want = (B, self.num_heads, self.head_k_dim, self.state_v_dim)
        if tuple(state.recurrent.shape) != want:
            raise ValueError(f"state.recurrent must be [B, H, K, V] = {list(want)}, got shape "
                             f"{tuple(state.recurrent.shape)}")

    def _decode_kernel_ok(self, rule, dtype) -> bool:
        """The decode step takes the Pallas kernel when the backend is "pallas", or "auto" on a GPU where the
        chunk kernels' GPU tests cover the rule and head dims; otherwise the recurrent oracle step."""
        K, V = self.head_k_dim, self.head_v_dim
        if rule.gate == "element" or rule.normalize or pallas_api.unsupported(rule, dtype, K, V, 64) is not None:
            return False
        return self.backend == "pallas" or (self.backend == "auto" and pallas_api.auto_ok(rule, dtype, K, V, 64))

    def log_gate(self, x_BTD):
        """g in the layout `lineattn.ops` expects for the rule ([H], [B, T, H], [B, T, H, K] or [B, T, H, K, V])."""
        gate, H = self.rule.gate, self.num_heads
        if gate == "none":
            return None
        if gate == "fixed":
            return -jnp.exp(self.A_log[...])
        B, T, _ = x_BTD.shape
        raw = self.g_proj(x_BTD) if gate == "head" else self.g_up(self.g_proj(x_BTD)).reshape(B, T, H, -1)
        raw = raw.astype(jnp.float32)
        if self.gate_fn == "safe":
            g = ops.safe_gate(raw, self.A_log[...], self.dt_bias[...], self.lower_bound)
        else:
            g = ops.softplus_gate(raw, self.A_log[...], self.dt_bias[...])
        return g.reshape(B, T, H, self.head_k_dim, self.head_v_dim) if gate == "element" else g

    def __call__(self, x_BTD, *, segment_ids=None, state: LinearState | None = None, checkpoints=(),
                 context_axis: str | None = None, **unused_context):
        """x [B, T, width] -> (y [B, T, width], new LinearState or None, snapshots or None).

        segment_ids [B, T] (0 = padding) resets the state where a segment starts and keeps the conv inside
        segments. With `state`, x continues from it (prefill or decode step) and the new state is returned.
        checkpoints: token counts p in [0, T] (concrete); snapshots = LinearState(conv [P, B, W - 1, C],
        recurrent [P, B, H, K, V]) after p tokens of x, from the same pass.
        context_axis: context parallelism (training forward, inside a shard_map binding that mesh axis): x and
        segment_ids are this device's slice [B, T/P] of the sequence; the conv takes a halo from the previous
        device and the rule runs through `ops.context_parallel_attention` (segment starts as reset gates).
        """
        check_input(x_BTD, self.width)
        B, T, _ = x_BTD.shape
        check_segment_ids(segment_ids, (B, T))
        if context_axis is not None and (state is not None or checkpoints):
            raise ValueError("LinearAttention: context_axis is for training forwards (no state or checkpoints)")
        if checkpoints and state is None:
            raise ValueError("LinearAttention: checkpoints need a state (snapshots are of a decode state)")
        if state is not None:
            self._check_state(state, B)
        H, K, V = self.num_heads, self.head_k_dim, self.head_v_dim
        qkv = jnp.concatenate([self.q_proj(x_BTD), self.k_proj(x_BTD), self.v_proj(x_BTD)], axis=-1)
        conv_state = conv_snaps = None
        if self.conv is not None:
            past = None if state is None else state.conv
            if checkpoints:
                window = self.conv.window(qkv, segment_ids=segment_ids, state=past)
                W1 = self.conv.kernel_size - 1
                conv_snaps = jnp.stack([window[:, p : p + W1] for p in checkpoints]).astype(past.dtype)
            qkv, conv_state = self.conv(qkv, segment_ids=segment_ids, state=past, context_axis=context_axis)
        q, k, v = jnp.split(qkv, [H * K, 2 * H * K], axis=-1)
        q, k, v = q.reshape(B, T, H, K), k.reshape(B, T, H, K), v.reshape(B, T, H, V)
        beta = None
        if self.rule.write == "delta":
            q, k = _l2_normalize(q), _l2_normalize(k)
            beta = jax.nn.sigmoid(self.b_proj(x_BTD).astype(jnp.float32))
        rule, g = self.rule, self.log_gate(x_BTD)
        if segment_ids is not None:
            starts = segment_starts(segment_ids) if context_axis is None else context_segment_starts(
                segment_ids, context_axis)
            rule, g = with_resets(rule, g, starts, H)
        if context_axis is not None:
            o, _ = ops.context_parallel_attention(rule, q, k, v, g, beta, axis_name=context_axis)
            return self._output(x_BTD, o), None, None
        # A few tokens continuing a state (a decode step, a speculative verify block) take the decode kernel where
        # its GPU tests cover the rule (it also emits the state after every token for checkpoints), else the
        # token-level scan: both exact, and far cheaper than padding the tokens to a 64-token chunk.
        short = state is not None and T <= SHORT_BLOCK
        if short and self._decode_kernel_ok(rule, q.dtype):
            g_step = jnp.broadcast_to(g, (B, T, H)) if rule.gate == "fixed" else g
            out = ops_pallas.decode_step(q, k, v, g_step, beta, state.recurrent, output_states=bool(checkpoints))
            if checkpoints:  # states after p tokens [P, B, H, K, V]; p = 0 is the incoming state
                after = lambda p: state.recurrent if p == 0 else out[2][:, p - 1]
                out = (*out[:2], jnp.stack([after(p) for p in checkpoints]))
        else:
            out = ops.linear_attention(rule, q, k, v, g, beta, initial_state=None if state is None else state.recurrent,
                                       output_final_state=state is not None,
                                       backend="recurrent" if short else self.backend,
                                       checkpoint_positions=list(checkpoints) if checkpoints else None)
        o, S = out[:2]
        snaps = LinearState(conv_snaps, out[2]) if checkpoints else None
        return self._output(x_BTD, o), (None if state is None else LinearState(conv_state, S)), snaps

    def _output(self, x_BTD, o_BTHV):
        """Head-wise RMSNorm of the rule's output times the sigmoid output gate, then the output projection."""
        B, T, H, V = o_BTHV.shape
        o_gate = jax.nn.sigmoid(self.o_gate_up(self.o_gate_down(x_BTD))).reshape(B, T, H, V)
        return self.o_proj((self.o_norm(o_BTHV) * o_gate).reshape(B, T, H * V))
