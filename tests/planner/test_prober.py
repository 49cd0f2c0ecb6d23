"""The prober's upward extrapolation (memadvisor/planner/_prober.py, Prober.largest).

A step's estimate is the larger of a fixed phase (the optimizer's update) and the
activations' phase; below the batch a run fitted at, its slope can be the fixed phase's.
"""

from __future__ import annotations

import pytest
import torch

from memadvisor.errors import AllocatorRetriesError
from memadvisor.estimate import estimate
from memadvisor.planner._prober import Prober, RunsSpent
from memadvisor.planner._space import Scored, SearchSpace, limit_at
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import PlanConfig
from tests.planner.conftest import MIB, FakeDevice, make_profile, run_many_batches

BF16 = {"precision": "bf16"}


class EstimateDevice(FakeDevice):
    """A card whose allocated peak is the estimate's, exactly: out of memory past the budget."""

    def __init__(self, profile, strategies, budget_bytes: int) -> None:
        super().__init__(10**9, runs_cost_more_than_steps=True)
        self.budget_bytes = budget_bytes
        self.profile, self.strategies = profile, strategies

    def peak(self, candidate: Candidate) -> int:
        return limit_at(self.profile, candidate.choices, self.strategies, candidate.batch_size)

    def edge(self) -> int:
        b = 1
        while self.peak(Candidate(batch_size=b + 1, choices=BF16)) <= self.budget_bytes:
            b += 1
        return b

    def run(self, workload, candidate: Candidate, steps: int) -> Measurement:
        self.calls.append((candidate.batch_size, steps, dict(candidate.choices)))
        peak = self.peak(candidate)
        if peak > self.budget_bytes:
            raise torch.OutOfMemoryError(f"fake: batch {candidate.batch_size} does not fit")
        step_ms = 1.0 + 0.05 * candidate.batch_size
        return Measurement(
            steps=steps,
            peak_bytes=peak,
            step_ms=step_ms,
            samples_per_s=candidate.batch_size / step_ms * 1e3,
        )


def _search_from_20(device, workload, profile, strategies, config):
    """The prober's batch search for bf16 from a fit at batch 20: (what it found, the
    batches the device ran, in order)."""
    space = SearchSpace(profile, strategies, config)
    prober = Prober(device, workload, space, config)
    start = Candidate(batch_size=20, choices=BF16)
    scored = Scored(
        candidate=start, estimate=estimate(profile, start, strategies), largest_batch=20, active=1
    )
    found, _ = prober.largest(scored, "probe")
    return found, [b for b, _, _ in device.calls]


def test_the_first_probe_above_a_fit_in_the_fixed_phase_lands_at_the_edge_not_beyond(
    strategies, workload
) -> None:
    """Rule: after a fit, the next probe aims at the batch that fills the budget along the
    estimate's own shape from that fit up, not along its slope averaged below the fit. Here
    the optimizer's update holds 100 MiB up to batch 15, and activations 2.7 MiB a sample
    above it; from a fit at 20 (114 MiB) under 160 MiB the edge is 37. The slope over
    [10, 20], mostly the fixed phase, is 1.4 MiB a sample and aimed at 53 (lm350m on a card:
    a fit at 18, then 38 where 21 ran out)."""
    profile = make_profile(param_mib=20)
    budget = 160 * MIB
    device = EstimateDevice(profile, strategies, budget)
    config = PlanConfig(budget_bytes=budget, probe_steps=2, timing_steps=2, verify_steps=4)
    assert limit_at(profile, BF16, strategies, 10) == limit_at(profile, BF16, strategies, 1)
    edge = device.edge()
    assert 30 < edge < 45
    found, tried = _search_from_20(device, workload, profile, strategies, config)
    assert tried[0] == 20
    assert edge <= tried[1] <= edge + 1, tried  # the first failure measures the edge
    assert found.batch <= edge
    assert len(tried) <= 4, tried


