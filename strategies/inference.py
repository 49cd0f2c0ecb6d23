"""Inference: a workload that never calls backward should keep nothing for it.

A forward run with grad enabled keeps every activation autograd would need; under
``torch.inference_mode()`` in ``eval()`` a layer's output is freed as soon as the next layer
has read it, so the peak drops from "all activations" to "the largest layer's working set",
and running the batch in chunks cuts that further. Offered only when the profile shows no
gradients and no optimizer state (an inference workload); :meth:`Inference.check` measures
the saving on a copy of the user's model with the memory meter.

Applying it puts the model in ``eval()`` and runs its forward under ``inference_mode``
(:class:`InferenceForward`): outputs are inference tensors, not for autograd.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any

import torch
from pydantic import JsonValue
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.memory import MemoryMeter
from memadvisor.schema.advice import Advice, Check
from memadvisor.step import Step
from memadvisor.strategy import Checked, Described, EffectOrder, Strategy
from strategies import _forward
from strategies._format import mib

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.profile import Profile
    from memadvisor.workload import Workload

__all__ = ["Inference", "InferenceForward", "is_inference", "measure_inference"]

_CHOICES = ("off", "advice")


def is_inference(profile: Profile) -> bool:
    """True when the profiled step trains nothing: no gradients, no optimizer state."""
    return profile.grad_bytes == 0 and profile.optimizer_state_bytes == 0


class InferenceForward(_forward.ForwardWrapper):
    """The module's forward under ``torch.inference_mode()``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.inference_mode():
            return self.call_inner(*args, **kwargs)


def _check_choice(choice: JsonValue) -> str:
    if choice in (None, False):
        return "off"
    if choice not in _CHOICES:
        raise BadInputError(f"An inference choice is one of {_CHOICES}, but got {choice=}.")
    return str(choice)


def _forward_peak(workload: Workload, model: nn.Module, batch_size: int, grad: bool) -> int:
    """Peak bytes that one forward allocates (weights not counted), output included."""
    batch = workload.batch(batch_size, device=workload.device)
    mode = torch.enable_grad() if grad else torch.inference_mode()
    with mode, MemoryMeter() as meter:
        out = workload.forward(model, batch)
        del out
    return meter.peak_bytes


def measure_inference(
    workload: Workload, batch_size: int | None = None, chunks: int = 4
) -> dict[str, float]:
    """Peak bytes of a forward with grad (train mode) vs in eval under inference_mode,
    whole and in ``chunks`` chunks; on copies of the model (the user's is untouched).

    Raises:
        BadInputError: ``batch_size`` or ``chunks`` is not positive.
    """
    b = batch_size or workload.sample_batch_size
    if b <= 0 or chunks <= 0:
        raise BadInputError(f"batch_size and chunks must be positive, but got {b=}, {chunks=}.")
    chunk = max(1, b // chunks)
    cuda = [workload.device.index or 0] if workload.device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        trained = copy.deepcopy(workload.model).train()
        with_grad = _forward_peak(workload, trained, b, grad=True)
        del trained
        model = copy.deepcopy(workload.model).eval()
        whole = _forward_peak(workload, model, b, grad=False)
        per_chunk = _forward_peak(workload, model, chunk, grad=False)
    return {
        "batch_size": float(b),
        "forward_with_grad_peak_bytes": float(with_grad),
        "inference_mode_peak_bytes": float(whole),
        "chunk_size": float(chunk),
        "chunk_peak_bytes": float(per_chunk),
    }


class Inference(Strategy, Described, Checked):
    """eval() + inference_mode + chunked batches for a workload that never trains."""

    name = "inference"
    effect_order = EffectOrder.INFERENCE

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        return ["advice"] if is_inference(profile) else ["off"]

    def changes_step(self, choice: JsonValue) -> bool:
        """Never: the profile of an inference workload measured a step without backward
        already, so every configuration the report compares runs that step, "advice" or not."""
        return False

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        """Nothing: an inference profile already measured a step without backward."""
        _check_choice(choice)

    def validate(self, step: Step, choice: JsonValue) -> None:
        """Raises ``BadInputError``: not a choice, or ``advice`` on a profile that trains
        (eval() and inference_mode would silently stop its training)."""
        profile = step.profile
        if _check_choice(choice) == "off" or profile is None or is_inference(profile):
            return
        raise BadInputError(
            f"The plan asks for inference ({choice=}) but was made for a training step (its "
            "profile has gradients and optimizer state): applying it would put the model in "
            "eval() and drop its gradients. Use a plan made for this workload."
        )

    def apply(self, step: Step, choice: JsonValue) -> Step:
        model = step.model
        self.validate(step, choice)
        if _check_choice(choice) == "off":
            _forward.remove(model, InferenceForward)
            return step
        model.eval()
        _forward.install(model, InferenceForward)
        return step

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        if _check_choice(choice) == "off":
            return None
        b = max(profile.batch_sizes)
        kept = profile.steps["fp32"].activation_total.at(b)
        return Advice(
            strategy=self.name,
            title="Run inference without autograd",
            sentence=(
                "Put the model in eval() and run it under torch.inference_mode(): nothing is "
                "kept for a backward that never comes, dropout is off and batch norm uses its "
                "running statistics. Split large batches into chunks to cap the peak at one "
                "chunk's working set."
            ),
            snippet="""\
model.eval()
with torch.inference_mode():
    outputs = torch.cat([model(chunk) for chunk in inputs.split(chunk_size)])
""",
            effect=(
                f"activations kept for backward at batch {b}: {mib(kept)} MiB "
                "(estimated from the profile; check() measures the saving)"
            ),
        )

    def check(self, workload: Workload, choice: JsonValue) -> Check | None:
        if _check_choice(choice) == "off":
            return None
        m = measure_inference(workload)
        return Check(
            strategy=self.name,
            choice=choice,
            summary=(
                f"Forward at batch {m['batch_size']:.0f}: {mib(m['forward_with_grad_peak_bytes'])}"
                f" MiB with grad, {mib(m['inference_mode_peak_bytes'])} MiB under "
                f"inference_mode, {mib(m['chunk_peak_bytes'])} MiB per chunk of "
                f"{m['chunk_size']:.0f} (measured, weights not counted)."
            ),
            passed=True,
            metrics=m,
        )
