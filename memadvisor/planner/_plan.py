"""plan_workload: profile, check the budget, search, time and probe, verify, compare.

Each stage hands the next a whole object (Profile, Scored, Confirmed), so the flow reads
top to bottom in :func:`plan_workload`; :class:`_Prober` holds what every device run shares
(the device, the probe log, what each run said, the notes).

Device runs are few because each costs seconds on a card (a process, a CUDA context, the
first step's kernel loading), and every run counts twice where it can:

1. Timing (:func:`timed_candidates`, :func:`_best_on_device`): the estimate's best
   ``rerank_top`` candidates (those within :data:`RERANK_FLOOR` of the best) and, where
   measured times rank, Baseline and +AMP as guards, each run once at the estimate's largest
   batch under the usable budget. That run is both the candidate's fit probe and its timing.
2. Batch search: the device's best alone continues :func:`find_batch` from what its timing
   run said: when it fitted, one run at the batch its measured peak extrapolates to (the
   estimate's bytes per sample up to the usable budget), none when it already fills it;
   when it did not, the margin below.
3. Verification: on a card every run takes ``verify_steps`` steps from a clean state, so the
   winner's fitting run at the final batch is its verification; a separate sustained run
   happens only where runs are short (the simulated device) or the final batch never ran.

With an exact estimate and one guard outside the best three, that is 4 runs (all timing),
1 of them the winner's; with a pessimistic one 5, 2 the winner's; within one margin
optimistic 5, 2 the winner's (tests/planner/test_plan.py has the exact table).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from pydantic import JsonValue

from memadvisor.apply import run_checks
from memadvisor.compile_cache import shared_compile_cache
from memadvisor.config import PlanConfig
from memadvisor.device import Device, Measurement
from memadvisor.errors import BadInputError
from memadvisor.estimate import Candidate, estimate
from memadvisor.planner._budget import check_static_fits, infeasible
from memadvisor.planner._compare import hand_configurations, unchecked_hand_choices
from memadvisor.planner._compiled import compiled_pick
from memadvisor.planner._probe import BatchSearch, find_batch, probe, safe_below
from memadvisor.planner._progress import Progress, Stage, stage_totals
from memadvisor.planner._schema import ModelFingerprint, Plan, Probe, Row
from memadvisor.planner._search import search
from memadvisor.planner._space import Scored, SearchSpace
from memadvisor.planner._state import preserved_state
from memadvisor.profiler import Profile
from memadvisor.profiler._state import check_copyable
from memadvisor.strategy import Advice, Check, Strategy, load_strategies
from memadvisor.workload import Workload

__all__ = ["measure_configuration", "plan_workload"]

SIMULATED_NOTE = (
    "This plan is for the simulated CPU device{why}. It enforces the budget on the tracked "
    "bytes of real CPU tensors; times are CPU times."
)
# Measuring the comparison rows may add this much wall time; beyond it they are estimated.
ROWS_TIME_BUDGET_S = 30.0
_RUNS_PER_ROW = 3  # a row's batch search: two probes when the estimate is right, plus timing
BATCH_SIZE = "batch_size"  # the strategy that records the pick's batch for its advice
PARALLEL = "parallel"  # the strategy that records the pick's precision for its advice
# Halving after this many margin-sized step-downs: a pick that keeps failing is far off.
_MARGIN_STEP_DOWNS = 3
# Of the estimate's best rerank_top, those under this share of the best's estimated samples/s
# (batch, for largest_batch) are not timed: the estimate's time errors seen on an H200
# (within ~1.6x per candidate, mostly shared by candidates of one precision) leave them behind.
RERANK_FLOOR = 0.7
# Candidates whose throughput lies within this share of the best's are a tie, broken by a
# fixed rule (fewest strategies). Two measurements of one configuration differ by up to
# 2-3% (bench/planner.py's tolerance; MIN_SPEEDUP's reasoning for compile), and the
# estimate's CPU-profiled times jitter as much between profiles of one model.
TIE_FRACTION = 0.03
# The measured margin: what the pick's measured limit (reserved bytes on a card) leaves free
# of the budget; below a batch that ran out, that many bytes' worth of measured samples. Near
# the edge the limit moved by a few samples between fresh processes on an H200 (a ViT held
# batch 92 in one, failed at step 2 in another: about 3% of an 8 GB budget); docs/design.md.
HEADROOM_FRACTION = 0.03


@dataclass
class _Confirmed:
    """A candidate the device ran: its batch as probed, and its measured step."""

    scored: Scored
    candidate: Candidate
    found_batch: int  # the largest micro-batch the probes allow (before the objective's pick)
    measured: Measurement  # a run of exactly ``candidate`` (its steps say whether it verifies)
    search: BatchSearch


@dataclass
class _Run:
    """What one device run of a candidate said; a failure holds the steps that completed."""

    steps: int
    measured: Measurement | None


class _Prober:
    """Runs candidates on the device, logs every run, and steps down when one runs out.

    Every run takes :attr:`steps` steps from a clean state, and what it said is kept by
    candidate: asking again for a batch already run (the winner's batch search continuing
    from its timing run, a comparison row the re-rank already ran) is answered without a
    device run.
    """

    def __init__(
        self, device: Device, workload: Workload, space: SearchSpace, config: PlanConfig
    ) -> None:
        self.device, self.workload, self.space, self.config = device, workload, space, config
        self.probes: list[Probe] = []
        self.notes: list[str] = []
        self.bar: Stage | None = None
        self.steps = run_steps(device, config)
        self._runs: dict[str, _Run] = {}
        # Per choice set (JSON), the runs that fitted by batch: the measured margin's slope.
        self._fitted: dict[str, dict[int, Measurement]] = {}
        self.tie: _Tie | None = None  # the last tie _device_best broke

    def run(self, candidate: Candidate, steps: int, stage: str) -> Measurement | None:
        """``candidate`` for ``steps`` steps, on the device unless an earlier run answers it."""
        known = self._runs.get(_key(candidate))
        if known is not None:
            if known.measured is not None and known.steps >= steps:
                return known.measured
            if known.measured is None and known.steps < steps:
                return None  # it ran out within the steps asked for now
        self._describe(f"{stage}: batch {candidate.batch_size} running")
        record, measured = probe(self.device, self.workload, candidate, steps, stage=stage)
        self.probes.append(record)
        if measured is not None and candidate.accumulation_steps == 1:
            key = json.dumps(candidate.choices, sort_keys=True)
            self._fitted.setdefault(key, {})[candidate.batch_size] = measured
        self._runs[_key(candidate)] = _Run(steps if measured else record.steps, measured)
        if self.bar is not None:
            self.bar.advance()
            self.bar.describe(
                f"{stage}: batch {candidate.batch_size} {'fits' if record.fits else 'ran out'}"
            )
        return measured

    def _describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.describe(text)

    def largest(self, scored: Scored, stage: str) -> tuple[BatchSearch, dict[int, Measurement]]:
        """Probe the largest micro-batch of ``scored``'s choices, bracketed by its estimate."""
        cfg = self.config
        choices = scored.candidate.choices
        measured: dict[int, Measurement] = {}

        def fits(batch: int) -> bool:
            m = self.run(Candidate(batch_size=batch, choices=choices), self.steps, stage)
            if m is not None:
                measured[batch] = m
            return m is not None

        def within_margin(batch: int) -> bool:
            m = measured[batch]
            return m.limit_bytes <= self.pick_limit_bytes(choices, batch)

        def extrapolate(batch: int) -> int | None:
            m = measured.get(batch)
            if m is None:
                return None
            slope = self.sample_bytes(choices, batch)
            if slope <= 0:
                return None
            if cfg.measured_margin:
                # Half a sample under what the pick may hold: a probe that lands just over it
                # fits but cannot be taken (within_margin), and the search keeps ``start``.
                aim = self.pick_limit_bytes(choices, batch) - slope / 2
            else:
                # A quarter margin under the usable budget, for the same reason.
                aim = cfg.usable_bytes - cfg.budget_bytes * cfg.margin_fraction / 4
            return batch + math.floor((aim - m.limit_bytes) / slope)

        upper = self.space.upper_batch(scored)
        found = find_batch(
            fits,
            scored.largest_batch,
            upper,
            cfg.margin_fraction,
            cfg.max_batch,
            within_margin,
            extrapolate,
            lambda failed: self.below(choices, failed),
            # A measured slope (two runs) lands the next extrapolation where the first one,
            # on the estimate's slope, could not: a pessimistic estimate costs a run, not batch.
            max_extrapolations=3 if cfg.measured_margin else 1,
        )
        return found, measured

    # -- the pick's margin ------------------------------------------------------------------

    def sample_bytes(self, choices: dict[str, JsonValue], batch: int) -> float:
        """What one more sample of ``choices`` adds to a run's limit: measured between the two
        largest batches of them that fitted when there are two, else the estimate's slope."""
        fitted = self._fitted.get(json.dumps(choices, sort_keys=True), {})
        if len(fitted) >= 2:
            high, low = sorted(fitted, reverse=True)[:2]
            slope = (fitted[high].limit_bytes - fitted[low].limit_bytes) / (high - low)
            if slope > 0:
                return slope
        return self.space.bytes_per_sample(choices, batch)

    def pick_limit_bytes(self, choices: dict[str, JsonValue], batch: int) -> float:
        """The most a run's measured limit may be for its batch to be the pick: the usable
        budget, or with the measured margin the budget less :data:`HEADROOM_FRACTION`."""
        cfg = self.config
        if not cfg.measured_margin:
            return cfg.usable_bytes
        return cfg.budget_bytes * (1.0 - HEADROOM_FRACTION)

    def below(self, choices: dict[str, JsonValue], failed: int) -> int:
        """The largest batch the pick may take when ``failed`` ran out: the margin below it,
        or with the measured margin the headroom's worth of measured samples below it (at
        least one)."""
        cfg = self.config
        slope = self.sample_bytes(choices, failed) if cfg.measured_margin else 0.0
        if slope <= 0:
            return safe_below(failed, cfg.margin_fraction)
        samples = max(1, math.ceil(HEADROOM_FRACTION * cfg.budget_bytes / slope))
        return max(0, failed - samples)

    def confirm(self, scored: Scored, stage: str = "probe") -> _Confirmed | None:
        """The candidate at the batch the device allows, timed; None when batch 1 fails.

        The batch search continues from whatever this prober already ran of the same choices.
        """
        found, measured = self.largest(scored, stage)
        if found.batch < 1:
            return None
        batch, accumulation = self.space.batch_for(found.batch)
        candidate = Candidate(
            batch_size=batch, accumulation_steps=accumulation, choices=scored.candidate.choices
        )
        m = measured.get(batch) if accumulation == 1 else None
        if m is None:  # the pick itself was not run (margin below a failure, or accumulation)
            candidate, m = self.stepping_down(candidate, self.steps, stage)
            if m is None:
                return None
        return _Confirmed(scored, candidate, found.batch, m, found)

    def stepping_down(
        self, candidate: Candidate, steps: int, stage: str
    ) -> tuple[Candidate, Measurement | None]:
        """Run ``candidate``; while it runs out, take the margin below and try again."""
        failures = 0
        while True:
            measured = self.run(candidate, steps, stage)
            if measured is not None:
                return candidate, measured
            failures += 1
            failed = candidate.batch_size
            micro = (
                self.below(candidate.choices, failed)
                if failures <= _MARGIN_STEP_DOWNS
                else failed // 2
            )
            batch, accumulation = self.space.batch_for(micro)
            if batch < 1:
                return candidate, None
            self.notes.append(
                f"Batch {failed} ran out of memory during {stage} ({steps} steps from a clean "
                f"state) though shorter probes fitted; stepped down to batch {batch}."
            )
            candidate = Candidate(
                batch_size=batch, accumulation_steps=accumulation, choices=candidate.choices
            )


