"""Re-ranking on the device: the estimate's best few, each timed once, the best searched on.

The estimate's best ``rerank_top`` candidates (those within :data:`RERANK_FLOOR` of the
best) and, where measured times rank, each choice of a *guarded* strategy with everything
else plain (Baseline and +AMP: ``TimedEachChoice``), run once at the estimate's largest
batch under the usable budget. Where the device's times do not rank (the simulated CPU
device), they run in the estimate's order only until one fits: the estimate ranks there.
That run is both the candidate's fit probe and its timing.
The device's best alone then finishes its batch search (``Prober.confirm``).

Known limitations:
    * A candidate that ran out at its estimated batch gets one retry the margin below, and
      none when a candidate of the same guarded choices (the same precision) ran out twice:
      the estimate is taken to be as far off for the rest of that group. Only the estimate's
      best of such a group gets its batch search continued (when it could still beat the
      winner at half the batch it ran out at: ``_rescued``); the group's other candidates
      are not run. On a device that retries in a run's own process (a card's fork server)
      every candidate's retry goes with its first run (``_first_runs_at_once``), so that
      rule saves no runs there; a retry after a failed step starts on its child's split
      allocator and can run out where a fresh process would fit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from pydantic import JsonValue

from memadvisor.estimate import estimate
from memadvisor.planner._budget import infeasible
from memadvisor.planner._compare import unchecked_hand_choices
from memadvisor.planner._probe import safe_below
from memadvisor.planner._prober import Confirmed, Prober, Tie, timing_steps_at_once
from memadvisor.planner._progress import Progress
from memadvisor.planner._space import Scored, SearchSpace
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.strategy import TimedAlternatives, TimedEachChoice

__all__ = [
    "RERANK_FLOOR",
    "TIE_FRACTION",
    "best_of_each_alternative",
    "best_on_device",
    "timed_candidates",
]

# Of the estimate's best rerank_top, those under this share of the best's estimated samples/s
# (batch, for largest_batch) are not timed: the estimate's time errors seen on a card
# (within ~1.6x per candidate, mostly shared by candidates of one precision) leave them behind.
RERANK_FLOOR = 0.7
# Candidates whose throughput lies within this share of the best's are a tie, broken by a
# fixed rule (fewest strategies). Two measurements of one configuration differ by up to
# 2-3% (bench/planner.py's tolerance; MIN_SPEEDUP's reasoning for compile), and the
# estimate's CPU-profiled times jitter as much between profiles of one model.
TIE_FRACTION = 0.03


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
        chosen += best_of_each_alternative(space, ranked)
    out: dict[str, Scored] = {}
    for s in chosen:
        out.setdefault(s.choices_json, s)
    return sorted(out.values(), key=space.key)


def best_of_each_alternative(space: SearchSpace, ranked: Sequence[Scored]) -> list[Scored]:
    """For each strategy whose choices only the device tells apart
    (``TimedAlternatives``), the estimate's best candidate of each of its
    choices: the best ranked one with it, else the overall best with that choice swapped in
    (None when it does not fit even batch 1)."""
    out: list[Scored] = []
    for strategy in space.strategies:
        options = space.options.get(strategy.name, [])
        if not isinstance(strategy, TimedAlternatives) or len(options) < 2:
            continue
        for option in options:
            best = next(
                (s for s in ranked if s.candidate.choices.get(strategy.name) == option), None
            )
            if best is None:
                best = space.score_choices({**ranked[0].candidate.choices, strategy.name: option})
            if best is not None:
                out.append(best)
    return out


def best_on_device(
    prober: Prober, timed: Sequence[Scored], notes: list[str], ui: Progress
) -> Confirmed:
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
    measured_times = device.capabilities.step_times_rank
    kind = device.capabilities.kind  # for display only
    with ui.stage("probes", total=None) as bar:
        prober.bar = bar
        first = _first_runs(prober, timed, measured_times)
        best = _device_best(prober, timed, first, measured_times)
        twice_out: set[str] = set()  # groups whose retry ran out too
        rescue: list[tuple[Scored, int]] = []  # each such group's first: (it, its retry)
        for s in timed:  # the estimate's order
            if first.get(s.choices_json, "not run") is not None:
                continue  # it fitted, or was not run (the estimate ranks it below one that fitted)
            group = _guarded_key(space, s)
            below = _retry_at(prober, _start(prober, s))
            # Where the first runs carried their retries (_first_runs_at_once), a candidate
            # still None here ran out at both batches: _timing reads the record, no run.
            if below is None or group in twice_out:
                continue  # the estimate is as far off for this group's other candidates
            if best is not None and not _could_beat(space, s, below, best):
                continue
            # Every group gets its retry, even when another's failed twice: the estimate can
            # be optimistic for one precision (a card's fragmentation around fp32's large
            # logits) and right for another.
            first[s.choices_json] = _timing(prober, s, below)
            if first[s.choices_json] is None:
                twice_out.add(group)
                rescue.append((s, below))
            best = _device_best(prober, timed, first, measured_times)
        winner = None
        if best is not None:
            winner = prober.confirm(best[0], stage="probe")
            winner = _rescued(prober, rescue, winner, notes)
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
    if measured_times:
        notes += alternatives_notes(space, timed, first)
    fitted = sum(m is not None for m in first.values())
    if not measured_times and fitted > 1:
        notes.append(
            f"The {fitted} best candidates were re-ranked at the batches the "
            f"{kind} device confirmed, by the estimate's step time: this device's own "
            "times do not rank (CPU times, slowed by tracking)."
        )
    skipped = len(timed) - len(first)
    if not measured_times and skipped > 0:
        notes.append(
            f"Ranked by the estimate's step time: the {kind} device's own times do not "
            "rank (CPU times, slowed by tracking), so it confirmed the batch of the estimate's "
            f"best candidate that fitted and did not run {skipped} ranked below it."
        )
    return winner


def _rescued(
    prober: Prober, rescue: Sequence[tuple[Scored, int]], winner: Confirmed | None, notes: list[str]
) -> Confirmed | None:
    """The winner, or a candidate of a group whose estimate was far off, searched down.

    A group (one precision) that ran out at its estimated batch and again the margin below
    is not retried at its other candidates: its estimate is as far off for them. But where
    the best that fitted is far behind (a bare configuration at batch 1, beside checkpointed
    ones that ran out at 17), keeping it costs more than the group's error: the estimate's
    best of that group continues its batch search (``Prober.confirm``, from the runs it
    already has), when at half the batch it last ran out at it would still beat the winner
    by the estimate. At most one such search. The faster confirmed is kept (for
    ``largest_batch``, the larger batch); within :data:`TIE_FRACTION`, the winner.
    """
    if winner is None:
        return winner
    space = prober.space
    ran = (winner.scored, _Timing(winner.candidate, winner.measured))
    for scored, failed in rescue:
        half = max(failed // 2, 1)
        if half >= failed or not _could_beat(space, scored, half, ran):
            continue
        other = prober.confirm(scored, stage="probe")
        if other is None:
            return winner
        if space.config.objective == "largest_batch":
            better = other.candidate.batch_size > winner.candidate.batch_size
        else:
            floor = (1.0 + TIE_FRACTION) * winner.measured.samples_per_s
            better = other.measured.samples_per_s > floor
        kept, dropped = (other, winner) if better else (winner, other)
        notes.append(
            f"Batch {failed} of the estimate's best {_group_words(space, scored)} "
            f"configuration ran out after its estimated batch did (the estimate was "
            f"optimistic there), leaving a pick of {winner.measured.samples_per_s:.4g} "
            f"samples/s at batch {winner.candidate.batch_size}; its batch search went on "
            f"down: {other.measured.samples_per_s:.4g} samples/s at batch "
            f"{other.candidate.batch_size}, so the pick is "
            f"{'that' if better else 'unchanged'} ({dropped.measured.samples_per_s:.4g} "
            "samples/s for the other)."
        )
        return kept
    return winner


def _group_words(space: SearchSpace, scored: Scored) -> str:
    """The guarded choices of ``scored`` in words ("bf16"), for a note."""
    guarded = {s.name for s in space.strategies if isinstance(s, TimedEachChoice)}
    words = [str(scored.candidate.choices.get(n)) for n in sorted(guarded)]
    return "/".join(w for w in words if w != "None") or "plain"


def alternatives_notes(
    space: SearchSpace, timed: Sequence[Scored], first: dict[str, _Timing | None]
) -> list[str]:
    """For each ``TimedAlternatives`` strategy, what the device measured of each of its
    choices (the best timing run with it), in the strategy's words: the report shows them
    side by side, as the pick was made from them."""
    notes = []
    for strategy in space.strategies:
        if not isinstance(strategy, TimedAlternatives):
            continue
        seen: dict[str, tuple[str, _Timing | None]] = {}
        for s in timed:
            choice = s.candidate.choices.get(strategy.name)
            advice = strategy.explain(choice, space.profile)
            if advice is None:
                continue
            timing = first.get(s.choices_json)
            kept = seen.get(advice.title)
            rate = timing.measured.samples_per_s if timing is not None else -1.0
            if kept is None or (kept[1].measured.samples_per_s if kept[1] else -1.0) < rate:
                seen[advice.title] = (advice.title, timing)
        if len(seen) < 2:
            continue
        parts = [
            f"{title}: {timing.measured.samples_per_s:.4g} samples/s at batch "
            f"{timing.candidate.batch_size} ({timing.measured.step_ms:.4g} ms a step)"
            if timing is not None
            else f"{title}: ran out at its estimated batch"
            for title, timing in seen.values()
        ]
        notes.append(
            f"Measured against each other ({strategy.name}: the estimate does not price "
            "their communication): " + "; ".join(parts) + ". The fastest that fitted decided."
        )
    return notes


def _first_runs(
    prober: Prober, timed: Sequence[Scored], measured_times: bool
) -> dict[str, _Timing | None]:
    """Each candidate's run at its estimated largest batch: every one where the device's
    times rank; else in the estimate's order until one fits.

    Where times do not rank, the first that fits at its estimated batch is the estimate's
    best there: a candidate after it is ranked below it at its own estimated batch, which
    its device run could only confirm or lower. Running it would cost steps of the largest
    batch and change nothing, unless it could tie the one that fitted (within
    :data:`TIE_FRACTION`, by the estimate) with fewer strategies turned on, which the tie
    rule would take: those still run. The others read as not run (the retry in
    :func:`best_on_device` skips them).
    """
    if measured_times and prober.device.capabilities.concurrent_runs > 1:
        return _first_runs_at_once(prober, timed)
    first: dict[str, _Timing | None] = {}
    fitted: Scored | None = None
    for s in timed:
        if fitted is not None and not _could_tie(prober.space, s, fitted):
            continue
        first[s.choices_json] = _timing(prober, s, _start(prober, s))
        if not measured_times and fitted is None and first[s.choices_json] is not None:
            fitted = s
    return first


def _first_runs_at_once(prober: Prober, timed: Sequence[Scored]) -> dict[str, _Timing | None]:
    """:func:`_first_runs` where times rank and the device makes runs at once: every
    candidate runs, each independent of the others, so all are asked together
    (``Prober.run_many``; the device makes as many at once as it holds, their timed steps
    in turn after every sibling's first step). The same runs as one at a time.

    Why: the first runs are most of the probes' seconds on a card: lm350m's four took 8.4 s
    one after another, the GPT example's six 24 s (H100, docs/design.md).

    On a device that retries a run in its own process (``retries_in_process``: a card's fork
    server), each run carries its retry the margin below (:func:`_retry_at`, the batch
    :func:`best_on_device` would retry it at): a candidate that runs out at its estimated
    batch is measured there in the same child, within this group, and is that batch's
    timing. Why: on an H200 (session 40) the Llama example's two checkpointed candidates ran
    out at 2745 and 2769 and were retried one after another in processes of their own, 4.0 s
    each, after a group of six that took 5.6 s. Where the retry ran out too, both batches are
    recorded as run out, and :func:`best_on_device` reads them so, as before.

    Raises:
        Exception: a run's error other than running out of memory, as :func:`_timing`.
    """
    runs = [
        (s, Candidate(batch_size=_start(prober, s), choices=s.candidate.choices)) for s in timed
    ]
    steps = timing_steps_at_once(prober.device, prober.config)
    retry_at = None
    if prober.device.capabilities.retries_in_process:
        retry_at = [_retry_at(prober, c.batch_size) for _, c in runs]
    answers = prober.run_many([c for _, c in runs], steps, "timing", retry_at=retry_at)
    first: dict[str, _Timing | None] = {}
    for i, ((s, candidate), answer) in enumerate(zip(runs, answers, strict=True)):
        if isinstance(answer, Exception):
            raise answer
        if answer is not None and answer.ran_out_first is not None and retry_at is not None:
            candidate = Candidate(batch_size=retry_at[i], choices=candidate.choices)
        first[s.choices_json] = _Timing(candidate, answer) if answer is not None else None
    return first


def _retry_at(prober: Prober, batch: int) -> int | None:
    """The batch a timing run that ran out at ``batch`` is retried at, by the first runs
    and by :func:`best_on_device` alike: the margin below
    (:func:`~memadvisor.planner._probe.safe_below`, always below ``batch``), None where that
    is no batch."""
    below = safe_below(batch, prober.space.config.margin_fraction)
    return below if below > 0 else None


def _could_tie(space: SearchSpace, scored: Scored, fitted: Scored) -> bool:
    """Whether ``scored`` could take the tie rule from ``fitted``: fewer strategies, and an
    estimated rate within the tie (batch, for largest_batch) of the one that fitted."""
    if scored.active >= fitted.active:
        return False
    if space.config.objective == "largest_batch":
        return scored.candidate.batch_size >= fitted.candidate.batch_size
    floor = (1.0 - TIE_FRACTION) * fitted.estimate.samples_per_s
    return scored.estimate.samples_per_s >= floor


@dataclass
class _Timing:
    """A candidate's first fitting run: the batch it ran and what it measured."""

    candidate: Candidate
    measured: Measurement


def _start(prober: Prober, scored: Scored) -> int:
    """The estimate's largest batch under the usable budget: where a candidate is timed."""
    return min(max(scored.largest_batch, 1), prober.config.max_batch)


def _timing(prober: Prober, scored: Scored, batch: int) -> _Timing | None:
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


def _device_best(
    prober: Prober,
    timed: Sequence[Scored],
    first: dict[str, _Timing | None],
    measured_times: bool,
) -> tuple[Scored, _Timing] | None:
    """The best of the candidates that fitted, by the objective on the device's answer.

    Rates within :data:`TIE_FRACTION` of the best (at the best's batch, for largest_batch)
    are a tie, which a fixed rule breaks: fewest strategies turned on, then the choices'
    JSON. Timings jitter from run to run; without the rule the same inputs could give
    another pick each time. :attr:`Prober.tie` keeps the last tie for the plan's notes.
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
    prober.tie = Tie(scored, rate, others) if others else None
    return scored, timing


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


def _guarded_key(space: SearchSpace, scored: Scored) -> str:
    """The choices of the guarded strategies (precision): candidates that share them share
    the estimate's errors."""
    guarded = {s.name for s in space.strategies if isinstance(s, TimedEachChoice)}
    choices = scored.candidate.choices
    return json.dumps({n: choices.get(n) for n in sorted(guarded)}, sort_keys=True)