def test_with_a_fixed_margin_the_probe_above_a_fit_in_the_fixed_phase_aims_inside_it(
    strategies, workload
) -> None:
    """Rule: with a fixed margin (``--margin``: the measured margin off) the probe after a fit
    aims at a quarter margin under the usable budget along the estimate's own shape from that
    fit up too, not along its slope averaged below the fit. Here the optimizer's update holds
    100 MiB up to batch 15 and activations 2.7 MiB a sample above it; from a fit at 20
    (114 MiB) the aim, 150 MiB of 160 at a 5% margin, is batch 33 (149.1 MiB), which fits
    and is the pick. The slope over [10, 20], mostly the fixed phase, is 1.4 MiB a sample and
    aimed at 45, which ran out, and the search kept 20: one run more for 13 samples fewer."""
    profile = make_profile(param_mib=20)
    budget = 160 * MIB
    device = EstimateDevice(profile, strategies, budget)
    config = PlanConfig(
        budget_bytes=budget, margin_fraction=0.05, probe_steps=2, timing_steps=2, verify_steps=4
    )
    assert not config.measured_margin
    aim = config.usable_bytes - budget * config.margin_fraction / 4
    aimed = max(b for b in range(20, 100) if limit_at(profile, BF16, strategies, b) <= aim)
    assert aimed == 33
    found, tried = _search_from_20(device, workload, profile, strategies, config)
    assert tried == [20, aimed], tried
    assert found.batch == aimed


def _card_plan(workload, profile, strategies, linear_device, at_once: int):
    """A plan on a card-like device (runs cost more than their steps), eager only, its runs
    made ``at_once`` at a time; (plan, the device's calls)."""
    from memadvisor.planner import plan_workload
    from tests.planner.test_compiled_search import EAGER_LM

    device = linear_device(EAGER_LM, fixed_ms=3.0, runs_cost_more_than_steps=True)
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": at_once})
    config = PlanConfig(budget_bytes=100 * MIB, probe_steps=3, timing_steps=3, verify_steps=20)
    plan = plan_workload(
        workload, config, profile=profile, device=device, progress=False,
        strategies=strategies, measure_comparison=False,
    )  # fmt: skip
    return plan, device.calls


def test_timing_runs_made_at_once_on_a_card_take_fewer_steps_and_the_pick_its_own(
    workload, profile, strategies, linear_device
) -> None:
    """Rule: on a card every run takes the verifying steps (20) so that the pick's run is its
    verification; the first timing runs made at once take their timed steps one run after
    another, so they take TIMING_AT_ONCE_STEPS (8) instead (H100: t5_base's six 20-step timing
    runs took 35-43 s). The plan picks what it picks with them one at a time, and the pick's
    verification is a run of the full 20 steps."""
    alone, _ = _card_plan(workload, profile, strategies, linear_device, at_once=1)
    together, calls = _card_plan(workload, profile, strategies, linear_device, at_once=4)
    assert together.candidate == alone.candidate
    timing = [p for p in together.probes if p.stage == "timing"]
    assert len(timing) >= 2
    at_once = [p for p in timing if p.fits and p.steps == 8]  # TIMING_AT_ONCE_STEPS
    assert len(at_once) >= 2, [(p.batch_size, p.steps, p.fits) for p in timing]
    assert together.verified is not None and together.verified.steps == 20
    assert together.verified == alone.verified
    steps = lambda plan: sum(p.steps for p in plan.probes)  # noqa: E731
    assert steps(together) < steps(alone)


def _card_plan_waits(workload, profile, strategies, linear_device, in_process: bool):
    """A card plan (four runs at once) whose estimate is optimistic: the device holds 1.5x
    the bytes a sample, so timing runs run out at their estimated batches. (plan, the
    retry_at of each run_many_retrying call, how many times the planner waited for the
    device: a group once, a run made alone once)."""
    from memadvisor.planner import plan_workload
    from tests.planner.test_compiled_search import EAGER_LM

    lines = {key: 1.5 * mib for key, mib in EAGER_LM.items()}
    device = linear_device(lines, fixed_ms=3.0, runs_cost_more_than_steps=True)
    device.capabilities = device.capabilities.model_copy(
        update={"concurrent_runs": 4, "retries_in_process": in_process}
    )
    retried: list[list[tuple[int, int | None]]] = []
    waits = {"n": 0, "inside": False}
    real_run, real_many, real_retrying = device.run, device.run_many, device.run_many_retrying

    def run(workload, candidate, steps):
        waits["n"] += not waits["inside"]
        return real_run(workload, candidate, steps)

    def grouped(real):
        def call(workload, runs):
            outer = not waits["inside"]
            waits["n"] += outer
            waits["inside"] = True
            try:
                return real(workload, runs)
            finally:
                waits["inside"] = not outer

        return call

    def retrying(workload, runs):
        retried.append([(c.batch_size, r) for c, _, r in runs])
        return grouped(real_retrying)(workload, runs)

    device.run, device.run_many, device.run_many_retrying = run, grouped(real_many), retrying
    config = PlanConfig(budget_bytes=100 * MIB, probe_steps=3, timing_steps=3, verify_steps=20)
    plan = plan_workload(
        workload, config, profile=profile, device=device, progress=False,
        strategies=strategies, measure_comparison=False,
    )  # fmt: skip
    return plan, retried, waits["n"]


