"""Mixed precision: run the forward under bf16 (or fp16) autocast.

Choices are ``"fp32"`` (off) and the one low precision the profiled device supports: bf16
where it can, else fp16 (which needs a ``GradScaler`` in the training loop: a model cannot
carry one, so the advice shows it and :func:`grad_scaler_for` makes one for our own steps).
Neither is offered on a device that lacks it.

Applying it installs :class:`AutocastForward` on the model's root module. Weights, gradients
and optimizer state stay fp32; outputs come back in whatever dtype autocast produced.

:func:`check_numerics` trains copies of the model a few steps in fp32 and in the low
precision from the same start and reports how far the losses and gradients drift.
"""

from __future__ import annotations

import copy
import math
from typing import TYPE_CHECKING, Any

import torch
from pydantic import JsonValue
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.strategy import Advice, Check, Strategy
from memadvisor.workload import train_step
from strategies import _forward
from strategies._format import how_known, loss_line, mib

if TYPE_CHECKING:
    from memadvisor.config import PlanConfig
    from memadvisor.estimate import StepModel
    from memadvisor.profiler import Profile
    from memadvisor.workload import Workload

__all__ = [
    "AutocastForward",
    "Precision",
    "check_numerics",
    "grad_scaler_for",
    "precision_of",
]

_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_PRECISIONS = ("fp32", "bf16", "fp16")

# What check_numerics calls fine. bf16 keeps 8 bits of mantissa (~0.4% relative error per
# value); a loss that moves by more than 2%, or gradients whose direction moves by more than
# 25% relative L2 after a few steps, is worth a person's look before a long run.
LOSS_TOLERANCE = 0.02
GRAD_TOLERANCE = 0.25


def _check_choice(choice: JsonValue) -> str:
    if choice not in _PRECISIONS:
        raise BadInputError(f"A precision choice is one of {_PRECISIONS}, but got {choice=}.")
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
        with torch.autocast(_device_type(self.module), dtype=_DTYPES[self.precision]):
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

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        if profile.device.bf16_supported:
            return ["fp32", "bf16"]
        if profile.device.fp16_supported:
            return ["fp32", "fp16"]
        return ["fp32"]

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        precision = _check_choice(choice)
        if precision != "fp32":
            model.use_precision(precision)

    def apply(self, model: nn.Module, choice: JsonValue, profile: Profile | None) -> nn.Module:
        """Run ``model``'s forward under autocast; 'fp32' takes a previous one off.

        Raises:
            BadInputError: ``choice`` is not a precision, or the profile's device lacks it.
        """
        precision = _check_choice(choice)
        if precision == "fp32":
            _forward.remove(model, AutocastForward)
            return model
        if profile is not None and profile.device.kind != "fake":
            supported = {
                "bf16": profile.device.bf16_supported,
                "fp16": profile.device.fp16_supported,
            }[precision]
            if not supported:
                raise BadInputError(
                    f"{precision} is not supported on {profile.device.name}, the device this "
                    f"plan was profiled on; but got {choice=}. Plan again on your device."
                )
        _forward.install(model, AutocastForward, precision=precision)
        return model

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
        # is not the card's numerics, and three steps of each precision of a 124M model took
        # 34 s on the CPU against about 2 s on an H200 (docs/design.md, plan speed).
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
    device: torch.device | None = None,
) -> tuple[list[float], list[torch.Tensor]]:
    """Train a copy of the workload's model ``steps`` steps on the sample batch.

    The copy goes to ``device`` (default: where the model is).

    Returns:
        Each step's loss and its gradients (unscaled, fp32, flattened, on the CPU).
    """
    device = device if device is not None else workload.device
    model = copy.deepcopy(workload.model).to(device)
    if precision != "fp32":
        _forward.install(model, AutocastForward, precision=precision)
    scaler = grad_scaler_for(precision, device.type)
    optimizer = workload.make_optimizer(model)
    params = [p for p in model.parameters() if p.requires_grad]
    batch = workload.batch(workload.sample_batch_size, device=device)
    grads: list[torch.Tensor] = []

    def record_grads(phase: str) -> None:
        # "optimizer" is announced after backward, before the step: the gradients are whole.
        if phase != "optimizer":
            return
        scale = float(scaler.get_scale()) if scaler is not None else 1.0
        flat = [
            p.grad.detach().float().flatten().cpu() / scale for p in params if p.grad is not None
        ]
        grads.append(torch.cat(flat) if flat else torch.zeros(0))

    losses: list[float] = []
    cuda = [device.index or 0] if device.type == "cuda" else []
    # The same seed for both runs (dropout draws alike), and the caller's RNG untouched.
    with torch.random.fork_rng(devices=cuda):
        torch.manual_seed(seed)
        for _ in range(steps):
            loss = train_step(
                workload, model, optimizer, batch, scaler=scaler, on_phase=record_grads
            )
            losses.append(float(loss.float()))
    return losses, grads


