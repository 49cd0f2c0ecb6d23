"""The monitor's readings: raw counter readings, the rows made of them, the records read.

record() keeps only a raw reading; the rows (and CSV lines, and epoch totals) are made of
them in batches (:meth:`Readings.digest`), and a row becomes an :class:`IterationRecord` only
when someone reads it (:class:`IterationHistory`): a pydantic model costs more to build than
the rest of record().
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import overload

from memadvisor.monitor._output import CsvLog
from memadvisor.monitor._schema import IterationRecord

__all__ = ["IterationHistory", "NO_TOTALS", "Readings", "to_record"]

# A row, kept instead of an IterationRecord (a pydantic model costs more to build than the
# rest of record()): (iteration, epoch, iteration_ms, allocated, peak allocated, reserved,
# peak reserved, totals, layers measured, leak flagged, perf_counter_ns at record(),
# iterations covered), with totals = (weights, grads, saved activations, optimizer state,
# other) from the latest measured iteration. The same tuple is the CSV line (csv_row) and the
# timeline sample. record() itself keeps only a raw reading, (iteration, perf_counter_ns at
# record(), end of the previous reading's record(), allocated, peak allocated, reserved, peak
# reserved), turned into rows in batches (_digest) by the rare record() that changes what the
# rows hold (a measured, printed or growing iteration) or when someone reads them.
NO_TOTALS: tuple[None, ...] = (None, None, None, None, None)


def to_record(row: tuple) -> IterationRecord:
    it, epoch, ms, allocated, peak, reserved, peak_reserved, totals, measured, _, _, span = row
    weights, grads, saved, optimizer, other = totals
    return IterationRecord(
        iteration=it,
        epoch=epoch,
        iterations=span,
        iteration_ms=ms,
        allocated_bytes=allocated,
        peak_allocated_bytes=peak,
        reserved_bytes=reserved,
        peak_reserved_bytes=peak_reserved,
        weight_bytes=weights,
        grad_bytes=grads,
        saved_activation_bytes=saved,
        optimizer_state_bytes=optimizer,
        other_bytes=other,
        layers_measured=measured,
    )


class IterationHistory(Sequence[IterationRecord]):
    """The latest iterations as :class:`IterationRecord` s, each built when it is read."""

    def __init__(self, rows: deque[tuple]) -> None:
        self._rows = rows

    def __len__(self) -> int:
        return len(self._rows)

    @overload
    def __getitem__(self, index: int) -> IterationRecord: ...
    @overload
    def __getitem__(self, index: slice) -> list[IterationRecord]: ...
    def __getitem__(self, index: int | slice) -> IterationRecord | list[IterationRecord]:
        if isinstance(index, slice):
            return [to_record(r) for r in list(self._rows)[index]]
        return to_record(self._rows[index])

    def __iter__(self) -> Iterator[IterationRecord]:
        return (to_record(r) for r in list(self._rows))


class Readings:
    """Raw readings, the rows made of them and the epoch's running numbers.

    Holds no reference to the monitor, so that a finalizer can make and write the last rows
    of a monitor that is collected (or an interpreter that exits) without being closed.
    """

    def __init__(self, history: int, csv: CsvLog | None) -> None:
        self.raw: list[tuple] = []  # readings not yet made into rows
        self.rows: deque[tuple] = deque(maxlen=history)
        self.csv = csv
        self.pending = csv.pending if csv is not None else None  # appended without a call
        self.epoch = 0
        self.totals: tuple = NO_TOTALS  # of the latest measured iteration
        self.flagged = False  # the leak check's flag at the latest reading
        self.read_it = 0  # the iteration of the latest reading made into a row
        self.count = 0  # readings made into rows
        self.start_epoch()

    def start_epoch(self) -> None:
        self.epoch_ms = 0.0
        self.epoch_timed = 0  # iterations with a time (all but a run's first)
        self.epoch_peak_allocated = 0
        self.epoch_peak_reserved = -1  # none seen (the CPU has no reserve)

    def last_iteration(self) -> int:
        """The iteration of the latest reading, raw or not."""
        return self.raw[-1][0] if self.raw else self.read_it

    def digest(self) -> None:
        """Make rows of the readings that are still raw."""
        raw = self.raw
        if raw:
            for reading in raw:
                self.add(reading, False)
            raw.clear()

    def add(self, reading: tuple, measured: bool) -> tuple:
        """Make one reading a row (with the current totals, flag and epoch)."""
        it, now, prev_end, allocated, peak, reserved, peak_reserved = reading
        if peak < allocated:
            peak = allocated
        span = it - self.read_it
        self.read_it = it
        ms = None if prev_end is None else (now - prev_end) / (1e6 * span)
        row = (it, self.epoch, ms, allocated, peak, reserved, peak_reserved, self.totals,
               measured, self.flagged, now, span)  # fmt: skip
        self.rows.append(row)
        self.count += 1
        if peak > self.epoch_peak_allocated:
            self.epoch_peak_allocated = peak
        if peak_reserved is not None and peak_reserved > self.epoch_peak_reserved:
            self.epoch_peak_reserved = peak_reserved
        if ms is not None:
            self.epoch_ms += ms * span
            self.epoch_timed += span
        if self.pending is not None:
            self.pending.append(row)
        return row

    def close(self) -> None:
        """Make rows of the raw readings and write every queued CSV line."""
        self.digest()
        if self.csv is not None:
            self.csv.close()
