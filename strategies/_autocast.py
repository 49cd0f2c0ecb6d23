"""How a low precision runs: autocast inside the forward, and fp16's GradScaler.

Below both :mod:`strategies.precision` (which applies it) and :mod:`strategies._numerics`
(which trains copies in it), so neither imports the other. ``strategies.precision``
re-exports both names (a model pickled before this module existed finds its wrapper there).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memadvisor.schema.precision import AUTOCAST_DTYPES
from strategies import _forward

__all__ = ["AutocastForward", "grad_scaler_for"]


def _device_type(module: nn.Module) -> str:
    for t in module.parameters():
        return t.device.type
    for t in module.buffers():
        return t.device.type
    return "cpu"


class AutocastForward(_forward.ForwardWrapper):
    """The module's forward under ``torch.autocast`` on the device its parameters are on.

    The device is read at each call, so the model can be moved after applying.
    """

    def __init__(self, module: nn.Module, inner: Any, precision: str = "bf16") -> None:
        super().__init__(module, inner)
        self.precision = precision

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(_device_type(self.module), dtype=AUTOCAST_DTYPES[self.precision]):
            return self.call_inner(*args, **kwargs)


def grad_scaler_for(precision: str, device_type: str) -> torch.amp.GradScaler | None:
    """A fresh GradScaler for fp16 (whose small gradients underflow without one), else None."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device_type)
