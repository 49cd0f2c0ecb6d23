"""Tensor bytes tracked at allocation: the simulated device's truth and the CPU profiler's counter.

:class:`MemoryMeter` is a ``TorchDispatchMode`` that follows *storages*, not tensors: a view
or an in-place result shares its base's storage and is counted once; a storage is counted
from the op that made it until Python frees it (a weakref callback), exactly as
``torch.distributed._tools.mem_tracker.MemTracker`` counts. On an H200 this matched the
CUDA allocator's allocated bytes to within 0.01 MiB (``../shared/DESIGN.md``).

It works on real CPU tensors and under ``FakeTensorMode`` (fake storages report their size
but hold no memory), so a model larger than this machine's RAM can be metered.

Known limitations:
    * Tensors made before the meter starts are invisible unless passed to :meth:`adopt`
      (the model's parameters, buffers, gradients and optimizer state are).
    * No allocator rounding: CUDA rounds each block up to 512 bytes and caches freed blocks,
      so a card's *reserved* memory is 3-32% above what is counted here (DESIGN.md).
    * Library workspaces (cuBLAS: 2 x 32 MiB on an H200) are not tensors and are not counted.
    * ``UntypedStorage.resize_`` bypasses the dispatcher: FSDP2 frees and re-allocates its
      unsharded parameters that way. A meter made with ``track_resizes=True`` follows them
      by wrapping that method while it is active (torch's own ``MemTracker`` does the same).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memadvisor._torch_private import dtensor_local
from memadvisor.errors import SimulatedOutOfMemoryError

__all__ = ["MemoryMeter", "storage_bytes", "unique_storage_bytes"]

_LIFT_OPS = (torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default)
AllocationListener = Callable[[int, int], None]  # (delta_bytes, live_bytes)
# (storage, nbytes): a storage counted for the first time; id(storage) is the meter's key.
StorageListener = Callable[[torch.UntypedStorage, int], None]


def storage_bytes(tensor: torch.Tensor) -> int:
    """Bytes of the storage behind ``tensor`` (not of the view)."""
    return tensor.untyped_storage().nbytes()


def unique_storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``: shared storages count once."""
    seen: dict[int, int] = {}
    for t in tensors:
        st = t.untyped_storage()
        seen[id(st)] = st.nbytes()
    return sum(seen.values())


class _ResizeHook:
    """Wraps ``torch.UntypedStorage.resize_`` while any meter that tracks resizes is active."""

    def __init__(self) -> None:
        self.meters: list[MemoryMeter] = []
        self.original: Any = None
        self.lock = threading.Lock()

    def add(self, meter: MemoryMeter) -> None:
        with self.lock:
            if not self.meters:
                self.original = original = torch.UntypedStorage.resize_

                def resize_(storage: torch.UntypedStorage, size: int) -> Any:
                    for m in list(self.meters):
                        m._resized(storage, int(size))  # may raise: out of budget
                    return original(storage, size)

                torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
            self.meters.append(meter)

    def remove(self, meter: MemoryMeter) -> None:
        with self.lock:
            if meter in self.meters:
                self.meters.remove(meter)
            if not self.meters and self.original is not None:
                torch.UntypedStorage.resize_ = self.original  # type: ignore[method-assign]
                self.original = None


_RESIZE_HOOK = _ResizeHook()