def test_timing_runs_at_once_carry_their_retries_where_the_device_retries_in_process(
    workload, profile, strategies, linear_device
) -> None:
    """Rule: on a device that retries a run in its own process (a card's fork server), the
    first timing runs go together with their retries the margin below (safe_below of each
    start): a candidate that runs out at its estimated batch is timed there without a run
    of its own after the group. The plan picks what it picks where the retries are made one
    after another, with the same probes after the timing runs, and waits for the device
    fewer times. On an H200 the Llama example's two retries took 4.0 s each, one after the
    other, after a group of 5.6 s (session 40)."""
    from memadvisor.planner._probe import safe_below

    apart, not_asked, apart_waits = _card_plan_waits(
        workload, profile, strategies, linear_device, in_process=False
    )
    together, retried, waits = _card_plan_waits(
        workload, profile, strategies, linear_device, in_process=True
    )
    assert not not_asked
    assert len(retried) == 1, retried
    margin = PlanConfig(budget_bytes=100 * MIB).margin_fraction
    assert all(r == safe_below(b, margin) for b, r in retried[0]), retried
    timing = lambda plan: [(p.batch_size, p.fits) for p in plan.probes if p.stage == "timing"]  # noqa: E731
    records = timing(together)
    starts_out = [(b, r) for b, r in retried[0] if (b, False) in records]
    assert starts_out, (records, retried)  # the estimate was optimistic: some ran out
    assert all(any(b == r for b, _ in records) for _, r in starts_out), (records, retried)
    assert set(timing(apart)) <= set(timing(together)), (timing(apart), timing(together))
    assert together.candidate == apart.candidate
    assert together.verified == apart.verified
    after = lambda plan: [(p.batch_size, p.fits) for p in plan.probes if p.stage != "timing"]  # noqa: E731
    assert after(together) == after(apart)
    assert waits < apart_waits, (waits, apart_waits)


# -- a probe that may run out, paired with the batch searched next if it does ---------------


class HoledDevice(EstimateDevice):
    """:class:`EstimateDevice` where the batches in ``holes`` run out though larger ones fit
    (near the limit fitting is not monotone, docs/design.md)."""

    def __init__(
        self, profile, strategies, budget_bytes: int, holes: set[int], first_step_ms: float
    ) -> None:
        super().__init__(profile, strategies, budget_bytes)
        self.holes = holes
        self.first_step_ms = first_step_ms

    def run(self, workload, candidate: Candidate, steps: int) -> Measurement:
        if candidate.batch_size in self.holes:
            self.calls.append((candidate.batch_size, steps, dict(candidate.choices)))
            raise torch.OutOfMemoryError(f"fake: batch {candidate.batch_size} does not fit")
        m = super().run(workload, candidate, steps)
        return m.model_copy(update={"first_step_ms": self.first_step_ms})


def _search_from(
    start: int,
    at_once: int,
    strategies,
    workload,
    runs_left: int | None = None,
    holes: frozenset[int] = frozenset(),
    first_step_ms: float = 1e4,
):
    """The prober's batch search for bf16 from ``start`` on a card whose peak is the
    estimate's (the edge is 37; ``holes`` run out too), making ``at_once`` runs at once;
    (what it found, the prober, the batches the device ran in order, the batches of each
    run_many call). ``runs_left``: the prober's bound on device runs. Each run's first step
    takes ``first_step_ms`` (default: a compile's, longer than the steps): a run of batch 1
    made before the search gives the prober a fit of the choices to read it from (not
    among the batches returned)."""
    profile = make_profile(param_mib=20)
    budget = 160 * MIB
    device = HoledDevice(profile, strategies, budget, set(holes), first_step_ms)
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": at_once})
    groups = run_many_batches(device)
    config = PlanConfig(budget_bytes=budget, probe_steps=2, timing_steps=2, verify_steps=4)
    prober = Prober(device, workload, SearchSpace(profile, strategies, config), config)
    assert prober.run(Candidate(batch_size=1, choices=BF16), prober.steps, "timing") is not None
    del device.calls[:]
    prober.runs_left = runs_left
    candidate = Candidate(batch_size=start, choices=BF16)
    scored = Scored(
        candidate=candidate,
        estimate=estimate(profile, candidate, strategies),
        largest_batch=start,
        active=1,
    )
    try:
        found = prober.largest(scored, "probe")[0]
    except RunsSpent:
        found = None
    return found, prober, [b for b, _, _ in device.calls], groups


