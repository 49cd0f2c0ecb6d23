"""The Device contract: run a candidate's training steps from a clean state, report the peak."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from memadvisor.estimate import Candidate
    from memadvisor.workload import Workload

__all__ = ["Device", "Measurement"]


class Measurement(BaseModel):
    """A candidate run on a device for some sustained steps."""

    model_config = ConfigDict(extra="forbid")

    steps: int
    peak_bytes: int = Field(description="Most bytes allocated to tensors at once.")
    reserved_peak_bytes: int | None = Field(
        None,
        description="CUDA: the caching allocator's reserved peak, which a memory fraction caps.",
    )
    step_ms: float = Field(description="Median step time (the first step excluded when >1).")
    samples_per_s: float
    rank_peak_bytes: list[int] | None = Field(
        None,
        description="Runs on several ranks (DDP, FSDP2): each rank's peak, rank 0 first; "
        "peak_bytes is the largest. None for a run on one device.",
    )

    @property
    def limit_bytes(self) -> int:
        """What the run needed of a memory cap: a memory fraction caps reserved bytes (the
        simulated device reserves nothing beyond its tensors)."""
        return max(self.peak_bytes, self.reserved_peak_bytes or 0)


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
