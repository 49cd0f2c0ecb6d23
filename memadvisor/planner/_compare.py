"""The configurations a person would try by hand, for the report to set the plan against.

Baseline (every strategy off), then each strategy's own hand choice (``Strategy.by_hand``:
"+Checkpointing" every block, "+AMP" bf16 else fp16 autocast), the strategy applied last
first, then all of them together ("+Both" for two). A strategy that offers no hand choice
for this profile has no row, rather than a faked one.
"""

from __future__ import annotations

from pydantic import JsonValue

from memadvisor.planner._space import SearchSpace
from memadvisor.strategy import HandTried, TimedEachChoice

__all__ = ["hand_configurations", "unchecked_hand_choices"]


def _hand_choices(space: SearchSpace) -> list[tuple[str | None, str, JsonValue]]:
    """(label, strategy name, choice) of each strategy's hand choice, the strategy applied
    last first (checkpointing before precision's autocast, which every other one reads)."""
    out = []
    for s in sorted(space.strategies, key=lambda s: -s.effect_order):
        if not isinstance(s, HandTried):
            continue
        picked = s.by_hand(space.options.get(s.name, []))
        if picked is not None:
            label, choice = picked
            out.append((label, s.name, choice))
    return out


def hand_configurations(space: SearchSpace) -> list[tuple[str, dict[str, JsonValue]]]:
    """(label, choices) of each hand configuration this profile's strategies can express;
    a hand choice without a label (the ranks' wrap) is in every row."""
    chosen = _hand_choices(space)
    every = {name: choice for label, name, choice in chosen if label is None}
    hand = [(label, name, choice) for label, name, choice in chosen if label is not None]
    rows: list[tuple[str, dict[str, JsonValue]]] = [("Baseline", {**every})]
    rows += [(label, {name: choice, **every}) for label, name, choice in hand]
    if len(hand) > 1:
        # In the order the strategies apply them.
        together = {name: choice for _, name, choice in reversed(hand)}
        rows.append(("+Both" if len(hand) == 2 else "+All", {**together, **every}))
    return rows


def unchecked_hand_choices(space: SearchSpace) -> list[dict[str, JsonValue]]:
    """Baseline and each choice of a guarded strategy (``TimedEachChoice``: precision), the
    rest plain, as the search writes candidates: a strategy with one option keeps it (an
    advice-only strategy is in every candidate), every other strategy its neutral option.

    The planner times these beside the estimate's best, so that an error in the estimate's
    step times (``docs/design.md``, "Re-ranking on the device") cannot make the plan lose to
    a configuration a person tries first. Empty when the space has no neutral option for a
    strategy other than the guarded ones to fall back on.
    """
    plain = space.plain_indices()
    if plain is None:
        return []
    guarded = [i for i, s in enumerate(space.strategies) if isinstance(s, TimedEachChoice)]
    if not guarded:
        return [space.choices_of(plain)]
    out: list[dict[str, JsonValue]] = []
    for at in guarded:
        for index in range(len(space.options[space.strategies[at].name])):
            indices = list(plain)
            indices[at] = index
            choices = space.choices_of(indices)
            if choices not in out:
                out.append(choices)
    return out
