"""Devices run training steps and report their peak: the CUDA card, or the CPU simulated one."""

from memadvisor.device._base import Device, Measurement
from memadvisor.device._oom import is_oom

__all__ = ["Device", "Measurement", "is_oom"]
