"""Monitor: memory per iteration and per layer inside the user's own training loop.

This module holds the loop's side: the calls the loop makes (``record``, ``with monitor:``,
``close``) and what a reading leads to (``_event``: the leak check, a print, a measurement,
CSV lines). The rest is split by job: :mod:`._options` checks the options, :mod:`._cadence`
chooses how often to read, :mod:`._layers` when to measure per layer, :mod:`._alerts` the
leak verdict, :mod:`._summary` the results; each is a part the Monitor class is made of
(one object, so that ``record()``, paid every iteration, reaches its state directly).

Known limitations:
    * On the CPU nothing is tracked outside ``with monitor:`` (the meter sees only what runs
      inside it); a reading there raises.
    * Peaks on CUDA are reset at every reading: code that reads
      ``torch.cuda.max_memory_allocated`` itself sees peaks since the monitor's last reading.
"""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
from rich.console import Console
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.monitor._alerts import LeakWatch
from memadvisor.monitor._cadence import NEVER, CounterCadence, clock
from memadvisor.monitor._layers import LayerSchedule
from memadvisor.monitor._options import check_options
from memadvisor.monitor._output import CsvLog, default_console
from memadvisor.monitor._readings import IterationHistory, Readings
from memadvisor.monitor._source import MemorySource, MeterSource, source_for
from memadvisor.monitor._summary import MonitorResults
from memadvisor.timeline import ModuleEventRecorder

__all__ = ["Monitor"]

# Raw readings turned into rows at least this often (iterations), so the buffer stays small.
_DIGEST_EVERY = 1024


class Monitor(MonitorResults, LeakWatch, LayerSchedule, CounterCadence):
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
        check_options(
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
        self.optimizer = optimizer
        self.max_rows = max_rows
        self.console = console or default_console()
        self.source = source if source is not None else source_for(model)
        self._meter = self.source.meter if isinstance(self.source, MeterSource) else None
        # On the CPU the meter counts only inside `with monitor:`; until then a reading says so
        # (swapping the function costs record() nothing, a check would cost every call).
        self._take = self._outside_meter if self._meter is not None else self.source.take
        # Global hooks: a measured iteration installs two hooks, not two per module.
        self.recorder = ModuleEventRecorder(
            model,
            self.source.reader,
            max_events=max_events,
            device=self.source.device,
            global_hooks=True,
        )
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
        self._last_ns: int | None = None  # end of the latest reading's record()
        self._next_print = print_period or -1  # the next iteration that prints
        self._flush_due_ns = NEVER
        self._epoch_first = 1
        self._init_cadence(counter_period, counter_budget)
        self._init_leak(leak_window)
        self._init_layers(layers, layer_period, layer_budget)
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
        now = clock()
        allocated, reserved, peak, peak_reserved = self._take()
        self._raw.append((it, now, self._last_ns, allocated, peak, reserved, peak_reserved))
        if allocated != self._leak_last or it >= self._next_event or now > self._flush_due_ns:
            busy = self._event(it, now)
            end = self._last_ns = clock()
            if busy:
                self._slow_ns += end - now
                self._slow_reads += 1
            else:
                self._own_ns += end - now
            return
        nxt = it + self.counter_period
        self._next_read = nxt if nxt < self._next_event else self._next_event
        end = self._last_ns = clock()
        self._own_ns += end - now

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
        now = clock()
        allocated, reserved, peak, peak_reserved = self.source.take()
        self._raw.append((it, now, self._last_ns, allocated, peak, reserved, peak_reserved))
        self._event(it, now)
        end = self._last_ns = clock()
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
