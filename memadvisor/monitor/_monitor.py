"""Monitor: memory per iteration and per layer inside the user's own training loop."""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

import torch
from rich.console import Console
from rich.text import Text
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.memory import unique_storage_bytes
from memadvisor.monitor._leak import LeakCheck
from memadvisor.monitor._output import (
    CsvLog,
    default_console,
    format_bytes,
    iteration_table,
    layer_csv_row,
    layer_table,
    print_table,
)
from memadvisor.monitor._probe import LayerProbe, LayerRow, ProbeResult
from memadvisor.monitor._schema import IterationRecord, LayerMemory, LeakReport, LeakSuspect
from memadvisor.monitor._source import MemorySource, MeterSource, source_for
from memadvisor.timeline import ModuleEventRecorder, Timeline, TimelineEvent

__all__ = ["Monitor"]

# A raw iteration row, kept instead of an IterationRecord (a pydantic model costs more to build
# than the rest of record()): (iteration, epoch, iteration_ms, allocated, peak allocated,
# reserved, peak reserved, totals, layers measured, leak flagged, perf_counter_ns at record()),
# with totals = (weights, grads, saved activations, optimizer state, other) from the latest
# measured iteration. The same tuple is the iteration's CSV line (csv_row) and timeline sample.
_NO_TOTALS: tuple[None, ...] = (None, None, None, None, None)


