"""The ``memadvisor`` command: one thin module per subcommand."""

from __future__ import annotations

import sys

import typer

from memadvisor.cli import plan as _plan  # noqa: F401 - registers the command on app
from memadvisor.cli import profile as _profile  # noqa: F401
from memadvisor.cli._app import app, err_console
from memadvisor.cli._interrupt import (
    INTERRUPTED_EXIT_CODE,
    interrupted,
    interrupts_handled,
    say_interrupted,
)

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point (``memadvisor`` and ``python -m memadvisor``)."""
    command = typer.main.get_command(app)
    _flag_help_without_placeholder(command)
    code: int | str | None = 0
    with interrupts_handled():
        try:
            command(prog_name="memadvisor")  # standalone: ends by SystemExit
        except SystemExit as e:
            code = e.code
        except KeyboardInterrupt:
            code = INTERRUPTED_EXIT_CODE
        if interrupted():
            # Outside the command's own handling (while typer parsed the arguments, which
            # turns it into a silent 130, or after the command returned): said here.
            say_interrupted(err_console)
            code = INTERRUPTED_EXIT_CODE
    sys.exit(code)


def _flag_help_without_placeholder(command: typer.core.TyperGroup) -> None:
    """Show ``--help`` as the flag it is: typer 0.26+ prints ``<bool>`` after it otherwise.

    Our own flags say ``metavar=""``; typer builds the help option itself, lazily, so its
    metavar is set here, on each command, before anything is parsed.
    """
    for cmd in [command, *command.commands.values()]:
        option = cmd.get_help_option(typer.Context(cmd))
        if option is not None:
            option.metavar = ""
