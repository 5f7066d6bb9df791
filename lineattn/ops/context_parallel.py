"""Context parallelism for the chunkwise rules: the sequence is sharded across devices, states are composed.

Every rule with a chunk form maps a chunk's incoming state S0 [K, V] to its outgoing state affinely,
S_C = T S0 + D, with (`lineattn.ops.scan.chunk_transitions`)

    delta:     T = Diag(e^(G_C)) - Kg^T W   [K, K],   D = Kg^T U   [K, V]
    additive:  T = Diag(e^(G_C))            [K, K],   D = Kg^T V   (sum of decayed k v^T)

The additive rule's diagonal decay is stored as a full [K, K] matrix, so one composition,
(T1, D1) then (T2, D2) = (T2 T1, T2 D1 + D2), serves every rule. With the sequence axis sharded over a mesh axis
of P devices (each holds T / P tokens), per layer:

  1. each device computes its chunks' pairs (stage 1 of `lineattn.ops.chunk`, in parallel) and composes them
     (prefix composition in log depth) into one pair for its whole slice, from a zero state;
  2. the P slice pairs are all-gathered and prefix-composed (log P depth); device d's
     incoming state is the composition of devices 0 .. d-1;
  3. each device applies its true incoming state to its chunks' prefix pairs, giving every chunk's incoming
     state, and reads out its outputs (stage 3 of `lineattn.ops.chunk`).

Communication per layer, per head and per sequence row: each device contributes one pair, K x (K + V) fp32
values, and receives the other P - 1; the final state, when asked for, adds one all-reduce of K x V. All-gathering
K and V instead (what exact softmax attention needs) moves (P - 1) x (T / P) x (K + V) values into every device,
which is T / (P K) times more: 32x for T / P = 4096 tokens per device and K = 128. The state pass is also not a
P-step relay: no device waits for its left neighbour's state.

Packing (`cu_seqlens`): each device lays its slice out with every document piece starting on a chunk boundary
(zero padding, which leaves a state unchanged, fills the rest of a piece's last chunk). A chunk that starts a
document is "reset": its pair becomes (0, T h0 + D), with h0 that document's initial state (zero by default),
so every composition that spans the boundary forgets what came before it. A document that crosses a device
boundary simply continues in the next device's first chunk; its initial state enters on the device holding its
first token, and its final state is read on the device holding its last token (one all-reduce gathers them).

Gradients are plain autodiff through the composition (the all-gather transposes into a reduce-scatter): the
backward passes d(state) right to left across devices the same way the forward passes states left to right.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec

from lineattn.ops import api
from lineattn.ops import chunk as chunk_form
from lineattn.ops.common import einsum
from lineattn.ops.gates import floor_gate
from lineattn.ops.rules import Rule, resolve_rule
from lineattn.ops.scan import _compose_affine, chunk_transitions


def _prefix_compose(T, D, axis: int):
    """Inclusive prefix composition of affine pairs along `axis`, in log depth (about 2n compositions).

    The same odd/even recursion as `jax.lax.associative_scan`, written out so that no zero-sized slice is ever
    formed: in jax 0.11.2 a zero-sized residual crossing a `shard_map` boundary crashes XLA:CPU's SPMD partitioner
    under `jax.grad`, and `associative_scan` forms one whenever a recursion level has exactly two elements.
    """
    T, D = jnp.moveaxis(T, axis, 0), jnp.moveaxis(D, axis, 0)
    n = T.shape[0]
    if n > 1:
        # Compose neighbours (0, 1), (2, 3), ...; their prefix gives every odd position.
        T_odd, D_odd = _prefix_compose(*_compose_affine((T[0 : n - 1 : 2], D[0 : n - 1 : 2]), (T[1::2], D[1::2])), 0)
        T_even, D_even = T[:1], D[:1]
        if n > 2:  # even positions after the first: the previous odd prefix, then the element itself
            m = (n - 1) // 2
            T_rest, D_rest = _compose_affine((T_odd[:m], D_odd[:m]), (T[2::2], D[2::2]))
            T_even, D_even = jnp.concatenate([T_even, T_rest]), jnp.concatenate([D_even, D_rest])

        def interleave(even, odd):
            if n % 2:
                odd = jnp.concatenate([odd, even[-1:]])  # a placeholder after the last even, dropped below
            return jnp.stack([even, odd], axis=1).reshape(-1, *even.shape[1:])[:n]

        T, D = interleave(T_even, T_odd), interleave(D_even, D_odd)
    return jnp.moveaxis(T, 0, axis), jnp.moveaxis(D, 0, axis)


class _Plan:
    """Static (NumPy) layout of the local slices, one row per device d in [P]:

    - streams S: independent state chains on a device: B rows without packing, the one packed row with it;
    - chunks N: chunks per device after layout; with packing, `gather[d]` [N*C] picks each laid-out slot's local
      token (`slot_valid` zeroes padding) and `scatter[d]` [T/P] picks each local token's slot;
    - resets: `reset_chunk[d, r]` is a chunk that starts a document (`reset_valid`), whose initial state is
      `initial_state[reset_doc[d, r]]` with packing, or stream s's own without it (only device 0's chunk 0);
    - final states: output n is read at chunk `final_chunk[d, n]` of stream `final_stream[n]` on the device
      where `final_valid[d, n]`; `empty[n]` marks empty documents, whose final state is their initial state.
    """

    def __init__(self, cu: np.ndarray | None, B: int, T: int, P: int, C: int):
        T_loc = T // P
        self.packed = cu is not None
        if cu is None:
            self.S = B
            self.N = -(-T_loc // C)
            self.reset_chunk = np.zeros((P, 1), np.int32)
            self.reset_valid = (np.arange(P) == 0)[:, None].astype(np.float32)
            self.reset_doc = np.zeros((P, 1), np.int32)
            self.final_stream = np.arange(B)
            self.final_chunk = np.full((P, B), self.N - 1, np.int32)
            self.final_valid = np.repeat((np.arange(P) == P - 1)[:, None], B, axis=1).astype(np.float32)
            self.empty = np.zeros(B, np.float32)
            return
        self.S = 1
        num_docs = len(cu) - 1
        slots, resets, finals = [], [], []
        for d in range(P):
            s, e = d * T_loc, (d + 1) * T_loc
            slot_of_token = np.zeros(T_loc, np.int64)
            device_resets, device_finals = [], {}
            offset = 0
            for n in range(num_docs):
                a, b = max(cu[n], s), min(cu[n + 1], e)
                if a >= b:
                    continue
                slot_of_token[a - s : b - s] = offset + np.arange(b - a)
                if cu[n] == a:  # the document starts here
                    device_resets.append((offset // C, n))
                if cu[n + 1] <= e:  # and ends here
                    device_finals[n] = (offset + b - a - 1) // C
                offset += -(-(b - a) // C) * C
            slots.append(slot_of_token)
            resets.append(device_resets)
            finals.append(device_finals)
        self.N = max(int(s.max()) // C + 1 for s in slots)
        L = self.N * C
        self.scatter = np.stack(slots).astype(np.int32)  # [P, T_loc]
        self.gather = np.zeros((P, L), np.int32)
        self.slot_valid = np.zeros((P, L), np.float32)
        for d in range(P):
            self.gather[d, self.scatter[d]] = np.arange(T_loc)
            self.slot_valid[d, self.scatter[d]] = 1.0
        R = max(len(r) for r in resets)
        self.reset_chunk = np.zeros((P, R), np.int32)
        self.reset_valid = np.zeros((P, R), np.float32)
        self.reset_doc = np.zeros((P, R), np.int32)
        for d, device_resets in enumerate(resets):
            for r, (c, n) in enumerate(device_resets):
                self.reset_chunk[d, r], self.reset_valid[d, r], self.reset_doc[d, r] = c, 1.0, n
        self.final_stream = np.zeros(num_docs, np.int64)
        self.final_chunk = np.zeros((P, num_docs), np.int32)
        self.final_valid = np.zeros((P, num_docs), np.float32)
        for d, device_finals in enumerate(finals):
            for n, c in device_finals.items():
                self.final_chunk[d, n], self.final_valid[d, n] = c, 1.0
        self.empty = (np.diff(cu) == 0).astype(np.float32)


def _local(q, k, v, g, beta, initial_state, *, rule: Rule, plan: _Plan, axis_name: str, scale: float,
           chunk_size: int, output_final_state: bool):
    """The per-device body: local slices [B, T/P, ...] (fp32, rule preprocessing done), h0 [N, H, K, V]."""
    C = chunk_size
    d = jax.lax.axis_index(axis_name)
    at_device = lambda table: jnp.asarray(table)[d]

    # Lay out the local slice as [S, N*C]: chunk-aligned document pieces with packing, plain padding without.
    if plan.packed:
        gather, slot_valid = at_device(plan.gather), at_device(plan.slot_valid)

        def lay_out(x):
            if x is None:
                return None
            rows = x[:, gather]
            return rows * slot_valid.reshape(1, -1, *([1] * (rows.ndim - 2)))

        rows = tuple(map(lay_out, (q, k, v, g, beta)))
    else:
        rows = chunk_form.pad_to_chunks(q, k, v, g, beta, C)
    terms = chunk_form.chunk_terms(*rows, scale=scale, chunk_size=C)
    T_chunks, D_chunks = chunk_transitions(terms)  # [S, H, N, K, K], [S, H, N, K, V]

    # Resets: a chunk that starts a document composes as (0, T h0 + D).
    reset_chunk, reset_valid = at_device(plan.reset_chunk), at_device(plan.reset_valid)
    if plan.packed:
        h0_resets = initial_state[at_device(plan.reset_doc)][None]  # [1, R, H, K, V]
    else:
        h0_resets = initial_state[:, None]  # [B, 1, H, K, V]: each stream's own, at device 0's chunk 0
    h0_resets = jnp.moveaxis(h0_resets, 1, 2) * reset_valid[:, None, None]  # [S, H, R, K, V], zero where unused
    reset_N = jnp.zeros((plan.N,), jnp.float32).at[reset_chunk].add(reset_valid)  # 1 on reset chunks
    D_chunks = D_chunks.at[:, :, reset_chunk].add(
        einsum("shrij,shrjv->shriv", T_chunks[:, :, reset_chunk], h0_resets))
    T_chunks = T_chunks * (1.0 - reset_N)[:, None, None]

    # Prefix pairs of the device's chunks, from a zero state; the last one is the whole slice's pair.
    T_cum, D_cum = _prefix_compose(T_chunks, D_chunks, axis=2)

    # Across devices: gather every slice's pair, prefix-compose, take the composition of devices 0 .. d-1.
    T_all = jax.lax.all_gather(T_cum[:, :, -1], axis_name)  # [P, S, H, K, K]
    D_all = jax.lax.all_gather(D_cum[:, :, -1], axis_name)  # [P, S, H, K, V]
    _, D_before = _prefix_compose(T_all, D_all, axis=0)
    # The chain starts from zero: device 0's first chunk always resets, so only the D part matters.
    carry = jnp.where(d > 0, D_before[jnp.maximum(d - 1, 0)], 0.0)  # [S, H, K, V]

    # Every chunk's incoming state, then the outputs.
    S_end = einsum("shnij,shjv->shniv", T_cum, carry) + D_cum
    S0 = jnp.concatenate([carry[:, :, None], S_end[:, :, :-1]], axis=2)
    S0 = (S0 * (1.0 - reset_N)[:, None, None]).at[:, :, reset_chunk].add(h0_resets)
    o_rows = chunk_form.chunk_outputs(terms, S0)  # [S, N*C, H, V]
    o = o_rows[:, at_device(plan.scatter)] if plan.packed else o_rows[:, : q.shape[1]]

    final_state = None
    if output_final_state:
        final_chunk, final_valid = at_device(plan.final_chunk), at_device(plan.final_valid)
        here = S_end[plan.final_stream, :, final_chunk] * final_valid[:, None, None, None]  # [Nout, H, K, V]
        final_state = jax.lax.psum(here, axis_name) + plan.empty[:, None, None, None] * initial_state
    return o, final_state


def context_parallel_attention(
    rule: str | Rule | tuple[str, str],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    g: jax.Array | None = None,
    beta: jax.Array | None = None,
    *,
    mesh: Mesh | None = None,
    axis_name: str = "context",
    batch_axes: str | tuple[str, ...] | None = None,
    scale: float | None = None,
    initial_state: jax.Array | None = None,
    output_final_state: bool = False,
    cu_seqlens=None,
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array | None]:
    """`linear_attention(rule, ...)` with the sequence sharded over the mesh axis `axis_name` (see module doc).

    Two ways to call it:

    - `mesh=Mesh(...)`: q, k, v, g, beta are the whole (global) arrays, e.g. inside a jitted train step; the
      function runs its own `jax.shard_map`: T over `axis_name`, B over `batch_axes` (other mesh axes replicate).
      It returns o sharded the same way and the final state split over `batch_axes` only.
    - `mesh=None`: called inside an outer `jax.shard_map` (or other SPMD context) that binds `axis_name`; q, k,
      v, g, beta are this device's slice [B, T/P, ...] of the sequence (device d holds tokens d T/P .. (d+1)
      T/P - 1), `initial_state` and the returned final state are the same on every device, and o is the local
      slice. `cu_seqlens` still gives global positions. Other mesh axes (e.g. a batch axis) are untouched. The
      enclosing shard_map needs `check_vma=False` for now: the chunk form's (I + A)^-1 loop
      (`lineattn.ops.triangular`) starts from an unvarying carry, which the varying-axes check refuses.

    Args:
      rule: any rule with a chunk form: a name (`lineattn.ops.RULES`), `Rule`, or `(write, gate)` pair.
      q, k: [B, T, H, K]. v: [B, T, H, V].
      g: log decay (<= 0): None ('none'), [H] ('fixed', replicated), [B, T, H] ('head'), [B, T, H, K] ('channel');
        checked and floored as in `linear_attention`.
      beta: [B, T, H] for delta rules; None for additive rules.
      mesh: the device mesh holding `axis_name`, or None inside shard_map (above).
      axis_name: the mesh axis that shards the sequence; its size P must divide T.
      batch_axes: with `mesh`, the mesh axis (or axes) that split the batch B (data parallelism), e.g. "data";
        None replicates the batch over the other axes. Not with `cu_seqlens` (B == 1). Ignored when mesh=None.
      scale: query scale, default K ** -0.5.
      initial_state: [N, H, K, V] fp32 (V + 1 for 'linear_attn'), N = B, or the number of sequences.
      output_final_state: return the final state [N, H, K, V] (fp32, V + 1 for 'linear_attn'; the same on every
        device of the axis); otherwise None.
      cu_seqlens: int [N + 1] boundaries of packed sequences (B == 1), concrete (NumPy, list). Sequences may cross
        device boundaries.
      chunk_size: tokens per chunk (16 * 2^m). T / P need not be a multiple of it (each slice is zero-padded).

    Returns:
      (o [B, T, H, V] in q's dtype, final_state [N, H, K, V] fp32 or None).

    Communication per call: one all-gather of K x (K + V) fp32 values per head, sequence row and device, plus an
    all-reduce of N x H x K x V for the final state; all-gathering K and V would move T / (P K) times more.
    """
    rule = resolve_rule(rule)
    if not rule.has_chunk_form:
        raise ValueError(f"rule: context parallelism needs a rule with a chunk form of its [K, V] state; {rule} has "
                         "a per-element gate (use linear_attention on the whole sequence)")
    batch_split = 1
    if mesh is None:
        try:
            P = jax.lax.axis_size(axis_name)
        except NameError as err:
            raise ValueError(
                f"mesh=None needs an enclosing jax.shard_map that binds axis_name={axis_name!r}; "
                "otherwise pass mesh=Mesh(...)") from err
    else:
        if axis_name not in mesh.axis_names:
            raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
        P = mesh.shape[axis_name]
        batch_names = (batch_axes,) if isinstance(batch_axes, str) else tuple(batch_axes or ())
        if any(a not in mesh.axis_names or a == axis_name for a in batch_names):
            raise ValueError(f"batch_axes {batch_axes!r} must name mesh axes {dict(mesh.shape)} other than "
                             f"axis_name {axis_name!r}")
        batch_split = int(np.prod([mesh.shape[a] for a in batch_names]))
        if batch_split > 1 and (cu_seqlens is not None or q.shape[0] % batch_split):
            raise ValueError(f"q must be [B, T, H, K] with B divisible by the {batch_split} devices on batch_axes "
                             f"{batch_axes!r} (and no cu_seqlens, which needs B == 1), got B = {q.shape[0]}")

    # Validate the global shapes (the local ones times P along T when called inside shard_map).
    def global_view(x, time_sharded=True):
        if x is None or mesh is not None or not time_sharded or x.ndim < 2:
            return x
        return jax.ShapeDtypeStruct((x.shape[0], x.shape[1] * P, *x.shape[2:]), x.dtype)

    try:
        cu = api._validate(rule, *map(global_view, (q, k, v)), global_view(g, rule.gate != "fixed"),
                           global_view(beta), initial_state, cu_seqlens, "chunk", chunk_size, scale)
    except ValueError as err:
        if mesh is None:
            raise ValueError(f"{err} (global shapes: the local slice's T times P = {P} devices on {axis_name!r})") \
                from err
        raise
    B, T, H, K = q.shape
    if mesh is not None and T % P:
        raise ValueError(f"q must be [B, T, H, K] with T divisible by the {P} devices on mesh axis "
                         f"{axis_name!r}, got T = {T}")
    T_global = T if mesh is not None else T * P
    V = v.shape[-1]
    out_dtype = q.dtype
    if scale is None:
        scale = K**-0.5
    num_states = B if cu is None else len(cu) - 1
    if initial_state is None:
        initial_state = jnp.zeros((num_states, H, K, V + 1 if rule.normalize else V), jnp.float32)
    plan = _Plan(cu, B // batch_split, T_global, P, chunk_size)

    def body(args):
        f32 = lambda x: None if x is None else jnp.asarray(x, jnp.float32)
        q, k, v, g, beta, h0 = (f32(args.get(n)) for n in ("q", "k", "v", "g", "beta", "initial_state"))
        g = floor_gate(g)
        if rule.gate == "fixed":
            g = jnp.broadcast_to(g, q.shape[:3])
        if rule.normalize:
            q, k = jax.nn.elu(q) + 1.0, jax.nn.elu(k) + 1.0
            v = jnp.concatenate([v, jnp.ones_like(v[..., :1])], axis=-1)
        o, final_state = _local(q, k, v, g, beta, h0, rule=rule, plan=plan, axis_name=axis_name, scale=scale,
                                chunk_size=chunk_size, output_final_state=output_final_state)
        if rule.normalize:
            o = o[..., :V] / (o[..., V:] + api._NORMALIZER_EPS)
        return o.astype(out_dtype), final_state

    args = {n: x for n, x in zip(("q", "k", "v", "g", "beta", "initial_state"), (q, k, v, g, beta, initial_state))
            if x is not None}
    if mesh is None:
        return body(args)
    sharded = PartitionSpec(batch_axes, axis_name)
    per_row = PartitionSpec() if cu is not None else PartitionSpec(batch_axes)  # states of batch rows or documents
    specs = {n: sharded for n in args}
    specs["initial_state"] = per_row
    if rule.gate == "fixed":
        specs["g"] = PartitionSpec()
    out_specs = (sharded, per_row if output_final_state else None)
    # check_vma=False: lineattn.ops.triangular's fori_loop starts from an unvarying carry, which the varying-axes
    # check refuses. jit: eager shard_map compiles op by op (slow; it also crashed XLA:CPU in jax 0.11.2).
    fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs,), out_specs=out_specs, check_vma=False))
    return fn(args)