def _key(candidate: Candidate) -> str:
    return json.dumps(
        [candidate.batch_size, candidate.accumulation_steps, candidate.choices], sort_keys=True
    )


def runs_cost_more_than_steps(device: Device) -> bool:
    """Whether a run's fixed cost dwarfs its steps on ``device``.

    On a card it does: each run is a process of its own, with a CUDA context and a first
    step that loads kernels (seconds), while a step takes milliseconds. There every run takes
    the verification's steps, so a fitting run at the final batch *is* the verification.
    On the simulated device each step is CPU work under a byte meter: runs stay short and
    the pick is verified by a run of its own. A device may say otherwise with a
    ``runs_cost_more_than_steps`` attribute.
    """
    return bool(getattr(device, "runs_cost_more_than_steps", device.kind == "cuda"))


def run_steps(device: Device, config: PlanConfig) -> int:
    """Steps each probe and timing run takes on ``device``."""
    steps = max(config.probe_steps, config.timing_steps)
    if runs_cost_more_than_steps(device):
        steps = max(steps, config.verify_steps)
    return steps


def step_times_rank(device: Device) -> bool:
    """Whether ``device``'s step times can rank candidates.

    A card's can. The simulated device's are CPU times slowed by its byte tracking, and fake
    tensors take no time at all: there the confirmed batches are ranked by the estimate's
    time. A device may say otherwise with a ``step_times_are_real`` attribute.
    """
    return bool(getattr(device, "step_times_are_real", device.kind == "cuda"))


