"""The Monitor's leak decisions: when memory that keeps rising is flagged, and which
layers' tensors are named as suspects.

The leak check itself (:class:`~memadvisor.monitor.LeakCheck`) counts rises; here the
monitor turns its count into a verdict at the latest reading and looks the suspects up in
the latest measured iteration at least two readings old, once per measured iteration, so
that a flagged run costs nothing per iteration.

Known limitations:
    * Suspects come only from measured iterations; until one has been measured after the
      rises began, a flagged leak names no layer.
"""

from __future__ import annotations

from memadvisor.monitor._leak import LeakCheck
from memadvisor.monitor._schema import LeakReport, LeakSuspect

__all__ = ["LeakWatch"]


class LeakWatch:
    """The leak verdict and its suspects, a part of :class:`~memadvisor.monitor.Monitor`."""

    def _init_leak(self, leak_window: int) -> None:
        self.leak_check = LeakCheck(leak_window)
        self._leak_cache: tuple[int, LeakReport] | None = None
        # The latest bytes the leak check counted; -1 while it counts rises, so that the next
        # reading goes to it whatever it reads (a flat one ends the run of rises).
        self._leak_last: int | None = None
        self._suspects: list[LeakSuspect] = []  # of the latest flagged reading
        self._suspects_key: int | None = None  # the measured iteration they come from

    @property
    def leak(self) -> LeakReport:
        """The leak check's verdict at the latest reading, naming suspects when flagged."""
        if self._leak_cache is not None and self._leak_cache[0] == self.iteration:
            return self._leak_cache[1]
        check = self.leak_check
        if not check.rises:
            report = LeakReport(flagged=False, iterations=0, growth_bytes=0)
        else:
            report = check.report(self._suspects if self._readings.flagged else [])
        self._leak_cache = (self.iteration, report)
        return report

    def _on_growth(self, rises: int) -> None:
        """Memory ended this reading higher (or a flagged run just ended): update the flag
        and, when flagged, the suspects."""
        flagged = rises >= self.leak_check.window and self.leak_check.flagged
        self._readings.flagged = flagged
        if flagged:
            self._update_suspects()
        else:
            self._suspects_key = None  # a new run of rises looks its suspects up afresh

    def _update_suspects(self) -> None:
        # A tensor from an iteration at least two records back has outlived the loop's own
        # variables (the last output and loss are still referenced at record()). Looked up
        # once per measured iteration, not on every flagged reading: O(1) per iteration.
        probe = next((p for p in reversed(self._probes) if p.iteration <= self.iteration - 2), None)
        key = None if probe is None else probe.iteration
        if key != self._suspects_key:
            self._suspects_key = key
            self._suspects = [] if probe is None else probe.survivors()
