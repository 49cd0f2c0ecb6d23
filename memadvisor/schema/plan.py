"""The planner's answer: what to run, why, and what was measured to back it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from memadvisor.schema.advice import Advice, Check
from memadvisor.schema.candidate import Candidate, Estimate, Measurement
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.profile import Profile

__all__ = ["Plan", "Probe", "Row", "StageOutcome", "StageVariant"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Probe(_Model):
    """One run of a candidate on the device from a clean state."""

    batch_size: int
    fits: bool
    steps: int = Field(description="Steps it ran (all of them when it fits).")
    peak_bytes: int | None = Field(None, description="Measured peak; None when it ran out.")
    error: str | None = Field(None, description="The out-of-memory message, when it ran out.")
    wall_ms: float = 0.0
    stage: str = Field(
        "probe",
        description="probe: searching the batch; timing: re-ranking the best candidates; "
        "verify: the pick's sustained run; compare: a comparison row's own batch search; "
        "a measured-only strategy's name: its variants' batch search ('compile').",
    )
    candidate: Candidate | None = Field(None, description="What ran (batch and choices).")


class Row(_Model):
    """One line of the comparison a person would build by hand (Baseline, +AMP, ...)."""

    label: str
    candidate: Candidate
    estimate: Estimate
    largest_batch: int | None = Field(None, description="Largest batch that fits, this config.")
    measured: Measurement | None = Field(None, description="None when only estimated.")


class StageVariant(_Model):
    """One variant a measured stage tried: whether its trial ran, and what the device measured."""

    choices: dict[str, JsonValue] = Field(description="Its choices, the stage's own included.")
    ok: bool = Field(description="Its trial here ran well (torch.compile: it compiled).")
    trial: str = Field(description="The trial's sentence: its one-off cost, or why it failed.")
    one_off_ms: float | None = Field(
        None, description="What the trial paid once (a compile: first step less a steady one)."
    )
    batch_size: int | None = Field(None, description="The batch the device confirmed, if run.")
    measured: Measurement | None = Field(None, description="Its steady steps at that batch.")
    device_wall_ms: float = Field(0.0, description="Its device runs' wall time.")
    error: str | None = Field(None, description="Why its device runs failed, when they did.")


class StageOutcome(_Model):
    """What a measured-only strategy's stage found for the eager pick (``Strategy.refine``).

    The report shows one answer row per outcome: ``label``, then ``pick_words`` with the
    measured gain and ``costs`` when the stage's variant was picked, else ``answer``.
    """

    strategy: str = Field(description="The measured-only strategy whose stage this was.")
    label: str = Field(description="The report's row label: 'Compile'.")
    runs_label: str = Field(
        description="How the report counts this stage's device runs: 'compiling (compiled "
        "variants)'."
    )
    picked: bool = Field(description="True when the plan's pick is the stage's variant.")
    summary: str = Field(description="The verdict in a sentence (also among the plan's notes).")
    pick_words: str = Field("", description="The picked variant in a few words.")
    answer: str = Field("", description="The report's row when the eager pick was kept: why.")
    costs: list[str] = Field(
        default_factory=list, description="What the picked variant costs once, in phrases."
    )
    eager_batch_size: int = Field(description="The eager pick's batch the variants started from.")
    eager_candidate: Candidate | None = Field(None, description="The eager pick itself.")
    eager_samples_per_s: float = Field(description="The eager pick's measured throughput.")
    eager_measured: Measurement | None = Field(
        None, description="The eager pick's measured steps (its peak too), before verification."
    )
    variants: list[StageVariant] = Field(default_factory=list)
    one_off_ms: float | None = Field(
        None, description="The pick's one-off cost (once per process); None when eager."
    )
    details: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="What else the strategy measured, by name (compile: its shared cache).",
    )
    wall_ms: float = Field(0.0, description="Planner wall time spent in the stage.")


class Plan(_Model):
    """The chosen configuration; ``apply_plan(model, plan)`` rewrites a model to it."""

    schema_version: int = 1
    model_name: str
    config: PlanConfig
    device_kind: Literal["cuda", "simulated", "fake"]
    device_name: str
    candidate: Candidate = Field(description="The pick.")
    estimate: Estimate = Field(description="The estimate of the pick.")
    verified: Measurement | None = Field(None, description="The pick's sustained run.")
    probes: list[Probe] = Field(default_factory=list)
    comparison: list[Row] = Field(default_factory=list)
    advice: list[Advice] = Field(default_factory=list)
    checks: list[Check] = Field(
        default_factory=list,
        description="What the chosen strategies measured on the workload (precision numerics).",
    )
    notes: list[str] = Field(
        default_factory=list,
        description="What a person should know: step-downs, fallbacks, what was only estimated.",
    )
    plan_wall_ms: float = 0.0
    stages: list[StageOutcome] = Field(
        default_factory=list,
        description="What each measured-only strategy's stage found for the eager pick.",
    )
    profile: Profile | None = Field(None, description="The profile the plan was made from.")
