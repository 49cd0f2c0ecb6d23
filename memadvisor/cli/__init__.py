"""The ``memadvisor`` command: one thin module per subcommand."""

from __future__ import annotations

import sys

import typer

from memadvisor.cli._app import app

__all__ = ["app", "main"]


def main() -> None:
    """Console-script entry point (``memadvisor`` and ``python -m memadvisor``)."""
    command = typer.main.get_command(app)
    _flag_help_without_placeholder(command)
    sys.exit(command(prog_name="memadvisor"))


def _flag_help_without_placeholder(command: typer.core.TyperGroup) -> None:
    """Show ``--help`` as the flag it is: typer 0.26+ prints ``<bool>`` after it otherwise.

    Our own flags say ``metavar=""``; typer builds the help option itself, lazily, so its
    metavar is set here, on each command, before anything is parsed.
    """
    for cmd in [command, *command.commands.values()]:
        option = cmd.get_help_option(typer.Context(cmd))
        if option is not None:
            option.metavar = ""
