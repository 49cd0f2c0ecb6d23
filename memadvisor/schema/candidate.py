r"""What every stage passes on about one configuration: the candidate, its estimate, its run.

The search writes :class:`Candidate`\ s, the estimate answers each with an
:class:`Estimate`, and a device run answers with a :class:`Measurement`. They sit here, below
every stage, so that the estimate, the devices, the planner and the report share them
without importing one another.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

__all__ = [
    "RETRY_RAN_OUT_HERE",
    "Candidate",
    "Estimate",
    "Measurement",
    "MemoryKind",
    "PeakPhase",
    "RanOutFirst",
]

# How the record of a retry that ran out too in the run's own process begins (the prober
# writes it, the compile search counts it as no run of its own).
RETRY_RAN_OUT_HERE = "ran out too, retried in the process where"

PeakPhase = Literal["forward", "backward", "optimizer"]
MemoryKind = Literal["params", "grads", "optimizer_state", "activations", "temporaries"]


class Candidate(BaseModel):
    """One configuration: a batch size and each strategy's choice, keyed by strategy name."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    batch_size: int = Field(gt=0, description="The micro-batch run per forward/backward.")
    accumulation_steps: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    choices: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="Strategy name -> its choice, e.g. {'precision': 'bf16', "
        "'checkpointing': ['blocks.0', 'blocks.1']}. A strategy left out is off.",
    )

    def choice(self, strategy: str, default: JsonValue = None) -> JsonValue:
        return self.choices.get(strategy, default)


class Estimate(BaseModel):
    """What the estimate says one candidate will do."""

    model_config = ConfigDict(extra="forbid")

    peak_bytes: int = Field(description="Highest bytes held during the step.")
    peak_phase: PeakPhase = Field(description="Where that peak happens.")
    breakdown: dict[MemoryKind, int] = Field(description="What is held at the peak, by kind.")
    step_ms: float = Field(description="One optimizer step, accumulation included.")
    samples_per_s: float = Field(description="batch * accumulation / step time.")
    peak_at: str = Field(
        "",
        description="The moment of the peak: 'forward', 'backward: head', 'backward: <block>' "
        "(its backward, or its recompute), or 'optimizer'.",
    )
    reserved_peak_bytes: int | None = Field(
        None,
        description="CUDA: what the caching allocator reserves at the peak: peak_bytes plus "
        "the step's largest allocation at this batch where the profile has its line, else "
        "peak_bytes scaled by its reserved/allocated ratio; None where it has neither.",
    )
    phase_peak_bytes: dict[PeakPhase, int] | None = Field(
        None,
        description="The highest bytes of each phase (forward, backward, optimizer), allocated "
        "as peak_bytes is; None in estimates made before this was kept.",
    )

    @property
    def limit_bytes(self) -> int:
        """What a memory cap must hold for this step: a memory fraction caps reserved bytes."""
        return max(self.peak_bytes, self.reserved_peak_bytes or 0)


class RanOutFirst(BaseModel):
    """A run that ran out of memory at a larger batch first and then measured its own in the
    same process (a compiled run with a dynamic batch: no second compile)."""

    model_config = ConfigDict(extra="forbid")

    batch_size: int = Field(gt=0, description="The batch that ran out.")
    message: str = Field(description="The out-of-memory error's first line.")
    steps: int = Field(ge=0, description="Steps that batch completed before it ran out.")
    same_process: bool = Field(
        True,
        description="The smaller batch ran in the process that ran out (False: a run of its "
        "own, a fresh start and compile: Device.run_many_retrying's default).",
    )

    @classmethod
    def of(
        cls, batch_size: int, error: BaseException, steps: int, *, same_process: bool
    ) -> RanOutFirst:
        """What ran out: ``batch_size``, ``error``'s first line (its type where it says
        nothing), the ``steps`` it completed."""
        lines = str(error).strip().splitlines()
        message = (lines[0] if lines else type(error).__name__)[:500]
        return cls(batch_size=batch_size, message=message, steps=steps, same_process=same_process)


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
    first_step_ms: float | None = Field(
        None,
        description="The first step, which compiles a compiled model (None: not recorded).",
    )
    host_ms: float | None = Field(
        None,
        description="Median time a timed step took to hand its work to the device, until the "
        "step returned and before the run waited for the device (None: not recorded). Near "
        "step_ms, the device waited on the host: the host's speed, not the card's, set the "
        "step's time (a host-bound step).",
    )
    compile_cache_hits: int | None = Field(
        None,
        description="Graphs this run loaded from inductor's FX graph and AOTAutograd caches; "
        "with compile_cache_misses, None when the run compiled nothing.",
    )
    compile_cache_misses: int | None = Field(
        None, description="Graphs this run compiled afresh (those caches missed)."
    )
    compile_cache_bypasses: int | None = Field(
        None,
        description="Graphs this run compiled that those caches would not take (so no later "
        "process loads them).",
    )
    rank_peak_bytes: list[int] | None = Field(
        None,
        description="Runs on several ranks (DDP, FSDP2): each rank's peak, rank 0 first; "
        "peak_bytes is the largest. None for a run on one device.",
    )
    ran_out_first: RanOutFirst | None = Field(
        None,
        description="The run ran out at this larger batch first, then measured this one "
        "(Device.run_many_retrying; in the same process where same_process): its peak counts "
        "from the process's start as a fresh run's does, after the failed steps' activations "
        "and gradients were freed. None: one batch from a clean state.",
    )

    @property
    def limit_bytes(self) -> int:
        """What the run needed of a memory cap: a memory fraction caps reserved bytes (the
        simulated device reserves nothing beyond its tensors)."""
        return max(self.peak_bytes, self.reserved_peak_bytes or 0)
