"""Optimizer-memory habits: ``zero_grad(set_to_none=True)``, foreach or not, fused AdamW.

Advice only. The optimizer is built by the training loop, not carried by the model, so
``apply`` cannot change it and returns the model as it is; and the probes build the
workload's own optimizer, so a choice here could not be verified on the device. The strategy
therefore offers one choice, ``"advice"``, which changes neither the estimate nor the model
and exists so the advice reaches the plan; the numbers in it are the profile's measurements:

* the optimizer step's temporaries (the optimizer phase's peak above weights, gradients and
  state): ``foreach`` implementations (the default on CUDA) allocate lists of
  parameter-sized intermediates; ``foreach=False`` loops one tensor at a time, slower;
  ``fused=True`` (CUDA AdamW/Adam/SGD) does the step in fused kernels, the fastest option;
* the gradient bytes ``zero_grad(set_to_none=True)`` frees before the next forward.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import JsonValue

from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Advice
from memadvisor.step import Step
from memadvisor.strategy import Described, EffectOrder, Strategy
from strategies._format import how_known, mib

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.profile import Profile

__all__ = ["OptimizerHabits", "optimizer_temporary_bytes"]

_CHOICES = ("off", "advice")


def optimizer_temporary_bytes(profile: Profile) -> int | None:
    """The optimizer step's peak above weights, gradients and state; None if not measured."""
    step = profile.steps["fp32"]
    peaks = [p for p in step.phases if p.phase == "optimizer"]
    if not peaks:
        return None
    b = max(profile.batch_sizes)
    static = profile.param_bytes + profile.buffer_bytes + profile.grad_bytes
    return max(0, peaks[0].allocated.at(b) - static - profile.optimizer_state_bytes)


def _optimizer_is_peak(profile: Profile) -> bool:
    phases = profile.steps["fp32"].phases
    if not phases:
        return False
    b = max(profile.batch_sizes)
    top = max(phases, key=lambda p: p.allocated.at(b))
    return top.phase == "optimizer"


def _check_choice(choice: JsonValue) -> str:
    if choice in (None, False):
        return "off"
    if choice not in _CHOICES:
        raise BadInputError(f"An optimizer_habits choice is one of {_CHOICES}, but got {choice=}.")
    return str(choice)


class OptimizerHabits(Strategy, Described):
    """Advice on the optimizer's own memory; changes neither the model nor the estimate."""

    name = "optimizer_habits"
    effect_order = EffectOrder.OPTIMIZER

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        if profile.optimizer_state_bytes == 0 and profile.grad_bytes == 0:
            return ["off"]  # no optimizer: nothing to advise
        return ["advice"]

    def changes_step(self, choice: JsonValue) -> bool:
        """Never: "advice" is what the training loop could do, not what the plan runs."""
        return False

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        """Nothing: the advice is what the training loop could do, not what the plan runs."""
        _check_choice(choice)

    def apply(self, step: Step, choice: JsonValue) -> Step:
        """Returns ``step`` unchanged: the optimizer is the training loop's to build."""
        _check_choice(choice)
        return step

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        if _check_choice(choice) == "off":
            return None
        b = max(profile.batch_sizes)
        temporaries = optimizer_temporary_bytes(profile)
        parts = [
            f"zero_grad(set_to_none=True) frees {mib(profile.grad_bytes)} MiB of gradients "
            "before the next forward (the default since torch 2.0)"
        ]
        if temporaries is None:
            parts.append("optimizer-step temporaries: not measured")
        else:
            where = (
                "the optimizer step is this step's peak, so they raise it"
                if _optimizer_is_peak(profile)
                else "the peak is elsewhere, so they cost nothing here"
            )
            parts.append(
                f"the optimizer step held {mib(temporaries)} MiB of temporaries at batch {b} "
                f"({how_known(profile)}; {where})"
            )
        on_card = profile.device.capabilities.trains_on == "cuda"  # torch's fused kernels
        fused = (
            "On CUDA, fused=True runs the update in fused kernels: the fastest, with no "
            "parameter-sized lists of intermediates. "
            if on_card
            else ""
        )
        return Advice(
            strategy=self.name,
            title="Optimizer memory habits",
            sentence=(
                f"Free gradients with zero_grad(set_to_none=True). {fused}foreach=True (the "
                "CUDA default) is fast but allocates intermediates the size of the parameters "
                "during the step; foreach=False loops one tensor at a time: a lower optimizer "
                "peak, a slower step. Pick it only when the optimizer step is the peak."
            ),
            snippet=_snippet(on_card),
            effect="; ".join(parts),
        )


def _snippet(on_card: bool) -> str:
    fused = "fused=True" if on_card else "foreach=False"
    return f"""\
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, {fused})
...
optimizer.step()
optimizer.zero_grad(set_to_none=True)  # frees the gradients until the next backward
"""
