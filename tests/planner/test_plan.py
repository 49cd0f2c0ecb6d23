"""plan_workload against a hand-built profile, fake strategies and a fake device.

The fake device fits a candidate iff its batch is at most a threshold that depends on the
candidate's choices, so the right plan is known without a card or the profiler.
"""

from __future__ import annotations

import pytest

from memadvisor.errors import InfeasibleBudgetError
from memadvisor.planner import measure_configuration, plan_workload, safe_below
from memadvisor.planner._search import search
from memadvisor.planner._space import SearchSpace
from memadvisor.schema.config import GIB, PlanConfig
from memadvisor.schema.plan import Plan

MIB = 2**20
FAST = {"probe_steps": 2, "timing_steps": 2, "verify_steps": 4}


def _config(**overrides) -> PlanConfig:
    """The tables below check the fixed margin's rule (``--margin``, 8% here); the measured
    margin has a table of its own (test_the_measured_margin_...)."""
    fixed = {"margin_fraction": 0.08}
    return PlanConfig(**{"budget_bytes": 100 * MIB, **FAST, **fixed, **overrides})


def _estimate_thresholds(profile, strategies, config) -> dict[str, int]:
    """Threshold per choice set = the estimate's own largest batch: the estimate is exact."""
    space = SearchSpace(profile, strategies, config)
    out = {}
    for indices in space.combinations():
        scored = space.score(indices)
        if scored is not None:
            out[scored.choices_json] = scored.largest_batch
    return out


class _ByChoices:
    def __init__(self, thresholds: dict[str, int]) -> None:
        self.thresholds = thresholds

    def __call__(self, candidate) -> int:
        import json

        return self.thresholds.get(json.dumps(candidate.choices, sort_keys=True), 0)


def _fits_up_to(profile, strategies, threshold):
    """A device threshold per candidate: ``threshold(bf16, t)`` of the estimate's own
    largest batch ``t`` for the candidate's choices (exact when it returns ``t``)."""
    thresholds = _estimate_thresholds(profile, strategies, _config())

    def fits_up_to(candidate) -> int:
        start = _ByChoices(thresholds)(candidate)
        return threshold(candidate.choices.get("precision") == "bf16", start)

    return fits_up_to


def _plan(workload, profile, strategies, device, measure_comparison=None, **overrides) -> Plan:
    return plan_workload(
        workload,
        _config(**overrides),
        profile=profile,
        device=device,
        progress=False,
        strategies=strategies,
        measure_comparison=measure_comparison,
    )


def _label(candidate) -> str:
    """'bf16/2': precision / number of checkpointed blocks."""
    precision = candidate.choices.get("precision", "fp32")
    return f"{precision}/{len(candidate.choices.get('checkpointing', []))}"


