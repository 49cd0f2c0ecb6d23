"""memadvisor.profiler.record_timeline / write_memory_snapshot: exports of one recorded step."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import jsonschema
import pytest
import torch
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.profiler import record_timeline, write_memory_snapshot
from memadvisor.timeline import Timeline
from memadvisor.workload import Workload

SCHEMA = json.loads(
    (Path(__file__).parents[1] / "data" / "speedscope_schema.json").read_text(encoding="utf-8")
)
W = 32


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(W, W), nn.ReLU()) for _ in range(2)))
        self.head = nn.Linear(W, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x)).sum()


def _workload() -> Workload:
    torch.manual_seed(0)
    return Workload(Net(), torch.randn(4, W))


def test_timeline_has_every_phase_in_order_and_module_events_in_both_passes() -> None:
    """Phases forward..end in order; each Linear enters and exits in forward and backward;
    the timeline survives its own JSON round trip."""
    wl = _workload()
    before = {k: v.clone() for k, v in wl.model.state_dict().items()}
    timeline = record_timeline(wl, device="cpu")
    phases = [e.phase for e in timeline.events if e.kind == "phase"]
    assert phases == ["forward", "loss", "backward", "optimizer", "zero_grad", "end"]
    seen = {(e.kind, e.module, e.pass_) for e in timeline.events if e.module is not None}
    for name in ("blocks.0.0", "blocks.1.0", "head"):
        assert ("enter", name, "forward") in seen and ("exit", name, "forward") in seen
        assert ("enter", name, "backward") in seen
    assert Timeline.model_validate_json(timeline.model_dump_json()) == timeline
    # The caller's model is untouched.
    assert all(torch.equal(v, before[k]) for k, v in wl.model.state_dict().items())


def test_timeline_bytes_follow_the_meter_and_the_flame_graph_validates() -> None:
    """Allocated bytes never go below the weights + optimizer state the step starts with;
    the speedscope exports validate against speedscope's file-format schema, and the bytes
    flame graph charges the blocks' forward with at least their saved ReLU outputs."""
    wl = _workload()
    timeline = record_timeline(wl, device="cpu", batch_size=8)
    params = sum(p.numel() * 4 for p in wl.model.parameters())
    assert min(e.allocated_bytes for e in timeline.events) >= 3 * params  # weights + 2 moments
    for weight in ("bytes", "ms"):
        jsonschema.validate(timeline.to_speedscope(weight), SCHEMA)
    in_blocks = sum(
        rise
        for stack, rise in timeline.bytes_by_stack()
        if any(f[1].startswith("blocks.") and f[2] == "forward" for f in stack)
    )
    assert in_blocks >= 2 * 8 * W * 4


def test_bad_precision_and_batch_size_are_refused() -> None:
    """The error names the bad value."""
    with pytest.raises(BadInputError, match="fp8"):
        record_timeline(_workload(), device="cpu", precision="fp8")
    with pytest.raises(BadInputError, match="batch_size"):
        record_timeline(_workload(), device="cpu", batch_size=0)


def test_the_allocator_snapshot_needs_cuda() -> None:
    """Without CUDA the snapshot is refused with a message that says what to use instead."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(BadInputError, match="CUDA"):
        write_memory_snapshot(_workload(), "unused.pickle")


@pytest.mark.gpu
def test_cuda_snapshot_pickle_and_html_are_written(tmp_path: Path) -> None:
    """The snapshot unpickles to the allocator's segments and its trace; the HTML embeds it."""
    snap = tmp_path / "snap.pickle"
    html = tmp_path / "snap.html"
    write_memory_snapshot(_workload(), snap, html_path=html)
    with snap.open("rb") as f:
        data = pickle.load(f)
    assert data["segments"] and any(trace for trace in data["device_traces"])
    assert "snapshot.pickle" in html.read_text(encoding="utf-8")
