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
from memadvisor.strategy import Strategy, apply_candidate, chosen_strategies

if TYPE_CHECKING:
    from memadvisor.schema.candidate import Candidate
    from memadvisor.workload import Workload

__all__ = ["apply_plan", "run_checks"]


def apply_plan(model: nn.Module, plan: Plan | str | os.PathLike[str]) -> nn.Module:
    """Rewrite ``model`` in place to ``plan``'s pick, the same rewrite ``optimize()`` makes.

    The plan is reachable afterwards as ``model.memadvisor_plan``.

    Example::

        model = memadvisor.apply_plan(model, "plan.json")  # memadvisor plan ... --json
        model = memadvisor.apply_plan(model, plan)  # what memadvisor.plan() returned

    Args:
        model: the model to rewrite.
        plan: a :class:`~memadvisor.schema.plan.Plan`, or the path (``str`` or
            ``pathlib.Path``) of one saved as JSON (read with ``Plan.load``).

    All or nothing: the model is checked against the plan (its fingerprint: class,
    parameter names and shapes) and every choice against the model before anything changes.

    One choice reaches beyond the model: a plan that picked ``tf32`` switches fp32 matmuls to
    TF32 for the whole process (``torch.set_float32_matmul_precision("high")``, a
    process-wide setting, not the model's); ``torch.set_float32_matmul_precision("highest")``
    switches it off.

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
    model = apply_candidate(model, plan.candidate, None, plan.profile)
    # Not an nn.Module attribute: a plain object in __dict__, kept out of state_dict.
    object.__setattr__(model, "memadvisor_plan", plan)
    return model


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
        result = strategy.check(workload, choice)
        if result is not None:
            checks.append(result)
    return checks
