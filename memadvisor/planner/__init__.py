"""Planner: search the strategies' choices on the estimate, probe the device, verify the pick.

Its answer is a :class:`~memadvisor.schema.plan.Plan` (``memadvisor.schema``).
"""

from memadvisor.planner._estimated import estimated_profile, plan_estimated, with_flop_times
from memadvisor.planner._plan import measure_configuration, plan_workload
from memadvisor.planner._probe import BatchSearch, find_batch, safe_below
from memadvisor.planner._progress import Progress

__all__ = [
    "BatchSearch",
    "Progress",
    "estimated_profile",
    "find_batch",
    "measure_configuration",
    "plan_estimated",
    "plan_workload",
    "safe_below",
    "with_flop_times",
]
