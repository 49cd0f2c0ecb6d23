"""Mixed precision: run the forward under bf16 (or fp16) autocast, or fp32 matmuls in TF32.

Choices are ``"fp32"`` (off), the one low precision the profiled device supports (bf16 where
it can, else fp16, which needs a ``GradScaler`` in the training loop: a model cannot carry
one, so the advice shows it and :func:`grad_scaler_for` makes one for our own steps), and
``"tf32"`` on a card whose matmuls have it (compute capability 8.0 and up): fp32 everywhere,
but fp32 matmuls round their inputs to TF32's 10-bit mantissa (cuDNN's convolutions already
do by default: ``torch.backends.cudnn.allow_tf32``). None is offered on a device that lacks
it; the CPU has no TF32.

Applying bf16/fp16 installs :class:`AutocastForward` on the model's root module. Weights,
gradients and optimizer state stay fp32; outputs come back in whatever dtype autocast
produced. Applying tf32 installs :class:`TF32Matmuls`, which switches TF32 on for the whole
process (``torch.set_float32_matmul_precision("high")``: a process-wide setting, not the
model's) when installed and when a saved model is loaded; ``"highest"`` switches it off.

:func:`check_numerics` (``strategies/_numerics.py``) trains copies of the model a few steps
in fp32, in fp32 perturbed by the low precision's rounding (fp32's own spread), and in the
low precision, and fails the low precision only where it is worse than that spread. It
decides: before the search, :meth:`Precision.screen` checks what the device offers, and one
that fails is not offered (fp16 with a GradScaler instead of bf16 where the device has it
and it passes, else fp32), unless the config says ``checks="report"``. The screen runs the
check at the cost a plan can bear (issue 26: at most 10% of its wall): spread runs only as
long as the verdict needs (the same verdicts), one fp32 reference for every precision
checked, and on the CPU, where the plan itself is steps of the model, 4 steps instead of 8.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import JsonValue
from torch import nn

from memadvisor import _torch_private
from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Advice, Check, LoopLines, ReportPart
from memadvisor.schema.facts import Facts
from memadvisor.schema.precision import FULL, PRECISIONS
from memadvisor.step import Step
from memadvisor.strategy import (
    Checked,
    Described,
    EffectOrder,
    HandTried,
    Strategy,
    TimedEachChoice,
)
from strategies import _forward
from strategies._autocast import AutocastForward, grad_scaler_for
from strategies._format import how_known, loss_line, mib
from strategies._numerics import (
    CPU_PLAN_STEPS,
    NUMERICS_MAX_BATCH,
    NUMERICS_STEPS,
    ROUNDING,
    FP32Runs,
    check_device,
    check_numerics,
)

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.plan import Plan
    from memadvisor.schema.profile import Profile
    from memadvisor.workload import Workload

__all__ = [
    "CHOICES",
    "NUMERICS_MAX_BATCH",
    "ROUNDING",
    "TF32_OFF",
    "TF32_ON",
    "AutocastForward",
    "Precision",
    "TF32Matmuls",
    "check_numerics",
    "grad_scaler_for",
    "precision_of",
]

#: Every choice this strategy takes: the profile's precisions and fp32 with TF32 matmuls.
CHOICES: tuple[str, ...] = (*PRECISIONS, "tf32")
#: How TF32 is switched on and off: one process-wide setting (every fp32 matmul after it).
TF32_ON = 'torch.set_float32_matmul_precision("high")'
TF32_OFF = 'torch.set_float32_matmul_precision("highest")'


def _check_choice(choice: JsonValue) -> str:
    if choice not in CHOICES:
        raise BadInputError(f"A precision choice is one of {CHOICES}, but got {choice=}.")
    return str(choice)


class TF32Matmuls(_forward.ForwardWrapper):
    """Marks a model planned in fp32 with TF32 matmuls, and switches TF32 on for the process.

    TF32 is not the model's: it is one process-wide setting that every fp32 matmul after it
    reads, ``torch.set_float32_matmul_precision("high")``. Installing
    this wrapper sets it, and so does loading a saved model that carries it (``__setstate__``),
    so a model trains as planned wherever it goes; removing it (applying 'fp32') restores
    the setting it found. ``torch.set_float32_matmul_precision("highest")`` switches it off
    for the process at any time; the forward itself does not set it again.
    """

    def __init__(self, module: nn.Module, inner: Any) -> None:
        super().__init__(module, inner)
        self.found = _torch_private.matmul_precision_state()
        torch.set_float32_matmul_precision("high")

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        torch.set_float32_matmul_precision("high")

    def restore(self) -> None:
        """Put back the process-wide setting this wrapper found when installed."""
        if isinstance(self.found, str):  # a wrapper pickled before the newer API's fields
            torch.set_float32_matmul_precision(self.found)
        else:
            _torch_private.restore_matmul_precision(self.found)


def precision_of(model: nn.Module) -> str:
    """The precision applied to ``model`` by this strategy: 'fp32' when none."""
    if _forward.find_wrapper(model, TF32Matmuls) is not None:
        return "tf32"
    wrapper = _forward.find_wrapper(model, AutocastForward)
    return wrapper.precision if wrapper is not None else "fp32"


def _remove_tf32(model: nn.Module) -> None:
    wrapper = _forward.find_wrapper(model, TF32Matmuls)
    if wrapper is not None:
        wrapper.restore()
        _forward.remove(model, TF32Matmuls)


class Precision(Strategy, TimedEachChoice, Described, HandTried, Checked):
    """bf16 / fp16 autocast of the forward, or TF32 matmuls in fp32."""

    name = "precision"
    # First: use_precision() reads a different measured step and resets the activation
    # numbers every other strategy then edits.
    effect_order = EffectOrder.PRECISION
    # The estimate's step times for autocast can be off by more than the gap between
    # candidates (docs/design.md, "Re-ranking on the device"): the planner times each
    # precision, everything else plain, beside the estimate's best.
    installs = "autocast"

    def is_neutral(self, choice: JsonValue) -> bool:
        """fp32 (no autocast) is this strategy's off."""
        return choice in (None, "off", FULL)

    def describe(self, choice: JsonValue, plan: Plan) -> ReportPart:
        """The answer's Precision row (fp32 too), the profiled step the pick runs, and, for
        a low precision, what autocast inside the forward means for the user's loop: the
        loss sees low-precision logits, and fp16 needs a GradScaler."""
        precision = FULL if self.is_neutral(choice) or not isinstance(choice, str) else choice
        if precision == FULL:
            return ReportPart(
                label="Precision", words=f"{FULL} (no autocast)", brief=FULL, step_precision=FULL
            )
        if precision == "tf32":
            return ReportPart(
                label="Precision",
                words=f"fp32 with TF32 matmuls (process-wide: {TF32_ON}; off: {TF32_OFF})",
                brief="tf32",
                step_precision=FULL,
                loop=LoopLines(
                    setup=[f"{TF32_ON}  # TF32 matmuls, process-wide; apply_plan sets it too"]
                ),
            )
        how = "measured" if plan.capabilities.measures_memory else "estimated"
        profile = plan.profile
        form = profile.call_form if profile is not None else None
        if form is not None and form.loss != "loss_fn":  # the model's own loss, in its forward
            notes = [f"# The model's own loss runs inside forward, under autocast, as {how}."]
        else:
            notes = [
                f"# The plan {how} your loss_fn on this output as it comes; upcast",
                "# (output.float()) only if your loss_fn did, or its memory was not planned.",
            ]
        loop = LoopLines(
            forward_comment=f"{precision}: autocast runs inside forward", forward_notes=notes
        )
        if precision == "fp16":
            device = profile.device.capabilities.trains_on if profile is not None else "cuda"
            loop.setup = [
                f'scaler = torch.amp.GradScaler("{device}")  # fp16 needs one; bf16 does not'
            ]
            loop.backward = "scaler.scale(loss).backward()"
            loop.step = "scaler.step(optimizer); scaler.update()"
        return ReportPart(
            label="Precision",
            words=f"{precision} autocast",
            brief=precision,
            step_precision=precision if precision in PRECISIONS else None,
            loop=loop,
        )

    def by_hand(self, options: Sequence[JsonValue]) -> tuple[str, JsonValue] | None:
        """ "+AMP": bf16 autocast where offered, else fp16."""
        amp = next((p for p in ("bf16", "fp16") if p in options), None)
        return None if amp is None else ("+AMP", amp)

    def __init__(self) -> None:
        # Low precisions whose numerics check failed in this plan's screen (not offered).
        self.rejected: set[str] = set()

    def _low(self, profile: Profile) -> list[str]:
        """The low precisions the device runs, preferred first: bf16 needs no GradScaler."""
        return [p for p in ("bf16", "fp16") if _supported(profile, p)]

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        offered = [p for p in self._low(profile) if p not in self.rejected]
        tf32 = _supported(profile, "tf32") and "tf32" not in self.rejected
        return ["fp32", *(["tf32"] if tf32 else []), *offered[:1]]

    def screen(self, workload: Workload, profile: Profile, config: PlanConfig) -> list[Check]:
        """Check what :meth:`choices` would offer; what fails (when ``config.checks`` is
        'decide') is not offered: for a failed bf16 the next precision the device runs (fp16,
        with a GradScaler) is checked in its place; TF32 is checked on its own."""
        self.rejected = set()
        checks: list[Check] = []
        # One pass: the fp32 runs are the same for every precision checked here, and the
        # spread runs only as long as each verdict needs (the same verdicts: _numerics.py).
        how = {
            "device": check_device(),
            "steps": _screen_steps(profile),
            "spread": "needed",
            "fp32": FP32Runs(),
        }
        for precision in self._low(profile):
            check = check_numerics(workload, precision, **how)
            checks.append(check)
            if check.passed or config.checks == "report":
                break
            self.rejected.add(precision)
        if _supported(profile, "tf32"):
            check = check_numerics(workload, "tf32", **how)
            checks.append(check)
            if not check.passed and config.checks != "report":
                self.rejected.add("tf32")
        return checks

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        precision = _check_choice(choice)
        # TF32 keeps fp32's memory; its speed is the card's to measure (the planner times
        # each precision on the device: guarded).
        if precision not in ("fp32", "tf32"):
            model.use_precision(precision)

    def apply(self, step: Step, choice: JsonValue) -> Step:
        """Run ``model``'s forward under autocast, or switch TF32 on (process-wide: see
        :class:`TF32Matmuls`); 'fp32' takes either off.

        Raises:
            BadInputError: ``choice`` is not a precision, or the profile's device lacks it.
        """
        model = step.model
        self.validate(step, choice)
        precision = _check_choice(choice)
        if precision in ("fp32", "tf32"):
            _forward.remove(model, AutocastForward)
        if precision != "tf32":
            _remove_tf32(model)
        if precision == "tf32":
            _forward.install(model, TF32Matmuls)
        elif precision != "fp32":
            _forward.install(model, AutocastForward, precision=precision)
        return step

    def validate(self, step: Step, choice: JsonValue) -> None:
        """Raises ``BadInputError``: not a precision, or the profile's device lacks it."""
        profile = step.profile
        precision = _check_choice(choice)
        if precision == "fp32" or profile is None or profile.device.capabilities.fake_tensors:
            return
        if not _supported(profile, precision):
            raise BadInputError(
                f"{precision} is not supported on {profile.device.name}, the device this "
                f"plan was profiled on; but got {choice=}. Plan again on your device."
            )

    states = frozenset({"autocast", "tf32"})

    def facts(self, choice: JsonValue) -> Facts:
        precision = _check_choice(choice)
        if precision == "tf32":
            return Facts(tf32=True)
        return Facts(autocast=precision) if precision in ("bf16", "fp16") else Facts()

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        precision = _check_choice(choice)
        if precision == "fp32":
            return None
        if precision == "tf32":
            return _tf32_advice(self.name)
        device_type = profile.device.capabilities.trains_on
        dtype = "torch.bfloat16" if precision == "bf16" else "torch.float16"
        sentence = (
            f"Run the forward and the loss under {precision} autocast: matmuls and convolutions "
            f"compute in {precision} and keep {precision} activations, while weights, gradients "
            "and optimizer state stay fp32."
        )
        if precision == "fp16":
            sentence += (
                " fp16 needs a GradScaler (bf16 is not available on this device): small "
                "gradients underflow in fp16 without one."
            )
        return Advice(
            strategy=self.name,
            title=f"{precision} autocast",
            sentence=sentence,
            snippet=_snippet(precision, device_type, dtype, loss_line(profile.call_form)),
            effect=_effect_text(profile, precision),
        )

    def check(self, workload: Workload, choice: JsonValue) -> Check | None:
        precision = _check_choice(choice)
        if precision == "fp32":
            return None
        # On the card when there is one (the user's model may sit on the CPU): CPU autocast
        # is not the card's numerics, and it is many times slower (docs/design.md, plan speed).
        return check_numerics(workload, precision, device=check_device())