def _resolve_kind(config: PlanConfig, device: Device | None) -> str:
    if device is not None:
        return device.kind
    if config.device == "auto":
        return "cuda" if torch.cuda.is_available() else "simulated"
    if config.device == "cuda" and not torch.cuda.is_available():
        raise BadInputError(
            "device='cuda' needs a CUDA device, but torch.cuda.is_available() is False; use "
            "device='simulated' (or 'auto') to plan on the CPU."
        )
    return config.device


def _profile(workload: Workload, kind: str, ui: Progress) -> Profile:
    from memadvisor.device._autocast import cuda_autocast_policy
    from memadvisor.profiler import profile_workload

    # The simulated device runs autocast with CUDA's policy (it stands in for a card); the
    # profile must measure that same step, not CPU autocast's, or bf16 estimates drift.
    policy = contextlib.nullcontext() if kind == "cuda" else cuda_autocast_policy()
    with ui.stage("profiling", total=None) as bar, policy:
        return profile_workload(
            workload,
            device="cuda" if kind == "cuda" else "cpu",
            progress=lambda text, done, total: bar.report(f"profiling: {text}", done, total),
        )


def _make_device(kind: str, config: PlanConfig, target: str | None, profile: Profile) -> Device:
    if config.parallel != "none":
        from memadvisor.device.ranks import Ranks

        return Ranks(
            config.budget_bytes,
            config.world_size,
            backend="cuda" if kind == "cuda" else "simulated",
            target=target,
            profile=profile,
            strategy_names=config.strategies,
        )
    if kind == "cuda":
        from memadvisor.device.cuda import CudaDevice

        return CudaDevice(
            config.budget_bytes, target=target, profile=profile, strategy_names=config.strategies
        )
    from memadvisor.device.simulated import SimulatedDevice

    return SimulatedDevice(config.budget_bytes, profile=profile, strategy_names=config.strategies)


