"""The prober: every device run of a plan goes through it, is logged, and is asked once.

Each run takes :func:`run_steps` steps from a clean state. What a run said is kept by
candidate, so asking again for a batch already run (the winner's batch search continuing
from its timing run, a comparison row the re-rank already ran) costs no device run. A
candidate that runs out of memory where shorter probes fitted steps down the margin below
(halving after a few such steps). On a device that makes several runs at once, a batch
search's probe that may run out goes to the device with the batch the search takes next if
it does (:meth:`Prober._searched`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import JsonValue

from memadvisor import strategy
from memadvisor.device import Device
from memadvisor.errors import ran_out_by_retries
from memadvisor.planner._probe import (
    BatchSearch,
    find_batch,
    probe,
    probe_many,
    ran_out_record,
    retry_ran_out_record,
    safe_below,
)
from memadvisor.planner._progress import Stage
from memadvisor.planner._space import Scored, SearchSpace
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.plan import Probe
from memadvisor.units import fmt_ms
from memadvisor.workload import Workload

__all__ = [
    "HEADROOM_FRACTION",
    "Confirmed",
    "Prober",
    "Run",
    "RunsSpent",
    "Tie",
    "describe_choices",
    "run_steps",
    "timing_steps_at_once",
    "verify_steps",
]

# The measured margin: how far below the edge the pick stays, as a share of the budget in
# measured bytes per sample: below the lowest batch that ran out, that many bytes' worth of
# samples, and a pick's allocated peak leaves that much of the budget free. Near the edge the
# limit moved by a few samples between fresh processes (docs/design.md, "The measured margin").
HEADROOM_FRACTION = 0.03
# Steps of the first timing runs made at once on a card (timing_steps_at_once): the first
# step compiles nothing in eager but warms the allocator and cuDNN; the median of 7 ranks.
TIMING_AT_ONCE_STEPS = 8

# The fits whose peaks say what a sample costs near the edge: those within this fraction of
# the largest batch that fitted (Prober._slope_and_basis).
_SLOPE_WINDOW = 0.1

# Halving after this many margin-sized step-downs: a pick that keeps failing is far off.
_MARGIN_STEP_DOWNS = 3

# How much faster a smaller batch of the pick's choices, run as long as the pick and held
# within its limit, must have run to be the pick instead of the largest batch that fits
# (Prober.faster_fit): above the few percent two runs of one candidate differ by.
_FASTER_BELOW = 1.05


@dataclass
class Confirmed(strategy.Confirmed):
    """A candidate the device ran (its batch as probed, its measured step), with the search
    that found the batch and the scored choices it came from; a measured stage gets it as
    the contract's :class:`memadvisor.strategy.Confirmed`."""

    scored: Scored
    search: BatchSearch


@dataclass
class Tie:
    """Candidates the device could not tell apart, and the one the fixed rule took."""

    taken: Scored
    rate: float
    others: list[tuple[Scored, float]]


class RunsSpent(Exception):
    """A device run was asked for after :attr:`Prober.runs_left` reached 0 (a measured
    stage's bounded batch search): the caller answers from the runs made so far."""


@dataclass
class Run:
    """What one device run of a candidate said; a failure holds the steps that completed."""

    steps: int
    measured: Measurement | None
    # It completed its steps, but the allocator retried in most of them
    # (AllocatorRetriesError): out of memory in effect, once the steps retried decide it
    # (``steps``: those it took, up to the one that decided).
    by_retries: bool = False

    @classmethod
    def of(cls, steps: int, record: Probe, measured: Measurement | None) -> Run:
        """A run of ``steps`` steps as its ``record`` and ``measured`` say (a failure: the
        steps it completed, and whether the allocator's retries decided it)."""
        return cls(
            steps if measured else record.steps,
            measured,
            by_retries=measured is None and ran_out_by_retries(record.error),
        )

    def answers(self, steps: int, shorter_fits: bool = False) -> bool:
        """Whether it answers a run of the same candidate for ``steps`` steps: it fitted
        them (``shorter_fits``: or fewer), or ran out within them."""
        if self.measured is not None:
            return self.steps >= steps or shorter_fits
        return self.ran_out_within(steps)

    def ran_out_within(self, steps: int) -> bool:
        """Whether it ran out before completing ``steps`` steps (so a run of ``steps`` of the
        same candidate, or of a larger batch of its choices, would too). A run out by the
        allocator's retries counts for ``steps`` of at least its own: it completed them,
        and a larger batch retries at least as often (lm350m on an H200, session 24: the
        compile stage's confirmation ran 26, 18.1 s of compiled run, above a 23 that had run
        out so)."""
        if self.measured is not None:
            return False
        return self.steps < steps or (self.by_retries and self.steps <= steps)