def _supported(profile: Profile, precision: str) -> bool:
    """Whether the profile's device runs ``precision``: its autocast's low precisions (its
    capabilities), TF32 where the card the profile measured on has it."""
    if precision == "fp32":
        return True
    if precision == "tf32":
        return profile.device.tf32_supported
    return profile.device.capabilities.offers_autocast(precision)


def _tf32_advice(strategy: str) -> Advice:
    return Advice(
        strategy=strategy,
        title="TF32 matmuls",
        sentence=(
            "Keep fp32 and let matmuls round their inputs to TF32 (10-bit mantissa, fp32's "
            "range) on the card's tensor cores, as cuDNN's convolutions already do by default: "
            "weights, activations, "
            "gradients and optimizer state stay fp32. It is a process-wide setting, not the "
            f"model's: apply_plan switches it on for the whole process ({TF32_ON}); "
            f"{TF32_OFF} switches it off."
        ),
        snippet=(
            f"{TF32_ON}  # process-wide: every fp32 matmul from here on\n"
            "# ... train as usual: no autocast, no GradScaler ...\n"
            f"{TF32_OFF}  # off again (the default)\n"
        ),
        effect="same memory as fp32; its speed is measured on the card",
    )


def _effect_text(profile: Profile, precision: str) -> str:
    low = profile.steps.get(precision)
    if low is None:
        return f"not measured: the profile has no {precision} step"
    fp32 = profile.steps["fp32"]
    b = max(profile.batch_sizes)
    saved = fp32.activation_total.at(b) - low.activation_total.at(b)
    fp32_ms, low_ms = fp32.step_ms.at(b), low.step_ms.at(b)
    speed = f", step {fp32_ms:.1f} -> {low_ms:.1f} ms" if fp32_ms > 0 and low_ms > 0 else ""
    if speed and profile.flops is not None:
        speed += " (modelled from FLOPs)"
    return (
        f"{how_known(profile)} at batch {b} in profiling: activations "
        f"{mib(fp32.activation_total.at(b))} -> "
        f"{mib(low.activation_total.at(b))} MiB ({mib(saved)} MiB less){speed}; "
        f"+{mib(low.cast_weight_bytes)} MiB of {precision} weight copies during forward"
    )


