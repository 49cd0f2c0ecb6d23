"""The plan's notes on the pick's batch say why a batch that fitted was not taken.

Rule: with the measured margin, when a run above the pick fitted and a higher one ran out,
the note names the pick, the larger batch that fitted and the one that ran out, and the
headroom that separates them; with no such fit above the pick it says nothing of it.
"""

from __future__ import annotations

from types import SimpleNamespace

from memadvisor.errors import AllocatorRetriesError
from memadvisor.planner._notes import runs_note
from memadvisor.planner._probe import BatchSearch
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.plan import Probe

MIB = 2**20
VERIFIED = Measurement(steps=20, peak_bytes=90 * MIB, step_ms=1.0, samples_per_s=1.0)


def _best(tried: list[tuple[int, bool]], batch: int) -> SimpleNamespace:
    search = BatchSearch(
        batch=batch,
        largest_fit=max(b for b, ok in tried if ok),
        lowest_failure=min((b for b, ok in tried if not ok), default=None),
        tried=tried,
    )
    return SimpleNamespace(search=search, found_batch=batch, candidate=Candidate(batch_size=batch))


def test_a_fit_above_the_pick_is_explained_by_the_headroom_below_the_failure() -> None:
    """101 ran out, 97 fitted, 96 kept (the ViT-B/16 search on an H200): the note says so."""
    best = _best([(101, False), (92, True), (96, True), (97, True)], 96)
    config = PlanConfig(budget_bytes=100 * MIB)
    note = runs_note([], best, VERIFIED, config)  # type: ignore[arg-type]
    assert "(101 OOM, 92 fits, 96 fits, 97 fits)" in note
    assert "kept 96 where 97 also fitted" in note and "below 101, which ran out" in note
    assert "3% of the budget" in note


def test_no_fit_above_the_pick_no_explanation() -> None:
    """The pick is the largest fit (or the margin is fixed): nothing to explain."""
    config = PlanConfig(budget_bytes=100 * MIB)
    plain = runs_note([], _best([(41, False), (39, True)], 39), VERIFIED, config)  # type: ignore[arg-type]
    assert "kept" not in plain
    fixed = PlanConfig(budget_bytes=100 * MIB, margin_fraction=0.08)
    best = _best([(101, False), (92, True), (96, True), (97, True)], 92)
    assert "kept" not in runs_note([], best, VERIFIED, fixed)  # type: ignore[arg-type]


def test_a_strategy_not_offered_at_all_says_why_without_the_checks_hint() -> None:
    """A failed check of no choice (a strategy not offered at all, e.g. the chunked loss
    where the loss_fn is opaque) is noted as the strategy's own sentence, without the
    "checks='report' to consider it anyway" that a failed choice gets (no setting offers it);
    a failed choice keeps that hint; passed checks say nothing."""
    from memadvisor.planner._notes import screen_notes
    from memadvisor.schema.advice import Check

    whole = Check(strategy="s", summary="not offered: the loss is opaque.", passed=False)
    one = Check(strategy="p", choice="bf16", summary="bf16 differs.", passed=False)
    fine = Check(strategy="p", choice="tf32", summary="tf32 agrees.", passed=True)
    config = PlanConfig(budget_bytes=100 * MIB)
    notes = screen_notes([whole, one, fine], config)
    assert notes[0] == "s: not offered: the loss is opaque."
    assert notes[1].startswith("p bf16 was not considered") and "checks='report'" in notes[1]
    assert len(notes) == 2


def test_a_batch_that_ran_out_by_the_allocators_retries_is_named_so() -> None:
    """Rule: a failed run of the pick's choices whose error is AllocatorRetriesError's is
    listed as 'retries', not 'OOM', and the note says once what that means; another
    candidate's retries at the same batch do not mark it (cnn on an H100, session 22)."""
    bf16 = Candidate(batch_size=2233, choices={"precision": "bf16"})
    message = str(AllocatorRetriesError(2233, 19, 19, 154.4))
    runs = [
        Probe(batch_size=2301, fits=False, steps=1, error="CUDA out of memory.", candidate=bf16),
        Probe(batch_size=2233, fits=False, steps=20, error=message, candidate=bf16),
        Probe(batch_size=2163, fits=True, steps=20, candidate=bf16),
    ]
    best = _best([(2301, False), (2233, False), (2163, True)], 2163)
    best.candidate = bf16.model_copy(update={"batch_size": 2163})
    config = PlanConfig(budget_bytes=100 * MIB)
    note = runs_note(runs, best, VERIFIED, config)  # type: ignore[arg-type]
    assert "(2301 OOM, 2233 retries, 2163 fits)" in note
    assert "freeing its cache" in note
    best.candidate = Candidate(batch_size=2163, choices={"precision": "fp32"})
    other = runs_note(runs, best, VERIFIED, config)  # type: ignore[arg-type]
    assert "(2301 OOM, 2233 OOM, 2163 fits)" in other and "freeing" not in other