class Prober:
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
        self._runs: dict[str, Run] = {}
        # Runs made ahead of the search's asking (run_many's ``ahead``), by candidate: the
        # steps they were made for, their record and measurement; logged, counted and kept
        # only where a run of the same candidate is asked for (_take_ahead).
        self._ahead: dict[str, tuple[Run, Probe]] = {}
        # Per choice set (JSON), the runs that fitted by batch: the measured margin's slope.
        self._fitted: dict[str, dict[int, Measurement]] = {}
        self.tie: Tie | None = None  # the last tie the re-rank broke
        # Device runs a measured stage still allows (None: no bound); a run past it raises
        # RunsSpent, answered from what ran (ProberStage.confirm's max_runs).
        self.runs_left: int | None = None
        # How near the largest fit a measured stage's descent stops (find_batch's ``within``;
        # ProberStage.confirm's): 0 bisects to the sample.
        self.within = 0.0
        # No upward probe above it (find_batch's ``ceiling``; PickStage.confirm sets it).
        self.ceiling: int | None = None
        # What a measured stage is doing, said before each run's batch on the progress line
        # ("compiling candidate 2/4 (...)"); '' says the stage's name.
        self.doing = ""
        # Runs to make at once with a measured stage's batch search's first device run
        # (PickStage.confirm's ``beside``: the compile stage's static form, the CUDA graphs'
        # first round), then none.
        self.beside: list[Candidate] = []

    def run(
        self, candidate: Candidate, steps: int, stage: str, shorter_fits: bool = False
    ) -> Measurement | None:
        """``candidate`` for ``steps`` steps, on the device unless an earlier run answers it;
        ``shorter_fits``: an earlier run of fewer steps that fitted answers too (a batch
        search asks whether it fits and what it held; the pick's own run takes the steps)."""
        known, answer = self._known(candidate, steps, shorter_fits)
        if known:
            return answer
        doing = self.doing or stage
        taken, answer = self._take_ahead(candidate, steps, shorter_fits, doing)
        if taken:
            return answer
        self._spend(1, candidate)
        self._describe(f"{doing}: batch {candidate.batch_size} running")
        record, measured = probe(self.device, self.workload, candidate, steps, stage=stage)
        self._keep(candidate, steps, record, measured, doing)
        return measured

    def run_many(
        self,
        candidates: list[Candidate],
        steps: int,
        stage: str,
        retry_at: Sequence[int | None] | None = None,
        ahead: Sequence[bool] | None = None,
    ) -> list[Measurement | None | Exception]:
        """Each of ``candidates`` for ``steps`` steps, as :meth:`run` answers it: those no
        earlier run answers go to the device together (``Device.run_many``: at once where it
        can). Per candidate, in order: its measurement, None (it ran out), or the error of a
        run that failed otherwise (not recorded, as :meth:`run` records none).

        ``ahead``: per candidate, True for a run made ahead of the search's asking (the
        compile search's fallback beside a pass-2 run, ``Search._fallback``): its answer is
        returned but neither logged, counted in :attr:`runs_left` nor kept, until a later
        run of the same candidate is asked for (:meth:`run`, a batch search's probe, this
        method), which takes it without a device run. Why: near the limit fitting is not
        monotone, and a smaller batch that ran out, recorded, would answer a larger one that
        fitted as run out (:meth:`_ran_out_below`), as a batch search's partner would
        (:meth:`_searched`).

        ``retry_at``: per candidate, a smaller batch the device measures where it runs out
        (``Device.run_many_retrying``): its answer is then that batch's measurement, whose
        ``ran_out_first`` says what ran out; both are recorded, the batch that ran out
        first, as two runs would be (one device run spent). Where the retry ran out too, the
        answer is None and both batches are recorded as run out.

        Raises:
            RunsSpent: the runs left (:attr:`runs_left`) do not cover them; none ran.
        """
        answers: list[Measurement | None | Exception] = []
        to_run: list[int] = []
        doing = self.doing or stage
        made_ahead = list(ahead) if ahead is not None else [False] * len(candidates)
        for i, candidate in enumerate(candidates):
            known, answer = self._known(candidate, steps)
            if not known and not made_ahead[i]:
                known, answer = self._take_ahead(candidate, steps, False, doing)
            answers.append(answer)
            if not known:
                to_run.append(i)
        if not to_run:
            return answers
        self._spend(sum(1 for i in to_run if not made_ahead[i]), candidates[to_run[0]])
        batches = ", ".join(str(candidates[i].batch_size) for i in to_run)
        many = (
            f"batches {batches} running at once" if len(to_run) > 1 else f"batch {batches} running"
        )
        self._describe(f"{doing}: {many}")
        too: dict[int, tuple[int, bool]] = {}
        ran = probe_many(
            self.device,
            self.workload,
            [candidates[i] for i in to_run],
            steps,
            stage=stage,
            retry_at=[retry_at[i] for i in to_run] if retry_at is not None else None,
            ran_out_too=too,
        )
        for j, (i, (record, measured, error)) in enumerate(zip(to_run, ran, strict=True)):
            if record is None:
                answers[i] = error
                continue
            if made_ahead[i]:
                self._ahead[_key(candidates[i])] = (Run.of(steps, record, measured), record)
                answers[i] = measured
                continue
            if j in too:  # its retry ran out too: that batch's record after the first's
                self._keep(candidates[i], steps, record, None, doing)
                again = retry_ran_out_record(candidates[i], *too[j], stage)
                assert again.candidate is not None
                self._keep(again.candidate, steps, again, None, doing)
                answers[i] = None
                continue
            failed = ran_out_record(candidates[i], measured, stage) if measured else None
            if failed is not None and record.candidate is not None:
                self._keep(candidates[i], steps, failed, None, doing)
                self._keep(record.candidate, steps, record, measured, doing)
            else:
                self._keep(candidates[i], steps, record, measured, doing)
            answers[i] = measured
        return answers

    def _known(
        self, candidate: Candidate, steps: int, shorter_fits: bool = False
    ) -> tuple[bool, Measurement | None]:
        """(True, the answer) where an earlier run answers ``candidate`` for ``steps``
        steps without the device (``shorter_fits``: or one of fewer steps that fitted);
        (False, None) where it must run."""
        known = self._runs.get(_key(candidate))
        if known is not None:
            if known.answers(steps, shorter_fits):  # it fitted them, or ran out within them
                return True, known.measured
        elif self._ran_out_below(candidate, steps):
            return True, None  # a smaller batch of the same choices ran out: no run to learn that
        return False, None

    def _take_ahead(
        self, candidate: Candidate, steps: int, shorter_fits: bool, doing: str
    ) -> tuple[bool, Measurement | None]:
        """(True, its answer) where a run of ``candidate`` made ahead (:meth:`run_many`'s
        ``ahead``) answers it for ``steps`` steps as :meth:`_known` would: logged, counted
        and kept now; (False, None) where none does."""
        key = _key(candidate)
        made = self._ahead.get(key)
        if made is None or not made[0].answers(steps, shorter_fits):
            return False, None
        run, record = made
        self._spend(1, candidate)  # RunsSpent leaves it made ahead
        del self._ahead[key]
        self._keep(candidate, run.steps, record, run.measured, doing)
        return True, run.measured

    def _spend(self, runs: int, candidate: Candidate) -> None:
        """Count ``runs`` device runs against :attr:`runs_left` (RunsSpent where they do not
        fit in it)."""
        if self.runs_left is None:
            return
        if self.runs_left < runs:
            raise RunsSpent(f"no device run left for batch {candidate.batch_size}")
        self.runs_left -= runs

    def _keep(
        self,
        candidate: Candidate,
        steps: int,
        record: Probe,
        measured: Measurement | None,
        doing: str,
    ) -> None:
        """Log a device run and keep what it said."""
        self.probes.append(record)
        if measured is not None and candidate.accumulation_steps == 1:
            key = json.dumps(candidate.choices, sort_keys=True)
            self._fitted.setdefault(key, {})[candidate.batch_size] = measured
        self._runs[_key(candidate)] = Run.of(steps, record, measured)
        if self.bar is not None:
            self.bar.advance()
            self.bar.describe(
                f"{doing}: batch {candidate.batch_size} {'fits' if record.fits else 'ran out'}"
                f"{_compiled_words(measured)}"
            )

    def _ran_out_below(self, candidate: Candidate, steps: int) -> bool:
        """Whether a smaller batch of ``candidate``'s choices (no accumulation) ran out within
        ``steps``: the batch search takes a failure as the edge, so a larger batch is not run
        again (the compile stage's confirmation started above a batch its search had seen run
        out, and paid two compiled runs, 13 and 11, to learn it; lm350m on a card)."""
        if candidate.accumulation_steps != 1:
            return False
        for key, run in self._runs.items():
            batch, accumulation, choices = json.loads(key)
            if (
                run.ran_out_within(steps)
                and accumulation == 1
                and batch < candidate.batch_size
                and choices == candidate.choices
            ):
                return True
        return False

    def held(self, measured: Measurement) -> int:
        """The bytes of ``measured`` the pick's margin reads (:func:`_held`)."""
        return _held(measured, self.config.measured_margin)

    def _fits(self, choices: dict[str, JsonValue]) -> dict[int, Measurement]:
        """The runs of ``choices`` (no accumulation) that fitted, by batch (this prober's
        record: not to be changed)."""
        return self._fitted.get(json.dumps(choices, sort_keys=True), {})

    def measured_runs(
        self, choices: dict[str, JsonValue]
    ) -> tuple[dict[int, Measurement], int | None]:
        """The runs of ``choices`` (no accumulation) that fitted, by batch, and the lowest
        batch of them that ran out (None: none did)."""
        fitted = dict(self._fits(choices))
        failed = [
            p.batch_size
            for p in self.probes
            if not p.fits
            and p.candidate is not None
            and p.candidate.accumulation_steps == 1
            and p.candidate.choices == choices
        ]
        return fitted, min(failed) if failed else None

    def _describe(self, text: str) -> None:
        if self.bar is not None:
            self.bar.describe(text)

    def largest(
        self, scored: Scored, stage: str, floor: int = 0
    ) -> tuple[BatchSearch, dict[int, Measurement]]:
        """Probe the largest micro-batch of ``scored``'s choices, bracketed by its estimate
        (``floor``: a batch of them known to fit, :func:`find_batch`)."""
        cfg = self.config
        choices = scored.candidate.choices
        measured: dict[int, Measurement] = {}
        # Where the device makes several runs at once: the batch the search probes next if
        # the one it asks for runs out (find_batch's next_if_out), and the partners' runs the
        # search has not asked for yet (:meth:`_searched`).
        next_if_out: dict[int, int | None] = {}
        ahead: dict[int, tuple[Probe, Measurement | None]] = {}

        def fits(batch: int) -> bool:
            candidate = Candidate(batch_size=batch, choices=choices)
            after = next_if_out.pop(batch, None)
            m = self._searched(candidate, after, stage, floor, ahead)
            if m is not None:
                measured[batch] = m
            return m is not None

        def within_margin(batch: int) -> bool:
            m = measured[batch]
            return _held(m, cfg.measured_margin) <= self.pick_limit_bytes(choices, batch)

        def extrapolate(batch: int) -> int | None:
            """The next batch up to probe after ``batch`` fitted: where its measured peak,
            grown along the runs' own slope where two fitted, else along the estimate's
            shape from ``batch`` up (SearchSpace.batch_reaching), fills what is aimed at.

            Why the estimate's shape, not a slope averaged below ``batch``: a step's
            estimate is the larger of a fixed phase (the optimizer's update) and the
            activations' phase, so below a fit its slope can be the fixed phase's. lm350m
            on a card fitted 18 at 7.53 GB of 8.59 (about 0.17 GB a sample there); the
            slope over [9, 18] said 0.05 and the next probe went to 38 or 42, then three
            more ran out before 20 fitted. Along the estimate, shifted by what the run
            measured, the probe after 18 is 24 (docs/design.md)."""
            m = measured.get(batch)
            if m is None:
                return None
            runs_slope, _ = self._slope_and_basis(choices)
            if cfg.measured_margin:
                # At the edge itself, where the allocated peak fills the budget: the first
                # failure (or a fit past the headroom) measures where it is, and the pick is
                # the headroom's worth of samples below it (find_batch's ``descend``).
                room = cfg.budget_bytes - m.peak_bytes
                if runs_slope > 0:
                    return batch + max(1, math.ceil(room / runs_slope))
                return self.space.batch_reaching(choices, batch, room) + 1
            # A quarter margin under the usable budget: a probe that lands just over it fits
            # but cannot be taken (within_margin), and the search keeps ``start``.
            aim = cfg.usable_bytes - cfg.budget_bytes * cfg.margin_fraction / 4
            if runs_slope > 0:
                return batch + math.floor((aim - m.limit_bytes) / runs_slope)
            return self.space.batch_reaching(choices, batch, aim - m.limit_bytes)

        upper = self.space.upper_batch(scored)
        ceiling = self._ceiling_below_failure(choices)
        reserved_start = self._reserved_start(choices)
        start = min(b for b in (scored.largest_batch, ceiling, reserved_start) if b is not None)
        known = max(self._fits(choices), default=0)

        def first_up(batch: int) -> int | None:
            """``extrapolate``; from a fit the search did not make (a timing run's), no
            higher than :meth:`_reserved_start`: the search's first probe above it."""
            guess = extrapolate(batch)
            if guess is not None and reserved_start is not None and batch <= known:
                guess = min(guess, reserved_start)
            return guess

        found = find_batch(
            fits,
            start,
            upper,
            cfg.margin_fraction,
            cfg.max_batch,
            within_margin,
            first_up,
            lambda failed: self.below(choices, failed),
            # A measured slope (two runs) lands the next extrapolation where the first one,
            # on the estimate's slope, could not: a pessimistic estimate costs a run, not batch.
            max_extrapolations=3 if cfg.measured_margin else 1,
            descend=cfg.measured_margin,
            floor=floor,
            within=self.within,
            ceiling=ceiling,
            next_if_out=next_if_out.__setitem__ if self._at_once() else None,
        )
        return found, measured

    def _ceiling_below_failure(self, choices: dict[str, JsonValue]) -> int | None:
        """The highest batch of ``choices`` a search may run: :attr:`ceiling`, or where a run
        of them ran out before the search, the margin :meth:`below` it if lower (None: no
        bound).

        Why: the pick is never above the margin under the lowest failure (find_batch's
        ``cap``), so a probe above it is a run the pick cannot take. t5_base's compiled
        confirmation on an H200 (session 32) started at 54 after 57 had run out, ran 54 and
        55 (fits, 29.1 and 26.9 s), then, with the margin below 57 at 53 and its runs spent,
        kept 39 from pass 1: 180.6 samples/s where 54 had run 221. Bounded, 54's fit ends
        the search and is the pick, its run the measurement.

        Known limitations: the bound is the margin the runs made before the search measure,
        fixed for the search. Its own fits would move it, a sample or a few either way (a
        fit near the failure measures a sample's bytes there, or the climb to the failure),
        and asked again after each fit the bound moved up and down: t5_base's would have
        been 54 from 39's fit, 56 after 54's, 53 after 55's. Fixed, the search ends at the
        first fit at the bound, and that fit is the pick."""
        _, failure = self.measured_runs(choices)
        if failure is None:
            return self.ceiling
        cap = max(1, self.below(choices, failure))
        return cap if self.ceiling is None else min(self.ceiling, cap)

    def _reserved_start(self, choices: dict[str, JsonValue]) -> int | None:
        """The highest first probe of a search of ``choices`` above the runs of them made
        before it (:meth:`largest`: the start where the estimate's is higher, or the first
        extrapolation from a fit known before it), where the largest of those fits recorded
        a reserved peak under the memory cap: that batch, grown by :meth:`sample_bytes` a
        sample until its reserved peak would reach the budget, at least one sample above it.
        None where that fit recorded no reserved peak or one at the budget, or without the
        measured margin.

        Why: where the allocator's segments keep much unused, the reserved peak, which the
        memory cap bounds, meets the cap long before the allocated one reaches the budget,
        and the batches between run out by the allocator's retries. t5_base's eager pick on
        an H200 (session 36 call 1, 21 blocks checkpointed) held 7.40 GB allocated and 8.37
        GB reserved of the 8.59 GB cap in its timing run at 36; from there the allocated
        bytes said 46, and 46, 43, 39 and 37 ran out before 36 held: about 22 s of probes.
        From the reserved peak, 37. Two more plans (call 2): 27 at 8.12 GB (reserved: 30,
        allocated: 33; 28 ran out) and 28 at 7.77 GB (33 and 38; 32 ran out, 30 held).

        The first probe only: a fit there, or any fit the search makes, climbs on its
        allocated bytes as before (``extrapolate``), so a reserved peak that overstates what
        a sample adds costs a run, not batch. Every later step along the reserved bytes
        would creep: resnet50's compiled step on an H200 (session 4) reserved 7.83 GiB of 8
        at 161 and held 178. A reserved peak at the cap says nothing (a card's stops there
        while the allocated one still grows: :meth:`sample_bytes`), and is not read.

        Known limitations: a sample's bytes are the allocated ones' (measured, or the
        estimate's); the reserved bytes of a step that fragments its segments grow faster,
        so the probe lands a sample or three above the reserved edge (all three plans
        above), and that run runs out.
        """
        if not self.config.measured_margin:
            return None
        fitted = self._fits(choices)
        if not fitted:
            return None
        batch = max(fitted)
        reserved = fitted[batch].reserved_peak_bytes
        cap = self.config.budget_bytes
        if reserved is None or reserved >= cap:
            return None
        slope = self.sample_bytes(choices, batch)
        if slope <= 0:
            return None
        return batch + max(1, math.floor((cap - reserved) / slope))

    def _at_once(self) -> bool:
        """Whether the device makes several runs at once."""
        return self.device.capabilities.concurrent_runs > 1

    def _searched(
        self,
        candidate: Candidate,
        after: int | None,
        stage: str,
        floor: int,
        ahead: dict[int, tuple[Probe, Measurement | None]],
    ) -> Measurement | None:
        """A batch search's probe of ``candidate``, as :meth:`run` answers it with
        ``shorter_fits``; where the device makes several runs at once, made together with
        its partner, the batch ``after`` that the search probes next if ``candidate`` runs
        out (:meth:`_partner`). The partner's run waits in ``ahead`` until the search asks
        for its batch; it is recorded, and counted in :attr:`runs_left`, then.

        Why: the probes near the edge run out, and each is a fresh process that the search
        waited for before choosing the next; a compiled one runs out only after its compile
        (10-40 s on a card). Where the probe runs out, its partner's answer is there without
        a wait: on an H100, lm350m's compiled confirmation ran 14 (out) and 12 (fits) at once,
        10.8 s for both. Where pairing does not pay (an eager probe runs out in its first
        step, and an unneeded partner costs its timed steps: :meth:`_pairing_pays`), the
        probe runs alone. The partner is recorded only when asked for: its fit would change
        the margin's slope (a fit far below the edge, :meth:`below`) and its failure below a
        fit (near the limit fitting is not monotone) would answer larger batches as ran out
        (:meth:`_ran_out_below`), where runs one at a time never made it; counted at once,
        it would end a bounded search (a compile confirmation's) a run early. So the search
        probes, and spends, what it does one at a time.

        Known limitations: a partner whose probe then fits is a device run spent for nothing,
        at the cost of its process beside the other and of its timed steps (runs made at once
        take them in turn, so their timings stay comparable), neither recorded nor counted
        in :attr:`runs_left`.

        Raises:
            Exception: what ``candidate``'s run raised that is not an out-of-memory (a
                partner's such error is ignored: it was speculative).
        """
        known, answer = self._known(candidate, self.steps, shorter_fits=True)
        if known:
            return answer
        doing = self.doing or stage
        taken, answer = self._take_ahead(candidate, self.steps, True, doing)
        if taken:
            return answer
        made = ahead.pop(candidate.batch_size, None)
        if made is not None:  # a partner's run: spent and recorded where the search asks for it
            self._spend(1, candidate)
            record, measured = made
            self._keep(candidate, self.steps, record, measured, doing)
            return measured
        partner = self._partner(candidate, after, floor)
        beside = self._beside(candidate)
        if beside and self.device.capabilities.concurrent_runs < 2 + len(beside):
            partner = None  # a run beside saves a compile; a partner, a run that ran out
        if partner is None and not beside:
            return self.run(candidate, self.steps, stage, shorter_fits=True)
        # A partner's run counts where the search asks for it; the run beside, never.
        self._spend(1, candidate)
        group = [candidate, *([partner] if partner else []), *beside]
        batches = ", ".join(str(c.batch_size) for c in group)
        self._describe(f"{doing}: batches {batches} running at once")
        answers = probe_many(self.device, self.workload, group, self.steps, stage=stage)
        record, measured, error = answers[0]
        if partner is not None and answers[1][0] is not None:
            ahead[partner.batch_size] = (answers[1][0], answers[1][1])
        if record is not None:
            self._keep(candidate, self.steps, record, measured, doing)
        if beside:
            self.beside = []  # made once; a run that failed otherwise is asked for again
            for other, (other_record, other_measured, _) in zip(
                beside, answers[len(group) - len(beside) :], strict=True
            ):
                if other_record is not None:
                    self._keep(other, self.steps, other_record, other_measured, doing)
        if record is None:
            assert error is not None
            raise error
        return measured

    def _beside(self, candidate: Candidate) -> list[Candidate]:
        """Those of :attr:`beside` to go with ``candidate``'s run: on a device of runs at
        once, those not ``candidate`` nor answered by an earlier run, as many as it makes
        beside ``candidate``'s (none: nothing to make, and :attr:`beside` is emptied)."""
        if not self.beside or not self._at_once():
            return []
        room = max(0, self.device.capabilities.concurrent_runs - 1)
        left = [c for c in self.beside if c != candidate and not self._known(c, self.steps)[0]]
        if not left:
            self.beside = []
        return left[:room]

    def _pairing_pays(self, choices: dict[str, JsonValue]) -> bool:
        """Whether a probe of ``choices`` is worth a partner: where their largest known fit
        spent longer in its first step (a compile) than a run's timed steps take.

        Why: runs made at once take their timed steps in turn, so a partner the search does
        not ask for (its probe fitted) costs the wall of its steps, and one it asks for saves
        the wall of the probe that ran out. An eager probe runs out in its first step, a
        few seconds; a compiled one after its compile. On an H100 (lm350m, eager): 24 and 22
        at once, both out, took 5.2 s; 20 with its partner 19 took 16.7 s where such a fit
        alone took 7-8 s. Compiled: 14 (out) and 12 (fitted) at once took 10.8 s for both.
        No known fit: no pairing."""
        fitted = self._fits(choices)
        if not fitted:
            return False
        m = fitted[max(fitted)]
        return m.first_step_ms is not None and m.first_step_ms >= self.steps * m.step_ms

    def _partner(self, candidate: Candidate, after: int | None, floor: int) -> Candidate | None:
        """The batch ``after`` of ``candidate``'s choices, to run beside ``candidate``
        (:meth:`_searched`), where worth a run: at least 1, below ``candidate``'s batch, above
        the largest batch of the choices known to fit below it and above ``floor``, not
        answered by an earlier run, with two device runs left (:attr:`runs_left`: else the
        search could not ask for it), and where pairing pays (:meth:`_pairing_pays`); else
        None (``candidate`` runs alone)."""
        if after is None or not self._at_once() or not self._pairing_pays(candidate.choices):
            return None
        if self.runs_left is not None and self.runs_left < 2:
            return None
        batch = candidate.batch_size
        fitted = max((b for b in self._fits(candidate.choices) if b < batch), default=0)
        if not max(1, fitted + 1, floor + 1) <= after < batch:
            return None
        partner = Candidate(batch_size=after, choices=candidate.choices)
        if self._known(partner, self.steps, shorter_fits=True)[0]:
            return None
        return partner

    # -- the pick's margin ------------------------------------------------------------------

    def sample_bytes(self, choices: dict[str, JsonValue], batch: int) -> float:
        """What one more sample of ``choices`` adds to a run's peak: measured between the two
        largest batches of them that fitted when there are two, else the estimate's slope.

        With the measured margin the peak is the allocated one (:func:`_held`): a card's
        reserved peak stops growing where it meets the memory cap, long before the edge."""
        slope, _ = self._slope_and_basis(choices)
        return slope if slope > 0 else self.space.bytes_per_sample(choices, batch)

    def _slope_and_basis(self, choices: dict[str, JsonValue]) -> tuple[float, bool]:
        """Bytes a sample of ``choices`` adds near their edge, from the runs that fitted: the
        least-squares slope of the peaks of those within :data:`_SLOPE_WINDOW` of the largest
        where there are two, else the slope between the two largest (0: fewer than two fits,
        or a peak that did not grow); and whether the slope came from fits near the edge
        (the window's), not from two fits far apart.

        Why a window and a fit of its points: two fits a sample apart differ by the
        allocator's rounding as much as by their samples (the GPT example at 1 GiB on a card
        fitted 533, 539, 540 and 543; the slopes between neighbours, 1.4, 3.7 and 0.6 MB,
        moved the margin below the failure by tens of samples and its pick fell to 496);
        and fits far below the largest may sit in a fixed phase of the step (the optimizer's
        update) that the activations overtake only near the edge, where a slope to them says
        a sample costs nothing."""
        fitted = self._fits(choices)
        if len(fitted) < 2:
            return 0.0, False
        held = self.config.measured_margin
        high = max(fitted)
        near = [b for b in fitted if b >= high * (1.0 - _SLOPE_WINDOW)]
        windowed = len(near) >= 2
        if not windowed:
            near = sorted(fitted, reverse=True)[:2]
        mean_b = sum(near) / len(near)
        mean_y = sum(_held(fitted[b], held) for b in near) / len(near)
        spread = sum((b - mean_b) ** 2 for b in near)
        cov = sum((b - mean_b) * (_held(fitted[b], held) - mean_y) for b in near)
        return max(0.0, cov / spread), windowed

    def pick_limit_bytes(self, choices: dict[str, JsonValue], batch: int) -> float:
        """The most a run's measured peak (:func:`_held`) may be for its batch to be the
        pick: the usable budget, or with the measured margin the budget less
        :data:`HEADROOM_FRACTION`."""
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
        measured, near_edge = self._slope_and_basis(choices)
        if measured <= 0 or not near_edge or self._failure_beyond_window(choices, failed):
            slope = max(slope, self._edge_slope(choices, failed))
        samples = max(1, math.ceil(HEADROOM_FRACTION * cfg.budget_bytes / slope))
        return max(0, failed - samples)

    def _failure_beyond_window(self, choices: dict[str, JsonValue], failed: int) -> bool:
        """Whether ``failed`` lies beyond :data:`_SLOPE_WINDOW` above the largest batch of
        ``choices`` that fitted below it: the fits near that batch then measure a sample's
        bytes there, not on the way to the failure.

        Why: a step's peak may stay in a fixed phase well past the fits near the edge of what
        was run. lm350m's CUDA graphs form on an H200 (session 43 call C) held 10 and 11 at
        7.016 and 7.020 GB allocated (its pool and the weights' state, the same whatever the
        batch) and ran out at 17; their slope, 4 MB a sample, put the 3% headroom 62 samples
        below 17, and the graphs search descended to batch 1 for a 12 s run at 11.9
        samples/s. The climb the failure proves (:meth:`_edge_slope`) then bounds the slope
        from below, as where the fits' peaks did not grow at all. A failure within the window
        (the GPT example at 1 GiB: 543 fitted, 552 ran out) keeps the fits' slope: there it
        may be the allocator's fragmentation, not a sample's bytes."""
        fits = [b for b in self._fits(choices) if b < failed]
        return bool(fits) and max(fits) < failed * (1.0 - _SLOPE_WINDOW)

    def _edge_slope(self, choices: dict[str, JsonValue], failed: int) -> float:
        """The least a sample of ``choices`` adds near their edge: between the largest batch
        of them that fitted below ``failed`` and ``failed``, which needed more than the
        budget, the peak climbed at least the budget less what that fit held (0: no fit).

        Where a step's peak is a fixed phase (the optimizer's update) until the activations
        overtake it near the edge, the runs that fitted hold the same bytes whatever their
        batch, and their slope, or the estimate's, says a sample costs little: the headroom
        in samples then reached far below the failure (lm350m's compiled candidate, 13 fitted
        at 7.28 GB and 2 at 7.39 GB under 8 GiB, 17 ran out: its line fell to batch 2 on a
        card). The climb the failure proves bounds the slope from below. :meth:`below` takes
        it only where the runs' peaks did not grow, where their slope comes from two fits
        far apart (fewer than two within :data:`_SLOPE_WINDOW` of the largest), or where the
        failure lies beyond that window above the largest fit: a failure near the fits can
        also be the allocator's fragmentation at the cap (the GPT example at 1 GiB: 543
        fitted at 963 MB allocated, 552 ran out), where the bound would be the
        fragmentation's bytes, not a sample's, and fits near the edge measure the slope
        better. Two fits far apart, the smaller in the fixed phase and the larger just past
        it, grow a little: their slope is low and put the margin below every fit (lm350m's
        compiled candidate on a card: 14 and 16 fitted, 19 ran out, and the plan kept eager
        at half the compiled rate). And fits near each other in the fixed phase, with the
        failure far above them (:meth:`_failure_beyond_window`), grow by the allocator's
        rounding only.
        """
        fitted = self._fits(choices)
        fits = [b for b in fitted if b < failed]
        if not fits:
            return 0.0
        batch = max(fits)
        held = _held(fitted[batch], self.config.measured_margin)
        return max(0.0, (self.config.budget_bytes - held) / (failed - batch))

    def confirm(self, scored: Scored, stage: str = "probe", floor: int = 0) -> Confirmed | None:
        """The candidate at the batch the device allows, timed; None when batch 1 fails.

        The batch search continues from whatever this prober already ran of the same choices
        (a run already made answers without the device; ``floor``, a batch of them known to
        fit, bounds its descent, :func:`find_batch`).
        """
        found, measured = self.largest(scored, stage, floor)
        if found.batch < 1:
            return None
        batch, accumulation = self.space.batch_for(found.batch)
        candidate = Candidate(
            batch_size=batch, accumulation_steps=accumulation, choices=scored.candidate.choices
        )
        m = measured.get(batch) if accumulation == 1 else None
        if m is not None and m.steps < self.steps:
            m = None  # a timing run of fewer steps (timing_steps_at_once): the pick's own run
        if m is None:  # the pick itself was not run (margin below a failure, or accumulation)
            candidate, m = self.stepping_down(candidate, self.steps, stage)
            if m is None:
                return None
        candidate, m = self.faster_fit(candidate, m)
        return Confirmed(
            candidate=candidate, found_batch=found.batch, measured=m, scored=scored, search=found
        )

    def faster_fit(
        self, candidate: Candidate, measured: Measurement
    ) -> tuple[Candidate, Measurement]:
        """``candidate`` and its run, or a smaller batch of its choices that ran
        :data:`_FASTER_BELOW` faster: the fastest run of them as long as ``measured``, held
        within the pick's limit (:meth:`pick_limit_bytes`), without accumulation. Only by the
        throughput objective, on a device whose step times rank candidates (a card's; a CPU
        meter's differ by more than that between two runs of one batch).

        Why: the largest batch that fits is the fastest only while a step's time grows with
        the batch. Near the edge it may not: lm350m's compiled confirmation on an H200
        (session 44 call A) ran 23 at 109.1 samples/s (211 ms a step, 196 of them the
        host's), where 22 had run 136.0 (162 ms) in the same plan and 21 140.0; the plan
        then weighed CUDA graphs against 109.1, took them at 11 (108.0), and left about a
        fifth of the rate the runs had shown. A slower largest batch is a step the allocator or
        the host stalls, which a smaller batch does not pay.

        Known limitations:
            * Runs made in different company (alone, beside another run's compile) are
              compared as they are: the faster one may owe some of its lead to the quieter
              moment it ran in. Either batch fits; the smaller is the safer pick.
        """
        if (
            candidate.accumulation_steps != 1
            or self.config.objective != "throughput"
            or not self.device.capabilities.step_times_rank
        ):
            return candidate, measured
        choices = candidate.choices
        limit = self.pick_limit_bytes(choices, candidate.batch_size)
        best_b, best_m = candidate.batch_size, measured
        for b, m in self._fits(choices).items():
            if (
                b < candidate.batch_size
                and m.steps >= measured.steps
                and self.held(m) <= limit
                and m.samples_per_s >= _FASTER_BELOW * measured.samples_per_s
                and m.samples_per_s > best_m.samples_per_s
            ):
                best_b, best_m = b, m
        if best_b == candidate.batch_size:
            return candidate, measured
        self.notes.append(
            f"Kept batch {best_b}, not {candidate.batch_size}, of {describe_choices(choices)}: "
            f"both fitted in runs of "
            f"{measured.steps} steps or more, and {best_b} ran {best_m.samples_per_s:.1f} "
            f"samples/s ({fmt_ms(best_m.step_ms)} a step) where {candidate.batch_size} ran "
            f"{measured.samples_per_s:.1f} ({fmt_ms(measured.step_ms)}): near the edge the "
            "larger batch's step stalled (the allocator, or the host)."
        )
        return Candidate(batch_size=best_b, choices=choices), best_m

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