def _device_waits(ran: list[int], groups: list[list[int]]) -> int:
    """How many times the search waited for the device: each run_many call once, each run
    made alone once."""
    return len(groups) + len(ran) - sum(len(g) for g in groups)


def test_a_probe_that_may_run_out_goes_with_the_batch_searched_next_and_finds_the_same(
    strategies, workload
) -> None:
    """Rule: on a device that makes several runs at once, a batch search's probe goes to the
    device in one group with the batch the search probes next should it run out (here 45,
    ran out, with 41, the margin below it); the search then tries the same batches and finds
    the same batch as one run at a time, and the prober's record is the same, in the same
    order (the partner recorded where the search asks for it)."""
    alone, alone_prober, _, _ = _search_from(45, 1, strategies, workload)
    together, prober, _, groups = _search_from(45, 2, strategies, workload)
    assert groups and groups[0] == [45, 41], groups
    assert alone.tried == [(45, False), (41, False), (37, True), (38, False)]
    assert together.tried == alone.tried
    assert together.batch == alone.batch == 35
    record = lambda p: [(r.batch_size, r.fits, r.steps, r.peak_bytes) for r in p.probes]  # noqa: E731
    assert record(prober) == record(alone_prober)


@pytest.mark.parametrize("start", [45, 100])
def test_pairing_a_probe_with_the_batch_searched_next_waits_for_the_device_fewer_times(
    strategies, workload, start: int
) -> None:
    """Rule: where the probes run out, pairing each with the batch searched next makes the
    search wait for the device fewer times than it makes runs one at a time (lm350m on an
    H100: 19 and 17 ran out, then 16 fitted, each run a fresh process of 3-10 s): from 45,
    3 waits for 4 runs; from 100 (far off: halving, then bisection), 6 for 9."""
    alone, _, alone_ran, _ = _search_from(start, 1, strategies, workload)
    together, _, ran, groups = _search_from(start, 2, strategies, workload)
    assert together.tried == alone.tried and together.batch == alone.batch
    assert _device_waits(ran, groups) < len(alone_ran) == len(alone.tried), (groups, ran)


def test_on_a_device_of_one_run_at_a_time_each_probe_runs_alone(strategies, workload) -> None:
    """Rule: on a device that makes one run at a time, the search runs each probe alone, only
    the batches it tries, in its order; a device of two at once runs a probe with its
    partner."""
    found, _, ran, groups = _search_from(45, 1, strategies, workload)
    assert groups == []
    assert ran == [b for b, _ in found.tried]
    assert _search_from(45, 2, strategies, workload)[3][0] == [45, 41]


def test_with_one_device_run_left_a_probe_runs_alone(strategies, workload) -> None:
    """Rule: a probe is paired only where the runs left (a measured stage's bound) cover two
    runs: with 1 left, 45 runs alone and the search ends on the next (RunsSpent); with 2
    left, 45 and 41 go at once, and the next probe ends it."""
    found, prober, ran, groups = _search_from(45, 2, strategies, workload, runs_left=1)
    assert found is None and prober.runs_left == 0
    assert ran == [45] and groups == []
    found, prober, ran, groups = _search_from(45, 2, strategies, workload, runs_left=2)
    assert found is None and prober.runs_left == 0
    assert ran == [45, 41] and groups == [[45, 41]]


