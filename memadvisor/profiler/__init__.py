"""Profiler: one instrumented training step measured at two small batch sizes."""

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
)

__all__ = [
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
]
