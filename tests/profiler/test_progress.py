"""memadvisor.profiler._progress.ProgressReporter: a callback or a rich bar, nothing else."""

from __future__ import annotations

import io

import pytest
from rich.console import Console
from rich.progress import Progress

from memadvisor.errors import BadInputError
from memadvisor.profiler._progress import ProgressReporter


def test_a_rich_bar_gets_a_task_that_ends_complete() -> None:
    """The reporter adds one task with the pass's total and advances it to the end."""
    bar = Progress(console=Console(file=io.StringIO()))
    reporter = ProgressReporter(bar, total=3)
    for step in ("a", "b", "c"):
        reporter.begin(step)
        reporter.advance(step)
    (task,) = bar.tasks
    assert task.total == 3 and task.completed == 3 and task.description == "c"


def test_a_callback_sees_each_step_begin_and_end() -> None:
    """begin reports the count so far; advance the count with this step done."""
    seen = []
    reporter = ProgressReporter(lambda what, done, total: seen.append((what, done, total)), 2)
    reporter.begin("x")
    reporter.advance("x")
    assert seen == [("x", 0, 2), ("x", 1, 2)]


def test_anything_else_is_refused() -> None:
    """A non-callable that is not a rich Progress is bad input, named in the message."""
    with pytest.raises(BadInputError, match="int"):
        ProgressReporter(3, total=1)