@pytest.mark.parametrize("runs_left", [3, 4, 5])
def test_a_partner_counts_against_the_runs_left_only_where_the_search_asks_for_it(
    strategies, workload, runs_left: int
) -> None:
    """Rule: a partner's run is counted in the runs left (a measured stage's bound) where the
    search asks for its batch, not when it ran: a bounded search tries the same batches and
    ends where one run at a time does. From 45 one at a time runs 45, 41, 37, 38; beside
    37 runs 18, never asked for: counted, 4 runs left would end the search before 39."""
    alone, alone_prober, _, _ = _search_from(45, 1, strategies, workload, runs_left=runs_left)
    together, prober, ran, groups = _search_from(45, 2, strategies, workload, runs_left=runs_left)
    assert groups, ran
    assert prober.runs_left == alone_prober.runs_left
    assert [p.batch_size for p in prober.probes] == [p.batch_size for p in alone_prober.probes]
    assert (together is None) == (alone is None) == (runs_left < 4)
    if alone is not None:
        assert together is not None and together.tried == alone.tried


def test_a_partner_the_search_does_not_ask_for_is_not_recorded(strategies, workload) -> None:
    """Rule: a partner's run is recorded only where the search asks for its batch. Here 20
    fits, so its partner 18 (the batch searched next had 20 run out) is never asked for; it
    runs out though 20 fits (a hole near the limit). Recorded, it would answer every larger
    batch of these choices as ran out without a run (Prober._ran_out_below), and the search
    would keep 20; unrecorded, the search finds 37 as one run at a time does."""
    alone, alone_prober, _, _ = _search_from(20, 1, strategies, workload, holes=frozenset({18}))
    together, prober, ran, groups = _search_from(20, 2, strategies, workload, holes=frozenset({18}))
    assert groups[0] == [20, 18] and 18 in ran
    assert together.tried == alone.tried
    assert together.batch == alone.batch == 37
    assert [p.batch_size for p in prober.probes] == [p.batch_size for p in alone_prober.probes]


def test_a_probe_whose_runs_take_longer_in_their_steps_than_their_first_step_runs_alone(
    strategies, workload
) -> None:
    """Rule: a probe is paired only where its choices' known fit spent longer in its first
    step (a compile) than a run's timed steps take: runs at once take their timed steps in
    turn, so an unneeded partner costs its steps, and an eager probe runs out in its first
    step (on an H100, lm350m eager: 20 with its partner 19 took 16.7 s where a fit alone took
    7-8 s). A first step of 0.1 ms here against 2 steps of 2-3 ms: each probe alone, and the
    same search."""
    alone = _search_from(45, 1, strategies, workload, first_step_ms=0.1)[0]
    found, _, ran, groups = _search_from(45, 2, strategies, workload, first_step_ms=0.1)
    assert groups == [] and ran == [b for b, _ in found.tried]
    assert found.tried == alone.tried


class RetriesDevice(EstimateDevice):
    """A card whose batches from ``retries_from`` up complete their steps but only by the
    allocator's retries (AllocatorRetriesError after the last step, as train_candidate
    raises it)."""

    def __init__(self, profile, strategies, budget_bytes: int, retries_from: int) -> None:
        super().__init__(profile, strategies, budget_bytes)
        self.retries_from = retries_from

    def run(self, workload, candidate: Candidate, steps: int) -> Measurement:
        measured = super().run(workload, candidate, steps)
        if candidate.batch_size >= self.retries_from:
            error = AllocatorRetriesError(candidate.batch_size, steps - 1, steps - 1, 5.0)
            error.memadvisor_steps_completed = steps  # type: ignore[attr-defined]
            raise error
        return measured


def test_a_batch_out_of_memory_by_the_allocators_retries_answers_larger_batches_without_a_run(
    strategies, workload
) -> None:
    """Rule: a run that completed its steps but counts as out of memory by the allocator's
    retries (AllocatorRetriesError) answers, without a device run, the same batch and every
    larger one of its choices for as many steps, as a run that ran out mid-step does. lm350m
    on an H200 (session 24): the compile stage's confirmation ran 26, a cold compile and 18.1
    s, after 23 had run out so, and the pick stayed below 23."""
    profile = make_profile(param_mib=20)
    budget = 160 * MIB
    device = RetriesDevice(profile, strategies, budget, retries_from=30)
    config = PlanConfig(budget_bytes=budget, probe_steps=2, timing_steps=2, verify_steps=4)
    prober = Prober(device, workload, SearchSpace(profile, strategies, config), config)
    steps = prober.steps
    assert prober.run(Candidate(batch_size=30, choices=BF16), steps, "compile") is None
    (record,) = prober.probes
    assert not record.fits and record.error.startswith("Out of memory in effect")
    assert record.steps == steps  # it completed them
    del device.calls[:]
    for batch in (30, 31, 36):
        assert prober.run(Candidate(batch_size=batch, choices=BF16), steps, "compile") is None
    assert device.calls == []
    # A smaller batch, or other choices, still runs.
    assert prober.run(Candidate(batch_size=29, choices=BF16), steps, "compile") is not None
    assert [b for b, _, _ in device.calls] == [29]


