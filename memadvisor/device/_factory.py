"""Making the device a plan runs on, from the capabilities its name stands for."""

from __future__ import annotations

from collections.abc import Sequence

from memadvisor.device._base import Device
from memadvisor.schema.device import DeviceCapabilities, DeviceKind, named_capabilities
from memadvisor.schema.profile import Profile

__all__ = ["make_device", "planned_capabilities"]


def planned_capabilities(asked: DeviceKind, device: Device | None = None) -> DeviceCapabilities:
    """The capabilities of the device a plan runs on: ``device``'s own, else those of the
    device the name ``asked`` makes ("auto": CUDA when a card is there, else the simulated
    CPU device; "estimate": none, every figure estimated).

    Raises:
        BadInputError: "cuda" was asked and there is no CUDA device.
    """
    if device is not None:
        return device.capabilities
    return named_capabilities(asked)


def make_device(
    capabilities: DeviceCapabilities,
    budget_bytes: int,
    *,
    target: str | None,
    profile: Profile,
    strategy_names: Sequence[str] | None,
    world_size: int = 1,
    parallel: str = "none",
) -> Device:
    """A fresh built-in device with ``capabilities`` (:func:`planned_capabilities`) under
    ``budget_bytes``: the card where its tensors are CUDA's, else the simulated CPU device;
    with ``parallel`` ("ddp", "fsdp2") ``world_size`` ranks of that kind, each under the budget.

    Args:
        target: ``"file.py:factory"`` when there is one: CUDA runs rebuild the workload from
            it in fresh processes.
        profile: the profile the plan reads (strategies check choices against it).
        strategy_names: the strategies a run loads to apply a candidate (None: all).
    """
    on_cards = capabilities.tensor_device == "cuda"
    if parallel != "none":
        from memadvisor.device.ranks import Ranks

        return Ranks(
            budget_bytes,
            world_size,
            backend="cuda" if on_cards else "simulated",
            target=target,
            profile=profile,
            strategy_names=strategy_names,
        )
    if on_cards:
        from memadvisor.device.cuda import CudaDevice  # starts no process until a run

        return CudaDevice(
            budget_bytes, target=target, profile=profile, strategy_names=strategy_names
        )
    from memadvisor.device.simulated import SimulatedDevice

    return SimulatedDevice(budget_bytes, profile=profile, strategy_names=strategy_names)
