"""One iteration measured per layer: weights, gradients, saved activations, time, peaks.

The monitor runs a probe only on the iterations it reports per layer (and when memory starts
to grow), so the other iterations pay nothing for it; a probe itself installs a handful of
process-wide hooks plus one gradient hook per parameter, and summarises from raw tuples.
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn

from memadvisor.monitor._schema import LayerMemory, LeakSuspect
from memadvisor.timeline import ModuleEventRecorder, iter_tensors

__all__ = ["LayerProbe", "LayerRow", "ProbeResult"]


class LayerRow(NamedTuple):
    """:class:`LayerMemory`'s fields as a tuple: made per module on every measured iteration,
    turned into the pydantic model only when someone reads ``Monitor.layers``."""

    module: str
    type_name: str
    weight_bytes: int
    grad_bytes: int
    saved_tensors: int
    saved_bytes: int
    intermediate_bytes: int
    forward_ms: float | None
    backward_ms: float | None
    forward_peak_bytes: int | None
    allocations: int | None

    def to_model(self) -> LayerMemory:
        return LayerMemory(**self._asdict())


@dataclass
class ProbeResult:
    """What one probed iteration found; ``created`` follows its tensors for the leak check."""

    iteration: int
    layers: list[LayerRow]
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
        self._handles: list[Any] = []
        # saved_tensors_hooks open in the root's forward, per thread (torch keeps them so).
        self._local = threading.local()
        self._start_total = 0
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
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._handles.append(self.model.register_forward_pre_hook(self._on_root_enter))
        self._handles.append(self.model.register_forward_hook(self._on_root_exit, always_call=True))
        self.recorder.start()
        self.active = True

    def stop(self) -> ProbeResult:
        """Unhook the model and summarise the iteration."""
        self.recorder.close()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        contexts = self._contexts()
        while contexts:  # a forward that never returned (an exception in a hook)
            ctx = contexts.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)
        self.active = False
        stats = self.recorder.layer_stats_dicts(self.recorder.recorded_total - self._start_total)
        return ProbeResult(self.iteration, self._layers(stats), self._created)

    # -- hooks ------------------------------------------------------------------------------

    def _contexts(self) -> list[Any]:
        contexts = getattr(self._local, "contexts", None)
        if contexts is None:
            contexts = self._local.contexts = []
        return contexts

    def _on_root_enter(self, module: nn.Module, args: Any) -> None:
        self._saved = {}  # per forward call: with accumulation, the last micro-batch's
        self._saved_seen = set()
        ctx: Any = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
        try:
            ctx.__enter__()
        except RuntimeError:  # saved-tensor hooks disabled here (e.g. under compile)
            ctx = None
        self._contexts().append(ctx)

    def _on_root_exit(self, module: nn.Module, args: Any, output: Any) -> None:
        contexts = self._contexts()
        if contexts:
            ctx = contexts.pop()
            if ctx is not None:
                ctx.__exit__(None, None, None)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        module = self.recorder.current_module()
        if module is not None:
            st = t.untyped_storage()
            key = id(st)
            if key not in self._param_storages:
                entry = self._saved.get(module)
                if entry is None:
                    entry = self._saved[module] = [0, 0]
                entry[0] += 1
                if key not in self._saved_seen:
                    self._saved_seen.add(key)
                    entry[1] += st.nbytes()
                if not self._tracks(st):
                    self._track(module, st)
        return t  # no copy: the hook only looks

    def _on_output(self, name: str, output: Any) -> None:
        if isinstance(output, torch.Tensor):
            st = output.untyped_storage()
            if id(st) not in self._param_storages and not self._tracks(st):
                self._track(name, st)
            return
        for t in iter_tensors(output):
            st = t.untyped_storage()
            if id(st) not in self._param_storages and not self._tracks(st):
                self._track(name, st)

    def _tracks(self, st: torch.UntypedStorage) -> bool:
        """Whether ``st`` itself is tracked. Keys are ids, and a storage freed earlier in the
        iteration (a temporary) can hand its id to a new one: an entry whose storage has died
        is not this storage, so the new one is tracked afresh under its own module."""
        entry = self._created.get(id(st))
        return entry is not None and entry[1]() is st

    def _track(self, module: str, st: torch.UntypedStorage) -> None:
        nbytes = st.nbytes()
        if nbytes > 0:
            self._created[id(st)] = (module, weakref.ref(st), nbytes)

    def _on_grad(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self._grad_bytes[id(p)] = p.grad.untyped_storage().nbytes()

    # -- summary ----------------------------------------------------------------------------

    def _layers(self, stats: dict[tuple[str, str], dict[str, Any]]) -> list[LayerRow]:
        weights: dict[str, int] = {}
        grads: dict[str, int] = {}
        for name, p in self._own_params:
            weights[name] = weights.get(name, 0) + p.untyped_storage().nbytes()
            g = self._grad_bytes.get(id(p))
            if g is None and p.grad is not None:
                g = p.grad.untyped_storage().nbytes()
            grads[name] = grads.get(name, 0) + (g or 0)
        layers = []
        for name, type_name in self._types.items():
            fwd = stats.get((name, "forward"))
            bwd = stats.get((name, "backward"))
            saved_tensors, saved_bytes = self._saved.get(name, (0, 0))
            intermediate = 0
            measured = fwd is not None and fwd["calls"] > 0
            if measured:
                left_behind = max(0, fwd["net_allocated_bytes"] // fwd["calls"])
                intermediate = max(0, fwd["peak_rise_bytes"] - left_behind)
            layers.append(
                LayerRow(
                    module=name,
                    type_name=type_name,
                    weight_bytes=weights.get(name, 0),
                    grad_bytes=grads.get(name, 0),
                    saved_tensors=saved_tensors,
                    saved_bytes=saved_bytes,
                    intermediate_bytes=intermediate,
                    forward_ms=fwd["total_ms"] if measured else None,
                    backward_ms=bwd["total_ms"] if bwd is not None and bwd["calls"] else None,
                    forward_peak_bytes=fwd["peak_allocated_bytes"] if measured else None,
                    allocations=fwd["allocations"] if fwd is not None else None,
                )
            )
        return layers


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t
