"""Monitor: per-layer numbers by hand arithmetic, totals, CSV, printing, leak check, CUDA."""

from __future__ import annotations

import csv
import gc
import io
import subprocess
import sys
import time

import pytest
import torch
from rich.console import Console
from torch import nn

from memadvisor import BadInputError, Monitor
from memadvisor.monitor import IterationRecord, LeakCheck
from memadvisor.monitor._output import CSV_COLUMNS, csv_row, iteration_table, print_table, step_line
from memadvisor.monitor._probe import ProbeResult
from memadvisor.monitor._source import MemorySource
from memadvisor.timeline import MemoryReading


class Tiny(nn.Module):
    """Linear(4, 8) -> ReLU -> Linear(8, 2) on batch 2, fp32: every byte countable by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class CachingLinear(nn.Module):
    """A layer that keeps every output it makes: the leak the check must name."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.kept: list[torch.Tensor] = []
        self.leak = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.fc(x)
        if self.leak:
            self.kept.append(y.detach())
        return y


class Slow(Tiny):
    """Tiny with a 50 ms forward: a measured iteration costs the loop far less than a step."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return super().forward(x)


class ScriptedSource(MemorySource):
    """Readings from a script, one per record(): the monitor's arithmetic without a model's
    real memory (and, as it is not a CPU meter, without `with monitor:`)."""

    device = "cpu"

    def __init__(self, readings: list[tuple[int, int | None, int, int | None]]) -> None:
        self.readings = list(readings)
        self.reader = lambda: MemoryReading(0, 0, None, 0)

    def take(self) -> tuple[int, int | None, int, int | None]:
        return self.readings.pop(0)


def _quiet() -> Console:
    return Console(file=io.StringIO(), width=160)


def _train(model: nn.Module, monitor: Monitor, steps: int, *, keep=None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with monitor:
        for _ in range(steps):
            out = model(torch.randn(2, 4))
            loss = out.pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            if keep is not None:
                keep.append(out)
            monitor.record()


def test_per_layer_numbers_match_hand_arithmetic():
    """fc1: W 4x8 + b 8 = 160 B (grads the same), saves x (2x4 = 32 B); act saves its output
    (2x8 = 64 B); fc2: 8x2 + 2 = 72 B, saves act's output too, which counts once (to act)."""
    torch.manual_seed(0)
    model = Tiny()
    monitor = Monitor(model, print_period=1, layer_period=1, console=_quiet())
    _train(model, monitor, 2)
    layers = {la.module: la for la in monitor.layers}
    got = {
        name: (la.weight_bytes, la.grad_bytes, la.saved_tensors, la.saved_bytes)
        for name, la in layers.items()
    }
    assert got == {
        "": (0, 0, 0, 0),
        "fc1": (160, 160, 1, 32),
        "act": (0, 0, 1, 64),
        "fc2": (72, 72, 1, 0),
    }
    rec = monitor.history[-1]
    assert rec.layers_measured and monitor.layers_iteration == 2
    assert (rec.weight_bytes, rec.grad_bytes, rec.saved_activation_bytes) == (232, 232, 96)
    assert layers["fc1"].forward_ms is not None and layers["fc1"].forward_ms >= 0
    assert layers["fc2"].backward_ms is not None
    # Forward of fc1 allocates exactly one tensor (addmm's output) on the CPU meter.
    assert layers["fc1"].allocations == 1


def test_optimizer_state_and_other_bytes_add_up_to_the_peak():
    """Adam keeps exp_avg and exp_avg_sq (2 x 232 B) and a 4-byte step per parameter (4);
    other = peak - weights - grads - optimizer state - saved activations."""
    torch.manual_seed(0)
    model = Tiny()
    opt = torch.optim.Adam(model.parameters())
    monitor = Monitor(model, print_period=1, layer_period=1, optimizer=opt, console=_quiet())
    with monitor:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            monitor.record()
    rec = monitor.history[-1]
    assert rec.optimizer_state_bytes == 2 * 232 + 4 * 4
    assert rec.other_bytes == rec.peak_allocated_bytes - 232 - 232 - 480 - 96
    # What the meter holds at record(): weights and optimizer state (grads set to None);
    # the step counters, made from Python data, are adopted at the first measured record().
    assert rec.allocated_bytes == 232 + 480


