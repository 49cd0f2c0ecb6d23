"""Timeline schema, its speedscope exports, per-module stats, and the module event recorder."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memadvisor.memory import MemoryMeter
from memadvisor.timeline import (
    MeterMemoryReader,
    ModuleEventRecorder,
    Timeline,
    TimelineEvent,
    meter_memory_reader,
)

SCHEMA = json.loads((Path(__file__).parent / "data" / "speedscope_schema.json").read_text())


def _ev(t: float, kind: str, alloc: int, module: str | None = None, pass_=None, **kw):
    return TimelineEvent(t_ms=t, kind=kind, module=module, pass_=pass_, allocated_bytes=alloc, **kw)


def _hand_timeline() -> Timeline:
    """forward: model > a (+100 B) ; model > b (+50 B, then frees 30) ; backward of b: +20 B."""
    return Timeline(
        device="cpu",
        model_name="Net",
        events=[
            _ev(0.0, "phase", 0, phase="forward"),
            _ev(1.0, "enter", 0, "", "forward"),
            _ev(2.0, "enter", 0, "a", "forward"),
            _ev(3.0, "exit", 100, "a", "forward"),
            _ev(4.0, "enter", 100, "b", "forward"),
            _ev(5.0, "alloc", 150),
            _ev(6.0, "exit", 120, "b", "forward"),
            _ev(7.0, "exit", 120, "", "forward"),
            _ev(8.0, "phase", 120, phase="backward"),
            _ev(9.0, "enter", 120, "b", "backward"),
            _ev(10.0, "exit", 140, "b", "backward"),
        ],
    )


class Tiny(nn.Module):
    """Linear(4, 8) -> ReLU -> Linear(8, 2): shapes small enough to check bytes by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 8)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


# -- schema ------------------------------------------------------------------------------------


def test_timeline_json_round_trip_keeps_every_field():
    """A timeline saved as JSON loads back equal, pass_ and allocations included."""
    tl = _hand_timeline()
    tl.events.append(_ev(11.0, "sample", 7, reserved_bytes=64, allocations=3))
    tl.dropped_events = 4
    assert Timeline.model_validate_json(tl.model_dump_json()) == tl


def test_timeline_rejects_unknown_fields():
    """extra='forbid': a misspelt field is an error, not silently dropped."""
    with pytest.raises(ValueError, match="extra"):
        Timeline.model_validate({"device": "cpu", "model_name": "m", "event": []})


def test_fragmentation_is_the_unheld_share_of_reserved():
    """fragmentation = 1 - allocated/reserved; None without a reserved reading."""
    assert _ev(0, "sample", 75, reserved_bytes=100).fragmentation == pytest.approx(0.25)
    assert _ev(0, "sample", 75).fragmentation is None


# -- speedscope --------------------------------------------------------------------------------


@pytest.mark.parametrize("weight", ["bytes", "ms"])
def test_speedscope_export_matches_the_file_format_schema(weight):
    """Both exports validate against speedscope's file-format schema."""
    jsonschema.validate(_hand_timeline().to_speedscope(weight), SCHEMA)


def test_speedscope_bytes_weights_each_stack_by_the_bytes_allocated_inside_it():
    """Rises in allocated bytes are charged to the innermost open stack; frees charge nothing."""
    doc = _hand_timeline().to_speedscope("bytes")
    names = [f["name"] for f in doc["shared"]["frames"]]
    prof = doc["profiles"][0]
    by_stack = {
        " > ".join(names[i] for i in s): w
        for s, w in zip(prof["samples"], prof["weights"], strict=True)
    }
    assert by_stack == {
        "[forward] > Net > a": 100,
        "[forward] > Net > b": 50,
        "[backward] > b (backward)": 20,
    }
    assert prof["endValue"] == 170 and prof["unit"] == "bytes"


def test_speedscope_ms_events_are_balanced_and_ordered():
    """Evented export: 'at' never decreases; every close matches the innermost open frame."""
    doc = _hand_timeline().to_speedscope("ms")
    prof = doc["profiles"][0]
    stack: list[int] = []
    last = -1.0
    for e in prof["events"]:
        assert e["at"] >= last
        last = e["at"]
        if e["type"] == "O":
            stack.append(e["frame"])
        else:
            assert stack.pop() == e["frame"]
    assert stack == []
    names = [f["name"] for f in doc["shared"]["frames"]]
    opened = [names[e["frame"]] for e in prof["events"] if e["type"] == "O"]
    assert opened == ["[forward]", "Net", "a", "b", "[backward]", "b (backward)"]


