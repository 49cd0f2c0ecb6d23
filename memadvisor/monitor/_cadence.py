"""When the Monitor reads the allocator's counters: every ``counter_period`` iterations,
chosen from the measured cost of a reading and the loop's time per iteration.

A reading on CUDA costs about 20 us (one stats call and one peak reset); where a step takes a
few milliseconds that is more than the ``counter_budget`` share of the loop, so the period
grows until it is not. The monitor's own time is counted here too (readings, and the busy
readings that print, measure or write), since it is what the choice is made from.

Known limitations:
    * The period is re-chosen every 64 iterations or so (8 periods); a loop whose step time
      changes faster than that is read at the previous choice's period meanwhile.
    * Only the monitor's own time is left out of the loop's time; another tool's hooks in the
      same loop count as the loop.
"""

from __future__ import annotations

import math
import time

__all__ = ["MAX_COUNTER_PERIOD", "NEVER", "CounterCadence", "clock"]

NEVER = 1 << 62  # a perf_counter_ns deadline that never comes
# Counters read at least once every this many iterations, whatever they cost.
MAX_COUNTER_PERIOD = 100
clock = time.perf_counter_ns


class CounterCadence:
    """The Monitor's choice of ``counter_period`` and the account of its own time.

    A part of :class:`~memadvisor.monitor.Monitor` (it reads the monitor's readings and
    source); kept apart because it is a decision of its own, made from timings.
    """

    def _init_cadence(self, counter_period: int | None, counter_budget: float) -> None:
        self.counter_budget = counter_budget
        self.counter_period = counter_period or 1
        self._auto_counters = counter_period is None and self.source.costly_reads
        # The monitor's own time, for the choice of counter_period: readings' (own; with the
        # leak check's, which memory that moves at every reading calls each time), the
        # busy readings' (slow: printed, measured, writing or choosing ones), how many of
        # those, and where the current measuring window started.
        self._own_ns = 0
        self._slow_ns = 0
        self._slow_reads = 0
        self._window: tuple[int, int, int, int, int, int] | None = None
        self._next_window = 1

    @property
    def own_ms(self) -> float:
        """The monitor's own time so far: its readings and what they led to (rows, tables,
        CSV lines, layer hooks installed and summarised). Not counted: the calls between
        readings (a comparison each) and the hooks' time inside a measured step."""
        return (self._own_ns + self._slow_ns) / 1e6

    def _choose_counter_period(self, it: int, now: int) -> None:
        """With counter_period=None on a card: read every ``ceil(R / (budget * T))``
        iterations, R the measured cost of a plain reading, T the loop's time per iteration
        (the monitor's own time left out), both over the window since the last choice: the
        readings between the start of that choice's reading and the start of this one."""
        reads = self._readings.count
        window = (it, now, reads, self._slow_reads, self._own_ns, self._slow_ns)
        if not self._auto_counters:
            self._next_window = NEVER
            return
        if self._window is not None:
            it0, ns0, reads0, slow_reads0, own0, slow0 = self._window
            plain = (reads - reads0) - (self._slow_reads - slow_reads0)  # not busy
            own = self._own_ns - own0
            loop_ns = (now - ns0) - own - (self._slow_ns - slow0)
            if plain > 0 and loop_ns > 0:
                per_reading = own / plain
                per_iteration = loop_ns / (it - it0)
                period = math.ceil(per_reading / (self.counter_budget * per_iteration))
                self.counter_period = min(MAX_COUNTER_PERIOD, max(1, period))
            # The first window is short, to leave every-iteration reading early.
            self._next_window = it + max(64, 8 * self.counter_period)
        else:
            self._next_window = it + 16
        self._window = window
