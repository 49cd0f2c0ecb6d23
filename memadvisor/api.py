"""The two calls most users need: ``plan()`` says what fits, ``optimize()`` applies it.

    tuned = memadvisor.optimize(model, sample_batch, budget_gb=8)
    tuned.memadvisor_plan.candidate.batch_size      # the batch to train with

Both leave the caller's weights, gradients, optimizer state, RNG states and train/eval
flags as they were: every profiling step, probe and verification runs on copies.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from memadvisor.config import PlanConfig, gib_to_bytes
from memadvisor.device import Device
from memadvisor.errors import BadInputError
from memadvisor.planner import Plan, plan_workload
from memadvisor.workload import Workload

__all__ = ["optimize", "plan"]


class SameOptimizer:
    """Builds the caller's optimizer class with its defaults over new parameters.

    A module-level class rather than a lambda so that a CUDA probe process can load it
    (``torch.save`` pickles the workload). The caller's optimizer and its state are only read.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.cls = type(optimizer)
        # ``defaults`` may hold keys the constructor does not take (torch 2.13's AdamW keeps
        # Adam's 'decoupled_weight_decay'): pass only what __init__ accepts.
        accepted = inspect.signature(self.cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        self.defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return self.cls(params, **self.defaults)


def _optimizer_factory(optimizer: Any) -> Callable[..., torch.optim.Optimizer] | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return SameOptimizer(optimizer)
    if callable(optimizer):
        return optimizer
    raise BadInputError(
        "optimizer must be a factory f(params) -> torch.optim.Optimizer or an optimizer "
        f"(its class and defaults are reused), but got {type(optimizer).__name__}."
    )


def _config(
    budget_gb: float,
    objective: str,
    effective_batch: int | None,
    device: str | Device,
    options: dict[str, Any],
) -> PlanConfig:
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)):
        raise BadInputError(f"budget_gb must be a number of GiB, e.g. 8, but got {budget_gb=}.")
    if not (math.isfinite(budget_gb) and gib_to_bytes(budget_gb) > 0):
        raise BadInputError(f"budget_gb must be a positive number of GiB, but got {budget_gb=}.")
    unknown = sorted(set(options) - set(PlanConfig.model_fields))
    reserved = {"budget_bytes", "objective", "effective_batch", "device"} & set(options)
    if unknown or reserved:
        settable = sorted(
            set(PlanConfig.model_fields)
            - {"budget_bytes", "objective", "effective_batch"}
            - {"device"}
        )
        raise BadInputError(
            f"Unknown or duplicate planning options {unknown + sorted(reserved)}; the options "
            f"besides budget_gb, objective, effective_batch and device are {settable}."
        )
    try:
        return PlanConfig(
            budget_bytes=gib_to_bytes(budget_gb),
            objective=objective,
            effective_batch=effective_batch,
            device=device if isinstance(device, str) else "auto",
            **options,
        )
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']} "
            f"(got {err.get('input')!r})"
            for err in e.errors()
        )
        raise BadInputError(f"Invalid planning options: {problems}.") from None


def plan(
    model: nn.Module,
    sample_batch: Any,
    *,
    budget_gb: float,
    objective: str = "throughput",
    effective_batch: int | None = None,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Any = None,
    make_batch: Callable[[int], Any] | None = None,
    forward_fn: Callable[[nn.Module, Any], Any] | None = None,
    device: str | Device = "auto",
    progress: bool = True,
    measure_comparison: bool | None = None,
    dataloader: Any = None,
    **config: Any,
) -> Plan:
    """The fastest training configuration of ``model`` that fits ``budget_gb``; the model is
    not changed.

    Args:
        model: the model to train.
        sample_batch: one batch as the model takes it (see :mod:`memadvisor.workload`).
        budget_gb: the memory budget in GiB (2^30 bytes) for weights, gradients, optimizer
            state and activations; an 80 GB card plans for an 8 GB one.
        objective: ``"throughput"`` (most samples/s), ``"largest_batch"``, or
            ``"effective_batch"`` (reach ``effective_batch`` by accumulation at the fastest
            micro-batch).
        effective_batch: the batch you train with; needed by ``"effective_batch"``.
        loss_fn: ``loss_fn(output, batch)``; default ``output.loss`` or a scalar output.
        optimizer: a factory ``f(params)`` or an optimizer (its class and defaults are
            reused; its state is not touched); default AdamW.
        make_batch: ``make_batch(b)`` for batches whose dim 0 is not the batch.
        forward_fn: ``forward_fn(model, batch)`` for models not called the usual way.
        device: ``"auto"`` (CUDA when available, else the CPU simulated device), ``"cuda"``,
            ``"simulated"``, ``"estimate"`` (no device: the model copied to fake tensors and
            planned for a CUDA card from the estimate alone; a model built under
            ``torch.device("meta")`` costs no memory), or a
            :class:`~memadvisor.device.Device`.
        progress: show progress on stderr.
        measure_comparison: also run the hand configurations (Baseline, +Checkpointing,
            +AMP, +Both) on the device for the report; by default only where that is cheap
            (never on CUDA); unmeasured rows are marked as estimated.
        dataloader: your ``torch.utils.data.DataLoader``: a few batches of it, and of copies
            with other ``num_workers`` / ``pin_memory``, are timed against the planned step
            (``plan.data_loading``): the report says whether the loader limits throughput
            and what to change. It is iterated, not changed.
        **config: any other :class:`~memadvisor.config.PlanConfig` field
            (``margin_fraction``, ``probe_steps``, ``verify_steps``, ``seed``, ...).

    Raises:
        BadInputError: an input or option is unusable (the message says what to pass).
        InfeasibleBudgetError: nothing fits; the message names the minimum budget.
        PlanningError: a probe failed for a reason other than memory.
    """
    workload = Workload(
        model=model,
        sample_batch=sample_batch,
        loss_fn=loss_fn,
        optimizer_factory=_optimizer_factory(optimizer),
        make_batch=make_batch,
        forward_fn=forward_fn,
    )
    cfg = _config(budget_gb, objective, effective_batch, device, config)
    result = plan_workload(
        workload,
        cfg,
        device=device if isinstance(device, Device) else None,
        progress=progress,
        measure_comparison=measure_comparison,
    )
    result._workload = workload  # for plan.to_html's recorded step
    if dataloader is not None:
        from memadvisor.dataloading import advise_loader

        result.data_loading = advise_loader(
            dataloader,
            result.verified.samples_per_s if result.verified else result.estimate.samples_per_s,
            step_measured=result.verified is not None,
            cuda=result.device_kind == "cuda",
        )
    return result


def optimize(model: nn.Module, sample_batch: Any, **kwargs: Any) -> nn.Module:
    """Plan as :func:`plan` does, then rewrite ``model`` to the plan, in place.

    Takes exactly :func:`plan`'s arguments. The rewrite (checkpointed blocks, autocast)
    keeps parameter names and ``state_dict`` keys; the weights, gradients, optimizer state,
    RNG states and train/eval flags are those you passed in.

    Returns:
        ``model``, rewritten, with the plan at ``model.memadvisor_plan`` (the batch size
        and accumulation steps to train with are in ``plan.candidate``).

    Raises:
        BadInputError, InfeasibleBudgetError, PlanningError: as :func:`plan`.
    """
    from memadvisor.apply import apply_plan  # the strategies' rewrite, shared with apply_plan()

    result = plan(model, sample_batch, **kwargs)
    return apply_plan(model, result)
