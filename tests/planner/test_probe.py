"""Probing: exact batches and probe counts against a device whose OOM threshold is known.

Like Lightning's batch-size finder tests: each case is (threshold, estimate bracket
(start, upper), expected batch, expected probes), with the reason in a comment. The margin
is the default 8%: ``safe_below(f) = min(f - 1, floor(0.92 f))``.
"""

from __future__ import annotations

import pytest
import torch

from memadvisor.planner import find_batch, safe_below
from memadvisor.planner._probe import probe
from memadvisor.schema.candidate import Candidate, Measurement

MARGIN = 0.08

CASES = [
    # estimate right or pessimistic: start fits, the bracket's top fits too -> take the top
    (200, (100, 110), 110, 2),
    # start fits, top fails -> start, already below safe_below(110) = 101
    (105, (100, 110), 100, 2),
    (100, (100, 110), 100, 2),
    # start fits, top fails, start above the margin below the failure -> safe_below(104) = 95
    (103, (100, 104), 95, 2),
    # estimate a little optimistic: 100 fails, its margin below (92) fits -> 92
    (95, (100, 110), 92, 2),
    # two margins optimistic: 100, 92 fail; 84 = safe_below(92) fits -> 84
    (91, (100, 110), 84, 3),
    # far off: 100, 92, 84 fail; halve to 42 (fits); bisect 63, 73 and 77 = safe_below(84)
    # (all fit) -> 77
    (80, (100, 110), 77, 7),
    # nothing fits: 100, 92, 84 fail, then halving 42, 21, 10, 5, 2, 1 all fail -> 0
    (0, (100, 110), 0, 9),
    # small batches: the top is at least start + 1
    (3, (3, 3), 3, 2),  # 3 fits, 4 fails, safe_below(4) = 3
    (2, (3, 3), 2, 2),  # 3 fails, safe_below(3) = 2 fits
    (1, (1, 1), 1, 2),  # 1 fits, 2 fails, safe_below(2) = 1
    # the estimate's bracket under max_batch 64: one probe at the cap
    (1000, (64, 80), 64, 1),
]


@pytest.mark.parametrize(("threshold", "bracket", "expected_batch", "expected_probes"), CASES)
def test_find_batch_gives_exact_batch_and_probe_count(
    threshold: int, bracket: tuple[int, int], expected_batch: int, expected_probes: int
) -> None:
    """Each (threshold, bracket) leads to exactly the expected batch in exactly so many probes."""
    tried: list[int] = []

    def fits(b: int) -> bool:
        tried.append(b)
        return b <= threshold

    start, upper = bracket
    result = find_batch(fits, start, upper, MARGIN, max_batch=64 if threshold == 1000 else 65536)
    assert (result.batch, result.probe_count) == (expected_batch, expected_probes), tried
    assert len(tried) == expected_probes


@pytest.mark.parametrize(("threshold", "bracket", "expected_batch", "expected_probes"), CASES)
def test_probing_a_device_matches_the_table(
    threshold: int,
    bracket: tuple[int, int],
    expected_batch: int,
    expected_probes: int,
    fake_device,
    workload,
) -> None:
    """Through Device.run: the OOM is recognised by is_oom and each probe is one device run."""
    device = fake_device(threshold)

    def fits(b: int) -> bool:
        record, measured = probe(device, workload, Candidate(batch_size=b), steps=3)
        assert record.fits == (measured is not None) == (b <= threshold)
        # The record keeps what the run measured, not only whether it fit.
        assert record.step_ms == (measured.step_ms if measured is not None else None)
        return record.fits

    max_batch = 64 if threshold == 1000 else 65536
    result = find_batch(fits, *bracket, MARGIN, max_batch)
    assert result.batch == expected_batch
    assert len(device.calls) == expected_probes
    assert all(steps > 1 for _, steps, _ in device.calls), "a probe must run more than one step"


def test_typical_model_needs_at_most_three_probes() -> None:
    """An estimate within one margin of the truth costs 2 probes; within two margins, 3."""
    start, upper = 100, 112
    for threshold in range(80, 160):
        result = find_batch(lambda b, t=threshold: b <= t, start, upper, MARGIN, 65536)
        assert 0 < result.batch <= threshold
        if threshold >= safe_below(start, MARGIN):
            assert result.probe_count == 2, (threshold, result.tried)
        elif threshold >= safe_below(safe_below(start, MARGIN), MARGIN):
            assert result.probe_count == 3, (threshold, result.tried)


