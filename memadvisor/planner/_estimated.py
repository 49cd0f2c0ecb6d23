"""plan_estimated: a plan for a card this machine does not have, from the estimate alone.

``device="estimate"``: the model is built (or copied) as fake tensors, so even a 7B model
costs no memory; the profiler meters one step under ``FakeTensorMode`` with CUDA's autocast
policy (:mod:`memadvisor.device.fake`); step times, which fake ops do not have, are modelled
from matmul FLOPs (:mod:`memadvisor.profiler._flops`); and the search picks precision,
checkpointed blocks and the largest batch on the estimate. Nothing runs on a device: no
probe, no verification, no compile, no numerics check, and the plan says so. The strategies
whose screen decides on recognition alone (:attr:`~memadvisor.strategy.Checked.
screens_fake_tensors`: the loss head, offered where memadvisor owns the loss) are screened as
on a card; the others' choices are offered unchecked (precision's numerics need values).

The entry point takes a profile too, so a caller that made its own (a per-rank profile for
a world size larger than this machine) plans from it without profiling again.

Known limitations:
    * Every figure is the estimate's: what a card adds beyond tensors is taken from an
      H200's measurement (``memadvisor.device.fake.CUDA_FIXED_BYTES``); cuDNN's workspaces,
      which grow with the batch on convolutions, and the allocator's fragmentation are not.
    * Step times rank configurations by a stated model; they do not predict a card's.
    * torch.compile is not weighed: its memory and speed can only be measured.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from memadvisor.device.fake import FakeWorkload, fake_workload, profile_fake
from memadvisor.errors import BadInputError
from memadvisor.estimate import estimate
from memadvisor.planner._notes import screen_notes
from memadvisor.planner._pick import advice_for, with_records
from memadvisor.planner._progress import Progress, log_pick
from memadvisor.planner._rows import comparison_rows
from memadvisor.planner._search import ranked_or_infeasible
from memadvisor.planner._space import SearchSpace
from memadvisor.profiler import count_step_flops, with_modelled_times
from memadvisor.schema.advice import Check
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.device import ESTIMATE
from memadvisor.schema.plan import EstimateBasis, ModelFingerprint, Plan, Row
from memadvisor.schema.profile import Profile, StepFlops, StepTimeModel
from memadvisor.strategy import Checked, Strategy, load_strategies
from memadvisor.workload import Workload

__all__ = ["ESTIMATE_DEVICE_NAME", "estimated_profile", "plan_estimated", "with_flop_times"]

ESTIMATE_DEVICE_NAME = "no card: estimate for CUDA"
ESTIMATED_NOTE = (
    "Every figure in this plan is estimated: the model ran as fake tensors (shapes, no data, "
    "no memory) with CUDA's autocast policy, and nothing ran on a card. Confirm the pick on "
    "the card before a long run (memadvisor plan --device cuda there probes and verifies it)."
)


def estimated_profile(
    workload: FakeWorkload,
    *,
    time_model: StepTimeModel | None = None,
    progress: Progress | None = None,
) -> Profile:
    """The fake workload's profile, its step times modelled from the FLOPs it counted.

    Raises:
        BadInputError: the workload is not a fake one, or its model rejects its batch.
    """
    if not isinstance(workload, FakeWorkload):
        raise BadInputError(
            f"estimated_profile needs a FakeWorkload (see fake_workload), but got "
            f"{type(workload).__name__}."
        )
    ui = progress or Progress(enabled=False)
    with ui.stage("profiling (fake tensors)", total=None) as bar:
        profile = profile_fake(
            workload,
            progress=lambda text, done, total: bar.report(f"profiling: {text}", done, total),
        )
    return with_flop_times(workload, profile, time_model or StepTimeModel())


def with_flop_times(workload: FakeWorkload, profile: Profile, time_model: StepTimeModel) -> Profile:
    """``profile`` with times from its FLOPs (counted now if it has none) at ``time_model``."""
    flops = profile.flops
    if flops is None:
        with workload.fake():
            flops = count_step_flops(workload, workload.fresh_model(), min(profile.batch_sizes))
        profile = profile.model_copy(update={"flops": flops})
    return with_modelled_times(profile, flops, time_model)


def plan_estimated(
    workload: Workload,
    config: PlanConfig,
    *,
    profile: Profile | None = None,
    time_model: StepTimeModel | None = None,
    progress: bool | Progress = True,
    strategies: Sequence[Strategy] | None = None,
) -> Plan:
    """The best configuration of ``workload`` under the budget, by the estimate alone.

    Args:
        workload: a :class:`~memadvisor.device.fake.FakeWorkload` (a factory's model built
            as fake tensors), or a real workload, copied to fake tensors first (a model
            built on the meta device is welcome: nothing of it is read).
        config: the budget, objective and search settings (``config.device`` is not read;
            the margin is kept whole, as nothing measures the pick: ``measured_margin`` off).
        profile: a profile already made (skips profiling), e.g. a per-rank one; its times
            are modelled from its FLOPs (counted first if it has none), as a fresh one's.
        time_model: the rates step times are modelled at; default :class:`StepTimeModel`.
        progress: progress bars on stderr (or a :class:`Progress` to share).
        strategies: strategy instances (else ``load_strategies(config.strategies)``).

    Raises:
        InfeasibleBudgetError: nothing fits even batch 1; the message names the minimum
            budget and what would shrink the static bytes (as advice, not a plan).
        BadInputError: the workload cannot run under fake tensors.
    """
    started = time.perf_counter()
    ui = progress if isinstance(progress, Progress) else Progress(enabled=bool(progress))
    time_model = time_model or StepTimeModel()
    # Nothing is measured, so no measured headroom can stand in for the margin: it is kept.
    config = config.model_copy(update={"measured_margin": False})
    fake = workload if isinstance(workload, FakeWorkload) else fake_workload(workload)
    if profile is None:
        profile = estimated_profile(fake, time_model=time_model, progress=ui)
    else:
        profile = with_flop_times(fake, profile, time_model)
    chosen = list(strategies) if strategies is not None else load_strategies(config.strategies)
    screened = _screened(fake, profile, chosen, config, ui)
    space = SearchSpace(profile, chosen, config)
    ranked = ranked_or_infeasible(space, ui)
    best = ranked[0]
    pick = with_records(best.candidate, chosen, config)
    pick_estimate = estimate(profile, pick, chosen)
    plan_row = Row(
        label="Plan", candidate=pick, estimate=pick_estimate, largest_batch=best.largest_batch
    )
    rows, _ = comparison_rows(
        space, None, plan_row, ui
    )  # every row estimated; ESTIMATED_NOTE says so
    cannot_know = _cannot_know(time_model, profile.flops)
    notes = [
        ESTIMATED_NOTE,
        *screen_notes(screened, config),  # they decided what may be picked
        *cannot_know,
        *_batch_notes(config, pick, best.largest_batch),
    ]
    ui.log_notes(notes)
    plan = Plan(
        model_name=profile.model_name,
        model_fingerprint=ModelFingerprint.of(fake.model),  # names and shapes, as the real's
        config=config,
        device_kind=ESTIMATE.kind,
        device_name=ESTIMATE_DEVICE_NAME,
        capabilities=ESTIMATE,
        candidate=pick,
        estimate=pick_estimate,
        comparison=rows,
        advice=advice_for(chosen, pick, profile),
        checks=screened,
        notes=notes,
        plan_wall_ms=(time.perf_counter() - started) * 1e3,
        profile=profile,
        basis=EstimateBasis(time_model=time_model, cannot_know=cannot_know),
    )
    log_pick(plan)
    return plan


def _screened(
    fake: FakeWorkload,
    profile: Profile,
    chosen: Sequence[Strategy],
    config: PlanConfig,
    ui: Progress,
) -> list[Check]:
    """The checks of the strategies whose screen decides without values, run before the
    search as on a card (a choice whose check fails is then not offered); the others are
    not screened: a numerics check would run the model, and fake tensors hold no values."""
    screening = [s for s in chosen if isinstance(s, Checked) and s.screens_fake_tensors]
    if not screening:
        return []
    # In the fake mode: a tensor a screen makes meets the model's fake ones as a fake one.
    with ui.stage("screening (by recognition)", total=None), fake.fake():
        return [c for s in screening for c in s.screen(fake, profile, config)]


def _cannot_know(time_model: StepTimeModel, flops: StepFlops | None) -> list[str]:
    """What only a card could say, each in a sentence the report prints."""
    tflop = flops.total_per_sample / 1e12 if flops is not None else 0.0
    return [
        f"Step times are not measured but modelled, and rank configurations only: matmul "
        f"FLOPs ({tflop:.3g} TFLOP a sample for forward and backward, a checkpointed "
        f"block's forward counted again) at the nominal rates of {time_model.describe()}; "
        "elementwise ops, launch latency and the card's real speed are not in them.",
        "torch.compile was not weighed: a compiled step's memory and speed can only be "
        "measured on the card.",
        "No numerics check ran for reduced precision (fake tensors hold no values).",
    ]


def _batch_notes(config: PlanConfig, pick: Candidate, largest: int) -> list[str]:
    """The effective batch, when accumulation could not reach it exactly."""
    wanted = config.effective_batch
    reached = pick.batch_size * pick.accumulation_steps
    if config.objective != "effective_batch" or not wanted or reached == wanted:
        return []
    return [
        f"Effective batch {reached}, not {wanted}: with micro-batches up to {largest}, no "
        f"micro-batch divides {wanted} within twice the fewest accumulation steps, so it was "
        f"rounded up ({pick.batch_size} x {pick.accumulation_steps})."
    ]
