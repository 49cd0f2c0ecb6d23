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
    # Round up: a budget printed as enough must be enough.
    return f"{math.ceil(nbytes / GIB * 100) / 100:.2f} GiB"


def infeasible(
    profile: Profile, config: PlanConfig, cheapest_peak_bytes: int, why: str
) -> InfeasibleBudgetError:
    """The error that names the minimum budget, from the cheapest estimated batch-1 peak."""
    needed = budget_needed_bytes(
        max(cheapest_peak_bytes, profile.static_bytes), config.margin_fraction
    )
    return InfeasibleBudgetError(
        f"{why} That is more than the {_gib(config.usable_bytes)} usable of the "
        f"{_gib(config.budget_bytes)} budget ({config.margin_fraction:.0%} is kept as a safety "
        f"margin). The minimum budget that would work is {_gib(needed)} (estimated at batch 1 "
        f"with the most memory-saving configuration): pass budget_gb={_gib(needed)[:-4]} or more.",
        minimum_bytes=needed,
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