def test_a_fitting_top_is_taken_only_when_its_measured_peak_left_the_margin_free() -> None:
    """The bracket's top fitting proves the device holds it at the budget's edge; the pick
    is the top only when its measured peak stayed within the usable budget, else start."""
    for within, expected in ((True, 110), (False, 100)):
        result = find_batch(lambda b: True, 100, 110, MARGIN, 65536, lambda b, w=within: w)
        assert (result.batch, result.probe_count, result.largest_fit) == (expected, 2, 110)


def test_pick_stays_the_margin_below_the_lowest_failure_on_non_monotone_fits() -> None:
    """Near the limit fits are not monotone (ResNet-50 bf16: 354 fits, 355 fails, 356-388 fit,
    389 fails): whatever the bracket, the pick is never above safe_below(lowest failure seen),
    and it never lands above a failure it saw."""

    def fits(b: int) -> bool:
        return b <= 354 or 356 <= b <= 388

    for start in range(300, 420, 7):
        for width in (5, 20, 40):
            result = find_batch(fits, start, start + width, MARGIN, 65536)
            assert result.batch >= 1
            if result.lowest_failure is not None:
                assert result.batch <= safe_below(result.lowest_failure, MARGIN)


def test_safe_below_keeps_a_margin_and_at_least_one() -> None:
    """The margin below a failure: 8% of it, at least one batch, never negative."""
    assert [safe_below(f, MARGIN) for f in (1, 2, 3, 13, 100, 389)] == [0, 1, 2, 11, 92, 357]


def test_a_non_oom_error_propagates_unchanged(fake_device, workload) -> None:
    """Anything is_oom does not call an out-of-memory leaves probe() as the same object."""
    error = ValueError("the model rejected the batch")
    device = fake_device(100, error=error)
    with pytest.raises(ValueError) as caught:
        probe(device, workload, Candidate(batch_size=4), steps=3)
    assert caught.value is error


def test_a_cuda_style_oom_message_counts_as_out_of_memory(fake_device, workload) -> None:
    """A RuntimeError with the CUDA allocator's message is an OOM answer, not a crash."""
    device = fake_device(100, error=RuntimeError("CUDA error: out of memory"), error_at=50)
    record, measured = probe(device, workload, Candidate(batch_size=60), steps=3)
    assert not record.fits and measured is None and "out of memory" in (record.error or "")
    record, measured = probe(device, workload, Candidate(batch_size=10), steps=3)
    assert record.fits and measured is not None


def test_probe_records_the_candidate_and_steps(fake_device, workload) -> None:
    """A probe record says what ran (batch, choices), at which stage, and how many steps."""
    device = fake_device(10)
    cand = Candidate(batch_size=8, choices={"precision": "bf16"})
    record, _ = probe(device, workload, cand, steps=4, stage="verify")
    assert (record.batch_size, record.steps, record.stage, record.candidate) == (
        8,
        4,
        "verify",
        cand,
    )
    record, _ = probe(device, workload, Candidate(batch_size=11), steps=4)
    assert (record.fits, record.peak_bytes) == (False, None)
    assert isinstance(torch.OutOfMemoryError("x"), RuntimeError)


def test_a_batch_above_one_that_ran_out_is_not_run_again(
    fake_device, workload, profile, strategies
) -> None:
    """Rule: once batch 12 of some choices ran out, a larger batch of the same choices is
    answered as out of memory without a device run (the batch search treats a failure as the
    edge); other choices, and batches below it, still run."""
    from memadvisor.planner._prober import Prober
    from memadvisor.planner._space import SearchSpace
    from memadvisor.schema.config import PlanConfig

    config = PlanConfig(budget_bytes=100 * 2**20, probe_steps=2, timing_steps=2, verify_steps=4)
    space = SearchSpace(profile, strategies, config)
    device = fake_device(10)
    prober = Prober(device, workload, space, config)
    bf16 = {"precision": "bf16"}
    assert prober.run(Candidate(batch_size=12, choices=bf16), prober.steps, "probe") is None
    assert prober.run(Candidate(batch_size=13, choices=bf16), prober.steps, "probe") is None
    assert prober.run(Candidate(batch_size=20, choices=bf16), prober.steps, "probe") is None
    assert len(device.calls) == 1
    assert prober.run(Candidate(batch_size=9, choices=bf16), prober.steps, "probe") is not None
    fp32 = {"precision": "fp32"}
    assert prober.run(Candidate(batch_size=13, choices=fp32), prober.steps, "probe") is None
    assert [b for b, _, _ in device.calls] == [12, 9, 13]