# The toy profile's estimate under 100 MiB (8% margin): each choice set's largest batch under
# the usable budget (where it is timed), the bracket's top under the whole budget, and its
# estimated samples/s there:
#   fp32/0 18 (top 20) 316 | bf16/0 32 (35) 627 | bf16/1 38 (42) 587 | bf16/2 46 (51) 551
#   (bf16/3 59 at 519 is the fourth; every fp32 one is under 0.7x of 627.)
# Timed: the estimate's best three (bf16/0, bf16/1, bf16/2) and, as the guard against the
# estimate's time errors, Baseline (fp32/0). The fake's throughput grows with the batch, so
# among those that fit, the largest batch wins. Every run takes verify_steps (4) steps on
# this card-like device, so the winner's run at the final batch is its verification.
# Before the re-rank was one run per candidate, each of the three best ran its own batch
# search (2 probes each with an exact estimate) and the pick a separate verify: 7 runs.
PLAN_CASES = [
    # exact: all four fit where timed; bf16/2 at 46 is fastest; its timing run measured
    # 46/46.5 of the budget, past the usable 92%, so extrapolating from it finds no room
    # above 46 and the search ends there: 4 runs, the winner's 1.
    (
        "exact",
        lambda bf16, t: t,
        True,
        [
            ("timing", "bf16/0", 32, True),
            ("timing", "bf16/1", 38, True),
            ("timing", "bf16/2", 46, True),
            ("timing", "fp32/0", 18, True),
        ],
        ("bf16/2", 46),
    ),
    # pessimistic (the device holds 1000): bf16/2's timing run at 46 measured 4.6 MiB, so
    # the estimate's bytes per sample from there to 2% under the usable budget reach 90,
    # which fits with its peak (9 MiB) inside the margin: taken, and it verifies. 5 runs,
    # the winner's 2.
    (
        "pessimistic",
        lambda bf16, t: 1000,
        True,
        [
            ("timing", "bf16/0", 32, True),
            ("timing", "bf16/1", 38, True),
            ("timing", "bf16/2", 46, True),
            ("timing", "fp32/0", 18, True),
            ("probe", "bf16/2", 90, True),
        ],
        ("bf16/2", 90),
    ),
    # 5% optimistic: all four fail where timed. Nothing fitted, so the estimate's best,
    # bf16/0, runs the margin below (safe_below(32) = 29) and fits; then bf16/1 at 34,
    # bf16/2 at 42 and fp32/0 at 16 are not run: by the estimate none beats bf16/0 at 29
    # (their recompute costs more than their batch gains). 29 is already the margin below
    # the failure: 5 runs, the winner's 2.
    (
        "optimistic 5%",
        lambda bf16, t: int(0.95 * t),
        True,
        [
            ("timing", "bf16/0", 32, False),
            ("timing", "bf16/1", 38, False),
            ("timing", "bf16/2", 46, False),
            ("timing", "fp32/0", 18, False),
            ("timing", "bf16/0", 29, True),
        ],
        ("bf16/0", 29),
    ),
    # bf16 5% optimistic, fp32 exact: fp32/0 fits at 18; bf16/0 at 29 beats it by the
    # estimate, so it runs, fits and is measured faster. 5 runs.
    (
        "bf16 optimistic 5%",
        lambda bf16, t: int(0.95 * t) if bf16 else t,
        True,
        [
            ("timing", "bf16/0", 32, False),
            ("timing", "bf16/1", 38, False),
            ("timing", "bf16/2", 46, False),
            ("timing", "fp32/0", 18, True),
            ("timing", "bf16/0", 29, True),
        ],
        ("bf16/0", 29),
    ),
    # 15% optimistic (two margins): bf16/0's 29 fails too (threshold 27), so bf16's other
    # candidates get no retry; fp32 gets its own (16 fails, threshold 15). Nothing fitted,
    # so bf16/0's batch search continues alone: safe_below(29) = 26 fits. 7 runs, the
    # winner's 3 (32, 29, 26).
    (
        "optimistic 15%",
        lambda bf16, t: int(0.85 * t),
        True,
        [
            ("timing", "bf16/0", 32, False),
            ("timing", "bf16/1", 38, False),
            ("timing", "bf16/2", 46, False),
            ("timing", "fp32/0", 18, False),
            ("timing", "bf16/0", 29, False),
            ("timing", "fp32/0", 16, False),
            ("probe", "bf16/0", 26, True),
        ],
        ("bf16/0", 26),
    ),
    # bf16 15% optimistic, fp32 exact: bf16/0 runs out at 32 and at 29, fp32/0 fits at 18;
    # bf16/0's search going on down (the group ran out twice, and fp32 is far behind by the
    # estimate) costs one run, 26, the margin below 29: the pick is bf16 at 26 (7879
    # samples/s on the fake) rather than fp32 at 18 (4737), where before it stopped at fp32.
    (
        "bf16 optimistic 15%, searched down",
        lambda bf16, t: int(0.85 * t) if bf16 else t,
        True,
        [
            ("timing", "bf16/0", 32, False),
            ("timing", "bf16/1", 38, False),
            ("timing", "bf16/2", 46, False),
            ("timing", "fp32/0", 18, True),
            ("timing", "bf16/0", 29, False),
            ("probe", "bf16/0", 26, True),
        ],
        ("bf16/0", 26),
    ),
    # exact, on a device whose runs are cheap next to their steps (the simulated CPU
    # device): probes take probe_steps (2), so the pick's sustained run is a run of its own.
    (
        "exact, short probes",
        lambda bf16, t: t,
        False,
        [
            ("timing", "bf16/0", 32, True),
            ("timing", "bf16/1", 38, True),
            ("timing", "bf16/2", 46, True),
            ("timing", "fp32/0", 18, True),
            ("verify", "bf16/2", 46, True),
        ],
        ("bf16/2", 46),
    ),
]


