"""Devices run training steps and report their peak: the CUDA card, or the CPU simulated one."""

from memadvisor.device._oom import is_oom

__all__ = ["is_oom"]