def _relative(diff: float, reference: float) -> float:
    if diff == 0.0:
        return 0.0
    return diff / reference if reference > 0 else math.inf


def check_numerics(
    workload: Workload,
    precision: str,
    steps: int = 3,
    seed: int = 0,
    device: torch.device | str | None = None,
) -> Check:
    """Losses and gradients of ``steps`` training steps in ``precision`` against fp32.

    Both runs start from copies of the workload's model (the user's model, optimizer and
    RNG are untouched), use the sample batch and the same seed, on ``device`` (default:
    where the model is). Gradients are compared as the relative L2 norm of their
    difference over all parameters.

    Raises:
        BadInputError: ``precision`` is not 'bf16' or 'fp16', or ``steps`` < 1.
    """
    if precision not in _DTYPES:
        raise BadInputError(f"Numerics are checked for 'bf16' or 'fp16', but got {precision=}.")
    if steps < 1:
        raise BadInputError(f"The numerics check needs at least one step, but got {steps=}.")
    where = torch.device(device) if device is not None else None
    ref_losses, ref_grads = _train_copy(workload, "fp32", steps, seed, where)
    low_losses, low_grads = _train_copy(workload, precision, steps, seed, where)
    loss_diffs = [
        _relative(abs(lo - ref), abs(ref)) for lo, ref in zip(low_losses, ref_losses, strict=True)
    ]
    grad_diffs = [
        _relative(float((lo - ref).norm()), float(ref.norm()))
        for lo, ref in zip(low_grads, ref_grads, strict=True)
    ]
    # Direction as well as size: a drift that only rescales the gradient matters less.
    grad_cosines = [
        float(torch.nn.functional.cosine_similarity(lo, ref, dim=0)) if ref.numel() else 1.0
        for lo, ref in zip(low_grads, ref_grads, strict=True)
    ]
    loss_diff = max(loss_diffs)
    grad_diff = max(grad_diffs, default=0.0)
    finite = all(math.isfinite(x) for x in (*low_losses, loss_diff, grad_diff))
    passed = finite and loss_diff <= LOSS_TOLERANCE and grad_diff <= GRAD_TOLERANCE
    summary = (
        f"{precision} vs fp32 over {steps} steps on the sample batch: losses differ by at most "
        f"{loss_diff:.2%}, gradients by {grad_diff:.2%} (relative L2; cosine similarity at "
        f"least {min(grad_cosines, default=1.0):.4f})"
    )
    if not finite:
        summary += "; the low-precision run produced inf/nan: keep fp32 or find the overflow"
    elif not passed:
        summary += (
            f"; above the {LOSS_TOLERANCE:.0%} / {GRAD_TOLERANCE:.0%} this check calls fine: "
            "compare a longer run before adopting it"
        )
    return Check(
        strategy=Precision.name,
        choice=precision,
        summary=summary + ".",
        passed=passed,
        metrics={
            "steps": float(steps),
            "loss_rel_diff_max": loss_diff,
            "grad_rel_diff_max": grad_diff,
            "grad_cosine_min": min(grad_cosines, default=1.0),
            "loss_fp32_first": ref_losses[0],
            f"loss_{precision}_first": low_losses[0],
        },
    )
