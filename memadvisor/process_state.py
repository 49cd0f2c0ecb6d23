"""Put back what running a model could disturb in the caller's process: RNG states and modes.

The caller's weights, gradients and optimizer state are never written (every stage runs on
copies); this guards what lives in the process rather than in the model: the torch, CUDA,
Python and NumPy random generators (dropout, ``randn`` in a probe draw from them), each
submodule's train/eval flag (profilers and strategies may call ``eval()``), and the fp32
matmul precision (TF32 is process-wide), and environment variables set for a while
(:func:`environ_set`). Restored in a ``finally``, as Lightning's batch-size finder restores
its trainer. The profiler's passes and the whole plan both use :func:`rng_restored`; the
plan adds the flags (:func:`preserved_state`). It also says what the process may use of
the host's cores (:func:`usable_cores`: the card's runs at once, the loader's workers).
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import nn

from memadvisor import _torch_private

__all__ = ["preserved_state", "rng_restored", "usable_cores"]


def usable_cores() -> int:
    """The host's cores this process may run on (its affinity where the OS says, else all;
    at least 1)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _numpy_random() -> Any | None:
    try:
        import numpy
    except ImportError:
        return None
    return numpy.random


@contextlib.contextmanager
def environ_set(values: Mapping[str, str]) -> Iterator[None]:
    """Run a block with ``values`` in ``os.environ`` (processes started inside inherit them)
    and put back what the caller had: the old value, or no variable where there was none."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def rng_restored(*, uses_cuda: bool = False) -> Iterator[None]:
    """Run a block and put back torch's (CPU and every CUDA device), Python's and, if
    installed, NumPy's random states.

    Args:
        uses_cuda: the block will use CUDA. CUDA is then initialised first, so the states saved
            are the ones ``torch.manual_seed`` queued for its lazy start (a generator first
            seeded inside the block is put back to its unused state).
    """
    if uses_cuda:
        torch.cuda.init()
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    py = random.getstate()
    np_random = _numpy_random()
    np_state = np_random.get_state() if np_random is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        if np_random is not None and np_state is not None:
            np_random.set_state(np_state)


@contextlib.contextmanager
def preserved_state(model: nn.Module) -> Iterator[None]:
    """Run the block, then restore RNG states, every submodule's training flag and the
    process's fp32 matmul precision (a TF32 candidate applied in this process sets it)."""
    modes = [(m, m.training) for m in model.modules()]
    matmul = _torch_private.matmul_precision_state()
    # Reading CUDA's generators initialises CUDA: planning on a card does that anyway.
    with rng_restored(uses_cuda=torch.cuda.is_available()):
        try:
            yield
        finally:
            for m, training in modes:
                m.training = training  # the flag alone: train() would recurse and run user hooks
            _torch_private.restore_matmul_precision(matmul)
