"""The plan's notes in words: where it was planned, what found the pick's batch, and how.

What a person should know that the numbers do not say; each sentence is made here once.
"""

from __future__ import annotations

from collections.abc import Sequence

from memadvisor.errors import ran_out_by_retries
from memadvisor.planner._prober import HEADROOM_FRACTION, Confirmed, Tie, describe_choices
from memadvisor.planner._rerank import TIE_FRACTION
from memadvisor.schema.advice import Check
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.plan import Probe

__all__ = [
    "SIMULATED_NOTE",
    "fallbacks_first",
    "pick_notes",
    "runs_note",
    "screen_notes",
    "tie_note",
]

SIMULATED_NOTE = (
    "This plan is for the simulated CPU device{why}. It enforces the budget on the tracked "
    "bytes of real CPU tensors; times are CPU times."
)


def pick_notes(config: PlanConfig, pick: Candidate, best: Confirmed) -> list[str]:
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
    limit = (
        f"the budget less the {HEADROOM_FRACTION:.0%} headroom"
        if config.measured_margin
        else "usable budget (budget less margin)"
    )
    if found.lowest_failure is None and found.probe_count > 1:
        kept = (
            f" and kept {best.found_batch}: the higher one's measured peak passed {limit}."
            if best.found_batch < found.largest_fit
            else " (its measured peak left the margin free)."
        )
        notes.append(
            f"The device held batch {found.largest_fit}, as far as the first run's measured "
            f"peak said would fit; the plan did not probe higher{kept}"
        )
    return notes


def runs_note(
    runs: Sequence[Probe],
    best: Confirmed,
    verified: Measurement,
    config: PlanConfig,
    steady_memory: bool = False,
) -> str:
    """The batch search of the pick's choices in runs, and what verified the pick.

    The report tallies every run by stage (``report._facts.device_runs``); this says what
    that tally cannot: how many runs found the pick's batch, and which run verified it.
    """
    search = best.search.probe_count
    retried = _ran_out_by_retries(runs, best)
    tried = ", ".join(
        f"{b} {'fits' if ok else 'retries' if b in retried else 'OOM'}"
        for b, ok in best.search.tried
    )
    text = f"The pick's batch took {search} device run{'s' if search != 1 else ''} ({tried})"
    if retried:
        text += (
            "; 'retries': it fitted only by the CUDA caching allocator freeing its cache and "
            "retrying an allocation in most steps, slower than the batch below, and counts "
            "as running out"
        )
    found = best.search
    if (
        config.measured_margin
        and found.lowest_failure is not None
        and best.found_batch < found.largest_fit
    ):
        text += (
            f"; kept {best.found_batch} where {found.largest_fit} also fitted: the pick stays "
            f"{HEADROOM_FRACTION:.0%} of the budget's worth of measured samples below "
            f"{found.lowest_failure}, which ran out, as the edge moves between fresh processes"
        )
    if not any(r.stage == "verify" for r in runs):
        if steady_memory and verified.steps < config.verify_steps:
            return (
                f"{text}; the pick's own {verified.steps}-step run from a clean state is its "
                "verification: this device's tracked bytes repeat from the second step on "
                "(no allocator cache), so longer runs show nothing more."
            )
        return (
            f"{text}; the pick's own {verified.steps}-step run from a clean state (at least "
            f"verify_steps={config.verify_steps}) is its verification."
        )
    return f"{text}, and a run of its own verified it over {verified.steps} steps."


def _ran_out_by_retries(runs: Sequence[Probe], best: Confirmed) -> set[int]:
    """The batches of the pick's choices that ran out by the allocator's retries
    (``AllocatorRetriesError``), by the runs' records."""
    return {
        r.batch_size
        for r in runs
        if not r.fits
        and ran_out_by_retries(r.error)
        and r.candidate is not None
        and r.candidate.choices == best.candidate.choices
    }


def screen_notes(checks: Sequence[Check], config: PlanConfig) -> list[str]:
    """What the checks run before the search decided, for the plan's first lines."""
    notes = []
    for check in checks:
        if check.passed:
            continue
        if check.choice is None:
            # The strategy as a whole, not one of its choices: it says itself why it was not
            # offered, and no setting would make it offered.
            notes.append(f"{check.strategy}: {check.summary}")
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


def tie_note(tie: Tie | None, final: Candidate) -> str | None:
    """The plan's note on a tie the fixed rule broke, when the tie decided the pick."""
    if tie is None or tie.taken.candidate.choices != final.choices:
        return None
    others = "; ".join(
        f"{describe_choices(s.candidate.choices)} {rate:.1f}" for s, rate in tie.others
    )
    return (
        f"Tie: {describe_choices(tie.taken.candidate.choices)} ran {tie.rate:.1f} samples/s "
        f"and {others} samples/s, within {TIE_FRACTION:.0%} of the best, the spread two runs "
        "of one configuration show; the plan takes the one with the fewest strategies turned "
        "on (a fixed rule: the same inputs give the same pick)."
    )


def fallbacks_first(notes: list[str]) -> list[str]:
    """The notes with the in-process fallback's first: it changes how far the report's
    measurements can be trusted, so the report's first lines say it, not a note at the end."""
    from memadvisor.device.cuda import IN_PROCESS_NOTE_START

    first = [n for n in notes if n.startswith(IN_PROCESS_NOTE_START)]
    return first + [n for n in notes if not n.startswith(IN_PROCESS_NOTE_START)]
