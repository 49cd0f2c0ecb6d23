"""``memadvisor profile TARGET``."""

from __future__ import annotations

import typer

from memadvisor.cli._app import app, handle_errors
from memadvisor.errors import PlanningError
from memadvisor.target import load_target


@app.command(epilog="Examples:\n\n  memadvisor profile examples/gpt.py:build")
@handle_errors
def profile(
    target: str = typer.Argument(..., help="path/to/file.py:factory or package.module:factory"),
    debug: bool = typer.Option(False, "--debug", help="Show tracebacks."),
) -> None:
    """Measure TARGET's training step: memory per block, per layer and per phase."""
    load_target(target)
    raise PlanningError("The profiler has not landed yet (issue 3).")
