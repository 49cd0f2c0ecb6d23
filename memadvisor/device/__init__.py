"""Devices run training steps and report their peak: the CUDA card, or the CPU simulated one."""

from memadvisor.device._base import Device
from memadvisor.device._factory import make_device, planned_capabilities

__all__ = ["Device", "make_device", "planned_capabilities"]
