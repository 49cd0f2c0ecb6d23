"""Rewrite a model to a saved plan, and run the chosen strategies' checks.

``apply_plan`` is :func:`memadvisor.strategy.apply_candidate` (what ``optimize()`` and the
devices' probe models use) on a plan loaded back from JSON, so the two agree by
construction. Each strategy rewrites in place (or returns a module whose parameter names and
``state_dict`` keys are unchanged); applying the same candidate twice changes nothing more.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Check
from memadvisor.schema.plan import Plan
from memadvisor.step import ForwardFn, LossFn, Step, base_step, step_from_call_form
from memadvisor.strategy import Checked, Strategy, apply_candidate, chosen_strategies

if TYPE_CHECKING:
    from memadvisor.schema.candidate import Candidate
    from memadvisor.workload import Workload

__all__ = ["apply_plan", "run_checks"]


def apply_plan(
    model: nn.Module,
    plan: Plan | str | os.PathLike[str],
    *,
    loss_fn: LossFn | None = None,
    forward_fn: ForwardFn | None = None,
) -> nn.Module:
    """Rewrite ``model`` in place to ``plan``'s pick, the same rewrite ``optimize()`` makes.

    The plan is reachable afterwards as ``model.memadvisor_plan``, and the training step the
    plan measured as ``model.memadvisor_step`` (a :class:`~memadvisor.step.Step`): where a
    strategy changed how the loss is computed (``step.loss_changed_by``), train with
    ``loss = model.memadvisor_step(batch)`` instead of your ``loss_fn(model(...), batch)``.

    Example::

        model = memadvisor.apply_plan(model, "plan.json")  # memadvisor plan ... --json
        model = memadvisor.apply_plan(model, plan)  # what memadvisor.plan() returned

    Args:
        model: the model to rewrite.
        plan: a :class:`~memadvisor.schema.plan.Plan`, or the path (``str`` or
            ``pathlib.Path``) of one saved as JSON (read with ``Plan.load``).
        loss_fn: your ``loss_fn(output, batch)``, for ``model.memadvisor_step`` where the
            plan was made with one and a strategy changed the step (a plan file does not
            hold your code). Not needed when the plan came from ``memadvisor.plan()`` in
            this process.
        forward_fn: likewise, your ``forward_fn(model, batch)`` if the plan used one.

    All or nothing: the model is checked against the plan (its fingerprint: class,
    parameter names and shapes) and every choice against the model before anything changes.

    Two choices reach beyond the model: a plan that picked ``tf32`` switches fp32 matmuls to
    TF32 for the whole process (``torch.set_float32_matmul_precision("high")``, a
    process-wide setting, not the model's); ``torch.set_float32_matmul_precision("highest")``
    switches it off. The other is a card plan's allocator (``"allocator":
    "expandable_segments"``): it sets the CUDA caching allocator's expandable segments for
    the process, as the plan's runs had them (``PYTORCH_CUDA_ALLOC_CONF`` set to
    ``expandable_segments:True``; new segments only). A ``PYTORCH_CUDA_ALLOC_CONF`` of yours
    that names ``expandable_segments`` is kept.

    Raises:
        BadInputError: ``plan`` is neither a Plan nor a path to one, the file is not a plan
            this version reads, the plan was made for another model, uses a strategy that is
            not installed, or names blocks this model does not have.
    """
    if not isinstance(model, nn.Module):
        raise BadInputError(f"model must be a torch.nn.Module, but got {type(model).__name__}.")
    if isinstance(plan, (str, os.PathLike)):
        plan = Plan.load(plan)
    elif not isinstance(plan, Plan):
        raise BadInputError(
            f"plan must be a memadvisor Plan or the path of one saved as JSON (str or "
            f"pathlib.Path), but got {type(plan).__name__}: {plan!r:.80}. Pass what "
            "memadvisor.plan() returned, or the file `memadvisor plan ... --json` wrote."
        )
    fingerprint = plan.model_fingerprint
    if fingerprint is None:
        # Every plan memadvisor makes has one; a file without it would skip the model check.
        raise BadInputError(
            "This plan has no model_fingerprint, so nothing says it was made for this model; "
            "every plan memadvisor makes has one. Make the plan again (memadvisor plan ... "
            "--json plan.json, or memadvisor.plan())."
        )
    difference = fingerprint.difference(model)
    if difference is not None:
        raise BadInputError(
            f"This plan does not fit the model: {difference}. Apply a plan made for this model "
            "(memadvisor plan ... --json plan.json on the same factory)."
        )
    step = apply_candidate(_users_step(model, plan, loss_fn, forward_fn), plan.candidate, None)
    model = step.model
    # Not nn.Module attributes: plain objects in __dict__, kept out of state_dict.
    object.__setattr__(model, "memadvisor_plan", plan)
    object.__setattr__(model, "memadvisor_step", step)
    return model


def _users_step(
    model: nn.Module, plan: Plan, loss_fn: LossFn | None, forward_fn: ForwardFn | None
) -> Step:
    """The user's own step over ``model``: the workload's rules where the plan was made in
    this process (``optimize()``, ``memadvisor.plan()``) and nothing else is given, else the
    plan's call form with the functions given."""
    workload = getattr(plan, "_workload", None)
    if workload is not None and loss_fn is None and forward_fn is None:
        return base_step(workload, model, plan.profile)
    for name, fn in (("loss_fn", loss_fn), ("forward_fn", forward_fn)):
        if fn is not None and not callable(fn):
            raise BadInputError(f"{name} must be a function or None, but got {fn!r:.80}.")
    call = plan.profile.call_form if plan.profile is not None else None
    return step_from_call_form(model, call, plan.profile, loss_fn=loss_fn, forward_fn=forward_fn)


def run_checks(
    workload: Workload,
    candidate: Candidate,
    strategies: Sequence[Strategy] | None = None,
    done: Sequence[Check] = (),
) -> list[Check]:
    """Each chosen strategy's own measurement of its choice on copies of the workload.

    The planner puts these in ``Plan.checks`` (precision's numerics check is one); a choice
    with a check in ``done`` (run before the search) is not checked again.
    """
    checked = {(c.strategy, json.dumps(c.choice, sort_keys=True)) for c in done}
    checks = []
    for strategy, choice in chosen_strategies(candidate, strategies):
        if (strategy.name, json.dumps(choice, sort_keys=True)) in checked:
            continue
        if not isinstance(strategy, Checked):
            continue
        result = strategy.check(workload, choice)
        if result is not None:
            checks.append(result)
    return checks
