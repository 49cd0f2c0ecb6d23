"""The typer application and the one place that turns MemadvisorError into an exit code."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

import typer
from rich.console import Console

from memadvisor.errors import MemadvisorError

app = typer.Typer(
    name="memadvisor",
    help="Measure a PyTorch training step and find the fastest configuration that fits a "
    "memory budget.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])


def handle_errors(fn: F) -> F:
    """Turn a MemadvisorError into one message on stderr and its exit code.

    The traceback is shown only with ``--debug``; other exceptions keep theirs (they are bugs).
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except MemadvisorError as e:
            if kwargs.get("debug"):
                raise
            err_console.print(f"[bold red]error:[/] {e}", highlight=False, soft_wrap=True)
            raise typer.Exit(e.exit_code) from None

    return wrapper  # type: ignore[return-value]


from memadvisor.cli import plan as _plan  # noqa: E402,F401  (registers the command)
from memadvisor.cli import profile as _profile  # noqa: E402,F401
