"""Fail at once when the budget cannot hold the model itself, saying what would."""

from __future__ import annotations

import math

from memadvisor.errors import InfeasibleBudgetError
from memadvisor.schema.config import GIB, PlanConfig
from memadvisor.schema.profile import Profile

__all__ = ["budget_needed_bytes", "check_static_fits", "infeasible"]


def budget_needed_bytes(peak_bytes: int, margin_fraction: float) -> int:
    """The smallest budget whose usable part (budget less margin) holds ``peak_bytes``."""
    return math.ceil(peak_bytes / (1.0 - margin_fraction))


def _gib(nbytes: int) -> str:
    """An amount needed, rounded up to 0.01 GiB: a budget printed as enough must be enough.
    (The tolerance keeps a float's last bit from adding 0.01: 0.08 GiB stays 0.08.)"""
    return f"{math.ceil(nbytes / GIB * 100 - 1e-6) / 100:.2f} GiB"


def _gib_given(nbytes: int) -> str:
    """A budget the caller gave (or its usable part), as they would write it: 0.08, 0.004, 8."""
    return f"{round(nbytes / GIB, 4):g} GiB"


def infeasible(
    profile: Profile, config: PlanConfig, cheapest_peak_bytes: int, why: str
) -> InfeasibleBudgetError:
    """The error that names the minimum budget, from the cheapest estimated batch-1 peak."""
    needed = budget_needed_bytes(
        max(cheapest_peak_bytes, profile.static_bytes), config.margin_fraction
    )
    return InfeasibleBudgetError(
        f"{why} That is more than the {_gib_given(config.usable_bytes)} usable of the "
        f"{_gib_given(config.budget_bytes)} budget ({config.margin_fraction:.0%} is kept as a "
        f"safety margin). The minimum budget that would work is {_gib(needed)} (estimated at "
        "batch 1 with the most memory-saving configuration):",
        minimum_bytes=needed,
        minimum_gib=_gib(needed)[: -len(" GiB")],
    )


def check_static_fits(profile: Profile, config: PlanConfig, cheapest_peak_bytes: int) -> None:
    """Raise when weights, gradients and optimizer state alone exceed the usable budget.

    No batch size, precision or checkpointing changes those bytes, so no search is needed.

    Raises:
        InfeasibleBudgetError: with ``minimum_bytes`` the smallest budget that would work.
    """
    if profile.static_bytes <= config.usable_bytes:
        return
    raise infeasible(
        profile,
        config,
        cheapest_peak_bytes,
        f"The model's weights, gradients and optimizer state alone take "
        f"{_gib(profile.static_bytes)}.",
    )
