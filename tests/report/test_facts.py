"""The report's facts: each number the report prints is computed here, once."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from memadvisor.report import _facts as facts
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import GIB
from memadvisor.schema.plan import Plan, Probe
from memadvisor.schema.profile import Profile


def test_answer_names_the_pick_and_compares_with_the_measured_baseline(plan: Plan) -> None:
    a = facts.answer(plan)
    assert a.precision == "bf16"
    assert a.checkpointed == ["transformer.h.0", "transformer.h.1", "transformer.h.2"]
    assert a.block_count == 4
    assert (a.batch_size, a.accumulation_steps, a.effective_batch) == (12, 2, 24)
    assert a.budget_bytes == 8 * GIB and a.usable_bytes == plan.config.usable_bytes
    assert a.verified_peak_bytes == plan.verified.peak_bytes and a.measured
    baseline = plan.comparison[0]
    assert a.baseline_samples_per_s == baseline.measured.samples_per_s and a.baseline_measured
    assert a.speedup == pytest.approx(plan.verified.samples_per_s / baseline.measured.samples_per_s)


def test_answer_falls_back_to_the_estimate_when_nothing_was_measured(plan: Plan) -> None:
    rows = [r.model_copy(update={"measured": None}) for r in plan.comparison]
    bare = plan.model_copy(update={"verified": None, "comparison": rows})
    a = facts.answer(bare)
    assert not a.measured and a.verified_peak_bytes is None
    assert a.samples_per_s == plan.estimate.samples_per_s
    assert a.baseline_samples_per_s == rows[0].estimate.samples_per_s and not a.baseline_measured


def test_answer_lists_other_non_neutral_choices_only(plan: Plan) -> None:
    choices = {**plan.candidate.choices, "offload": "forward", "optimizer_habits": "off", "x": [1]}
    changed = plan.model_copy(update={"candidate": Candidate(batch_size=4, choices=choices)})
    assert facts.answer(changed).other_choices == {"offload": "forward", "x": "[1]"}


def test_a_pick_that_runs_what_the_baseline_runs_is_not_compared_by_ratio(plan: Plan) -> None:
    """Two runs of one configuration differ only by timing noise: no speedup is claimed."""
    base = plan.comparison[0].candidate
    same = Candidate(
        batch_size=base.batch_size,
        choices={**base.choices, "optimizer_habits": "advice", "precision": "fp32"},
    )
    assert facts.answer(plan.model_copy(update={"candidate": same})).same_as_baseline
    assert not facts.answer(plan).same_as_baseline
    bigger = same.model_copy(update={"batch_size": base.batch_size + 1})
    assert not facts.answer(plan.model_copy(update={"candidate": bigger})).same_as_baseline


def test_checkpointed_blocks_reads_names_or_indices(plan: Plan) -> None:
    """The checkpointing strategy's part names the blocks a choice names, by name or index."""

    def blocks(choice) -> list[str]:
        cand = plan.candidate.model_copy(
            update={"choices": {**plan.candidate.choices, "checkpointing": choice}}
        )
        return facts.answer(plan.model_copy(update={"candidate": cand})).checkpointed

    assert blocks(["transformer.h.1"]) == ["transformer.h.1"]
    assert blocks([0, 3]) == ["transformer.h.0", "transformer.h.3"]
    assert blocks([]) == []
    assert blocks(None) == []


def test_comparison_appends_the_pick_and_marks_what_was_measured(plan: Plan) -> None:
    lines = facts.comparison(plan)
    assert [line.label for line in lines] == [
        "Baseline",
        "+Checkpointing",
        "+AMP",
        "+Both",
        "Plan",
    ]
    assert [line.measured for line in lines] == [True, False, True, False, True]
    # A measured row shows the device's peak, an estimated one the estimate's.
    assert lines[0].peak_bytes == plan.comparison[0].measured.peak_bytes
    assert lines[1].peak_bytes == plan.comparison[1].estimate.peak_bytes
    assert lines[-1].is_plan and lines[-1].accumulation_steps == 2


def test_comparison_flags_a_row_whose_reserved_peak_passes_the_budget(plan: Plan) -> None:
    row = plan.comparison[0]
    over = Measurement(
        steps=3,
        peak_bytes=plan.config.budget_bytes - 1,
        reserved_peak_bytes=plan.config.budget_bytes + 1,
        step_ms=1.0,
        samples_per_s=1.0,
    )
    changed = plan.model_copy(update={"comparison": [row.model_copy(update={"measured": over})]})
    assert facts.comparison(changed)[0].over_budget
    assert not facts.comparison(plan)[0].over_budget


def test_consumers_include_owners_that_are_not_blocks_largest_first(profile: Profile) -> None:
    owners = facts.consumers(profile, 4, "fp32")
    names = [c.name for c in owners]
    assert names[:2] == ["lm_head", "<loss>"]  # 786 and 785 MiB, over any block's 371
    assert {c.owner for c in owners if c.name.startswith("transformer.h.")} == {"block"}
    sizes = [c.activation_bytes for c in owners]
    assert sizes == sorted(sizes, reverse=True)
    total = profile.steps["fp32"].activation_total.at(4)
    # Each owner's line is rounded to a byte on its own: allow a byte per owner.
    assert sum(sizes) <= total + len(owners)
    assert sum(c.share for c in owners) == pytest.approx(sum(sizes) / total)


