"""Activation offload: keep what the forward saves for backward in pinned host memory.

``torch.autograd.graph.save_on_cpu(pin_memory=True)`` copies each saved tensor to the host
as forward saves it and back as backward needs it. It frees nearly all activation memory on
the card and costs two copies of every saved byte over the host link, so its price is read
from the profile's measured ``host_bandwidth_bytes_per_ms``.

Choices: ``"off"`` and ``"forward"`` (everything the model's forward saves; the loss, computed
outside the model, stays). None are offered unless the profile was measured on CUDA with
the bandwidth known: on the CPU there is no other memory to offload to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from pydantic import JsonValue

from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Advice
from memadvisor.step import Step
from memadvisor.strategy import EffectOrder, Strategy
from strategies import _forward
from strategies._format import loss_line, mib

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.profile import Profile

__all__ = ["ActivationOffload", "OffloadForward", "offload_bytes"]

_CHOICES = ("off", "forward")
# Names the profiler gives activation owners outside every module.
_LOSS_OWNERS = ("<loss>",)


class OffloadForward(_forward.ForwardWrapper):
    """The module's forward with its saved tensors kept in (pinned) host memory.

    Only while training with grad enabled on a CUDA device: elsewhere nothing is saved, or
    there is no other memory to keep it in.
    """

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        on_cuda = any(p.is_cuda for p in self.module.parameters())
        if not (on_cuda and self.module.training and torch.is_grad_enabled()):
            return self.call_inner(*args, **kwargs)
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return self.call_inner(*args, **kwargs)


def _check_choice(choice: JsonValue) -> str:
    if choice in (None, False):
        return "off"
    if choice not in _CHOICES:
        raise BadInputError(f"An offload choice is one of {_CHOICES}, but got {choice=}.")
    return str(choice)


def _loss_bytes(model: StepModel) -> int:
    return sum(
        m.activation.at(model.batch_size) for m in model.step.outside if m.name in _LOSS_OWNERS
    )


def offload_bytes(model: StepModel) -> tuple[int, int]:
    """(bytes moved to the host, bytes kept for backward in all) for the StepModel as edited.

    Reads the StepModel after precision and checkpointing have edited it: a checkpointed
    block keeps (and so offloads) only its input.
    """
    kept = model.outside_activation_bytes
    for i, ckpt in enumerate(model.checkpointed):
        kept += model.block_input_bytes[i] if ckpt else model.block_activation_bytes[i]
    moved = max(0, kept - _loss_bytes(model))
    return moved, kept


class ActivationOffload(Strategy):
    """Saved activations in pinned host memory, paid for with host <-> device copies."""

    name = "offload"
    # After precision (0) and checkpointing (50): what is offloaded is what they leave kept.
    effect_order = EffectOrder.OFFLOAD

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        if not profile.device.capabilities.pinned_memory or not profile.host_bandwidth_bytes_per_ms:
            return ["off"]
        return ["off", "forward"]

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        """Moves the forward's saved bytes off the card; two copies of them cost time.

        Raises:
            BadInputError: the profile has no measured host bandwidth.
        """
        if _check_choice(choice) == "off":
            return
        bandwidth = profile.host_bandwidth_bytes_per_ms
        if not bandwidth:
            raise BadInputError(
                "Offload is priced from the measured host bandwidth, but the profile has "
                f"{bandwidth=}; profile on a CUDA device."
            )
        moved, kept = offload_bytes(model)
        if kept <= 0:
            return
        # save_on_cpu copies synchronously: device -> host in forward, back in backward.
        model.offload(moved / kept, transfer_ms=2 * moved / bandwidth)

    def apply(self, step: Step, choice: JsonValue) -> Step:
        model = step.model
        if _check_choice(choice) == "off":
            _forward.remove(model, OffloadForward)
        else:
            _forward.install(model, OffloadForward)
        return step

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        if _check_choice(choice) == "off":
            return None
        step = profile.steps["fp32"]
        b = max(profile.batch_sizes)
        loss = sum(m.activation.at(b) for m in step.outside if m.name in _LOSS_OWNERS)
        moved = max(0, step.activation_total.at(b) - loss)
        bandwidth = profile.host_bandwidth_bytes_per_ms
        cost = (
            f", about +{2 * moved / bandwidth:.1f} ms of copies per micro-batch at the "
            f"measured {bandwidth / 1e6:.1f} GB/s"
            if bandwidth
            else ""
        )
        return Advice(
            strategy=self.name,
            title="Offload activations to host memory",
            sentence=(
                "Keep the tensors the forward saves for backward in pinned host memory and "
                "copy them back as backward needs them: the card holds almost no activations, "
                "at the price of two copies over the host link."
            ),
            snippet=(
                "with torch.autograd.graph.save_on_cpu(pin_memory=True):\n"
                f"    {loss_line(profile.call_form)}\n"
                "loss.backward()\n"
            ),
            effect=f"estimated at batch {b}, fp32: {mib(moved)} MiB off the card{cost}",
        )