def _with_batch_record(
    candidate: Candidate, strategies: Sequence[Strategy], config: PlanConfig
) -> Candidate:
    """The pick with the batch_size strategy's record of it, so its advice explains the batch.

    That strategy searches nothing (the planner solves the batch); its choice only records
    the pick in the format ``strategies.batch_size.choice_for`` defines.
    """
    if not any(s.name == BATCH_SIZE for s in strategies):
        return candidate
    from strategies.batch_size import choice_for

    record = choice_for(candidate, config.effective_batch)
    if record is None:
        return candidate
    return Candidate(
        batch_size=candidate.batch_size,
        accumulation_steps=candidate.accumulation_steps,
        choices={**candidate.choices, BATCH_SIZE: record},
    )


def _with_parallel_record(candidate: Candidate) -> Candidate:
    """The pick with its precision recorded in the parallel choice, for the advice's code
    (FSDP2 gathers its units in that dtype: ``strategies.parallel``)."""
    choice = candidate.choices.get(PARALLEL)
    precision = candidate.choices.get("precision")
    if not isinstance(choice, dict) or precision in (None, "fp32"):
        return candidate
    return candidate.model_copy(
        update={"choices": {**candidate.choices, PARALLEL: {**choice, "param_dtype": precision}}}
    )


def _advice(strategies: Sequence[Strategy], candidate: Candidate, profile: Profile) -> list[Advice]:
    out = []
    for s in strategies:
        choice = candidate.choices.get(s.name)
        if choice is None or s.is_neutral(choice):
            continue
        advice = s.explain(choice, profile)
        if advice is not None:
            out.append(advice)
    return out


