"""strategies/_compile_model.py: a compiled configuration's memory and time lines from its runs.

Pure arithmetic on hand-made runs whose line is known: two runs recover it exactly, one run
scales the eager estimate's per-sample bytes by the measured ratio and holds the rate it
measured, and the prediction stays
within the limit, the largest batch asked and below a batch that ran out.
"""

from __future__ import annotations

import pytest

from strategies._compile_model import EagerLines, Line, fit_step, predicted, samples_per_s

MIB = 2**20
LIMIT = 97 * MIB
# The eager estimate: 10 MiB whatever the batch, 1 MiB a sample; 2 ms + 0.1 ms a sample.
EAGER = EagerLines(bytes=Line(10 * MIB, 1 * MIB), ms=Line(2.0, 0.1))


def _run(batch: int, fixed: float, per_sample: float, fixed_ms: float, per_sample_ms: float):
    return round(fixed + per_sample * batch), fixed_ms + per_sample_ms * batch


def test_two_runs_give_the_line_through_them() -> None:
    """Compiled: 12 MiB fixed, 0.7 MiB a sample, 1.5 ms + 0.06 ms a sample. Two runs recover
    both lines (the eager estimate is not used), and the batch is the line's under the limit."""
    runs = {b: _run(b, 12 * MIB, 0.7 * MIB, 1.5, 0.06) for b in (10, 40)}
    fit = fit_step(runs, EAGER, limit_bytes=LIMIT, max_batch=1000)
    assert fit is not None and fit.basis == "fitted" and fit.batches == [10, 40]
    assert fit.fixed_bytes == 12 * MIB and abs(fit.per_sample_bytes - 0.7 * MIB) <= 1
    assert fit.fixed_ms == pytest.approx(1.5) and fit.per_sample_ms == pytest.approx(0.06)
    assert fit.bytes_ratio is None and fit.time_ratio is None
    assert fit.largest_batch == 121  # (97 - 12) / 0.7 = 121.4
    assert fit.samples_per_s == pytest.approx(121 / (1.5 + 0.06 * 121) * 1e3)


def test_more_runs_give_the_least_squares_line() -> None:
    """Three runs off a line by +-1 KiB: the fitted line stays within a KiB of the true one."""
    runs = {
        b: (round(12 * MIB + 0.7 * MIB * b + noise), 1.0 + 0.05 * b)
        for b, noise in ((10, 1024), (20, -1024), (40, 1024))
    }
    fit = fit_step(runs, EAGER, limit_bytes=LIMIT, max_batch=1000)
    assert fit is not None and fit.basis == "fitted"
    assert abs(fit.fixed_bytes - 12 * MIB) <= 1024
    assert abs(fit.per_sample_bytes - 0.7 * MIB) <= 64


def test_one_run_scales_the_eager_per_sample_bytes_by_the_measured_ratio() -> None:
    """One run at batch 20 holding eager's fixed 10 MiB and 0.7 of its per-sample bytes, in
    0.8 of eager's time: the line keeps eager's fixed bytes, scales its slope by 0.7 (the
    ratio of the batch-dependent bytes) and passes through the run; its time ratio 0.8 is
    recorded, and the time line goes from zero through the run."""
    held, step_ms = _run(20, 10 * MIB, 0.7 * MIB, 0.8 * 2.0, 0.8 * 0.1)
    fit = fit_step({20: (held, step_ms)}, EAGER, limit_bytes=LIMIT, max_batch=1000)
    assert fit is not None and fit.basis == "scaled" and fit.batches == [20]
    assert fit.bytes_ratio == pytest.approx(0.7) and fit.time_ratio == pytest.approx(0.8)
    assert fit.fixed_bytes == 10 * MIB and abs(fit.per_sample_bytes - 0.7 * MIB) <= 1
    assert fit.fixed_bytes + fit.per_sample_bytes * 20 == pytest.approx(held, abs=20)
    assert fit.largest_batch == 124  # (97 - 10) / 0.7 = 124.3
    assert fit.fixed_ms == 0.0 and fit.per_sample_ms == pytest.approx(step_ms / 20)


