"""The report tells the truth: one method per ratio, code that pastes, tables that are whole,
owners named with their remedy, and charts whose legend and bars say what was measured."""

from __future__ import annotations

import ast
import io
import re
import shutil
import subprocess

import pytest
from rich.console import Console

from memadvisor.report import print_plan, print_profile, render_plan_html
from memadvisor.report._facts import Consumer, answer, consumers, series_from_events
from memadvisor.report._html_assets import SCRIPT
from memadvisor.report._words import owner_notes
from memadvisor.report.terminal import print_code
from memadvisor.schema.advice import Advice
from memadvisor.schema.call import CallForm
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.device import SIMULATED
from memadvisor.schema.plan import Plan
from memadvisor.schema.profile import LinearMs, ModuleActivity, Profile
from memadvisor.strategy import registered_names
from strategies.batch_size import BatchSize, choice_for
from strategies.precision import Precision

MIB = 2**20
FENCE = re.compile(r"^```python\n(.*?)^```$", re.S | re.M)


def _render(fn, obj, width: int = 80, **kwargs) -> str:
    buf = io.StringIO()
    fn(obj, Console(file=buf, width=width, color_system=None), **kwargs)
    return buf.getvalue()


def code_blocks(text: str) -> list[str]:
    """Every fenced code block of a printed report."""
    return FENCE.findall(text)


# -- the headline ratio -----------------------------------------------------------------------


def test_an_estimated_baseline_is_set_against_the_plans_estimate_not_its_measurement(
    plan: Plan,
) -> None:
    rows = list(plan.comparison)
    rows[0] = rows[0].model_copy(update={"measured": None})  # the baseline only estimated
    only_estimated = plan.model_copy(update={"comparison": rows})
    a = answer(only_estimated)
    assert a.speedup_basis == "estimated"
    expected = plan.estimate.samples_per_s / rows[0].estimate.samples_per_s
    assert a.speedup == pytest.approx(expected)
    # The measured plan over the estimated baseline would be a different number: never shown.
    mixed = plan.verified.samples_per_s / rows[0].estimate.samples_per_s
    assert f"{mixed:.2f}×" not in _render(print_plan, only_estimated, 140)
    text = _render(print_plan, only_estimated, 140)
    assert f"by the estimate {expected:.2f}× the baseline's" in text
    assert "both sides estimated" in text


def test_where_device_times_rank_nothing_the_estimate_ranks_every_row_and_the_headline(
    plan: Plan,
) -> None:
    """The same measured plan, made on the simulated CPU device: the headline's rate and
    ratio are the estimate's (no measured ratio, which would be noise there), every row's
    Step and Samples/s are the estimate's and marked so, and the measured peaks stay."""
    from memadvisor.report._facts import comparison

    simulated = plan.model_copy(
        update={"device_kind": "simulated", "device_name": "cpu", "capabilities": SIMULATED}
    )
    a = answer(simulated)
    assert not a.measured and a.speedup_basis == "estimated"
    assert a.samples_per_s == plan.estimate.samples_per_s
    assert a.speedup == pytest.approx(
        plan.estimate.samples_per_s / plan.comparison[0].estimate.samples_per_s
    )
    lines = comparison(simulated)
    assert len(lines) == len(simulated.comparison) + 1  # and the pick's own row, last
    for line, row in zip(lines, simulated.comparison, strict=False):
        assert not line.time_measured
        assert line.samples_per_s == row.estimate.samples_per_s
        assert line.measured == (row.measured is not None)  # its peak: measured where it ran
    text = _render(print_plan, simulated, 140)
    assert "both measured" not in text and "this device's times do not rank" in text
    assert "Step and Samples/s are the estimate's on every row" in text
    assert not lines[-1].time_measured and lines[-1].samples_per_s == plan.estimate.samples_per_s
    page = render_plan_html(simulated)
    assert "Step and Samples/s are the estimate&#x27;s on every row" in page


def test_a_measured_baseline_is_set_against_the_plans_measurement(plan: Plan) -> None:
    a = answer(plan)
    assert a.speedup_basis == "measured"
    assert a.speedup == pytest.approx(
        plan.verified.samples_per_s / plan.comparison[0].measured.samples_per_s
    )
    assert "both measured" in _render(print_plan, plan, 140)


# -- code that pastes -------------------------------------------------------------------------


@pytest.mark.parametrize("width", [40, 80, 200])
def test_code_is_printed_whole_at_any_width(width: int) -> None:
    long_line = "for name in " + repr([f"model.layers.{i}.self_attn" for i in range(12)]) + ":"
    code = f"import torch\n\n{long_line}\n    print(name)  # [bold]not markup[/]\n"
    text = _render(lambda c, console: print_code(console, c), code, width)
    (block,) = code_blocks(text)
    assert block == code  # every character, no wrap, no ellipsis, no markup eaten
    ast.parse(block)


