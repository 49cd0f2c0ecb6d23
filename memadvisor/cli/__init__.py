"""The ``memadvisor`` command: one thin module per subcommand."""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from typing import NoReturn

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
    if code == INTERRUPTED_EXIT_CODE:
        _exit_now(code)
    _end(code)


def _end(code: int | str | None) -> NoReturn:
    """End the command as ``sys.exit(code)`` would, without freeing every module of torch.

    Why: after a plan, Python's finalization took 2.81 s of the GPT example's 82.7 s process
    on an H200, 0.98 s ending as :func:`_exit_now` does (``bench/plan_edges.py``,
    docs/design.md "A plan's edges"); the issue asks for a plan in a minute, the exit
    included. Everything a user's own code may be waiting on still happens, in Python's
    order: the threads that are not daemons are waited for (and executors finish the work
    queued on them: ``threading._shutdown``), then the exit handlers run (a logging file's
    flush, ``weakref.finalize`` callbacks, inductor's compile workers shut) and the streams
    are flushed. A message (``sys.exit("...")``) is printed to stderr with exit code 1, as
    Python prints it.

    Known limitations:
        * Objects still alive at exit are not finalized: a file the user's factory opened
          and never closed or flushed loses what it buffered (Python's teardown would have
          flushed it). Close or flush files; a ``logging`` handler is flushed (its exit
          handler).
    """
    if code is None:
        code = 0
    elif not isinstance(code, int):
        print(code, file=sys.stderr)  # as Python's exit prints sys.exit's message
        code = 1
    shutdown = getattr(threading, "_shutdown", None)
    if shutdown is None:  # no such step in this Python: its own exit, as before
        sys.exit(code)
    shutdown()  # the non-daemon threads joined, executors' queued work done
    _exit_now(code)


def _exit_now(code: int) -> NoReturn:
    """End an interrupted command without Python's finalization: the devices' processes and
    folders are gone already (their ``finally`` blocks ran on the way up), and freeing every
    module of torch took 3.4 to 4.3 s after ``import torch`` on a loaded 2-core machine
    (docs/design.md), which a user who pressed Ctrl-C waits through. The exit handlers still
    run and the streams are flushed."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def _flag_help_without_placeholder(command: typer.core.TyperGroup) -> None:
    """Show ``--help`` as the flag it is: typer 0.26+ prints ``<bool>`` after it otherwise.

    Our own flags say ``metavar=""``; typer builds the help option itself, lazily, so its
    metavar is set here, on each command, before anything is parsed.
    """
    for cmd in [command, *command.commands.values()]:
        option = cmd.get_help_option(typer.Context(cmd))
        if option is not None:
            option.metavar = ""
