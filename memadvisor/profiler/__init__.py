"""Profiler: one instrumented training step measured at two small batch sizes."""

from memadvisor.profiler._blocks import find_blocks
from memadvisor.profiler._export import record_timeline, write_memory_snapshot
from memadvisor.profiler._ops import OpAllocation, top_allocations
from memadvisor.profiler._profile import as_optimizer_factory, profile, profile_workload
from memadvisor.profiler._schema import (
    BlockActivity,
    BlockInfo,
    DeviceInfo,
    LayerRow,
    LinearBytes,
    LinearMs,
    ModuleActivity,
    PhasePeak,
    Profile,
    StepProfile,
    UntrackedBytes,
)

__all__ = [
    "OpAllocation",
    "top_allocations",
    "BlockActivity",
    "BlockInfo",
    "DeviceInfo",
    "LayerRow",
    "LinearBytes",
    "LinearMs",
    "ModuleActivity",
    "PhasePeak",
    "Profile",
    "StepProfile",
    "UntrackedBytes",
    "as_optimizer_factory",
    "find_blocks",
    "profile",
    "profile_workload",
    "record_timeline",
    "write_memory_snapshot",
]