@pytest.mark.parametrize(("ran_out_at", "below_by"), [(34, 1), (35, 3), (36, 3)])
def test_a_search_after_a_failure_runs_no_batch_above_the_margin_below_it(
    strategies, workload, ran_out_at: int, below_by: int
) -> None:
    """Rule: where a batch of the choices ran out before the search (a compiled pass-2 run,
    then the winner's confirmation), no probe goes above the margin below it (``below``,
    measured before the search), and a fit at that margin ends the search as the pick, its
    run the measurement. Above it a fit is a run the pick cannot take: t5_base's compiled
    confirmation on an H200 ran 54 and 55 after 57 had run out, its runs were spent, and it
    kept 39 from pass 1 (180.6 samples/s where 54 had run 221)."""
    profile = make_profile(param_mib=20)
    budget = 160 * MIB
    device = RetriesDevice(profile, strategies, budget, retries_from=ran_out_at)
    config = PlanConfig(budget_bytes=budget, probe_steps=2, timing_steps=2, verify_steps=4)
    prober = Prober(device, workload, SearchSpace(profile, strategies, config), config)
    assert prober.run(Candidate(batch_size=20, choices=BF16), prober.steps, "probe") is not None
    assert prober.run(Candidate(batch_size=ran_out_at, choices=BF16), prober.steps, "x") is None
    bound = prober.below(BF16, ran_out_at)
    assert 20 < bound < ran_out_at
    del device.calls[:]
    start = Candidate(batch_size=bound - below_by, choices=BF16)
    scored = Scored(
        candidate=start, estimate=estimate(profile, start, strategies),
        largest_batch=start.batch_size, active=1,
    )  # fmt: skip
    prober.runs_left = 2  # a compiled confirmation's runs are bounded
    found = prober.confirm(scored, "compile", floor=20)
    tried = [b for b, _, _ in device.calls]
    assert max(tried) <= bound, (tried, bound)
    assert found is not None and found.candidate.batch_size == bound, (found, tried)
    assert found.measured.steps == prober.steps


class ReservedDevice(EstimateDevice):
    """A card whose allocator keeps ``gap_bytes`` of its segments unused beyond the
    estimate's allocated peak: the reserved peak, which the memory cap bounds; a batch whose
    reserved peak passes the budget completes its steps only by the allocator's retries
    (AllocatorRetriesError), as on a card."""

    def __init__(self, profile, strategies, budget_bytes: int, gap_bytes: int) -> None:
        super().__init__(profile, strategies, budget_bytes)
        self.gap_bytes = gap_bytes

    def reserved(self, batch: int) -> int:
        return self.peak(Candidate(batch_size=batch, choices=BF16)) + self.gap_bytes

    def reserved_edge(self) -> int:
        b = 1
        while self.reserved(b + 1) <= self.budget_bytes:
            b += 1
        return b

    def run(self, workload, candidate: Candidate, steps: int) -> Measurement:
        measured = super().run(workload, candidate, steps)
        reserved = self.reserved(candidate.batch_size)
        if reserved > self.budget_bytes:
            error = AllocatorRetriesError(candidate.batch_size, steps - 1, steps - 1, 5.0)
            error.memadvisor_steps_completed = steps  # type: ignore[attr-defined]
            raise error
        return measured.model_copy(update={"reserved_peak_bytes": reserved})


def _search_after_a_fit(device, profile, strategies, workload, fit: int, start: int):
    """The prober's batch search of bf16 from the estimate's ``start``, after a run at
    ``fit`` (a timing run's) fitted: (what it found, the batches the search ran)."""
    config = PlanConfig(budget_bytes=device.budget_bytes, probe_steps=2, timing_steps=2,
                        verify_steps=4)  # fmt: skip
    prober = Prober(device, workload, SearchSpace(profile, strategies, config), config)
    assert prober.run(Candidate(batch_size=fit, choices=BF16), prober.steps, "timing")
    del device.calls[:]
    at = Candidate(batch_size=start, choices=BF16)
    scored = Scored(
        candidate=at, estimate=estimate(profile, at, strategies), largest_batch=start, active=1
    )
    found, _ = prober.largest(scored, "probe")
    return found, [b for b, _, _ in device.calls]