@pytest.mark.parametrize(
    ("case", "threshold", "card_like", "expected_runs", "expected_pick"),
    PLAN_CASES,
    ids=[c[0] for c in PLAN_CASES],
)
def test_plan_runs_exactly_the_expected_device_runs(
    workload,
    profile,
    strategies,
    fake_device,
    case,
    threshold,
    card_like,
    expected_runs,
    expected_pick,
) -> None:
    """Each device whose threshold is a known function of the estimate's batch leads to
    exactly the expected device runs (stage, choices, batch, fits), in order, and the pick."""
    config = _config()
    device = fake_device(
        _fits_up_to(profile, strategies, threshold), runs_cost_more_than_steps=card_like
    )
    plan = _plan(workload, profile, strategies, device, measure_comparison=False)
    runs = [(p.stage, _label(p.candidate), p.batch_size, p.fits) for p in plan.probes]
    assert runs == expected_runs
    assert len(device.calls) == len(expected_runs)
    assert (_label(plan.candidate), plan.candidate.batch_size) == expected_pick
    steps = config.verify_steps if card_like else config.probe_steps
    assert {s for _, s, _ in device.calls if s != config.verify_steps} <= {steps}
    assert plan.verified is not None and plan.verified.steps == config.verify_steps


def test_a_group_far_off_is_searched_down_when_what_fitted_is_far_behind(
    workload, profile, strategies, fake_device
) -> None:
    """Rule: where every bf16 candidate runs out at its estimated batch and at the margin
    below (the estimate 40% optimistic for bf16 alone) and only fp32 fitted, the estimate's
    best bf16 candidate continues its batch search, because at half the batch it ran out at
    it would still beat fp32 by the estimate; the pick is then bf16, at a batch that holds,
    and a note says why. (On a card: lm350m's chunked-loss candidates ran out at 19, 18, 17
    and the plan kept bf16 without checkpointing at batch 1, 3.7x slower.)"""
    fits_up_to = _fits_up_to(profile, strategies, lambda bf16, t: int(0.6 * t) if bf16 else t)
    device = fake_device(fits_up_to, runs_cost_more_than_steps=True)
    plan = _plan(workload, profile, strategies, device, measure_comparison=False)
    assert plan.candidate.choices.get("precision") == "bf16", plan.probes
    assert plan.candidate.batch_size <= fits_up_to(plan.candidate)
    assert plan.verified is not None
    assert any("went on" in n and "so the pick is that" in n for n in plan.notes), plan.notes
    # The fp32 pick it replaced was confirmed first (its runs are in the record).
    assert any(p.fits and p.candidate.choices.get("precision") != "bf16" for p in plan.probes)
    assert len(plan.probes) <= 12, [(p.stage, p.batch_size, p.fits) for p in plan.probes]


def test_a_typical_plan_takes_at_most_five_device_runs_and_three_for_the_winner(
    workload, profile, strategies, fake_device
) -> None:
    """The issue's goal: with an estimate within two margins of the device (thresholds from
    85% to 115% of the estimate's batch), a plan on a card-like device uses at most 3 runs
    of the winner's choices and at most 7 device runs in all (5 within one margin, 92% and
    up; beyond it each precision, fp32 and bf16 here, gets its retry the margin below),
    verification included."""
    config = _config()
    thresholds = _estimate_thresholds(profile, strategies, config)
    for percent in (85, 88, 90, 91, 92, 95, 100, 105, 110, 115):
        device = fake_device(
            lambda c, p=percent: int(_ByChoices(thresholds)(c) * p / 100),
            runs_cost_more_than_steps=True,
        )
        plan = _plan(workload, profile, strategies, device, measure_comparison=False)
        winner = [p for p in plan.probes if p.candidate.choices == plan.candidate.choices]
        assert len(winner) <= 3, (percent, plan.probes)
        assert len(plan.probes) <= (5 if percent >= 92 else 7), (percent, plan.probes)


def test_the_pick_is_the_fastest_measured_of_the_reranked(
    workload, profile, strategies, fake_device
) -> None:
    """Re-ranking is by the device's measured throughput, not the estimate's."""
    thresholds = _estimate_thresholds(profile, strategies, _config())
    device = fake_device(_ByChoices(thresholds))
    plan = _plan(workload, profile, strategies, device)
    timed = {}
    for p in plan.probes:
        if p.stage in ("probe", "timing") and p.fits and p.candidate is not None:
            key = __import__("json").dumps(p.candidate.choices, sort_keys=True)
            timed[key] = max(timed.get(key, 0), p.batch_size)
    # The fake's throughput grows with the batch and halves its per-sample time in bf16:
    # the pick must be the bf16 choice set with the largest fitting batch.
    bf16 = {k: b for k, b in timed.items() if '"bf16"' in k}
    assert plan.candidate.choices.get("precision") == "bf16"
    assert plan.candidate.batch_size == max(bf16.values())