def describe_choices(choices: dict[str, JsonValue]) -> str:
    """``choices`` in a note's words: each strategy's choice (a checkpointed set by its
    count of blocks)."""
    if not choices:
        return "the plain step"
    return ", ".join(
        f"{name} {len(c)} blocks" if isinstance(c, list) else f"{name} {json.dumps(c)}"
        for name, c in sorted(choices.items())
    )


def _held(measured: Measurement, measured_margin: bool) -> int:
    """The bytes of a run the margin reads: with the measured margin the allocated peak, which
    grows with the batch up to the edge; else the limit (on a card the reserved peak, which a
    memory cap holds at the cap once the allocator starts freeing its cache)."""
    return measured.peak_bytes if measured_margin else measured.limit_bytes


def _key(candidate: Candidate) -> str:
    return json.dumps(
        [candidate.batch_size, candidate.accumulation_steps, candidate.choices], sort_keys=True
    )


def run_steps(device: Device, config: PlanConfig) -> int:
    """Steps each probe and timing run takes on ``device``."""
    steps = max(config.probe_steps, config.timing_steps)
    if device.capabilities.runs_cost_more_than_steps:
        steps = max(steps, config.verify_steps)
    return steps


def timing_steps_at_once(device: Device, config: PlanConfig) -> int:
    """Steps of the first timing runs made at once (``_rerank``): :func:`run_steps`, but on
    a device whose runs cost more than their steps (a card) at most
    :data:`TIMING_AT_ONCE_STEPS` (and no fewer than the probe's and the timing's steps).

    Why: on a card every run takes the verifying steps so that the pick's own run is its
    verification; runs made at once start their processes together, but take their timed
    steps one run after another, so there the steps are what they cost (H100: t5_base's
    six 20-step timing runs took 35.0-42.6 s, lm350m's four 21.3-21.6 s). A timing run
    ranks a candidate and tells the batch search that its batch fits; the pick's batch is
    run again for the full steps where only a timing run measured it (:meth:`Prober.confirm`).
    """
    steps = run_steps(device, config)
    if not device.capabilities.runs_cost_more_than_steps:
        return steps
    return min(steps, max(config.probe_steps, config.timing_steps, TIMING_AT_ONCE_STEPS))


def verify_steps(device: Device, config: PlanConfig) -> int:
    """Steps of the pick's verifying run: ``config.verify_steps``, except on a device whose
    memory repeats from the second step (its capabilities' ``steady_memory``), where a
    probe's steps show all there is, unless the user set ``verify_steps`` themselves."""
    if device.capabilities.steady_memory and "verify_steps" not in config.model_fields_set:
        return run_steps(device, config)
    return config.verify_steps


def _compiled_words(measured: Measurement | None) -> str:
    """' (first step 9.8 s: 2 graphs from the compile cache, 1 compiled)' for a run that
    compiled (what a slow compiled run waited on; graphs the cache would not take are
    counted apart), else ''."""
    if measured is None or measured.compile_cache_hits is None:
        return ""
    first = f"first step {fmt_ms(measured.first_step_ms)}: " if measured.first_step_ms else ""
    bypassed = measured.compile_cache_bypasses
    uncached = f", {bypassed} the cache would not take" if bypassed else ""
    return (
        f" ({first}{measured.compile_cache_hits} graphs from the compile cache, "
        f"{measured.compile_cache_misses} compiled{uncached})"
    )