def test_one_run_predicts_the_rate_it_measured_not_eagers_launch_bound_rise() -> None:
    """Rule: a line from one run promises no more samples/s at its predicted batch than the
    run measured. Eager's time line from the profile's small batches is nearly all fixed
    time (a launch-bound step: 20 ms + 0.001 ms a sample); scaled to a run at 700 it would
    read the step as fixed and promise a rate rising with the batch (hf_gpt2's two-block
    candidate on an H100: 56,356 samples/s measured at 726, 81,223 promised at 1050)."""
    eager = EagerLines(bytes=Line(10 * MIB, 0.05 * MIB), ms=Line(20.0, 0.001))
    step_ms = 700 / 56_356 * 1e3  # 12.4 ms: the run's measured rate
    held = round(10 * MIB + 0.05 * MIB * 700)
    fit = fit_step({700: (held, step_ms)}, eager, limit_bytes=LIMIT, max_batch=10_000)
    assert fit is not None and fit.largest_batch > 700
    assert fit.samples_per_s == pytest.approx(56_356, rel=1e-6)


def test_one_run_with_a_workspace_of_its_own_predicts_a_smaller_batch() -> None:
    """A compiled step holding 5 MiB more whatever the batch, measured once: that workspace
    reads as per-sample bytes, so the scaled line is steeper and its batch smaller than the
    true one (safe), and a second run puts it right."""
    true = {b: _run(b, 15 * MIB, 0.7 * MIB, 2.0, 0.1) for b in (20, 100)}
    once = fit_step({20: true[20]}, EAGER, limit_bytes=LIMIT, max_batch=1000)
    twice = fit_step(true, EAGER, limit_bytes=LIMIT, max_batch=1000)
    assert once is not None and twice is not None
    assert twice.largest_batch == 117  # (97 - 15) / 0.7
    assert once.largest_batch < twice.largest_batch


def test_the_prediction_stays_below_a_failure_and_the_largest_batch() -> None:
    """A batch that ran out caps the prediction one below it; max_batch caps it too."""
    runs = {b: _run(b, 12 * MIB, 0.7 * MIB, 1.5, 0.06) for b in (10, 40)}
    capped = fit_step(runs, EAGER, limit_bytes=LIMIT, max_batch=1000, lowest_failure=100)
    assert capped is not None and capped.largest_batch == 99 and capped.lowest_failure == 100
    small = fit_step(runs, EAGER, limit_bytes=LIMIT, max_batch=64)
    assert small is not None and small.largest_batch == 64
    assert predicted(Line(200 * MIB, MIB), LIMIT, 1000, None) == 0  # not even one sample


def test_a_failure_caps_the_prediction_at_the_plans_margin_below_it() -> None:
    """With the plan's margin below the failure given (what its batch search takes under a
    batch that ran out), the prediction stays there, not one under the failure: on a card
    the batch one under a failure that a line had put within the limit ran out too."""
    runs = {b: _run(b, 12 * MIB, 0.7 * MIB, 1.5, 0.06) for b in (10, 40)}
    margin = fit_step(
        runs, EAGER, limit_bytes=LIMIT, max_batch=1000, lowest_failure=100, below_failure=94
    )
    assert margin is not None and margin.largest_batch == 94 and margin.lowest_failure == 100
    # A margin above the line's own prediction changes nothing.
    loose = fit_step(
        runs, EAGER, limit_bytes=LIMIT, max_batch=80, lowest_failure=100, below_failure=94
    )
    assert loose is not None and loose.largest_batch == 80


def test_runs_whose_bytes_do_not_rise_are_scaled_from_the_largest() -> None:
    """Two runs whose bytes fall with the batch (noise at the same peak) give no slope: the
    line is eager's scaled through the larger batch's run, and says so."""
    runs = {10: (30 * MIB, 3.0), 20: (29 * MIB, 4.0)}
    fit = fit_step(runs, EAGER, limit_bytes=LIMIT, max_batch=1000)
    assert fit is not None and fit.basis == "scaled" and fit.bytes_ratio is not None
    assert fit.fixed_bytes + fit.per_sample_bytes * 20 == pytest.approx(29 * MIB, abs=20)


def test_a_run_below_eagers_fixed_bytes_is_a_line_from_zero() -> None:
    """A run holding less than the estimate's fixed bytes leaves no ratio to take: the line
    goes from zero through it (no ratio recorded)."""
    fit = fit_step({8: (8 * MIB, 2.0)}, EAGER, limit_bytes=LIMIT, max_batch=1000)
    assert fit is not None and fit.basis == "scaled" and fit.bytes_ratio is None
    assert fit.fixed_bytes == 0 and fit.per_sample_bytes == MIB and fit.largest_batch == 97