@pytest.mark.parametrize("estimate_at", ["fit", "allocated edge"])
def test_a_search_after_a_fit_whose_reserved_peak_nears_the_cap_probes_first_where_it_meets_it(
    strategies, workload, monkeypatch, estimate_at: str
) -> None:
    """Rule: where the largest fit of the choices made before the search recorded a reserved
    peak under the memory cap, the search's first probe above it is no higher than where that
    peak, grown a sample's bytes at a time, meets the budget, whether the estimate starts
    above it or at the fit (its first extrapolation, on allocated bytes, then aims past the
    reserved edge): the batches between run out by the allocator's retries, each a run. Same
    pick, fewer runs. t5_base's eager pick on an H200 (session 36 call 1): 8.37 GB reserved
    of 8.59 at 36, the estimate's start; the allocated bytes said 46, and 46, 43, 39 and 37
    ran out before 36 held."""
    profile = make_profile(param_mib=20)
    budget = 160 * MIB
    device = ReservedDevice(profile, strategies, budget, gap_bytes=24 * MIB)
    edge, allocated_edge = device.reserved_edge(), device.edge()
    assert allocated_edge - edge >= 8  # the allocated bytes aim well past the reserved edge
    fit = edge  # t5_base's timing run was its edge
    start = fit if estimate_at == "fit" else allocated_edge
    found, ran = _search_after_a_fit(device, profile, strategies, workload, fit, start)
    assert ran[0] <= edge + 2, ran  # from the reserved peak: a sample or two over

    monkeypatch.setattr(Prober, "_reserved_start", lambda self, choices: None)
    device.calls.clear()
    before, ran_before = _search_after_a_fit(device, profile, strategies, workload, fit, start)
    assert ran_before[0] > edge + 2, ran_before
    assert found.batch == before.batch and edge - 2 <= found.batch <= edge, (found, before)
    assert len(ran) < len(ran_before), (ran, ran_before)


def test_a_reserved_peak_at_the_cap_moves_no_start(strategies, workload) -> None:
    """Rule: a fit whose reserved peak reached the budget says nothing of where the reserve
    meets it (a card's reserved peak stops at the cap while the allocated one grows): the
    search starts at the estimate's batch, as without reserved peaks."""
    profile = make_profile(param_mib=20)
    budget = 160 * MIB
    device = ReservedDevice(profile, strategies, budget, gap_bytes=0)
    edge = device.edge()
    config = PlanConfig(budget_bytes=budget, probe_steps=2, timing_steps=2, verify_steps=4)
    prober = Prober(device, workload, SearchSpace(profile, strategies, config), config)
    assert prober.run(Candidate(batch_size=edge, choices=BF16), prober.steps, "timing")
    assert prober._reserved_start(BF16) is not None  # under the cap: read
    at_cap = prober._fits(BF16)[edge].model_copy(update={"reserved_peak_bytes": budget})
    prober._fitted[next(iter(prober._fitted))][edge] = at_cap
    assert prober._reserved_start(BF16) is None


def test_a_run_made_ahead_is_logged_and_counted_only_where_a_run_of_it_is_asked_for(
    strategies, workload
) -> None:
    """Rule: a run made ahead (run_many's ``ahead``) is neither logged, counted in the runs
    left nor kept until a run of the same candidate is asked for, which takes it without a
    device run: near the limit fitting is not monotone, and a smaller batch that ran out,
    kept, would answer a larger one that fitted as run out (the compile search's fallback
    for its pass-2 leader)."""
    profile = make_profile(param_mib=20)
    device = RetriesDevice(profile, strategies, 160 * MIB, retries_from=30)
    config = PlanConfig(budget_bytes=160 * MIB, probe_steps=2, timing_steps=2, verify_steps=4)
    prober = Prober(device, workload, SearchSpace(profile, strategies, config), config)
    prober.runs_left = 5
    out, fits = Candidate(batch_size=31, choices=BF16), Candidate(batch_size=20, choices=BF16)
    answers = prober.run_many([out, fits], prober.steps, "compile", ahead=[True, True])
    assert answers[0] is None and answers[1] is not None
    assert prober.probes == [] and prober.runs_left == 5 and prober._fits(BF16) == {}
    # Not kept: a batch above the one made ahead that ran out still runs.
    assert prober.run(Candidate(batch_size=32, choices=BF16), prober.steps, "x") is None
    assert [b for b, _, _ in device.calls] == [31, 20, 32] and prober.runs_left == 4
    # Asked for, each is taken without a device run, then logged and counted.
    assert prober.run(fits, prober.steps, "compile") == answers[1]
    assert prober.run(out, prober.steps, "compile") is None
    assert [b for b, _, _ in device.calls] == [31, 20, 32] and prober.runs_left == 2
    assert [p.batch_size for p in prober.probes] == [32, 20, 31]


