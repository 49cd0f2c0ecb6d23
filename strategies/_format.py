"""Small formatting helpers shared by the strategies' explanations."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memadvisor.profiler import Profile

__all__ = ["how_known", "mib", "names_text"]

MIB = 2**20


def mib(nbytes: float) -> str:
    """``3.5 * 2**20`` -> ``'3.5'`` (one decimal below 100 MiB, none above)."""
    value = nbytes / MIB
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def names_text(names: list[str], limit: int = 4) -> str:
    """``['h.0', 'h.1']`` -> ``'h.0, h.1'``; a long list is cut with a count of the rest."""
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def how_known(profile: Profile) -> str:
    """How a profile's bytes were had: ``'measured'``, or for fake tensors (nothing ran,
    shapes only) ``'metered under fake tensors'``."""
    return "metered under fake tensors" if profile.device.kind == "fake" else "measured"