def test_light_iterations_install_no_hooks():
    """Between printed iterations the model carries no hook of the monitor."""
    model = Tiny()
    monitor = Monitor(model, print_period=5, console=_quiet())
    _train(model, monitor, 3)
    assert not any(m._forward_pre_hooks for m in model.modules())
    assert not any(r.layers_measured for r in monitor.history)


def test_prints_every_print_period_and_writes_csv_rows(tmp_path):
    """print_period=2 over 4 iterations: 2 tables; CSV: 4 step rows, layer rows twice, 1 epoch."""
    path = tmp_path / "memory.csv"
    out = io.StringIO()
    model = Tiny()
    monitor = Monitor(
        model, print_period=2, layer_period=2, csv=path, console=Console(file=out, width=160)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with monitor:
        for _ in range(4):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            monitor.record()
        monitor.epoch_end()
    text = out.getvalue()
    assert text.count("memadvisor · Tiny · iteration") == 2
    assert "fc1" in text and "epoch 0: 4 iterations" in text
    rows = list(csv.DictReader(path.open()))
    scopes = [r["scope"] for r in rows]
    assert scopes.count("step") == 4 and scopes.count("epoch") == 1
    layer_rows = [r for r in rows if r["scope"] == "layer"]
    assert {r["iteration"] for r in layer_rows} == {"2", "4"}
    assert {r["module"]: r["weight_bytes"] for r in layer_rows if r["iteration"] == "4"}[
        "fc1"
    ] == "160"
    # A second monitor appends to the same file without a second header.
    Monitor(Tiny(), print_period=0, csv=path, console=_quiet()).close()
    assert path.read_text().count("scope,iteration") == 1


def test_cpu_record_outside_the_meter_says_what_to_do():
    """On the CPU nothing is tracked outside `with monitor:`; record() says so."""
    monitor = Monitor(Tiny(), print_period=0, console=_quiet())
    with pytest.raises(BadInputError, match="with monitor"):
        monitor.record()


def test_bad_periods_are_rejected():
    """Negative periods, a leak window below 2, a budget outside (0, 1] and an empty history
    raise BadInputError naming the value."""
    with pytest.raises(BadInputError, match="print_period"):
        Monitor(Tiny(), print_period=-1)
    with pytest.raises(BadInputError, match="layer_period"):
        Monitor(Tiny(), layer_period=-1)
    with pytest.raises(BadInputError, match="leak_window"):
        Monitor(Tiny(), leak_window=1)
    for budget in (0.0, 1.5):
        with pytest.raises(BadInputError, match="layer_budget"):
            Monitor(Tiny(), layer_budget=budget)
    with pytest.raises(BadInputError, match="history"):
        Monitor(Tiny(), history=0)
    with pytest.raises(BadInputError, match="counter_period"):
        Monitor(Tiny(), counter_period=0)
    for budget in (0.0, 2.0):
        with pytest.raises(BadInputError, match="counter_budget"):
            Monitor(Tiny(), counter_budget=budget)


def test_record_returns_nothing_and_history_builds_bounded_records_on_read():
    """record() returns None (it stays cheap); `last` and `history` are IterationRecords built
    from the raw rows, newest last, the oldest dropped past `history`; so are the timeline's
    samples, whose dropped ones are counted."""
    readings = [(100 * i, 1000, 100 * i + 50, 1100) for i in range(1, 6)]
    monitor = Monitor(
        Tiny(), print_period=0, history=3, source=ScriptedSource(readings), console=_quiet()
    )
    assert monitor.last is None
    for _ in range(5):
        assert monitor.record() is None
    assert [r.iteration for r in monitor.history] == [3, 4, 5]
    assert len(monitor.history) == 3
    assert isinstance(monitor.last, IterationRecord) and monitor.last == monitor.history[-1]
    assert [r.allocated_bytes for r in monitor.history[:2]] == [300, 400]
    last = monitor.last
    assert (last.peak_allocated_bytes, last.reserved_bytes, last.fragmentation) == (550, 1000, 0.5)
    assert last.iteration_ms is not None and monitor.history[0].iteration_ms is not None
    timeline = monitor.timeline()
    assert [e.phase for e in timeline.events] == ["iteration 3", "iteration 4", "iteration 5"]
    assert timeline.dropped_events == 2


def test_epoch_end_summarises_its_own_iterations_from_running_numbers(tmp_path):
    """Scripted readings over two epochs: each summary has its epoch's highest peaks, the last
    reading's current bytes, the mean of its iteration times; epoch rows go to the CSV."""
    path = tmp_path / "memory.csv"
    epoch0 = [(100, 1000, 150, 1100), (120, 1000, 300, 1200), (110, 1000, 200, 1000)]
    epoch1 = [(100, 900, 120, 950), (100, 900, 110, 900)]
    monitor = Monitor(
        Tiny(), print_period=0, csv=path, source=ScriptedSource(epoch0 + epoch1),
        console=_quiet(),
    )  # fmt: skip
    for _ in range(3):
        monitor.record()
    first = monitor.epoch_end()
    times = [r.iteration_ms for r in monitor.history if r.iteration_ms is not None]
    for _ in range(2):
        monitor.record()
    second = monitor.epoch_end()
    assert (first.epoch, first.iteration, first.allocated_bytes) == (0, 3, 110)
    assert (first.peak_allocated_bytes, first.peak_reserved_bytes) == (300, 1200)
    assert first.iteration_ms == pytest.approx(sum(times) / len(times))
    assert (second.epoch, second.peak_allocated_bytes, second.peak_reserved_bytes) == (1, 120, 950)
    assert monitor.epoch_end() is None  # an epoch without iterations
    epochs = [r for r in csv.DictReader(path.open()) if r["scope"] == "epoch"]
    assert [(r["epoch"], r["peak_allocated_bytes"]) for r in epochs] == [("0", "300"), ("1", "120")]


def _lines(path) -> list[str]:
    return path.read_text().splitlines()


def test_csv_lines_wait_in_memory_until_a_print_or_close_and_none_are_lost(tmp_path):
    """print_period=3: two records leave only the header in the file; the printed third
    writes all three; the fourth waits until close(); a record after close reopens the file."""
    path = tmp_path / "memory.csv"
    source = ScriptedSource([(100, 200, 100, 200)] * 5)
    monitor = Monitor(Tiny(), print_period=3, layers=False, csv=path, source=source,
                      console=_quiet())  # fmt: skip
    monitor.record()
    monitor.record()
    assert len(_lines(path)) == 1  # the header
    monitor.record()
    assert len(_lines(path)) == 4
    monitor.record()
    assert len(_lines(path)) == 4
    monitor.close()
    assert len(_lines(path)) == 5
    monitor.record()
    monitor.close()
    rows = list(csv.DictReader(path.open()))
    assert [r["iteration"] for r in rows] == ["1", "2", "3", "4", "5"]


def test_csv_lines_are_written_when_they_have_waited_csv_flush_s(tmp_path):
    """csv_flush_s=0: every record() finds the lines due and writes its own at once."""
    path = tmp_path / "memory.csv"
    monitor = Monitor(Tiny(), print_period=0, csv=path, csv_flush_s=0,
                      source=ScriptedSource([(1, 2, 1, 2)] * 3), console=_quiet())  # fmt: skip
    for n in range(1, 4):
        monitor.record()
        assert len(_lines(path)) == 1 + n


def test_csv_lines_of_a_monitor_never_closed_are_written_when_it_is_collected(tmp_path):
    """A monitor dropped without close(): its queued lines reach the file when collected."""
    path = tmp_path / "memory.csv"
    monitor = Monitor(Tiny(), print_period=0, csv=path,
                      source=ScriptedSource([(1, 2, 1, 2)] * 3), console=_quiet())  # fmt: skip
    for _ in range(3):
        monitor.record()
    assert len(_lines(path)) == 1
    del monitor
    gc.collect()
    assert len(_lines(path)) == 4


def test_csv_lines_of_a_monitor_never_closed_are_written_at_interpreter_exit(tmp_path):
    """A script that records three iterations and exits without close(): three step lines."""
    path = tmp_path / "memory.csv"
    script = f"""
import torch, memadvisor
from memadvisor.monitor._source import MemorySource

class Constant(MemorySource):
    device = "cpu"
    reader = staticmethod(lambda: (1, 2))
    def take(self):
        return (1, 2, 1, 2)

mon = memadvisor.Monitor(torch.nn.Linear(2, 2), print_period=0, csv={str(path)!r},
                         source=Constant())
for _ in range(3):
    mon.record()
assert len(open({str(path)!r}).read().splitlines()) == 1  # queued, not written yet
"""
    subprocess.run([sys.executable, "-c", script], check=True, timeout=120)
    assert [r["scope"] for r in csv.DictReader(path.open())] == ["step"] * 3


# -- leak check -------------------------------------------------------------------------------


def test_leak_is_flagged_with_the_layer_that_keeps_its_outputs():
    """A layer that appends its output to a list each step: flagged, naming that layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), CachingLinear(), nn.Linear(8, 1))
    monitor = Monitor(model, print_period=100, console=_quiet())
    _train(model, monitor, 10)
    leak = monitor.leak
    assert leak.flagged
    assert leak.growth_bytes == leak.iterations * 2 * 8 * 4  # one (2, 8) fp32 output per step
    assert leak.suspects[0].module == "2.fc"
    assert "2.fc" in leak.message


def test_leak_is_flagged_where_the_loop_keeps_the_models_outputs():
    """The loop keeps every output (with its graph): flagged, naming the last layer."""
    torch.manual_seed(0)
    model = Tiny()
    monitor = Monitor(model, print_period=100, console=_quiet())
    _train(model, monitor, 10, keep=[])
    assert monitor.leak.flagged
    assert monitor.leak.suspects[0].module == "fc2"


def test_a_storage_id_left_by_a_freed_temporary_is_tracked_afresh():
    """Storages are keyed by id, and a temporary freed earlier in the iteration can hand its
    id to a new output: that output is still tracked, under the layer that made it (CI met
    this as a leak naming no layer)."""
    import weakref

    from memadvisor.monitor._probe import LayerProbe
    from memadvisor.timeline import ModuleEventRecorder

    model = Tiny()
    probe = LayerProbe(model, ModuleEventRecorder(model, lambda: (0, None)))
    out = torch.randn(2, 2)
    st = out.untyped_storage()

    class Gone:  # stands for the freed temporary's storage object: its weakref is dead
        pass

    dead = weakref.ref(Gone())
    probe._created[id(st)] = ("fc1", dead, 64)  # what the temporary left under this id
    probe._on_output("fc2", out)
    result = ProbeResult(1, [], probe._created)
    assert [(s.module, s.surviving_bytes) for s in result.survivors()] == [("fc2", st.nbytes())]


def test_clean_loop_is_not_flagged():
    """The same loops without the kept references: never flagged."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), CachingLinear(), nn.Linear(8, 1))
    model[2].leak = False
    monitor = Monitor(model, print_period=3, layer_period=3, console=_quiet())
    _train(model, monitor, 12)
    assert not monitor.leak.flagged
    # ...and memory never rose, so no extra iteration was measured for the leak check.
    assert [r.iteration for r in monitor.history if r.layers_measured] == [3, 6, 9, 12]


@pytest.mark.parametrize(
    ("ends", "flagged"),
    [
        ([10, 20, 30, 40, 50, 60, 70], True),  # warmup 10, then 5 rises
        ([10, 20, 30, 40, 50, 60], False),  # only 4 rises after warmup
        ([10, 20, 30, 40, 40, 50, 60, 70], False),  # a flat step resets the count
        ([100, 20, 20, 20, 20, 20, 20], False),  # first step's optimizer state is warmup
    ],
)
def test_leak_check_needs_window_consecutive_rises(ends, flagged):
    """window=5: five consecutive rises after the warmup record flag; a flat step resets."""
    check = LeakCheck(5)
    for b in ends:
        check.add(b)
    assert check.flagged is flagged


def test_leak_suspects_are_looked_up_once_per_measured_iteration(monkeypatch):
    """A loop leaking for 30 iterations: flagged on most of them, but each measured
    iteration's survivors are looked up once, not on every flagged record() (O(1) each)."""
    calls: list[int] = []
    survivors = ProbeResult.survivors

    def counted(self: ProbeResult):
        calls.append(self.iteration)
        return survivors(self)

    monkeypatch.setattr(ProbeResult, "survivors", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), CachingLinear(), nn.Linear(8, 1))
    monitor = Monitor(model, print_period=100, console=_quiet())
    flagged = 0
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with monitor:
        for _ in range(30):
            model(torch.randn(2, 4)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
            monitor.record()
            flagged += monitor.leak.flagged
    assert flagged >= 20
    assert monitor.leak.suspects[0].module == "2.fc"
    assert len(calls) == len(set(calls)) <= 6


# -- per-layer schedule ---------------------------------------------------------------------------


def test_layers_are_measured_on_every_print_when_the_budget_allows():
    """A 50 ms step, layer_budget=1: a measured iteration costs the loop less than a step, so
    every printed iteration is measured, and the cost is reported."""
    model = Slow()
    monitor = Monitor(model, print_period=2, layer_budget=1.0, console=_quiet())
    _train(model, monitor, 8)
    assert [r.iteration for r in monitor.history if r.layers_measured] == [2, 4, 6, 8]
    assert monitor.layer_cost_ms is not None and 0 < monitor.layer_cost_ms < 50


def test_layers_are_spaced_out_to_stay_within_the_budget():
    """A tiny budget: only the first printed iteration is measured (iteration 2 gave the
    loop's typical time); later tables still show its layers, labelled with its iteration."""
    out = io.StringIO()
    model = Tiny()
    monitor = Monitor(model, print_period=3, layer_budget=1e-9, console=Console(file=out))
    _train(model, monitor, 12)
    assert [r.iteration for r in monitor.history if r.layers_measured] == [3]
    last_table = out.getvalue().split("memadvisor · Tiny · iteration 12")[1]
    assert "per layer (measured in iteration 3)" in last_table and "fc1" in last_table


def test_a_measurement_discarded_by_close_is_made_at_the_next_iteration():
    """close() after record 1 drops the probe set for iteration 2 (hooks must not outlive
    the block); the monitor measures iteration 3 instead of never measuring again."""
    model = Tiny()
    monitor = Monitor(model, print_period=2, source=ScriptedSource([(1, 2, 1, 2)] * 4),
                      console=_quiet())  # fmt: skip
    monitor.record()
    monitor.close()
    assert not any(m._forward_pre_hooks for m in model.modules())
    for _ in range(3):
        model(torch.randn(2, 4)).sum().backward()
        monitor.record()
    assert [r.iteration for r in monitor.history if r.layers_measured] == [3]


def test_layer_table_columns_line_up():
    """The printed per-layer table: header, rule and rows are all the same width, the numbers
    right-aligned under their headers."""
    out = io.StringIO()
    model = Tiny()
    monitor = Monitor(model, print_period=2, layer_period=2, console=Console(file=out, width=80))
    _train(model, monitor, 2)
    lines = out.getvalue().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("layer "))
    table = lines[start : start + 2 + 4]  # header, rule, <model>, fc1, act, fc2
    assert table[1] == "─" * len(table[0])
    assert {len(line) for line in table} == {len(table[0])}
    fc1 = next(line for line in table if line.startswith("fc1 "))
    assert fc1.split()[1:4] == ["Linear", "160", "B"]
    assert table[0].index("weights") + len("weights") == fc1.index("160 B") + len("160 B")


