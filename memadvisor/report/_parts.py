"""The plan's strategies, asked how the report shows their choices.

The report names no strategy: each strategy the plan used describes its own choice
(:meth:`memadvisor.strategy.Strategy.describe`): an answer row, a phrase in the one-line
answer, the profiled step it runs, the blocks it recomputes, its lines in a plain training
loop. This module finds those strategies through the registry and collects their parts.

Known limitations:
    * A plan read back where a strategy it used is not installed shows that strategy's
      non-neutral choice as its JSON under "Also" (the default description), and counts it
      as changing the step.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from pydantic import JsonValue

from memadvisor.schema.advice import ReportPart
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.plan import Plan
from memadvisor.strategy import (
    Strategy,
    changes_step,
    describe_choice,
    load_strategies,
    registered_names,
)
from memadvisor.strategy import installs as installs_word

__all__ = ["changes", "installs", "others", "parts", "plan_strategies"]

# Neutral choices of a strategy that is not installed here, so that cannot say itself.
_NEUTRAL: tuple[JsonValue, ...] = (None, False, 0, [], "off", {})


def plan_strategies(plan: Plan) -> list[Strategy]:
    """The strategies the plan used and this install registers, in effect order.

    The plan's config names them (None: every registered one); a choice of the pick names
    one too, so a plan made with strategies passed in by hand still finds them.
    """
    registered = set(registered_names())
    names = list(plan.config.strategies or registered_names())
    names += [n for n in plan.candidate.choices if n not in names]
    found = load_strategies(sorted({n for n in names if n in registered}, key=names.index))
    return sorted(found, key=lambda s: s.effect_order)


def parts(plan: Plan, strategies: Sequence[Strategy] | None = None) -> dict[str, ReportPart]:
    """Strategy name -> how the report shows the pick's choice, in effect order; strategies
    with nothing to show are left out."""
    strategies = plan_strategies(plan) if strategies is None else strategies
    out = {}
    for strategy in strategies:
        part = describe_choice(strategy, plan.candidate.choices.get(strategy.name), plan)
        if part is not None:
            out[strategy.name] = part
    return out


def others(
    plan: Plan, strategies: Sequence[Strategy], found: dict[str, ReportPart]
) -> dict[str, str]:
    """The "Also" entries, in the pick's order: name -> words, for each choice whose part
    has no row of its own, and for each non-neutral choice of a strategy not installed here
    (as itself, or its JSON). A strategy whose measured stage has a row is left out."""
    installed = {s.name for s in strategies}
    staged = {stage.strategy for stage in plan.stages}
    out = {}
    for name, choice in plan.candidate.choices.items():
        if name in staged:
            continue
        if name in installed:
            part = found.get(name)
            if part is not None and not part.label:
                out[name] = part.words
        elif choice not in _NEUTRAL:
            out[name] = choice if isinstance(choice, str) else json.dumps(choice)
    return out


def changes(cand: Candidate, strategies: Sequence[Strategy]) -> dict[str, str]:
    """The choices of ``cand`` that change the step the device runs, as JSON."""
    by_name = {s.name: s for s in strategies}
    out = {}
    for name, choice in cand.choices.items():
        strategy = by_name.get(name)
        runs = changes_step(strategy, choice) if strategy is not None else choice not in _NEUTRAL
        if runs:
            out[name] = json.dumps(choice, sort_keys=True)
    return out


def installs(strategies: Sequence[Strategy]) -> list[str]:
    """What ``apply_plan`` installs in the forward, a word per strategy, in effect order."""
    return [word for word in (installs_word(s) for s in strategies) if word]
