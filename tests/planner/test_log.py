"""The memadvisor logger carries what the planner shows: each note (markup stripped) and
each stage's start and end, whether or not the rich bars are drawn; and nothing reaches the
terminal through it unless the application configures logging."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest

from memadvisor.planner._progress import Progress


def test_notes_and_stages_are_logged_with_the_bars_off(caplog: pytest.LogCaptureFixture) -> None:
    ui = Progress(enabled=False)
    with caplog.at_level(logging.DEBUG, logger="memadvisor"):
        ui.note("[dim]planning on the simulated device[/]")
        with ui.stage("probes", total=3) as bar:
            bar.describe("probing batch 8")
            bar.describe("probing batch 8")  # the same words again: logged once
        ui.log_notes(["[dim]planning on the simulated device[/]", "a step-down"])
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "memadvisor"]
    assert lines[0] == ("INFO", "planning on the simulated device")
    assert lines[1] == ("INFO", "probes ...")
    assert lines[2] == ("DEBUG", "probing batch 8")
    assert lines[3][0] == "INFO" and lines[3][1].startswith("probes took ")
    assert lines[4:] == [("INFO", "a step-down")]  # the note already logged is not repeated


def test_the_logger_is_silent_until_the_application_configures_logging() -> None:
    """A library adds only a NullHandler: an INFO note prints nothing on its own."""
    code = (
        "from memadvisor.planner._progress import Progress\n"
        "Progress(enabled=False).note('a note')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout == "" and "a note" not in done.stderr
    configured = "import logging; logging.basicConfig(level=logging.INFO)\n" + code
    done = subprocess.run(
        [sys.executable, "-c", configured], capture_output=True, text=True, timeout=120
    )
    assert "INFO:memadvisor:a note" in done.stderr


def test_outside_a_terminal_each_stage_and_description_is_a_line_as_it_happens() -> None:
    """Rule: where the console is not a terminal (a pipe, a log file, CI), a stage's start and
    each new description are printed as lines while the stage runs, not when it ends (rich's
    bar drew nothing there until it stopped), each with the seconds since the plan began."""
    import io
    import re

    from rich.console import Console

    out = io.StringIO()
    ui = Progress(console=Console(file=out, force_terminal=False))
    with ui.stage("compile", total=None) as bar:
        bar.describe("compiling candidate 1/4 (checkpoint 4/4 blocks): batch 10 running")
        so_far = out.getvalue()
        bar.describe("compiling candidate 1/4 (checkpoint 4/4 blocks): batch 10 running")
    lines = out.getvalue().splitlines()
    assert "compile ..." in so_far
    assert "compiling candidate 1/4 (checkpoint 4/4 blocks): batch 10 running" in so_far
    assert len(lines) == 3, lines  # the repeated description printed once
    assert all(re.match(r"\[\s*\d+\.\ds\] ", line) for line in lines), lines
    assert re.search(r"compile took \S+", lines[-1])


def test_outside_a_terminal_a_step_reported_as_it_begins_and_ends_is_one_line() -> None:
    """Rule: ``report`` calls that keep the description (a profiling step's begin and end)
    print one line; a new description prints the next."""
    import io

    from rich.console import Console

    out = io.StringIO()
    ui = Progress(console=Console(file=out, force_terminal=False))
    with ui.stage("profiling", total=2) as bar:
        bar.report("profiling: warm-up step, fp32, batch 16", 0, 2)
        bar.report("profiling: warm-up step, fp32, batch 16", 1, 2)
        bar.report("profiling: metered step, fp32, batch 8", 1, 2)
        bar.report("profiling: metered step, fp32, batch 8", 2, 2)
    steps = [line for line in out.getvalue().splitlines() if "step," in line]
    assert len(steps) == 2, steps
    assert steps[0].endswith("warm-up step, fp32, batch 16 (0/2)")


def test_each_checked_strategys_screen_logs_its_seconds(caplog: pytest.LogCaptureFixture) -> None:
    """Rule: the screening stage logs at DEBUG how long each checked strategy's screen took,
    by its name (a card plan's screen of 33 s was placed only once its parts were timed)."""
    from memadvisor.planner._plan import _screened
    from memadvisor.schema.config import PlanConfig
    from strategies.loss_head import LossHead
    from tests.planner.conftest import FakePrecision, make_profile, tiny_workload

    with caplog.at_level(logging.DEBUG, logger="memadvisor"):
        checks = _screened(
            [FakePrecision(), LossHead()], tiny_workload(), make_profile(),
            PlanConfig(budget_bytes=2**30),
        )  # fmt: skip
    assert checks == []  # the tiny model's loss is not a head's: nothing to offer or say
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("screening: ")]
    assert len(said) == 1 and said[0].startswith("screening: loss_head took ")