@pytest.mark.parametrize(
    "ends",
    [
        [100, 100, 110, 120, 130, 140, 150],  # flat from the warmup record, then 5 rises
        [100, 90, 90, 90, 100, 110, 120, 130, 140, 140, 150],  # flat, 5 rises, flat, 1 rise
        [50, 60, 60, 70, 80, 90, 100, 110],
    ],
)
def test_monitor_leak_verdicts_equal_a_leak_check_fed_every_record(ends):
    """record() skips the leak check while memory stays flat; its verdicts, iteration by
    iteration, are those of a LeakCheck given every value."""
    readings = [(b, 1000, b, 1000) for b in ends]
    monitor = Monitor(Tiny(), print_period=0, source=ScriptedSource(readings), console=_quiet())
    check = LeakCheck(5)
    for b in ends:
        monitor.record()
        check.add(b)
        leak = monitor.leak
        assert (leak.flagged, leak.iterations, leak.growth_bytes) == (
            check.flagged,
            check.rises,
            check.growth_bytes,
        )


# -- counters read every few iterations ---------------------------------------------------------


class CountingSource(MemorySource):
    """Reading n (from 1) is (100, 1000, 100 + 50 n, 1100), after ``delay_s`` of sleep (100 n
    allocated if ``moving``: memory that ends every iteration higher); counts its calls.
    ``costly_reads`` as given: True lets the monitor space readings out."""

    device = "cpu"

    def __init__(self, *, costly: bool = False, delay_s: float = 0.0, moving=False) -> None:
        self.calls = 0
        self.costly_reads = costly
        self.delay_s = delay_s
        self.moving = moving
        self.reader = lambda: MemoryReading(0, 0, None, 0)

    def take(self) -> tuple[int, int | None, int, int | None]:
        if self.delay_s:
            time.sleep(self.delay_s)
        self.calls += 1
        return 100 * (self.calls if self.moving else 1), 1000, 100 + 50 * self.calls, 1100


