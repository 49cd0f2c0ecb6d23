"""plan_workload: profile, check the budget, search, time and probe, refine, verify, compare.

Each stage hands the next a whole object (Profile, Scored, Confirmed), so the flow reads
top to bottom in :func:`plan_workload`; each stage's rule lives in a module of its own:

* the search on the estimate (``_space``, ``_search``);
* device runs through one :class:`~memadvisor.planner._prober.Prober` (``_prober``), which
  logs each run and never repeats one;
* re-ranking on the device (``_rerank``): the estimate's best few timed, the best searched;
* measured stages (``_stage``): each measured-only strategy's ``refine`` hook;
* verification (:func:`_verified`), the comparison rows (``_rows``), the notes (``_notes``).

Device runs are few because each costs seconds on a card (a process, a CUDA context, the
first step's kernel loading), and every run counts twice where it can. With an exact
estimate and one guard outside the best three, that is 4 runs (all timing), 1 of them the
winner's; with a pessimistic one 5, 2 the winner's; within one margin optimistic 5, 2 the
winner's (``tests/planner/test_plan.py`` has the exact table).

Known limitations:
    * Only the device's best candidate finishes its batch search; the others keep the batch
      their one timing run allowed.
    * A measured stage starts from the eager pick and varies only what its strategy chooses
      (compile: the checkpointed set with it); precision and the rest stay the pick's
      (``memadvisor.strategy``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence

import torch

from memadvisor._log import logger
from memadvisor.apply import run_checks
from memadvisor.device import Device, make_device, planned_capabilities
from memadvisor.device.simulated import check_host_holds
from memadvisor.estimate import estimate
from memadvisor.memory import release_cached_memory
from memadvisor.planner._budget import infeasible
from memadvisor.planner._notes import (
    SIMULATED_NOTE,
    fallbacks_first,
    pick_notes,
    runs_note,
    screen_notes,
    tie_note,
)
from memadvisor.planner._pick import advice_for, with_records
from memadvisor.planner._prober import Confirmed, Prober, verify_steps
from memadvisor.planner._progress import Progress, log_pick, stage_totals
from memadvisor.planner._rerank import best_on_device, timed_candidates
from memadvisor.planner._rows import comparison_rows, measure_configuration, rows_are_cheap
from memadvisor.planner._search import ranked_or_infeasible
from memadvisor.planner._space import SearchSpace
from memadvisor.planner._stage import refined_pick
from memadvisor.planner._steady import with_times_that_rank
from memadvisor.process_state import preserved_state
from memadvisor.profiler._state import check_copyable
from memadvisor.schema.advice import Check
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.device import DeviceCapabilities
from memadvisor.schema.plan import ModelFingerprint, Plan, Row, StageOutcome
from memadvisor.schema.profile import Profile
from memadvisor.strategy import Checked, Scoped, Strategy, load_strategies
from memadvisor.workload import Workload

__all__ = ["measure_configuration", "plan_workload"]


def _profile(workload: Workload, capabilities: DeviceCapabilities, ui: Progress) -> Profile:
    """The workload profiled where the device runs its tensors, for that device: the profile
    carries its capabilities, which the strategies read."""
    from memadvisor.device._autocast import cuda_autocast_policy
    from memadvisor.profiler import profile_workload

    # The simulated device runs autocast with CUDA's policy (it stands in for a card); the
    # profile must measure that same step, not CPU autocast's, or bf16 estimates drift.
    lists = capabilities.autocast.cuda_cast_lists
    policy = cuda_autocast_policy() if lists else contextlib.nullcontext()
    with ui.stage("profiling", total=None) as bar, policy:
        profile = profile_workload(
            workload,
            device=capabilities.tensor_device,
            progress=lambda text, done, total: bar.report(f"profiling: {text}", done, total),
        )
    # How the profile's own bytes were read (a card's allocator, or tensors metered) stays
    # the profiler's: the estimate adds fixed costs by it.
    memory = profile.device.capabilities.memory
    caps = capabilities.model_copy(update={"memory": memory})
    device = profile.device.model_copy(update={"capabilities": caps})
    return profile.model_copy(update={"device": device})


def plan_workload(
    workload: Workload,
    config: PlanConfig,
    *,
    target: str | None = None,
    profile: Profile | None = None,
    device: Device | None = None,
    progress: bool | Progress = True,
    strategies: Sequence[Strategy] | None = None,
    measure_comparison: bool | None = None,
) -> Plan:
    """The fastest configuration of ``workload``'s training step that fits the budget.

    Args:
        workload: the model and its step; its model, optimizer state and RNG are untouched.
        config: the budget, objective and search settings.
        target: ``"file.py:factory"`` when there is one: CUDA probes rebuild the workload
            from it in fresh processes.
        profile: a profile already made (else the workload is profiled first).
        device: where probes run (else CUDA when available, or the simulated CPU device;
            with ``config.device="estimate"`` none: see :func:`plan_estimated`).
        progress: show progress bars on stderr (or a :class:`Progress` to share).
        strategies: strategy instances (else ``load_strategies(config.strategies)``).
        measure_comparison: run the hand configurations on the device too; by default
            only where that costs under ``ROWS_TIME_BUDGET_S`` (never on CUDA, whose every
            run is a fresh process: the bench measures those in its own processes).

    Raises:
        InfeasibleBudgetError: the budget cannot hold the model at batch 1 (the message and
            ``minimum_bytes`` say what would).
        BadInputError: the workload, target or config cannot be used as given.
        PlanningError: a device run failed for a reason other than memory.
    """
    caps = planned_capabilities(config.device, device)
    if device is None and not caps.measures_memory:
        from memadvisor.planner._estimated import plan_estimated

        return plan_estimated(
            workload, config, profile=profile, progress=progress, strategies=strategies
        )
    started = time.perf_counter()
    ui = progress if isinstance(progress, Progress) else Progress(enabled=bool(progress))
    first_stage = len(ui.stage_log)  # a shared Progress may have timed other plans
    owned: Device | None = None
    # The planner's own CPU device: its tensors live in this host's memory.
    on_this_host = device is None and caps.tensor_device == "cpu"
    with preserved_state(workload.model), contextlib.ExitStack() as scope:
        try:
            check_copyable(workload.model)
            if on_this_host:
                check_host_holds(config.budget_bytes)
            notes: list[str] = []
            if on_this_host:
                why = " (device='simulated')" if torch.cuda.is_available() else " (no CUDA device)"
                notes.append(SIMULATED_NOTE.format(why=why))
                ui.note(notes[-1])
            chosen = (
                list(strategies) if strategies is not None else load_strategies(config.strategies)
            )
            # What a strategy sets up for the whole plan, before the device starts processes
            # that inherit it (compile: one inductor cache that every probe compiles into;
            # the allocator: expandable segments).
            for s in chosen:
                if not isinstance(s, Scoped):
                    continue
                plan_scope = s.plan_scope(config, caps)
                if plan_scope is not None:
                    scope.enter_context(plan_scope)
            ours = device is None  # the plan makes (and closes) its own device

            def own_device() -> Device:
                return make_device(
                    caps,
                    config.budget_bytes,
                    target=target,
                    profile=profile,
                    strategy_names=config.strategies,
                    world_size=config.world_size,
                    parallel=config.parallel,
                )

            if ours and caps.runs_cost_more_than_steps and config.world_size == 1:
                # Where a run's start dwarfs its steps (a card's fork server), the device
                # starts now: its imports and the model's build overlap the profile and the
                # screening (the first probe waited 8-14 s for them before); the profile
                # reaches its processes with that probe.
                device = owned = own_device()
                prestart = getattr(device, "prestart", None)
                if prestart is not None:
                    prestart(workload)
            if profile is None:
                profile = _profile(workload, caps, ui)
                if ours and not caps.step_times_rank:
                    # CPU times jitter past the gaps between candidates: rank by a model of
                    # the step's FLOPs instead, so the same inputs give the same plan.
                    profile, steady_note = with_times_that_rank(workload, profile)
                    if steady_note is not None:
                        notes.append(steady_note)
            screened: list[Check] = []
            if any(isinstance(s, Checked) for s in chosen):
                # Before the search: a choice that fails its check is then not offered.
                with ui.stage("screening", total=None):
                    screened = _screened(chosen, workload, profile, config)
            for note in screen_notes(screened, config):
                notes.append(note)  # among the first lines: it decided what may be picked
                ui.note(note)
            space = SearchSpace(profile, chosen, config)
            ranked = ranked_or_infeasible(space, ui)

            if owned is not None and getattr(owned, "profile", profile) is None:
                owned.profile = profile  # type: ignore[attr-defined]
            if device is None:
                device = owned = own_device()
            prober = Prober(device, workload, space, config)
            guard = device.capabilities.step_times_rank and config.objective != "largest_batch"
            timed = timed_candidates(space, ranked, guard)
            best = best_on_device(prober, timed, notes, ui)
            unrefined = best
            best, stages, stage_notes = refined_pick(prober, best, chosen, ui)
            pick, verified = _verified(prober, best, ui)
            if best is not unrefined and not _gain_held(config, pick, verified, unrefined):
                lost = (pick, verified)
                best, (pick, verified) = unrefined, _verified(prober, unrefined, ui)
                stages, stage_notes = _gain_lost(stages, stage_notes, lost, (pick, verified))
            notes += stage_notes
            pick = with_records(pick, chosen, config)
            pick_estimate = estimate(profile, pick, chosen)
            same_batch = pick.batch_size == best.candidate.batch_size
            plan_row = Row(
                label="Plan",
                candidate=pick,
                estimate=pick_estimate,
                largest_batch=best.found_batch if same_batch else pick.batch_size,
                measured=verified,
            )
            if measure_comparison is None:
                measure_comparison = rows_are_cheap(device, prober.probes, space)
            rows, row_notes = comparison_rows(
                space, prober if measure_comparison else None, plan_row, ui
            )
            notes += pick_notes(config, pick, best)
            tie = tie_note(prober.tie, best.candidate)
            if tie is not None:
                notes.append(tie)
            steady = device.capabilities.steady_memory
            notes.append(runs_note(prober.probes, best, verified, config, steady))
            with ui.stage("checks", total=None):
                checks = screened + run_checks(workload, pick, chosen, done=screened)
            notes += prober.notes + device.notes + row_notes
            notes = fallbacks_first(notes)
            ui.log_notes(notes)
            confirmed_on = device.capabilities
            result = Plan(
                model_name=profile.model_name,
                model_fingerprint=ModelFingerprint.of(workload.model),
                config=config,
                device_kind=confirmed_on.kind,
                device_name=device.name,
                capabilities=confirmed_on,
                candidate=pick,
                estimate=pick_estimate,
                verified=verified,
                probes=prober.probes,
                comparison=rows,
                advice=advice_for(chosen, pick, profile),
                checks=checks,
                notes=notes,
                plan_wall_ms=(time.perf_counter() - started) * 1e3,
                stage_wall_ms=stage_totals(ui.stage_log[first_stage:]),
                stages=stages,
                profile=profile,
            )
            log_pick(result)
            return result
        finally:
            if owned is not None:
                owned.close()
            # What the probes freed goes back: the allocator holds no more than before.
            release_cached_memory(workspaces=True)


def _screened(
    chosen: Sequence[Strategy], workload: Workload, profile: Profile, config: PlanConfig
) -> list[Check]:
    """Each checked strategy's screen, in order, its seconds logged at DEBUG (t5_base's
    screen on a card took 32.6 s, 15 s of it before the numerics check's first run: not yet
    placed)."""
    out: list[Check] = []
    for s in chosen:
        if isinstance(s, Checked):
            t0 = time.perf_counter()
            out += s.screen(workload, profile, config)
            logger.debug("screening: %s took %.1f s", s.name, time.perf_counter() - t0)
    return out


def _gain_held(
    config: PlanConfig, pick: Candidate, verified: Measurement, before: Confirmed
) -> bool:
    """Whether a measured stage's pick (compile) kept, in its verifying run, what it was picked
    for over the pick before the stages: a larger batch for the largest-batch objective
    (at the same batch, as otherwise: at least that pick's measured throughput).

    Why: a stage picks on its search runs (a compiled candidate is searched with a dynamic
    batch and verified static), and on a card beside other work a short step's time moves
    by more than the 3% a compiled pick must gain (the GPT example on an H100 beside another
    plan: compiled searched at 21,812 samples/s against eager's 21,003, verified at 17,307).
    A pick whose verification ran slower than the pick it replaced is not handed on."""
    if config.objective == "largest_batch":
        effective = pick.batch_size * pick.accumulation_steps
        before_effective = before.candidate.batch_size * before.candidate.accumulation_steps
        if effective != before_effective:  # picked for a larger batch: it must still be
            return effective > before_effective
    return verified.samples_per_s >= before.measured.samples_per_s


def _gain_lost(
    stages: list[StageOutcome],
    notes: list[str],
    lost: tuple[Candidate, Measurement],
    kept: tuple[Candidate, Measurement],
) -> tuple[list[StageOutcome], list[str]]:
    """The stages' outcomes and notes where the picking stage's pick (``lost``, with its
    verifying run) did not hold its gain (:func:`_gain_held`) and the pick before the stages
    (``kept``) is handed on instead: that stage says so beside its verdict."""
    (lost_pick, lost_run), (pick, verified) = lost, kept
    out_stages, out_notes = [], list(notes)
    for outcome in stages:
        if not outcome.picked:
            out_stages.append(outcome)
            continue
        why = (
            f"Its verifying run ({lost_run.steps} steps from a clean state) then measured "
            f"{lost_run.samples_per_s:.1f} samples/s at batch {lost_pick.batch_size}, below "
            f"the {verified.samples_per_s:.1f} samples/s of the pick before this stage (batch "
            f"{pick.batch_size}), so the plan keeps that one. On a busy machine a short step's "
            "time varies by more than the gain: plan again on an idle card to compare."
        )
        summary = f"{outcome.summary} {why}"
        out_notes = [summary if n == outcome.summary else n for n in out_notes]
        out_stages.append(
            outcome.model_copy(
                update={
                    "picked": False,
                    "summary": summary,
                    "answer": "picked, then slower than the eager pick in its verifying run: "
                    "planned eager (see notes)",
                    "one_off_ms": None,
                }
            )
        )
    return out_stages, out_notes


def _verified(prober: Prober, best: Confirmed, ui: Progress) -> tuple[Candidate, Measurement]:
    """The pick after its sustained run from a clean state, stepped down while it fails.

    A run of the pick that already took the verifying steps from a clean state (on a card
    every probe does; on the simulated device, whose memory repeats from the second step,
    a probe's steps are the verifying steps) is that run: no device run repeats it.

    Raises:
        InfeasibleBudgetError: it failed even at batch 1.
    """
    steps = verify_steps(prober.device, prober.config)
    with ui.stage("verify", total=None) as bar:
        prober.bar = bar
        pick, verified = prober.stepping_down(best.candidate, steps, "verify")
    if verified is None:
        space = prober.space
        raise infeasible(
            space.profile,
            space.config,
            space.cheapest_peak_bytes(),
            f"The pick ran out of memory within {steps} sustained steps even at batch 1.",
        )
    return pick, verified
