"""The typer application and the one place that turns an exception into an exit code.

Exit codes: 0 ok; 2 bad input (BadInputError, and typer's own usage errors); 3 no
configuration fits the budget (InfeasibleBudgetError); 4 planning failed (any other
MemadvisorError); 1 anything unexpected, which is a bug in memadvisor or in the model;
130 interrupted (Ctrl-C), said in one line.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from rich.text import Text

from memadvisor.cli._interrupt import (
    INTERRUPTED_EXIT_CODE,
    interrupted,
    raise_if_interrupted,
    say_interrupted,
)
from memadvisor.errors import MemadvisorError

app = typer.Typer(
    name="memadvisor",
    help="Measure a PyTorch training step and find the fastest configuration that fits a "
    "memory budget.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode="rich",
    epilog="[bold]Examples[/]\n\n"
    "  memadvisor plan examples/gpt.py:build --budget-gb 0.25 --html plan.html\n\n"
    "  memadvisor profile examples/cnn.py:build --speedscope step.speedscope.json\n\n"
    "Run memadvisor COMMAND --help for a command's options.",
)


def _version(value: bool) -> None:
    if value:
        from memadvisor._version import __version__

        typer.echo(f"memadvisor {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            metavar="",
            callback=_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """Measure a PyTorch training step and find the fastest configuration that fits a memory
    budget."""


# Progress, notes and errors go to stderr so stdout holds only the report.
err_console = Console(stderr=True)

F = TypeVar("F", bound=Callable[..., Any])

UNEXPECTED_EXIT_CODE = 1


class DeviceOption(str, Enum):
    """Where probes and verification run."""

    auto = "auto"
    cuda = "cuda"
    gpu = "gpu"
    cpu = "cpu"
    simulated = "simulated"
    estimate = "estimate"


TARGET_HELP = (
    "path/to/file.py:factory or package.module:factory; the factory returns (model, "
    "sample_batch) or a dict with 'model', 'sample_batch' and optionally 'loss_fn', "
    "'optimizer', 'make_batch', 'forward_fn'."
)
DEBUG_HELP = "Show the traceback of an error."
QUIET_HELP = "No progress bars and no full report: only the one-line answer and errors."
DEVICE_HELP = (
    "cuda (or gpu): the real card, the budget emulated with a memory fraction; cpu (or "
    "simulated): CPU tensors whose bytes are tracked against the budget; auto: cuda when there "
    "is one, else cpu; estimate: no device at all, the model built as fake tensors (no memory, "
    "any size) and planned for a CUDA card from the estimate alone. The same names as "
    "memadvisor.plan(device=...)."
)
PROFILE_DEVICE_HELP = (
    "cuda (or gpu): the real card; cpu (or simulated): CPU tensors whose bytes are tracked as "
    "they are allocated; auto: cuda when there is one, else cpu; estimate: no device at all, "
    "the model built as fake tensors (no memory, any size): bytes, no times. The same names as "
    "memadvisor.profile(device=...)."
)


def handle_errors(fn: F) -> F:
    """Turn an exception into one message on stderr and its exit code.

    A MemadvisorError exits with its class's ``exit_code``; anything else is unexpected and
    exits with 1. With ``--debug`` the traceback is printed too, and the exit code is the same.
    A Ctrl-C (KeyboardInterrupt, or any error after one: :mod:`memadvisor.cli._interrupt`)
    prints one line and exits with 130.
    """

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            with warnings.catch_warnings():
                # A library's or a strategy's warning reads as one line, not as Python's
                # "file:line: UserWarning" with a source line of torch's.
                warnings.showwarning = _show_warning
                return fn(*args, **kwargs)
        except (typer.Exit, typer.Abort, typer.BadParameter):
            # typer's own exits and usage errors carry their codes already. These three names
            # exist in every typer this package supports, whether it vendors click (0.26 and
            # later) or depends on it.
            raise
        except KeyboardInterrupt:
            # Output files are written whole or not at all (write_text), and the planner's
            # devices end their processes on the way out: saying so is all that is left.
            _say_interrupted_and_exit()
        except Exception as e:
            if interrupted():
                # A library caught the Ctrl-C and raised an error of its own instead, or the
                # cleanup after it failed: the interrupt is what ended the command.
                _say_interrupted_and_exit()
            if isinstance(e, MemadvisorError):
                _fail(str(e), e.exit_code, debug=kwargs.get("debug", False))
            _fail(
                f"unexpected {type(e).__name__}: {e}. This is a bug in memadvisor or in the "
                "model; rerun with --debug for the traceback.",
                UNEXPECTED_EXIT_CODE,
                debug=kwargs.get("debug", False),
            )

    return wrapper  # type: ignore[return-value]


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: Any = None,
    line: str | None = None,
) -> None:
    """One ``warning:`` line on stderr for a warning raised while a command runs."""
    text = Text("warning: ", style="yellow")
    text.append(str(message))
    err_console.print(text, highlight=False, soft_wrap=True)


def _say_interrupted_and_exit() -> NoReturn:
    say_interrupted(err_console)
    raise typer.Exit(INTERRUPTED_EXIT_CODE) from None


def _fail(message: str, exit_code: int, *, debug: bool) -> None:
    if debug:
        err_console.print_exception()
    _print_error(message)
    raise typer.Exit(exit_code) from None


def _print_error(message: str) -> None:
    err_console.print(
        f"[bold red]error:[/] {message}", highlight=False, markup=True, soft_wrap=True
    )


def resolve_device(device: DeviceOption) -> str:
    """``cuda``, ``simulated`` or ``estimate``: where this machine can run what was asked
    (the names of :data:`memadvisor.schema.config.DEVICE_NAMES`, aliases resolved).

    Raises:
        BadInputError: ``cuda`` was asked for on a machine without a CUDA device.
    """
    from memadvisor.schema.device import device_kind, resolved_kind

    return resolved_kind(
        device_kind(device.value, "--device"),
        refusal=f"--device {device.value}, but torch sees no CUDA device here; use --device "
        "cpu (or auto) to run on the CPU simulated device.",
    )


def announce_device(kind: str, *, quiet: bool) -> None:
    """Say in one line that the work runs on the CPU simulated device or on none, not a card."""
    if kind == DeviceOption.estimate.value and not quiet:
        err_console.print(
            "No device in use: the model is built as fake tensors (no memory) and planned for a "
            "CUDA card from the estimate alone; every figure is estimated.",
            highlight=False,
            soft_wrap=True,
        )
    if kind == DeviceOption.simulated.value and not quiet:
        err_console.print(
            "No GPU in use: running on the CPU simulated device (tensor bytes tracked as they "
            "are allocated).",
            highlight=False,
            soft_wrap=True,
        )


def out_console() -> Console:
    """The console the report prints to (stdout), made per command so tests capture it."""
    return Console()


def check_output_paths(**paths: Path | None) -> None:
    """Fail before the long work, not after it, when an output file cannot be written.

    Raises:
        BadInputError: an output's folder is missing, read-only or not writable, or the path
            is not a regular file (a folder, a device, a FIFO, an unsafe symlink:
            :mod:`memadvisor.files`).
    """
    from memadvisor.files import check_writable

    for option, path in paths.items():
        if path is not None:
            check_writable(path, "--" + option.replace("_", "-"))


def write_text(path: Path, text: str, what: str, *, quiet: bool) -> None:
    """Write an output file and say so on stderr.

    Raises:
        BadInputError: the file cannot be written.
    """
    from memadvisor.files import write_text_atomic

    raise_if_interrupted()  # a Ctrl-C that a library swallowed still leaves no output
    # Whole or not at all, through a temporary file no other user can name
    # (memadvisor.files): an interrupt or a full disk never leaves half a file behind.
    write_text_atomic(path, text, what)
    say_written(what, path, quiet=quiet)


def say_written(what: str, path: object, *, quiet: bool) -> None:
    if not quiet:
        err_console.print(f"Wrote {what} to {path}", highlight=False, soft_wrap=True)
