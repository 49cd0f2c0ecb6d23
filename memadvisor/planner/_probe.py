"""Find the largest batch that really fits: few probes, bracketed by the estimate.

Each probe is one :meth:`Device.run` from a clean state for more than one step; this
module decides nothing about memory, the device's :meth:`Device.is_oom` does. The search:

1. Probe ``start``, the estimate's largest batch under the usable budget (budget less margin).
2. If it fits, probe once above it: where the caller can extrapolate from ``start``'s
   measured peak (the planner: the estimate's bytes per sample from there up to the usable
   budget), at that batch; otherwise at ``upper``, the estimate's largest batch under the
   *whole* budget. If it fits with its measured peak inside the usable budget, take it.
   Otherwise take ``start``, kept the margin below the failure if that failed. Where the
   extrapolation says ``start`` already fills the budget, nothing more is probed.
3. If ``start`` fails, the estimate was optimistic. Probe the highest batch that could still
   be picked, the margin below the failure; a fit ends the search. After a third failure
   the estimate is far off: halve until something fits, then bisect.

Near the limit fitting is deterministic but not monotone (``docs/design.md``, "Fitting near
the limit"), so a fit above a failure proves nothing about the
batches around it. The pick therefore stays the margin below the *lowest* failure seen,
never on a lucky island above it. An estimate within the margin of the truth costs two
probes, within two margins three.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from memadvisor.device import Device
from memadvisor.errors import PlanningError, retry_ran_out
from memadvisor.schema.candidate import RETRY_RAN_OUT_HERE, Candidate, Measurement
from memadvisor.schema.plan import Probe
from memadvisor.workload import Workload

__all__ = [
    "BatchSearch",
    "find_batch",
    "next_descent_probe",
    "probe",
    "probe_many",
    "ran_out_record",
    "safe_below",
]

TryBatch = Callable[[int], bool]
Extrapolate = Callable[[int], "int | None"]
NextIfOut = Callable[[int, "int | None"], None]
# Steps of one margin down before halving: an estimate up to ~2 margins optimistic (its
# stated worst case is 10%) then costs 3 probes; one further off is found by bisection.
_MARGIN_DESCENTS = 2


def safe_below(failing_batch: int, margin_fraction: float) -> int:
    """The largest batch the plan may take when ``failing_batch`` ran out of memory.

    ``margin_fraction`` below it, and at least one below: ``safe_below(100, 0.08) == 92``,
    ``safe_below(2, 0.08) == 1``, ``safe_below(1, 0.08) == 0`` (nothing fits).
    """
    return max(0, min(failing_batch - 1, int(failing_batch * (1.0 - margin_fraction))))


def next_descent_probe(
    lo: int,
    hi: int,
    failures_before_a_fit: int,
    cap: Callable[[int], int],
    margin_fraction: float,
    within: float = 0.0,
    straight_to_target: bool = False,
) -> int | None:
    """The batch :func:`find_batch`'s descent probes next; None where it stops there.

    ``hi`` is the lowest failure (or the edge a fit outside the margin stood for), ``lo``
    the largest fit below it (the floor, or 0: none), ``failures_before_a_fit`` the failures
    while ``lo`` was 0, ``cap`` the ``below`` callback, ``straight_to_target`` the first step
    after the upward probes met the edge with ``descend``. Before a fit: the margin below
    the failure for the first :data:`_MARGIN_DESCENTS` failures, then halving; after one,
    bisection; never above ``cap(hi)``.
    """
    target = cap(hi)
    if lo >= target:
        return None
    if lo > 0 and target - lo <= within * lo:
        return None  # close enough: the largest fit stands
    if straight_to_target:
        b = target
    elif lo == 0 and failures_before_a_fit <= _MARGIN_DESCENTS:
        # The estimate was a little optimistic: the margin below the failure.
        b = min(target, max(1, safe_below(hi, margin_fraction)))
    elif lo == 0:
        b = min(max(1, hi // 2), target)  # far off: halve
    else:
        b = min((lo + hi) // 2, target)
    return b if b > lo else None


@dataclass
class BatchSearch:
    """What probing found: the pick and the evidence for it."""

    batch: int = 0
    largest_fit: int = 0
    lowest_failure: int | None = None
    tried: list[tuple[int, bool]] = field(default_factory=list)

    @property
    def probe_count(self) -> int:
        return len(self.tried)


def find_batch(
    fits: TryBatch,
    start: int,
    upper: int,
    margin_fraction: float,
    max_batch: int,
    within_margin: TryBatch | None = None,
    extrapolate: Extrapolate | None = None,
    below: Callable[[int], int] | None = None,
    max_extrapolations: int = 1,
    descend: bool = False,
    floor: int = 0,
    within: float = 0.0,
    ceiling: int | None = None,
    next_if_out: NextIfOut | None = None,
) -> BatchSearch:
    """The largest batch to train with, by probing ``fits(b)`` as few times as it can.

    Args:
        fits: runs batch ``b`` on the device from a clean state; True when it fits.
        start: the estimate's largest batch under the usable budget.
        upper: the estimate's largest batch under the whole budget (the bracket's top).
        margin_fraction: how far below the lowest failure the pick stays.
        max_batch: no batch above this is tried.
        within_margin: for a batch that fitted, whether its *measured* peak stayed within
            the usable budget. ``upper`` fitting only proves the device holds it at the
            edge of the budget; it is taken over ``start`` only when its peak also left the
            margin free (the estimate was pessimistic). None takes it whenever it fits.
        extrapolate: for ``start`` once it fitted, the largest batch its measured peak says
            fits the usable budget; None (or a None answer) probes ``upper`` instead.
        below: the largest batch the pick may take below a batch that ran out; default
            ``safe_below(b, margin_fraction)``. The planner's measured margin passes what its
            runs measured (a headroom in samples); the descent before anything fitted still
            steps a ``margin_fraction`` at a time.
        max_extrapolations: how many times to extrapolate from the latest fit that stayed
            within the margin (the first may probe ``upper`` when there is no guess).
        descend: after the upward probes met the edge (a failure, or a fit outside the
            margin, taken as an edge one sample above it), probe the highest batch ``below``
            allows, then bisect, instead of keeping the last fit inside the margin. The
            planner's measured margin aims its extrapolation at the edge itself and sets this.
        floor: a batch known to fit (an earlier run of the same choices, within the limit
            and below every failure): the descent after a failure bisects down to it and
            never below it, where it would otherwise halve from nothing (a compiled
            confirmation ran 167 after 335 failed, below a 302 that had fitted; gpt on a
            card). 0: nothing known.
        within: stop bisecting once the batch the pick may take is at most this fraction
            (of the largest fit) above that fit: a bench's search for the largest batch
            that holds needs no run to gain the last percent (each run of a compiled hand
            cell compiles afresh). A ``start`` within it above ``floor`` starts at
            ``floor`` (within the limit: the pick if nothing above it fits). 0, the
            planner's: bisect to the sample.
        ceiling: no upward probe above this batch (None: none): where a bound the search
            trusts more than the extrapolation says the edge is (a compiled line capped by
            its largest allocation: gpt's confirmation on a card ran 317, 306 and 279 above
            such a cap at 252, all out of memory). An upward probe within ``within`` of the
            largest fit is not made where that fit is within the margin (``within_margin``).
            Without a ceiling the extrapolation aims at the edge, the margin below it taken
            after, so a guess near the fit says nothing of the pick: it is probed.
        next_if_out: called before each probe with its batch and the batch the search
            probes next should that one run out (None: the search would stop there), so that
            a caller that can make two runs at once makes both (``Prober.largest``).

    Returns:
        The search; ``batch == 0`` when not even batch 1 fits.

    Raises:
        ValueError: ``max_batch`` is not positive.
    """
    if max_batch < 1:
        raise ValueError(f"max_batch must be positive, but got {max_batch=}.")
    search = BatchSearch()

    def run(b: int, if_out: tuple[int, int, bool] | None) -> bool:
        """Probe ``b``; ``if_out``: the descent's (lo, failures before a fit, straight to
        the target) should ``b`` run out, None where there would be no descent."""
        if next_if_out is not None:
            after = None
            if if_out is not None:
                lo_out, failures_out, straight_out = if_out
                after = next_descent_probe(
                    lo_out, b, failures_out, cap, margin_fraction, within, straight_out
                )
            next_if_out(b, after)
        ok = fits(b)
        search.tried.append((b, ok))
        if ok:
            search.largest_fit = max(search.largest_fit, b)
        else:
            search.lowest_failure = (
                b if search.lowest_failure is None else min(search.lowest_failure, b)
            )
        return ok

    cap = below if below is not None else (lambda b: safe_below(b, margin_fraction))
    start = min(max(start, 1), max_batch)
    upper = min(max(upper, start + 1), max_batch)
    lo, hi = 0, None  # the largest fit below every failure, the lowest failure
    floor = min(max(floor, 0), max_batch)
    if floor > 0 and (start <= floor or start - floor <= within * floor):
        # Nothing below a known fit is worth a run, nor a start ``within`` above it: the
        # fit answers without one (a compiled confirmation ran 1905 from its line where 1895
        # had fitted, a cold compile for half a percent: hf_gpt2 on a card, session 19).
        start = floor
    if run(start, (floor if floor < start else 0, 1, False)):
        lo = start
        for attempt in range(max(1, max_extrapolations)):
            guess = extrapolate(lo) if extrapolate is not None else None
            if guess is None and attempt > 0:
                break  # only the first step may fall back to the bracket's top
            top = upper if guess is None else min(guess, max_batch)
            if ceiling is not None:
                top = min(top, ceiling)
                if top - lo <= within * lo and (within_margin is None or within_margin(lo)):
                    break  # the ceiling is close enough: the largest fit stands
            if top <= lo:
                break
            if not run(top, (lo, 1, True) if descend else None):
                hi = top
                break
            if within_margin is not None and not within_margin(top):
                if descend:
                    hi = top + 1  # it fitted at the edge: the pick stays below it
                break
            lo = top
        # Only ``descend`` steps down from a fit (else ``start`` stays): a measured slope
        # puts the edge close, so the highest pickable batch usually fits; then bisect.
        stepping_down = straight_to_target = descend and hi is not None
    else:
        hi = start
        lo = floor if floor < start else 0
        stepping_down, straight_to_target = True, False
    failures_before_a_fit = 1
    while stepping_down and hi is not None:
        b = next_descent_probe(
            lo, hi, failures_before_a_fit, cap, margin_fraction, within, straight_to_target
        )
        if b is None:
            break
        straight_to_target = False
        if run(b, (lo, failures_before_a_fit + (1 if lo == 0 else 0), False)):
            lo = b
        else:
            hi = b
            if lo == 0:
                failures_before_a_fit += 1
    search.batch = lo if hi is None else min(lo, cap(hi))
    return search


def probe(
    device: Device, workload: Workload, candidate: Candidate, steps: int, *, stage: str = "probe"
) -> tuple[Probe, Measurement | None]:
    """Run ``candidate`` on ``device`` for ``steps`` steps; an out-of-memory is an answer.

    Returns:
        The probe record, and the measurement when it fit.

    Raises:
        Exception: anything ``device.is_oom`` does not call an out-of-memory,
            re-raised unchanged.
    """
    t0 = time.perf_counter()
    failure: tuple[str, int] | None = None
    try:
        measured = device.run(workload, candidate, steps)
    except Exception as e:
        if not device.is_oom(e):
            raise
        failure = _failure(e)
    if failure is not None:
        # Out of the except block the exception and its traceback are gone: the failed
        # step's frames and tensors can be freed now, before the next probe's clean start.
        gc.collect()
        return _ran_out(candidate, failure, t0, stage), None
    return _fitted(candidate, measured, t0, stage), measured


def probe_many(
    device: Device,
    workload: Workload,
    candidates: Sequence[Candidate],
    steps: int,
    *,
    stage: str = "probe",
    retry_at: Sequence[int | None] | None = None,
    ran_out_too: dict[int, tuple[int, bool]] | None = None,
) -> list[tuple[Probe | None, Measurement | None, Exception | None]]:
    """Run ``candidates`` for ``steps`` steps each through ``device.run_many`` (at once where
    the device can); per candidate, in order: its probe record and its measurement (None
    when it ran out) and None, or (None, None, the error) for a run that failed otherwise,
    which no record counts. Each record's wall time is the whole group's.

    ``retry_at``: per candidate, a smaller batch to measure where it runs out
    (``device.run_many_retrying``); such a run's record is the retry's (its batch), its
    measurement's ``ran_out_first`` says what ran out (the caller records that). Where the
    retry ran out too, the record is the first batch's, and ``ran_out_too`` (when given)
    gets the candidate's index, the retry's batch and whether it ran in the first's
    process (the caller records that).

    Raises:
        PlanningError: the device answered a different number of runs than it was given.
    """
    t0 = time.perf_counter()
    if retry_at is not None and any(r is not None for r in retry_at):
        runs = [(c, steps, r) for c, r in zip(candidates, retry_at, strict=True)]
        answers = device.run_many_retrying(workload, runs)
    else:
        answers = device.run_many(workload, [(c, steps) for c in candidates])
    if len(answers) != len(candidates):
        raise PlanningError(
            f"{type(device).__name__}.run_many answered {len(answers)} runs for "
            f"{len(candidates)}: a device must answer every run, in order."
        )
    out: list[tuple[Probe | None, Measurement | None, Exception | None]] = []
    ran_out = False
    for i, candidate in enumerate(candidates):
        answer = answers[i]
        if not isinstance(answer, Exception):
            if answer.ran_out_first is not None and retry_at is not None and retry_at[i]:
                candidate = _at(candidate, retry_at[i])
            out.append((_fitted(candidate, answer, t0, stage), answer, None))
        elif device.is_oom(answer):
            out.append((_ran_out(candidate, _failure(answer), t0, stage), None, None))
            retried = retry_ran_out(answer)
            asked = retry_at[i] if retry_at is not None else None
            if ran_out_too is not None and retried is not None and retried[0] == asked:
                ran_out_too[i] = retried
            answers[i] = None  # type: ignore[call-overload]  # its traceback goes (below)
            ran_out = True
        else:
            out.append((None, None, answer))
    if ran_out:
        del answer
        gc.collect()  # as probe: the failed steps' frames and tensors, before the next start
    return out


def _failure(error: BaseException) -> tuple[str, int]:
    """An out-of-memory's first line and the steps its run finished."""
    text = str(error).strip()
    message = text.splitlines()[0] if text else type(error).__name__
    return message, int(getattr(error, "memadvisor_steps_completed", 0))