def test_same_seed_gives_the_same_plan(workload, profile, strategies, fake_device) -> None:
    """A fixed seed and profile give the same pick and the same probes."""
    thresholds = _estimate_thresholds(profile, strategies, _config())
    plans = [
        _plan(workload, profile, strategies, fake_device(_ByChoices(thresholds))) for _ in range(2)
    ]
    assert plans[0].candidate == plans[1].candidate
    assert [(p.batch_size, p.fits) for p in plans[0].probes] == [
        (p.batch_size, p.fits) for p in plans[1].probes
    ]


def test_a_failed_verification_steps_down_and_says_so(
    workload, profile, strategies, fake_device
) -> None:
    """A batch that passes short probes but fails sustained steps is stepped down by the
    margin below the failure (halved after three such steps: it is far off), verified
    there, and a note says so."""
    # Probes (<= 3 steps) fit up to 60 in every configuration; sustained runs only to 30.
    device = fake_device(lambda c: 60, sustained=30, short_steps=3)
    plan = _plan(workload, profile, strategies, device, verify_steps=10, rerank_top=1)
    verify = [p for p in plan.probes if p.stage == "verify"]
    assert not verify[0].fits and verify[-1].fits
    assert plan.candidate.batch_size <= 30
    for i, (failed, retried) in enumerate(zip(verify, verify[1:], strict=False)):
        expected = safe_below(failed.batch_size, 0.08) if i < 3 else failed.batch_size // 2
        assert retried.batch_size == expected
    assert any("stepped down" in n for n in plan.notes)
    assert plan.verified is not None and plan.verified.steps == 10


def test_non_oom_errors_propagate_unchanged(workload, profile, strategies, fake_device) -> None:
    """An error that is not an out-of-memory leaves plan_workload as the very same object."""
    error = KeyError("the model's own bug")
    device = fake_device(lambda c: 1000, error=error)
    with pytest.raises(KeyError) as caught:
        _plan(workload, profile, strategies, device)
    assert caught.value is error


def test_weights_above_the_budget_fail_at_once_naming_the_minimum(
    workload, profile_factory, strategies, fake_device
) -> None:
    """Weights + grads + optimizer state above the usable budget: InfeasibleBudgetError
    before any device run, with the minimum budget in GiB in the message and on the error."""
    profile = profile_factory(param_mib=40.0)  # 40 + 40 + 80 = 160 MiB of static bytes
    device = fake_device(lambda c: 1000)
    with pytest.raises(InfeasibleBudgetError) as caught:
        _plan(workload, profile, strategies, device)
    assert device.calls == []
    minimum = caught.value.minimum_bytes
    assert minimum is not None and minimum > profile.static_bytes / 0.92
    assert f"{minimum / GIB:.2f}"[:3] in str(caught.value) and "GiB" in str(caught.value)
    # The named minimum is enough: planning at it succeeds.
    ok = plan_workload(
        workload,
        PlanConfig(budget_bytes=minimum, **FAST),
        profile=profile,
        device=device,
        progress=False,
        strategies=strategies,
    )
    assert ok.candidate.batch_size >= 1


def test_nothing_fitting_on_the_device_is_infeasible(
    workload, profile, strategies, fake_device
) -> None:
    """If not even batch 1 fits on the device for the best candidates, say so as infeasible."""
    with pytest.raises(InfeasibleBudgetError, match="not even batch 1"):
        _plan(workload, profile, strategies, fake_device(lambda c: 0))


