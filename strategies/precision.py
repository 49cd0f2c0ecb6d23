"""Mixed precision: run the forward under bf16 (or fp16) autocast.

Choices are ``"fp32"`` (off) and the one low precision the profiled device supports: bf16
where it can, else fp16 (which needs a ``GradScaler`` in the training loop: a model cannot
carry one, so the advice shows it and :func:`grad_scaler_for` makes one for our own steps).
Neither is offered on a device that lacks it.

Applying it installs :class:`AutocastForward` on the model's root module. Weights, gradients
and optimizer state stay fp32; outputs come back in whatever dtype autocast produced.

:func:`check_numerics` trains copies of the model a few steps in fp32 and in the low
precision from the same start and compares the loss curves. It decides: before the search,
:meth:`Precision.screen` checks the low precision the device offers, and one that fails is
not offered (fp16 with a GradScaler instead where the device has it and it passes, else
fp32), unless the config says ``checks="report"``.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import JsonValue
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Advice, Check, LoopLines, ReportPart
from memadvisor.schema.precision import AUTOCAST_DTYPES, FULL, PRECISIONS
from memadvisor.strategy import Strategy
from memadvisor.workload import train_step
from strategies import _forward
from strategies._format import how_known, loss_line, mib

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.plan import Plan
    from memadvisor.schema.profile import Profile
    from memadvisor.workload import Workload

__all__ = [
    "AutocastForward",
    "Precision",
    "check_numerics",
    "grad_scaler_for",
    "precision_of",
]


# What check_numerics calls safe: the low-precision loss curve within 5% of fp32's (of the
# fp32 loss's size) at every step, allowing the curve to run one step ahead or behind where
# it falls steeply. bf16 keeps 8 bits of mantissa (~0.4% per value): a curve that parts by
# ten times that has lost something fp32 learns.
LOSS_TOLERANCE = 0.05
# 16 steps at 8 samples: long enough for a curve to part (drift grows with the steps it
# compounds over), short enough to cost 2 x 16 small steps. Where steps are slow (a large
# model on the CPU) the fp32 run stops once it has taken NUMERICS_TIME_S and at least
# NUMERICS_MIN_STEPS, and the low-precision run takes as many steps.
NUMERICS_STEPS = 16
NUMERICS_MIN_STEPS = 4
NUMERICS_MAX_BATCH = 8
NUMERICS_TIME_S = 5.0


def _loss_drift(low: list[float], ref: list[float]) -> float:
    """How far the low-precision loss curve strays from fp32's, as a share of fp32's largest
    loss: at each step, the distance from the low loss to the range fp32's curve spans over
    that step and its two neighbours, the largest over the steps.

    Why the neighbours: a few samples trained for a few steps are memorised, and the loss
    can fall by a tenth of its size in a step (a ViT on an H200: 6.9 to 0.12 in 16 steps).
    Where it falls that steeply, a curve that runs a fraction of a step ahead differs from
    fp32's by more than 5% at that step while training the same; a curve that has *parted*
    from fp32's stays outside the neighbours' range too.
    """
    scale = max(abs(x) for x in ref) or 1.0
    worst = 0.0
    for t, value in enumerate(low):
        near = ref[max(t - 1, 0) : t + 2]
        below, above = min(near), max(near)
        gap = below - value if value < below else value - above if value > above else 0.0
        worst = max(worst, gap)
    return worst / scale


def _check_choice(choice: JsonValue) -> str:
    if choice not in PRECISIONS:
        raise BadInputError(f"A precision choice is one of {PRECISIONS}, but got {choice=}.")
    return str(choice)


def _device_type(module: nn.Module) -> str:
    for t in module.parameters():
        return t.device.type
    for t in module.buffers():
        return t.device.type
    return "cpu"


class AutocastForward(_forward.ForwardWrapper):
    """The module's forward under ``torch.autocast`` on the device its parameters are on.

    The device is read at each call, so the model can be moved after applying.
    """

    def __init__(self, module: nn.Module, inner: Any, precision: str = "bf16") -> None:
        super().__init__(module, inner)
        self.precision = precision

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autocast(_device_type(self.module), dtype=AUTOCAST_DTYPES[self.precision]):
            return self.call_inner(*args, **kwargs)


def precision_of(model: nn.Module) -> str:
    """The precision applied to ``model`` by this strategy: 'fp32' when none."""
    wrapper = _forward.find_wrapper(model, AutocastForward)
    return wrapper.precision if wrapper is not None else "fp32"


def grad_scaler_for(precision: str, device_type: str) -> torch.amp.GradScaler | None:
    """A fresh GradScaler for fp16 (whose small gradients underflow without one), else None."""
    if precision != "fp16":
        return None
    return torch.amp.GradScaler(device_type)


class Precision(Strategy):
    """bf16 / fp16 autocast of the forward."""

    name = "precision"
    # First: use_precision() reads a different measured step and resets the activation
    # numbers every other strategy then edits.
    effect_order = 0
    # The estimate's step times for autocast can be off by more than the gap between
    # candidates (docs/design.md, "Re-ranking on the device"): the planner times each
    # precision, everything else plain, beside the estimate's best.
    guarded = True
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
        how = "estimated" if plan.device_kind == "estimate" else "measured"
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
            device = "cpu" if profile is not None and profile.device.kind == "cpu" else "cuda"
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
        supported = {"bf16": profile.device.bf16_supported, "fp16": profile.device.fp16_supported}
        return [p for p in ("bf16", "fp16") if supported[p]]

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        offered = [p for p in self._low(profile) if p not in self.rejected]
        return ["fp32", offered[0]] if offered else ["fp32"]

    def screen(self, workload: Workload, profile: Profile, config: PlanConfig) -> list[Check]:
        """Check the low precision :meth:`choices` would offer; when it fails (and
        ``config.checks`` is 'decide') it is not offered, and the next one the device runs
        (fp16, with a GradScaler) is checked in its place."""
        self.rejected = set()
        checks: list[Check] = []
        for precision in self._low(profile):
            check = check_numerics(workload, precision, device=_check_device())
            checks.append(check)
            if check.passed or config.checks == "report":
                break
            self.rejected.add(precision)
        return checks

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        precision = _check_choice(choice)
        if precision != "fp32":
            model.use_precision(precision)

    def apply(self, model: nn.Module, choice: JsonValue, profile: Profile | None) -> nn.Module:
        """Run ``model``'s forward under autocast; 'fp32' takes a previous one off.

        Raises:
            BadInputError: ``choice`` is not a precision, or the profile's device lacks it.
        """
        self.validate(model, choice, profile)
        precision = _check_choice(choice)
        if precision == "fp32":
            _forward.remove(model, AutocastForward)
            return model
        _forward.install(model, AutocastForward, precision=precision)
        return model

    def validate(self, model: nn.Module, choice: JsonValue, profile: Profile | None) -> None:
        """Raises ``BadInputError``: not a precision, or the profile's device lacks it."""
        precision = _check_choice(choice)
        if precision == "fp32" or profile is None or profile.device.kind == "fake":
            return
        supported = {
            "bf16": profile.device.bf16_supported,
            "fp16": profile.device.fp16_supported,
        }[precision]
        if not supported:
            raise BadInputError(
                f"{precision} is not supported on {profile.device.name}, the device this "
                f"plan was profiled on; but got {choice=}. Plan again on your device."
            )

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        precision = _check_choice(choice)
        if precision == "fp32":
            return None
        device_type = "cpu" if profile.device.kind == "cpu" else "cuda"
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
        return check_numerics(workload, precision, device=_check_device())


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


