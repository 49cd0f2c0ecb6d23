"""Monitor: memory per iteration and per layer inside the user's own training loop."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path

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
    layer_row,
    step_row,
)
from memadvisor.monitor._probe import LayerProbe, ProbeResult
from memadvisor.monitor._schema import IterationRecord, LayerMemory, LeakReport, LeakSuspect
from memadvisor.monitor._source import MeterSource, source_for
from memadvisor.timeline import ModuleEventRecorder, Timeline

__all__ = ["Monitor"]


class Monitor:
    """Watches memory in a training loop: call :meth:`record` once per iteration.

    Every iteration costs a few counter reads (allocated, reserved and their peaks), one CSV
    row and a timeline sample. Per-layer numbers (weights, gradients, saved activations,
    other intermediates, time) are measured only on the iterations that print them, by hooks
    installed for that one iteration, so the loop runs unhooked the rest of the time. A leak
    check flags allocated memory that ends each iteration higher, and names the layers whose
    tensors outlive their iteration.

    On CUDA the allocator's counters are read, and its peak counters are reset at every
    record() (and at every hook on measured iterations) to give per-iteration peaks: code
    that reads ``torch.cuda.max_memory_allocated`` itself sees peaks since the last record().
    On the CPU bytes are tracked by a
    :class:`~memadvisor.memory.MemoryMeter`, which only sees what runs inside it: run the
    loop inside ``with monitor:`` (harmless, and the same code, on CUDA).

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

    Raises:
        BadInputError: a period or window is negative, or ``model`` is not a module.

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
        self.model = model
        self.print_period = print_period
        self.layer_period = layer_period
        self.optimizer = optimizer
        self.max_rows = max_rows
        self.console = console or default_console()
        self.source = source_for(model)
        self.recorder = ModuleEventRecorder(
            model, self.source.reader, max_events=max_events, device=self.source.device
        )
        self.probe = LayerProbe(model, self.recorder)
        self.leak_check = LeakCheck(leak_window)
        self._csv = CsvLog(csv) if csv is not None else None
        self.iteration = 0
        self.epoch = 0
        self.history: deque[IterationRecord] = deque(maxlen=10_000)
        self.layers: list[LayerMemory] | None = None
        self.layers_iteration: int | None = None
        self._probes: deque[ProbeResult] = deque(maxlen=4)  # for the leak check's suspects
        self._last_probe_iteration = -(10**9)
        self._totals: dict[str, int | None] = {}
        self._last_time: float | None = None
        self._inside = False
        self._leak = LeakReport(flagged=False, iterations=0, growth_bytes=0)
        self._maybe_start_probe(1)

    # -- context: the CPU meter -------------------------------------------------------------

    def __enter__(self) -> Monitor:
        if isinstance(self.source, MeterSource):
            meter = self.source.meter
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
        if isinstance(self.source, MeterSource):
            self.source.meter.__exit__(*exc)
        self.close()

    def close(self) -> None:
        """Remove any hooks and close the CSV file. Recorded numbers stay readable."""
        if self.probe.active:
            self.probe.stop()
        if self._csv is not None:
            self._csv.close()

    # -- the loop's calls -------------------------------------------------------------------

    def record(self) -> IterationRecord:
        """Close one training iteration: read memory, log, print every ``print_period``.

        Raises:
            BadInputError: on the CPU, called outside ``with monitor:`` (nothing is tracked).
        """
        if isinstance(self.source, MeterSource) and not self._inside:
            raise BadInputError(
                "On the CPU the monitor counts tensor bytes only inside `with monitor:`; "
                "wrap the training loop in it."
            )
        now = time.perf_counter()
        self.iteration += 1
        allocated, reserved, peak_allocated, peak_reserved = self.source.take()
        self.recorder.record("sample", phase=f"iteration {self.iteration}",
                             reading=(allocated, reserved))  # fmt: skip
        measured = False
        if self.probe.active:
            result = self.probe.stop()
            self._probes.append(result)
            self.layers, self.layers_iteration = result.layers, result.iteration
            self._update_totals(result.layers, peak_allocated)
            measured = True
        self.leak_check.add(allocated)
        rec = IterationRecord(
            iteration=self.iteration,
            epoch=self.epoch,
            iteration_ms=None if self._last_time is None else (now - self._last_time) * 1e3,
            allocated_bytes=allocated,
            peak_allocated_bytes=max(peak_allocated, allocated),
            reserved_bytes=reserved,
            peak_reserved_bytes=peak_reserved,
            layers_measured=measured,
            **self._totals,
        )
        self.history.append(rec)
        if self.leak_check.rises:
            self._leak = self.leak_check.report(self._suspects() if self.leak_check.flagged else [])
        elif self._leak.iterations:
            self._leak = LeakReport(flagged=False, iterations=0, growth_bytes=0)
        printing = bool(self.print_period) and self.iteration % self.print_period == 0
        self._write_csv(rec, measured, flush=printing)
        if printing:
            self.print()
        self._maybe_start_probe(self.iteration + 1)
        self._last_time = time.perf_counter()  # the monitor's own time is not the loop's
        return rec

    def epoch_end(self) -> IterationRecord | None:
        """Close an epoch: print its peak and the leak verdict, log an epoch row.

        Returns:
            The epoch's summary (peaks over its iterations), or None if it had none.
        """
        recs = [r for r in self.history if r.epoch == self.epoch]
        summary = None
        if recs:
            times = [r.iteration_ms for r in recs if r.iteration_ms is not None]
            last = recs[-1]
            summary = last.model_copy(
                update={
                    "peak_allocated_bytes": max(r.peak_allocated_bytes for r in recs),
                    "peak_reserved_bytes": max(
                        (r.peak_reserved_bytes for r in recs if r.peak_reserved_bytes is not None),
                        default=None,
                    ),
                    "iteration_ms": sum(times) / len(times) if times else None,
                }
            )
            if self._csv is not None:
                row = step_row(summary, self._leak)
                row["scope"] = "epoch"
                self._csv.write(row, flush=True)
            if self.print_period:
                self.console.print(
                    f"[bold]epoch {self.epoch}[/bold]: {len(recs)} iterations, peak allocated "
                    f"{format_bytes(summary.peak_allocated_bytes)}"
                    + (
                        f", peak reserved {format_bytes(summary.peak_reserved_bytes)}"
                        if summary.peak_reserved_bytes is not None
                        else ""
                    )
                    + (f"; [red]{self._leak.message}[/red]" if self._leak.flagged else "")
                )
        self.epoch += 1
        return summary

    def print(self) -> None:
        """Print the latest iteration's table now."""
        if not self.history:
            return
        self.console.print(
            iteration_table(
                self.history[-1],
                self.layers,
                self.layers_iteration,
                self._leak,
                model_name=self.recorder.model_name,
                max_rows=self.max_rows,
            )
        )

    # -- results ----------------------------------------------------------------------------

    @property
    def leak(self) -> LeakReport:
        """The leak check's latest verdict."""
        return self._leak

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

    def _suspects(self) -> list[LeakSuspect]:
        # A tensor from an iteration at least two records back has outlived the loop's own
        # variables (the last output and loss are still referenced at record()).
        old = [p for p in self._probes if p.iteration <= self.iteration - 2]
        return old[-1].survivors() if old else []

    def _optimizer_tensors(self) -> list[torch.Tensor]:
        if self.optimizer is None:
            return []
        return [
            v
            for state in self.optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ]

    def _update_totals(self, layers: list[LayerMemory], peak_allocated: int) -> None:
        if isinstance(self.source, MeterSource) and self.optimizer is not None:
            # The meter misses tensors made from Python data (torch.tensor(0.0): Adam's step
            # counters come out of aten.lift_fresh sharing their input's storage).
            self.source.meter.adopt(self._optimizer_tensors())
        weights = sum(la.weight_bytes for la in layers)
        grads = sum(la.grad_bytes for la in layers)
        saved = sum(la.saved_bytes for la in layers)
        optim = unique_storage_bytes(self._optimizer_tensors()) if self.optimizer else None
        self._totals = {
            "weight_bytes": weights,
            "grad_bytes": grads,
            "saved_activation_bytes": saved,
            "optimizer_state_bytes": optim,
            "other_bytes": max(0, peak_allocated - weights - grads - saved - (optim or 0)),
        }

    def _write_csv(self, rec: IterationRecord, measured: bool, *, flush: bool) -> None:
        if self._csv is None:
            return
        self._csv.write(step_row(rec, self._leak), flush=flush and not measured)
        if measured and self.layers:
            for i, la in enumerate(self.layers):
                row = layer_row(rec.iteration, rec.epoch, la)
                self._csv.write(row, flush=flush and i == len(self.layers) - 1)
