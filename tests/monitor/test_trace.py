"""trace(): module events with memory, bounded and thread-safe, exported like the profiler's."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn

import memadvisor
from memadvisor.timeline import Timeline

SCHEMA = json.loads((Path(__file__).parents[1] / "data" / "speedscope_schema.json").read_text())


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))


def test_trace_records_forward_and_backward_with_per_layer_stats():
    """Every module enters and exits in forward; layers with grad inputs also in backward;
    stats give calls, allocations (Linear(4,8) forward: one) and the (2, 8) output's bytes."""
    model = _mlp()
    with memadvisor.trace(model) as tr:
        for _ in range(3):
            model(torch.randn(2, 4)).sum().backward()
    stats = {(s.module, s.pass_): s for s in tr.layer_stats()}
    for name in ("", "0", "1", "2"):
        assert stats[(name, "forward")].calls == 3
    assert stats[("2", "backward")].calls == 3 and stats[("1", "backward")].calls == 3
    first = stats[("0", "forward")]
    assert first.allocations == 3  # one addmm output per call
    assert first.net_allocated_bytes == 3 * 2 * 8 * 4
    assert first.peak_allocated_bytes >= first.net_allocated_bytes // 3
    assert tr.dropped_events == 0


def test_trace_exports_validate_and_round_trip(tmp_path):
    """save() writes a Timeline that loads back equal; both speedscope files match the schema."""
    model = _mlp()
    with memadvisor.trace(model) as tr:
        tr.mark_phase("forward")
        loss = model(torch.randn(2, 4)).sum()
        tr.mark_phase("backward")
        loss.backward()
        tr.sample("end of step")
    path = tr.save(tmp_path / "t.json")
    assert Timeline.model_validate_json(path.read_text()) == tr.timeline()
    for weight in ("bytes", "ms"):
        doc = json.loads(tr.save_speedscope(tmp_path / f"{weight}.json", weight).read_text())
        jsonschema.validate(doc, SCHEMA)


def test_trace_buffer_is_bounded():
    """max_events=10 over a longer run: 10 events kept, the rest counted; export still valid."""
    model = _mlp()
    with memadvisor.trace(model, max_events=10) as tr:
        for _ in range(5):
            model(torch.randn(2, 4)).sum().backward()
    tl = tr.timeline()
    assert len(tl.events) == 10 and tl.dropped_events > 0
    jsonschema.validate(tl.to_speedscope("ms"), SCHEMA)


def test_trace_from_two_threads_loses_no_event_below_the_bound():
    """Two threads running forward at once: every enter and exit of both is kept."""
    model = _mlp()
    steps = 200
    start = threading.Barrier(2)

    def work() -> None:
        start.wait()
        with torch.no_grad():
            for _ in range(steps):
                model(torch.randn(2, 4))

    with memadvisor.trace(model, max_events=100_000) as tr:
        threads = [threading.Thread(target=work) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    events = tr.timeline().events
    modules = len(list(model.modules()))
    assert sum(e.kind == "enter" for e in events) == 2 * steps * modules
    assert sum(e.kind == "exit" for e in events) == 2 * steps * modules
    assert tr.dropped_events == 0


def test_trace_removes_its_hooks_and_leaves_the_meter():
    """After the block: no hooks on the model, and the CPU meter no longer counts."""
    model = _mlp()
    with memadvisor.trace(model) as tr:
        model(torch.randn(2, 4))
    n = len(tr.timeline().events)
    live = tr.source.meter.live_bytes
    out = model(torch.randn(2, 4))
    out.sum().backward()
    assert len(tr.timeline().events) == n
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in model.modules())
    assert tr.source.meter.live_bytes == live


@pytest.mark.gpu
def test_cuda_trace_reads_reserved_fragmentation_and_allocations():
    """On a card: every event has reserved bytes, a fragmentation in [0, 1] and a count."""
    model = _mlp().cuda()
    model(torch.randn(64, 4, device="cuda")).sum().backward()  # cuBLAS workspace made outside
    with memadvisor.trace(model) as tr:
        model(torch.randn(64, 4, device="cuda")).sum().backward()
    events = tr.timeline().events
    assert events and all(e.reserved_bytes is not None for e in events)
    assert all(0.0 <= e.fragmentation <= 1.0 for e in events if e.reserved_bytes)
    stats = {(s.module, s.pass_): s for s in tr.layer_stats()}
    assert stats[("0", "forward")].allocations >= 1
    assert stats[("0", "forward")].net_allocated_bytes == 64 * 8 * 4


def test_trace_files_go_through_the_one_safe_writer(tmp_path):
    """save() and save_speedscope() write as the plan does (memadvisor/files.py): a folder is
    refused with what to pass instead, and a failed write leaves no half file."""
    from memadvisor.errors import BadInputError

    model = _mlp()
    with memadvisor.trace(model) as tr:
        model(torch.randn(2, 4)).sum().backward()
    with pytest.raises(BadInputError, match="a folder"):
        tr.save(tmp_path)
    with pytest.raises(BadInputError, match="a folder"):
        tr.save_speedscope(tmp_path)
    assert tr.save(tmp_path / "t.json").read_text().startswith("{")