def test_a_checkpointed_block_keeps_only_its_input(profile: Profile) -> None:
    owners = {c.name: c for c in facts.consumers(profile, 8, "bf16", ["transformer.h.2"])}
    kept = owners["transformer.h.2"]
    assert kept.checkpointed and kept.kept_bytes == profile.steps["bf16"].blocks[2].input.at(8)
    assert owners["transformer.h.1"].kept_bytes == owners["transformer.h.1"].activation_bytes


def test_unattributed_bytes_are_shown_when_owners_miss_more_than_one_percent(
    profile: Profile,
) -> None:
    step = profile.steps["fp32"]
    bigger = step.activation_total.model_copy(
        update={"per_sample_bytes": step.activation_total.per_sample_bytes * 1.1}
    )
    changed = profile.model_copy(
        update={"steps": {"fp32": step.model_copy(update={"activation_total": bigger})}}
    )
    owners = facts.consumers(changed, 4)
    rest = [c for c in owners if c.name == "<unattributed>"]
    assert len(rest) == 1
    assert sum(c.activation_bytes for c in owners) == bigger.at(4)
    assert not any(c.name == "<unattributed>" for c in facts.consumers(profile, 4))


def test_kinds_at_the_plan_peak_are_the_estimates_breakdown(plan: Plan) -> None:
    lines = facts.kinds_at_plan_peak(plan)
    assert {line.kind: line.nbytes for line in lines if line.kind in plan.estimate.breakdown} == (
        plan.estimate.breakdown
    )
    assert lines[0].kind == "params"


def test_kinds_of_a_profile_add_up_to_weights_state_and_activations(profile: Profile) -> None:
    lines = {line.kind: line.nbytes for line in facts.kinds_of_profile(profile, 4)}
    assert lines["params"] == profile.param_bytes
    assert lines["optimizer_state"] == profile.optimizer_state_bytes
    assert lines["activations"] == profile.steps["fp32"].activation_total.at(4)
    assert "buffers" not in lines  # none in this model: no empty line


def test_phase_series_steps_through_the_phases_over_their_measured_times(
    profile: Profile,
) -> None:
    series = facts.series_from_phases(profile, 4, "fp32")
    step = profile.steps["fp32"]
    assert [s[0] for s in series.spans] == ["forward", "backward", "optimizer", "zero_grad"]
    assert series.spans[0][2] - series.spans[0][1] == pytest.approx(step.forward_ms.at(4))
    assert series.spans[1][2] - series.spans[1][1] == pytest.approx(step.backward_ms.at(4))
    # Each phase is flat at its own peak: two points per phase.
    peaks = [p.allocated.at(4) for p in step.phases]
    assert [pt[1] for pt in series.points[::2]] == peaks
    assert series.time_unit == "ms" and series.source == "phase peaks"


def test_timeline_series_follows_the_phase_marks_and_thins_to_the_peaks() -> None:
    def ev(t: float, kind: str, alloc: int, phase: str | None = None) -> SimpleNamespace:
        return SimpleNamespace(t_ms=t, kind=kind, phase=phase, allocated_bytes=alloc,
                               reserved_bytes=None)  # fmt: skip

    events = [ev(0, "phase", 10, "forward"), ev(1, "sample", 50), ev(2, "phase", 60, "backward")]
    events += [ev(2 + i / 1000, "sample", 60 + (i % 7)) for i in range(5000)]
    events += [ev(8, "phase", 20, "optimizer"), ev(9, "phase", 10, "end")]
    timeline = SimpleNamespace(events=events, model_name="m", device="cpu", dropped_events=0)
    series = facts.series_from_timeline(timeline, max_points=500)
    assert [s[0] for s in series.spans] == ["forward", "backward", "optimizer"]
    assert series.spans[1][1:] == (2, 8)
    assert len(series.points) <= 501 + 4  # a point per slice, and the phase marks
    assert max(p[1] for p in series.points) == 66  # the highest reading survives thinning


def test_device_runs_lists_the_batch_probes_and_counts_the_other_stages(plan: Plan) -> None:
    extra = [
        Probe(batch_size=6, fits=True, steps=3, stage="timing"),
        Probe(batch_size=12, fits=True, steps=20, stage="verify"),
        *(Probe(batch_size=b, fits=b < 9, steps=3, stage="compare") for b in (8, 9)),
    ]
    many = [Probe(batch_size=b, fits=True, steps=3) for b in range(20, 30)]
    text = facts.device_runs(plan.model_copy(update={"probes": [*plan.probes, *extra]}))
    assert text == (
        "Runs on NVIDIA H200: 3 batch probes (14 OOM, 13 OOM, 12 fits), 1 timed, 1 verifying, "
        "2 for the comparison rows"
    )
    long = facts.device_runs(plan.model_copy(update={"probes": many}), shown=2)
    assert long == "Runs on NVIDIA H200: 10 batch probes (20 fits, 21 fits, … 8 more)"
