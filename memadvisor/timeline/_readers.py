"""Memory readers: where a recorder reads the bytes held at each event.

A reader is a callable returning ``(allocated, reserved[, allocations[, peak]])``: the CUDA
allocator's counters (:class:`CudaMemoryReader`, through the one private counter read in
:mod:`memadvisor._torch_private`) or the CPU meter's (:class:`MeterMemoryReader`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch

from memadvisor._torch_private import cuda_counter_reader

__all__ = [
    "CudaMemoryReader",
    "MemoryReader",
    "MemoryReading",
    "MeterMemoryReader",
    "cuda_memory_reader",
    "meter_memory_reader",
]

# () -> (allocated_bytes, reserved_bytes | None[, allocations | None[, peak since last | None]])
MemoryReader = Callable[[], tuple]


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
