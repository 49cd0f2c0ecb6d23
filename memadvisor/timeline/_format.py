"""Timeline: a recording's events as one JSON format, summed per module, exported.

* saves and loads as JSON (a pydantic model),
* summarises each module as :class:`LayerStats` (calls, duration, peak, allocations),
* exports to speedscope (:mod:`memadvisor.timeline._speedscope`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from memadvisor.timeline._events import Frame, Pass, TimelineEvent
from memadvisor.timeline._speedscope import bytes_by_stack, export

__all__ = ["LayerStats", "Timeline", "layer_stats_of_rows"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LayerStats(_Model):
    """One module in one pass, summed over every call in a timeline."""

    module: str = Field(description="Qualified module name; '' is the model itself.")
    pass_: Pass
    calls: int = Field(ge=0, description="Completed enter/exit pairs.")
    total_ms: float = Field(ge=0, description="Wall time inside the module, children included.")
    peak_allocated_bytes: int = Field(ge=0, description="Highest reading while inside.")
    peak_reserved_bytes: int | None = None
    net_allocated_bytes: int = Field(
        description="Allocated at exit minus at enter, summed over calls: what the module left "
        "behind (its output and saved activations in forward; negative when it frees)."
    )
    allocations: int | None = Field(
        None, description="Allocations made while inside, where the reader counts them."
    )
    peak_rise_bytes: int = Field(
        0, ge=0, description="Highest rise above the bytes at enter, over calls."
    )


class Timeline(_Model):
    """Events of one recording, in the order they were recorded."""

    events: list[TimelineEvent] = Field(default_factory=list)
    device: str = Field(description="e.g. 'cuda:0' or 'cpu'.")
    model_name: str = Field(description="Shown for the model itself (module '').")
    dropped_events: int = Field(
        0, ge=0, description="Events the bounded buffer dropped (the oldest ones)."
    )

    # -- per-module statistics --------------------------------------------------------------

    def layer_stats(self) -> list[LayerStats]:
        """Per module and pass: calls, time, peak and net bytes, allocations (first-seen order)."""
        return _layer_stats(
            (e.t_ms, e.kind, e.module, e.pass_, e.allocated_bytes, e.reserved_bytes,
             e.allocations, e.peak_allocated_bytes)
            for e in self._sorted_events()
        )  # fmt: skip

    # -- speedscope -------------------------------------------------------------------------

    def to_speedscope(self, weight: Literal["bytes", "ms"] = "bytes") -> dict:
        """The timeline as a speedscope file (:func:`memadvisor.timeline._speedscope.export`).

        Args:
            weight: ``"bytes"``: module frames weighted by the bytes allocated while each
                stack was innermost; ``"ms"``: an evented profile in milliseconds.

        Raises:
            ValueError: ``weight`` is neither ``"bytes"`` nor ``"ms"``.
        """
        title = f"{self.model_name} on {self.device}"
        return export(self._sorted_events(), self.model_name, title, weight)

    def bytes_by_stack(self) -> Iterator[tuple[tuple[Frame, ...], int]]:
        """``(stack, bytes)`` for every rise in allocated bytes, charged to the open stack."""
        return bytes_by_stack(self._sorted_events())

    def _sorted_events(self) -> list[TimelineEvent]:
        # Events are appended under one lock with the time read inside it, so they are already
        # in time order; a stable sort keeps that order and repairs a hand-made timeline.
        return sorted(self.events, key=lambda e: e.t_ms)


def _layer_stats(rows: Iterable[tuple]) -> list[LayerStats]:
    return [LayerStats(module=m, pass_=p, **s) for (m, p), s in layer_stats_of_rows(rows).items()]


def layer_stats_of_rows(rows: Iterable[tuple]) -> dict[tuple[str, str], dict[str, Any]]:
    """:meth:`Timeline.layer_stats` over raw rows in time order, ``(t_ms, kind, module, pass_,
    allocated, reserved, allocations, peak)``: the recorder's buffer needs no events built."""
    spans_of: dict[tuple[str, str], list[list]] = {}
    open_spans: list[list] = []  # every span not closed yet: each reading raises their peaks
    stats: dict[tuple[str, str], dict[str, Any]] = {}
    for t_ms, kind, module, pass_, allocated, reserved, allocations, peak in rows:
        high = allocated if peak is None or peak < allocated else peak
        for span in open_spans:  # [t, allocated, allocations, peak_alloc, peak_reserved]
            if high > span[3]:
                span[3] = high
            if reserved is not None and reserved > (span[4] or 0):
                span[4] = reserved
        if (kind != "enter" and kind != "exit") or module is None or pass_ is None:
            continue
        key = (module, pass_)
        if kind == "enter":
            span = [t_ms, allocated, allocations, allocated, reserved]
            spans_of.setdefault(key, []).append(span)
            open_spans.append(span)
            if key not in stats:
                stats[key] = _empty_stats()
            continue
        spans = spans_of.get(key)
        if not spans:
            continue  # its enter was dropped from the buffer
        span = spans.pop()
        for i in range(len(open_spans) - 1, -1, -1):  # innermost spans close first
            if open_spans[i] is span:
                del open_spans[i]
                break
        t0, alloc0, count0, top, peak_reserved = span
        s = stats[key]
        s["calls"] += 1
        s["total_ms"] += max(0.0, t_ms - t0)
        s["peak_allocated_bytes"] = max(s["peak_allocated_bytes"], top)
        if peak_reserved is not None:
            s["peak_reserved_bytes"] = max(s["peak_reserved_bytes"] or 0, peak_reserved)
        s["net_allocated_bytes"] += allocated - alloc0
        s["peak_rise_bytes"] = max(s["peak_rise_bytes"], top - alloc0)
        if count0 is not None and allocations is not None:
            s["allocations"] = (s["allocations"] or 0) + allocations - count0
    return stats


def _empty_stats() -> dict[str, Any]:
    return {
        "calls": 0,
        "total_ms": 0.0,
        "peak_allocated_bytes": 0,
        "peak_reserved_bytes": None,
        "net_allocated_bytes": 0,
        "allocations": None,
        "peak_rise_bytes": 0,
    }
