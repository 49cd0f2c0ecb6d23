"""The precision vocabulary: the names a profile, a plan and the precision strategy use.

A step runs in fp32 (no autocast) or under autocast to bf16 or fp16. The profile measures a
step per precision (``Profile.steps`` is keyed by these names), the estimate reads the step
a candidate's precision names, and the precision strategy applies autocast with the dtype
named here.
"""

from __future__ import annotations

from typing import Literal

import torch

__all__ = ["AUTOCAST_DTYPES", "DTYPE_NAMES", "FULL", "PRECISIONS", "Precision"]

Precision = Literal["fp32", "bf16", "fp16"]
#: Every precision, the full one first.
PRECISIONS: tuple[Precision, ...] = ("fp32", "bf16", "fp16")
#: The precision without autocast: every profile measures it, and a missing step falls back to it.
FULL: Precision = "fp32"
#: The dtype autocast runs each low precision in.
AUTOCAST_DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}
#: The precision name of each dtype a step computes in.
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: FULL,
    **{dtype: name for name, dtype in AUTOCAST_DTYPES.items()},
}