def test_largest_batch_objective_takes_the_largest_fitting_batch(
    workload, profile, strategies, fake_device
) -> None:
    """objective='largest_batch': of the timed choice sets, the pick has the largest batch the
    device allows: here its threshold (the estimate's own batch), where its timing run's
    measured peak leaves no room above, so the winner's search ends with that run."""
    config = _config(objective="largest_batch")
    space = SearchSpace(profile, strategies, config)
    thresholds = _estimate_thresholds(profile, strategies, config)
    device = fake_device(_ByChoices(thresholds))
    plan = _plan(workload, profile, strategies, device, objective="largest_batch")
    allowed = {}
    for p in plan.probes:
        if p.stage == "timing":
            scored = space.score_choices(p.candidate.choices)
            key = scored.choices_json
            # start fits (the threshold is the estimate's own) and measures no room above
            allowed[key] = thresholds[key]
    assert plan.candidate.batch_size == max(allowed.values())
    assert len(plan.candidate.choices["checkpointing"]) >= 3
    # No Baseline guard for this objective: it ranks by batch, which the device measured.
    assert all(p.candidate.choices != {} for p in plan.probes if p.stage != "compare")


@pytest.mark.parametrize(
    ("effective", "micro", "steps"), [(20, 20, 1), (120, 60, 2), (150, 50, 3), (127, 43, 3)]
)
def test_effective_batch_is_kept_through_accumulation(
    workload, profile, strategies, fake_device, effective: int, micro: int, steps: int
) -> None:
    """objective='effective_batch': the fewest accumulation steps that reach the user's batch
    with a micro-batch that fits (60 here); exactly when a divisor allows (150 = 3 x 50),
    else rounded up and said so (127 is prime: 3 x 43 = 129)."""
    device = fake_device(lambda c: 60)
    plan = _plan(
        workload,
        profile,
        strategies,
        device,
        budget_bytes=GIB,  # the estimate allows far more than 60: max_batch caps the bracket
        objective="effective_batch",
        effective_batch=effective,
        max_batch=60,
    )
    assert (plan.candidate.batch_size, plan.candidate.accumulation_steps) == (micro, steps)
    overshoot = micro * steps - effective
    rounded = f"Effective batch {micro * steps}, not {effective}"
    assert any(n.startswith(rounded) for n in plan.notes) == (overshoot > 0)


def test_advice_and_comparison_rows(workload, profile, strategies, fake_device) -> None:
    """Advice explains each non-neutral chosen strategy; the comparison has the four hand
    configurations, each measured on this cheap device, and the plan, measured."""
    thresholds = _estimate_thresholds(profile, strategies, _config())
    plan = _plan(workload, profile, strategies, fake_device(_ByChoices(thresholds)))
    chosen = {k for k, v in plan.candidate.choices.items() if v not in ("fp32", [])}
    assert {a.strategy for a in plan.advice} == chosen
    labels = [r.label for r in plan.comparison]
    assert labels == ["Baseline", "+Checkpointing", "+AMP", "+Both", "Plan"]
    for row in plan.comparison:
        assert row.measured is not None
        key = __import__("json").dumps(row.candidate.choices, sort_keys=True)
        assert 1 <= row.candidate.batch_size <= thresholds[key]
    assert plan.comparison[-1].measured == plan.verified
    baseline = plan.comparison[0]
    assert baseline.candidate.choices == {} and baseline.largest_batch == thresholds["{}"]


def test_rows_are_estimated_when_not_measured(workload, profile, strategies, fake_device) -> None:
    """measure_comparison=False: hand rows carry no measurement and a note says so."""
    thresholds = _estimate_thresholds(profile, strategies, _config())
    plan = plan_workload(
        workload,
        _config(),
        profile=profile,
        device=fake_device(_ByChoices(thresholds)),
        progress=False,
        strategies=strategies,
        measure_comparison=False,
    )
    assert [r.measured is None for r in plan.comparison] == [True] * 4 + [False]
    assert any("estimated" in n for n in plan.notes)
    assert not [p for p in plan.probes if p.stage == "compare"]


