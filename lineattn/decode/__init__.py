"""Decode with explicit state: `init_state`, `prefill`, `step`, `generate`."""

from lineattn.decode.loop import generate, prefill, prefill_with_snapshots, sample, step
from lineattn.decode.state import DecodeState, init_state, state_bytes

__all__ = ["DecodeState", "generate", "init_state", "prefill", "prefill_with_snapshots", "sample", "state_bytes",
           "step"]
