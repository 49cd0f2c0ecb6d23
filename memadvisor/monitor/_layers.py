"""When the Monitor measures per-layer numbers, and what a measurement leaves behind.

Layers are measured by hooks installed for one iteration (:class:`LayerProbe`): on the first
printed iteration, then as often as ``layer_budget`` of the loop's time allows (or every
``layer_period`` iterations), and once per window when memory starts to rise, so that a
leak can be traced to the layers whose tensors outlive their iteration. A measurement's
cost (the hooked step's extra time, installing, summarising) spaces the next one out.

Known limitations:
    * The typical iteration a measurement is compared with is the median of the latest
      unmeasured readings; before there are any, the next printed iteration is measured.
    * Totals split the peak into weights, gradients, saved activations and optimizer state as
      the hooks saw them; the rest is "other", whatever made it.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque

import torch

from memadvisor.memory import unique_storage_bytes
from memadvisor.monitor._cadence import clock
from memadvisor.monitor._output import layer_csv_row
from memadvisor.monitor._probe import LayerProbe, LayerRow, ProbeResult
from memadvisor.monitor._schema import LayerMemory

__all__ = ["LayerSchedule"]


class LayerSchedule:
    """Per-layer measurement for :class:`~memadvisor.monitor.Monitor`: its schedule, its
    cost, and the latest measured layers and totals."""

    def _init_layers(self, layers: bool, layer_period: int | None, layer_budget: float) -> None:
        # None: measured on printed iterations, spaced out to stay within layer_budget.
        self.layer_period = layer_period
        self.layer_budget = layer_budget
        self._adaptive = layer_period is None and layers and self.print_period > 0
        self.probe = LayerProbe(self.model, self.recorder)
        self._layer_rows: list[LayerRow] | None = None
        self._layers: list[LayerMemory] | None = None
        self._layer_text = None  # the printed table of them, laid out once
        self.layers_iteration: int | None = None
        self._probes: deque[ProbeResult] = deque(maxlen=4)  # for the leak check's suspects
        self._last_probe_iteration = -(10**9)
        # The next iteration measured per layer; -1: none planned.
        self._next_probe = self.print_period if self._adaptive else (layer_period or -1)
        self._probe_start_ms = 0.0
        self.layer_cost_ms: float | None = None

    @property
    def layers(self) -> list[LayerMemory] | None:
        """Per-layer numbers of the latest measured iteration (:attr:`layers_iteration`)."""
        if self._layers is None and self._layer_rows is not None:
            self._layers = [row.to_model() for row in self._layer_rows]
        return self._layers

    def _queue_layer_lines(self, iteration: int) -> None:
        if self._csv is not None and self._layer_rows:
            self._csv.pending.extend(
                layer_csv_row(iteration, self.epoch, la) for la in self._layer_rows
            )

    def _maybe_start_probe(self, next_iteration: int) -> bool:
        """Hook the model for ``next_iteration`` if a measurement is due (or memory grows);
        returns whether it did."""
        # Past due, not just due: a probe that close() discarded is started again.
        due = 0 < self._next_probe <= next_iteration
        # Memory that starts to rise gets one measured iteration per window, so that a leak,
        # when flagged, can be traced to the layers whose tensors outlive their iteration.
        growing = (
            self.leak_check.rises >= 2
            and next_iteration - self._last_probe_iteration > self.leak_check.window
        )
        started = (due or growing) and not self.probe.active
        if started:
            t0 = clock()
            self.probe.start(next_iteration)
            self._probe_start_ms = (clock() - t0) / 1e6
            self._last_probe_iteration = next_iteration
        if due and not self._adaptive:
            period = self.layer_period or 0
            self._next_probe = (next_iteration // period + 1) * period
        return started

    def _plan_next_probe(self, it: int, ms: float | None, now: int) -> None:
        """After a measured iteration: what it cost the loop and, if adaptive, when next."""
        typical = self._typical_ms()
        cost_ms = self._probe_start_ms + (clock() - now) / 1e6
        if ms is not None and typical is not None:
            cost_ms += max(0.0, ms - typical)  # the hooked step's extra time
        self.layer_cost_ms = cost_ms
        if not self._adaptive or it < self._next_probe:
            return  # a fixed schedule, or an extra measurement for the leak check
        gap = 1 if typical is None else math.ceil(cost_ms / (self.layer_budget * typical))
        period = self.print_period
        self._next_probe = ((it + max(gap, 1)) // period + 1) * period

    def _typical_ms(self) -> float | None:
        """Median time per iteration of the latest unmeasured readings (up to 31), None
        before any."""
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
        self._readings.totals = self._measured_totals(result.layers, peak_allocated)

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
