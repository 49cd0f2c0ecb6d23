"""What the planner shows while it works: one rich progress bar per stage, and notes.

``Progress(enabled=False)`` shows nothing (tests, library use that wants silence); the
planner calls the same methods either way. Each stage's wall time is kept either way
(:attr:`Progress.stage_log`; a plan's part of it becomes ``Plan.stage_wall_ms``), so a plan
says where its time went whether or not anyone watched the bars.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as _RichProgress

__all__ = ["Progress", "Stage", "stage_totals"]


def stage_totals(log: list[tuple[str, float]]) -> dict[str, float]:
    """``log``'s wall times summed per stage name, in the order each name first appears."""
    totals: dict[str, float] = {}
    for name, ms in log:
        totals[name] = totals.get(name, 0.0) + ms
    return totals


class Stage:
    """One stage's bar: ``advance()`` after each unit of work, ``describe()`` to say what."""

    def __init__(self, bar: _RichProgress | None, task: int | None) -> None:
        self._bar, self._task = bar, task

    def advance(self, n: int = 1) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, n)

    def describe(self, text: str) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=text)

    def report(self, description: str, done: int, total: int) -> None:
        """Set the bar outright: ``progress(description, done, total)`` callbacks land here."""
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=description, completed=done, total=total)


class Progress:
    """Stages (profiling, search, probes, verify) on stderr, and one-line notes."""

    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._bar: _RichProgress | None = None
        # (stage name, wall ms) of every stage block that ended, in order.
        self.stage_log: list[tuple[str, float]] = []

    def note(self, text: str) -> None:
        """One line the user should see (e.g. that the plan is for the simulated device)."""
        if self.enabled:
            self.console.print(text, highlight=False, soft_wrap=True)

    @contextlib.contextmanager
    def stage(self, description: str, total: int | None = None) -> Iterator[Stage]:
        """A bar for the duration of the block; ``total=None`` shows a spinner.

        The block's wall time goes to :attr:`stage_log` under ``description``, also when it
        raises.
        """
        started = time.perf_counter()
        try:
            with self._bar_for(description, total) as stage:
                yield stage
        finally:
            self.stage_log.append((description, (time.perf_counter() - started) * 1e3))

    @property
    def stage_wall_ms(self) -> dict[str, float]:
        """Wall time per stage name, in the order the stages first ran; a name that ran twice
        adds up."""
        return stage_totals(self.stage_log)

    @contextlib.contextmanager
    def _bar_for(self, description: str, total: int | None) -> Iterator[Stage]:
        if not self.enabled:
            yield Stage(None, None)
            return
        bar = _RichProgress(
            SpinnerColumn(),
            TextColumn("[progress.description]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=self.console,
            transient=False,
        )
        with bar:
            task = bar.add_task(description, total=total)
            stage = Stage(bar, task)
            yield stage
            if total is not None:
                bar.update(task, completed=bar.tasks[task].total)
