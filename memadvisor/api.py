"""What users call: ``plan()`` says what fits, ``optimize()`` applies it, ``profile()`` measures.

    tuned = memadvisor.optimize(model, sample_batch, budget_gb=8)
    tuned.memadvisor_plan.candidate.batch_size      # the batch to train with

All leave the caller's weights, gradients, optimizer state, RNG states and train/eval
flags as they were: every profiling step, probe and verification runs on copies. User input
becomes a Workload in :func:`memadvisor.workload.build_workload` (which the CLI's factories
also go through, in this process and in the probe processes) and a PlanConfig in
:func:`plan_config` (which the CLI calls with its flags' names).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from pydantic import ValidationError
from torch import nn

from memadvisor.apply import apply_plan
from memadvisor.device import Device
from memadvisor.errors import BadInputError, validation_problems
from memadvisor.planner import plan_workload
from memadvisor.profiler import profile_workload
from memadvisor.profiler._blocks import BlockSpec
from memadvisor.profiler._progress import ProgressArg
from memadvisor.schema.config import PlanConfig, device_kind, gib_to_bytes
from memadvisor.schema.device import profiler_device
from memadvisor.schema.plan import Plan
from memadvisor.schema.profile import Profile
from memadvisor.strategy import Configured, load_strategies, registered_names
from memadvisor.workload import build_workload

__all__ = ["optimize", "plan", "plan_config", "profile"]


#: How plan() names each PlanConfig field in its messages (the CLI passes its flags instead).
# Past this a budget is a typo (1e308 used to overflow into OverflowError, exit 1).
MAX_BUDGET_GIB = 2**20

PYTHON_NAMES = {
    "budget_gb": "budget_gb",
    "objective": "objective",
    "effective_batch": "effective_batch",
    "margin_fraction": "margin_fraction",
    "world_size": "world_size",
    "parallel": "parallel",
    "device": "device",
    "max_batch": "max_batch",
}
_SET_BY_NAME = {"budget_bytes", "objective", "effective_batch", "device"}


def plan_config(
    budget_gb: float,
    *,
    objective: str | None = "throughput",
    effective_batch: int | None = None,
    device: str = "auto",
    options: dict[str, Any] | None = None,
    names: dict[str, str] | None = None,
) -> PlanConfig:
    """The :class:`PlanConfig` a user asked for: the one place user input becomes one.

    ``plan()``, ``optimize()`` and the CLI all build their config here, so they check the
    same things and say the same words about them.

    Args:
        budget_gb: the budget in GiB (2^30 bytes).
        objective: throughput, largest_batch or effective_batch; None: effective_batch
            when ``effective_batch`` is given, else throughput.
        effective_batch: the batch the user trains with.
        device: a name of :data:`~memadvisor.schema.config.DEVICE_NAMES`: auto, cuda (or
            gpu), cpu (or simulated), estimate.
        options: any other PlanConfig field (``margin_fraction``, ``verify_steps``...), or
            a registered strategy's name with its setting (``compile="off"``).
        names: how the caller spells each field in messages (the CLI: ``--budget-gb``).

    Raises:
        BadInputError: an option is unknown, out of range, or lacks what it needs.
    """
    said = {**PYTHON_NAMES, **(names or {})}
    if isinstance(budget_gb, bool) or not isinstance(budget_gb, (int, float)):
        raise BadInputError(
            f"{said['budget_gb']} must be a number of GiB, e.g. 8, but got {budget_gb=}."
        )
    if not (math.isfinite(budget_gb) and 0 < budget_gb <= MAX_BUDGET_GIB) or not (
        gib_to_bytes(budget_gb) > 0
    ):
        raise BadInputError(
            f"{said['budget_gb']} must be a positive number of GiB up to {MAX_BUDGET_GIB} "
            f"(1 PiB), e.g. 8, but got {budget_gb=}."
        )
    kind = device_kind(device, said["device"])
    fields, strategy_options = _split_options(dict(options or {}))
    max_batch = fields.get("max_batch", 1)
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise BadInputError(
            f"{said['max_batch']} must be a whole number of samples, at least 1, but got "
            f"{max_batch=}."
        )
    margin = fields.get("margin_fraction", 0.08)
    if isinstance(margin, (int, float)) and not 0.0 <= margin < 0.5:
        raise BadInputError(
            f"{said['margin_fraction']} must be at least 0 and below 0.5, but got {margin=}."
        )
    if effective_batch is not None and effective_batch <= 0:
        raise BadInputError(
            f"{said['effective_batch']} must be positive, but got {effective_batch=}."
        )
    world_size, parallel = fields.get("world_size", 1), fields.get("parallel", "none")
    if isinstance(world_size, int) and world_size < 1:
        raise BadInputError(f"{said['world_size']} must be at least 1, but got {world_size=}.")
    if isinstance(world_size, int) and world_size > 1 and parallel == "none":
        raise BadInputError(
            f"{said['world_size']} {world_size} needs {said['parallel']} ddp or "
            f"{said['parallel']} fsdp2 (how the ranks share the model), but got {parallel=}."
        )
    if objective is None:
        objective = "effective_batch" if effective_batch is not None else "throughput"
    if objective == "effective_batch" and effective_batch is None:
        raise BadInputError(
            f"{said['objective']} effective_batch needs {said['effective_batch']} N, the batch "
            f"you train with, but got {effective_batch=}."
        )
    if effective_batch is not None and objective != "effective_batch":
        # Planned silently, the batch the user trains with would be ignored.
        raise BadInputError(
            f"{said['effective_batch']} {effective_batch} is kept only by {said['objective']} "
            f"effective_batch, but got {objective=}: drop {said['objective']} (it then "
            f"defaults to effective_batch) or drop {said['effective_batch']}."
        )
    if strategy_options:
        _check_settings(strategy_options)
        fields["options"] = {**fields.get("options", {}), **strategy_options}
    try:
        return PlanConfig(
            budget_bytes=gib_to_bytes(budget_gb),
            objective=objective,
            effective_batch=effective_batch,
            device=kind,
            **fields,
        )
    except ValidationError as e:
        problems = validation_problems(e, "config")
        raise BadInputError(f"Invalid planning options: {problems}.") from None


def _split_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """PlanConfig fields, and the settings named after a registered strategy.

    Raises:
        BadInputError: a name is neither, or is one plan() takes by name.
    """
    known = set(PlanConfig.model_fields)
    reserved = sorted(_SET_BY_NAME & set(options))
    rest = {k: v for k, v in options.items() if k not in known}
    registered = set(registered_names()) if rest else set()
    unknown = sorted(k for k in rest if k not in registered)
    if unknown or reserved:
        settable = sorted(known - _SET_BY_NAME)
        raise BadInputError(
            f"Unknown or duplicate planning options {unknown + reserved}; the options "
            f"besides budget_gb, objective, effective_batch and device are {settable}, or a "
            f"registered strategy's name with its setting ({sorted(registered_names())})."
        )
    fields = {k: v for k, v in options.items() if k in known}
    return fields, {k: v for k, v in rest.items() if k in registered}


def _check_settings(settings: dict[str, Any]) -> None:
    """Each registered strategy's setting checked by the strategy (``Configured``), so a
    wrong one fails here, before the plan measures anything.

    Raises:
        BadInputError: a strategy refused its setting.
    """
    for strategy in load_strategies(sorted(settings)):
        if isinstance(strategy, Configured):
            strategy.check_setting(settings[strategy.name])


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
        device: ``"auto"`` (CUDA when available, else the CPU simulated device), ``"cuda"``
            (or ``"gpu"``), ``"cpu"`` (or ``"simulated"``: CPU tensors whose bytes are tracked
            against the budget), ``"estimate"`` (no device: the model copied to fake tensors
            and planned for a CUDA card from the estimate alone; a model built under
            ``torch.device("meta")`` costs no memory), or a
            :class:`~memadvisor.device.Device`. The same names as ``profile()`` and the
            CLI's ``--device``.
        progress: show progress on stderr.
        measure_comparison: also run the hand configurations (Baseline, +Checkpointing,
            +AMP, +Both) on the device for the report; by default only where that is cheap
            (never on CUDA); unmeasured rows are marked as estimated.
        dataloader: your ``torch.utils.data.DataLoader``: a few batches of it, and of copies
            with other ``num_workers`` / ``pin_memory``, are timed against the planned step
            (``plan.data_loading``): the report says whether the loader limits throughput
            and what to change. It is iterated, not changed.
        **config: any other :class:`~memadvisor.schema.config.PlanConfig` field
            (``margin_fraction``, ``probe_steps``, ``verify_steps``, ``seed``, ...), or a
            registered strategy's setting by its name (``compile="off"``).

    Raises:
        BadInputError: an input or option is unusable (the message says what to pass).
        InfeasibleBudgetError: nothing fits; the message names the minimum budget.
        PlanningError: a probe failed for a reason other than memory.
    """
    workload = build_workload(
        model,
        sample_batch,
        loss_fn=loss_fn,
        optimizer=optimizer,
        make_batch=make_batch,
        forward_fn=forward_fn,
    )
    cfg = plan_config(
        budget_gb,
        objective=objective,
        effective_batch=effective_batch,
        device=device if isinstance(device, str) else "auto",
        options=config,
    )
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
            cuda=result.capabilities.tensor_device == "cuda",
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
    result = plan(model, sample_batch, **kwargs)
    return apply_plan(model, result)