def test_progress_false_prints_nothing(workload, profile, strategies, fake_device, capfd) -> None:
    """progress=False is silent on stdout and stderr."""
    thresholds = _estimate_thresholds(profile, strategies, _config())
    _plan(workload, profile, strategies, fake_device(_ByChoices(thresholds)))
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_plan_round_trips_as_json(workload, profile, strategies, fake_device) -> None:
    """The plan, probes and rows included, survives JSON (it is saved and loaded back)."""
    thresholds = _estimate_thresholds(profile, strategies, _config())
    plan = _plan(workload, profile, strategies, fake_device(_ByChoices(thresholds)))
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_measure_configuration_finds_a_hand_configuration_batch_like_the_plan(
    workload, profile, strategies, fake_device
) -> None:
    """A hand configuration's largest batch is probed as the plan's is (bracket and margin):
    with an exact estimate it is the estimate's batch, measured in one run (its peak leaves
    no room above); one that never fits gives 0."""
    config = _config()
    thresholds = _estimate_thresholds(profile, strategies, config)
    device = fake_device(_ByChoices(thresholds))
    choices = {"precision": "bf16"}
    row, runs = measure_configuration(
        workload, config, choices, profile=profile, device=device, strategies=strategies
    )
    key = SearchSpace(profile, strategies, config).score_choices(choices).choices_json
    assert row.largest_batch == row.candidate.batch_size == thresholds[key]
    assert row.measured is not None and len(runs) == 1
    row, runs = measure_configuration(
        workload, config, choices, profile=profile, device=fake_device(0), strategies=strategies
    )
    assert (row.largest_batch, row.measured) == (0, None) and all(not r.fits for r in runs)


@pytest.mark.parametrize("times_rank", [True, False])
def test_reranking_uses_device_times_only_where_they_rank(
    workload, profile, strategies, fake_device, times_rank: bool
) -> None:
    """A card's measured times re-rank the best candidates; a device whose times do not rank
    (the simulated device's CPU times) keeps the estimate's order, and runs the estimate's
    best only (it fits here): the others could not overtake it by the estimate."""
    config = _config()
    thresholds = _estimate_thresholds(profile, strategies, config)
    device = fake_device(_ByChoices(thresholds), inverse_times=True)
    device.capabilities = device.capabilities.model_copy(update={"step_times_rank": times_rank})
    plan = _plan(workload, profile, strategies, device)
    reranked = [p.candidate for p in plan.probes if p.stage == "timing" and p.fits]
    smallest = min(reranked, key=lambda c: c.batch_size)
    estimate_best = search(SearchSpace(profile, strategies, config), config.seed)[0]
    expected = smallest if times_rank else estimate_best.candidate
    assert plan.candidate.choices == expected.choices
    assert any("estimate's step time" in n for n in plan.notes) == (not times_rank)
    if not times_rank:
        assert [p.stage for p in plan.probes].count("timing") == 1


def test_the_hand_configurations_without_checkpointing_are_timed_beside_the_estimates_best(
    workload, profile, strategies, fake_device
) -> None:
    """Baseline (fp32, nothing checkpointed) is far behind by the estimate (316 vs 627
    samples/s) and outside its best three, yet it is timed; when the card says it is fastest
    (here: smaller batches faster), the plan takes it and cannot lose to it. On a device
    whose times do not rank, there is nothing to guard and it is not run."""
    config = _config()
    thresholds = _estimate_thresholds(profile, strategies, config)
    estimate_top = search(SearchSpace(profile, strategies, config), config.seed)[:3]
    assert all(s.candidate.choices.get("precision") == "bf16" for s in estimate_top)
    device = fake_device(_ByChoices(thresholds), inverse_times=True)
    plan = _plan(workload, profile, strategies, device, measure_comparison=False)
    assert plan.candidate.choices == {}
    assert plan.candidate.batch_size == thresholds["{}"]
    device = fake_device(_ByChoices(thresholds), inverse_times=True)
    device.capabilities = device.capabilities.model_copy(update={"step_times_rank": False})
    plan = _plan(workload, profile, strategies, device, measure_comparison=False)
    assert all(p.candidate.choices != {} for p in plan.probes)


def test_candidates_far_behind_by_the_estimate_are_not_timed(
    workload, profile, strategies, fake_device
) -> None:
    """With rerank_top 10 the estimate's whole ranking could be timed; only those within 0.7x
    of the best's estimated samples/s are (the five bf16 ones here, 488 to 627), plus the
    Baseline guard: six timing runs, not ten."""
    config = _config(rerank_top=10)
    thresholds = _estimate_thresholds(profile, strategies, config)
    ranked = search(SearchSpace(profile, strategies, config), config.seed)
    best = ranked[0].estimate.samples_per_s
    near = {s.choices_json for s in ranked if s.estimate.samples_per_s >= 0.7 * best}
    device = fake_device(_ByChoices(thresholds), runs_cost_more_than_steps=True)
    plan = _plan(workload, profile, strategies, device, rerank_top=10, measure_comparison=False)
    timed = {
        __import__("json").dumps(p.candidate.choices, sort_keys=True)
        for p in plan.probes
        if p.stage == "timing"
    }
    assert timed == near | {"{}"}
    assert len(near) == 5


