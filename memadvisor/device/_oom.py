"""The one place that decides "is this an out-of-memory error?"."""

from __future__ import annotations

import torch

__all__ = ["is_oom"]

# Messages the CUDA stack uses for an allocation failure that arrives as a plain RuntimeError
# (cuDNN and cuBLAS report their own allocation failures this way, not as OutOfMemoryError).
_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "Simulated device out of memory",
)


def is_oom(error: BaseException) -> bool:
    """True when ``error`` means the device ran out of memory.

    ``torch.OutOfMemoryError`` (which the simulated device's error subclasses) and the CUDA,
    cuDNN and cuBLAS allocation messages count; anything else does not, and the caller
    re-raises it unchanged.
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, RuntimeError) and len(error.args) == 1:
        message = str(error.args[0])
        return any(m in message for m in _OOM_MESSAGES)
    return False
