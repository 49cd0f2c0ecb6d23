"""The comparison rows: the configurations a person would try by hand, beside the plan.

Each row is the hand configuration's largest batch, found exactly as the plan's is (the
estimate's bracket, the margin below the lowest failure), measured on the device where that
is cheap (:func:`rows_are_cheap`) and estimated elsewhere, which the plan's notes say.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import JsonValue

from memadvisor.device import Device
from memadvisor.estimate import estimate
from memadvisor.planner._compare import hand_configurations
from memadvisor.planner._prober import Prober
from memadvisor.planner._progress import Progress
from memadvisor.planner._space import SearchSpace
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.plan import Probe, Row
from memadvisor.schema.profile import Profile
from memadvisor.strategy import Strategy, load_strategies
from memadvisor.workload import Workload

__all__ = ["ROWS_TIME_BUDGET_S", "comparison_rows", "measure_configuration", "rows_are_cheap"]

# Measuring the comparison rows may add this much wall time; beyond it they are estimated.
ROWS_TIME_BUDGET_S = 30.0

_RUNS_PER_ROW = 3  # a row's batch search: two probes when the estimate is right, plus timing


def comparison_rows(
    space: SearchSpace, prober: Prober | None, plan_row: Row, ui: Progress
) -> tuple[list[Row], list[str]]:
    """The hand configurations (measured when ``prober``), then the plan's own row."""
    configs = hand_configurations(space)
    rows: list[Row] = []
    estimated: list[str] = []
    with ui.stage("comparison", total=None) as bar:
        if prober is not None:
            prober.bar = bar  # counts the rows' probes
        for label, choices in configs:
            bar.describe(f"comparison: {label}")
            scored = space.score_choices(choices)
            if scored is None:  # not even batch 1 by the estimate: shown with batch 1's peak
                cand = Candidate(batch_size=1, choices=choices)
                est = estimate(space.profile, cand, space.strategies)
                rows.append(Row(label=label, candidate=cand, estimate=est, largest_batch=0))
                estimated.append(label)
                continue
            row = Row(
                label=label,
                candidate=scored.candidate,
                estimate=scored.estimate,
                largest_batch=scored.largest_batch,
            )
            if prober is not None:
                confirmed = prober.confirm(scored, stage="compare")
                if confirmed is None:
                    row = row.model_copy(update={"largest_batch": 0})
                else:
                    est = estimate(space.profile, confirmed.candidate, space.strategies)
                    row = Row(
                        label=label,
                        candidate=confirmed.candidate,
                        estimate=est,
                        largest_batch=confirmed.found_batch,
                        measured=confirmed.measured,
                    )
            else:
                estimated.append(label)
            rows.append(row)
    rows.append(plan_row)
    notes = []
    if estimated:
        notes.append(
            f"Comparison rows {', '.join(estimated)} are estimated, not run on the device; "
            "the Plan row is measured."
        )
    return rows, notes


def measure_configuration(
    workload: Workload,
    config: PlanConfig,
    choices: dict[str, JsonValue],
    *,
    profile: Profile,
    device: Device,
    strategies: Sequence[Strategy] | None = None,
    label: str = "",
) -> tuple[Row, list[Probe]]:
    """One configuration's largest batch on ``device``, found exactly as the plan's is (the
    estimate's bracket, the margin below the lowest failure), and its measured step there.

    What a person would get by hand-tuning the batch of that configuration; the GPU bench
    sets the plan against such rows.

    Returns:
        The row (``largest_batch`` 0 and no measurement when not even batch 1 fits) and
        the device runs it took.
    """
    chosen = list(strategies) if strategies is not None else load_strategies(config.strategies)
    space = SearchSpace(profile, chosen, config)
    prober = Prober(device, workload, space, config)
    scored = space.score_choices(choices)
    confirmed = prober.confirm(scored, stage="compare") if scored is not None else None
    if confirmed is None:
        cand = Candidate(batch_size=1, choices=choices)
        est = estimate(profile, cand, chosen)
        return Row(label=label, candidate=cand, estimate=est, largest_batch=0), prober.probes
    row = Row(
        label=label,
        candidate=confirmed.candidate,
        estimate=estimate(profile, confirmed.candidate, chosen),
        largest_batch=confirmed.found_batch,
        measured=confirmed.measured,
    )
    return row, prober.probes


def rows_are_cheap(device: Device, runs: Sequence[Probe], space: SearchSpace) -> bool:
    """Whether running the hand configurations too fits :data:`ROWS_TIME_BUDGET_S`, and
    is worth it.

    Not where a run's fixed cost dwarfs its steps (a card: each run a fresh process of
    several seconds), nor where the device's step times do not rank (the simulated CPU
    device): there a measured row's time is noise beside the estimate that ranks, and its
    batch search costs steps of the largest batch. Elsewhere judged from the plan's own runs:
    about three runs per row at their average wall time.
    """
    caps = device.capabilities
    if caps.runs_cost_more_than_steps or not caps.step_times_rank or not runs:
        return False
    average_s = sum(r.wall_ms for r in runs) / len(runs) / 1e3
    return average_s * _RUNS_PER_ROW * len(hand_configurations(space)) <= ROWS_TIME_BUDGET_S
