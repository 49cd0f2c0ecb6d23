"""Rewrite a model to a candidate (or a saved plan) with the strategies that chose it.

``apply_candidate`` is what ``optimize()`` and the devices' probe models use;
``apply_plan`` is the same rewrite from a plan loaded back from JSON, so the two agree by
construction. Each strategy rewrites in place (or returns a module whose parameter names and
``state_dict`` keys are unchanged); applying the same candidate twice changes nothing more.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.strategy import Check, Strategy, load_strategies

if TYPE_CHECKING:
    from memadvisor.estimate import Candidate
    from memadvisor.planner import Plan
    from memadvisor.profiler import Profile
    from memadvisor.workload import Workload

__all__ = ["apply_candidate", "apply_plan", "run_checks"]


def _chosen(
    candidate: Candidate, strategies: Sequence[Strategy] | None
) -> list[tuple[Strategy, object]]:
    """(strategy, choice) for each strategy the candidate turns on, in effect order.

    Raises:
        BadInputError: the candidate names a strategy that is not registered or given.
    """
    names = list(candidate.choices)
    if strategies is None:
        strategies = load_strategies(names)
    by_name = {s.name: s for s in strategies}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise BadInputError(
            f"The candidate uses strategies {unknown} that are not among {sorted(by_name)}. "
            "Install the package that provides them, or pass them in `strategies`."
        )
    chosen = [(by_name[n], c) for n, c in candidate.choices.items() if not by_name[n].is_neutral(c)]
    return sorted(chosen, key=lambda sc: sc[0].effect_order)


def apply_candidate(
    model: nn.Module,
    candidate: Candidate,
    strategies: Sequence[Strategy] | None = None,
    profile: Profile | None = None,
) -> nn.Module:
    """Rewrite ``model`` in place to ``candidate``'s choices and return it.

    Batch size and accumulation are not the model's to carry: they are the training loop's
    (see the batch_size strategy's advice). Neutral choices are skipped.

    Args:
        model: the user's model (or a copy a device trains).
        candidate: the batch size and each strategy's choice.
        strategies: the strategies to apply with; None loads those the candidate names.
        profile: the profile the candidate was planned from; strategies use it to check
            the choice (e.g. a precision the device lacks).

    Raises:
        BadInputError: a strategy is unknown, or a choice does not fit this model.
    """
    if not isinstance(model, nn.Module):
        raise BadInputError(f"model must be a torch.nn.Module, but got {type(model).__name__}.")
    chosen = _chosen(candidate, strategies)
    # All or nothing: every choice is checked before any is applied, and what was applied
    # is taken back when a strategy still fails while applying.
    for strategy, choice in chosen:
        strategy.validate(model, choice, profile)
    before = _Rewrite(model)
    try:
        for strategy, choice in chosen:
            rewritten = strategy.apply(model, choice, profile)
            if rewritten is not model:
                _check_same_keys(model, rewritten, strategy.name)
                model = rewritten
    except BaseException:
        before.restore()
        raise
    return model


class _Rewrite:
    """What strategies change on a model: each module's instance ``forward`` (the wrappers)
    and its train/eval flag, saved to be put back when applying fails half way."""

    _NONE = object()

    def __init__(self, model: nn.Module) -> None:
        self.saved = [
            (m, m.__dict__.get("forward", self._NONE), m.training) for m in model.modules()
        ]

    def restore(self) -> None:
        for module, forward, training in self.saved:
            if forward is self._NONE:
                module.__dict__.pop("forward", None)
            else:
                object.__setattr__(module, "forward", forward)
            module.training = training


def _check_same_keys(before: nn.Module, after: nn.Module, strategy: str) -> None:
    if list(before.state_dict()) != list(after.state_dict()):
        raise BadInputError(
            f"Strategy {strategy!r} returned a model whose state_dict keys differ from the "
            "original's; a strategy must keep them (fix the strategy's apply())."
        )


def apply_plan(model: nn.Module, plan: Plan) -> nn.Module:
    """Rewrite ``model`` in place to ``plan``'s pick, the same rewrite ``optimize()`` makes.

    The plan is reachable afterwards as ``model.memadvisor_plan``.

    Example::

        plan = memadvisor.Plan.model_validate_json(Path("plan.json").read_text())
        model = memadvisor.apply_plan(model, plan)

    All or nothing: the model is checked against the plan (its fingerprint: class,
    parameter names and shapes) and every choice against the model before anything changes.

    Raises:
        BadInputError: the plan was made for another model, uses a strategy that is not
            installed, or names blocks this model does not have.
    """
    if not isinstance(model, nn.Module):
        raise BadInputError(f"model must be a torch.nn.Module, but got {type(model).__name__}.")
    fingerprint = plan.model_fingerprint
    difference = fingerprint.difference(model) if fingerprint is not None else None
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
    for strategy, choice in _chosen(candidate, strategies):
        if (strategy.name, json.dumps(choice, sort_keys=True)) in checked:
            continue
        result = strategy.check(workload, choice)
        if result is not None:
            checks.append(result)
    return checks
