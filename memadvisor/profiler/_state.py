"""Leaving the caller's model as it was: a private copy of it, or its tensors put back.

The RNG states are put back by :func:`memadvisor.process_state.rng_restored`.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from memadvisor.errors import BadInputError

__all__ = ["check_copyable", "clone_module", "private_model"]


def clone_module(
    model: nn.Module,
    device: torch.device | None = None,
    make: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> nn.Module:
    """A deep copy of ``model`` whose tensors are fresh clones, without gradients; with
    ``device``, its parameters and buffers are cloned there (tensors held as plain module
    attributes stay where they are, as ``Module.to`` leaves them); with ``make``, each
    parameter's and buffer's copy is ``make(it)``, made once per tensor (the numerics
    check's copies from pinned host memory: ``strategies._numerics.Weights``).

    Parameters, buffers and tensors held as plain module attributes are cloned first and
    handed to ``copy.deepcopy`` through its memo: shared tensors (tied weights) stay shared,
    and fake tensors are cloned in the active ``FakeTensorMode`` (``deepcopy`` of a fake
    tensor makes a second mode, which torch then refuses to mix with the first).

    Why ``device``: a clone on the host and then ``.to(device)`` copies every byte twice
    and allocates the model's size in host memory (lm350m, 1.4 GB: 4.1 s for the host
    clone alone on a 2-core machine); cloned straight to the card, once.
    """

    def fresh(t: torch.Tensor) -> torch.Tensor:
        if make is not None:
            return make(t)
        t = t.detach()
        return t.clone() if device is None else t.to(device, copy=True)

    memo: dict[int, Any] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(fresh(p), requires_grad=p.requires_grad)
        for b in module._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = fresh(b)
        for value in vars(module).values():
            if isinstance(value, torch.Tensor) and id(value) not in memo:
                memo[id(value)] = value.detach().clone()
    return copy.deepcopy(model, memo)


def check_copyable(model: nn.Module) -> None:
    """Refuse a model ``copy.deepcopy`` cannot copy, before anything runs it.

    Planning trains copies only (the caller's model stays as it is); a model holding a lock,
    an open file or a connection cannot be copied. Checked without copying a tensor: every
    tensor is its own copy in the memo, so only the Python objects around them are copied.

    Raises:
        BadInputError: the copy fails; the message names the error and the fix.
    """
    memo: dict[int, Any] = {}
    for module in model.modules():
        for t in (*module._parameters.values(), *module._buffers.values(), *vars(module).values()):
            if isinstance(t, torch.Tensor):
                memo[id(t)] = t
    try:
        copy.deepcopy(model, memo)
    except Exception as e:  # noqa: BLE001 - whatever deepcopy raises, the model is not copyable
        raise BadInputError(
            f"The model cannot be copied with copy.deepcopy ({type(e).__name__}: {e}). "
            "memadvisor measures copies so that your model stays as it is: hold the object "
            "that cannot be copied (a lock, an open file, a connection) outside the module, "
            "or give its class a __deepcopy__."
        ) from e


@contextlib.contextmanager
def private_model(model: nn.Module, device: torch.device) -> Iterator[nn.Module]:
    """A model to profile on ``device``: a clone (:func:`clone_module`), or where the model
    cannot be deep-copied, the model itself, with its tensors put back afterwards.

    The fallback saves every parameter, buffer, gradient and tensor attribute (on the host,
    so the card's numbers are not disturbed) and restores them in place (values) and by
    reference (gradients, buffers and attributes a forward reassigned). Non-tensor state a
    forward changes (a Python counter) is not restored.

    Raises:
        BadInputError: the model cannot be copied and is not on ``device`` (moving the
            caller's own model is not ours to do).
    """
    try:
        clone = clone_module(model, device)
    except Exception as e:  # noqa: BLE001 - any deepcopy failure: fall back, said in the error
        copy_error = e
    else:
        yield clone.to(device)  # its parameters and buffers are there: the rest, as before
        return
    first = next(iter(model.parameters()), None)
    if first is not None and first.device.type != device.type:
        raise BadInputError(
            f"The model cannot be deep-copied ({type(copy_error).__name__}: {copy_error}), so "
            f"it is profiled in place, and it is on {first.device}, not {device}: move it to "
            f"{device} first, or pass device='{first.device.type}'."
        ) from copy_error
    saved = _Snapshot(model)
    try:
        yield model
    finally:
        saved.restore()


class _Snapshot:
    """Every tensor of a model, saved on the host, and where each one was held."""

    def __init__(self, model: nn.Module) -> None:
        self.params = [(p, _host(p), p.grad) for p in _unique(model.parameters())]
        self.tensors = [(t, _host(t)) for t in _unique(model.buffers())]
        self.slots: list[tuple[dict[str, Any], str, Any]] = []
        for module in model.modules():
            for d in (module._buffers, vars(module)):
                self.slots += [(d, k, v) for k, v in d.items() if isinstance(v, torch.Tensor)]
            self.tensors += [
                (v, _host(v))
                for v in vars(module).values()
                if isinstance(v, torch.Tensor) and not isinstance(v, nn.Parameter)
            ]
        for p, _, _ in self.params:
            p.grad = None  # the step starts without gradients, as train_step leaves them

    def restore(self) -> None:
        for d, key, value in self.slots:
            d[key] = value
        with torch.no_grad():
            for t, host in [(p, h) for p, h, _ in self.params] + self.tensors:
                t.copy_(host)
        for p, _, grad in self.params:
            p.grad = grad


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _unique(tensors: Any) -> list[torch.Tensor]:
    return list({id(t): t for t in tensors}.values())