def _rows(
    space: SearchSpace, prober: _Prober | None, plan_row: Row, ui: Progress
) -> tuple[list[Row], list[str]]:
    """Baseline, +Checkpointing, +AMP, +Both (measured when ``prober``), then the plan."""
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
            with ``config.device == "estimate"`` none: see :func:`plan_estimated`).
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
    if config.device == "estimate" and device is None:
        from memadvisor.planner._estimated import plan_estimated

        return plan_estimated(
            workload, config, profile=profile, progress=progress, strategies=strategies
        )
    started = time.perf_counter()
    ui = progress if isinstance(progress, Progress) else Progress(enabled=bool(progress))
    first_stage = len(ui.stage_log)  # a shared Progress may have timed other plans
    owned: Device | None = None
    with preserved_state(workload.model), contextlib.ExitStack() as scope:
        try:
            kind = _resolve_kind(config, device)
            check_copyable(workload.model)
            if kind == "simulated" and device is None:
                from memadvisor.device.simulated import check_host_holds

                check_host_holds(config.budget_bytes)
            notes: list[str] = []
            if kind == "simulated" and device is None:
                why = " (device='simulated')" if torch.cuda.is_available() else " (no CUDA device)"
                notes.append(SIMULATED_NOTE.format(why=why))
                ui.note(notes[-1])
            chosen = (
                list(strategies) if strategies is not None else load_strategies(config.strategies)
            )
            if profile is None:
                profile = _profile(workload, kind, ui)
            screened: list[Check] = []
            if any(type(s).screen is not Strategy.screen for s in chosen):
                # Before the search: a choice that fails its check is then not offered.
                with ui.stage("screening", total=None):
                    screened = [c for s in chosen for c in s.screen(workload, profile, config)]
            for note in _screen_notes(screened, config):
                notes.append(note)  # among the first lines: it decided what may be picked
                ui.note(note)
            space = SearchSpace(profile, chosen, config)
            check_static_fits(profile, config, space.cheapest_peak_bytes())

            with ui.stage("search", total=None) as bar:
                ranked = search(space, config.seed, bar.advance)
            if not ranked:
                raise infeasible(
                    profile,
                    config,
                    space.cheapest_peak_bytes(),
                    "By the estimate no configuration fits even batch 1.",
                )

            # One inductor cache for the whole plan, set before the fork server starts: its
            # children compile into it, and the compile stage needs no fresh server for it.
            cache = None
            if kind == "cuda" and config.compile != "off":
                cache = scope.enter_context(shared_compile_cache())
            if device is None:
                device = owned = _make_device(kind, config, target, profile)
            prober = _Prober(device, workload, space, config)
            guard = step_times_rank(device) and config.objective != "largest_batch"
            timed = timed_candidates(space, ranked, guard)
            best = _best_on_device(prober, timed, notes, ui)
            best, compiled = compiled_pick(
                prober, best, notes, ui, cache=cache, free_bytes=_free_bytes(device)
            )
            pick, verified = _verified(prober, best, ui)
            pick = _with_parallel_record(_with_batch_record(pick, chosen, config))
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
                measure_comparison = _rows_are_cheap(device, prober.probes, space)
            rows, row_notes = _rows(space, prober if measure_comparison else None, plan_row, ui)
            notes += _pick_notes(config, pick, best)
            tie = _tie_note(prober.tie, best.candidate)
            if tie is not None:
                notes.append(tie)
            notes.append(_runs_note(prober.probes, best, verified, config))
            with ui.stage("checks", total=None):
                checks = screened + run_checks(workload, pick, chosen, done=screened)
            notes += prober.notes + getattr(device, "notes", []) + row_notes
            notes = _fallbacks_first(notes)
            return Plan(
                model_name=profile.model_name,
                model_fingerprint=ModelFingerprint.of(workload.model),
                config=config,
                device_kind=device.kind,
                device_name=device.name,
                candidate=pick,
                estimate=pick_estimate,
                verified=verified,
                probes=prober.probes,
                comparison=rows,
                advice=_advice(chosen, pick, profile),
                checks=checks,
                notes=notes,
                plan_wall_ms=(time.perf_counter() - started) * 1e3,
                stage_wall_ms=stage_totals(ui.stage_log[first_stage:]),
                compile=compiled,
                profile=profile,
            )
        finally:
            if owned is not None and hasattr(owned, "close"):
                owned.close()
            _release_cached_memory()


def _fallbacks_first(notes: list[str]) -> list[str]:
    """The notes with the in-process fallback's first: it changes how far the report's
    measurements can be trusted, so the report's first lines say it, not a note at the end."""
    from memadvisor.device.cuda import IN_PROCESS_NOTE_START

    first = [n for n in notes if n.startswith(IN_PROCESS_NOTE_START)]
    return first + [n for n in notes if not n.startswith(IN_PROCESS_NOTE_START)]


def _free_bytes(device: Device) -> int | None:
    """Bytes free on ``device``'s card now; None where it is not a card."""
    from memadvisor.device.cuda import CudaDevice

    if not isinstance(device, CudaDevice):
        return None
    return int(torch.cuda.mem_get_info(device.index)[0])


