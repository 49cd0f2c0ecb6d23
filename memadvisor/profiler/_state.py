"""Leaving the caller's world as it was: a private copy of the model, and every RNG put back."""

from __future__ import annotations

import contextlib
import copy
import random
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

__all__ = ["clone_module", "rng_restored"]


def clone_module(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose tensors are fresh clones, without gradients.

    Parameters, buffers and tensors held as plain module attributes are cloned first and
    handed to ``copy.deepcopy`` through its memo: shared tensors (tied weights) stay shared,
    and fake tensors are cloned in the active ``FakeTensorMode`` (``deepcopy`` of a fake
    tensor makes a second mode, which torch then refuses to mix with the first).
    """
    memo: dict[int, Any] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
        for b in module._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = b.detach().clone()
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


@contextlib.contextmanager
def rng_restored(*, uses_cuda: bool = False) -> Iterator[None]:
    """Run a block and put back torch's (CPU and every CUDA device), Python's and, if
    imported, NumPy's random states.

    Args:
        uses_cuda: the block will use CUDA. CUDA is then initialised first, so the states saved
            are the ones ``torch.manual_seed`` queued for its lazy start.
    """
    if uses_cuda:
        torch.cuda.init()
    cpu = torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    py = random.getstate()
    numpy = sys.modules.get("numpy")
    np_state = numpy.random.get_state() if numpy is not None else None
    try:
        yield
    finally:
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        random.setstate(py)
        if numpy is not None and np_state is not None:
            numpy.random.set_state(np_state)