def test_no_run_no_line_and_no_time_no_rate() -> None:
    """Without a run there is no line; a batch of 0 has no throughput."""
    assert fit_step({}, EAGER, limit_bytes=LIMIT, max_batch=1000) is None
    assert samples_per_s(Line(1.0, 0.1), 0) == 0.0


def test_no_batch_is_predicted_where_the_line_and_the_largest_allocation_pass_the_cap() -> None:
    """Rule: where the eager estimate has the step's largest allocation (its reserved peak
    less its peak: a block the allocator must find free at the cap) and the cap is given,
    the prediction stops where the bytes line plus that block passes the cap, and says so
    (``cap_batch``); a block too small to bind changes nothing. (The GPT example's compiled
    form on a card: 6.91 GB allocated at batch 250 under 8 GiB, its line's edge at 294-302,
    and 255-302 ran out allocating its 1.5 GiB logits.)"""
    cap = 100 * MIB
    runs = {b: _run(b, 12 * MIB, 0.7 * MIB, 1.5, 0.06) for b in (10, 40)}
    plain = fit_step(runs, EAGER, limit_bytes=LIMIT, max_batch=1000, cap_bytes=cap)
    assert plain is not None and plain.cap_batch is None
    assert plain.largest_batch == (LIMIT - 12 * MIB) // round(0.7 * MIB)  # the line's: 121
    logits = EagerLines(bytes=EAGER.bytes, ms=EAGER.ms, largest_allocation=Line(0.0, 0.3 * MIB))
    fit = fit_step(runs, logits, limit_bytes=LIMIT, max_batch=1000, cap_bytes=cap)
    assert fit is not None and fit.cap_batch == fit.largest_batch
    assert fit.largest_batch == (cap - 12 * MIB) // MIB  # 0.7 + 0.3 MiB a sample: 88
    assert fit.samples_per_s == pytest.approx(samples_per_s(Line(1.5, 0.06), 88))
    small = EagerLines(bytes=EAGER.bytes, ms=EAGER.ms, largest_allocation=Line(MIB, 0.001 * MIB))
    loose = fit_step(runs, small, limit_bytes=LIMIT, max_batch=1000, cap_bytes=cap)
    assert loose is not None and loose.cap_batch is None and loose.largest_batch == 121
    # Without the cap (no measured margin: the held bytes are reserved already), the line's.
    assert fit_step(runs, logits, limit_bytes=LIMIT, max_batch=1000).largest_batch == 121


def test_the_cap_never_predicts_below_a_batch_the_runs_held_within_the_limit() -> None:
    """Rule: a run that fitted with its held bytes within the limit is measured; the
    largest-allocation bound, a prediction, stops at it and not below. (The GPT example's
    compiled form under expandable segments on a card: it fitted at 302, the cap said 252,
    and the search dropped compile on the lower rate.) A run held beyond the limit is no
    such floor."""
    cap = 100 * MIB
    logits = EagerLines(bytes=EAGER.bytes, ms=EAGER.ms, largest_allocation=Line(0.0, 0.3 * MIB))
    runs = {b: _run(b, 12 * MIB, 0.7 * MIB, 1.5, 0.06) for b in (10, 100)}  # 100 held 82 MiB
    fit = fit_step(runs, logits, limit_bytes=LIMIT, max_batch=1000, cap_bytes=cap)
    assert fit is not None and fit.largest_batch == 100 and fit.cap_batch == 100
    beyond = {b: _run(b, 12 * MIB, 0.7 * MIB, 1.5, 0.06) for b in (10, 125)}  # 99.5 MiB
    over = fit_step(beyond, logits, limit_bytes=LIMIT, max_batch=1000, cap_bytes=cap)
    assert over is not None and over.largest_batch == 88  # the cap's, as without the run


def test_the_fit_note_says_when_the_largest_allocation_bounds_the_batch() -> None:
    """Rule: the plan's sentence on the pick's compiled memory says where the largest
    allocation, not the line alone, set its largest batch."""
    from memadvisor.schema.plan import StageVariant
    from strategies._compile_stage import _fit_note

    runs = {b: _run(b, 12 * MIB, 0.7 * MIB, 1.5, 0.06) for b in (10, 40)}
    logits = EagerLines(bytes=EAGER.bytes, ms=EAGER.ms, largest_allocation=Line(0.0, 0.3 * MIB))
    for lines, said in ((EAGER, False), (logits, True)):
        fit = fit_step(runs, lines, limit_bytes=LIMIT, max_batch=1000, cap_bytes=100 * MIB)
        record = StageVariant(choices={"compile": "default"}, ok=True, trial="", fit=fit)
        assert ("largest allocation" in _fit_note(record)) is said