def timed_candidates(space: SearchSpace, ranked: Sequence[Scored], guard: bool) -> list[Scored]:
    """The candidates the device times: the estimate's best ``rerank_top``, less those far
    behind the best by the estimate, and with ``guard`` the hand configurations without
    checkpointing (Baseline, +AMP), best by the estimate first, each choice set once.

    ``guard`` is for objectives that rank by time on devices whose times rank: the estimate's
    step times can be off by more than the gap between candidates, and then only the device
    can say whether the plan beats the configuration a person would try first.
    """
    cfg = space.config
    if not ranked:
        return []

    def worth(s: Scored) -> float:
        if cfg.objective == "largest_batch":
            return float(s.candidate.batch_size)
        return s.estimate.samples_per_s

    floor = RERANK_FLOOR * worth(ranked[0])
    chosen = [s for s in ranked[: cfg.rerank_top] if worth(s) >= floor]
    if guard:
        for choices in unchecked_hand_choices(space):
            scored = space.score_choices(choices)
            if scored is not None:
                chosen.append(scored)
    out: dict[str, Scored] = {}
    for s in chosen:
        out.setdefault(s.choices_json, s)
    return sorted(out.values(), key=space.key)


def _best_on_device(
    prober: _Prober, timed: Sequence[Scored], notes: list[str], ui: Progress
) -> _Confirmed:
    """Time each candidate with one run at its estimated batch and finish the batch search of
    the device's best alone.

    A candidate that ran out there gets one more run the margin below, when (by the estimate
    at that batch) it could still beat the best that fitted, or when nothing fitted yet, and
    no candidate of its precision ran out at its own margin below already. If still nothing
    fitted, the candidates' batch searches run in
    full, best by the estimate first, until one finds a batch.

    Raises:
        InfeasibleBudgetError: not even batch 1 fitted for any of them.
    """
    space, device = prober.space, prober.device
    measured_times = step_times_rank(device)
    with ui.stage("probes", total=None) as bar:
        prober.bar = bar
        first = {s.choices_json: _timing(prober, s, _start(prober, s)) for s in timed}
        best = _device_best(prober, timed, first, measured_times)
        twice_out: set[JsonValue] = set()  # precisions whose retry ran out too
        for s in timed:  # the estimate's order
            if first[s.choices_json] is not None:
                continue
            precision = s.candidate.choices.get("precision", "fp32")
            below = safe_below(_start(prober, s), space.config.margin_fraction)
            if below < 1 or precision in twice_out:
                continue  # the estimate is as far off for this precision's other candidates
            if best is not None and not _could_beat(space, s, below, best):
                continue
            # Every precision gets its retry, even when another's failed twice: the estimate
            # can be optimistic for one (a card's fragmentation around fp32's large logits)
            # and right for another.
            first[s.choices_json] = _timing(prober, s, below)
            if first[s.choices_json] is None:
                twice_out.add(precision)
            best = _device_best(prober, timed, first, measured_times)
        winner = None
        if best is not None:
            winner = prober.confirm(best[0], stage="probe")
        for s in timed if winner is None else ():
            winner = prober.confirm(s, stage="probe")
            if winner is not None:
                break
    if winner is None:
        raise infeasible(
            space.profile,
            space.config,
            space.cheapest_peak_bytes(),
            f"On the device not even batch 1 fitted for the {len(timed)} best configurations "
            "by the estimate.",
        )
    fitted = sum(m is not None for m in first.values())
    if not measured_times and fitted > 1:
        notes.append(
            f"The {fitted} best candidates were re-ranked at the batches the "
            f"{device.kind} device confirmed, by the estimate's step time: this device's own "
            "times do not rank (CPU times, slowed by tracking)."
        )
    return winner


@dataclass
class _Timing:
    """A candidate's first fitting run: the batch it ran and what it measured."""

    candidate: Candidate
    measured: Measurement


def _start(prober: _Prober, scored: Scored) -> int:
    """The estimate's largest batch under the usable budget: where a candidate is timed."""
    return min(max(scored.largest_batch, 1), prober.config.max_batch)


def _timing(prober: _Prober, scored: Scored, batch: int) -> _Timing | None:
    """One run of ``scored``'s choices at ``batch``; None when it ran out."""
    candidate = Candidate(batch_size=batch, choices=scored.candidate.choices)
    measured = prober.run(candidate, prober.steps, "timing")
    return _Timing(candidate, measured) if measured is not None else None


