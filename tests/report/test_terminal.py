"""The terminal report: the answer first, then the comparison, the memory, the advice."""

from __future__ import annotations

import io

from rich.console import Console

from memadvisor.report import one_line, print_plan, print_profile
from memadvisor.schema.plan import Plan
from memadvisor.schema.profile import Profile
from memadvisor.units import fmt_bytes, fmt_rate


def _render(fn, obj, **kwargs) -> str:
    buf = io.StringIO()
    fn(obj, Console(file=buf, width=140, color_system=None), **kwargs)
    return buf.getvalue()


def _first_words(section: str, known: set[str]) -> list[str]:
    """The first word of each table line that starts with one of ``known``, in order."""
    words = (line.split()[0] for line in section.splitlines() if line.split())
    return [w for w in words if w in known]


def _owner_names(profile: Profile) -> set[str]:
    step = profile.steps["fp32"]
    return {b.name for b in step.blocks} | {m.name for m in step.outside}


def test_plan_report_gives_the_answer_before_the_evidence(plan: Plan) -> None:
    text = _render(print_plan, plan)
    order = [
        "Budget",
        "Configurations compared",
        "Where the memory goes",
        "Top activation owners",
        "Per-phase peaks",
        "Recommendations",
    ]
    positions = [text.index(heading) for heading in order]
    assert positions == sorted(positions)


def test_plan_answer_states_budget_precision_blocks_batch_peaks_and_speedup(plan: Plan) -> None:
    text = _render(print_plan, plan)
    answer = text[: text.index("Configurations compared")]
    assert "8.00 GiB" in answer and "stays 3% of it below the batch that ran out" in answer
    assert "bf16 autocast" in answer
    assert "3 of 4 blocks: transformer.h.0, transformer.h.1, transformer.h.2" in answer
    assert "12 × 2 accumulation steps = effective batch 24" in answer
    assert f"estimated {fmt_bytes(plan.estimate.peak_bytes)}" in answer
    assert f"verified {fmt_bytes(plan.verified.peak_bytes)}" in answer
    speedup = plan.verified.samples_per_s / plan.comparison[0].measured.samples_per_s
    assert f"{speedup:.2f}× the baseline's" in answer


def test_a_pick_equal_to_the_baseline_says_so_instead_of_a_ratio(plan: Plan) -> None:
    base = plan.comparison[0].candidate
    text = _render(print_plan, plan.model_copy(update={"candidate": base}))
    assert "the baseline configuration itself: nothing to change for speed" in text
    assert "the baseline's" not in text


def test_comparison_marks_estimated_numbers_and_not_measured_ones(plan: Plan) -> None:
    text = _render(print_plan, plan)
    table = text[text.index("Configurations compared") : text.index("Where the memory goes")]
    labels = {"Baseline", "+Checkpointing", "+AMP", "+Both", "Plan"}
    rows = {line.split()[0]: line for line in table.splitlines() if set(line.split()[:1]) & labels}
    assert set(rows) == labels
    baseline, ckpt = plan.comparison[0], plan.comparison[1]
    assert fmt_bytes(baseline.measured.peak_bytes) in rows["Baseline"]
    assert "~" not in rows["Baseline"]
    assert f"~{fmt_bytes(ckpt.estimate.peak_bytes)}" in rows["+Checkpointing"]
    assert f"~{fmt_rate(ckpt.estimate.samples_per_s)}" in rows["+Checkpointing"]


def test_memory_section_names_owners_that_are_not_blocks(plan: Plan) -> None:
    text = _render(print_plan, plan)
    owners = text[text.index("Top activation owners") : text.index("Per-phase peaks")]
    names = _first_words(owners, _owner_names(plan.profile))
    assert names[:2] == ["<loss>", "lm_head"]  # bigger than any block at batch 12 in bf16
    assert "ckpt" in owners  # checkpointed blocks show what they still keep
    phases = text[text.index("Per-phase peaks") : text.index("Recommendations")]
    for phase in ("forward", "backward", "optimizer", "zero_grad"):
        assert phase in phases
    assert "Fragmentation: the allocator reserved 1.08×" in phases


def test_recommendations_carry_their_snippet_and_effect(plan: Plan) -> None:
    text = _render(print_plan, plan)
    advice = text[text.index("Recommendations") :]
    for adv in plan.advice:
        assert adv.title in advice
        assert adv.snippet.splitlines()[0] in advice
        if adv.effect:
            assert f"Effect: {adv.effect}" in advice
    assert "Check (precision, passed)" in advice
    assert "Runs on NVIDIA H200: 3 batch probes (14 OOM, 13 OOM, 12 fits)" in advice


def test_plan_without_a_profile_says_so_instead_of_the_memory_section(plan: Plan) -> None:
    text = _render(print_plan, plan.model_copy(update={"profile": None}))
    assert "carries no profile" in text and "Top activation owners" not in text


def test_one_line_answer_has_the_numbers_a_script_needs(plan: Plan) -> None:
    line = one_line(plan)
    assert "\n" not in line
    assert "bf16" in line and "batch 12 x 2" in line and "3 blocks checkpointed" in line
    assert f"peak {fmt_bytes(plan.verified.peak_bytes)} verified of 8.00 GiB" in line


def test_profile_report_shows_kinds_owners_per_precision_and_phases(profile: Profile) -> None:
    text = _render(print_profile, profile)
    assert "memadvisor profile · GPT" in text and "batch sizes 2 and 4" in text
    kinds = text[text.index("Memory by kind") : text.index("Top activation owners")]
    assert fmt_bytes(profile.optimizer_state_bytes) in kinds
    owners = text[text.index("Top activation owners") : text.index("Per-phase peaks")]
    head = next(line for line in owners.splitlines() if "Module" in line)
    assert "fp32" in head and "bf16" in head
    assert _first_words(owners, _owner_names(profile))[:2] == ["lm_head", "<loss>"]
    assert "Configurations compared" not in text


def test_profile_report_reads_the_fits_at_the_batch_asked_for(profile: Profile) -> None:
    text = _render(print_profile, profile, batch_size=32)
    at32 = fmt_bytes(profile.steps["fp32"].activation_total.at(32))
    assert "Memory by kind at batch 32" in text and at32 in text
