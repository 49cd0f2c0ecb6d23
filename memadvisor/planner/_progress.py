"""What the planner shows while it works: one rich progress bar per stage, and notes.

``Progress(enabled=False)`` shows nothing (tests, library use that wants silence); the
planner calls the same methods either way. Enabled or not, every note, every stage's start
and end (with its wall time) and each bar's description go to the ``memadvisor`` logger
(:mod:`memadvisor._log`), where an application that configures logging sees them. Each
stage's wall time is kept either way (:attr:`Progress.stage_log`; a plan's part of it
becomes ``Plan.stage_wall_ms``), so a plan says where its time went whether or not anyone
watched the bars.

Outside a terminal (a log file, a pipe, CI) rich would draw a bar only when it stops, so a
stage of minutes showed nothing while it ran: there each stage's start, every new
description ("compiling candidate 2/4 (...): batch 10 running") and its end are printed as
lines, each with the seconds since the plan started.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.progress import Progress as _RichProgress

from memadvisor._log import logger, plain
from memadvisor.schema.plan import Plan
from memadvisor.units import fmt_ms

__all__ = ["Progress", "Stage", "log_pick", "stage_totals"]


def log_pick(plan: Plan) -> None:
    """The plan's pick in one INFO line of the ``memadvisor`` logger."""
    cand = plan.candidate
    choices = ", ".join(f"{k}={v}" for k, v in cand.choices.items() if v not in (None, [], "off"))
    logger.info(
        "plan for %s on %s: batch %d x %d accumulation, %s; planning took %s",
        plan.model_name,
        plan.device_name,
        cand.batch_size,
        cand.accumulation_steps,
        choices or "no strategy",
        fmt_ms(plan.plan_wall_ms),
    )


def stage_totals(log: list[tuple[str, float]]) -> dict[str, float]:
    """``log``'s wall times summed per stage name, in the order each name first appears."""
    totals: dict[str, float] = {}
    for name, ms in log:
        totals[name] = totals.get(name, 0.0) + ms
    return totals


class Stage:
    """One stage's bar: ``advance()`` after each unit of work, ``describe()`` to say what."""

    def __init__(
        self,
        bar: _RichProgress | None,
        task: int | None,
        echo: Callable[[str], None] | None = None,
    ) -> None:
        self._bar, self._task = bar, task
        self._said = ""  # the last description logged: a bar redrawn with it logs nothing
        self._echo = echo  # a line per new description, where no bar can be drawn
        self._echoed = ""

    def advance(self, n: int = 1) -> None:
        if self._bar is not None and self._task is not None:
            self._bar.advance(self._task, n)

    def describe(self, text: str) -> None:
        self._log(text)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=text)

    def report(self, description: str, done: int, total: int) -> None:
        """Set the bar outright: ``progress(description, done, total)`` callbacks land here."""
        self._log(f"{description} ({done}/{total})", echo_key=description)
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, description=description, completed=done, total=total)

    def _log(self, text: str, echo_key: str | None = None) -> None:
        if text != self._said:
            self._said = text
            logger.debug("%s", plain(text))
            # A line per new description: a step reported as it begins and as it ends is
            # one line, not two.
            key = text if echo_key is None else echo_key
            if self._echo is not None and key != self._echoed:
                self._echoed = key
                self._echo(plain(text))


class Progress:
    """Stages (profiling, search, probes, verify) on stderr, and one-line notes."""

    def __init__(self, enabled: bool = True, console: Console | None = None) -> None:
        self.enabled = enabled
        self.console = console or Console(stderr=True)
        self._bar: _RichProgress | None = None
        # (stage name, wall ms) of every stage block that ended, in order.
        self.stage_log: list[tuple[str, float]] = []
        self._noted: set[str] = set()
        self._started = time.perf_counter()

    def note(self, text: str) -> None:
        """One line the user should see (e.g. that the plan is for the simulated device);
        logged at INFO whether or not the console shows it."""
        self._noted.add(text)
        logger.info("%s", plain(text))
        if self.enabled:
            self.console.print(text, highlight=False, soft_wrap=True)

    def log_notes(self, notes: list[str]) -> None:
        """Log at INFO each of a plan's notes that :meth:`note` has not: the log then holds
        every note the plan carries (the console shows them in the report)."""
        for text in notes:
            if text not in self._noted:
                self._noted.add(text)
                logger.info("%s", plain(text))

    @contextlib.contextmanager
    def stage(self, description: str, total: int | None = None) -> Iterator[Stage]:
        """A bar for the duration of the block; ``total=None`` shows a spinner.

        The block's wall time goes to :attr:`stage_log` under ``description``, also when it
        raises.
        """
        started = time.perf_counter()
        logger.info("%s ...", description)
        try:
            with self._bar_for(description, total) as stage:
                yield stage
        finally:
            wall_ms = (time.perf_counter() - started) * 1e3
            self.stage_log.append((description, wall_ms))
            logger.info("%s took %s", description, fmt_ms(wall_ms))

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
        if not self.console.is_terminal:
            # Rich draws a bar outside a terminal only when it stops: a log file or a pipe
            # would show nothing of a stage that takes minutes (a slow compile). Lines instead,
            # as things happen.
            self._line(f"{description} ...")
            started = time.perf_counter()
            try:
                yield Stage(None, None, echo=lambda text: self._line(f"  {text}"))
            finally:
                took = fmt_ms((time.perf_counter() - started) * 1e3)
                self._line(f"{description} took {took}")
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

    def _line(self, text: str) -> None:
        elapsed = time.perf_counter() - self._started
        self.console.print(f"[{elapsed:6.1f}s] {text}", markup=False, highlight=False)