def _pick_at(space: SearchSpace, choices: dict[str, JsonValue], largest: int) -> Candidate:
    """What the objective takes of ``choices`` when ``largest`` fits (accumulation included)."""
    batch, accumulation = space.batch_for(largest)
    return Candidate(batch_size=batch, accumulation_steps=accumulation, choices=choices)


def _rate(space: SearchSpace, scored: Scored, timing: _Timing, measured_times: bool) -> float:
    """Samples/s of ``scored``'s pick, judged from its timing run.

    The pick is what the objective takes when the run's batch fits (for effective_batch a
    micro-batch and accumulation, else the run itself). Measured times are carried from the
    run to the pick by the estimate's ratio between the two (exactly the measurement when
    the pick is what ran); where times do not rank, the estimate's samples/s of the pick.
    """
    pick = _pick_at(space, scored.candidate.choices, timing.candidate.batch_size)
    at_pick = estimate(space.profile, pick, space.strategies).samples_per_s
    if not measured_times:
        return at_pick
    if pick == timing.candidate:
        return timing.measured.samples_per_s
    ran = estimate(space.profile, timing.candidate, space.strategies).samples_per_s
    return timing.measured.samples_per_s * at_pick / ran if ran > 0 else at_pick


@dataclass
class _Tie:
    """Candidates the device could not tell apart, and the one the fixed rule took."""

    taken: Scored
    rate: float
    others: list[tuple[Scored, float]]


def _device_best(
    prober: _Prober,
    timed: Sequence[Scored],
    first: dict[str, _Timing | None],
    measured_times: bool,
) -> tuple[Scored, _Timing] | None:
    """The best of the candidates that fitted, by the objective on the device's answer.

    Rates within :data:`TIE_FRACTION` of the best (at the best's batch, for largest_batch)
    are a tie, which a fixed rule breaks: fewest strategies turned on, then the choices'
    JSON. Timings jitter from run to run; without the rule the same inputs could give
    another pick each time. :attr:`_Prober.tie` keeps the last tie for the plan's notes.
    """
    space = prober.space
    objective = space.config.objective
    entries = []
    for s in timed:
        timing = first.get(s.choices_json)
        if timing is None:
            continue
        entries.append((s, timing, _rate(space, s, timing, measured_times)))
    if not entries:
        return None
    top_batch = max(t.candidate.batch_size for _, t, _ in entries)
    if objective == "largest_batch":
        entries = [e for e in entries if e[1].candidate.batch_size == top_batch]
    best_rate = max(rate for _, _, rate in entries)
    tied = [e for e in entries if e[2] >= (1.0 - TIE_FRACTION) * best_rate]
    scored, timing, rate = min(tied, key=lambda e: (e[0].active, e[0].choices_json))
    others = [(s, r) for s, _, r in tied if s is not scored]
    prober.tie = _Tie(scored, rate, others) if others else None
    return scored, timing


def _tie_note(tie: _Tie | None, final: Candidate) -> str | None:
    """The plan's note on a tie the fixed rule broke, when the tie decided the pick."""
    if tie is None or tie.taken.candidate.choices != final.choices:
        return None
    others = "; ".join(
        f"{_describe_choices(s.candidate.choices)} {rate:.1f}" for s, rate in tie.others
    )
    return (
        f"Tie: {_describe_choices(tie.taken.candidate.choices)} ran {tie.rate:.1f} samples/s "
        f"and {others} samples/s, within {TIE_FRACTION:.0%} of the best, the spread two runs "
        "of one configuration show; the plan takes the one with the fewest strategies turned "
        "on (a fixed rule: the same inputs give the same pick)."
    )


def _describe_choices(choices: dict[str, JsonValue]) -> str:
    if not choices:
        return "the plain step"
    return ", ".join(
        f"{name} {len(c)} blocks" if isinstance(c, list) else f"{name} {json.dumps(c)}"
        for name, c in sorted(choices.items())
    )


def _could_beat(
    space: SearchSpace, scored: Scored, batch: int, best: tuple[Scored, _Timing]
) -> bool:
    """Whether ``scored``, if ``batch`` fits, beats the best that fitted (at the batch it
    ran), by the estimate: both sides estimated, so errors they share cancel."""
    ran = best[1].candidate
    if space.config.objective == "largest_batch":
        return batch > ran.batch_size
    mine = _pick_at(space, scored.candidate.choices, batch)
    theirs = _pick_at(space, best[0].candidate.choices, ran.batch_size)
    rate = estimate(space.profile, mine, space.strategies).samples_per_s
    return rate > estimate(space.profile, theirs, space.strategies).samples_per_s