def test_candidates_within_noise_give_the_same_pick_every_time(
    workload, profile, strategies, fake_device
) -> None:
    """Every candidate fits batch 30 and runs 1000 samples/s but for +-1.5% of jitter: which
    one measures fastest changes with the jitter, the pick does not (the fewest strategies:
    the plain step), and a note says the candidates tied."""
    import json
    import random

    from memadvisor.schema.candidate import Measurement

    class Jittery(fake_device):
        def __init__(self, seed: int) -> None:
            super().__init__(lambda c: 30)
            self.rng = random.Random(seed)
            self.first_rates: dict[str, float] = {}  # each choice set's first (timing) run

        def run(self, workload, candidate, steps) -> Measurement:
            m = super().run(workload, candidate, steps)
            rate = 1000.0 * self.rng.uniform(0.985, 1.015)
            self.first_rates.setdefault(json.dumps(candidate.choices, sort_keys=True), rate)
            step_ms = candidate.batch_size / rate * 1e3
            return m.model_copy(update={"step_ms": step_ms, "samples_per_s": rate})

    picks, fastest = [], []
    for seed in (1, 2):
        device = Jittery(seed)
        plan = _plan(workload, profile, strategies, device)
        picks.append(plan.candidate.choices)
        assert len(device.first_rates) >= 3
        fastest.append(max(device.first_rates, key=device.first_rates.__getitem__))
        assert any(n.startswith("Tie:") and "fewest strategies" in n for n in plan.notes)
    assert fastest[0] != fastest[1]  # the jitter alone would have picked differently
    assert picks[0] == picks[1] == {}


# The measured margin on the fake device (fp32, no checkpointing; the estimate's start 18):
# a run's peak is b * budget / (threshold + 0.5). The search extrapolates along the measured
# allocated bytes per sample to the edge (the peak filling the budget), which runs out there;
# the pick is then 3% of the budget's worth of measured samples (HEADROOM_FRACTION, at least
# one) below the lowest batch that ran out.
MEASURED_MARGIN_CASES = [
    # threshold, pick, runs: (batch, fits)
    # pessimistic estimate: 30 on the estimate's slope, then 41 on the measured one (2.47 MiB
    # a sample) runs out; 3 MiB is two samples: 39. The fixed 8% margin kept 27.
    (40, 39, [(18, True), (30, True), (41, False), (39, True)]),
    # 31 runs out; 3 MiB is under one sample (3.28 MiB): 30. Fixed 8%: 24.
    (30, 30, [(18, True), (27, True), (31, False), (30, True)]),
    (19, 19, [(18, True), (20, False), (19, True)]),
    # optimistic: two margin-sized descents, then 15 one sample below 16's failure. The fixed
    # 8% margin kept 14.
    (15, 15, [(18, False), (16, False), (14, True), (15, True)]),
    # far pessimistic: four samples (0.99 MiB each) under 101's failure.
    (100, 97, [(18, True), (36, True), (101, False), (97, True)]),
]


def _headroom_kept(probes, pick: int) -> bool:
    """Whether ``pick`` stays the headroom's worth of measured samples under the lowest run
    that ran out (or is the largest that fitted where none ran out)."""
    failed = [p.batch_size for p in probes if not p.fits]
    fitted = {p.batch_size: p.peak_bytes for p in probes if p.fits}
    if not failed:
        return pick == max(fitted)
    low, high = sorted(fitted)[-2:] if len(fitted) > 1 else (0, pick)
    slope = (fitted[high] - (fitted[low] if low else 0)) / (high - low)
    return (min(failed) - pick) * slope >= 0.03 * 100 * MIB or min(failed) - pick == 1


