"""The search: the batch solved on the estimate, the space enumerated or sampled, a fixed seed."""

from __future__ import annotations

import itertools

import optuna
import pytest
from pydantic import JsonValue

from memadvisor.errors import InfeasibleBudgetError
from memadvisor.estimate import StepModel, estimate
from memadvisor.planner import _search
from memadvisor.planner._progress import Progress
from memadvisor.planner._search import ranked_or_infeasible, search
from memadvisor.planner._space import SearchSpace, largest_batch, micro_batch_for
from memadvisor.schema.advice import Advice
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.strategy import Strategy

MIB = 2**20


class _Padding(Strategy):
    """A third-party-like strategy: n choices, each adding bytes and time (0 is off)."""

    def __init__(self, name: str, n: int) -> None:
        self.name = name  # type: ignore[misc]
        self.n = n

    def choices(self, profile, config) -> list[JsonValue]:
        return list(range(self.n))

    def effect(self, profile, choice, model: StepModel) -> None:
        model.add_bytes("backward", int(choice) * MIB)  # type: ignore[arg-type]
        model.add_ms(-0.01 * int(choice))  # type: ignore[arg-type]  # a little faster

    def apply(self, step, choice):
        return step

    def explain(self, choice, profile) -> Advice | None:
        return None


def _brute_largest(profile, choices, strategies, limit: int, cap: int = 4000) -> int:
    b = 0
    while b < cap:
        cand = Candidate(batch_size=b + 1, choices=choices)
        if estimate(profile, cand, strategies).peak_bytes > limit:
            break
        b += 1
    return b


@pytest.mark.parametrize("limit_mib", [5, 20, 92, 300])
def test_largest_batch_on_the_estimate_equals_counting_up(profile, strategies, limit_mib) -> None:
    """The chord/bisection solve gives exactly the largest batch a count from 1 finds."""
    for choices in (
        {},
        {"precision": "bf16"},
        {"checkpointing": ["b0", "b1"]},
        {"precision": "bf16", "checkpointing": ["b0", "b1", "b2", "b3"]},
    ):
        limit = limit_mib * MIB
        got = largest_batch(profile, choices, strategies, limit, max_batch=65536)
        assert got == _brute_largest(profile, choices, strategies, limit), choices


def test_largest_batch_is_capped_and_zero_when_nothing_fits(profile, strategies) -> None:
    """max_batch caps the answer; a limit below batch 1's peak gives 0."""
    assert largest_batch(profile, {}, strategies, 10**15, max_batch=77) == 77
    assert largest_batch(profile, {}, strategies, 1, max_batch=77) == 0


@pytest.mark.parametrize(
    ("effective", "largest", "expected"),
    [
        (64, 100, (64, 1)),  # fits whole
        (72, 35, (24, 3)),  # 3 steps of 24 keep 72 exactly
        (73, 35, (25, 3)),  # prime: fewest steps, rounded up to 75
        (128, 1, (1, 128)),  # only batch 1 fits
        (10, 0, (0, 0)),  # nothing fits
    ],
)
def test_micro_batch_for_an_effective_batch(effective, largest, expected) -> None:
    """The fewest accumulation steps; exact when a divisor within twice that count exists."""
    assert micro_batch_for(effective, largest) == expected


def test_enumeration_scores_every_combination_and_ranks_the_true_best_first(
    profile, strategies
) -> None:
    """A small space is walked whole: the top equals the best of a brute-force ranking, and
    neutral choices are left out of the candidate (off)."""
    config = PlanConfig(budget_bytes=100 * MIB)
    space = SearchSpace(profile, strategies, config)
    assert space.size <= _search.ENUMERATE_UP_TO
    ranked = search(space, seed=0)
    every = [
        space.score(i) for i in itertools.product(*(range(len(o)) for o in space.options.values()))
    ]
    best = min((s for s in every if s is not None), key=space.key)
    assert ranked[0] == best
    assert len(ranked) == len({s.choices_json for s in every if s is not None})
    assert all("fp32" not in s.candidate.choices.values() for s in ranked)
    assert all(s.candidate.choices.get("checkpointing") != [] for s in ranked)


def test_a_large_space_is_sampled_with_tpe_and_the_same_seed_gives_the_same_ranking(
    profile, strategies, monkeypatch
) -> None:
    """Past ENUMERATE_UP_TO combinations TPE samples (fewer trials here to keep the test
    short); the same seed gives the same ranking, and Optuna's log level is put back."""
    monkeypatch.setattr(_search, "TPE_TRIALS", 30)
    config = PlanConfig(budget_bytes=100 * MIB)
    extra = [_Padding("pad_a", 11), _Padding("pad_b", 11), _Padding("pad_c", 3)]
    level = optuna.logging.get_verbosity()
    runs = []
    for _ in range(2):
        space = SearchSpace(profile, [*strategies, *extra], config)
        assert space.size > _search.ENUMERATE_UP_TO
        runs.append([s.choices_json for s in search(space, seed=7)])
    assert runs[0] == runs[1] and 0 < len(runs[0]) <= 30
    assert optuna.logging.get_verbosity() == level


def test_ranked_or_infeasible_ranks_or_says_what_does_not_fit(profile, strategies) -> None:
    """The planner's one way into the search (a plan with a device and one without): the
    ranking where something fits; where the static bytes fit but not even batch 1 does, the
    error says so; where the static bytes alone exceed the budget, it names them."""
    ui = Progress(enabled=False)
    roomy = SearchSpace(profile, strategies, PlanConfig(budget_bytes=100 * MIB))
    assert ranked_or_infeasible(roomy, ui) == search(roomy, seed=0)

    # The smallest budget whose usable part holds the static bytes: no room for batch 1.
    budget = next(
        b
        for b in itertools.count(profile.static_bytes, 1024)
        if PlanConfig(budget_bytes=b).usable_bytes >= profile.static_bytes
    )
    tight = SearchSpace(profile, strategies, PlanConfig(budget_bytes=budget))
    assert search(tight, seed=0) == []
    with pytest.raises(InfeasibleBudgetError, match="no configuration fits even batch 1"):
        ranked_or_infeasible(tight, ui)

    starved = SearchSpace(profile, strategies, PlanConfig(budget_bytes=profile.static_bytes // 2))
    with pytest.raises(InfeasibleBudgetError, match="optimizer state alone take"):
        ranked_or_infeasible(starved, ui)