def test_every_advice_snippet_of_a_plan_parses_at_80_columns(plan: Plan) -> None:
    long = "x = checkpoint(" + ", ".join(f"argument_{i}" for i in range(20)) + ")\n"
    advice = [*plan.advice, Advice(strategy="t", title="t", sentence="s", snippet=long)]
    text = _render(print_plan, plan.model_copy(update={"advice": advice}), 80)
    blocks = code_blocks(text)
    assert len(blocks) == sum(1 for a in advice if a.snippet)
    for block in blocks:
        ast.parse(block)
    assert long in blocks


# -- tables that are whole at 80 columns ------------------------------------------------------


def test_tables_at_80_columns_cut_no_header_and_no_value(plan: Plan, profile: Profile) -> None:
    for text in (_render(print_plan, plan), _render(print_profile, profile)):
        # "… N more" is a row of its own; an ellipsis anywhere else is a cut.
        cut = [line for line in text.splitlines() if "…" in line and "more" not in line]
        assert cut == []
        assert max(len(line) for line in text.splitlines()) <= 80
    # Headers wrap at their spaces instead: each word is there whole.
    plan_text, profile_text = _render(print_plan, plan), _render(print_profile, profile)
    for word in ("Largest", "batch", "Samples/s", "Forward", "Kept", "plan", "Share"):
        assert re.search(rf"\b{re.escape(word)}\b", plan_text), word
    for word in ("Per", "sample", "bf16", "Forward", "Embedding", "LayerNorm"):
        assert re.search(rf"\b{re.escape(word)}\b", profile_text), word


# -- owners outside the blocks ----------------------------------------------------------------


def _consumer(name: str, type_name: str = "", **kw) -> Consumer:
    return Consumer(
        name=name, type_name=type_name, owner="outside", activation_bytes=785 * MIB,
        share=0.19, kept_bytes=785 * MIB, **kw,
    )  # fmt: skip


def test_other_owner_made_by_a_softmax_after_the_head_is_named_as_the_loss_with_its_remedy():
    other = _consumer(
        "<other>", "GPT2LMHeadModel", made_by=["_log_softmax", "_to_copy"], after="lm_head"
    )
    head = _consumer("lm_head", "Linear")
    notes = owner_notes([other, head])
    assert len(notes) == 2
    assert "loss over lm_head's output" in notes[0] and "GPT2LMHeadModel.forward" in notes[0]
    assert "chunked or fused cross-entropy" in notes[0] and "smaller batch" in notes[0]
    assert notes[1].startswith("lm_head:") and "fused linear + cross-entropy" in notes[1]


def test_other_owner_without_a_loss_op_is_named_as_the_models_own_glue() -> None:
    (note,) = owner_notes([_consumer("<other>", "Net", made_by=["add", "relu"], after="h.1")])
    assert "Net.forward outside every submodule after h.1 (add, relu)" in note
    assert "cross-entropy" not in note and "smaller batch" in note


def test_small_owners_get_no_note() -> None:
    small = _consumer("<other>", "Net", made_by=["add"]).model_copy(update={"share": 0.01})
    assert owner_notes([small]) == []


needs_loss_head = pytest.mark.skipif(
    "loss_head" not in registered_names(),
    reason="loss_head is not registered in this environment (pip install -e . from here)",
)


def _with_pick(plan: Plan, **choices) -> Plan:  # noqa: ANN003
    pick = plan.candidate.model_copy(update={"choices": {**plan.candidate.choices, **choices}})
    return plan.model_copy(update={"candidate": pick})


def _owners_section(text: str) -> str:
    return text[text.index("Top activation owners") : text.index("Per-phase peaks")]


@needs_loss_head
def test_a_pick_that_chunks_the_loss_keeps_none_of_it_and_suggests_no_other_loss(
    plan: Plan,
) -> None:
    """Where the pick's facts say it computes the loss another way (loss_changed: the
    chunked loss head), the owners' loss row keeps 0 bytes and says how, and no note
    suggests a chunked or fused cross-entropy, in the terminal and the HTML alike."""
    chunked = _with_pick(plan, loss_head=8)
    a = answer(chunked)
    assert a.loss_rewrite is not None and "8 chunks" in a.loss_rewrite.brief
    owners = consumers(chunked.profile, a.batch_size, a.precision, a.checkpointed, a.loss_rewrite)
    (loss,) = [c for c in owners if c.name == "<loss>"]
    assert loss.activation_bytes > 0 and loss.kept_bytes == 0 and loss.loss_rewrite is not None
    section = _owners_section(_render(print_plan, chunked, width=140))
    (row,) = [line for line in section.splitlines() if line.lstrip().startswith("<loss> *")]
    assert f"0 B, {a.loss_rewrite.brief}" in row
    assert "the plan computes the loss another way" in " ".join(section.split())
    page = render_plan_html(chunked)
    for text in (section, page):
        assert "chunked or fused" not in text and "fused linear" not in text


