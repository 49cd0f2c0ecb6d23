"""How a person meets the result: the terminal report, the Plan as JSON, a self-contained HTML.

print_plan(plan, console)                 the answer, the comparison, the memory, the advice
print_profile(profile, console)           what the profiler measured
write_html(render_plan_html(plan), path)  one file that opens offline: charts, tables, advice
write_plan_json(plan, path)               the Plan, for Plan.model_validate_json + apply_plan

plan.report(), plan.to_html(path) and plan.to_json(path) are these, from Python.
"""

from pathlib import Path
from typing import Any

from rich.console import Console

from memadvisor.report._facts import MemorySeries, series_from_timeline
from memadvisor.report._json import write_plan_json
from memadvisor.report._planned_step import PlannedStep, planned_step
from memadvisor.report.html import render_plan_html, render_profile_html, write_html
from memadvisor.report.terminal import one_line, one_line_profile, print_plan, print_profile
from memadvisor.schema.plan import Plan, lend_views

__all__ = [
    "MemorySeries",
    "one_line",
    "one_line_profile",
    "PlannedStep",
    "planned_step",
    "print_plan",
    "print_profile",
    "render_plan_html",
    "render_profile_html",
    "series_from_timeline",
    "write_html",
    "write_plan_json",
]


class _Views:
    """The report as ``Plan.report()``, ``to_json()`` and ``to_html()`` reach it."""

    def print(self, plan: Plan, console: Console | None = None) -> None:
        print_plan(plan, console or Console())

    def write_json(self, plan: Plan, path: str | Path) -> Path:
        return write_plan_json(plan, path)

    def write_html(self, plan: Plan, path: str | Path, workload: Any) -> Path:
        step = planned_step(workload, plan, in_place=False) if workload is not None else None
        return write_html(render_plan_html(plan, step=step), path)


lend_views(_Views())