GB = 10**9
# t5_base's compiled candidates on an H200 under 8 GiB (session 35 call 2): eager's fixed
# 3.41 GB and the limit, 8 GiB less the 3% headroom.
T5_LIMIT = 8_332_236_554
T5_EAGER = EagerLines(bytes=Line(3.41 * GB, 0.1 * GB), ms=Line(0.0, 5.0))


@pytest.mark.parametrize(
    ("runs", "reserved", "bound"),
    [
        # 24 blocks checkpointed: 6.28 GB allocated, 6.72 GB reserved at 36; through its
        # reserved bytes from eager's fixed ones (0.092 GB a sample) the limit is at 53.
        ({36: 6.28 * GB}, {36: 6.72 * GB}, 53),
        # 21 blocks: 7.23 / 8.14 GB at 36: 37.
        ({36: 7.23 * GB}, {36: 8.14 * GB}, 37),
        # Two runs under the limit, 36 and 50 (7.45 / 8.02 GB reserved, 0.093 GB a sample
        # between them): the line through both reaches the limit at 53.
        ({36: 6.28 * GB, 50: 7.45 * GB}, {36: 6.72 * GB, 50: 8.02 * GB}, 53),
    ],
)
def test_no_batch_is_predicted_where_a_line_through_the_runs_reserved_bytes_passes_the_limit(
    runs: dict[int, float], reserved: dict[int, float], bound: int
) -> None:
    """Rule: where the runs recorded their reserved peaks, the predicted batch is no more
    than where a line through them (least squares through two or more, else from the bytes
    line's fixed bytes through the largest) reaches the limit, and never below a run whose
    allocated bytes stayed within it; StepFit.reserved_batch says where that bound binds.
    Without reserved peaks the prediction is the allocated line's alone (larger here)."""
    held = {b: (round(a), 250.0) for b, a in runs.items()}
    kept = {b: round(r) for b, r in reserved.items()}
    fit = fit_step(held, T5_EAGER, limit_bytes=T5_LIMIT, max_batch=1000, reserved=kept)
    plain = fit_step(held, T5_EAGER, limit_bytes=T5_LIMIT, max_batch=1000)
    assert fit is not None and plain is not None
    assert fit.largest_batch == bound and plain.largest_batch > bound
    assert fit.reserved_batch == bound and plain.reserved_batch is None


def test_a_reserved_peak_at_the_limit_draws_no_bound() -> None:
    """Rule: where a run's reserved peak reached the limit, no reserved bound is drawn: a
    card's reserved peak stops at the memory cap while the allocated one still grows, so it
    says nothing of how the reserved bytes grow (t5_base's 24 blocks at 55 reserved 8.48 GB
    of 8.59 and held; 12 blocks at 20, 8.42). The prediction is the allocated line's."""
    held = {36: (round(6.28 * GB), 250.0), 55: (round(7.85 * GB), 254.0)}
    reserved = {36: round(6.72 * GB), 55: round(8.48 * GB)}
    fit = fit_step(held, T5_EAGER, limit_bytes=T5_LIMIT, max_batch=1000, reserved=reserved)
    plain = fit_step(held, T5_EAGER, limit_bytes=T5_LIMIT, max_batch=1000)
    assert fit is not None and plain is not None
    assert fit.reserved_batch is None and fit.largest_batch == plain.largest_batch > 55


def test_reserved_bytes_a_little_ahead_of_the_allocated_ones_move_the_batch_by_a_sample() -> None:
    """Rule: where the reserved bytes run a little ahead of the allocated ones (the GPT
    example's compiled form at 307: 8.27 GB allocated, 8.30 reserved, session 35), the
    reserved line reaches the limit at most a sample below the allocated one (308 against
    309 here), never below the run itself."""
    eager = EagerLines(bytes=Line(0.157 * GB, 0.0264 * GB), ms=Line(0.0, 0.03))
    held = {307: (round(8.27 * GB), 9.6)}
    fit = fit_step(
        held, eager, limit_bytes=T5_LIMIT, max_batch=10_000, reserved={307: 8_300_000_000}
    )
    plain = fit_step(held, eager, limit_bytes=T5_LIMIT, max_batch=10_000)
    assert fit is not None and plain is not None
    assert 307 <= fit.largest_batch <= plain.largest_batch <= fit.largest_batch + 1


