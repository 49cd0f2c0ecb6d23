"""How a person meets the result: the terminal report, the Plan as JSON, a self-contained HTML.

print_plan(plan, console)                 the answer, the comparison, the memory, the advice
print_profile(profile, console)           what the profiler measured
write_html(render_plan_html(plan), path)  one file that opens offline: charts, tables, advice
write_plan_json(plan, path)               the Plan, for Plan.model_validate_json + apply_plan

plan.report(), plan.to_html(path) and plan.to_json(path) are these, from Python.
"""

from memadvisor.report._facts import MemorySeries, series_from_timeline
from memadvisor.report._json import write_plan_json
from memadvisor.report._planned_step import PlannedStep, planned_step
from memadvisor.report.html import render_plan_html, render_profile_html, write_html
from memadvisor.report.terminal import one_line, one_line_profile, print_plan, print_profile

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