class MemoryMeter(TorchDispatchMode):
    """Counts the live bytes of every storage created inside it; optionally enforces a budget.

    Args:
        budget_bytes: when an op's new storages would take the live bytes above this, the op's
            outputs are dropped and :class:`SimulatedOutOfMemoryError` is raised, as the CUDA
            allocator raises ``torch.OutOfMemoryError``. ``None`` meters without a limit.
        track_resizes: also follow ``UntypedStorage.resize_`` while the meter is active (a
            resize to 0 frees, a resize up allocates): needed where FSDP2 runs.

    Example::

        meter = MemoryMeter(budget_bytes=2**30)
        meter.adopt(model.parameters())
        with meter:
            loss = model(x).sum(); loss.backward()
        meter.peak_bytes
    """

    def __init__(self, budget_bytes: int | None = None, *, track_resizes: bool = False) -> None:
        super().__init__()
        self.track_resizes = track_resizes
        if budget_bytes is not None and budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, but got {budget_bytes=}.")
        self.budget_bytes = budget_bytes
        self.live_bytes = 0
        self.peak_bytes = 0
        self.allocations = 0
        self._refs: dict[int, weakref.ref] = {}
        self._bytes: dict[int, int] = {}  # key -> the storage's bytes as counted now
        self._lock = threading.Lock()
        self._listeners: list[AllocationListener] = []
        self._storage_listeners: list[StorageListener] = []

    # -- counting ---------------------------------------------------------------------------

    def adopt(self, tensors: Iterable[torch.Tensor | None]) -> int:
        """Count already-existing tensors (weights, grads, optimizer state) as live.

        Returns the bytes newly counted (storages already counted add nothing).
        """
        added = 0
        for t in tensors:
            if isinstance(t, torch.Tensor):
                added += self._track(dtensor_local(t).untyped_storage(), enforce=False)
        return added

    def reset_peak(self) -> None:
        """Start a new peak from the current live bytes, as ``reset_peak_memory_stats`` does."""
        with self._lock:
            self.peak_bytes = self.live_bytes

    def add_listener(self, listener: AllocationListener) -> None:
        """Call ``listener(delta_bytes, live_bytes)`` after every change to the live bytes."""
        self._listeners.append(listener)

    def add_storage_listener(self, listener: StorageListener) -> None:
        """Call ``listener(storage, nbytes)`` when a storage is first counted.

        Made inside the meter or adopted; the profiler uses it to attribute each storage to
        the module that made it. ``id(storage)`` is the key the meter counts it under.
        """
        self._storage_listeners.append(listener)

    def _track(self, storage: torch.UntypedStorage, *, enforce: bool) -> int:
        key = id(storage)
        with self._lock:
            if key in self._refs:
                return 0
            nbytes = storage.nbytes()
            budget = self.budget_bytes
            if enforce and budget is not None and self.live_bytes + nbytes > budget:
                raise SimulatedOutOfMemoryError(nbytes, self.live_bytes, self.budget_bytes)
            self._refs[key] = weakref.ref(storage, lambda _ref, k=key: self._free(k))
            self._bytes[key] = nbytes
            self.live_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            self.allocations += 1
            live = self.live_bytes
        for storage_listener in self._storage_listeners:
            storage_listener(storage, nbytes)
        for listener in self._listeners:
            listener(nbytes, live)
        return nbytes

    def _free(self, key: int) -> None:
        with self._lock:
            if self._refs.pop(key, None) is None:
                return
            nbytes = self._bytes.pop(key, 0)
            self.live_bytes -= nbytes
            live = self.live_bytes
        for listener in self._listeners:
            listener(-nbytes, live)

    def _resized(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """``storage`` is about to hold ``nbytes``: count the difference (before it happens, so
        that a resize past the budget fails as an allocation would)."""
        key = id(storage)
        if key not in self._refs:
            if nbytes > 0 and storage.nbytes() == 0:  # a freed storage made outside: allocates
                if self.budget_bytes is not None and self.live_bytes + nbytes > self.budget_bytes:
                    raise SimulatedOutOfMemoryError(nbytes, self.live_bytes, self.budget_bytes)
                self._track(storage, enforce=False)
                self._resized(storage, nbytes)
            return
        with self._lock:
            delta = nbytes - self._bytes[key]
            budget = self.budget_bytes
            if delta > 0 and budget is not None and self.live_bytes + delta > budget:
                raise SimulatedOutOfMemoryError(delta, self.live_bytes, budget)
            self._bytes[key] = nbytes
            self.live_bytes += delta
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)
            live = self.live_bytes
        for listener in self._listeners:
            listener(delta, live)

    def __enter__(self) -> MemoryMeter:
        if self.track_resizes:
            _RESIZE_HOOK.add(self)
        try:
            return super().__enter__()
        except BaseException:
            _RESIZE_HOOK.remove(self)
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            if self.track_resizes:
                _RESIZE_HOOK.remove(self)

    # -- the dispatch mode ------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # noqa: ANN001
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # A view or in-place result shares an input's storage: this op allocated nothing for it,
        # even when that input was made before the meter started (and so is not counted).
        # The exception is lift_fresh: torch.tensor(...) builds its tensor outside the dispatcher
        # and only "lifts" it through this op, so the shared storage is in fact brand new.
        inputs = (
            set()
            if func in _LIFT_OPS
            else {
                id(dtensor_local(t).untyped_storage())
                for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor) and t.device.type != "meta"
            }
        )
        new: dict[int, torch.UntypedStorage] = {}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                # A DTensor (FSDP2's sharded parameters, their optimizer state) holds its
                # bytes in its local shard.
                st = dtensor_local(t).untyped_storage()
                if id(st) not in self._refs and id(st) not in inputs:
                    new[id(st)] = st
        if new and self.budget_bytes is not None:
            requested = sum(st.nbytes() for st in new.values())
            if self.live_bytes + requested > self.budget_bytes:
                raise SimulatedOutOfMemoryError(requested, self.live_bytes, self.budget_bytes)
        for st in new.values():
            self._track(st, enforce=False)
        return out
