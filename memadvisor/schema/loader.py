"""What timing the user's DataLoader found: the loader as it is, the variants tried, the advice."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["LoaderAdvice", "LoaderTrial"]


class LoaderTrial(BaseModel):
    """A few batches of one loader configuration."""

    model_config = ConfigDict(extra="forbid")

    num_workers: int
    pin_memory: bool
    persistent_workers: bool
    batches: int = Field(description="Batches timed after the first.")
    first_batch_ms: float = Field(description="iter() to the first batch, start-up included.")
    batch_ms: float = Field(description="Median time per batch after the first.")
    batch_ms_spread: tuple[float, float] = Field(description="Fastest and slowest batch.")
    copy_ms: float | None = Field(None, description="CUDA: median host-to-card copy of a batch.")
    samples_per_batch: int

    @property
    def samples_per_s(self) -> float:
        """What this loader delivers alone (its workers loading in parallel)."""
        return self.samples_per_batch / self.batch_ms * 1e3 if self.batch_ms > 0 else float("inf")


class LoaderAdvice(BaseModel):
    """The loader as it is, the variants tried, and what to change."""

    model_config = ConfigDict(extra="forbid")

    current: LoaderTrial
    variants: list[LoaderTrial] = Field(default_factory=list)
    step_samples_per_s: float = Field(description="The planned step's samples/s.")
    step_measured: bool = Field(description="True when the step's rate was measured.")
    limits_throughput: bool = Field(
        description="The loader as it is delivers fewer samples/s than the step consumes."
    )
    recommended: dict[str, Any] = Field(
        default_factory=dict, description="DataLoader arguments to change, with their values."
    )
    sentences: list[str] = Field(default_factory=list, description="The findings, in words.")
    snippet: str = ""