def ran_out_record(candidate: Candidate, measured: Measurement, stage: str) -> Probe | None:
    """The record of the batch that ran out before ``measured``'s retry in the same process
    (``measured.ran_out_first``), ``candidate``'s choices at that batch; None where none did."""
    first = measured.ran_out_first
    if first is None:
        return None
    at = _at(candidate, first.batch_size)
    return Probe(
        batch_size=first.batch_size,
        fits=False,
        steps=first.steps,
        error=first.message,
        stage=stage,
        candidate=at,
    )


def retry_ran_out_record(candidate: Candidate, batch: int, same_process: bool, stage: str) -> Probe:
    """The record of ``candidate``'s retry at ``batch``, which ran out after the candidate's
    own batch had (``probe_many``'s ``ran_out_too``): in that run's process
    (``same_process``; the record begins with :data:`RETRY_RAN_OUT_HERE`) or as a run of its
    own."""
    where = (
        f"{RETRY_RAN_OUT_HERE} batch {candidate.batch_size} had run out"
        if same_process
        else f"ran out too, retried as a run of its own after batch {candidate.batch_size}"
    )
    return Probe(
        batch_size=batch,
        fits=False,
        steps=0,
        error=where,
        stage=stage,
        candidate=_at(candidate, batch),
    )


def _at(candidate: Candidate, batch: int) -> Candidate:
    """``candidate`` at another batch (its choices and accumulation kept)."""
    return Candidate(
        batch_size=batch, accumulation_steps=candidate.accumulation_steps, choices=candidate.choices
    )


def _ran_out(candidate: Candidate, failure: tuple[str, int], t0: float, stage: str) -> Probe:
    return Probe(
        batch_size=candidate.batch_size,
        fits=False,
        steps=failure[1],
        error=failure[0][:500],
        wall_ms=(time.perf_counter() - t0) * 1e3,
        stage=stage,
        candidate=candidate,
    )


def _fitted(candidate: Candidate, measured: Measurement, t0: float, stage: str) -> Probe:
    return Probe(
        batch_size=candidate.batch_size,
        fits=True,
        steps=measured.steps,
        peak_bytes=measured.peak_bytes,
        step_ms=measured.step_ms,
        reserved_peak_bytes=measured.reserved_peak_bytes,
        host_ms=measured.host_ms,
        wall_ms=(time.perf_counter() - t0) * 1e3,
        stage=stage,
        candidate=candidate,
    )
