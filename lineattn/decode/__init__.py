"""Decode with explicit state: `init_state`, `prefill`, `step`, `generate`."""

from lineattn.decode.loop import generate, prefill, sample, step
from lineattn.decode.state import DecodeState, init_state, state_bytes

__all__ = ["DecodeState", "generate", "init_state", "prefill", "sample", "state_bytes", "step"]