# -- numerics check ----------------------------------------------------------------------


def _check_device() -> torch.device | None:
    """Where :meth:`Precision.check` trains its copies: CUDA when available, else the model's."""
    return torch.device("cuda") if torch.cuda.is_available() else None


def _train_copy(
    workload: Workload,
    precision: str,
    steps: int,
    seed: int,
    batch_size: int,
    time_s: float | None = None,
    device: torch.device | None = None,
) -> tuple[list[float], torch.Tensor]:
    """Train a copy of the workload's model ``steps`` steps on one batch of ``batch_size``.

    With ``time_s``, stop early once that long has passed and :data:`NUMERICS_MIN_STEPS`
    steps are done. The copy goes to ``device`` (default: where the model is).

    Returns:
        Each step's loss, and the first step's gradients (unscaled, fp32, flattened, on the
        CPU). A step whose loss is not finite ends the run: nothing after it means anything.
    """
    device = device if device is not None else workload.device
    model = copy.deepcopy(workload.model).to(device)
    if precision != "fp32":
        _forward.install(model, AutocastForward, precision=precision)
    scaler = grad_scaler_for(precision, device.type)
    optimizer = workload.make_optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = workload.batch(batch_size, device=device)
    first_grads: list[torch.Tensor] = []

    def record_grads(phase: str) -> None:
        # "optimizer" is announced after backward, before the step: the gradients are whole.
        if phase != "optimizer" or first_grads:
            return
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        flat = [
            p.grad.detach().double().flatten().cpu() / scale for p in params if p.grad is not None
        ]
        first_grads.append(torch.cat(flat) if flat else torch.zeros(0, dtype=torch.float64))

    losses: list[float] = []
    cuda = [device.index or 0] if device.type == "cuda" else []
    # The same seed for both runs (dropout draws alike), and the caller's RNG untouched.
    started = time.perf_counter()
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        for _ in range(steps):
            loss = train_step(
                workload, model, optimizer, batch, scaler=scaler, on_phase=record_grads
            )
            losses.append(float(loss.float()))
            if not math.isfinite(losses[-1]):
                break
            late = time_s is not None and time.perf_counter() - started > time_s
            if late and len(losses) >= NUMERICS_MIN_STEPS:
                break
    return losses, first_grads[0]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine similarity in float64, within [-1, 1] (float rounding put it at 1.0003)."""
    if a.numel() == 0:
        return 1.0
    na, nb = float(a.norm()), float(b.norm())
    if na == 0.0 or nb == 0.0:
        return 1.0 if na == nb else 0.0
    return max(-1.0, min(1.0, float(a @ b) / (na * nb)))


def check_numerics(
    workload: Workload,
    precision: str,
    steps: int = NUMERICS_STEPS,
    seed: int = 0,
    batch_size: int | None = None,
    time_s: float | None = NUMERICS_TIME_S,
    device: torch.device | str | None = None,
) -> Check:
    """Whether training in ``precision`` follows fp32's: ``steps`` steps of each from the
    same weights, batch and seed, their loss curves compared.

    What it takes to call a precision safe: no inf or nan (fp16 without its scaler, an
    overflow in bf16), and losses within :data:`LOSS_TOLERANCE` of fp32's at every step,
    relative to the fp32 loss's size. A training curve is what a person cares about; one
    step's relative gradient error on a random initialisation mostly measures gradients
    near zero (it read 97% "off" on a ResNet-18 that trains identically in bf16), so the
    first step's gradient cosine is reported but decides nothing.

    Its cost is bounded: ``2 x steps`` training steps at no more than
    :data:`NUMERICS_MAX_BATCH` samples, fewer steps (at least :data:`NUMERICS_MIN_STEPS`)
    where the fp32 run passes ``time_s``; on copies of the workload's model on ``device``
    (default: where the model is; the user's model, optimizer and RNG are untouched). Its
    wall time is in the metrics.

    Raises:
        BadInputError: ``precision`` is not 'bf16' or 'fp16', or ``steps`` < 1.
    """
    if precision not in AUTOCAST_DTYPES:
        raise BadInputError(f"Numerics are checked for 'bf16' or 'fp16', but got {precision=}.")
    if steps < 1:
        raise BadInputError(f"The numerics check needs at least one step, but got {steps=}.")
    b = batch_size or min(workload.sample_batch_size, NUMERICS_MAX_BATCH)
    started = time.perf_counter()
    where = torch.device(device) if device is not None else None
    ref, ref_grads = _train_copy(workload, "fp32", steps, seed, b, time_s, where)
    ref_finite = math.isfinite(ref[-1])
    steps = len(ref)  # fewer than asked where steps are slow: the low run takes as many
    low, low_grads = _train_copy(workload, precision, steps, seed, b, None, where)
    wall_ms = (time.perf_counter() - started) * 1e3
    low_finite = (
        len(low) == steps and math.isfinite(low[-1]) and bool(torch.isfinite(low_grads).all())
    )
    where = f"{precision} vs fp32 over {steps} training steps from the same weights on {b} samples"
    metrics = {"steps": float(steps), "batch_size": float(b), "wall_ms": wall_ms}
    if not ref_finite:
        return Check(
            strategy=Precision.name,
            choice=precision,
            summary=f"{where}: fp32 itself reached inf/nan, so the comparison says nothing.",
            passed=True,
            metrics=metrics,
        )
    if not low_finite:
        return Check(
            strategy=Precision.name,
            choice=precision,
            summary=f"{where}: {precision} reached inf/nan (at step {len(low)}), fp32 did not.",
            passed=False,
            metrics={**metrics, "finite_steps": float(len(low) - 1)},
        )
    drift = _loss_drift(low, ref)
    cosine = _cosine(low_grads, ref_grads)
    passed = drift <= LOSS_TOLERANCE
    summary = (
        f"{where}: the losses differ by at most {drift:.2%} of the fp32 loss (limit "
        f"{LOSS_TOLERANCE:.0%}), fp32 {ref[0]:.4g} -> {ref[-1]:.4g}, {precision} "
        f"{low[0]:.4g} -> {low[-1]:.4g}; first-step gradient cosine {cosine:.4f}"
    )
    return Check(
        strategy=Precision.name,
        choice=precision,
        summary=summary + ".",
        passed=passed,
        metrics={
            **metrics,
            "loss_drift_max": drift,
            "grad_cosine_first": cosine,
            "loss_fp32_first": ref[0],
            "loss_fp32_last": ref[-1],
            f"loss_{precision}_first": low[0],
            f"loss_{precision}_last": low[-1],
        },
    )
