"""What the plan says about its pick: each strategy's record of it, and each one's advice.

Shared by the plan on a device (``_plan``) and the plan without one (``_estimated``).
"""

from __future__ import annotations

from collections.abc import Sequence

from memadvisor.schema.advice import Advice
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.profile import Profile
from memadvisor.strategy import Recorded, Strategy

__all__ = ["advice_for", "with_records"]


def with_records(
    candidate: Candidate, strategies: Sequence[Strategy], config: PlanConfig
) -> Candidate:
    """The pick with each strategy's record of it (``Recorded.record``: the batch size's), so
    that their advice explains what the planner solved itself."""
    records = {}
    for s in strategies:
        if not isinstance(s, Recorded):
            continue
        record = s.record(candidate, config)
        if record is not None:
            records[s.name] = record
    if not records:
        return candidate
    return Candidate(
        batch_size=candidate.batch_size,
        accumulation_steps=candidate.accumulation_steps,
        choices={**candidate.choices, **records},
    )


def advice_for(
    strategies: Sequence[Strategy], candidate: Candidate, profile: Profile
) -> list[Advice]:
    out = []
    for s in strategies:
        choice = candidate.choices.get(s.name)
        if choice is None or s.is_neutral(choice):
            continue
        advice = s.explain(choice, profile)
        if advice is not None:
            out.append(advice)
    return out
