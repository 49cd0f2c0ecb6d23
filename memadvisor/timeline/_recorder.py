"""ModuleEventRecorder: a model's module enter/exit, phase marks and samples, as events.

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
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import (
    register_module_forward_hook,
    register_module_forward_pre_hook,
)

from memadvisor.timeline._events import EventKind, Pass, TimelineEvent
from memadvisor.timeline._format import LayerStats, Timeline, layer_stats_of_rows
from memadvisor.timeline._readers import MemoryReader
from memadvisor.workload import tensor_leaves as iter_tensors

__all__ = ["ModuleEventRecorder", "iter_tensors"]


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
        return layer_stats_of_rows(
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
