"""No XLA pass over a large array outside the Pallas kernels in the programs the H200 bench times.

XLA cannot fuse an op into a Pallas kernel, so such an op is a pass through device memory of its own, which a profile
of the kernels alone does not show (sessions 42-45 timed an XLA `where` over the fp32 gate, 268 MB read and written
per call at (8, 4096), without seeing it). `scripts/xla_passes.py` traces the bench's forward and forward+backward as
on an H200 (the GPU faked; kernels traced, never compiled) and lists the ops between the kernels.
"""

from __future__ import annotations

import pytest

from conftest import load_script
from lineattn.ops.pallas import chunk as pallas_chunk

xla_passes = load_script("xla_passes")

# Larger than the segmented passes' K x K maps at (1, 32768) (16.8 MB: a concatenate and two slices), smaller than
# any [B, T, H, .] array of the bench's shapes (a channel gate's int8 mask: 67 MB).
LIMIT = 32e6


def _passes(rule, B, T):
    """{mode: [(op, bytes)]}: the ops outside the kernels, not layout-only, over LIMIT."""
    return {mode: [(xla_passes.describe(e), n) for e, n in xla_passes.passes(xla_passes.program_ops(jaxpr), LIMIT)]
            for mode, jaxpr in xla_passes.bench_programs(rule, B, T).items()}


G_BYTES = {(8, 4096): 8 * 4096 * 16 * 128 * 4, (1, 32768): 32768 * 16 * 128 * 4}  # KDA's fp32 channel gate


@pytest.mark.parametrize("rule", ["kda", "gdn"])
@pytest.mark.parametrize("B,T", [(8, 4096), (1, 32768)])
def test_bench_programs_move_large_arrays_in_kernels_only(rule, B, T):
    # KDA and GDN, forward and forward+backward (backend "pallas", the defaults, bf16, H = 16, K = V = 128): between
    # the kernels only reshapes, zero-width pads and ops on arrays of at most 32 MB, but for one pass, by choice:
    # KDA's forward+backward forms the int8 mask of g below the floor in XLA (`chunk.below_floor`, an `lt` and a
    # convert that XLA fuses: 268 MB read, 67 MB written), which took less than the Gram kernel's store of it (H100
    # run44b, H200 run45b: that form was removed).
    found = _passes(rule, B, T)
    mask = [("lt", G_BYTES[B, T]), ("convert_element_type", G_BYTES[B, T] // 4)] if rule == "kda" else []
    assert found["fwd"] == [] and [(op.split()[0], n) for op, n in found["fwdbwd"]] == mask, found


def test_bench_programs_check_sees_the_gate_passes(monkeypatch):
    # The check above tells the gate's forms apart (KDA at (8, 4096)): with the floor in XLA (GATE_FLOOR "xla", the
    # form of sessions 42-44) the forward has the floor's `where` over g (a `select_n`).
    monkeypatch.setattr(pallas_chunk, "GATE_FLOOR", "xla")
    found = _passes("kda", 8, 4096)
    assert any(op.startswith("select_n") and n == G_BYTES[8, 4096] for op, n in found["fwd"]), found