def test_speedscope_closes_a_backward_module_that_never_exits_when_a_sibling_starts():
    """No backward exit (inputs need no grad): the frame closes where a non-descendant begins."""
    tl = Timeline(
        device="cpu",
        model_name="Net",
        events=[
            _ev(0, "enter", 0, "", "backward"),
            _ev(1, "enter", 0, "emb", "backward"),  # never exits
            _ev(2, "enter", 0, "pos", "backward"),
            _ev(3, "exit", 0, "pos", "backward"),
        ],
    )
    doc = tl.to_speedscope("ms")
    jsonschema.validate(doc, SCHEMA)
    names = [f["name"] for f in doc["shared"]["frames"]]
    seq = [(e["type"], names[e["frame"]], e["at"]) for e in doc["profiles"][0]["events"]]
    assert ("C", "emb (backward)", 2) in seq
    assert seq[-1] == ("C", "Net (backward)", 3)


def test_speedscope_rejects_an_unknown_weight():
    """weight is 'bytes' or 'ms'; anything else says so."""
    with pytest.raises(ValueError, match="weight"):
        _hand_timeline().to_speedscope("calls")


# -- layer stats -------------------------------------------------------------------------------


def test_layer_stats_from_a_hand_timeline():
    """Per module and pass: calls, duration, peak inside (children and alloc events included)."""
    stats = {(s.module, s.pass_): s for s in _hand_timeline().layer_stats()}
    root = stats[("", "forward")]
    assert (root.calls, root.total_ms, root.peak_allocated_bytes) == (1, 6.0, 150)
    assert root.net_allocated_bytes == 120
    b = stats[("b", "forward")]
    assert (b.total_ms, b.peak_allocated_bytes, b.net_allocated_bytes) == (2.0, 150, 20)
    assert stats[("b", "backward")].net_allocated_bytes == 20


# -- recorder ----------------------------------------------------------------------------------


def _meter_recorder(model: nn.Module, **kw) -> tuple[MemoryMeter, ModuleEventRecorder]:
    meter = MemoryMeter()
    meter.adopt(model.parameters())
    return meter, ModuleEventRecorder(model, meter_memory_reader(meter), **kw)


def test_recorder_nests_forward_and_finds_backward_of_every_module_that_needs_grad():
    """Forward: enter/exit nest per module. Backward: fc2, act, fc1-enter and the root-enter."""
    model = Tiny()
    meter, rec = _meter_recorder(model)
    x = torch.randn(2, 4)
    with rec, meter:
        model(x).sum().backward()
    seq = [(e.kind, e.module, e.pass_) for e in rec.events()]
    fwd = [s for s in seq if s[2] == "forward"]
    assert fwd == [
        ("enter", "", "forward"),
        ("enter", "fc1", "forward"),
        ("exit", "fc1", "forward"),
        ("enter", "act", "forward"),
        ("exit", "act", "forward"),
        ("enter", "fc2", "forward"),
        ("exit", "fc2", "forward"),
        ("exit", "", "forward"),
    ]
    bwd = [s for s in seq if s[2] == "backward"]
    # fc1's input x needs no grad, so neither fc1 nor the model has a backward exit. The model
    # and fc2 share one output node; fc2's hook on it was registered first, so fires first.
    assert bwd == [
        ("enter", "fc2", "backward"),
        ("enter", "", "backward"),
        ("exit", "fc2", "backward"),
        ("enter", "act", "backward"),
        ("exit", "act", "backward"),
        ("enter", "fc1", "backward"),
    ]
    # The export still nests fc2's backward inside the model's.
    # fc2's backward allocates its weight grad (2x8 fp32 = 64 B), bias grad (8 B) and the
    # grad of its input (2x8 = 64 B), all inside the model's backward frame.
    bwd_bytes = [(st, b) for st, b in rec.timeline().bytes_by_stack() if st[-1][2] == "backward"]
    assert bwd_bytes == [((("module", "", "backward"), ("module", "fc2", "backward")), 136)]


