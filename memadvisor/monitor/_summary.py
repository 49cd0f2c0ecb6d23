"""What the Monitor tells: the epoch's summary, the printed table, the records, the timeline.

Rows are made from raw readings only when read (:meth:`Readings.digest`), so each result
here digests first; a record (pydantic) is built only for the row asked for.

Known limitations:
    * The timeline holds only the readings still in :attr:`history` and the module events of
      measured iterations still in the recorder's buffer; older ones are counted as dropped.
"""

from __future__ import annotations

import heapq

from memadvisor.monitor._output import format_bytes, iteration_table, layer_table, print_table
from memadvisor.monitor._readings import IterationHistory, to_record
from memadvisor.monitor._schema import IterationRecord
from memadvisor.timeline import Timeline, TimelineEvent

__all__ = ["MonitorResults"]


class MonitorResults:
    """The results of :class:`~memadvisor.monitor.Monitor`, read from its readings."""

    def epoch_end(self) -> IterationRecord | None:
        """Close an epoch: read memory, print the epoch's peak and the leak verdict, log an
        epoch row.

        Returns:
            The epoch's summary (peaks over its iterations, mean iteration time), or None if
            it had none.
        """
        self._read_now()
        count = self.iteration - self._epoch_first + 1
        summary = None
        r = self._readings
        if count > 0 and self._rows:
            last = self._rows[-1]
            timed = r.epoch_timed
            row = (last[0], last[1], r.epoch_ms / timed if timed else None, last[3],
                   r.epoch_peak_allocated, last[5],
                   None if r.epoch_peak_reserved < 0 else r.epoch_peak_reserved,
                   last[7], last[8], last[9], last[10], count)  # fmt: skip
            summary = to_record(row)
            if self._csv is not None:
                self._csv.pending.append(("epoch", row))
                self._flush_csv()
            if self.print_period:
                leak = self.leak
                self.console.print(
                    f"[bold]epoch {self.epoch}[/bold]: {count} iterations, peak allocated "
                    f"{format_bytes(summary.peak_allocated_bytes)}"
                    + (
                        f", peak reserved {format_bytes(summary.peak_reserved_bytes)}"
                        if summary.peak_reserved_bytes is not None
                        else ""
                    )
                    + (f"; [red]{leak.message}[/red]" if leak.flagged else "")
                )
        r.epoch += 1
        r.start_epoch()
        self._epoch_first = self.iteration + 1
        return summary

    def print(self) -> None:
        """Print the latest reading's table now."""
        self._digest()
        if not self._rows:
            return
        layers = None
        if self._layer_rows:
            if self._layer_text is None:  # laid out once per measurement, printed many times
                self._layer_text = layer_table(
                    self._layer_rows, self.layers_iteration, self.max_rows
                )
            layers = self._layer_text
        table = iteration_table(
            to_record(self._rows[-1]), layers, self.leak, model_name=self.recorder.model_name
        )
        print_table(self.console, table)

    @property
    def epoch(self) -> int:
        """The current epoch (0-based; :meth:`epoch_end` moves to the next)."""
        return self._readings.epoch

    @property
    def history(self) -> IterationHistory:
        """The latest readings' :class:`IterationRecord` s, oldest first (built when read)."""
        self._digest()
        return self._history

    @property
    def last(self) -> IterationRecord | None:
        """The latest reading's record, or None before the first."""
        self._digest()
        return to_record(self._rows[-1]) if self._rows else None

    def timeline(self) -> Timeline:
        """Readings (those still in :attr:`history`) as samples, and the measured iterations'
        module events, as one timeline."""
        self._digest()
        t0 = self.recorder.start_ns
        samples = [
            TimelineEvent(
                t_ms=(row[10] - t0) / 1e6,
                kind="sample",
                phase=f"iteration {row[0]}",
                allocated_bytes=row[3],
                reserved_bytes=row[5],
            )
            for row in list(self._rows)
        ]
        events = self.recorder.events()
        return Timeline(
            events=list(heapq.merge(events, samples, key=lambda e: e.t_ms)),
            device=self.recorder.device,
            model_name=self.recorder.model_name,
            dropped_events=self.recorder.dropped_events + self._readings.count - len(samples),
        )
