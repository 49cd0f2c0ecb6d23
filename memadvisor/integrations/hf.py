"""Hugging Face ``Trainer``: plan from the trainer, train with the plan's arguments.

    plan = plan_trainer(trainer, budget_gb=8)           # its model, a collated batch, its optim
    fields = training_arguments(plan, model=trainer.model)
    args = dataclasses.replace(trainer.args, **fields)  # per_device_train_batch_size, bf16, ...
    Trainer(model=trainer.model, args=args, ...).train()

:func:`training_arguments` returns the ``TrainingArguments`` fields the plan decides. Where
the plan checkpoints every block, that is ``gradient_checkpointing=True`` (the model's own
``gradient_checkpointing_enable``); where it checkpoints some of them, those blocks are
checkpointed on the model you pass and ``gradient_checkpointing`` stays ``False``, so the
Trainer leaves them as they are.

Needs ``transformers`` (``pip install 'memadvisor[hf]'``); this module imports without it.

Known limitations:
    * The plan sees one batch from the data collator, padded to that batch's length; a
      collator that pads each batch to its own longest sequence makes longer batches later.
      Plan with a batch of the longest sequences you train on (``max_length`` padding).
    * The Trainer's optimizer is rebuilt from ``args.optim`` without its weight-decay
      parameter groups (which change no memory).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.integrations import require
from memadvisor.integrations._pick import apply_blocks, pick_of, plan_options

if TYPE_CHECKING:
    from collections.abc import Iterable

    from memadvisor.schema.plan import Plan

__all__ = ["TrainerOptimizer", "plan_trainer", "training_arguments"]

logger = logging.getLogger(__name__)  # what transformers.utils.logging.get_logger returns

_EXTRA = "hf"


class TrainerOptimizer:
    """The optimizer ``args.optim`` names, over new parameters: the class and keyword
    arguments ``Trainer.get_optimizer_cls_and_kwargs`` gives. A module-level class so a
    CUDA probe process can load it."""

    def __init__(self, cls: type, kwargs: dict[str, Any]) -> None:
        self.cls = cls
        self.kwargs = dict(kwargs)

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return self.cls(params, **self.kwargs)


def plan_trainer(
    trainer: Any,
    *,
    budget_gb: float,
    time_dataloader: bool = False,
    **plan_kwargs: Any,
) -> Plan:
    """Plan ``trainer``'s model on one batch of its own training data and its optimizer.

    The batch is the first of ``trainer.get_train_dataloader()`` (its data collator, its
    ``per_device_train_batch_size``, the columns the model takes), moved to the CPU; the
    model is called as the Trainer calls it, ``model(**batch)``, and returns its own loss.

    Args:
        trainer: a ``transformers.Trainer`` with a ``train_dataset``.
        budget_gb: the memory budget in GiB.
        time_dataloader: also time the Trainer's training DataLoader against the planned step
            (``plan.data_loading``; ``dataloader_num_workers`` and ``dataloader_pin_memory``
            are the arguments it advises on).
        **plan_kwargs: any other :func:`memadvisor.plan` argument. ``progress`` defaults to
            False here (the ``memadvisor`` logger carries the notes and stage lines), and
            ``max_batch`` to the training dataset's length.

    Raises:
        BadInputError: transformers is not installed, the trainer has no training data, or
            the model returns no loss for the batch (the collator gives no ``labels``).
    """
    transformers = require("transformers", _EXTRA)
    if not isinstance(trainer, transformers.Trainer):
        raise BadInputError(
            f"trainer must be a transformers.Trainer, but got {type(trainer).__name__}."
        )
    if trainer.train_dataset is None:
        raise BadInputError(
            "The Trainer has no train_dataset: pass Trainer(train_dataset=...) so a batch "
            "of your data can be planned."
        )
    import torch

    from memadvisor import api
    from memadvisor.workload import _move  # the batch to the CPU: the plan moves it itself

    loader = trainer.get_train_dataloader()
    batch = dict(_move(next(iter(loader)), torch.device("cpu")))
    cls, kwargs = transformers.Trainer.get_optimizer_cls_and_kwargs(trainer.args, trainer.model)
    logger.info(
        "memadvisor: planning %s for %s GiB on a batch of %d from the Trainer's data collator",
        type(trainer.model).__name__,
        budget_gb,
        trainer.args.per_device_train_batch_size,
    )
    return api.plan(
        trainer.model,
        batch,
        budget_gb=budget_gb,
        optimizer=TrainerOptimizer(cls, kwargs),
        dataloader=loader if time_dataloader else None,
        **plan_options(plan_kwargs, trainer.train_dataset),
    )


def training_arguments(plan: Plan, model: nn.Module | None = None) -> dict[str, Any]:
    """The ``TrainingArguments`` fields the plan decides, to pass to
    ``dataclasses.replace(args, **fields)`` or ``TrainingArguments(..., **fields)``.

    ``per_device_train_batch_size``, ``gradient_accumulation_steps``, ``bf16`` / ``fp16``,
    ``tf32`` (only when the plan picked it: the Trainer switches it on process-wide),
    ``gradient_checkpointing`` (and its ``gradient_checkpointing_kwargs``), ``torch_compile``
    (and ``torch_compile_mode``); data-loader fields when ``plan.data_loading`` recommends
    them (``dataloader_num_workers``, ``dataloader_pin_memory``,
    ``dataloader_persistent_workers``).

    A compiled pick: with ``model`` given, its compile is installed on the model in the form
    the plan measured (each repeated block, or the whole model) and ``torch_compile`` stays
    False; without it, a whole-model pick sets ``torch_compile`` (the Trainer's
    ``torch.compile(model)``), and a pick the Trainer's switch cannot make (each repeated
    block compiled, a partitioner budget) is refused.

    Args:
        plan: the plan, e.g. from :func:`plan_trainer`.
        model: the model the Trainer will train. Needed when the plan checkpoints only some
            blocks, or compiles each repeated block: those are done on it, in place.

    Raises:
        BadInputError: the plan checkpoints some blocks, or compiles in a form the Trainer's
            switch cannot make, and no model was given (training without them would run
            another step than the one the batch was planned for).
    """
    pick = pick_of(plan)
    fields: dict[str, Any] = {
        "per_device_train_batch_size": pick.batch_size,
        "gradient_accumulation_steps": pick.accumulation_steps,
        "bf16": pick.precision == "bf16",
        "fp16": pick.precision == "fp16",
        "gradient_checkpointing": False,
        "torch_compile": False,
    }
    if pick.tf32:
        fields["tf32"] = True
    if pick.compile_mode is not None and model is None:
        if not pick.compiled_whole:
            raise BadInputError(
                "The plan compiles each repeated block (or with a partitioner budget), which "
                "the Trainer's torch_compile cannot say (it compiles the whole model: another "
                "step in memory and time); pass model= (the model the Trainer will train) and "
                "the plan's compile is installed on it."
            )
        fields["torch_compile"] = True
        if pick.compile_mode != "default":
            fields["torch_compile_mode"] = pick.compile_mode
    in_place = pick.compile_mode is not None and model is not None
    if pick.all_blocks and not in_place:
        # The model's own switch checkpoints every layer, as the plan does; non-reentrant, as
        # memadvisor measured it.
        fields["gradient_checkpointing"] = True
        fields["gradient_checkpointing_kwargs"] = {"use_reentrant": False}
    elif pick.checkpointed and model is None:
        raise BadInputError(
            f"The plan checkpoints {len(pick.checkpointed)} of {pick.block_count} blocks, "
            "which TrainingArguments cannot say; pass model= (the model the Trainer will "
            "train) and they are checkpointed on it."
        )
    if model is not None and (in_place or (pick.checkpointed and not pick.all_blocks)):
        # The blocks and the compile as the plan measured them, the compile around the
        # checkpointed blocks (apply_plan's order); the Trainer's switches stay off.
        apply_blocks(model, plan, compiled=in_place)
        done = []
        if pick.checkpointed:
            done.append(
                f"checkpointed {len(pick.checkpointed)} of {pick.block_count} blocks "
                f"({', '.join(pick.checkpointed)})"
            )
        if in_place:
            done.append(f"torch.compile installed ({pick.compile_form})")
        logger.info(
            "memadvisor: on the model: %s; the Trainer's gradient_checkpointing and "
            "torch_compile stay False so it does neither a second way",
            ", ".join(done),
        )
    loading = plan.data_loading
    if loading is not None:
        names = {
            "num_workers": "dataloader_num_workers",
            "pin_memory": "dataloader_pin_memory",
            "persistent_workers": "dataloader_persistent_workers",
        }
        fields.update({names[k]: v for k, v in loading.recommended.items() if k in names})
    return fields
