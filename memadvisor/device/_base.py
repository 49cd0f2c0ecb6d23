"""The Device contract: run a candidate's training steps from a clean state, report the peak."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Literal

if TYPE_CHECKING:
    from memadvisor.schema.candidate import Candidate, Measurement
    from memadvisor.workload import Workload

__all__ = ["Device"]


class Device(ABC):
    """Where probes, timing and verification run.

    ``run`` must start from a clean state every call (a fresh process, or a state proven equal
    to one: DESIGN.md shows why) and raise an error for which ``memadvisor.device.is_oom`` is
    true when the candidate does not fit ``budget_bytes``. It never changes the caller's
    model, optimizer or RNG state.
    """

    kind: ClassVar[Literal["cuda", "simulated", "fake"]]

    def __init__(self, budget_bytes: int, name: str) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, but got {budget_bytes=}.")
        self.budget_bytes = budget_bytes
        self.name = name

    @abstractmethod
    def run(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        """Train ``candidate`` for ``steps`` steps on a copy of ``workload``'s model."""
