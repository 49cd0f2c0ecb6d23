"""The report from Python: ``plan.report()``, ``plan.to_json(path)`` and ``plan.to_html(path)``
give what the CLI prints and writes; the data-loading section travels with the plan."""

from __future__ import annotations

import io

from rich.console import Console

from memadvisor.dataloading import LoaderAdvice, LoaderTrial
from memadvisor.planner import Plan
from memadvisor.report import print_plan, render_plan_html


def _text(fn, plan: Plan) -> str:
    buf = io.StringIO()
    fn(plan, Console(file=buf, width=120, color_system=None))
    return buf.getvalue()


def test_report_prints_the_terminal_report(plan: Plan) -> None:
    assert _text(lambda p, c: p.report(c), plan) == _text(print_plan, plan)
    assert "Configurations compared" in _text(lambda p, c: p.report(c), plan)


def test_to_json_writes_the_plan_that_reads_back_equal(plan: Plan, tmp_path) -> None:
    path = plan.to_json(tmp_path / "plan.json")
    assert Plan.model_validate_json(path.read_text()) == plan


def test_to_html_of_a_plan_without_its_model_writes_the_page_with_phase_peaks(
    plan: Plan, tmp_path
) -> None:
    path = plan.to_html(tmp_path / "plan.html")
    page = path.read_text()
    assert page == render_plan_html(plan)
    assert "Peak of each phase of the profiled step" in page  # and says so


def _loader(limits: bool) -> LoaderAdvice:
    trial = LoaderTrial(
        num_workers=0, pin_memory=False, persistent_workers=False, batches=3,
        first_batch_ms=45.0, batch_ms=44.0, batch_ms_spread=(43.0, 46.0), samples_per_batch=4,
    )  # fmt: skip
    return LoaderAdvice(
        current=trial, variants=[trial.model_copy(update={"num_workers": 2, "batch_ms": 22.0})],
        step_samples_per_s=1000.0, step_measured=True, limits_throughput=limits,
        recommended={"num_workers": 2}, sentences=["The loader, not memory, limits throughput."],
        snippet="loader = DataLoader(dataset, batch_size=4, num_workers=2)\n",
    )  # fmt: skip


def test_the_report_shows_the_loader_and_says_it_limits_throughput(plan: Plan) -> None:
    with_loader = plan.model_copy(update={"data_loading": _loader(True)})
    text = _text(print_plan, with_loader)
    assert "Data loading" in text and "limits throughput" in text
    assert "loader = DataLoader(dataset, batch_size=4, num_workers=2)" in text
    page = render_plan_html(with_loader)
    assert 'id="loading"' in page and '<p class="limits">' in page
    assert Plan.model_validate_json(with_loader.model_dump_json()) == with_loader
    assert "Data loading" not in _text(print_plan, plan)  # no loader given, no section
