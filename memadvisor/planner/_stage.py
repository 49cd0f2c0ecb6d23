"""The measured stages after the eager pick: the planner's side of ``Strategy.refine``.

A measured-only strategy (torch.compile) cannot be ranked on the estimate, so the search
ranks eager combinations only; once the device has chosen the eager pick, each such strategy
gets a :class:`ProberStage` and measures its variants of the pick through it. The stage runs
them with the same batch search the eager pick got and logs them under the strategy's name;
the strategy decides which pick is verified and says why.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator, Sequence

from pydantic import JsonValue

from memadvisor.errors import PlanningError
from memadvisor.estimate import estimate
from memadvisor.planner._probe import BatchSearch
from memadvisor.planner._prober import HEADROOM_FRACTION, Confirmed, Prober, RunsSpent
from memadvisor.planner._progress import Progress, Stage
from memadvisor.planner._space import Scored
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.plan import Probe, StageOutcome
from memadvisor.strategy import Confirmed as AnyConfirmed
from memadvisor.strategy import Estimated, Measured, PickStage, Strategy

__all__ = ["ProberStage", "refined_pick"]


class ProberStage(PickStage):
    """A :class:`~memadvisor.strategy.PickStage` over the plan's prober, for one strategy."""

    def __init__(
        self, prober: Prober, name: str, ui: Progress, reference: Confirmed | None = None
    ) -> None:
        self._prober, self._name, self._ui = prober, name, ui
        self._reference = reference  # the pick this stage refines
        self.config = prober.config
        self.profile = prober.space.profile
        self.workload = prober.workload
        self.strategies = prober.space.strategies
        self.device = prober.device.capabilities
        self.options = prober.space.options
        self._bar: Stage | None = None
        self._two: _TwoLines | None = None  # inside side_by_side

    def confirm(
        self,
        choices: dict[str, JsonValue],
        start_batch: int,
        *,
        like: AnyConfirmed | None = None,
        max_runs: int | None = None,
        within: float = 0.0,
        floor_from: dict[str, JsonValue] | None = None,
        ceiling: int | None = None,
        beside: Sequence[tuple[dict[str, JsonValue], int]] = (),
    ) -> Confirmed | None:
        """``choices``' batch search from ``start_batch``, logged under this stage's name.

        The estimate is eager's (the stage's choice is measured only): the device's answer
        for the eager pick is the better start. The search's top stays the estimate's.

        With the measured margin, a variant that at the reference's own batch (``like``, else
        the refined pick) allocates no more than it did is confirmed without searching its own
        edge: the reference's batch stays the headroom below an edge the device measured, and
        each new batch of a compiled variant is a compile of its own (tens of seconds on a
        card). Where it allocates less by more than the headroom, one run more tries the batch
        at which it would allocate what the reference did (along the reference's measured
        bytes per sample) and takes it if it fits within them. One that allocates more gets
        the whole search.

        With ``max_runs``, a search that would run more answers from the runs made so far:
        the largest batch of ``choices`` that fitted within the limit, below every failure.
        ``within`` and ``ceiling`` are :func:`~memadvisor.planner._probe.find_batch`'s;
        ``beside`` goes with the search's first device run (``Prober.beside``), as far as
        the device makes runs at once.
        """
        space = self._prober.space
        candidate = Candidate(batch_size=max(1, start_batch), choices=choices)
        scored = Scored(
            candidate=candidate,
            estimate=estimate(space.profile, candidate, space.strategies),
            largest_batch=candidate.batch_size,
            active=len(choices),
        )
        self._prober.runs_left, self._prober.within = max_runs, within
        self._prober.ceiling = ceiling
        self._prober.beside = [Candidate(batch_size=max(1, b), choices=c) for c, b in beside]
        try:
            ref = like if like is not None else self._reference
            return self._search(scored, ref, floor_from)
        except RunsSpent:
            return self._best_measured(scored)
        finally:
            self._prober.runs_left, self._prober.within = None, 0.0
            self._prober.ceiling = None
            self._prober.beside = []

    def _search(
        self,
        scored: Scored,
        ref: AnyConfirmed | None,
        floor_from: dict[str, JsonValue] | None = None,
    ) -> Confirmed | None:
        candidate = scored.candidate
        if (
            ref is not None
            and self.config.measured_margin
            and ref.candidate.accumulation_steps == 1
            and ref.candidate.batch_size == candidate.batch_size
        ):
            m = self._prober.run(candidate, self._prober.steps, self._name)
            if m is not None and m.peak_bytes <= ref.measured.peak_bytes:
                search = BatchSearch(tried=[(candidate.batch_size, True)])
                spare = ref.measured.peak_bytes - m.peak_bytes
                if spare > HEADROOM_FRACTION * self.config.budget_bytes:
                    larger = self._larger(candidate, spare, ref, search)
                    if larger is not None:
                        candidate, m = larger
                b = candidate.batch_size
                search.batch = search.largest_fit = b
                return Confirmed(
                    candidate=candidate, found_batch=b, measured=m, scored=scored, search=search
                )
        choices = scored.candidate.choices
        floor = self._known_fit(choices, *self._prober.measured_runs(choices))
        if floor_from is not None:
            other = self._known_fit(floor_from, *self._prober.measured_runs(floor_from))
            floor = max(floor, other)
        return self._prober.confirm(scored, stage=self._name, floor=floor)

    def _known_fit(
        self, choices: dict[str, JsonValue], fitted: dict[int, Measurement], failure: int | None
    ) -> int:
        """Of ``choices``' runs that fitted (``fitted``, by batch; ``failure``, their lowest
        that ran out: :meth:`Prober.measured_runs`), the largest batch within the pick's
        limit, below the margin under the failure (0: none): where a measured stage's batch
        search may stop descending (its earlier runs, e.g. the compile search's passes)."""
        prober = self._prober
        cap = prober.below(choices, failure) if failure is not None else None
        limit = prober.pick_limit_bytes(choices, 0)
        ok = [b for b, m in fitted.items() if prober.held(m) <= limit and (cap is None or b <= cap)]
        return max(ok, default=0)

    def _best_measured(self, scored: Scored) -> Confirmed | None:
        """The largest batch of ``scored``'s choices that fitted within the pick's limit, below
        the margin under its lowest failure, or a smaller one that ran faster
        (:meth:`Prober.faster_fit`): a search whose runs were spent (None: none, or the
        objective's batch there needs accumulation, which no run measured)."""
        prober, choices = self._prober, scored.candidate.choices
        fitted, failure = prober.measured_runs(choices)
        # A shorter run (CompileSearch.pass_one_steps) ranks, but is no pick's measurement.
        fitted = {b: m for b, m in fitted.items() if m.steps >= prober.steps}
        known = self._known_fit(choices, fitted, failure)
        if not known:
            return None
        batch, accumulation = prober.space.batch_for(known)
        if accumulation != 1 or batch not in fitted:
            return None
        tried = [(b, True) for b in sorted(fitted)] + ([(failure, False)] if failure else [])
        search = BatchSearch(
            batch=batch, largest_fit=max(fitted), lowest_failure=failure, tried=tried
        )
        candidate, measured = prober.faster_fit(
            Candidate(batch_size=batch, choices=choices), fitted[batch]
        )
        return Confirmed(
            candidate=candidate, found_batch=batch, measured=measured, scored=scored, search=search
        )

    def run(self, choices: dict[str, JsonValue], batch: int) -> Measurement | None:
        candidate = Candidate(batch_size=max(1, batch), choices=choices)
        return self._prober.run(candidate, self._prober.steps, self._name)

    def run_many(
        self,
        runs: Sequence[tuple[dict[str, JsonValue], int]],
        retry_at: Sequence[int | None] | None = None,
        ahead: Sequence[bool] | None = None,
        steps: int | None = None,
    ) -> list[Measurement | None | Exception]:
        candidates = [Candidate(batch_size=max(1, b), choices=c) for c, b in runs]
        steps = self._prober.steps if steps is None else max(2, steps)
        return self._prober.run_many(candidates, steps, self._name, retry_at, ahead=ahead)

    @property
    def concurrent_runs(self) -> int:
        return self._prober.device.capabilities.concurrent_runs

    def score(self, choices: dict[str, JsonValue]) -> Estimated | None:
        return self._prober.space.score_choices(choices)

    def held_bytes(self, measured: Measurement) -> int:
        return self._prober.held(measured)

    def below_failure(self, choices: dict[str, JsonValue], failed: int) -> int:
        return self._prober.below(choices, failed)

    @property
    def limit_bytes(self) -> int:
        return int(self._prober.pick_limit_bytes({}, 0))

    def _larger(
        self, candidate: Candidate, spare: int, ref: AnyConfirmed, search: BatchSearch
    ) -> tuple[Candidate, Measurement] | None:
        """The batch at which ``candidate``'s choices would allocate what ``ref`` did, if it
        fits within that: ``spare`` bytes along the pick's measured bytes per sample. The run
        goes into ``search``'s record (a failure as its lowest)."""
        slope = self._prober.sample_bytes(ref.candidate.choices, ref.candidate.batch_size)
        if slope <= 0:
            return None
        batch = candidate.batch_size + int(spare // slope)
        if batch <= candidate.batch_size or batch > self.config.max_batch:
            return None
        larger = Candidate(batch_size=batch, choices=candidate.choices)
        m = self._prober.run(larger, self._prober.steps, self._name)
        search.tried.append((batch, m is not None))
        if m is None:
            search.lowest_failure = batch
            return None
        if m.peak_bytes > ref.measured.peak_bytes:
            return None
        return larger, m

    @property
    def probes(self) -> Sequence[Probe]:
        return tuple(self._prober.probes)

    def describe(self, text: str) -> None:
        """The stage's progress line, and the words its device runs say their batch after
        (only inside :meth:`progress`: no other stage's runs inherit them). Inside
        :meth:`side_by_side`, the thread that entered it says only its own part of the line
        (the device's runs keep their own words)."""
        if self._bar is None:
            return
        two = self._two
        if two is not None and threading.get_ident() == two.here_thread:
            two.here(text)
            return
        self._prober.doing = text
        (two or self._bar).describe(text)

    @contextlib.contextmanager
    def progress(self) -> Iterator[None]:
        with self._ui.stage(self._name, total=None) as bar:
            self._bar = self._prober.bar = bar
            try:
                yield
            finally:
                self._bar, self._prober.doing = None, ""

    @contextlib.contextmanager
    def side_by_side(self) -> Iterator[None]:
        """See :meth:`PickStage.side_by_side`. Why: on a card the compile trial ran in this
        process beside pass 1's runs and its line ("compiling default mode ... in this
        process") stood alone for 200 s of swin_t's plan, the runs it waited beside unsaid
        (session 19)."""
        bar = self._bar
        if bar is None or self._two is not None:
            yield
            return
        two = _TwoLines(bar, threading.get_ident())
        self._two, self._prober.bar = two, two
        try:
            yield
        finally:
            self._two, self._prober.bar = None, bar
            if two.device_text:
                bar.describe(two.device_text)

    def compiling_here(self) -> contextlib.AbstractContextManager[None]:
        """See :meth:`PickStage.compiling_here`: the device's :meth:`Device.host_busy`. Why:
        the trial compiling here takes the host's cores from the runs' timed steps, as a
        sibling's compile did before the turn kept them apart (docs/design.md, session 13)."""
        return self._prober.device.host_busy()


class _TwoLines:
    """A stage's progress line in two parts (:meth:`ProberStage.side_by_side`): what this
    process does, then what the device runs; each part keeps its last words until the other
    changes. Stands for the bar on the prober's side (its runs' "batch N running")."""

    def __init__(self, bar: Stage, here_thread: int) -> None:
        self.bar, self.here_thread = bar, here_thread
        self.here_text = self.device_text = ""
        self._lock = threading.Lock()

    def here(self, text: str) -> None:
        with self._lock:
            self.here_text = text
            self._show()

    def describe(self, text: str) -> None:
        with self._lock:
            self.device_text = text
            self._show()

    def _show(self) -> None:
        parts = [p for p in (self.here_text, self.device_text) if p]
        self.bar.describe("; beside it, ".join(parts))

    def __getattr__(self, name: str) -> object:  # the bar's other calls (advance, ...)
        return getattr(self.bar, name)


def refined_pick(
    prober: Prober, eager: Confirmed, strategies: Sequence[Strategy], ui: Progress
) -> tuple[Confirmed, list[StageOutcome], list[str]]:
    """The pick to verify after every measured-only strategy's stage, what each found, and
    their notes; each stage starts from the pick the previous one returned."""
    pick, outcomes, notes = eager, [], []
    for strategy in strategies:
        if not isinstance(strategy, Measured):
            continue
        started = time.perf_counter()
        result = strategy.refine(ProberStage(prober, strategy.name, ui, pick), pick)
        if result is None:
            continue
        notes += result.notes
        if result.outcome is not None:
            wall_ms = (time.perf_counter() - started) * 1e3
            outcomes.append(result.outcome.model_copy(update={"wall_ms": wall_ms}))
        if not isinstance(result.pick, Confirmed):
            raise PlanningError(
                f"Strategy {strategy.name!r} returned a pick its stage did not confirm; "
                "refine() must return the eager pick or one that stage.confirm() gave."
            )
        pick = result.pick
    return pick, outcomes, notes