def _verified(prober: _Prober, best: _Confirmed, ui: Progress) -> tuple[Candidate, Measurement]:
    """The pick after its sustained run from a clean state, stepped down while it fails.

    A run of the pick that already took ``verify_steps`` steps from a clean state (on a card
    every probe does) is that run: no device run repeats it.

    Raises:
        InfeasibleBudgetError: it failed even at batch 1.
    """
    steps = prober.config.verify_steps
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


def _screen_notes(checks: Sequence[Check], config: PlanConfig) -> list[str]:
    """What the checks run before the search decided, for the plan's first lines."""
    notes = []
    for check in checks:
        if check.passed:
            continue
        choice = f"{check.strategy} {check.choice}"
        if config.checks == "decide":
            notes.append(
                f"{choice} was not considered: its check failed. {check.summary} Pass "
                "checks='report' (CLI: --checks report) to consider it anyway."
            )
        else:
            notes.append(
                f"{choice} failed its check and was considered anyway (checks='report'): "
                f"{check.summary}"
            )
    return notes


def _pick_notes(config: PlanConfig, pick: Candidate, best: _Confirmed) -> list[str]:
    """What a person should know about the pick's batch."""
    notes = []
    wanted = config.effective_batch
    reached = pick.batch_size * pick.accumulation_steps
    if config.objective == "effective_batch" and wanted and reached != wanted:
        notes.append(
            f"Effective batch {reached}, not {wanted}: no micro-batch that fits divides "
            f"{wanted} within twice the fewest accumulation steps, so the micro-batch was "
            f"rounded up ({pick.batch_size} x {pick.accumulation_steps})."
        )
    found = best.search
    if found.lowest_failure is None and found.probe_count > 1:
        kept = (
            f" and kept {best.found_batch}: the higher one's measured peak passed the "
            "usable budget (budget less margin)."
            if best.found_batch < found.largest_fit
            else " (its measured peak left the margin free)."
        )
        notes.append(
            f"The device held batch {found.largest_fit}, as far as the first run's measured "
            f"peak said would fit; the plan did not probe higher{kept}"
        )
    return notes


def _runs_note(
    runs: Sequence[Probe], best: _Confirmed, verified: Measurement, config: PlanConfig
) -> str:
    """The batch search of the pick's choices in runs, and what verified the pick.

    The report tallies every run by stage (``report._facts.device_runs``); this says what
    that tally cannot: how many runs found the pick's batch, and which run verified it.
    """
    search = best.search.probe_count
    tried = ", ".join(f"{b} {'fits' if ok else 'OOM'}" for b, ok in best.search.tried)
    text = f"The pick's batch took {search} device run{'s' if search != 1 else ''} ({tried})"
    if not any(r.stage == "verify" for r in runs):
        return (
            f"{text}; the pick's own {verified.steps}-step run from a clean state (at least "
            f"verify_steps={config.verify_steps}) is its verification."
        )
    return f"{text}, and a run of its own verified it over {verified.steps} steps."


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
    prober = _Prober(device, workload, space, config)
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


def _rows_are_cheap(device: Device, runs: Sequence[Probe], space: SearchSpace) -> bool:
    """Whether running the hand configurations too fits :data:`ROWS_TIME_BUDGET_S`.

    Not on CUDA (each run is a fresh process of several seconds); elsewhere judged from the
    plan's own runs: about three runs per row at their average wall time.
    """
    if device.kind == "cuda" or not runs:
        return False
    average_s = sum(r.wall_ms for r in runs) / len(runs) / 1e3
    return average_s * _RUNS_PER_ROW * len(hand_configurations(space)) <= ROWS_TIME_BUDGET_S


def _release_cached_memory() -> None:
    # What the probes freed goes back: the allocator holds no more than before planning.
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        # The profile, compile trial and checks ran matmuls on threads of this process: each
        # thread's cuBLAS workspace (32 MiB on an H200) stays allocated until cleared; the
        # next matmul makes it again. Measured: 68 MiB more allocated after a plan without this.
        from memadvisor._torch_private import clear_cublas_workspaces

        torch.cuda.synchronize()
        clear_cublas_workspaces()
        torch.cuda.empty_cache()
