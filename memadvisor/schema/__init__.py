"""The vocabulary every stage shares: what is asked, measured, estimated and planned.

Nothing here runs a model or imports a stage of the pipeline; every stage imports from here.

    config      PlanConfig: the budget and how to plan under it
    device      DeviceCapabilities: what a device can do; the device names users pass
    precision   the precision names and their autocast dtypes
    profile     Profile: what the profiler measured
    candidate   Candidate, Estimate, Measurement: one configuration, estimated and run
    advice      Advice, Check: what a strategy tells a person
    plan        Plan: the planner's answer
"""

from memadvisor.schema.advice import Advice, Check
from memadvisor.schema.candidate import Candidate, Estimate, Measurement
from memadvisor.schema.config import GIB, PlanConfig, gib_to_bytes
from memadvisor.schema.device import AutocastPolicy, DeviceCapabilities
from memadvisor.schema.plan import Plan, Probe, Row
from memadvisor.schema.precision import AUTOCAST_DTYPES, PRECISIONS, Precision
from memadvisor.schema.profile import Profile, StepProfile

__all__ = [
    "AUTOCAST_DTYPES",
    "GIB",
    "PRECISIONS",
    "Advice",
    "AutocastPolicy",
    "Candidate",
    "Check",
    "DeviceCapabilities",
    "Estimate",
    "Measurement",
    "Plan",
    "PlanConfig",
    "Precision",
    "Probe",
    "Profile",
    "Row",
    "StepProfile",
    "gib_to_bytes",
]
