"""Monitor: memory per iteration and per layer inside the user's own training loop."""

from __future__ import annotations

import heapq
import itertools
import math
import statistics
import time
import weakref
from collections import deque
from pathlib import Path

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
from memadvisor.monitor._readings import IterationHistory, Readings, to_record
from memadvisor.monitor._schema import IterationRecord, LayerMemory, LeakReport, LeakSuspect
from memadvisor.monitor._source import MemorySource, MeterSource, source_for
from memadvisor.timeline import ModuleEventRecorder, Timeline, TimelineEvent

__all__ = ["Monitor"]

_NEVER = 1 << 62  # a perf_counter_ns deadline that never comes
# Counters read at least once every this many iterations, whatever they cost.
_MAX_COUNTER_PERIOD = 100
# Raw readings turned into rows at least this often (iterations), so the buffer stays small.
_DIGEST_EVERY = 1024
_clock = time.perf_counter_ns


def _check_options(
    model: object,
    print_period: int,
    layer_period: int | None,
    counter_period: int | None,
    layer_budget: float,
    counter_budget: float,
    leak_window: int,
    history: int,
) -> None:
    """Raise BadInputError naming the first option out of range (see :class:`Monitor`)."""
    if not isinstance(model, nn.Module):
        raise BadInputError(f"model must be a torch.nn.Module, but got {type(model)=}.")
    if print_period < 0:
        raise BadInputError(f"print_period must be >= 0 (0: never), but got {print_period=}.")
    if layer_period is not None and layer_period < 0:
        raise BadInputError(f"layer_period must be >= 0 (0: never), but got {layer_period=}.")
    if counter_period is not None and counter_period < 1:
        raise BadInputError(
            f"counter_period must be >= 1 (None: chosen from the cost of a reading), but "
            f"got {counter_period=}."
        )
    for name, budget in (("layer_budget", layer_budget), ("counter_budget", counter_budget)):
        if not 0 < budget <= 1:
            raise BadInputError(
                f"{name} must be a share of the loop's time in (0, 1], but got {budget=}."
            )
    if leak_window < 2:
        raise BadInputError(f"leak_window must be at least 2, but got {leak_window=}.")
    if history < 1:
        raise BadInputError(f"history must keep at least 1 iteration, but got {history=}.")