def test_a_compiled_runs_progress_says_its_first_step_and_the_cache() -> None:
    """A run that compiled says what its first step waited on (the first step's seconds and
    the graphs loaded from the cache against those compiled); an eager run or one that ran
    out adds nothing."""
    from memadvisor.planner._prober import _compiled_words

    eager = Measurement(steps=3, peak_bytes=1, step_ms=10.0, samples_per_s=100.0)
    assert _compiled_words(eager) == "" and _compiled_words(None) == ""
    compiled = eager.model_copy(
        update={"first_step_ms": 12_345.0, "compile_cache_hits": 4, "compile_cache_misses": 1}
    )
    assert _compiled_words(compiled) == (
        " (first step 12.3 s: 4 graphs from the compile cache, 1 compiled)"
    )
    uncached = compiled.model_copy(update={"compile_cache_bypasses": 2})
    assert _compiled_words(uncached).endswith(", 1 compiled, 2 the cache would not take)")


def test_a_known_fit_is_the_floor_of_the_descent() -> None:
    """A batch of the same choices known to fit (an earlier run) bounds the search after a
    failure: it bisects between that fit and the failure instead of halving below it (a
    compiled confirmation ran 167 after 335 failed, below a 302 that had fitted), and a
    start at or below it costs no run."""
    edge = 320

    def run_log(tried: list[int]):
        def fits(b: int) -> bool:
            tried.append(b)
            return b <= edge

        return fits

    blind: list[int] = []
    find_batch(run_log(blind), 397, 400, 0.08, 10_000, below=lambda b: b - 10, descend=True)
    assert min(blind) < 302  # without the floor the descent went below the known fit
    known: list[int] = []
    found = find_batch(
        run_log(known), 397, 400, 0.08, 10_000, below=lambda b: b - 10, descend=True, floor=302
    )
    assert min(known) > 302 and 302 <= found.batch <= edge, known
    low: list[int] = []
    found = find_batch(run_log(low), 250, 400, 0.08, 10_000, descend=True, floor=302)
    assert low[0] == 302 and found.batch >= 302  # the start is the floor, not below it


def test_within_stops_the_bisection_once_the_fit_is_that_close_to_the_failure() -> None:
    """``within``: the search stops bisecting when the batch the pick may take is at most that
    fraction above the largest fit, with fewer runs and a fit that close to the edge; 0 (the
    planner's) bisects to the sample. The GPT example's hand cell on a card: 286, 381 OOM,
    380 OOM, 333 OOM, 309, 321 OOM, 315 OOM, 312, 313, 314 (10 runs) for an edge at 314."""

    def search(within: float) -> tuple[int, int]:
        tried: list[int] = []

        def fits(b: int) -> bool:
            tried.append(b)
            return b <= 314

        found = find_batch(
            fits, 286, 287, 0.0, 10_000, extrapolate=lambda b: 381 if b < 381 else None,
            below=lambda failed: failed - 1, max_extrapolations=4, descend=True, within=within,
        )  # fmt: skip
        return found.batch, len(tried)

    exact, exact_runs = search(0.0)
    close, close_runs = search(0.01)
    assert exact == 314 and 0.99 * 314 <= close <= 314 and close_runs < exact_runs


def test_runs_asked_together_are_answered_in_order_and_kept_as_one_at_a_time(
    fake_device, workload, profile, strategies, record_run_many
) -> None:
    """Rule: Prober.run_many answers each candidate as run() would, in order: a run made
    earlier (or a larger batch of choices that ran out) without the device, the rest in one
    Device.run_many call; an out-of-memory is None and recorded, an error that is not one is
    its answer and recorded nowhere; a bound on the runs left that cannot cover them runs
    none."""
    from memadvisor.planner._prober import Prober, RunsSpent
    from memadvisor.planner._space import SearchSpace
    from memadvisor.schema.config import PlanConfig

    config = PlanConfig(budget_bytes=100 * 2**20, probe_steps=2, timing_steps=2, verify_steps=4)
    space = SearchSpace(profile, strategies, config)
    device = fake_device(10)
    calls = record_run_many(device)
    prober = Prober(device, workload, space, config)
    bf16 = {"precision": "bf16"}
    assert prober.run(Candidate(batch_size=4, choices=bf16), prober.steps, "probe") is not None
    assert prober.run(Candidate(batch_size=12, choices=bf16), prober.steps, "probe") is None
    asked = [Candidate(batch_size=b, choices=bf16) for b in (4, 6, 11, 13, 14)]
    answers = prober.run_many(asked, prober.steps, "compile")
    assert calls == [[6, 11]]  # 4 ran before; 13 and 14 are above 12, which ran out
    assert isinstance(answers[0], Measurement) and isinstance(answers[1], Measurement)
    assert answers[2] is None and answers[3] is None and answers[4] is None
    assert [p.batch_size for p in prober.probes] == [4, 12, 6, 11]
    assert [p.stage for p in prober.probes[2:]] == ["compile", "compile"]
    # Asked again, everything is known: no device call.
    assert prober.run_many(asked, prober.steps, "compile") == answers and len(calls) == 1
    # An error that is not an out-of-memory is the answer, and no record.
    device.error, device.error_at = ValueError("the model rejected the batch"), 8
    fp32 = {"precision": "fp32"}
    answers = prober.run_many(
        [Candidate(batch_size=b, choices=fp32) for b in (2, 9)], prober.steps, "compile"
    )
    assert isinstance(answers[0], Measurement) and isinstance(answers[1], ValueError)
    assert [p.batch_size for p in prober.probes][-1] == 2
    # Two runs asked where one is left: none runs.
    prober.runs_left = 1
    with pytest.raises(RunsSpent):
        prober.run_many([Candidate(batch_size=b, choices=fp32) for b in (3, 5)], 2, "compile")
    assert len(calls) == 2 and prober.runs_left == 1