def test_a_confirmation_makes_no_run_above_where_the_reserved_line_bound_the_batch() -> None:
    """Rule: where a candidate's line was bound by its runs' reserved bytes, its
    confirmation's ceiling is that bound, or its largest run where larger (a run there
    held): the confirmation extrapolates from allocated peaks, which do not see the
    segments the allocator keeps; where the largest-allocation cap binds too, the lower."""
    from memadvisor.schema.candidate import Measurement
    from strategies._compile_search import Variant, confirm_ceiling

    held = {36: (round(6.28 * GB), 250.0)}
    fit = fit_step(
        held, T5_EAGER, limit_bytes=T5_LIMIT, max_batch=1000, reserved={36: round(6.72 * GB)}
    )
    assert fit is not None and fit.reserved_batch == 53
    run = Measurement(steps=20, peak_bytes=held[36][0], step_ms=250.0, samples_per_s=144.0)
    v = Variant(
        choices={"compile": "default"},
        final_choices={"compile": "default"},
        label="checkpoint 24/24 blocks",
        start_batch=36,
        eager=T5_EAGER,
        runs={36: run},
        fit=fit,
    )
    assert confirm_ceiling(v) == 53
    v.fit = fit.model_copy(update={"cap_batch": 50})
    assert confirm_ceiling(v) == 50
    v.fit = fit.model_copy(update={"reserved_batch": None})
    assert confirm_ceiling(v) is None


# hf_gpt2's compiled form without checkpointing on an H200 under 8 GiB (session 40 call C's
# plan, the same in every plan of sessions 38-40): two dynamic runs, their reserved peaks,
# and eager's largest allocation (its logits, 2 MiB a sample).
HF_RUNS = {637: (4_059_005_952, 9.494), 1020: (6_442_945_536, 9.533)}
HF_RESERVED = {637: 4_760_535_040, 1020: 6_522_142_720}
HF_EAGER = EagerLines(
    bytes=Line(0.5 * GB, 10.0 * MIB), ms=Line(5.0, 0.01), largest_allocation=Line(0.0, 2 * MIB)
)


def test_two_runs_reserved_peaks_stand_for_the_largest_allocations_cap() -> None:
    """Rule: where two runs give a rising line and their reserved peaks draw a bound, eager's
    largest allocation does not cap the prediction (the reserved line measures what the
    allocator keeps beyond the allocated bytes); without the reserved peaks it does. On
    hf_gpt2's numbers the cap said 1020 (its run's batch), the line 1323; the hand cell
    held 1339."""
    cap = 8 * 2**30
    capped = fit_step(HF_RUNS, HF_EAGER, limit_bytes=T5_LIMIT, max_batch=65536, cap_bytes=cap)
    assert capped is not None and capped.cap_batch == capped.largest_batch == 1020
    fit = fit_step(
        HF_RUNS,
        HF_EAGER,
        limit_bytes=T5_LIMIT,
        max_batch=65536,
        cap_bytes=cap,
        reserved=HF_RESERVED,
    )
    assert fit is not None and fit.cap_batch is None and fit.reserved_batch is None
    assert fit.largest_batch == 1323  # the allocated line's; the reserved line says 1413


def test_one_runs_reserved_peak_leaves_the_largest_allocations_cap() -> None:
    """Rule: one run's line is eager's shape scaled, and its reserved peak does not replace
    the cap: the prediction is capped as without it."""
    one = {1020: HF_RUNS[1020]}
    kwargs = dict(limit_bytes=T5_LIMIT, max_batch=65536, cap_bytes=8 * 2**30)
    without = fit_step(one, HF_EAGER, **kwargs)
    with_reserved = fit_step(one, HF_EAGER, **kwargs, reserved={1020: HF_RESERVED[1020]})
    assert without is not None and with_reserved is not None
    assert without.cap_batch is not None
    assert with_reserved.largest_batch <= without.largest_batch
    assert with_reserved.cap_batch is not None or with_reserved.reserved_batch is not None
