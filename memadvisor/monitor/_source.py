"""Where the monitor reads memory: the CUDA allocator's counters, or a CPU MemoryMeter."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memadvisor.memory import MemoryMeter
from memadvisor.timeline import CudaMemoryReader, MeterMemoryReader

__all__ = ["CudaSource", "MemorySource", "MeterSource", "source_for"]


class MemorySource:
    """Current and per-iteration peak bytes of one device, and a reader for event hooks."""

    device: str
    reader: Any  # CudaMemoryReader | MeterMemoryReader, with interval peaks

    def read(self) -> tuple[int, int | None]:
        """``(allocated_bytes, reserved_bytes | None)`` now."""
        raise NotImplementedError

    def take_peaks(self) -> tuple[int, int | None]:
        """Peaks since the last call, then start new ones."""
        raise NotImplementedError


class CudaSource(MemorySource):
    """The caching allocator's counters: a few microseconds, no synchronisation."""

    def __init__(self, device: torch.device, *, count_allocations: bool = False) -> None:
        self.device = str(device)
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self.reader = CudaMemoryReader(
            self._index, count_allocations=count_allocations, interval_peaks=True
        )
        torch.cuda.reset_peak_memory_stats(self._index)

    def read(self) -> tuple[int, int | None]:
        return torch.cuda.memory_allocated(self._index), torch.cuda.memory_reserved(self._index)

    def take_peaks(self) -> tuple[int, int | None]:
        d = self._index
        # Event hooks reset the allocator's peaks at each reading; their running maxima
        # hold what those resets took away.
        allocated = max(torch.cuda.max_memory_allocated(d), self.reader.max_allocated_bytes)
        reserved = max(torch.cuda.max_memory_reserved(d), self.reader.max_reserved_bytes)
        torch.cuda.reset_peak_memory_stats(d)
        self.reader.reset_max()
        return allocated, reserved


class MeterSource(MemorySource):
    """Tracked tensor bytes on the CPU; the user's loop must run inside the meter."""

    def __init__(self, meter: MemoryMeter) -> None:
        self.device = "cpu"
        self.meter = meter
        self.reader = MeterMemoryReader(meter, interval_peaks=True)

    def read(self) -> tuple[int, int | None]:
        return self.meter.live_bytes, None

    def take_peaks(self) -> tuple[int, int | None]:
        allocated = max(self.meter.peak_bytes, self.reader.max_allocated_bytes)
        self.meter.reset_peak()
        self.reader.reset_max()
        return allocated, None


def model_device(model: nn.Module) -> torch.device:
    """Where the model's first parameter (or buffer) lives; the CPU for an empty model."""
    for t in model.parameters():
        return t.device
    for t in model.buffers():
        return t.device
    return torch.device("cpu")


def source_for(model: nn.Module, *, count_allocations: bool = False) -> MemorySource:
    """A CUDA source for a model on a card, otherwise a fresh CPU meter's."""
    device = model_device(model)
    if device.type == "cuda":
        return CudaSource(device, count_allocations=count_allocations)
    return MeterSource(MemoryMeter())
