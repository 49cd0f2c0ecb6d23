"""One iteration measured per layer: weights, gradients, saved activations, time, peaks.

The monitor runs a probe only on the iterations it reports per layer (and when memory starts
to grow), so the other iterations pay nothing for it.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memadvisor.monitor._schema import LayerMemory, LeakSuspect
from memadvisor.timeline import ModuleEventRecorder, Timeline, iter_tensors

__all__ = ["LayerProbe", "ProbeResult"]


@dataclass
class ProbeResult:
    """What one probed iteration found; ``created`` follows its tensors for the leak check."""

    iteration: int
    layers: list[LayerMemory]
    timeline: Timeline
    # storage id -> (module that made or first saved it, weakref to the storage, bytes)
    created: dict[int, tuple[str, weakref.ref, int]] = field(default_factory=dict)

    def survivors(self) -> list[LeakSuspect]:
        """Modules whose storages from this iteration are still alive, largest first."""
        alive: dict[str, list[int]] = {}
        for module, ref, nbytes in self.created.values():
            if ref() is not None:
                entry = alive.setdefault(module, [0, 0])
                entry[0] += nbytes
                entry[1] += 1
        suspects = [
            LeakSuspect(module=m, surviving_bytes=b, tensors=n) for m, (b, n) in alive.items()
        ]
        return sorted(suspects, key=lambda s: -s.surviving_bytes)


class LayerProbe:
    """Measures per-layer memory over one iteration through a :class:`ModuleEventRecorder`.

    Saved activations are counted with ``saved_tensors_hooks`` pushed for the duration of the
    model's own forward and charged to the innermost module running (the recorder knows it);
    gradient bytes come from post-accumulate-grad hooks.

    Known limitations:
        * Tensors saved inside a checkpointed region are not seen (checkpoint's own hooks
          replace ours there), nor are the inputs the checkpoint keeps.
        * Saved tensors of the loss (computed outside the model) are not charged to a layer.
    """

    def __init__(self, model: nn.Module, recorder: ModuleEventRecorder) -> None:
        self.model = model
        self.recorder = recorder
        self.active = False
        self.iteration = 0
        self._types = {name: type(m).__name__ for name, m in model.named_modules()}
        self._own_params: list[tuple[str, nn.Parameter]] = []
        seen: set[int] = set()
        for name, module in model.named_modules():
            for p in module.parameters(recurse=False):
                if id(p) not in seen:  # a tied weight belongs to its first owner
                    seen.add(id(p))
                    self._own_params.append((name, p))
        self._local = threading.local()
        self._grad_handles: list[Any] = []
        recorder.add_listener(self._on_event)
        recorder.add_output_listener(self._on_output)
        self._reset()

    def _reset(self) -> None:
        self._saved: dict[str, list[int]] = {}  # module -> [tensors, bytes], per forward call
        self._saved_seen: set[int] = set()
        self._created: dict[int, tuple[str, weakref.ref, int]] = {}
        self._grad_bytes: dict[int, int] = {}  # id(param) -> bytes
        self._param_storages = {id(p.untyped_storage()) for _, p in self._own_params}

    # -- lifecycle --------------------------------------------------------------------------

    def start(self, iteration: int) -> None:
        """Hook the model for the coming iteration."""
        if self.active:
            return
        self._reset()
        self.iteration = iteration
        self._start_total = self.recorder.recorded_total
        for _, p in self._own_params:
            if p.requires_grad:
                self._grad_handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self.recorder.start()
        self.active = True

    def stop(self) -> ProbeResult:
        """Unhook the model and summarise the iteration."""
        self.recorder.close()
        for handle in self._grad_handles:
            handle.remove()
        self._grad_handles.clear()
        self.active = False
        timeline = self.recorder.timeline(last=self.recorder.recorded_total - self._start_total)
        return ProbeResult(self.iteration, self._layers(timeline), timeline, self._created)

    # -- hooks ------------------------------------------------------------------------------

    def _on_event(self, kind: str, name: str, pass_: str) -> None:
        if name != "" or pass_ != "forward":
            return
        stack = getattr(self._local, "hooks", None)
        if stack is None:
            stack = self._local.hooks = []
        if kind == "enter":
            self._saved = {}  # per forward call: with accumulation, the last micro-batch's
            self._saved_seen = set()
            ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            try:
                ctx.__enter__()
            except RuntimeError:  # saved-tensor hooks disabled here (e.g. under compile)
                ctx = None
            stack.append(ctx)
        elif stack:
            ctx = stack.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        module = self.recorder.current_module()
        if module is not None:
            st = t.untyped_storage()
            key = id(st)
            if key not in self._param_storages:
                entry = self._saved.setdefault(module, [0, 0])
                entry[0] += 1
                if key not in self._saved_seen:
                    self._saved_seen.add(key)
                    entry[1] += st.nbytes()
                self._track(module, st)
        return t  # no copy: the hook only looks

    def _on_output(self, name: str, output: Any) -> None:
        for t in iter_tensors(output):
            st = t.untyped_storage()
            if id(st) not in self._param_storages:
                self._track(name, st)

    def _track(self, module: str, st: torch.UntypedStorage) -> None:
        key = id(st)
        if key not in self._created and st.nbytes() > 0:
            self._created[key] = (module, weakref.ref(st), st.nbytes())

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._grad_bytes[id(p)] = p.grad.untyped_storage().nbytes()

    # -- summary ----------------------------------------------------------------------------

    def _layers(self, timeline: Timeline) -> list[LayerMemory]:
        weights: dict[str, int] = {}
        grads: dict[str, int] = {}
        for name, p in self._own_params:
            weights[name] = weights.get(name, 0) + p.untyped_storage().nbytes()
            g = self._grad_bytes.get(id(p))
            if g is None and p.grad is not None:
                g = p.grad.untyped_storage().nbytes()
            grads[name] = grads.get(name, 0) + (g or 0)
        stats = {(s.module, s.pass_): s for s in timeline.layer_stats()}
        layers = []
        for name, type_name in self._types.items():
            fwd = stats.get((name, "forward"))
            bwd = stats.get((name, "backward"))
            saved_tensors, saved_bytes = self._saved.get(name, (0, 0))
            intermediate = 0
            if fwd is not None and fwd.calls:
                left_behind = max(0, fwd.net_allocated_bytes // fwd.calls)
                intermediate = max(0, fwd.peak_rise_bytes - left_behind)
            layers.append(
                LayerMemory(
                    module=name,
                    type_name=type_name,
                    weight_bytes=weights.get(name, 0),
                    grad_bytes=grads.get(name, 0),
                    saved_tensors=saved_tensors,
                    saved_bytes=saved_bytes,
                    intermediate_bytes=intermediate,
                    forward_ms=fwd.total_ms if fwd and fwd.calls else None,
                    backward_ms=bwd.total_ms if bwd and bwd.calls else None,
                    forward_peak_bytes=fwd.peak_allocated_bytes if fwd and fwd.calls else None,
                    allocations=fwd.allocations if fwd else None,
                )
            )
        return layers


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
