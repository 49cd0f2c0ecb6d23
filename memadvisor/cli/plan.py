"""``memadvisor plan TARGET --budget-gb N``."""

from __future__ import annotations

import typer

from memadvisor.cli._app import app, handle_errors
from memadvisor.errors import PlanningError
from memadvisor.target import load_target


@app.command(
    epilog="Examples:\n\n"
    "  memadvisor plan examples/gpt.py:build --budget-gb 0.5\n\n"
    "  memadvisor plan examples/cnn.py:build --budget-gb 0.25 --json plan.json"
)
@handle_errors
def plan(
    target: str = typer.Argument(..., help="path/to/file.py:factory or package.module:factory"),
    budget_gb: float = typer.Option(..., "--budget-gb", help="Memory budget in GiB (2^30)."),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Find the fastest configuration of TARGET's training step that fits the budget."""
    load_target(target)
    raise PlanningError("The planner has not landed yet (issue 6): nothing to plan with.")