@pytest.mark.parametrize(("threshold", "pick", "runs"), MEASURED_MARGIN_CASES)
@pytest.mark.parametrize("reserved_over", [None, 0.15])
def test_the_measured_margin_takes_the_batch_the_runs_allow(
    workload, profile, strategies, fake_device, threshold: int, pick: int, runs, reserved_over
) -> None:
    """With the margin measured (the default), the pick is at least 0.95 of the largest batch
    the device holds and stays 3% of the budget's worth of measured samples below the lowest
    batch that ran out; --margin keeps 8%. A card's reserved peak (15% over the allocated one,
    held at the budget by the cap) changes nothing: reading it, the search stopped where the
    reserve met 97% of the budget, at 0.85 of what holds."""
    config = PlanConfig(**{"budget_bytes": 100 * MIB, **FAST})
    assert config.measured_margin and not _config().measured_margin
    row, probes = measure_configuration(
        workload,
        config,
        {},
        profile=profile,
        device=fake_device(lambda c: threshold, reserved_over=reserved_over),
        strategies=strategies,
    )
    assert row.largest_batch == pick and row.candidate.batch_size == pick
    assert [(p.batch_size, p.fits) for p in probes] == runs
    assert _headroom_kept(probes, pick)
    assert pick >= 0.95 * threshold


def test_where_a_run_costs_more_than_its_steps_the_device_starts_before_the_profile(
    monkeypatch,
) -> None:
    """Rule: where a run's start dwarfs its steps (a card's fork server), plan_workload makes
    the device and prestarts it before profiling, so the start overlaps the profile; the
    profile reaches the device before its first run. (A simulated device stands in for the
    card: its capabilities say a run costs more than its steps.)"""
    import torch
    from torch import nn

    import memadvisor.planner._plan as planning
    from memadvisor.device.simulated import SimulatedDevice
    from memadvisor.schema.device import SIMULATED
    from memadvisor.workload import Workload

    events: list[str] = []
    caps = SIMULATED.model_copy(update={"runs_cost_more_than_steps": True})

    class Prestarting(SimulatedDevice):
        def prestart(self, workload) -> None:
            events.append("prestart")

        def run(self, workload, candidate, steps):
            events.append("run with a profile" if self.profile is not None else "run bare")
            return super().run(workload, candidate, steps)

    def make(capabilities, budget_bytes, *, profile, strategy_names, **kwargs):
        events.append("device")
        return Prestarting(budget_bytes, profile=profile, strategy_names=strategy_names)

    real_profile = planning._profile

    def profiled(*args, **kwargs):
        events.append("profile")
        return real_profile(*args, **kwargs)

    monkeypatch.setattr(planning, "planned_capabilities", lambda asked, device=None: caps)
    monkeypatch.setattr(planning, "make_device", make)
    monkeypatch.setattr(planning, "_profile", profiled)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    workload = Workload(
        model=model, sample_batch=torch.randn(4, 8), loss_fn=lambda out, batch: out.square().mean()
    )
    plan_workload(workload, _config(strategies=[]), progress=False, measure_comparison=False)
    assert events[:3] == ["device", "prestart", "profile"], events
    assert events.count("device") == 1 and "run bare" not in events, events


@pytest.mark.parametrize(
    ("objective", "pick_batch", "pick_rate", "held"),
    [
        ("throughput", 16, 110.0, True),  # faster than the pick it replaced
        ("throughput", 16, 90.0, False),  # slower in its verifying run
        ("largest_batch", 16, 50.0, True),  # picked for a larger batch, and still larger
        ("largest_batch", 14, 110.0, True),  # the same batch: picked for speed, still faster
        ("largest_batch", 14, 90.0, False),  # the same batch and slower
        ("largest_batch", 12, 200.0, False),  # stepped down below the batch it replaced
    ],
)
def test_a_stages_pick_holds_its_gain_by_what_it_was_picked_for(
    objective: str, pick_batch: int, pick_rate: float, held: bool
) -> None:
    """Rule: a measured stage's pick is handed on only where its verifying run kept what it
    was picked for over the pick before the stage (batch 14 at 100 samples/s): a larger batch
    for the largest-batch objective, else (and at the same batch) at least its throughput."""
    from types import SimpleNamespace

    from memadvisor.planner._plan import _gain_held
    from memadvisor.schema.candidate import Candidate, Measurement

    def measured(batch: int, rate: float) -> Measurement:
        step_ms = batch / rate * 1e3
        return Measurement(steps=20, peak_bytes=1, step_ms=step_ms, samples_per_s=rate)

    config = PlanConfig(budget_bytes=GIB, objective=objective)
    before = SimpleNamespace(candidate=Candidate(batch_size=14), measured=measured(14, 100.0))
    pick = Candidate(batch_size=pick_batch, choices={"compile": "default"})
    assert _gain_held(config, pick, measured(pick_batch, pick_rate), before) is held
