"""Profiler: one instrumented training step measured at two small batch sizes."""

from memadvisor.profiler._blocks import find_blocks
from memadvisor.profiler._export import record_timeline, write_memory_snapshot
from memadvisor.profiler._flops import (
    FlopCounter,
    StepTimeModel,
    count_step_flops,
    with_modelled_times,
)
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
    StepFlops,
    StepProfile,
    UntrackedBytes,
)

__all__ = [
    "OpAllocation",
    "top_allocations",
    "BlockActivity",
    "BlockInfo",
    "DeviceInfo",
    "FlopCounter",
    "LayerRow",
    "LinearBytes",
    "LinearMs",
    "ModuleActivity",
    "PhasePeak",
    "Profile",
    "StepFlops",
    "StepProfile",
    "StepTimeModel",
    "UntrackedBytes",
    "as_optimizer_factory",
    "count_step_flops",
    "find_blocks",
    "profile",
    "profile_workload",
    "record_timeline",
    "with_modelled_times",
    "write_memory_snapshot",
]
