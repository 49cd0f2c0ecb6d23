"""The training step a strategy rewrites: the model, how it is called, the loss, the optimizer.

A memory strategy may change more than the module. Checkpointing and autocast rewrite the
model; a chunked loss head changes the forward (the head is not run on the whole sequence)
and the loss (computed from the hidden states, a chunk at a time) together. So strategies
rewrite a :class:`Step`, ``apply(step, choice) -> Step``, and everything that runs a
candidate (the probes, the ranks, compile trials, ``optimize()`` and ``apply_plan``) runs the
rewritten step: :func:`running` turns it back into the :class:`~memadvisor.workload.Workload`
that :func:`~memadvisor.workload.train_step` runs, with the user's batch rules unchanged.

A user whose plan changed the loss trains with the step itself::

    step = model.memadvisor_step       # what optimize() / apply_plan() attach
    loss = step(batch)                 # forward and loss, as the plan measured them
    loss.backward()

Known limitations:
    * A step built without the user's workload (``apply_plan`` on a saved plan) knows the
      forward and the loss only by the plan's call form: a custom ``forward_fn`` or a user's
      ``loss_fn`` is not in the plan, so ``step(batch)`` raises unless they are passed to
      ``apply_plan``. Replacing the loss of a rewritten step would drop the rewrite.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from memadvisor.errors import BadInputError

if TYPE_CHECKING:
    from memadvisor.schema.call import CallForm
    from memadvisor.schema.profile import Profile
    from memadvisor.workload import Workload

__all__ = ["ForwardFn", "LossFn", "Step", "base_step", "running", "step_from_call_form"]

ForwardFn = Callable[[nn.Module, Any], Any]
LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass(frozen=True)
class Step:
    """One training step's parts, as strategies leave them.

    Attributes:
        model: the module trained (rewritten in place by module strategies).
        forward: ``forward(model, batch) -> output``.
        loss: ``loss(output, batch) -> scalar tensor``.
        optimizer_factory: ``f(params) -> optimizer``; None: the workload's (AdamW).
        profile: the profile the candidate was planned from, for strategies that read it
            (checkpointing's block names); None where there is none.
        loss_changed_by: the strategies that replaced the forward or the loss, in the order
            they did: non-empty means the user's own ``model(...)`` + ``loss_fn`` is no longer
            what the plan measured, and the report says to call the step instead.
    """

    model: nn.Module
    forward: ForwardFn
    loss: LossFn
    optimizer_factory: OptimizerFactory | None = None
    profile: Profile | None = None
    loss_changed_by: tuple[str, ...] = field(default=())

    def replace(self, **changes: Any) -> Step:
        """A copy with ``changes`` (the dataclass is frozen: a rewrite makes a new step)."""
        return replace(self, **changes)

    def __call__(self, batch: Any) -> torch.Tensor:
        """The loss of ``batch``: the step's forward, then its loss (call ``backward()`` on it)."""
        return self.loss(self.forward(self.model, batch), batch)


def base_step(
    workload: Workload, model: nn.Module | None = None, profile: Profile | None = None
) -> Step:
    """The user's own step: ``workload``'s forward and loss rules over ``model`` (default the
    workload's model)."""
    return Step(
        model=workload.model if model is None else model,
        forward=workload.forward,
        loss=workload.loss,
        optimizer_factory=workload.optimizer_factory,
        profile=profile,
    )


def running(workload: Workload, step: Step) -> Workload:
    """``workload`` with ``step``'s model, forward, loss and optimizer (its batches unchanged),
    for :func:`~memadvisor.workload.train_step` and everything else that runs a workload.

    A shallow copy: the sample batch and ``make_batch`` are shared, nothing is re-checked.
    """
    out = copy.copy(workload)
    out.model = step.model
    if step.forward != workload.forward:
        out.forward_fn = step.forward
    if step.loss != workload.loss:
        out.loss_fn = step.loss
    out.optimizer_factory = step.optimizer_factory
    return out


def step_from_call_form(
    model: nn.Module,
    call: CallForm | None,
    profile: Profile | None = None,
    *,
    loss_fn: LossFn | None = None,
    forward_fn: ForwardFn | None = None,
) -> Step:
    """The step a plan's call form describes, for ``apply_plan`` (which has no workload).

    The forward follows the workload rules (``forward_fn`` where given); the loss is
    ``loss_fn`` where given, else the output's own (``output.loss``, ``output['loss']`` or a
    scalar output). A plan made with a ``loss_fn`` or a custom forward does not hold them:
    calling such a step without them raises :class:`BadInputError` saying to pass them to
    ``apply_plan``.
    """
    batch_kind = call.batch if call is not None else "tensor"
    loss_kind = call.loss if call is not None else "output"

    def forward(m: nn.Module, batch: Any) -> Any:
        if forward_fn is not None:
            return forward_fn(m, batch)
        if batch_kind == "custom":
            raise BadInputError(
                "This plan was made with a custom forward_fn, which the plan file does not "
                "hold: pass it too, apply_plan(model, plan, forward_fn=your_forward_fn)."
            )
        if isinstance(batch, Mapping):
            return m(**batch)
        if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
            return m(batch[0])
        return m(batch)

    def loss(output: Any, batch: Any) -> torch.Tensor:
        if loss_fn is not None:
            return loss_fn(output, batch)
        if isinstance(getattr(output, "loss", None), torch.Tensor):
            return output.loss
        if isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            return output["loss"]
        if isinstance(output, torch.Tensor) and output.numel() == 1:
            return output.reshape(())
        if loss_kind == "loss_fn":
            raise BadInputError(
                "This plan was made with your loss_fn, which the plan file does not hold: "
                "pass it too, apply_plan(model, plan, loss_fn=your_loss_fn)."
            )
        raise BadInputError(
            "Cannot find a loss in the model's output: pass your loss function, "
            "apply_plan(model, plan, loss_fn=your_loss_fn)."
        )

    return Step(model=model, forward=forward, loss=loss, profile=profile)
