"""Devices run training steps and report their peak: the CUDA card, or the CPU simulated one."""

from memadvisor.device._base import Device

__all__ = ["Device"]