def test_a_pick_that_keeps_the_users_loss_still_gets_the_chunked_loss_suggestion(
    plan: Plan,
) -> None:
    """The same plan with the loss head off: the loss row keeps what it saved, and the note
    names a chunked or fused cross-entropy as what would shrink it."""
    kept = _with_pick(plan, loss_head="off") if "loss_head" in registered_names() else plan
    a = answer(kept)
    assert a.loss_rewrite is None
    owners = consumers(kept.profile, a.batch_size, a.precision, a.checkpointed, a.loss_rewrite)
    (loss,) = [c for c in owners if c.name == "<loss>"]
    assert loss.kept_bytes == loss.activation_bytes > 0
    section = " ".join(_owners_section(_render(print_plan, kept, width=140)).split())
    assert "chunked or fused cross-entropy" in section


def test_the_profile_records_what_made_other_and_the_module_before(profile: Profile) -> None:
    step = profile.steps["fp32"]
    other = ModuleActivity(
        name="<other>", type_name="GPT", activation=step.outside[0].activation,
        made_by=["_log_softmax"], after="lm_head",
    )  # fmt: skip
    steps = {"fp32": step.model_copy(update={"outside": [*step.outside, other]})}
    owners = consumers(profile.model_copy(update={"steps": steps}), 4)
    (c,) = [c for c in owners if c.name == "<other>"]
    assert c.made_by == ["_log_softmax"] and c.after == "lm_head"


# -- advice in the workload's own form --------------------------------------------------------


def test_advice_for_a_model_returning_its_own_loss_from_a_dict_batch_has_no_loss_fn(
    profile: Profile,
) -> None:
    hf = profile.model_copy(update={"call_form": CallForm(batch="mapping", loss="output.loss")})
    precision = Precision().explain("bf16", hf)
    assert "loss = model(**batch).loss" in precision.snippet and "loss_fn" not in precision.snippet
    record = choice_for(Candidate(batch_size=4, accumulation_steps=2), 8)
    batch = BatchSize().explain(record, hf)
    assert "for i, batch in enumerate(loader):" in batch.snippet
    assert "loss = model(**batch).loss" in batch.snippet and "loss_fn" not in batch.snippet
    for snippet in (precision.snippet, batch.snippet):
        ast.parse(snippet)


def test_advice_for_an_inputs_targets_batch_keeps_loss_fn(profile: Profile) -> None:
    pair = profile.model_copy(update={"call_form": CallForm(batch="sequence", loss="loss_fn")})
    assert "loss = loss_fn(model(inputs), targets)" in Precision().explain("bf16", pair).snippet


# -- the HTML ---------------------------------------------------------------------------------


def test_every_phase_band_of_the_memory_chart_has_a_legend_entry_the_loss_too(plan: Plan) -> None:
    events = [
        (0.0, 10, None, "forward"), (5.0, 20, None, "loss"), (5.3, 21, None, "backward"),
        (9.0, 12, None, "optimizer"), (9.5, 12, None, "zero_grad"),
    ]  # fmt: skip
    page = render_plan_html(plan, series=series_from_events(events, "recorded"))
    legend = re.search(r'<ul class="legend" id="memory-legend">(.*?)</ul>', page).group(1)
    phases = re.findall(r'data-phase="([a-z_]+)"', legend)
    assert phases == ["forward", "loss", "backward", "optimizer", "zero_grad"]
    assert "allocated" in legend


def test_recompute_cost_of_identical_blocks_is_their_median_with_the_spread(plan: Plan) -> None:
    profile = plan.profile
    steps = dict(profile.steps)
    blocks = list(steps["bf16"].blocks)
    blocks[0] = blocks[0].model_copy(update={"forward_ms": LinearMs(constant_ms=207.0)})
    steps["bf16"] = steps["bf16"].model_copy(update={"blocks": blocks})
    noisy = plan.model_copy(update={"profile": profile.model_copy(update={"steps": steps})})
    a = answer(noisy)
    owners = [c for c in consumers(noisy.profile, a.batch_size, "bf16") if c.owner == "block"]
    others = sorted(b.forward_ms.at(a.batch_size) for b in blocks[1:])
    # Four blocks: the median is the mean of the middle two of all four timings.
    times = sorted([207.0, *others])
    assert {c.forward_ms for c in owners} == {(times[1] + times[2]) / 2}
    assert all(c.forward_ms_high == 207.0 and c.repeats == len(blocks) for c in owners)
    page = render_plan_html(noisy)
    assert f"median of {len(blocks)} identical blocks" in page and "207 ms" in page


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_chart_script_is_valid_javascript(tmp_path) -> None:
    script = tmp_path / "charts.js"
    script.write_text(SCRIPT)
    result = subprocess.run(["node", "--check", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
