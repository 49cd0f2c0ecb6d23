"""Which device a plan runs on, and making it: the one place that knows the device kinds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from memadvisor.device._base import Device
from memadvisor.errors import BadInputError
from memadvisor.schema.profile import Profile

__all__ = ["make_device", "resolve_kind"]


def resolve_kind(asked: str, device: Device | None = None) -> str:
    """The device kind a plan runs on: ``device``'s own, else ``asked`` ("auto": CUDA when a
    card is there, else the simulated CPU device).

    Raises:
        BadInputError: "cuda" was asked and there is no CUDA device.
    """
    if device is not None:
        return device.kind
    if asked == "auto":
        return "cuda" if torch.cuda.is_available() else "simulated"
    if asked == "cuda" and not torch.cuda.is_available():
        raise BadInputError(
            "device='cuda' needs a CUDA device, but torch.cuda.is_available() is False; use "
            "device='simulated' (or 'auto') to plan on the CPU."
        )
    return asked


def make_device(
    kind: str,
    budget_bytes: int,
    *,
    target: str | None,
    profile: Profile,
    strategy_names: Sequence[str] | None,
    world_size: int = 1,
    parallel: str = "none",
) -> Device:
    """A fresh device of ``kind`` ("cuda" or "simulated") under ``budget_bytes``; with
    ``parallel`` ("ddp", "fsdp2") ``world_size`` ranks of that kind, each under the budget.

    Args:
        target: ``"file.py:factory"`` when there is one: CUDA runs rebuild the workload from
            it in fresh processes.
        profile: the profile the plan reads (strategies check choices against it).
        strategy_names: the strategies a run loads to apply a candidate (None: all).
    """
    if parallel != "none":
        from memadvisor.device.ranks import Ranks

        return Ranks(
            budget_bytes,
            world_size,
            backend="cuda" if kind == "cuda" else "simulated",
            target=target,
            profile=profile,
            strategy_names=strategy_names,
        )
    if kind == "cuda":
        from memadvisor.device.cuda import CudaDevice  # starts no process until a run

        return CudaDevice(
            budget_bytes, target=target, profile=profile, strategy_names=strategy_names
        )
    from memadvisor.device.simulated import SimulatedDevice

    return SimulatedDevice(budget_bytes, profile=profile, strategy_names=strategy_names)
