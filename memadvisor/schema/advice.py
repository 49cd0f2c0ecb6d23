"""What a strategy tells a person: advice to adopt by hand, and what it checked."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, JsonValue

__all__ = ["Advice", "Check"]


class Advice(BaseModel):
    """One recommendation a person can adopt by hand."""

    model_config = ConfigDict(extra="forbid")

    strategy: str = Field(description="The strategy's registered name.")
    title: str = Field(description="A few words: 'Checkpoint 6 of 12 blocks'.")
    sentence: str = Field(description="What to do and why, in plain words.")
    snippet: str = Field("", description="Code to paste into one's own training script.")
    effect: str = Field("", description="Its effect, measured or marked as estimated.")


class Check(BaseModel):
    """What a strategy measured about a choice on the user's own workload (e.g. numerics)."""

    model_config = ConfigDict(extra="forbid")

    strategy: str = Field(description="The strategy's registered name.")
    choice: JsonValue = Field(None, description="The choice that was checked.")
    summary: str = Field(description="One sentence a person reads: what differed, by how much.")
    passed: bool = Field(description="False when the difference is worth a person's attention.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="The measured numbers, named with their units."
    )
