"""Planner: search the strategies' choices on the estimate, probe the device, verify the pick."""

from memadvisor.planner._estimated import estimated_profile, plan_estimated, with_flop_times
from memadvisor.planner._plan import measure_configuration, plan_workload
from memadvisor.planner._probe import BatchSearch, find_batch, safe_below
from memadvisor.planner._progress import Progress
from memadvisor.planner._schema import (
    EstimateBasis,
    Measurement,
    ModelFingerprint,
    Plan,
    Probe,
    Row,
)

__all__ = [
    "BatchSearch",
    "EstimateBasis",
    "Measurement",
    "ModelFingerprint",
    "Plan",
    "Probe",
    "Progress",
    "Row",
    "estimated_profile",
    "find_batch",
    "measure_configuration",
    "plan_estimated",
    "plan_workload",
    "safe_below",
    "with_flop_times",
]
