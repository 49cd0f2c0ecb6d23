"""A step's memory over time, per module: one format and one set of exports for every recorder.

The profiler and the training-loop monitor both record :class:`TimelineEvent` s through
:class:`ModuleEventRecorder` (module enter/exit in forward and backward, phase marks, memory
samples) and hand back a :class:`Timeline`, which

* saves and loads as JSON (a pydantic model),
* exports to speedscope (https://www.speedscope.app): module frames weighted by the bytes
  allocated inside them, or laid out in time,
* summarises each module as :class:`LayerStats` (calls, duration, peak, allocations).

Known limitations:
    * Backward enter/exit come from gradient hooks on a module's outputs and inputs (the way
      ``torch.distributed._tools.mod_tracker`` finds them), so a module whose inputs need no
      gradient (an embedding fed token ids, the root model) has no backward *exit*: its frame
      closes when the next module outside it starts, or at the end of the recording.
    * Memory is read at events only; bytes allocated and freed between two events are not
      seen (a CPU :class:`~memadvisor.memory.MemoryMeter` listener adds an ``alloc`` event per
      allocation where that matters).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Literal, NamedTuple

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from memadvisor._torch_private import cuda_counter_reader
from memadvisor.workload import tensor_leaves as iter_tensors

__all__ = [
    "SPEEDSCOPE_SCHEMA_URL",
    "CudaMemoryReader",
    "EventKind",
    "LayerStats",
    "MemoryReader",
    "MemoryReading",
    "MeterMemoryReader",
    "ModuleEventRecorder",
    "Pass",
    "Timeline",
    "TimelineEvent",
    "cuda_memory_reader",
    "iter_tensors",
    "meter_memory_reader",
]

SPEEDSCOPE_SCHEMA_URL = "https://www.speedscope.app/file-format-schema.json"

EventKind = Literal["enter", "exit", "phase", "alloc", "sample"]
Pass = Literal["forward", "backward"]

# () -> (allocated_bytes, reserved_bytes | None[, allocations | None[, peak since last | None]])
MemoryReader = Callable[[], tuple]

_NO_MODULE = "(outside modules)"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TimelineEvent(_Model):
    """One moment of a recording: a module entered or left, a phase began, memory sampled."""

    t_ms: float = Field(description="Milliseconds since the recording started.")
    kind: EventKind = Field(
        description="enter/exit: a module's forward or backward; phase: a training-step phase "
        "began; alloc: an allocation (CPU meter); sample: a plain memory reading."
    )
    phase: str | None = Field(
        None,
        description="For kind='phase': forward, loss, backward, optimizer, zero_grad, end; "
        "for kind='sample': an optional label (the monitor writes 'iteration N').",
    )
    module: str | None = Field(
        None, description="Qualified module name for enter/exit; '' is the model itself."
    )
    pass_: Pass | None = Field(None, description="For enter/exit: forward or backward.")
    allocated_bytes: int = Field(ge=0, description="Bytes held by tensors at this moment.")
    reserved_bytes: int | None = Field(
        None, description="CUDA caching allocator's reserved bytes; None on the CPU."
    )
    allocations: int | None = Field(
        None,
        description="Cumulative number of allocations so far, where the reader counts them "
        "(the CPU meter and the CUDA reader, when asked).",
    )
    peak_allocated_bytes: int | None = Field(
        None,
        ge=0,
        description="Highest allocated bytes since the previous event, where the reader "
        "tracks it: a peak between two events (inside a leaf module) is then not missed.",
    )

    @property
    def fragmentation(self) -> float | None:
        """Share of reserved bytes not held by tensors: ``1 - allocated / reserved``."""
        if not self.reserved_bytes:
            return None
        return max(0.0, 1.0 - self.allocated_bytes / self.reserved_bytes)


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
        """The timeline as a speedscope file (https://www.speedscope.app/file-format-schema.json).

        Args:
            weight: ``"bytes"``: a sampled profile whose stacks are module frames (under the
                step phase, when phases were marked) weighted by the bytes allocated while that
                stack was innermost, i.e. the sum of rises in allocated bytes between readings.
                ``"ms"``: an evented profile in milliseconds, a flame chart in time.

        Raises:
            ValueError: ``weight`` is neither ``"bytes"`` nor ``"ms"``.
        """
        if weight not in ("bytes", "ms"):
            raise ValueError(f"weight must be 'bytes' or 'ms', but got {weight=}.")
        frames: dict[str, int] = {}

        def frame(name: str) -> int:
            return frames.setdefault(name, len(frames))

        profile = self._evented_ms(frame) if weight == "ms" else self._sampled_bytes(frame)
        return {
            "$schema": SPEEDSCOPE_SCHEMA_URL,
            "shared": {"frames": [{"name": name} for name in frames]},
            "profiles": [profile],
            "name": f"{self.model_name} on {self.device}",
            "activeProfileIndex": 0,
            "exporter": "memadvisor",
        }

    def _evented_ms(self, frame: Callable[[str], int]) -> dict:
        out: list[dict] = []
        events = self._sorted_events()
        for t_ms, opened, closed in _stack_changes(events):
            for name in closed:
                out.append({"type": "C", "frame": frame(self._frame_name(name)), "at": t_ms})
            for name in opened:
                out.append({"type": "O", "frame": frame(self._frame_name(name)), "at": t_ms})
        start = events[0].t_ms if events else 0.0
        end = events[-1].t_ms if events else 0.0
        return {
            "type": "evented",
            "name": f"{self.model_name}: time per module",
            "unit": "milliseconds",
            "startValue": start,
            "endValue": end,
            "events": out,
        }

    def _sampled_bytes(self, frame: Callable[[str], int]) -> dict:
        weights: dict[tuple[int, ...], int] = {}
        for stack, rise_bytes in self.bytes_by_stack():
            key = tuple(frame(self._frame_name(f)) for f in stack) or (frame(_NO_MODULE),)
            weights[key] = weights.get(key, 0) + rise_bytes
        total = sum(weights.values())
        return {
            "type": "sampled",
            "name": f"{self.model_name}: bytes allocated per module",
            "unit": "bytes",
            "startValue": 0,
            "endValue": total,
            "samples": [list(k) for k in weights],
            "weights": list(weights.values()),
        }

    def bytes_by_stack(self) -> Iterator[tuple[tuple[_Frame, ...], int]]:
        """``(stack, bytes)`` for every rise in allocated bytes, charged to the open stack."""
        events = self._sorted_events()
        stack: tuple[_Frame, ...] = ()
        previous: int | None = None
        for ev, after in zip(events, _stacks_after(events), strict=True):
            if previous is not None and ev.allocated_bytes > previous:
                yield stack, ev.allocated_bytes - previous
            previous = ev.allocated_bytes
            stack = after

    def _frame_name(self, f: _Frame) -> str:
        kind, name, pass_ = f
        if kind == "phase":
            return f"[{name}]"
        shown = name if name else self.model_name
        return f"{shown} (backward)" if pass_ == "backward" else shown

    def _sorted_events(self) -> list[TimelineEvent]:
        # Events are appended under one lock with the time read inside it, so they are already
        # in time order; a stable sort keeps that order and repairs a hand-made timeline.
        return sorted(self.events, key=lambda e: e.t_ms)


# A speedscope frame: ("phase", phase_name, None) or ("module", qualified_name, pass).
_Frame = tuple[str, str, str | None]


def _layer_stats(rows: Iterable[tuple]) -> list[LayerStats]:
    return [LayerStats(module=m, pass_=p, **s) for (m, p), s in _layer_stats_dicts(rows).items()]


def _layer_stats_dicts(rows: Iterable[tuple]) -> dict[tuple[str, str], dict[str, Any]]:
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


def _is_ancestor_or_self(ancestor: str, name: str) -> bool:
    return ancestor == "" or name == ancestor or name.startswith(ancestor + ".")


def _apply(stack: list[_Frame], ev: TimelineEvent) -> None:
    """Move ``stack`` past ``ev``, repairing the nesting that backward hooks cannot promise."""
    if ev.kind == "phase":
        stack.clear()  # a new phase closes everything the last one left open
        if ev.phase and ev.phase != "end":
            stack.append(("phase", ev.phase, None))
        return
    if ev.kind not in ("enter", "exit") or ev.module is None:
        return
    me: _Frame = ("module", ev.module, ev.pass_)
    if ev.kind == "enter":
        lifted: list[_Frame] = []
        if ev.pass_ == "backward":
            while stack and stack[-1][0] == "module" and stack[-1][2] == "backward":
                top = stack[-1][1]
                if _is_ancestor_or_self(top, ev.module):
                    break
                if _is_ancestor_or_self(ev.module, top):
                    # A parent and its last child share an output tensor, and the child's hook
                    # on it was registered (so fires) first: the parent goes beneath it.
                    lifted.append(stack.pop())
                else:
                    # A module with no backward exit (its inputs need no grad) ends where a
                    # module outside its subtree begins.
                    stack.pop()
        stack.append(me)
        stack.extend(reversed(lifted))
        return
    if me in stack:  # an exit whose enter was dropped from the buffer is ignored
        del stack[len(stack) - 1 - stack[::-1].index(me) :]


def _stacks_after(events: list[TimelineEvent]) -> Iterator[tuple[_Frame, ...]]:
    stack: list[_Frame] = []
    for ev in events:
        _apply(stack, ev)
        yield tuple(stack)


def _stack_changes(
    events: list[TimelineEvent],
) -> Iterator[tuple[float, list[_Frame], list[_Frame]]]:
    """``(t_ms, opened, closed)`` per event (closed innermost first); all closed at the end."""
    before: tuple[_Frame, ...] = ()
    for ev, after in zip(events, _stacks_after(events), strict=True):
        common = 0
        while common < min(len(before), len(after)) and before[common] == after[common]:
            common += 1
        closed = list(reversed(before[common:]))
        opened = list(after[common:])
        if closed or opened:
            yield ev.t_ms, opened, closed
        before = after
    if before:
        yield events[-1].t_ms, [], list(reversed(before))


# -- memory readers ------------------------------------------------------------------------------


class MemoryReading(NamedTuple):
    """What a :data:`MemoryReader` returns; a plain ``(allocated, reserved)`` tuple also works."""

    allocated_bytes: int
    reserved_bytes: int | None = None
    allocations: int | None = None
    peak_allocated_bytes: int | None = None  # highest since the previous reading


def _cuda_index(device: torch.device | str | int | None) -> int:
    if isinstance(device, int):
        return device
    if device is not None and torch.device(device).index is not None:
        return torch.device(device).index
    return torch.cuda.current_device()


class CudaMemoryReader:
    """Reads the CUDA caching allocator's counters in one stats call (no synchronisation).

    Args:
        device: the card; the current one (at the first reading) if None.
        count_allocations: also report the cumulative allocation count (free: every number
            comes from one stats call).
        interval_peaks: also read the peak since the previous reading, by resetting the
            allocator's peak counters at every reading. Code that reads
            ``torch.cuda.max_memory_allocated`` meanwhile should read :attr:`max_allocated_bytes`
            instead, the running maximum of what this reader saw.
    """

    def __init__(
        self,
        device: torch.device | str | int | None = None,
        *,
        count_allocations: bool = False,
        interval_peaks: bool = False,
    ) -> None:
        self.device = device
        self.count_allocations = count_allocations
        self.interval_peaks = interval_peaks
        self.max_allocated_bytes = 0
        self.max_reserved_bytes = 0
        self._read: Callable[[], tuple] | None = None

    def __call__(self) -> MemoryReading:
        read = self._read
        if read is None:  # bound at the first reading: CUDA need not be up at construction
            read = self._read = cuda_counter_reader(
                _cuda_index(self.device), reset_peaks=self.interval_peaks
            )
        allocated, reserved, peak, reserved_peak, count = read()  # one stats call for all
        if not self.interval_peaks:
            peak = None
        else:
            if peak > self.max_allocated_bytes:
                self.max_allocated_bytes = peak
            if reserved_peak > self.max_reserved_bytes:
                self.max_reserved_bytes = reserved_peak
        return MemoryReading(allocated, reserved, count if self.count_allocations else None, peak)

    def reset_max(self) -> None:
        """Start the running maxima again (e.g. at each training iteration)."""
        self.max_allocated_bytes = 0
        self.max_reserved_bytes = 0


class MeterMemoryReader:
    """Reads a :class:`~memadvisor.memory.MemoryMeter`: live bytes and allocation count.

    Args:
        meter: the meter.
        interval_peaks: also read the peak since the previous reading (resets the meter's
            peak at each reading; :attr:`max_allocated_bytes` keeps the running maximum).
    """

    def __init__(self, meter: Any, *, interval_peaks: bool = False) -> None:
        self.meter = meter
        self.interval_peaks = interval_peaks
        self.max_allocated_bytes = 0
        self.max_reserved_bytes = 0

    def __call__(self) -> MemoryReading:
        meter = self.meter
        peak = None
        if self.interval_peaks:
            peak = meter.peak_bytes
            meter.reset_peak()
            self.max_allocated_bytes = max(self.max_allocated_bytes, peak)
        return MemoryReading(meter.live_bytes, None, meter.allocations, peak)

    def reset_max(self) -> None:
        self.max_allocated_bytes = 0


def cuda_memory_reader(
    device: torch.device | str | int | None = None, *, count_allocations: bool = False
) -> CudaMemoryReader:
    """A :class:`CudaMemoryReader` of allocated and reserved bytes."""
    return CudaMemoryReader(device, count_allocations=count_allocations)


def meter_memory_reader(meter: Any) -> MeterMemoryReader:
    """A :class:`MeterMemoryReader` of a meter's live bytes and allocation count."""
    return MeterMemoryReader(meter)


# -- the recorder ------------------------------------------------------------------------------


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    if type(obj) is tuple and len(obj) == 1:  # the usual module input: one tensor
        obj = obj[0]
    if isinstance(obj, torch.Tensor):
        return [obj] if obj.requires_grad else []
    return [t for t in iter_tensors(obj) if t.requires_grad]


class ModuleEventRecorder:
    """Hooks every module of a model and records enter/exit events with memory readings.

    Forward enter/exit come from forward pre/post hooks. Backward enter is a gradient hook on
    the module's outputs (fires when the first output gradient is ready); backward exit is a
    hook on its inputs that need grad (fires when all their gradients are computed). Tensor
    hooks, unlike ``register_full_backward_hook``, wrap nothing, so in-place ops on a module's
    output (``ReLU(inplace=True)``) and checkpointed blocks keep working: a reentrant
    checkpoint's recomputation runs the hooks again and its inner backward fires them.

    Events go to a bounded buffer (the newest ``max_events`` are kept, the rest counted in
    :attr:`dropped_events`); :meth:`record` is safe to call from any thread.

    Args:
        model: the model; every named module is hooked.
        memory_reader: ``() -> (allocated_bytes, reserved_bytes | None[, allocations])``,
            e.g. :func:`cuda_memory_reader` or :func:`meter_memory_reader`.
        max_events: buffer bound.
        backward: also record backward enter/exit (registers gradient hooks each forward).
        device: shown in the timeline; the model's parameter device if None.
        model_name: shown for the model itself; its class name if None.
        global_hooks: hook every module through two process-wide forward hooks
            (``torch.nn.modules.module.register_module_forward_pre_hook`` and
            ``register_module_forward_hook``) that look the module's name up, instead of two
            hooks per module: :meth:`start` and :meth:`close` then cost the same for any model
            (for recorders started often, like the monitor's). They also see the model's
            modules called by other code, and run before a module's own hooks.

    Raises:
        ValueError: ``max_events`` is not positive.

    Example::

        with ModuleEventRecorder(model, cuda_memory_reader()) as rec:
            train_step(workload, model, opt, batch, on_phase=rec.mark_phase)
        rec.timeline().to_speedscope()
    """

    def __init__(
        self,
        model: nn.Module,
        memory_reader: MemoryReader,
        *,
        max_events: int = 100_000,
        backward: bool = True,
        device: str | None = None,
        model_name: str | None = None,
        global_hooks: bool = False,
    ) -> None:
        if max_events <= 0:
            raise ValueError(f"max_events must be positive, but got {max_events=}.")
        self.model = model
        self.memory_reader = memory_reader
        self.max_events = max_events
        self.backward = backward
        self.global_hooks = global_hooks
        if device is None:
            p = next(iter(model.parameters()), None)
            device = str(p.device) if p is not None else "cpu"
        self.device = device
        self.model_name = model_name or type(model).__name__
        self.dropped_events = 0
        self._buffer: deque[tuple] = deque(maxlen=max_events)
        self._lock = threading.Lock()
        self._local = threading.local()
        self._handles: list[Any] = []
        self._leaf_handles: list[Any] = []
        self._listeners: list[Callable[[str, str, str], None]] = []
        self._output_listeners: list[Callable[[str, Any], None]] = []
        self._names: dict[int, str] = {}  # id(module) -> name, for the global hooks
        self._t0_ns = time.perf_counter_ns()
        self._active = False

    # -- lifecycle --------------------------------------------------------------------------

    def start(self) -> ModuleEventRecorder:
        """Install the hooks (again, after :meth:`close`); the clock keeps running."""
        if self._active:
            return self
        if self.global_hooks:
            # Named now, not at construction: the model may have been rewrapped since.
            self._names = {id(m): name for name, m in self.model.named_modules()}
            self._handles.append(register_module_forward_pre_hook(self._global_pre_hook))
            self._handles.append(
                register_module_forward_hook(self._global_post_hook, always_call=True)
            )
        else:
            for name, module in self.model.named_modules():
                self._handles.append(module.register_forward_pre_hook(self._pre_hook(name)))
                self._handles.append(
                    module.register_forward_hook(self._post_hook(name), always_call=True)
                )
        self._active = True
        return self

    def close(self) -> None:
        """Remove every hook this recorder installed. Recorded events are kept."""
        for handle in self._handles + self._leaf_handles:
            handle.remove()
        self._handles.clear()
        self._leaf_handles.clear()
        self._active = False

    def __enter__(self) -> ModuleEventRecorder:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def active(self) -> bool:
        return self._active

    @property
    def start_ns(self) -> int:
        """``time.perf_counter_ns()`` at the recording's time zero (events' ``t_ms`` count
        from it)."""
        return self._t0_ns

    # -- recording --------------------------------------------------------------------------

    def record(
        self,
        kind: EventKind,
        *,
        module: str | None = None,
        pass_: Pass | None = None,
        phase: str | None = None,
        reading: tuple | None = None,
    ) -> None:
        """Append one event with the current time and memory reading (thread-safe).

        Args:
            reading: a reading already taken (saves a second one); the reader's if None.
        """
        self._append(kind, module, pass_, phase, reading)

    def _append(
        self,
        kind: str,
        module: str | None,
        pass_: str | None,
        phase: str | None = None,
        reading: tuple | None = None,
    ) -> None:
        if reading is None:
            reading = self.memory_reader()
        n = len(reading)
        allocations = reading[2] if n > 2 else None
        peak = reading[3] if n > 3 else None
        with self._lock:
            # The clock is read under the lock so the buffer is in time order.
            t_ns = time.perf_counter_ns() - self._t0_ns
            if len(self._buffer) == self.max_events:
                self.dropped_events += 1
            self._buffer.append(
                (t_ns, kind, phase, module, pass_, reading[0], reading[1], allocations, peak)
            )

    def mark_phase(self, phase: str) -> None:
        """Record the start of a training-step phase; fits ``train_step(on_phase=...)``."""
        self._append("phase", None, None, phase)

    def add_listener(self, listener: Callable[[str, str, str], None]) -> None:
        """Call ``listener(kind, module, pass_)`` on every module enter/exit, after recording."""
        self._listeners.append(listener)

    def add_output_listener(self, listener: Callable[[str, Any], None]) -> None:
        """Call ``listener(module_name, output)`` after each module's forward returns."""
        self._output_listeners.append(listener)

    def current_module(self) -> str | None:
        """The innermost module whose forward is running in the calling thread."""
        stack = getattr(self._local, "stack", None)
        return stack[-1] if stack else None

    def clear(self) -> None:
        """Drop the recorded events and the dropped count."""
        with self._lock:
            self._buffer.clear()
            self.dropped_events = 0

    def __len__(self) -> int:
        return len(self._buffer)

    @property
    def recorded_total(self) -> int:
        """Events recorded since the last :meth:`clear`, kept or dropped."""
        return len(self._buffer) + self.dropped_events

    def _rows(self, last: int | None) -> list[tuple]:
        with self._lock:
            rows = list(self._buffer)
        if last is not None:
            rows = rows[len(rows) - min(last, len(rows)) :]
        return rows

    def events(self, last: int | None = None) -> list[TimelineEvent]:
        """A copy of the buffer (its ``last`` events, if given) as :class:`TimelineEvent` s."""
        return [
            TimelineEvent(
                t_ms=t_ns / 1e6,
                kind=kind,
                phase=phase,
                module=module,
                pass_=pass_,
                allocated_bytes=allocated,
                reserved_bytes=reserved,
                allocations=allocations,
                peak_allocated_bytes=peak,
            )
            for t_ns, kind, phase, module, pass_, allocated, reserved, allocations, peak in (
                self._rows(last)
            )
        ]

    def timeline(self, last: int | None = None) -> Timeline:
        """Everything recorded so far (or the ``last`` events) as a :class:`Timeline`."""
        return Timeline(
            events=self.events(last),
            device=self.device,
            model_name=self.model_name,
            dropped_events=self.dropped_events,
        )

    def layer_stats(self, last: int | None = None) -> list[LayerStats]:
        """``self.timeline(last).layer_stats()``, read straight from the buffer (cheaper)."""
        return [
            LayerStats(module=m, pass_=p, **s) for (m, p), s in self.layer_stats_dicts(last).items()
        ]

    def layer_stats_dicts(self, last: int | None = None) -> dict[tuple[str, str], dict[str, Any]]:
        """:meth:`layer_stats` as plain dicts of :class:`LayerStats`' fields, keyed by
        ``(module, pass_)``: for callers that summarise many recordings (the monitor)."""
        return _layer_stats_dicts(
            (t_ns / 1e6, kind, module, pass_, allocated, reserved, allocations, peak)
            for t_ns, kind, _, module, pass_, allocated, reserved, allocations, peak in (
                self._rows(last)
            )
        )

    # -- hooks ------------------------------------------------------------------------------

    def _pre_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any) -> None:
            self._enter(name, args)

        return hook

    def _post_hook(self, name: str) -> Callable:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._exit(name, output)

        return hook

    def _global_pre_hook(self, module: nn.Module, args: Any) -> None:
        name = self._names.get(id(module))
        if name is not None:  # a module of another model
            self._enter(name, args)

    def _global_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._exit(name, output)

    def _enter(self, name: str, args: Any) -> None:
        stack = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        stack.append(name)
        self._append("enter", name, "forward")
        for listener in self._listeners:
            listener("enter", name, "forward")
        if self.backward and torch.is_grad_enabled():
            self._hook_backward_exit(name, args)

    def _exit(self, name: str, output: Any) -> None:
        stack = getattr(self._local, "stack", None)
        if stack:  # always_call: also runs after an exception, so pop to this module
            if stack[-1] == name:
                stack.pop()
            elif name in stack:
                del stack[len(stack) - 1 - stack[::-1].index(name) :]
        self._append("exit", name, "forward")
        for listener in self._listeners:
            listener("exit", name, "forward")
        for listener in self._output_listeners:
            listener(name, output)
        if self.backward and torch.is_grad_enabled():
            self._hook_backward_enter(name, output)

    def _emit_backward(self, kind: str, name: str) -> None:
        self._append(kind, name, "backward")
        for listener in self._listeners:
            listener(kind, name, "backward")

    def _hook_backward_exit(self, name: str, args: Any) -> None:
        inputs = _grad_tensors(args)
        if not inputs:
            return
        fired = [False]

        def exit_(_grads: Any) -> None:
            if not fired[0]:  # once per forward call
                fired[0] = True
                self._emit_backward("exit", name)

        if len(inputs) == 1:
            # One input: its own gradient hook is what the multi-grad hook would register,
            # at a third of the cost.
            handle = inputs[0].register_hook(exit_)
        else:
            handle = torch.autograd.graph.register_multi_grad_hook(inputs, exit_, mode="all")
        if any(t.grad_fn is None for t in inputs):
            # A hook on a leaf (an input made with requires_grad=True) outlives the graph: it
            # would fire again in every later backward. Removed at close().
            self._leaf_handles.append(handle)

    def _hook_backward_enter(self, name: str, output: Any) -> None:
        # A pre-hook on the node that made the output, not a tensor hook: the engine runs a
        # node's tensor hooks before its node hooks, so the next module's backward *exit*
        # (a tensor hook on that same tensor, its input) is recorded before this enter.
        if isinstance(output, torch.Tensor):
            fn = output.grad_fn if output.requires_grad else None
            nodes = [fn] if fn is not None else []
        else:
            found = {id(t.grad_fn): t.grad_fn for t in _grad_tensors(output)}
            nodes = [fn for fn in found.values() if fn is not None]
        if not nodes:
            return
        fired = [False]

        def enter(_grad_outputs: Any) -> None:
            if not fired[0]:  # once per forward call, at the first output gradient
                fired[0] = True
                self._emit_backward("enter", name)

        for node in nodes:
            node.register_prehook(enter)
