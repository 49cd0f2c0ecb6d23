"""Put back what planning could disturb in the caller's process: RNG states and modes.

The caller's weights, gradients and optimizer state are never written (every stage runs on
copies); this guards what lives in the process rather than in the model: the torch, CUDA,
Python and NumPy random generators (dropout, ``randn`` in a probe draw from them), and each
submodule's train/eval flag (profilers and strategies may call ``eval()``). Restored in a
``finally``, as Lightning's batch-size finder restores its trainer.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["preserved_state"]


def _numpy_random() -> Any | None:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run the block, then restore RNG states and every submodule's training flag."""
    torch_rng = torch.get_rng_state()
    # Reading CUDA's generators initialises CUDA: planning on a card does that anyway, and a
    # generator first seeded during planning must still be put back to its unused state.
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    python_rng = random.getstate()
    np_random = _numpy_random()
    numpy_rng = np_random.get_state() if np_random is not None else None
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training  # the flag alone: train() would recurse and run user hooks
        torch.set_rng_state(torch_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(python_rng)
        if np_random is not None and numpy_rng is not None:
            np_random.set_state(numpy_rng)