def test_counter_period_reads_every_nth_iteration_and_its_peak_covers_those_between():
    """counter_period=3 on the CPU meter: readings at iterations 1, 4, 7, covering 1, 3 and 3
    iterations; a 1 MiB temporary freed in iteration 2 (not read) is in reading 4's peak,
    and not in reading 7's."""
    torch.manual_seed(0)
    model = Tiny()
    monitor = Monitor(model, print_period=0, layers=False, counter_period=3, console=_quiet())
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with monitor:
        for i in range(1, 8):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if i == 2:
                tmp = torch.empty(2**18)  # 1 MiB
                del tmp
            monitor.record()
    recs = list(monitor.history)
    assert [(r.iteration, r.iterations) for r in recs] == [(1, 1), (4, 3), (7, 3)]
    by_it = {r.iteration: r for r in recs}
    assert by_it[4].peak_allocated_bytes >= by_it[4].allocated_bytes + 2**20
    assert by_it[7].peak_allocated_bytes < by_it[7].allocated_bytes + 2**20
    assert all(r.iteration_ms is not None and r.iteration_ms >= 0 for r in recs[1:])


def test_printed_measured_and_epoch_ending_iterations_are_always_read(tmp_path):
    """counter_period=4 with prints every 6 and layers every 5: iterations 5 and 10 are read
    and measured, 6 is read (and printed), epoch_end reads iteration 11; nothing else is read
    off the period, every iteration is covered once, and the CSV has one step line per
    reading, its `iterations` column filled, and the epoch line covering all 11."""
    path = tmp_path / "memory.csv"
    out = io.StringIO()
    model = Tiny()
    source = CountingSource()
    monitor = Monitor(model, print_period=6, layer_period=5, counter_period=4, csv=path,
                      source=source, console=Console(file=out, width=160))  # fmt: skip
    for _ in range(11):
        model(torch.randn(2, 4)).sum().backward()
        monitor.record()
    summary = monitor.epoch_end()
    recs = list(monitor.history)
    read = [r.iteration for r in recs]
    assert {5, 6, 10, 11} <= set(read)
    assert [r.iteration for r in recs if r.layers_measured] == [5, 10]
    assert source.calls == len(recs) < 11
    assert sum(r.iterations for r in recs) == 11
    assert all(b - a <= 4 for a, b in zip([0, *read], read, strict=False))
    assert out.getvalue().count("memadvisor · Tiny · iteration 6") == 1
    assert summary.iterations == 11
    assert summary.peak_allocated_bytes == max(r.peak_allocated_bytes for r in recs)
    rows = list(csv.DictReader(path.open()))
    steps = [r for r in rows if r["scope"] == "step"]
    assert [(int(r["iteration"]), int(r["iterations"])) for r in steps] == [
        (r.iteration, r.iterations) for r in recs
    ]
    assert [r["iterations"] for r in rows if r["scope"] == "epoch"] == ["11"]