class StallDevice(EstimateDevice):
    """A card whose step stalls (``stall`` times as long) from ``stall_from`` up: the
    allocator's retries or the host near the edge, in fewer steps than decide a failure."""

    def __init__(self, profile, strategies, budget_bytes: int, stall_from: int, stall: float):
        super().__init__(profile, strategies, budget_bytes)
        self.stall_from, self.stall = stall_from, stall

    def run(self, workload, candidate: Candidate, steps: int) -> Measurement:
        measured = super().run(workload, candidate, steps)
        if candidate.batch_size < self.stall_from:
            return measured
        step_ms = measured.step_ms * self.stall
        return measured.model_copy(
            update={"step_ms": step_ms, "samples_per_s": candidate.batch_size / step_ms * 1e3}
        )


def _confirm_after(
    profile, strategies, workload, stall_from: int, stall: float, ran: int, steps, objective
):
    """The prober's confirmation of bf16 from batch 40 on a StallDevice, after a run of
    ``ran`` for ``steps`` steps (None: the prober's own)."""
    budget = 160 * MIB
    device = StallDevice(profile, strategies, budget, stall_from, stall)
    config = PlanConfig(
        budget_bytes=budget, probe_steps=2, timing_steps=2, verify_steps=4, objective=objective
    )
    prober = Prober(device, workload, SearchSpace(profile, strategies, config), config)
    if ran:
        ran_for = prober.steps if steps is None else steps
        assert prober.run(Candidate(batch_size=ran, choices=BF16), ran_for, "x") is not None
    start = Candidate(batch_size=40, choices=BF16)
    scored = Scored(
        candidate=start, estimate=estimate(profile, start, strategies),
        largest_batch=start.batch_size, active=1,
    )  # fmt: skip
    return prober, prober.confirm(scored, "compile")


@pytest.mark.parametrize(
    ("stall", "steps", "objective", "kept_below"),
    [
        (1.3, None, "throughput", True),
        (1.02, None, "throughput", False),
        (1.3, 2, "throughput", False),
        (1.3, None, "largest_batch", False),
    ],
    ids=["stalled-by-30%", "within-noise", "the-faster-run-was-shorter", "largest-batch"],
)
def test_a_smaller_batch_that_ran_faster_as_long_as_the_pick_is_the_pick(
    strategies, workload, stall: float, steps: int | None, objective: str, kept_below: bool
) -> None:
    """Rule: by the throughput objective, where a smaller batch of the pick's choices ran at
    least 5% faster than the largest batch that fits, in a run as long as the pick's and
    within the pick's limit, the confirmation takes it, its run the measurement; within the
    few percent two runs differ by, from a shorter run, or by the largest-batch objective,
    the largest batch stays. lm350m's compiled confirmation on an H200 (session 44 call A)
    ran 23 at 109.1 samples/s where 22 had run 136.0, and the plan took CUDA graphs at 11
    (108.0) against the stalled rate."""
    profile = make_profile(param_mib=20)
    _, plain = _confirm_after(profile, strategies, workload, 10**6, 1.0, 0, None, objective)
    assert plain is not None
    edge = plain.candidate.batch_size
    below = edge - 2
    prober, found = _confirm_after(
        profile, strategies, workload, edge, stall, below, steps, objective
    )
    assert found is not None and found.found_batch == edge
    if kept_below:
        assert found.candidate.batch_size == below, found.candidate
        assert found.measured.samples_per_s > plain.measured.samples_per_s / stall
        note = f'Kept batch {below}, not {edge}, of precision "bf16"'
        assert any(n.startswith(note) for n in prober.notes), prober.notes
    else:
        assert found.candidate.batch_size == edge, found.candidate
        assert not any("Kept batch" in n for n in prober.notes), prober.notes
