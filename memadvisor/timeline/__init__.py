"""A step's memory over time, per module: one format and one set of exports for every recorder.

    _events      TimelineEvent, and the open stack of modules each event leaves
    _format      Timeline (JSON, per-module LayerStats) and its exports
    _speedscope  the speedscope file (https://www.speedscope.app): bytes per module, or time
    _readers     memory readers: the CUDA allocator's counters, the CPU meter's
    _recorder    ModuleEventRecorder: module enter/exit, phase marks and samples as events

The profiler and the training-loop monitor both record through :class:`ModuleEventRecorder`
and hand back a :class:`Timeline`.
"""

from memadvisor.timeline._events import EventKind, Pass, TimelineEvent
from memadvisor.timeline._format import LayerStats, Timeline
from memadvisor.timeline._readers import (
    CudaMemoryReader,
    MemoryReader,
    MemoryReading,
    MeterMemoryReader,
    cuda_memory_reader,
    meter_memory_reader,
)
from memadvisor.timeline._recorder import ModuleEventRecorder, iter_tensors
from memadvisor.timeline._speedscope import SPEEDSCOPE_SCHEMA_URL

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
