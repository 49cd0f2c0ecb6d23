"""Reporting a profiling pass's progress to a callback or a rich ``Progress``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from memadvisor.errors import BadInputError

__all__ = ["ProgressArg", "ProgressReporter"]

# progress(description, steps_done, steps_total), or a rich.progress.Progress (a task is added).
ProgressCallback = Callable[[str, int, int], None]
ProgressArg = ProgressCallback | Any | None


class ProgressReporter:
    """Counts the pass's steps and forwards each to the caller's callback or rich bar.

    Raises:
        BadInputError: ``progress`` is neither None, a callable, nor a rich ``Progress``.
    """

    def __init__(self, progress: ProgressArg, total: int) -> None:
        self.total = total
        self.done = 0
        self._callback: ProgressCallback | None = None
        self._rich: Any = None
        self._task: Any = None
        if progress is None:
            return
        if hasattr(progress, "add_task") and hasattr(progress, "update"):
            self._rich = progress
            self._task = progress.add_task("profiling", total=total)
        elif callable(progress):
            self._callback = progress
        else:
            raise BadInputError(
                "progress must be None, a callable progress(description, done, total) or a "
                f"rich.progress.Progress, but got {type(progress).__name__}."
            )

    def begin(self, description: str) -> None:
        """A step starts (shown with the count done so far)."""
        self._emit(description)

    def advance(self, description: str) -> None:
        """A step finished."""
        self.done += 1
        self._emit(description)

    def _emit(self, description: str) -> None:
        if self._callback is not None:
            self._callback(description, self.done, self.total)
        elif self._rich is not None:
            self._rich.update(self._task, description=description, completed=self.done)
