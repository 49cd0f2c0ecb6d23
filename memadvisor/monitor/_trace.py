"""trace(): every module's enter and exit, forward and backward, with memory readings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

from torch import nn

from memadvisor.files import write_text_atomic
from memadvisor.monitor._source import MeterSource, source_for
from memadvisor.timeline import LayerStats, ModuleEventRecorder, Timeline

__all__ = ["Tracer", "trace"]


class Tracer:
    """Records a :class:`~memadvisor.timeline.Timeline` of a model while it runs.

    Every module's forward and backward enter/exit is recorded with a timestamp, allocated
    and reserved bytes (so the fragmentation ratio), the peak since the previous event and,
    where the device counts them, allocations. Events go to a bounded, thread-safe buffer.
    On CUDA the allocator's counters are read (allocation counts cost a ``memory_stats``
    call per event: pass ``count_allocations=False`` for a lighter trace); on the CPU a
    :class:`~memadvisor.memory.MemoryMeter` tracks the bytes for the duration of the block.

    The peak counters of the card are reset at each event while tracing; read
    ``tracer.source.reader.max_allocated_bytes`` for the block's peak.

    Args:
        model: the model to trace.
        max_events: buffer bound; the oldest events are dropped past it (and counted).
        backward: also record backward enter/exit.
        count_allocations: per-event allocation counts on CUDA (always on with the CPU meter).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        max_events: int = 100_000,
        backward: bool = True,
        count_allocations: bool = True,
    ) -> None:
        self.model = model
        self.source = source_for(model, count_allocations=count_allocations)
        self.recorder = ModuleEventRecorder(
            model,
            self.source.reader,
            max_events=max_events,
            backward=backward,
            device=self.source.device,
        )

    def __enter__(self) -> Tracer:
        if isinstance(self.source, MeterSource):
            meter = self.source.meter
            meter.adopt(self.model.parameters())
            meter.adopt(self.model.buffers())
            meter.adopt(p.grad for p in self.model.parameters())
            meter.__enter__()
        self.recorder.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.recorder.close()
        if isinstance(self.source, MeterSource):
            self.source.meter.__exit__(*exc)

    # -- marks ------------------------------------------------------------------------------

    def mark_phase(self, phase: str) -> None:
        """Mark a step phase (forward, loss, backward, optimizer, zero_grad, end)."""
        self.recorder.mark_phase(phase)

    def sample(self, label: str | None = None) -> None:
        """Record a plain memory reading (e.g. once per iteration)."""
        self.recorder.record("sample", phase=label)

    # -- results ----------------------------------------------------------------------------

    @property
    def dropped_events(self) -> int:
        return self.recorder.dropped_events

    def timeline(self) -> Timeline:
        return self.recorder.timeline()

    def layer_stats(self) -> list[LayerStats]:
        """Per module and pass: calls, duration, peak allocated, allocation count."""
        return self.timeline().layer_stats()

    def save(self, path: str | Path) -> Path:
        """Write the timeline as JSON (``Timeline.model_validate_json`` reads it back)."""
        path = Path(path)
        write_text_atomic(path, self.timeline().model_dump_json(), "the timeline")
        return path

    def save_speedscope(self, path: str | Path, weight: Literal["bytes", "ms"] = "bytes") -> Path:
        """Write a speedscope file (open it at https://www.speedscope.app)."""
        path = Path(path)
        write_text_atomic(path, json.dumps(self.timeline().to_speedscope(weight)), "the profile")
        return path


def trace(
    model: nn.Module,
    *,
    max_events: int = 100_000,
    backward: bool = True,
    count_allocations: bool = True,
) -> Tracer:
    """Trace ``model`` inside a ``with`` block; see :class:`Tracer`.

    Example::

        with memadvisor.trace(model) as tr:
            loss = model(x).sum(); loss.backward()
        tr.save_speedscope("step.speedscope.json")
        for s in tr.layer_stats(): print(s.module, s.pass_, s.total_ms, s.peak_allocated_bytes)
    """
    return Tracer(
        model, max_events=max_events, backward=backward, count_allocations=count_allocations
    )