class Monitor:
    """Watches memory in a training loop: call :meth:`record` once per iteration.

    A reading of the allocator's counters (allocated, reserved and their peaks since the
    previous reading) costs one stats call and one peak reset on CUDA, about 20 us, and no
    synchronisation; record() adds a tuple append to it. Rows, CSV lines, epoch totals and
    the leak check's verdicts are made from those raw readings in batches, on the rare
    iterations that need them (printed, measured or growing ones) or when they are read.

    Counters are read every ``counter_period`` iterations. By default that is every
    iteration on the CPU (a meter's counters are attributes) and, on CUDA, every iteration
    whose share of the loop's time stays within ``counter_budget``: where a step is short
    enough that 20 us matter (a few ms, a small model), every few iterations, chosen from
    the measured cost of a reading and the loop's time per iteration. Nothing is lost
    between readings: a reading's peaks cover every iteration since the previous one (its
    record's ``iterations``), its time is their mean, and the iterations that print,
    measure layers or end an epoch are always read. Leaks are still caught (memory that
    grows each iteration grows between readings). Pass ``counter_period=1`` for a reading
    of every iteration.

    Per-layer numbers (weights, gradients, saved activations, other intermediates, time) are
    measured on printed iterations, by hooks installed for that one iteration, so the loop
    runs unhooked the rest of the time: on the first printed iteration, then on as many as
    keep their cost within ``layer_budget`` of the loop's time (every one, where the card
    hides the hooks' CPU time behind a long step; every tenth or fewer for a small model
    whose step is all CPU time). Tables in between show the latest measured layers. A leak
    check flags allocated memory that ends each reading higher, and names the layers whose
    tensors outlive their iteration.

    On CUDA the allocator's peak counters are reset at every reading (and at every hook on
    measured iterations) to give peaks per reading: code that reads
    ``torch.cuda.max_memory_allocated`` itself sees peaks since the monitor's last reading.
    On the CPU bytes are tracked by a :class:`~memadvisor.memory.MemoryMeter`, which only
    sees what runs inside it: run the loop inside ``with monitor:`` (harmless, and the same
    code, on CUDA).

    CSV lines are written in batches: on printed iterations, at :meth:`epoch_end`, at
    :meth:`close` (and the end of ``with monitor:``), at the first reading ``csv_flush_s``
    after the last write, and when the monitor is collected or the interpreter exits. Only a
    process killed outright (SIGKILL) loses lines, those of the last ``csv_flush_s`` or so.

    Args:
        model: the model being trained.
        print_period: print a table every this many iterations (0: never).
        csv: append one row per reading (and per layer on measured iterations) here.
        optimizer: counted as optimizer state in the totals (and adopted by the CPU meter).
        layers: measure per-layer numbers on printed iterations: the first one, then as
            often as ``layer_budget`` allows (every printed one where a step is long enough).
        layer_period: measure layers exactly every this many iterations instead (0: never).
        layer_budget: share of the loop's time that per-layer measurement may take, on
            average. A measured iteration that cost the loop ``C`` ms more than its typical
            ``T`` ms iteration (hooks, summary, table) is followed by at least
            ``C / (layer_budget * T)`` unmeasured ones, up to the next printed iteration.
        counter_period: read the counters every this many iterations (and on every printed,
            measured and epoch-ending one); None: chosen as described above.
        counter_budget: with ``counter_period=None`` on CUDA, the share of the loop's time
            that readings may take: a reading that costs ``R`` us in a loop of ``T`` us per
            iteration is made every ``ceil(R / (counter_budget * T))`` iterations (at most
            100), re-chosen every 64 iterations or so from the measured times. The default,
            0.05%, is set low because a reading costs the loop more than its own time says
            (``docs/design.md``, "The monitor's own cost").
        leak_window: consecutive growing readings that flag a leak.
        max_events: bound of the buffer of module events (those of measured iterations).
        max_rows: most layers in a printed table.
        console: where tables go; stderr if None.
        history: readings kept in :attr:`history` (and as timeline samples).
        csv_flush_s: CSV lines wait in memory at most about this long (see above).
        source: where memory is read; from the model's device if None (the CUDA allocator,
            or a CPU meter). Benchmarks pass a no-op one to time the monitor itself.

    Attributes:
        history: the latest readings' :class:`IterationRecord` s (built when read).
        counter_period: counters are read every this many iterations now.
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
        counter_period: int | None = None,
        counter_budget: float = 0.0005,
        leak_window: int = 5,
        max_events: int = 100_000,
        max_rows: int = 20,
        console: Console | None = None,
        history: int = 10_000,
        csv_flush_s: float = 5.0,
        source: MemorySource | None = None,
    ) -> None:
        _check_options(
            model,
            print_period,
            layer_period,
            counter_period,
            layer_budget,
            counter_budget,
            leak_window,
            history,
        )
        self.model = model
        self.print_period = print_period
        # None: measured on printed iterations, spaced out to stay within layer_budget.
        self.layer_period = layer_period
        self.layer_budget = layer_budget
        self.counter_budget = counter_budget
        self._adaptive = layer_period is None and layers and print_period > 0
        self.optimizer = optimizer
        self.max_rows = max_rows
        self.console = console or default_console()
        self.source = source if source is not None else source_for(model)
        self._meter = self.source.meter if isinstance(self.source, MeterSource) else None
        # On the CPU the meter counts only inside `with monitor:`; until then a reading says so
        # (swapping the function costs record() nothing, a check would cost every call).
        self._take = self._outside_meter if self._meter is not None else self.source.take
        self.counter_period = counter_period or 1
        self._auto_counters = counter_period is None and self.source.costly_reads
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
        self._readings = Readings(history, self._csv)
        if self._csv is not None:
            # Writes what is queued when the monitor is collected or the interpreter exits;
            # holds the readings and the log, not the monitor, so it does not keep it alive.
            weakref.finalize(self, self._readings.close)
        self._raw = self._readings.raw  # record() appends to it
        self._rows = self._readings.rows
        self._history = IterationHistory(self._rows)
        self.iteration = 0
        self._layer_rows: list[LayerRow] | None = None
        self._layers: list[LayerMemory] | None = None
        self._layer_text: Text | None = None
        self.layers_iteration: int | None = None
        self._probes: deque[ProbeResult] = deque(maxlen=4)  # for the leak check's suspects
        self._last_probe_iteration = -(10**9)
        self._last_ns: int | None = None  # end of the latest reading's record()
        self._leak_cache: tuple[int, LeakReport] | None = None
        # The latest bytes the leak check counted; -1 while it counts rises, so that the next
        # reading goes to it whatever it reads (a flat one ends the run of rises).
        self._leak_last: int | None = None
        self._suspects: list[LeakSuspect] = []  # of the latest flagged reading
        self._suspects_key: int | None = None  # the measured iteration they come from
        self._next_print = print_period or -1  # the next iteration that prints
        # The next iteration measured per layer; -1: none planned.
        self._next_probe = print_period if self._adaptive else (layer_period or -1)
        self._probe_start_ms = 0.0
        self.layer_cost_ms: float | None = None
        # The monitor's own time, for the choice of counter_period: readings' (own; with the
        # leak check's, which memory that moves at every reading calls each time), the
        # busy readings' (slow: printed, measured, writing or choosing ones), how many of
        # those, and where the current measuring window started.
        self._own_ns = 0
        self._slow_ns = 0
        self._slow_reads = 0
        self._window: tuple[int, int, int, int, int, int] | None = None
        self._next_window = 1
        self._flush_due_ns = _NEVER
        self._epoch_first = 1
        self._maybe_start_probe(1)
        self._schedule(0)

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
            self._take = self.source.take
        return self

    def __exit__(self, *exc: object) -> None:
        if self._meter is not None:
            self._take = self._outside_meter
            self._meter.__exit__(*exc)
        self.close()

    def close(self) -> None:
        """Read the iterations since the latest reading, remove any hooks and write the
        queued CSV lines. Recorded numbers stay readable."""
        self._read_now()
        if self.probe.active:
            self.probe.stop()
        self._schedule(self.iteration)  # a probe dropped here is made at the next reading
        self._readings.close()

    # -- the loop's calls -------------------------------------------------------------------

    def record(self) -> None:
        """Close one training iteration: read memory (every ``counter_period`` iterations),
        print every ``print_period``. Returns nothing, to stay cheap: read :attr:`last`.

        Raises:
            BadInputError: on the CPU, a reading outside ``with monitor:`` (nothing is
                tracked there).
        """
        # Every call and attribute here is paid each iteration, and paid cold (the training
        # step has just evicted the monitor from the CPU caches): an iteration between
        # readings is one comparison; a reading is a counter read, a tuple append and three
        # comparisons; anything rare (a measured, printed or growing iteration, rows made
        # from readings, lines written) is behind them, in _event().
        it = self.iteration = self.iteration + 1
        if it < self._next_read:
            return
        now = _clock()
        allocated, reserved, peak, peak_reserved = self._take()
        self._raw.append((it, now, self._last_ns, allocated, peak, reserved, peak_reserved))
        if allocated != self._leak_last or it >= self._next_event or now > self._flush_due_ns:
            busy = self._event(it, now)
            end = self._last_ns = _clock()
            if busy:
                self._slow_ns += end - now
                self._slow_reads += 1
            else:
                self._own_ns += end - now
            return
        nxt = it + self.counter_period
        self._next_read = nxt if nxt < self._next_event else self._next_event
        end = self._last_ns = _clock()
        self._own_ns += end - now

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

    # -- results ----------------------------------------------------------------------------

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

    @property
    def own_ms(self) -> float:
        """The monitor's own time so far: its readings and what they led to (rows, tables,
        CSV lines, layer hooks installed and summarised). Not counted: the calls between
        readings (a comparison each) and the hooks' time inside a measured step."""
        return (self._own_ns + self._slow_ns) / 1e6

    @property
    def layers(self) -> list[LayerMemory] | None:
        """Per-layer numbers of the latest measured iteration (:attr:`layers_iteration`)."""
        if self._layers is None and self._layer_rows is not None:
            self._layers = [row.to_model() for row in self._layer_rows]
        return self._layers

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

    # -- internals: readings ----------------------------------------------------------------

    def _outside_meter(self) -> tuple:
        self.iteration -= 1  # the iteration was not recorded
        raise BadInputError(
            "On the CPU the monitor counts tensor bytes only inside `with monitor:`; "
            "wrap the training loop in it."
        )

    def _read_now(self) -> None:
        """Read the iterations since the latest reading, if any, and make rows of every
        reading (an epoch's end, close())."""
        it = self.iteration
        if it <= self._readings.last_iteration():
            self._digest()
            return
        now = _clock()
        allocated, reserved, peak, peak_reserved = self.source.take()
        self._raw.append((it, now, self._last_ns, allocated, peak, reserved, peak_reserved))
        self._event(it, now)
        end = self._last_ns = _clock()
        self._slow_ns += end - now
        self._slow_reads += 1

    def _event(self, it: int, now: int) -> bool:
        """A reading that needs more than a raw tuple: memory moved (the leak check), or it
        prints, measures layers, writes lines or re-chooses the counter period.

        Returns:
            Whether it did more than the leak check (its time is then not a reading's cost).
        """
        raw = self._raw.pop()
        self._digest()  # the readings before this one, under the state they were made in
        # Chosen first: the window then holds whole readings, this one not among them.
        busy = it >= self._next_window
        if busy:
            self._choose_counter_period(it, now)
        allocated = raw[3]
        probe = self.probe
        measured = probe.active and probe.iteration == it
        if measured:
            self._finish_probe(max(raw[4], allocated))
        rises = 0
        if allocated != self._leak_last:  # skipped while memory stays flat
            check = self.leak_check
            rises = check.add(allocated)
            self._leak_last = -1 if rises else check.last_bytes
            if rises or self._readings.flagged:
                self._on_growth(rises)
        row = self._readings.add(raw, measured)
        busy |= measured
        if measured:
            self._queue_layer_lines(it)
        if self.print_period and it >= self._next_print:
            self._next_print = (it // self.print_period + 1) * self.print_period
            self.print()
            self._flush_csv()
            busy = True
        elif self._csv is not None and now > self._flush_due_ns:
            self._flush_csv()
            busy = True
        if measured:
            self._plan_next_probe(it, row[2], now)
        if 0 < self._next_probe <= it + 1 or rises >= 2:
            busy |= self._maybe_start_probe(it + 1)
        self._schedule(it)
        return busy

    def _schedule(self, it: int) -> None:
        """The next reading, and the next one that is an event (prints, measures layers,
        re-chooses the period or makes rows), after a reading of iteration ``it``."""
        due = [it + _DIGEST_EVERY, self._next_window]
        if self.print_period:
            due.append(self._next_print)
        if self._next_probe > 0:
            due.append(self._next_probe - 1)  # the probe starts in the iteration before
        if self.probe.active:
            due.append(self.probe.iteration)
        self._next_event = max(it + 1, min(due))
        self._next_read = min(it + self.counter_period, self._next_event)
        if self._csv is not None:
            self._flush_due_ns = self._csv.flushed_ns + self._csv.max_wait_ns

    def _digest(self) -> None:
        self._readings.digest()

    def _flush_csv(self) -> None:
        if self._csv is not None:
            self._csv.flush()
            self._flush_due_ns = self._csv.flushed_ns + self._csv.max_wait_ns

    def _choose_counter_period(self, it: int, now: int) -> None:
        """With counter_period=None on a card: read every ``ceil(R / (budget * T))``
        iterations, R the measured cost of a plain reading, T the loop's time per iteration
        (the monitor's own time left out), both over the window since the last choice: the
        readings between the start of that choice's reading and the start of this one."""
        reads = self._readings.count
        window = (it, now, reads, self._slow_reads, self._own_ns, self._slow_ns)
        if not self._auto_counters:
            self._next_window = _NEVER
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
                self.counter_period = min(_MAX_COUNTER_PERIOD, max(1, period))
            # The first window is short, to leave every-iteration reading early.
            self._next_window = it + max(64, 8 * self.counter_period)
        else:
            self._next_window = it + 16
        self._window = window

    # -- internals: layers and the leak check -----------------------------------------------

    def _on_growth(self, rises: int) -> None:
        """Memory ended this reading higher (or a flagged run just ended): update the flag
        and, when flagged, the suspects."""
        flagged = rises >= self.leak_check.window and self.leak_check.flagged
        self._readings.flagged = flagged
        if flagged:
            self._update_suspects()
        else:
            self._suspects_key = None  # a new run of rises looks its suspects up afresh

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
            t0 = _clock()
            self.probe.start(next_iteration)
            self._probe_start_ms = (_clock() - t0) / 1e6
            self._last_probe_iteration = next_iteration
        if due and not self._adaptive:
            period = self.layer_period or 0
            self._next_probe = (next_iteration // period + 1) * period
        return started

    def _plan_next_probe(self, it: int, ms: float | None, now: int) -> None:
        """After a measured iteration: what it cost the loop and, if adaptive, when next."""
        typical = self._typical_ms()
        cost_ms = self._probe_start_ms + (_clock() - now) / 1e6
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

    def _update_suspects(self) -> None:
        # A tensor from an iteration at least two records back has outlived the loop's own
        # variables (the last output and loss are still referenced at record()). Looked up
        # once per measured iteration, not on every flagged reading: O(1) per iteration.
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