def test_close_reads_the_iterations_since_the_latest_reading():
    """counter_period=5: readings at 1 and 6; close() after iteration 7 reads it, so the
    history covers all 7 iterations."""
    source = CountingSource()
    monitor = Monitor(Tiny(), print_period=0, counter_period=5, source=source, console=_quiet())
    for _ in range(7):
        monitor.record()
    assert [r.iteration for r in monitor.history] == [1, 6]
    monitor.close()
    assert [(r.iteration, r.iterations) for r in monitor.history] == [(1, 1), (6, 5), (7, 1)]
    assert source.calls == 3


@pytest.mark.parametrize("moving", [False, True])
def test_costly_readings_are_spaced_out_to_stay_within_the_counter_budget(moving):
    """A source that takes 2 ms to read in a loop of 1 ms iterations, counter_budget=0.5:
    the monitor settles on reading about every 2 / (0.5 * 1) = 4 iterations, measured, not
    told; it reads only then, and its records still cover every iteration. So it does when
    memory moves at every reading (each one then goes through the leak check)."""
    source = CountingSource(costly=True, delay_s=0.002, moving=moving)
    monitor = Monitor(Tiny(), print_period=0, counter_budget=0.5, source=source,
                      console=_quiet())  # fmt: skip
    assert monitor.counter_period == 1
    for _ in range(120):
        time.sleep(0.001)
        monitor.record()
    assert 2 <= monitor.counter_period <= 8
    assert source.calls == len(monitor.history) < 80
    assert sum(r.iterations for r in monitor.history) == monitor.history[-1].iteration
    assert monitor.own_ms >= 2 * source.calls  # the readings' own 2 ms each


