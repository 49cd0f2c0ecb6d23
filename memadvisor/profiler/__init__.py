"""Profiler: one instrumented training step measured at two small batch sizes.

What it measures is a :class:`~memadvisor.schema.profile.Profile` (``memadvisor.schema``).
"""

from memadvisor.profiler._blocks import find_blocks
from memadvisor.profiler._export import record_timeline, write_memory_snapshot
from memadvisor.profiler._profile import as_optimizer_factory, profile, profile_workload

__all__ = [
    "as_optimizer_factory",
    "find_blocks",
    "profile",
    "profile_workload",
    "record_timeline",
    "write_memory_snapshot",
]