def _snippet(precision: str, device_type: str, dtype: str, loss: str) -> str:
    if precision == "bf16":
        return f"""\
with torch.autocast("{device_type}", dtype={dtype}):
    {loss}
loss.backward()
optimizer.step()
optimizer.zero_grad(set_to_none=True)
"""
    return f"""\
scaler = torch.amp.GradScaler("{device_type}")  # once, before the loop

with torch.autocast("{device_type}", dtype={dtype}):
    {loss}
scaler.scale(loss).backward()
scaler.step(optimizer)  # skips the step if gradients overflowed
scaler.update()
optimizer.zero_grad(set_to_none=True)
"""


def _screen_steps(profile: Profile) -> int:
    """How many steps the screen's checks train: 8 where the copies train on a card or the
    plan's runs cost more than their steps (processes, contexts: a card's plan of 100-450 s),
    else :data:`CPU_PLAN_STEPS`. On the CPU every stage of a plan is steps of this model in
    this process (profile, probes, verification: plans of 4-40 s), so the check's steps are a
    share of the plan's whatever they cost: 8 of each run there were 10-25% of the README
    examples' plans (docs/design.md, "Precision check")."""
    on_a_card = check_device() is not None
    if on_a_card or profile.device.capabilities.runs_cost_more_than_steps:
        return NUMERICS_STEPS
    return CPU_PLAN_STEPS
