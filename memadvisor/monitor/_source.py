"""Where the monitor reads memory: the CUDA allocator's counters, or a CPU MemoryMeter."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from memadvisor._torch_private import cuda_counter_reader
from memadvisor.memory import MemoryMeter
from memadvisor.timeline import CudaMemoryReader, MeterMemoryReader

__all__ = ["CudaSource", "MemorySource", "MeterSource", "model_device", "source_for"]


class MemorySource:
    """Current and per-iteration peak bytes of one device, and a reader for event hooks.

    Attributes:
        costly_reads: a reading costs enough (the CUDA allocator's, ~20 us: its stats call
            builds a dict of some 120 counters) that the monitor, unless told a period,
            reads every few iterations where every one would exceed its budget.
    """

    device: str
    reader: Any  # CudaMemoryReader | MeterMemoryReader, with interval peaks
    costly_reads: bool = False

    def take(self) -> tuple[int, int | None, int, int | None]:
        """``(allocated, reserved, peak allocated, peak reserved)``, then start new peaks.

        Reserved bytes are None on the CPU; peaks cover the time since the last call.
        """
        raise NotImplementedError


class CudaSource(MemorySource):
    """The caching allocator's counters: one stats call and one peak reset, no synchronisation.

    The public ``torch.cuda.memory_allocated`` (``max_memory_allocated``, ``memory_reserved``)
    each make the same stats call and then flatten and sort its dict in Python: one private
    call here reads all four numbers for less than one of them.

    Args:
        device: the card.
        count_allocations: the event reader also reports cumulative allocation counts.
    """

    costly_reads = True

    def __init__(self, device: torch.device, *, count_allocations: bool = False) -> None:
        self.device = str(device)
        self._index = device.index if device.index is not None else torch.cuda.current_device()
        self.reader = CudaMemoryReader(
            self._index, count_allocations=count_allocations, interval_peaks=True
        )
        self._read = cuda_counter_reader(self._index, reset_peaks=True)
        torch.cuda.reset_peak_memory_stats(self._index)

    def take(self) -> tuple[int, int | None, int, int | None]:
        allocated, reserved, peak_allocated, peak_reserved, _ = self._read()
        reader = self.reader
        if reader.max_allocated_bytes:
            # Event hooks (a measured iteration) reset the allocator's peaks at each reading;
            # their running maxima hold what those resets took away.
            peak_allocated = max(peak_allocated, reader.max_allocated_bytes)
            peak_reserved = max(peak_reserved, reader.max_reserved_bytes)
            reader.reset_max()
        return allocated, reserved, peak_allocated, peak_reserved


class MeterSource(MemorySource):
    """Tracked tensor bytes on the CPU; the user's loop must run inside the meter."""

    def __init__(self, meter: MemoryMeter) -> None:
        self.device = "cpu"
        self.meter = meter
        self.reader = MeterMemoryReader(meter, interval_peaks=True)

    def take(self) -> tuple[int, int | None, int, int | None]:
        live = self.meter.live_bytes
        peak = max(self.meter.peak_bytes, self.reader.max_allocated_bytes)
        self.meter.reset_peak()
        self.reader.reset_max()
        return live, None, peak, None


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