def test_recorder_forward_bytes_match_hand_arithmetic():
    """Batch 2, fp32: fc1 leaves its (2, 8) output = 64 B, fc2 its (2, 2) output = 16 B."""
    model = Tiny()
    meter, rec = _meter_recorder(model)
    with rec, meter:
        model(torch.randn(2, 4))
    stats = {(s.module, s.pass_): s for s in rec.timeline().layer_stats()}
    assert stats[("fc1", "forward")].net_allocated_bytes == 2 * 8 * 4
    assert stats[("act", "forward")].net_allocated_bytes == 2 * 8 * 4
    assert stats[("fc2", "forward")].net_allocated_bytes == 2 * 2 * 4
    assert stats[("fc1", "forward")].allocations == 1  # addmm's output, nothing else


def test_recorder_removes_every_hook_on_close():
    """After the with-block no module carries a hook of the recorder."""
    model = Tiny()
    _, rec = _meter_recorder(model)
    with rec:
        assert all(m._forward_pre_hooks for m in model.modules())
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    n = len(rec)
    model(torch.randn(2, 4))
    assert len(rec) == n


def test_recorder_keeps_the_newest_events_within_the_bound_and_counts_the_rest():
    """max_events=5 after 12 records: 5 kept (the last ones), 7 counted as dropped."""
    _, rec = _meter_recorder(Tiny(), max_events=5)
    for i in range(12):
        rec.record("sample", phase=str(i))
    assert len(rec) == 5 and rec.dropped_events == 7
    assert [e.phase for e in rec.events()] == ["7", "8", "9", "10", "11"]
    assert rec.timeline().dropped_events == 7


