"""What a strategy tells a person: advice to adopt by hand, what it checked, and how the
report shows its choice (its answer row, its words in the one-line answer, its lines in the
training loop a person pastes).

The report names no strategy: it asks each one for a :class:`ReportPart` and lays the parts
out, so a third party's strategy speaks in the report exactly as a built-in does.

Known limitations:
    * The loop a :class:`LoopLines` edits is a plain PyTorch loop with fixed slots (the
      loader's arguments, lines after the optimizer, the forward's comment, the backward and
      the optimizer step); a strategy that needs another shape of loop says so in its advice.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from memadvisor.schema.precision import Precision

__all__ = ["Advice", "Check", "LoopLines", "ReportPart"]


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


class LoopLines(BaseModel):
    """What a choice changes in a plain training loop: the report's "Train with it in your own
    loop" code. Each field fills one slot; empty leaves the plain loop's own line.

    What ``apply_plan`` installs runs inside the model's forward, so only what a model cannot
    carry belongs here (the loader's shape, a gradient scaler).
    """

    model_config = ConfigDict(extra="forbid")

    loader_args: str = Field("", description="Appended to the DataLoader's arguments.")
    loader_comment: str = Field("", description="Why, after the DataLoader line.")
    setup: list[str] = Field(
        default_factory=list, description="Lines after the optimizer's, before the loop."
    )
    forward_comment: str = Field("", description="After the forward line: what runs inside it.")
    forward_notes: list[str] = Field(
        default_factory=list, description="Comment lines after the forward line, '# ...'."
    )
    backward: str = Field("", description="Replaces 'loss.backward()'.")
    step: str = Field("", description="Replaces 'optimizer.step()'.")


class ReportPart(BaseModel):
    """A strategy's choice as the report shows it, in the strategy's own words.

    ``label`` gives the choice a row of the answer (``("Precision", "bf16 autocast")``); a
    part without one is listed under the answer's "Also" as ``name: words``.
    """

    model_config = ConfigDict(extra="forbid")

    label: str = Field("", description="The answer row's label; '' lists it under 'Also'.")
    words: str = Field(description="The row's (or the 'Also' entry's) words.")
    brief: str = Field(
        "", description="Its phrase in the one-line answer ('bf16', 'no checkpointing')."
    )
    step_precision: Precision | None = Field(
        None,
        description="The profiled step the choice runs (a key of Profile.steps); the report "
        "reads activations at it. None: the choice does not change it.",
    )
    recomputed_blocks: list[str] = Field(
        default_factory=list,
        description="Blocks whose saved activations the choice recomputes in backward: the "
        "report shows what they keep.",
    )
    loop: LoopLines | None = Field(None, description="Its lines in a plain training loop.")