def _to_record(row: tuple) -> IterationRecord:
    it, epoch, ms, allocated, peak, reserved, peak_reserved, totals, measured, _, _ = row
    weights, grads, saved, optimizer, other = totals
    return IterationRecord(
        iteration=it,
        epoch=epoch,
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
            return [_to_record(r) for r in list(self._rows)[index]]
        return _to_record(self._rows[index])

    def __iter__(self) -> Iterator[IterationRecord]:
        return (_to_record(r) for r in list(self._rows))


class Monitor:
    """Watches memory in a training loop: call :meth:`record` once per iteration.

    An iteration costs one reading of the allocator's counters (allocated, reserved and their
    peaks, one stats call on CUDA) and a few tuple appends: records, CSV lines and the leak
    check are kept raw and turned into models, lines and verdicts only when read, printed or
    flushed. Per-layer numbers (weights, gradients, saved activations, other intermediates,
    time) are measured on printed iterations, by hooks installed for that one iteration, so
    the loop runs unhooked the rest of the time: on the first printed iteration, then on as
    many as keep their cost within ``layer_budget`` of the loop's time (every one, where the
    card hides the hooks' CPU time behind a long step; every tenth or fewer for a small
    model whose step is all CPU time). Tables in between show the latest measured layers. A
    leak check flags allocated memory that ends each iteration higher, and names the layers
    whose tensors outlive their iteration.

    On CUDA the allocator's counters are read, and its peak counters are reset at every
    record() (and at every hook on measured iterations) to give per-iteration peaks: code
    that reads ``torch.cuda.max_memory_allocated`` itself sees peaks since the last record().
    On the CPU bytes are tracked by a
    :class:`~memadvisor.memory.MemoryMeter`, which only sees what runs inside it: run the
    loop inside ``with monitor:`` (harmless, and the same code, on CUDA).

    CSV lines are written in batches: on printed iterations, at :meth:`epoch_end`, at
    :meth:`close` (and the end of ``with monitor:``), at the first record() ``csv_flush_s``
    after the last write, and when the monitor is collected or the interpreter exits. Only a
    process killed outright (SIGKILL) loses lines, those of the last ``csv_flush_s`` or so.

    Args:
        model: the model being trained.
        print_period: print a table every this many iterations (0: never).
        csv: append one row per iteration (and per layer on measured iterations) here.
        optimizer: counted as optimizer state in the totals (and adopted by the CPU meter).
        layers: measure per-layer numbers on printed iterations: the first one, then as
            often as ``layer_budget`` allows (every printed one where a step is long enough).
        layer_period: measure layers exactly every this many iterations instead (0: never).
        layer_budget: share of the loop's time that per-layer measurement may take, on
            average. A measured iteration that cost the loop ``C`` ms more than its typical
            ``T`` ms iteration (hooks, summary, table) is followed by at least
            ``C / (layer_budget * T)`` unmeasured ones, up to the next printed iteration.
        leak_window: consecutive growing iterations that flag a leak.
        max_events: bound of the buffer of module events (those of measured iterations).
        max_rows: most layers in a printed table.
        console: where tables go; stderr if None.
        history: iterations kept in :attr:`history` (and as timeline samples).
        csv_flush_s: CSV lines wait in memory at most about this long (see above).
        source: where memory is read; from the model's device if None (the CUDA allocator,
            or a CPU meter). Benchmarks pass a no-op one to time the monitor itself.

    Attributes:
        history: the latest iterations' :class:`IterationRecord` s (built when read).
        layers_iteration: the iteration :attr:`layers` were measured in.
        layer_cost_ms: what the latest measured iteration cost the loop: the hooked step's
            extra time over a typical one, installing the hooks, summarising and printing.

    Raises:
        BadInputError: a period, window, budget or history is out of range, or ``model`` is
            not a module.

    Example::

        monitor = memadvisor.Monitor(model, print_period=100, csv="memory.csv")
        with monitor:
            for epoch in range(3):
                for x, y in loader:
                    loss = F.cross_entropy(model(x), y)
                    loss.backward(); opt.step(); opt.zero_grad()
                    monitor.record()
                monitor.epoch_end()
    """

    def __init__(
        self,
        model: nn.Module,
        print_period: int = 100,
        csv: str | Path | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        layers: bool = True,
        layer_period: int | None = None,
        layer_budget: float = 0.001,
        leak_window: int = 5,
        max_events: int = 100_000,
        max_rows: int = 20,
        console: Console | None = None,
        history: int = 10_000,
        csv_flush_s: float = 5.0,
        source: MemorySource | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise BadInputError(f"model must be a torch.nn.Module, but got {type(model)=}.")
        if print_period < 0:
            raise BadInputError(f"print_period must be >= 0 (0: never), but got {print_period=}.")
        if layer_period is not None and layer_period < 0:
            raise BadInputError(f"layer_period must be >= 0 (0: never), but got {layer_period=}.")
        if not 0 < layer_budget <= 1:
            raise BadInputError(
                f"layer_budget must be a share of the loop's time in (0, 1], but got "
                f"{layer_budget=}."
            )
        if leak_window < 2:
            raise BadInputError(f"leak_window must be at least 2, but got {leak_window=}.")
        if history < 1:
            raise BadInputError(f"history must keep at least 1 iteration, but got {history=}.")
        self.model = model
        self.print_period = print_period
        # None: measured on printed iterations, spaced out to stay within layer_budget.
        self.layer_period = layer_period
        self.layer_budget = layer_budget
        self._adaptive = layer_period is None and layers and print_period > 0
        self.optimizer = optimizer
        self.max_rows = max_rows
        self.console = console or default_console()
        self.source = source if source is not None else source_for(model)
        self._meter = self.source.meter if isinstance(self.source, MeterSource) else None
        self._take = self.source.take
        # Global hooks: a measured iteration installs two hooks, not two per module.
        self.recorder = ModuleEventRecorder(
            model,
            self.source.reader,
            max_events=max_events,
            device=self.source.device,
            global_hooks=True,
        )
        self.probe = LayerProbe(model, self.recorder)
        self.leak_check = LeakCheck(leak_window)
        self._csv = CsvLog(csv, max_wait_s=csv_flush_s) if csv is not None else None
        # The log's queue, read once here: record() appends to it without a call.
        self._csv_pending = self._csv.pending if self._csv is not None else None
        if self._csv is not None:
            # Writes what is queued when the monitor is collected or the interpreter exits;
            # holds the log, not the monitor, so it does not keep the monitor alive.
            weakref.finalize(self, self._csv.close)
        self.iteration = 0
        self.epoch = 0
        self._rows: deque[tuple] = deque(maxlen=history)
        self.history = IterationHistory(self._rows)
        self._layer_rows: list[LayerRow] | None = None
        self._layers: list[LayerMemory] | None = None
        self._layer_text: Text | None = None
        self.layers_iteration: int | None = None
        self._probes: deque[ProbeResult] = deque(maxlen=4)  # for the leak check's suspects
        self._last_probe_iteration = -(10**9)
        self._totals: tuple = _NO_TOTALS
        self._last_ns: int | None = None
        self._inside = False
        self._leak_cache: tuple[int, LeakReport] | None = None
        self._flagged = False
        self._rises = 0  # the leak check's, mirrored: record() reads it without a call
        self._leak_last: int | None = None
        self._suspects: list[LeakSuspect] = []  # of the latest flagged record()
        self._suspects_key: int | None = None  # the measured iteration they come from
        self._next_print = print_period or -1  # the next iteration that prints
        # The next iteration measured per layer; -1: none planned.
        self._next_probe = print_period if self._adaptive else (layer_period or -1)
        self._probe_start_ms = 0.0
        self.layer_cost_ms: float | None = None
        self._start_epoch()
        self._maybe_start_probe(1)

    # -- context: the CPU meter -------------------------------------------------------------

    def __enter__(self) -> Monitor:
        if self._meter is not None:
            meter = self._meter
            meter.adopt(self.model.parameters())
            meter.adopt(self.model.buffers())
            meter.adopt(p.grad for p in self.model.parameters())
            meter.adopt(self._optimizer_tensors())
            meter.reset_peak()
            meter.__enter__()
        self._inside = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._inside = False
        if self._meter is not None:
            self._meter.__exit__(*exc)
        self.close()

    def close(self) -> None:
        """Remove any hooks and write the queued CSV lines. Recorded numbers stay readable."""
        if self.probe.active:
            self.probe.stop()
        if self._csv is not None:
            self._csv.close()

    # -- the loop's calls -------------------------------------------------------------------

    def record(self) -> None:
        """Close one training iteration: read memory, queue a CSV line, print every
        ``print_period``. Returns nothing, to stay cheap: read :attr:`last` for the record.

        Raises:
            BadInputError: on the CPU, called outside ``with monitor:`` (nothing is tracked).
        """
        # Every call and attribute here is paid each iteration, and paid cold (the training
        # step has just evicted the monitor from the CPU caches): anything rare (a measured,
        # printed or growing iteration) is one branch away, and the rest is tuple appends.
        now = time.perf_counter_ns()
        if self._meter is not None and not self._inside:
            raise BadInputError(
                "On the CPU the monitor counts tensor bytes only inside `with monitor:`; "
                "wrap the training loop in it."
            )
        it = self.iteration = self.iteration + 1
        allocated, reserved, peak_allocated, peak_reserved = self._take()
        if peak_allocated < allocated:
            peak_allocated = allocated
        measured = self.probe.active
        if measured:
            self._finish_probe(peak_allocated)
        rises = 0
        if allocated != self._leak_last or self._rises:  # skipped while memory stays flat
            rises = self._rises = self.leak_check.add(allocated)
            self._leak_last = self.leak_check.last_bytes
            if rises or self._flagged:
                self._on_growth(rises)
        last = self._last_ns
        ms = None if last is None else (now - last) / 1e6
        row = (it, self.epoch, ms, allocated, peak_allocated, reserved, peak_reserved,
               self._totals, measured, self._flagged, now)  # fmt: skip
        self._rows.append(row)
        if peak_allocated > self._epoch_peak_allocated:
            self._epoch_peak_allocated = peak_allocated
        if peak_reserved is not None and peak_reserved > self._epoch_peak_reserved:
            self._epoch_peak_reserved = peak_reserved
        if ms is not None:
            self._epoch_ms += ms
        pending = self._csv_pending
        if pending is not None:
            pending.append(row)
            if measured:
                self._queue_layer_lines(it)
        if it == self._next_print:
            self._next_print += self.print_period
            self.print()
            if self._csv is not None:
                self._csv.flush()
        elif pending is not None and now - self._csv.flushed_ns > self._csv.max_wait_ns:
            self._csv.flush()
        if measured:
            self._plan_next_probe(it, ms, now)
        if 0 < self._next_probe <= it + 1 or rises >= 2:
            self._maybe_start_probe(it + 1)
        self._last_ns = time.perf_counter_ns()  # the monitor's own time is not the loop's

    def epoch_end(self) -> IterationRecord | None:
        """Close an epoch: print its peak and the leak verdict, log an epoch row.

        Returns:
            The epoch's summary (peaks over its iterations, mean iteration time), or None if
            it had none.
        """
        count = self.iteration - self._epoch_first + 1
        summary = None
        if count > 0 and self._rows:
            last = self._rows[-1]
            # Iteration times exist from the second record() on.
            timed = count - (1 if self._epoch_first == 1 else 0)
            row = (last[0], last[1], self._epoch_ms / timed if timed else None, last[3],
                   self._epoch_peak_allocated, last[5],
                   None if self._epoch_peak_reserved < 0 else self._epoch_peak_reserved,
                   last[7], last[8], last[9], last[10])  # fmt: skip
            summary = _to_record(row)
            if self._csv is not None:
                self._csv.pending.append(("epoch", row))
                self._csv.flush()
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
        self.epoch += 1
        self._start_epoch()
        return summary

    def print(self) -> None:
        """Print the latest iteration's table now."""
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
            _to_record(self._rows[-1]), layers, self.leak, model_name=self.recorder.model_name
        )
        print_table(self.console, table)

    # -- results ----------------------------------------------------------------------------

    @property
    def last(self) -> IterationRecord | None:
        """The latest iteration's record, or None before the first record()."""
        return _to_record(self._rows[-1]) if self._rows else None

    @property
    def layers(self) -> list[LayerMemory] | None:
        """Per-layer numbers of the latest measured iteration (:attr:`layers_iteration`)."""
        if self._layers is None and self._layer_rows is not None:
            self._layers = [row.to_model() for row in self._layer_rows]
        return self._layers

    @property
    def leak(self) -> LeakReport:
        """The leak check's verdict at the latest record(), naming suspects when flagged."""
        if self._leak_cache is not None and self._leak_cache[0] == self.iteration:
            return self._leak_cache[1]
        check = self.leak_check
        if not check.rises:
            report = LeakReport(flagged=False, iterations=0, growth_bytes=0)
        else:
            report = check.report(self._suspects if self._flagged else [])
        self._leak_cache = (self.iteration, report)
        return report

    def timeline(self) -> Timeline:
        """Iteration samples (those still in :attr:`history`) and the measured iterations'
        module events, as one timeline."""
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
            dropped_events=self.recorder.dropped_events + self.iteration - len(samples),
        )

    # -- internals --------------------------------------------------------------------------

    def _start_epoch(self) -> None:
        self._epoch_first = self.iteration + 1
        self._epoch_ms = 0.0
        self._epoch_peak_allocated = 0
        self._epoch_peak_reserved = -1  # none seen (the CPU has no reserve)

    def _on_growth(self, rises: int) -> None:
        """Memory ended this iteration higher (or a flagged run just ended): update the flag
        and, when flagged, the suspects."""
        flagged = rises >= self.leak_check.window and self.leak_check.flagged
        self._flagged = flagged
        if flagged:
            self._update_suspects()
        else:
            self._suspects_key = None  # a new run of rises looks its suspects up afresh

    def _queue_layer_lines(self, iteration: int) -> None:
        if self._csv_pending is not None and self._layer_rows:
            self._csv_pending.extend(
                layer_csv_row(iteration, self.epoch, la) for la in self._layer_rows
            )

    def _maybe_start_probe(self, next_iteration: int) -> None:
        # Past due, not just due: a probe that close() discarded is started again.
        due = 0 < self._next_probe <= next_iteration
        # Memory that starts to rise gets one measured iteration per window, so that a leak,
        # when flagged, can be traced to the layers whose tensors outlive their iteration.
        growing = (
            self.leak_check.rises >= 2
            and next_iteration - self._last_probe_iteration > self.leak_check.window
        )
        if (due or growing) and not self.probe.active:
            t0 = time.perf_counter_ns()
            self.probe.start(next_iteration)
            self._probe_start_ms = (time.perf_counter_ns() - t0) / 1e6
            self._last_probe_iteration = next_iteration
        if due and not self._adaptive:
            period = self.layer_period or 0
            self._next_probe = (next_iteration // period + 1) * period

    def _plan_next_probe(self, it: int, ms: float | None, now: int) -> None:
        """After a measured iteration: what it cost the loop and, if adaptive, when next."""
        typical = self._typical_ms()
        cost_ms = self._probe_start_ms + (time.perf_counter_ns() - now) / 1e6
        if ms is not None and typical is not None:
            cost_ms += max(0.0, ms - typical)  # the hooked step's extra time
        self.layer_cost_ms = cost_ms
        if not self._adaptive or it < self._next_probe:
            return  # a fixed schedule, or an extra measurement for the leak check
        gap = 1 if typical is None else math.ceil(cost_ms / (self.layer_budget * typical))
        period = self.print_period
        self._next_probe = ((it + max(gap, 1)) // period + 1) * period

    def _typical_ms(self) -> float | None:
        """Median time of the latest unmeasured iterations (up to 31), None before any."""
        times = [
            row[2]
            for row in itertools.islice(reversed(self._rows), 1, 64)
            if row[2] is not None and not row[8]
        ][:31]
        return statistics.median(times) if times else None

    def _finish_probe(self, peak_allocated: int) -> None:
        result = self.probe.stop()
        self._probes.append(result)
        self._layer_rows, self._layers, self._layer_text = result.layers, None, None
        self.layers_iteration = result.iteration
        self._totals = self._measured_totals(result.layers, peak_allocated)

    def _update_suspects(self) -> None:
        # A tensor from an iteration at least two records back has outlived the loop's own
        # variables (the last output and loss are still referenced at record()). Looked up
        # once per measured iteration, not on every flagged one: O(1) per iteration.
        probe = next((p for p in reversed(self._probes) if p.iteration <= self.iteration - 2), None)
        key = None if probe is None else probe.iteration
        if key != self._suspects_key:
            self._suspects_key = key
            self._suspects = [] if probe is None else probe.survivors()

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [
            v
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ]

    def _measured_totals(self, layers: list[LayerRow], peak_allocated: int) -> tuple:
        if self._meter is not None and self.optimizer is not None:
            # The meter misses tensors made from Python data (torch.tensor(0.0): Adam's step
            # counters come out of aten.lift_fresh sharing their input's storage).
            self._meter.adopt(self._optimizer_tensors())
        weights = sum(la.weight_bytes for la in layers)
        grads = sum(la.grad_bytes for la in layers)
        saved = sum(la.saved_bytes for la in layers)
        optim = unique_storage_bytes(self._optimizer_tensors()) if self.optimizer else None
        other = max(0, peak_allocated - weights - grads - saved - (optim or 0))
        return (weights, grads, saved, optim, other)
