"""Peak bytes and step time of any candidate configuration, from a Profile alone.

Pure: no device, no torch ops, so the planner can score thousands of candidates a second
(``python bench/estimate_speed.py`` prints how many).

How a candidate is estimated:
    1. :class:`StepModel` reads the profile's step in fp32 at the candidate's batch size
       (every size that grows with the batch is a line, ``per_sample * b + constant``).
    2. Each strategy's ``effect()`` edits it through a few verbs (``use_precision``,
       ``checkpoint``, ``offload``, ``add_bytes``, ``add_ms``): strategies say *what* they
       change, the StepModel knows *how* memory adds up.
    3. :meth:`StepModel.result` walks the step and returns an :class:`Estimate`.

The walk. The profiler measured one step with no block checkpointed: the live bytes at the
end of forward, the peak of forward (the loss included) and of the optimizer step, and the
backward *block by block*: where the live bytes stand when each block's backward begins
and how high they go until the next one begins (gradients grow as activations are freed),
and the head's peak before the first block. A candidate moves that walk:

* A checkpointed block keeps, after forward, only its outputs that something outside it
  saved (``output_kept``: the successor's input; all of its outputs when the successor is
  checkpointed too). What it frees (``s_k``: its saved activations and autocast's weight
  copies, less what it keeps) is missing from every moment until its own backward, so
  block ``k``'s backward runs ``sum(s_j for checkpointed j < k)`` lower.
* During its own backward a checkpointed block first recomputes its forward: its
  activations come back, one block at a time, topped by its forward transient, from the
  level where its backward begins: ``start_k - D_k + transient_k``.
* Forward holds everything but what checkpointed blocks freed (autocast's weight copies
  stay cached until the forward ends); the optimizer step (AdamW's state, its foreach or
  per-tensor temporaries, first-step state creation: measured as a steady step after a
  warm-up) does not depend on the blocks.
* Precision reads a different measured step (autocast: halved activations where the op
  runs low, fp32 weights plus their low-precision copies during forward).
* Gradient accumulation holds the gradients through the next micro-batches' forward and
  backward.

Each piece was checked against :class:`~memadvisor.device.simulated.SimulatedDevice`'s
measured peak over checkpointing, precision and batch size (``tests/test_estimate.py``).
Profiles without the walk (hand-built, older) fall back to a walk derived from per-block
activations and parameter bytes, less exact.

Known limitations (what a card adds that tensor bytes do not show; DESIGN.md, measured on
an H200 with torch 2.11):
    * cuBLAS workspaces: 2 x 32 MiB (one per thread that runs matmuls: the main thread and
      autograd's) + 1 MiB cuBLASLt, held from the first matmul on. The CUDA profiler
      measures and adds them (``Profile.fixed_overhead_bytes``); fake-tensor profiles
      planned for CUDA add the measured total (``memadvisor.device.fake``).
    * Allocator rounding: blocks are rounded up to 512 bytes (small) or 2 MiB segments:
      4-12 MiB at the peak on a 6-block GPT; in ``fixed_overhead_bytes`` on CUDA.
    * Fragmentation: the caching allocator *reserved* 3-32% more than it had allocated at
      the peak, and a memory fraction caps reserved bytes. :attr:`Estimate.peak_bytes` is
      allocated bytes; :attr:`Estimate.reserved_peak_bytes` scales it by the profile's
      measured ratio where there is one. The planner's margin and OOM probing cover it.
    * The CUDA context (~500 MiB) is outside both, as it is outside the budget.
    * A checkpointed block whose input no op of its own saved keeps that input in
      addition (rare: most blocks start with a norm or a matmul, which save it).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from memadvisor.profiler import LinearBytes, Profile, StepProfile

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
    peak_at: str = Field(
        "",
        description="The moment of the peak: 'forward', 'backward: head', 'backward: <block>' "
        "(its backward, or its recompute), or 'optimizer'.",
    )
    reserved_peak_bytes: int | None = Field(
        None,
        description="peak_bytes scaled by the profile's measured reserved/allocated ratio "
        "(CUDA); None where the profile has none.",
    )


def _line(value: LinearBytes | None) -> tuple[float, float] | None:
    return None if value is None else (value.per_sample_bytes, value.constant_bytes)


class _Lines:
    """One measured step's numbers as ``(per_sample, constant)`` pairs, read once per step.

    Reading pydantic fields costs more than the arithmetic; the search estimates the same
    profile thousands of times, so each step's lines are extracted once and cached.
    """

    __slots__ = (
        "activation",
        "inputs",
        "outputs",
        "transient",
        "forward_ms",
        "output_kept",
        "cast",
        "start",
        "peak",
        "walk",
        "activation_total",
        "end_of_forward",
        "head_peak",
        "phases",
        "step_forward_ms",
        "step_backward_ms",
    )

    def __init__(self, step: StepProfile) -> None:
        blocks = step.blocks
        self.activation = [_line(b.activation) for b in blocks]
        self.inputs = [_line(b.input) for b in blocks]
        self.outputs = [_line(b.output) for b in blocks]
        self.transient = [_line(b.forward_transient) for b in blocks]
        self.forward_ms = [(b.forward_ms.per_sample_ms, b.forward_ms.constant_ms) for b in blocks]
        self.output_kept = [_line(b.output_kept) for b in blocks]
        self.cast = [b.cast_weight_bytes for b in blocks]
        self.start = [_line(b.backward_start) for b in blocks]
        self.peak = [_line(b.backward_peak) for b in blocks]
        self.activation_total = _line(step.activation_total)
        self.end_of_forward = _line(step.end_of_forward)
        self.head_peak = _line(step.backward_head_peak)
        self.walk = (
            self.end_of_forward is not None
            and self.head_peak is not None
            and all(x is not None for x in (*self.start, *self.peak, *self.output_kept))
        )
        self.phases = {p.phase: _line(p.allocated) for p in step.phases}
        self.step_forward_ms = (step.forward_ms.per_sample_ms, step.forward_ms.constant_ms)
        self.step_backward_ms = (step.backward_ms.per_sample_ms, step.backward_ms.constant_ms)


_CACHE: dict[int, tuple[StepProfile, _Lines]] = {}
_CACHE_SIZE = 64


def _lines(step: StepProfile) -> _Lines:
    # Keyed by identity; the entry holds the step itself, so its id cannot be reused while
    # cached. A profile edited in place after being estimated is not noticed.
    hit = _CACHE.get(id(step))
    if hit is not None and hit[0] is step:
        return hit[1]
    if len(_CACHE) >= _CACHE_SIZE:
        _CACHE.pop(next(iter(_CACHE)))
    lines = _Lines(step)
    _CACHE[id(step)] = (step, lines)
    return lines


def _at(line: tuple[float, float] | None, b: int) -> int:
    """A line at batch ``b``, signed (walk levels are differences); 0 when unmeasured."""
    return 0 if line is None else int(round(line[0] * b + line[1]))


def _pos(line: tuple[float, float] | None, b: int) -> int:
    return max(0, _at(line, b))


class StepModel:
    """The numbers of one candidate's step, edited by strategies, summed by :meth:`result`.

    A plain class with slots rather than a pydantic model: it lives for microseconds inside
    the search loop and never crosses a boundary. Strategies read the per-block lists
    (``block_activation_bytes``...) and edit through the verbs.
    """

    __slots__ = (
        "batch_size",
        "accumulation_steps",
        "profile",
        "step",
        "precision",
        "lines",
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
        lines = _lines(step)
        b = self.batch_size
        self.precision = precision
        self.step = step
        self.lines = lines
        self.block_activation_bytes = [_pos(x, b) for x in lines.activation]
        self.block_input_bytes = [_pos(x, b) for x in lines.inputs]
        self.block_transient_bytes = [_pos(x, b) for x in lines.transient]
        self.block_forward_ms = [max(0.0, a * b + c) for a, c in lines.forward_ms]
        self.outside_activation_bytes = max(
            0, _pos(lines.activation_total, b) - sum(self.block_activation_bytes)
        )
        self.forward_ms = max(0.0, lines.step_forward_ms[0] * b + lines.step_forward_ms[1])
        self.backward_ms = max(0.0, lines.step_backward_ms[0] * b + lines.step_backward_ms[1])
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

    def _kept(self, k: int) -> int:
        """What block ``k`` still holds after forward when it is checkpointed."""
        lines, b, n = self.lines, self.batch_size, len(self.checkpointed)
        if k + 1 < n and self.checkpointed[k + 1]:
            # The successor's checkpoint holds its inputs: all of k's outputs stay.
            return _pos(lines.outputs[k], b) or self.block_input_bytes[k + 1]
        if lines.output_kept[k] is not None:
            return _pos(lines.output_kept[k], b)
        # Unmeasured: assume the successor (or the head) saves what k returns.
        out = _pos(lines.outputs[k], b)
        if out:
            return out
        return self.block_input_bytes[k + 1] if k + 1 < n else self.block_input_bytes[k]

    def _cast(self, k: int) -> int:
        cast = self.lines.cast[k]
        if cast or not self.step.cast_weight_bytes:
            return cast
        # Unmeasured per block: the step's copies shared out by parameter bytes.
        params = self.profile.param_bytes or 1
        return self.step.cast_weight_bytes * self.profile.blocks[k].param_bytes // params

    def result(self) -> Estimate:
        """Walk forward, backward and the optimizer step; return the peak and the time."""
        p, b, lines = self.profile, self.batch_size, self.lines
        n = len(self.checkpointed)
        act = self.block_activation_bytes
        weights = p.param_bytes + p.buffer_bytes
        state, grads = p.optimizer_state_bytes, p.grad_bytes
        # Held through every micro-batch after the first when gradients accumulate.
        held_grads = grads if self.accumulation_steps > 1 else 0

        # What each checkpointed block frees from the end of its forward to its backward.
        freed = [0] * n
        freed_activations = 0
        recompute_ms = 0.0
        for k in range(n):
            if self.checkpointed[k]:
                kept = self._kept(k)
                freed[k] = max(0, act[k] + self._cast(k) - kept)
                freed_activations += max(0, act[k] - kept)
                recompute_ms += self.block_forward_ms[k]
        freed_total = sum(freed)
        activations = max(0, _pos(lines.activation_total, b) - freed_activations)
        offloaded = int(activations * self.offloaded_fraction)

        if lines.walk:
            eof = _at(lines.end_of_forward, b)
            head = _at(lines.head_peak, b)
            starts = [_at(x, b) for x in lines.start]
            peaks = [_at(x, b) for x in lines.peak]
        else:
            eof, head, starts, peaks = self._derived_walk(weights + state)
        # Fixed costs (cuBLAS workspaces, rounding) come on top of tracked tensor bytes; a
        # CUDA profile's phase peaks were read from the allocator and hold them already.
        overhead = p.fixed_overhead_bytes
        phase_overhead = 0 if p.device.kind == "cuda" else overhead
        forward_line = lines.phases.get("forward")
        forward_peak = (
            _at(forward_line, b) + phase_overhead if forward_line is not None else eof + overhead
        )
        optimizer_line = lines.phases.get("optimizer")
        optimizer_peak = (
            _at(optimizer_line, b) + phase_overhead
            if optimizer_line is not None
            else weights + state + grads + self._optimizer_temporaries() + overhead
        )

        moments: dict[str, tuple[PeakPhase, int]] = {}
        moments["forward"] = (
            "forward",
            forward_peak - freed_activations - offloaded + held_grads + self.extra_bytes["forward"],
        )
        eof += overhead
        extra_backward = held_grads + self.extra_bytes["backward"]
        moments["backward: head"] = (
            "backward",
            eof + head - freed_total - offloaded + extra_backward,
        )
        below = freed_total  # freed by checkpointed blocks whose backward has not run yet
        for k in range(n - 1, -1, -1):
            below -= freed[k]
            level = eof + peaks[k] - below
            if self.checkpointed[k]:
                level = max(level, eof + starts[k] - below + self.block_transient_bytes[k])
            # Offloaded activations of blocks not yet reached stay on the host.
            level -= int(self.offloaded_fraction * sum(act[:k]))
            moments[f"backward: {p.blocks[k].name}"] = ("backward", level + extra_backward)
        moments["optimizer"] = ("optimizer", optimizer_peak + self.extra_bytes["optimizer"])

        peak_at = max(moments, key=lambda m: moments[m][1])
        peak_phase, peak = moments[peak_at]

        micro_ms = self.forward_ms + self.backward_ms + recompute_ms + self.extra_ms
        step_ms = micro_ms * self.accumulation_steps + self.optimizer_ms
        samples = b * self.accumulation_steps
        held_activations = 0 if peak_phase == "optimizer" else activations - offloaded
        held_grad_bytes = grads if peak_phase == "optimizer" else held_grads
        known = weights + state + held_grad_bytes + held_activations
        return Estimate(
            peak_bytes=peak,
            peak_phase=peak_phase,
            peak_at=peak_at,
            breakdown={
                "params": weights,
                "grads": held_grad_bytes,
                "optimizer_state": state,
                "activations": held_activations,
                "temporaries": max(0, peak - known),
            },
            step_ms=step_ms,
            samples_per_s=samples / step_ms * 1000.0 if step_ms > 0 else float("inf"),
            reserved_peak_bytes=(
                int(peak * p.fragmentation_ratio) if p.fragmentation_ratio else None
            ),
        )

    def _optimizer_temporaries(self) -> int:
        # Unmeasured: AdamW's foreach step holds one temporary per parameter (sqrt of the
        # second moment), the default on CUDA; a CPU profile always has the phase measured.
        return self.profile.param_bytes if self.profile.optimizer_state_bytes else 0

    def _derived_walk(self, static: int) -> tuple[int, int, list[int], list[int]]:
        """The walk from per-block bytes, for a profile that did not measure it.

        End of forward: weights, state and everything saved. The head's transient is what
        the measured backward peak adds (the gradient of the logits, for an LM), else one
        output's worth. Block k's backward begins with later blocks' activations freed and
        their gradients made, plus the gradient of k's output; it peaks one output higher.
        """
        p, b, lines = self.profile, self.batch_size, self.lines
        n = len(self.checkpointed)
        act = self.block_activation_bytes
        eof = static + _pos(lines.activation_total, b) + self.step.cast_weight_bytes
        backward_line = lines.phases.get("backward")
        outs = [_pos(lines.outputs[k], b) or self.block_input_bytes[k] for k in range(n)]
        last_out = outs[-1] if n else 0
        head = _at(backward_line, b) - eof if backward_line is not None else last_out
        ratio = p.grad_bytes / p.param_bytes if p.param_bytes else 0.0
        starts, peaks = [0] * n, [0] * n
        level = 0
        for k in range(n - 1, -1, -1):
            starts[k] = level + outs[k]
            peaks[k] = starts[k] + max(outs[k], self.block_transient_bytes[k])
            level += int(p.blocks[k].param_bytes * ratio) - act[k] - self._cast(k)
        return eof, head, starts, peaks


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
