"""What the user asks for: the budget and how to plan under it."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue, model_validator

# The device names are read in schema.device; re-exported here, where callers found them.
from memadvisor.schema.device import DEVICE_NAMES, DeviceKind, device_kind

__all__ = [
    "GIB",
    "ChecksPolicy",
    "DeviceKind",
    "Objective",
    "Parallel",
    "PlanConfig",
    "DEVICE_NAMES",
    "device_kind",
    "gib_to_bytes",
    "samples_per_s",
]

GIB = 2**30  # budgets are GiB (2^30), the unit torch's own OOM messages count in

Objective = Literal["throughput", "largest_batch", "effective_batch"]
Parallel = Literal["none", "ddp", "fsdp2", "auto"]
ChecksPolicy = Literal["decide", "report"]


# A step timed (or estimated) at 0 ms counts as one tick of this: samples/s stays a finite
# number, which JSON can hold (an infinity was written as null and the plan did not load).
MIN_STEP_MS = 1e-3


def samples_per_s(samples: int, step_ms: float) -> float:
    """Throughput of ``samples`` per step of ``step_ms``, finite for any step time."""
    return samples / max(step_ms, MIN_STEP_MS) * 1e3


def steady_ms(times_ms: Sequence[float]) -> float:
    """A run's steady step: the median of its steps' times but the first (which creates the
    optimizer's state, warms kernels up and compiles), or the first where it is the only one."""
    return statistics.median(times_ms[1:] if len(times_ms) > 1 else times_ms)


def gib_to_bytes(gib: float) -> int:
    """``8`` -> 8 GiB in bytes."""
    return int(round(gib * GIB))


class PlanConfig(BaseModel):
    """Everything `plan()` / `optimize()` needs besides the model and its batch."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    budget_bytes: int = Field(
        gt=0,
        description="Bytes the card (or slice) can give to tensors: weights, gradients, "
        "optimizer state, activations and temporaries. The CUDA context is not in it.",
    )
    objective: Objective = Field(
        "throughput",
        description="throughput: most samples/s; largest_batch: biggest micro-batch; "
        "effective_batch: reach `effective_batch` through accumulation at the fastest micro-batch.",
    )
    effective_batch: int | None = Field(
        None, gt=0, description="The batch the user trains with; required by effective_batch."
    )
    # 8%: the estimate models reserved bytes already; the margin covers what it can't, a step
    # or two of overshoot near the limit and non-monotone fits (docs/design.md, "Reserved
    # above allocated", "Fitting near the limit"). Probes confirm the batch on the device.
    # The planner uses it twice: the estimated peak stays under budget x (1 - margin), and the
    # picked batch stays the margin below the lowest batch a probe saw fail. At 8% an estimate
    # within one margin of the device costs 2 probes, within two margins 3 (tests/planner);
    # the estimate's stated accuracy is 5% median, 10% worst (on the simulated device the
    # examples' picks matched their measured peaks to 0.1%).
    margin_fraction: float = Field(
        0.08,
        ge=0.0,
        lt=0.5,
        description="Share of the budget the estimate keeps free before anything is measured "
        "(where the batch search starts); with measured_margin off, also what the pick keeps "
        "free. Passing it turns measured_margin off unless that is passed too.",
    )
    # On a card the limit moved by a few samples near the edge between fresh processes (a ViT
    # held batch 92 in one and failed at step 2 in another; docs/design.md), and the fixed 8%
    # left a CNN at 148 where 166 held: 0.89 of what the card allows.
    measured_margin: bool = Field(
        True,
        description="The pick is sized from its runs: the batch search extrapolates along "
        "the measured allocated bytes per sample to the batch that fills the budget, and the "
        "pick stays planner._prober.HEADROOM_FRACTION (3%) of the budget's worth of measured "
        "samples below the lowest batch that ran out. False keeps margin_fraction for the "
        "pick (the CLI's --margin).",
    )
    device: DeviceKind = Field(
        "auto",
        description="cuda, the CPU simulated device, auto, or estimate: no device at all, the "
        "model profiled under fake tensors and planned from the estimate alone.",
    )
    # On a card a run's fixed cost (a process, a CUDA context, the first step's kernel loading:
    # seconds, docs/design.md "A clean state per run") dwarfs its steps, so there every run
    # takes verify_steps steps and the pick's own run at the final batch is its verification;
    # where steps cost more than runs (the simulated CPU device) probes take
    # max(probe_steps, timing_steps) and the pick is verified by a run of its own.
    probe_steps: int = Field(
        3, ge=2, description="Steps per probe: one step overshoots near the limit."
    )
    verify_steps: int = Field(
        20,
        ge=1,
        description="Sustained steps that verify the pick (on a card every probe runs them).",
    )
    timing_steps: int = Field(3, ge=1, description="Steps timed per re-ranked candidate.")
    # 3: with the two guards (Baseline, +AMP) that is at most 5 timing runs; candidates under
    # 0.7x of the best's estimated samples/s are not timed.
    rerank_top: int = Field(
        3,
        ge=1,
        description="Best estimated candidates timed on the device, one run each at the "
        "estimate's largest batch; the device's best alone finishes its batch search.",
    )
    max_batch: int = Field(65536, gt=0, description="Largest batch size considered.")
    seed: int = Field(0, description="Seed of the search: the same profile gives the same plan.")
    strategies: list[str] | None = Field(
        None, description="Names of the strategies to use; None uses every registered one."
    )
    checks: ChecksPolicy = Field(
        "decide",
        description="decide: a choice whose check fails on the workload (precision's "
        "numerics: bf16 loss curve against fp32's) is not picked; report: it may be picked "
        "and the failed check is reported.",
    )
    options: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="Settings of individual strategies, keyed by strategy name; each strategy "
        "documents its own (the compile strategy: 'auto', 'off' or 'on').",
    )

    # The budget, the batch and every byte of the estimate are per rank when these are set:
    # each of world_size processes trains batch_size samples on a card of budget_bytes.
    world_size: int = Field(
        1, ge=1, description="Processes (one card each) that train together; 1: one card."
    )
    parallel: Parallel = Field(
        "none",
        description="How the ranks share the model: ddp (a full replica each), fsdp2 "
        "(torch.distributed.fsdp.fully_shard on the profile's blocks), auto (whichever of "
        "the two, and of FSDP2's resharding after forward or not, measures fastest where "
        "they fit), or none (one card).",
    )

    @property
    def may_shard(self) -> bool:
        """Whether a rank may hold a shard of the weights, gradients and optimizer state
        (FSDP2 is among the ways the ranks may share the model)."""
        return self.parallel in ("fsdp2", "auto")

    @model_validator(mode="after")
    def _parallel_given(self) -> PlanConfig:
        if self.world_size > 1 and self.parallel == "none":
            raise ValueError(
                "world_size > 1 needs parallel='ddp', 'fsdp2' or 'auto' (how the ranks share the "
                f"model), but got {self.world_size=} and {self.parallel=}."
            )
        return self

    @model_validator(mode="before")
    @classmethod
    def _a_given_margin_is_kept(cls, data: object) -> object:
        # A margin the user sets is theirs: the pick keeps it rather than a measured one.
        if isinstance(data, dict) and "margin_fraction" in data and "measured_margin" not in data:
            return {**data, "measured_margin": False}
        return data

    @model_validator(mode="after")
    def _effective_batch_given(self) -> PlanConfig:
        if self.objective == "effective_batch" and self.effective_batch is None:
            raise ValueError(
                "objective='effective_batch' needs effective_batch, the batch you train with; "
                f"but got {self.effective_batch=}."
            )
        return self

    @model_validator(mode="after")
    def _options_of_chosen_strategies(self) -> PlanConfig:
        chosen = self.strategies
        missing = [name for name in self.options if chosen is not None and name not in chosen]
        if missing:
            raise ValueError(
                f"options are given for strategies that are not in strategies: add "
                f"{missing[0]!r} to them or drop its option, but got {self.strategies=} and "
                f"{self.options=}."
            )
        return self

    def option(self, strategy: str, default: JsonValue = None) -> JsonValue:
        """The setting ``options`` gives ``strategy``, or ``default``."""
        return self.options.get(strategy, default)

    @property
    def usable_bytes(self) -> int:
        """The budget less the safety margin: what an estimated peak must stay under."""
        return int(self.budget_bytes * (1.0 - self.margin_fraction))
