"""The prober's upward extrapolation (memadvisor/planner/_prober.py, Prober.largest).

A step's estimate is the larger of a fixed phase (the optimizer's update) and the
activations' phase; below the batch a run fitted at, its slope can be the fixed phase's.
"""

from __future__ import annotations

import torch

from memadvisor.estimate import estimate
from memadvisor.planner._prober import Prober
from memadvisor.planner._space import Scored, SearchSpace, limit_at
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import PlanConfig
from tests.planner.conftest import MIB, FakeDevice, make_profile

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