@pytest.mark.parametrize("bound", [50_000, 5_000])
def test_two_threads_recording_at_once_lose_no_event_below_the_bound(bound):
    """2 threads x 10,000 records: all kept under a 50k bound; exactly bound kept under 5k."""
    _, rec = _meter_recorder(Tiny(), max_events=bound)
    start = threading.Barrier(2)

    def work(tag: str) -> None:
        start.wait()
        for _ in range(10_000):
            rec.record("sample", phase=tag)

    threads = [threading.Thread(target=work, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    events = rec.events()
    assert len(events) + rec.dropped_events == 20_000
    assert len(events) == min(bound, 20_000)
    if bound >= 20_000:
        assert sum(e.phase == "a" for e in events) == 10_000
    assert all(a.t_ms <= b.t_ms for a, b in zip(events, events[1:], strict=False))


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_recorder_leaves_gradients_unchanged_with_checkpoint_and_inplace_relu(use_reentrant):
    """Hooks change no gradient of a checkpointed block followed by ReLU(inplace=True)."""

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.block = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
            self.relu = nn.ReLU(inplace=True)
            self.head = nn.Linear(4, 1)

        def forward(self, x):
            h = checkpoint(self.block, x, use_reentrant=use_reentrant)
            return self.head(self.relu(h))

    torch.manual_seed(0)
    model = Net()
    x = torch.randn(3, 4, requires_grad=True)
    model(x).sum().backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    _, rec = _meter_recorder(model)
    with rec:
        model(x.detach().requires_grad_()).sum().backward()
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g)
    bwd = {e.module for e in rec.events() if e.pass_ == "backward" and e.kind == "exit"}
    assert {"head", "block"} <= bwd
    jsonschema.validate(rec.timeline().to_speedscope("ms"), SCHEMA)
    jsonschema.validate(rec.timeline().to_speedscope("bytes"), SCHEMA)


def test_mark_phase_records_phases_for_the_export():
    """mark_phase is a train_step on_phase callback: phases become top frames."""
    from memadvisor.workload import Workload, train_step

    model = Tiny()
    wl = Workload(model=model, sample_batch=torch.randn(2, 4), loss_fn=lambda o, b: o.sum())
    opt = wl.make_optimizer(model)
    meter, rec = _meter_recorder(model)
    with rec, meter:
        train_step(wl, model, opt, wl.batch(2), on_phase=rec.mark_phase)
    phases = [e.phase for e in rec.events() if e.kind == "phase"]
    assert phases == ["forward", "loss", "backward", "optimizer", "zero_grad", "end"]
    doc = rec.timeline().to_speedscope("bytes")
    jsonschema.validate(doc, SCHEMA)
    names = {f["name"] for f in doc["shared"]["frames"]}
    assert {"[forward]", "[optimizer]", "Tiny", "fc1"} <= names


def test_interval_peaks_reveal_a_temporary_freed_inside_a_leaf_module():
    """A (2, 8) fp32 temporary (64 B) made and freed inside one module is seen only with
    interval peaks: peak_rise = temp 64 B + output 8 B; without, only the output's 8 B."""

    class Temp(nn.Module):
        def forward(self, x):
            return (x * 2).sum(dim=1)  # (2, 8) temporary, (2,) output

    rises = {}
    for interval_peaks in (False, True):
        model = nn.Sequential(Temp())
        meter = MemoryMeter()
        reader = MeterMemoryReader(meter, interval_peaks=interval_peaks)
        x = torch.randn(2, 8)
        with ModuleEventRecorder(model, reader) as rec, meter:
            model(x)
        stats = {s.module: s for s in rec.timeline().layer_stats()}
        rises[interval_peaks] = stats["0"].peak_rise_bytes
    assert rises == {False: 2 * 4, True: 2 * 8 * 4 + 2 * 4}


def test_events_last_returns_only_the_newest():
    """events(last=n) is the newest n events; recorded_total counts kept and dropped."""
    _, rec = _meter_recorder(Tiny(), max_events=3)
    for i in range(5):
        rec.record("sample", phase=str(i))
    assert [e.phase for e in rec.events(last=2)] == ["3", "4"]
    assert rec.recorded_total == 5


@pytest.mark.gpu
def test_cuda_reader_matches_the_allocator_and_tracks_interval_peaks():
    """One stats call gives what torch.cuda.memory_allocated/reserved give; with interval
    peaks, a 4 MiB temporary freed between two readings shows in the second's peak."""
    from memadvisor.timeline import CudaMemoryReader

    reader = CudaMemoryReader(interval_peaks=True, count_allocations=True)
    first = reader()
    assert first.allocated_bytes == torch.cuda.memory_allocated()
    assert first.reserved_bytes == torch.cuda.memory_reserved()
    tmp = torch.empty(2**20, device="cuda")  # 4 MiB
    del tmp
    second = reader()
    assert second.peak_allocated_bytes >= first.allocated_bytes + 4 * 2**20
    assert second.allocations == first.allocations + 1


def test_a_leaf_input_reused_across_steps_gets_one_backward_exit_per_step():
    """An input made with requires_grad=True and fed every step: one backward exit of the
    first layer per backward (its hooks would otherwise pile up), none after close()."""
    model = Tiny()
    _, rec = _meter_recorder(model)
    x = torch.randn(2, 4, requires_grad=True)
    with rec:
        for _ in range(3):
            model(x).sum().backward()
    exits = [e for e in rec.events() if (e.kind, e.module, e.pass_) == ("exit", "fc1", "backward")]
    assert len(exits) == 3
    n = len(rec)
    model(x).sum().backward()
    assert len(rec) == n


def _sequence(rec: ModuleEventRecorder) -> list[tuple]:
    return [(e.kind, e.module, e.pass_) for e in rec.events() if e.kind in ("enter", "exit")]


def test_global_hooks_record_what_module_hooks_record_and_nothing_of_other_models():
    """global_hooks=True: the same enter/exit sequence, forward and backward, as one hook pair
    per module; a second model run meanwhile adds nothing; after close() nothing is recorded."""
    sequences = []
    for global_hooks in (False, True):
        torch.manual_seed(0)
        model, other = Tiny(), Tiny()
        meter, rec = _meter_recorder(model, global_hooks=global_hooks)
        x = torch.randn(2, 4, requires_grad=True)
        with rec, meter:
            model(x).sum().backward()
            other(x).sum().backward()
        n = len(rec)
        model(x).sum().backward()
        assert len(rec) == n
        sequences.append(_sequence(rec))
    assert sequences[0] == sequences[1]
    assert len(sequences[1]) == 2 * 4 + 2 * 4  # every module enters and exits in both passes


def test_recorder_layer_stats_from_the_buffer_equal_the_timelines():
    """layer_stats(last) read from the raw buffer equals timeline(last).layer_stats()."""
    model = Tiny()
    meter, rec = _meter_recorder(model)
    meter.add_listener(lambda _delta, _live: rec.record("alloc"))
    with rec, meter:
        for _ in range(2):
            model(torch.randn(2, 4)).sum().backward()
    assert rec.layer_stats() == rec.timeline().layer_stats()
    assert rec.layer_stats(last=9) == rec.timeline(last=9).layer_stats()
    fc1 = {(s.module, s.pass_): s for s in rec.layer_stats()}[("fc1", "forward")]
    assert (fc1.calls, fc1.net_allocated_bytes) == (2, 2 * 2 * 8 * 4)
