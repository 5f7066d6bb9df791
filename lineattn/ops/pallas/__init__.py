"""Pallas GPU kernels (Triton backend) for the chunkwise delta / additive rules and the decode step.

`lineattn.ops.linear_attention(..., backend="pallas")` (and `chunk_kda`, `chunk_gated_delta_rule`, ...) call
`chunk_pallas`; without a GPU every kernel runs with `interpret=True`. See `api.py` for what is supported and
what `backend="auto"` hands to these kernels.
"""

from lineattn.ops.pallas.chunk import chunk_pallas
from lineattn.ops.pallas.decode import decode_step

__all__ = ["chunk_pallas", "decode_step"]
