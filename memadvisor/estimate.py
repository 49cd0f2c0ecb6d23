"""Peak bytes and step time of any candidate configuration, from a Profile alone.

Pure: no device, no torch ops, so the planner can score thousands of candidates a second.

How a candidate is estimated:
    1. :class:`StepModel` is built from the profile at the candidate's batch size
       (fp32 activations per block, outside the blocks, the phase peaks).
    2. Each strategy's ``effect()`` edits it through a few verbs (``use_precision``,
       ``checkpoint``, ``offload``, ``add_bytes``, ``add_ms``): strategies say *what* they
       change, the StepModel knows *how* memory adds up.
    3. :meth:`StepModel.result` walks the step's phases and returns an :class:`Estimate`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from memadvisor.profiler import Profile, StepProfile

if TYPE_CHECKING:
    from memadvisor.strategy import Strategy

__all__ = ["Candidate", "Estimate", "StepModel", "estimate"]

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


class StepModel:
    """The numbers of one candidate's step, edited by strategies, summed by :meth:`result`.

    A plain class with slots rather than a pydantic model: it lives for microseconds inside
    the search loop and never crosses a boundary.
    """

    __slots__ = (
        "batch_size",
        "accumulation_steps",
        "profile",
        "step",
        "precision",
        "block_activation_bytes",
        "block_input_bytes",
        "block_transient_bytes",
        "block_forward_ms",
        "checkpointed",
        "outside_activation_bytes",
        "offloaded_fraction",
        "extra_bytes",
        "extra_ms",
        "forward_ms",
        "backward_ms",
        "optimizer_ms",
    )

    def __init__(self, profile: Profile, batch_size: int, accumulation_steps: int = 1) -> None:
        self.profile = profile
        self.batch_size = batch_size
        self.accumulation_steps = accumulation_steps
        self.checkpointed: list[bool] = [False] * len(profile.blocks)
        self.offloaded_fraction = 0.0
        self.extra_bytes: dict[PeakPhase, int] = {"forward": 0, "backward": 0, "optimizer": 0}
        self.extra_ms = 0.0
        self.use_precision("fp32")

    # -- verbs strategies use ---------------------------------------------------------------

    def use_precision(self, precision: str) -> None:
        """Read activations and times from the profile's step in ``precision``."""
        step = self.profile.steps.get(precision) or self.profile.steps["fp32"]
        b = self.batch_size
        self.precision = precision
        self.step: StepProfile = step
        self.block_activation_bytes = [blk.activation.at(b) for blk in step.blocks]
        self.block_input_bytes = [blk.input.at(b) for blk in step.blocks]
        self.block_transient_bytes = [blk.forward_transient.at(b) for blk in step.blocks]
        self.block_forward_ms = [blk.forward_ms.at(b) for blk in step.blocks]
        self.outside_activation_bytes = max(
            0, step.activation_total.at(b) - sum(self.block_activation_bytes)
        )
        self.forward_ms = step.forward_ms.at(b)
        self.backward_ms = step.backward_ms.at(b)
        self.optimizer_ms = step.optimizer_ms

    def checkpoint(self, block_indices: Iterable[int]) -> None:
        """Recompute these blocks in backward instead of keeping their activations."""
        for i in block_indices:
            self.checkpointed[i] = True

    def offload(self, fraction: float, transfer_ms: float) -> None:
        """Keep ``fraction`` of the saved activations in host memory, at a time cost."""
        self.offloaded_fraction = min(1.0, max(0.0, fraction))
        self.extra_ms += transfer_ms

    def add_bytes(self, phase: PeakPhase, nbytes: int) -> None:
        """Extra bytes held through ``phase`` (a third-party strategy's own cost)."""
        self.extra_bytes[phase] += nbytes

    def add_ms(self, ms: float) -> None:
        """Extra time per micro-batch."""
        self.extra_ms += ms

    # -- summing up -------------------------------------------------------------------------

    def result(self) -> Estimate:
        """Walk forward, backward and the optimizer step; return the peak and the time."""
        p = self.profile
        weights = p.param_bytes + p.buffer_bytes
        state = p.optimizer_state_bytes
        kept = 0
        recompute_ms = 0.0
        largest_recompute = 0
        for i, ckpt in enumerate(self.checkpointed):
            if ckpt:
                kept += self.block_input_bytes[i]
                recompute_ms += self.block_forward_ms[i]
                largest_recompute = max(
                    largest_recompute,
                    self.block_activation_bytes[i] + self.block_transient_bytes[i],
                )
            else:
                kept += self.block_activation_bytes[i]
        activations = int((kept + self.outside_activation_bytes) * (1.0 - self.offloaded_fraction))
        cast = self.step.cast_weight_bytes
        forward_peak = weights + state + activations + cast + self.extra_bytes["forward"]
        # Backward: activations are freed as gradients grow; the worst case is modelled as the
        # start of backward plus one recomputed block (the largest) and the parameter grads.
        backward_peak = (
            weights
            + state
            + activations
            + largest_recompute
            + p.grad_bytes
            + self.extra_bytes["backward"]
        )
        optimizer_peak = weights + state + p.grad_bytes + self.extra_bytes["optimizer"]
        peaks: dict[PeakPhase, int] = {
            "forward": forward_peak,
            "backward": backward_peak,
            "optimizer": optimizer_peak,
        }
        peak_phase: PeakPhase = max(peaks, key=peaks.__getitem__)
        micro_ms = self.forward_ms + self.backward_ms + recompute_ms + self.extra_ms
        step_ms = micro_ms * self.accumulation_steps + self.optimizer_ms
        samples = self.batch_size * self.accumulation_steps
        return Estimate(
            peak_bytes=peaks[peak_phase] + p.fixed_overhead_bytes,
            peak_phase=peak_phase,
            breakdown={
                "params": weights,
                "grads": p.grad_bytes if peak_phase != "forward" else 0,
                "optimizer_state": state,
                "activations": activations if peak_phase != "optimizer" else 0,
                "temporaries": max(0, peaks[peak_phase] - weights - state - activations),
            },
            step_ms=step_ms,
            samples_per_s=samples / step_ms * 1000.0 if step_ms > 0 else float("inf"),
        )


def estimate(
    profile: Profile, candidate: Candidate, strategies: Sequence[Strategy] = ()
) -> Estimate:
    """The estimated peak and step time of ``candidate``.

    Args:
        profile: what the profiler measured.
        candidate: the batch size and each strategy's choice.
        strategies: the strategies whose choices the candidate holds; a strategy whose name is
            not in ``candidate.choices`` is off and not asked.
    """
    model = StepModel(profile, candidate.batch_size, candidate.accumulation_steps)
    # Precision first: it decides which measured step the others edit.
    for strategy in sorted(strategies, key=lambda s: s.effect_order):
        choice = candidate.choices.get(strategy.name)
        if choice is not None:
            strategy.effect(profile, choice, model)
    return model.result()