def test_cheap_readings_and_the_cpu_meter_are_read_every_iteration():
    """A costly-marked source whose reading is cheap next to a 10 ms iteration stays at one
    reading per iteration; a source not marked costly (the CPU meter's) is never spaced out."""
    cheap = CountingSource(costly=True)
    # A 10% budget: a reading may cost up to 1 ms before the period grows, so a scheduling
    # hiccup on a loaded CI core does not space the readings out.
    monitor = Monitor(Tiny(), print_period=0, counter_budget=0.1, source=cheap,
                      console=_quiet())  # fmt: skip
    for _ in range(90):
        time.sleep(0.01)
        monitor.record()
    assert monitor.counter_period == 1 and cheap.calls == 90
    plain = CountingSource(costly=False, delay_s=0.002)
    monitor = Monitor(Tiny(), print_period=0, source=plain, console=_quiet())
    for _ in range(90):
        monitor.record()
    assert monitor.counter_period == 1 and plain.calls == 90


def test_step_line_is_what_the_csv_module_writes_of_csv_row():
    """The directly formatted step line parses to csv_row's cells: None as empty, the time
    to 0.1 us, the flag as 0/1."""
    totals = [(None,) * 5, (232, 232, 96, 480, 1234)]
    rows = [
        (1, 0, None, 100, 150, None, None, totals[0], False, False, 123, 1),
        (9, 2, 3.14159265, 2**31, 2**31 + 5, 2**32, 2**32 + 7, totals[1], True, True, 456, 4),
    ]
    for row in rows:
        (direct,) = list(csv.reader(io.StringIO(step_line(row))))
        buf = io.StringIO()
        csv.writer(buf).writerow(csv_row(row))
        (via_csv,) = list(csv.reader(io.StringIO(buf.getvalue())))
        assert len(direct) == len(via_csv) == len(CSV_COLUMNS)
        ms = CSV_COLUMNS.index("iteration_ms")
        assert direct[:ms] + direct[ms + 1 :] == via_csv[:ms] + via_csv[ms + 1 :]
        assert (direct[ms] == "") == (via_csv[ms] == "")
        if direct[ms]:
            assert float(direct[ms]) == pytest.approx(float(via_csv[ms]), abs=1e-4)
        assert step_line(row).endswith("\r\n")


