"""The speedscope export (https://www.speedscope.app): a timeline's events as module frames.

Two views: ``"bytes"``, a sampled profile whose stacks are module frames (under the step
phase, when phases were marked) weighted by the bytes allocated while that stack was
innermost; ``"ms"``, an evented profile in milliseconds, a flame chart in time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Literal

from memadvisor.timeline._events import Frame, TimelineEvent, stack_changes, stacks_after

__all__ = ["SPEEDSCOPE_SCHEMA_URL", "bytes_by_stack", "export"]

SPEEDSCOPE_SCHEMA_URL = "https://www.speedscope.app/file-format-schema.json"
_NO_MODULE = "(outside modules)"


def export(
    events: Sequence[TimelineEvent],
    model_name: str,
    title: str,
    weight: Literal["bytes", "ms"] = "bytes",
) -> dict:
    """``events`` (in time order) as a speedscope file.

    Raises:
        ValueError: ``weight`` is neither ``"bytes"`` nor ``"ms"``.
    """
    if weight not in ("bytes", "ms"):
        raise ValueError(f"weight must be 'bytes' or 'ms', but got {weight=}.")
    frames: dict[str, int] = {}

    def frame(f: Frame | str) -> int:
        name = f if isinstance(f, str) else _frame_name(f, model_name)
        return frames.setdefault(name, len(frames))

    events = list(events)
    if weight == "ms":
        profile = _evented_ms(events, model_name, frame)
    else:
        profile = _sampled_bytes(events, model_name, frame)
    return {
        "$schema": SPEEDSCOPE_SCHEMA_URL,
        "shared": {"frames": [{"name": name} for name in frames]},
        "profiles": [profile],
        "name": title,
        "activeProfileIndex": 0,
        "exporter": "memadvisor",
    }


def _evented_ms(
    events: list[TimelineEvent], model_name: str, frame: Callable[[Frame | str], int]
) -> dict:
    out: list[dict] = []
    for t_ms, opened, closed in stack_changes(events):
        for f in closed:
            out.append({"type": "C", "frame": frame(f), "at": t_ms})
        for f in opened:
            out.append({"type": "O", "frame": frame(f), "at": t_ms})
    start = events[0].t_ms if events else 0.0
    end = events[-1].t_ms if events else 0.0
    return {
        "type": "evented",
        "name": f"{model_name}: time per module",
        "unit": "milliseconds",
        "startValue": start,
        "endValue": end,
        "events": out,
    }


def _sampled_bytes(
    events: list[TimelineEvent], model_name: str, frame: Callable[[Frame | str], int]
) -> dict:
    weights: dict[tuple[int, ...], int] = {}
    for stack, rise_bytes in bytes_by_stack(events):
        key = tuple(frame(f) for f in stack) or (frame(_NO_MODULE),)
        weights[key] = weights.get(key, 0) + rise_bytes
    total = sum(weights.values())
    return {
        "type": "sampled",
        "name": f"{model_name}: bytes allocated per module",
        "unit": "bytes",
        "startValue": 0,
        "endValue": total,
        "samples": [list(k) for k in weights],
        "weights": list(weights.values()),
    }


def bytes_by_stack(events: Sequence[TimelineEvent]) -> Iterator[tuple[tuple[Frame, ...], int]]:
    """``(stack, bytes)`` for every rise in allocated bytes, charged to the open stack."""
    events = list(events)
    stack: tuple[Frame, ...] = ()
    previous: int | None = None
    for ev, after in zip(events, stacks_after(events), strict=True):
        if previous is not None and ev.allocated_bytes > previous:
            yield stack, ev.allocated_bytes - previous
        previous = ev.allocated_bytes
        stack = after


def _frame_name(f: Frame, model_name: str) -> str:
    kind, name, pass_ = f
    if kind == "phase":
        return f"[{name}]"
    shown = name if name else model_name
    return f"{shown} (backward)" if pass_ == "backward" else shown