def profile(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    optimizer: Any = None,
    make_batch: Callable[[int], Any] | None = None,
    forward_fn: Callable[[nn.Module, Any], Any] | None = None,
    blocks: BlockSpec | None = None,
    device: str = "auto",
    precisions: Sequence[str] | None = None,
    batch_sizes: tuple[int, int] | None = None,
    progress: ProgressArg = None,
) -> Profile:
    """Measure one training step of ``model``: memory per block, per layer and per phase.

    Args:
        model: the model to train; it is not changed (a copy is profiled).
        sample_batch: one batch as the model takes it (see :mod:`memadvisor.workload`).
        loss_fn: ``loss_fn(output, batch)``; default: ``output.loss`` or a scalar output.
        optimizer: an optimizer factory ``f(params)``, or an optimizer whose class and
            defaults are reused; default AdamW.
        make_batch: ``make_batch(b)`` for batches whose dim 0 is not the batch.
        forward_fn: ``forward_fn(model, batch)`` when the model is not called as the
            workload rules say.
        blocks: which modules are blocks (names, globs, class names or types); detected if None.
        device: the names :func:`plan` takes: ``"auto"``, ``"cuda"`` (or ``"gpu"``),
            ``"cpu"`` (or ``"simulated"``: CPU tensors, their bytes tracked), ``"estimate"``
            (the model copied to fake tensors: shapes and bytes, no memory, no times).
        precisions: subset of fp32/bf16/fp16; default fp32 and, where supported, bf16.
        batch_sizes: the two batch sizes to measure; default ``(n, 2n)`` for a sample of n.
        progress: ``progress(description, done, total)`` or a rich ``Progress``.

    Returns:
        The :class:`~memadvisor.schema.profile.Profile`.

    Raises:
        BadInputError: an input is unusable (the message says which and what to pass).
    """
    workload = build_workload(
        model,
        sample_batch,
        loss_fn=loss_fn,
        optimizer=optimizer,
        make_batch=make_batch,
        forward_fn=forward_fn,
    )
    on = profiler_device(device_kind(device))
    if on is None:  # "estimate": the model as fake tensors
        from memadvisor.device.fake import fake_workload, profile_fake

        return profile_fake(
            fake_workload(workload),
            blocks=blocks,
            precisions=precisions,
            batch_sizes=batch_sizes,
            progress=progress,
        )
    return profile_workload(
        workload,
        blocks=blocks,
        device=on,
        precisions=precisions,
        batch_sizes=batch_sizes,
        progress=progress,
    )