def test_tables_reach_a_plain_console_as_rich_would_print_them_and_a_terminal_in_colour():
    """A console without colours gets the text rich writes (recording it makes rich write),
    each table on its own lines; a terminal gets the same characters plus styles (ANSI
    escapes); a quiet console gets nothing."""
    model = Tiny()
    monitor = Monitor(model, print_period=2, layer_period=2, console=_quiet())
    _train(model, monitor, 2)
    table = iteration_table(monitor.last, monitor._layer_text, monitor.leak, model_name="Tiny")
    fast, slow = io.StringIO(), io.StringIO()
    for _ in range(2):
        print_table(Console(file=fast, width=160), table)
        print_table(Console(file=slow, width=160, record=True), table)  # through rich
    assert fast.getvalue() == slow.getvalue() == 2 * (table.plain + "\n")
    coloured = io.StringIO()
    terminal = Console(file=coloured, width=160, force_terminal=True, record=True)
    print_table(terminal, table)
    assert "\x1b[" in coloured.getvalue()
    assert terminal.export_text() == table.plain + "\n"
    quiet = io.StringIO()
    print_table(Console(file=quiet, quiet=True), table)
    assert quiet.getvalue() == ""


# -- CUDA ---------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_monitor_matches_allocator_and_cpu_layer_numbers():
    """On a card: allocated and reserved at record() are the allocator's; each record's peak
    covers a 4 MiB temporary freed in its own iteration only (peaks reset per record());
    per-layer bytes equal the CPU's."""
    torch.manual_seed(0)
    model = Tiny().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, print_period=1, layer_period=1, console=_quiet())
    for i in range(4):
        model(torch.randn(2, 4, device="cuda")).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == 2:
            tmp = torch.empty(2**20, device="cuda")  # 4 MiB
            del tmp
        monitor.record()
        rec = monitor.last
        assert rec.allocated_bytes == torch.cuda.memory_allocated()
        assert rec.reserved_bytes == torch.cuda.memory_reserved()
        assert rec.peak_allocated_bytes >= rec.allocated_bytes
        if i == 2:
            assert rec.peak_allocated_bytes >= rec.allocated_bytes + 4 * 2**20
        if i == 3:
            assert rec.peak_allocated_bytes < rec.allocated_bytes + 4 * 2**20
    layers = {la.module: (la.weight_bytes, la.saved_bytes) for la in monitor.layers}
    assert layers == {"": (0, 0), "fc1": (160, 32), "act": (0, 64), "fc2": (72, 0)}
    monitor.close()


