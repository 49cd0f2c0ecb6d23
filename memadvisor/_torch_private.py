"""The one place memadvisor touches private torch APIs.

Each function names the private API it wraps and falls back (or raises a clear error) when a
torch release moves it, so a torch upgrade breaks one file, not the whole package. Add-only:
other modules import from here, never from ``torch._*`` directly.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = [
    "clear_cublas_workspaces",
    "fake_mode_active",
    "is_fake",
]


def is_fake(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a ``FakeTensor`` (``torch._subclasses.fake_tensor``)."""
    try:
        from torch._subclasses.fake_tensor import is_fake as _is_fake
    except ImportError:  # pragma: no cover - moved in a future torch: fall back to the class
        return type(tensor).__name__ == "FakeTensor"
    return bool(_is_fake(tensor))


def fake_mode_active() -> bool:
    """Whether a ``FakeTensorMode`` is on the dispatch-mode stack right now."""
    try:
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
    except ImportError:  # pragma: no cover - moved in a future torch
        return False
    return any(isinstance(m, FakeTensorMode) for m in _get_current_dispatch_mode_stack())


def clear_cublas_workspaces() -> bool:
    """Free cuBLAS's per-handle workspaces (``torch._C._cuda_clearCublasWorkspaces``).

    The next matmul on each thread allocates its workspace again, through the caching
    allocator, as in a fresh process. Returns False where this torch has no such call.
    """
    clear: Any = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or not torch.cuda.is_available():
        return False
    clear()
    return True