def test_no_upward_probe_passes_the_ceiling():
    """Rule: with a ceiling, the extrapolated probe is taken at most there; a ceiling within
    ``within`` of the largest fit ends the search on that fit without a run."""
    tried: list[int] = []

    def fits(b: int) -> bool:
        tried.append(b)
        return b <= 300

    found = find_batch(fits, 250, 400, 0.05, 10_000, extrapolate=lambda b: 317, ceiling=270)
    assert max(tried) == 270 and found.batch >= 250
    tried.clear()
    found = find_batch(
        fits, 252, 400, 0.05, 10_000, extrapolate=lambda b: 317, ceiling=255, within=0.03
    )
    assert tried == [252] and found.batch == 252


def test_a_start_a_few_percent_above_a_known_fit_starts_there() -> None:
    """Rule: with ``within``, a start at most that fraction above ``floor`` (a batch known to
    fit within the limit) starts at the floor, answered without a run: each run of a
    compiled confirmation is a compile. On a card hf_gpt2's confirmation ran 1905 from its
    line where 1895 had fitted (28.7 s for half a percent, session 19). The upward probe
    after it is made as from any start (it aims at the edge; the margin comes after), and
    without ``within`` the start is run, as the planner's eager search runs it."""

    def search(within: float) -> tuple[list[int], int]:
        tried: list[int] = []

        def fits(b: int) -> bool:
            tried.append(b)
            return b <= 1950

        found = find_batch(
            fits, 1905, 2000, 0.05, 10_000, extrapolate=lambda b: 1920, floor=1895, within=within
        )
        return tried, found.batch

    assert search(0.03) == ([1895, 1920], 1920)
    assert search(0.0) == ([1905, 1920], 1920)
    # A start further above the floor than ``within`` is run.
    tried: list[int] = []
    find_batch(lambda b: tried.append(b) or True, 1990, 2000, 0.05, 10_000, floor=1895, within=0.03)
    assert tried[0] == 1990


def test_a_ceiling_near_a_fit_outside_the_margin_still_probes() -> None:
    """Rule: a ceiling within ``within`` of the largest fit ends the search on that fit only
    where the fit is within the margin; a fit outside it (it held more than the pick may)
    is not a pick, and the search goes on to find the edge and step below it."""
    tried: list[int] = []

    def fits(b: int) -> bool:
        tried.append(b)
        return b <= 2000

    found = find_batch(
        fits, 1960, 2100, 0.05, 10_000, within_margin=lambda b: b <= 1900,
        extrapolate=lambda b: 2100, below=lambda failed: failed - 60, descend=True,
        ceiling=1980, within=0.03,
    )  # fmt: skip
    assert tried[0] == 1960 and len(tried) > 1 and found.batch < 1960, (tried, found)


def test_a_fitting_probe_records_its_reserved_peak_and_host_time() -> None:
    """Rule: a run that fits keeps, beside its allocated peak and step time, the reserved
    peak and the host's time its measurement has (None where the device reports neither),
    so a saved plan says how near the reserved bytes came to the cap and whether the card
    waited on the host, run by run."""

    class _Device:
        def run(self, workload, candidate, steps):
            return Measurement(
                steps=steps,
                peak_bytes=700,
                reserved_peak_bytes=900,
                step_ms=10.0,
                samples_per_s=800.0,
                host_ms=9.5,
            )

    record, measured = probe(_Device(), None, Candidate(batch_size=8), steps=3)
    assert (record.peak_bytes, record.reserved_peak_bytes, record.host_ms) == (700, 900, 9.5)
    assert measured is not None and record.step_ms == measured.step_ms