@pytest.mark.gpu
def test_cuda_short_steps_are_read_every_few_iterations_and_lose_no_peak():
    """On a card, a tiny model's step is a few hundred us of launches, so a ~20 us reading
    every iteration would exceed the 0.05% budget: after 200 iterations readings are spaced
    out; a 4 MiB temporary freed in an iteration that is not read is in the next reading's
    peak; allocated at a reading is the allocator's; the records cover every iteration."""
    torch.manual_seed(0)
    model = Tiny().cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    monitor = Monitor(model, print_period=0, console=_quiet())
    with monitor:
        for _ in range(200):
            model(torch.randn(2, 4, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
            monitor.record()
        period = monitor.counter_period
        assert period > 1
        last = monitor.last.iteration
        while monitor.iteration + 1 >= last + period:  # the next record() is a reading
            monitor.record()
            last = monitor.last.iteration
        tmp = torch.empty(2**20, device="cuda")  # 4 MiB, in an iteration not read
        del tmp
        for _ in range(period):
            monitor.record()
        rec = monitor.last
        assert rec.iteration == last + period and rec.iterations == period
        assert rec.peak_allocated_bytes >= rec.allocated_bytes + 4 * 2**20
        assert rec.allocated_bytes == torch.cuda.memory_allocated()
    assert sum(r.iterations for r in monitor.history) == monitor.iteration


def test_measuring_layers_keeps_no_tensor_alive():
    """Iterations measured per layer end at the same allocated bytes as unmeasured ones."""
    torch.manual_seed(0)
    model = Tiny()
    monitor = Monitor(model, print_period=2, console=_quiet())
    _train(model, monitor, 6)
    ends = {r.layers_measured: r.allocated_bytes for r in list(monitor.history)[1:]}
    assert ends[True] == ends[False]


def test_checkpointed_blocks_hide_their_saved_tensors_but_not_their_weights():
    """A checkpointed Linear saves nothing the monitor sees (recomputed in backward); its
    weights and gradients are still counted, and backward still runs."""
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Linear(4, 8)
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(checkpoint(self.inner, x, use_reentrant=False))

    torch.manual_seed(0)
    model = Net()
    monitor = Monitor(model, print_period=1, console=_quiet())
    _train(model, monitor, 2)
    layers = {la.module: la for la in monitor.layers}
    assert (layers["inner"].saved_bytes, layers["inner"].weight_bytes) == (0, 160)
    assert layers["inner"].grad_bytes == 160
    assert layers["head"].saved_bytes == 2 * 8 * 4  # inner's output, saved by head


def test_monitor_timeline_exports_like_the_profiler():
    """The monitor's timeline (samples every iteration, module events when measured) is the
    shared Timeline: both speedscope exports validate against the schema."""
    import json
    from pathlib import Path

    import jsonschema

    schema = json.loads((Path(__file__).parents[1] / "data" / "speedscope_schema.json").read_text())
    model = Tiny()
    monitor = Monitor(model, print_period=2, console=_quiet())
    _train(model, monitor, 4)
    tl = monitor.timeline()
    assert sum(e.kind == "sample" for e in tl.events) == 4
    assert any(e.kind == "enter" and e.pass_ == "backward" for e in tl.events)
    for weight in ("bytes", "ms"):
        jsonschema.validate(tl.to_speedscope(weight), schema)
