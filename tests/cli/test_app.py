"""Exit codes and error messages: one place turns every exception into both."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from memadvisor import __version__
from memadvisor.cli._app import handle_errors
from memadvisor.errors import BadInputError, InfeasibleBudgetError, PlanningError


def _app_raising(error: Exception) -> typer.Typer:
    app = typer.Typer()

    @app.command()
    @handle_errors
    def run(debug: bool = typer.Option(False, "--debug")) -> None:
        raise error

    return app


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (BadInputError("bad target"), 2),
        (InfeasibleBudgetError("needs 3 GiB"), 3),
        (PlanningError("probes disagree"), 4),
        (ZeroDivisionError("division by zero"), 1),  # unexpected: a bug
    ],
)
def test_each_error_kind_has_its_exit_code_and_one_line_on_stderr(
    error: Exception, code: int
) -> None:
    result = CliRunner().invoke(_app_raising(error), [], env={"COLUMNS": "200"})
    assert result.exit_code == code
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(error) in lines[0]
    assert "Traceback" not in result.stderr


def test_a_warning_while_a_command_runs_is_one_line_on_stderr() -> None:
    """A strategy's UserWarning (checkpointing a layer with a KV cache) prints as one
    'warning:' line, without Python's file:line prefix or a source line of torch's."""
    import warnings

    app = typer.Typer()

    @app.command()
    @handle_errors
    def run(debug: bool = typer.Option(False, "--debug")) -> None:
        warnings.warn("GPT2Block is checkpointed while training with a KV cache [1]", stacklevel=1)

    result = CliRunner().invoke(app, [], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert result.stderr.strip().splitlines() == [
        "warning: GPT2Block is checkpointed while training with a KV cache [1]"
    ]
    assert warnings.showwarning.__module__ == "warnings"  # put back after the command


def test_an_unexpected_error_is_named_and_points_to_debug() -> None:
    result = CliRunner().invoke(_app_raising(KeyError("x")), [], env={"COLUMNS": "200"})
    assert "unexpected KeyError" in result.stderr and "--debug" in result.stderr


def test_debug_adds_the_traceback_and_keeps_the_exit_code() -> None:
    result = CliRunner().invoke(_app_raising(BadInputError("bad target")), ["--debug"])
    assert result.exit_code == 2
    assert "Traceback" in result.stderr and "error: bad target" in result.stderr


def test_the_installed_command_exits_with_the_code_in_a_real_process(tmp_path) -> None:
    """The console script's path (python -m memadvisor.cli), not only the in-process runner."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "memadvisor.cli",
            "plan",
            "no/such/file.py:build",
            "--budget-gb",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().startswith("error: No such file: 'no/such/file.py'")


def test_top_level_help_ends_with_examples_and_version_prints(cli) -> None:
    result = cli("--help")
    assert result.exit_code == 0
    assert result.stdout.index("Examples") > result.stdout.index("profile")
    assert "memadvisor plan examples/gpt.py:build --budget-gb 0.25" in result.stdout
    version = cli("--version")
    assert version.exit_code == 0 and version.stdout.strip() == f"memadvisor {__version__}"


