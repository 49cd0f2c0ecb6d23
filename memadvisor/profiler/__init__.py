"""Profiler: one instrumented training step measured at two small batch sizes.

What it measures is a :class:`~memadvisor.schema.profile.Profile` (``memadvisor.schema``).
"""

from memadvisor.profiler._blocks import find_blocks
from memadvisor.profiler._export import record_timeline, write_memory_snapshot
from memadvisor.profiler._flops import FlopCounter, count_step_flops, with_modelled_times
from memadvisor.profiler._ops import OpAllocation, top_allocations
from memadvisor.profiler._profile import profile_workload

__all__ = [
    "OpAllocation",
    "top_allocations",
    "FlopCounter",
    "count_step_flops",
    "find_blocks",
    "profile_workload",
    "record_timeline",
    "with_modelled_times",
    "write_memory_snapshot",
]
