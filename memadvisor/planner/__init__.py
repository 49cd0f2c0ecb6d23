"""Planner: search the strategies' choices on the estimate, probe the device, verify the pick."""

from memadvisor.planner._schema import Measurement, Plan, Probe, Row

__all__ = ["Measurement", "Plan", "Probe", "Row"]
