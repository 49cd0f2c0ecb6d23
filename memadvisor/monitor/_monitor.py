"""Monitor: memory per iteration and per layer inside the user's own training loop."""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

import torch
from rich.console import Console
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
    print_table,
)
from memadvisor.monitor._probe import LayerProbe, LayerRow, ProbeResult
from memadvisor.monitor._schema import IterationRecord, LayerMemory, LeakReport, LeakSuspect
from memadvisor.monitor._source import MemorySource, MeterSource, source_for
from memadvisor.timeline import ModuleEventRecorder, Timeline

__all__ = ["Monitor"]

# A raw iteration row, kept instead of an IterationRecord (a pydantic model costs more to build
# than the rest of record()): (iteration, epoch, iteration_ms, allocated, peak allocated,
# reserved, peak reserved, totals, layers measured, leak flagged), with totals = (weights,
# grads, saved activations, optimizer state, other) from the latest measured iteration.
_NO_TOTALS: tuple[None, ...] = (None, None, None, None, None)


def _to_record(row: tuple) -> IterationRecord:
    it, epoch, ms, allocated, peak, reserved, peak_reserved, totals, measured, _ = row
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
    time) are measured only on the iterations that print them, by hooks installed for that
    one iteration, so the loop runs unhooked the rest of the time. A leak check flags
    allocated memory that ends each iteration higher, and names the layers whose tensors
    outlive their iteration.

    On CUDA the allocator's counters are read, and its peak counters are reset at every
    record() (and at every hook on measured iterations) to give per-iteration peaks: code
    that reads ``torch.cuda.max_memory_allocated`` itself sees peaks since the last record().
    On the CPU bytes are tracked by a
    :class:`~memadvisor.memory.MemoryMeter`, which only sees what runs inside it: run the
    loop inside ``with monitor:`` (harmless, and the same code, on CUDA).

    CSV lines are written in batches: on printed iterations, at :meth:`epoch_end`, at
    :meth:`close` (and the end of ``with monitor:``), when the oldest waiting line is 5 s old,
    and when the monitor is collected or the interpreter exits. Only a process killed outright
    (SIGKILL) loses lines, at most those 5 s.

    Args:
        model: the model being trained.
        print_period: print a table every this many iterations (0: never).
        csv: append one row per iteration (and per layer on measured iterations) here.
        optimizer: counted as optimizer state in the totals (and adopted by the CPU meter).
        layers: measure per-layer numbers on printed iterations.
        layer_period: measure layers every this many iterations instead (0: never).
        leak_window: consecutive growing iterations that flag a leak.
        max_events: bound of the timeline buffer.
        max_rows: most layers in a printed table.
        console: where tables go; stderr if None.
        history: iterations kept in :attr:`history`.
        source: where memory is read; from the model's device if None (the CUDA allocator,
            or a CPU meter). Benchmarks pass a no-op one to time the monitor itself.

    Raises:
        BadInputError: a period, window or history is out of range, or ``model`` is not a
            module.

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
        leak_window: int = 5,
        max_events: int = 100_000,
        max_rows: int = 20,
        console: Console | None = None,
        history: int = 10_000,
        source: MemorySource | None = None,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise BadInputError(f"model must be a torch.nn.Module, but got {type(model)=}.")
        if print_period < 0:
            raise BadInputError(f"print_period must be >= 0 (0: never), but got {print_period=}.")
        if layer_period is None:
            layer_period = print_period if layers else 0
        if layer_period < 0:
            raise BadInputError(f"layer_period must be >= 0 (0: never), but got {layer_period=}.")
        if leak_window < 2:
            raise BadInputError(f"leak_window must be at least 2, but got {leak_window=}.")
        if history < 1:
            raise BadInputError(f"history must keep at least 1 iteration, but got {history=}.")
        self.model = model
        self.print_period = print_period
        self.layer_period = layer_period
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
        self._csv = CsvLog(csv) if csv is not None else None
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
        self.layers_iteration: int | None = None
        self._probes: deque[ProbeResult] = deque(maxlen=4)  # for the leak check's suspects
        self._last_probe_iteration = -(10**9)
        self._totals: tuple = _NO_TOTALS
        self._last_ns: int | None = None
        self._inside = False
        self._leak_cache: tuple[int, LeakReport] | None = None
        self._suspects: list[LeakSuspect] = []  # of the latest flagged record()
        self._suspects_key: int | None = None  # the measured iteration they come from
        self._epoch_acc = _EpochAccumulator()
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
        self.recorder.record("sample", phase=f"iteration {it}", reading=(allocated, reserved))
        measured = self.probe.active
        if measured:
            self._finish_probe(peak_allocated)
        flagged = self.leak_check.add(allocated)
        if flagged:
            self._update_suspects()
        elif self._suspects_key is not None:
            self._suspects_key = None  # a new run of rises looks its suspects up afresh
        last = self._last_ns
        ms = None if last is None else (now - last) / 1e6
        row = (it, self.epoch, ms, allocated, peak_allocated, reserved, peak_reserved,
               self._totals, measured, flagged)  # fmt: skip
        self._rows.append(row)
        self._epoch_acc.add(ms, peak_allocated, peak_reserved)
        csv = self._csv
        if csv is not None:
            csv.add(row, now)
            if measured and self._layer_rows:
                for layer in self._layer_rows:
                    csv.add(layer_csv_row(it, self.epoch, layer), now)
        if self.print_period and it % self.print_period == 0:
            self.print()
            if csv is not None:
                csv.flush()
        elif csv is not None and csv.due(now):
            csv.flush()
        if self.layer_period or self.leak_check.rises >= 2:
            self._maybe_start_probe(it + 1)
        self._last_ns = time.perf_counter_ns()  # the monitor's own time is not the loop's

    def epoch_end(self) -> IterationRecord | None:
        """Close an epoch: print its peak and the leak verdict, log an epoch row.

        Returns:
            The epoch's summary (peaks over its iterations, mean iteration time), or None if
            it had none.
        """
        acc, self._epoch_acc = self._epoch_acc, _EpochAccumulator()
        summary = None
        if acc.count and self._rows:
            last = self._rows[-1]
            row = (last[0], last[1], acc.mean_ms, last[3], acc.peak_allocated, last[5],
                   acc.peak_reserved, last[7], last[8], last[9])  # fmt: skip
            summary = _to_record(row)
            if self._csv is not None:
                self._csv.add(("epoch", row), time.perf_counter_ns())
                self._csv.flush()
            if self.print_period:
                leak = self.leak
                self.console.print(
                    f"[bold]epoch {self.epoch}[/bold]: {acc.count} iterations, peak allocated "
                    f"{format_bytes(summary.peak_allocated_bytes)}"
                    + (
                        f", peak reserved {format_bytes(summary.peak_reserved_bytes)}"
                        if summary.peak_reserved_bytes is not None
                        else ""
                    )
                    + (f"; [red]{leak.message}[/red]" if leak.flagged else "")
                )
        self.epoch += 1
        return summary

    def print(self) -> None:
        """Print the latest iteration's table now."""
        if not self._rows:
            return
        table = iteration_table(
            _to_record(self._rows[-1]),
            self._layer_rows,
            self.layers_iteration,
            self.leak,
            model_name=self.recorder.model_name,
            max_rows=self.max_rows,
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
            report = check.report(self._suspects if check.flagged else [])
        self._leak_cache = (self.iteration, report)
        return report

    def timeline(self) -> Timeline:
        """Iteration samples and the measured iterations' module events, as one timeline."""
        return self.recorder.timeline()

    # -- internals --------------------------------------------------------------------------

    def _maybe_start_probe(self, next_iteration: int) -> None:
        periodic = self.layer_period and next_iteration % self.layer_period == 0
        # Memory that starts to rise gets one measured iteration per window, so that a leak,
        # when flagged, can be traced to the layers whose tensors outlive their iteration.
        growing = (
            self.leak_check.rises >= 2
            and next_iteration - self._last_probe_iteration > self.leak_check.window
        )
        if periodic or growing:
            self.probe.start(next_iteration)
            self._last_probe_iteration = next_iteration

    def _finish_probe(self, peak_allocated: int) -> None:
        result = self.probe.stop()
        self._probes.append(result)
        self._layer_rows, self._layers = result.layers, None
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


class _EpochAccumulator:
    """Running peaks and mean iteration time of one epoch, O(1) per iteration."""

    __slots__ = ("count", "ms_count", "ms_sum", "peak_allocated", "peak_reserved")

    def __init__(self) -> None:
        self.count = 0
        self.ms_sum = 0.0
        self.ms_count = 0
        self.peak_allocated = 0
        self.peak_reserved: int | None = None

    def add(self, ms: float | None, peak_allocated: int, peak_reserved: int | None) -> None:
        self.count += 1
        if ms is not None:
            self.ms_sum += ms
            self.ms_count += 1
        if peak_allocated > self.peak_allocated:
            self.peak_allocated = peak_allocated
        if peak_reserved is not None and (
            self.peak_reserved is None or peak_reserved > self.peak_reserved
        ):
            self.peak_reserved = peak_reserved

    @property
    def mean_ms(self) -> float | None:
        return self.ms_sum / self.ms_count if self.ms_count else None