def _help_in_a_real_process(*args: str, columns: int = 100) -> str:
    """``python -m memadvisor ... --help`` as a user runs it, not on a terminal."""
    proc = subprocess.run(
        [sys.executable, "-m", "memadvisor", *args, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": str(columns), "TERM": "dumb"},
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_python_dash_m_memadvisor_is_the_memadvisor_command() -> None:
    """``python -m memadvisor`` runs the same app, with the same exit codes and usage name."""
    proc = subprocess.run(
        [sys.executable, "-m", "memadvisor", "plan", "no/such/file.py:build", "--budget-gb", "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error: No such file: 'no/such/file.py'")
    assert "Usage: memadvisor plan" in _help_in_a_real_process("plan")


@pytest.mark.parametrize("command", ["plan", "profile"])
def test_help_names_the_target_lists_choices_and_shows_flags_without_a_type(command: str) -> None:
    """Under current typer: TARGET, the allowed values of --device (and --objective), and no
    ``<bool>`` after a flag (typer prints one unless told otherwise)."""
    text = _help_in_a_real_process(command, columns=200)  # wide: a value list is not wrapped
    assert "TARGET" in text and "{target}" not in text
    assert "<bool>" not in text
    assert "<auto|cuda|gpu|cpu|simulated|estimate>" in text
    if command == "plan":
        assert "<throughput|largest_batch|effective_batch>" in text


def _suggested_budgets(text: str) -> set[tuple[str, str]]:
    return set(re.findall(r"examples/(\w+)\.py:build --budget-gb ([\d.]+)", text))


def test_every_suggested_budget_for_an_example_is_the_one_the_readme_gives() -> None:
    """The examples' docstrings and ``--help``'s examples suggest budgets the README also
    gives, so a user who follows any of them meets the same plan."""
    root = Path(__file__).resolve().parents[2]
    readme = _suggested_budgets((root / "README.md").read_text(encoding="utf-8"))
    readme |= {
        (m, b)
        for m, b in re.findall(
            r"examples/(\w+)\.py:build --budget-gb [\d.]+` on a GPU, or\s+`--budget-gb ([\d.]+)`",
            (root / "README.md").read_text(encoding="utf-8"),
        )
    }
    elsewhere = {
        path.name: _suggested_budgets(path.read_text(encoding="utf-8"))
        for path in sorted((root / "examples").glob("*.py"))
    }
    elsewhere["plan --help"] = _suggested_budgets(_help_in_a_real_process("plan"))
    elsewhere["--help"] = _suggested_budgets(_help_in_a_real_process())
    assert readme, "the README suggests no budget for any example"
    disagreeing = {where: found - readme for where, found in elsewhere.items() if found - readme}
    assert not disagreeing, f"budgets the README does not give: {disagreeing}; README: {readme}"


USERS_EXIT_FACTORY = """
import atexit, threading, time
from pathlib import Path
import torch
from torch import nn

HERE = Path(__file__).parent


class Finalized:
    def __del__(self):
        (HERE / "finalized").write_text("module teardown ran")


KEPT = Finalized()  # alive until Python's teardown frees this module


def build():
    def late():  # a non-daemon thread of the user's, still running when the plan ends
        time.sleep(1.0)
        (HERE / "thread").write_text("done")

    threading.Thread(target=late).start()
    atexit.register(lambda: (HERE / "atexit").write_text("ran"))
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    batch = (torch.randn(4, 8), torch.randn(4, 4))
    loss = lambda out, b: nn.functional.mse_loss(out, b[1])  # noqa: E731
    forward = lambda m, b: m(b[0])  # noqa: E731
    return {"model": model, "sample_batch": batch, "loss_fn": loss, "forward_fn": forward}
"""


def test_the_command_ends_after_the_users_threads_and_exit_handlers_but_skips_teardown(
    tmp_path,
) -> None:
    """Rule: ``memadvisor plan`` ends without freeing every module (Python's teardown of
    torch took 1.8 s of a plan on a card), but as Python's own exit would for whatever the
    user's code waits on: a non-daemon thread their factory started finishes, and their exit
    handlers run, before the exit code 0."""
    factory = tmp_path / "users_exit.py"
    factory.write_text(USERS_EXIT_FACTORY)
    proc = subprocess.run(
        [sys.executable, "-m", "memadvisor", "plan", f"{factory}:build", "--budget-gb", "0.5",
         "--device", "estimate", "--json", str(tmp_path / "plan.json")],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "200"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "plan.json").exists()
    assert (tmp_path / "thread").read_text() == "done"  # waited for, as Python waits
    assert (tmp_path / "atexit").read_text() == "ran"
    assert not (tmp_path / "finalized").exists()  # the teardown was skipped
