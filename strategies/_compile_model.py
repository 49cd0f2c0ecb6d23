"""The compiled step's memory and time as lines in the batch, learned from a few device runs.

The eager profile does not predict a compiled step: inductor fuses intermediates away (the
fp32 logits a decoder's loss holds, which eager checkpointing cannot free) and its
partitioner chooses what backward keeps. So the compile stage learns each compiled
configuration (checkpointed set, precision, form of compile) from its own runs, and ranks
the configurations and picks their batch by what it learned (:class:`StepFit`):

* Two or more runs that fitted, at different batches: least-squares lines through them,
  ``peak(b) = fixed + per_sample * b`` and ``step_ms(b) = fixed_ms + per_sample_ms * b``.
* One run: the eager estimate's lines for the same choices, their batch-dependent part scaled
  by what the run measured against the estimate at its batch. The fixed bytes stay eager's
  (weights, gradients, optimizer state: compiling changes none of them), so the bytes line
  passes through the run and its per-sample bytes are eager's times the ratio of the
  batch-dependent bytes (``bytes_ratio``, 0.7: the compiled step keeps 70% of what eager
  keeps per sample). The time line goes from zero through the run: the rate measured there
  is the rate predicted at every batch (``time_ratio`` records the run's step over eager's
  estimate at its batch). Eager's time line comes from the profile's small batches, where a
  step is launch-bound, so scaled to a run at hundreds of samples it read as nearly all
  fixed time and promised a rate rising with the batch that the card did not give: on an
  H100 (session 19) hf_gpt2's two-block checkpointed candidate, one run at 726 (56,356
  samples/s), was promised 81,223 at 1050, won the search on that line and was confirmed
  there for 61 s, beaten by a candidate already measured at 76,810; the partitioner-budget
  candidate of lm350m (session 16) was promised 133.4 at 14 from one run at 10 and found
  118.2. A second run gives the time line its slope.

The largest batch a line keeps within the limit, and the throughput the time line gives
there, rank the configurations; the batch search then confirms the winner from that batch.

Known limitations:
    * Lines: a step whose peak moves from one phase to another between the runs' batches
      (the optimizer's at small batches, backward's at large) bends, and a line through runs
      on both sides of the bend is off at either end. Runs near the batch the line predicts
      (the search's second run is there) keep that error small where it matters.
    * One run: a fixed workspace the compiled step holds (inductor's, a CUDA graph pool)
      reads as per-sample bytes, so the line is steeper than the step's and the predicted
      batch smaller than it could be (safe, not best); the second run corrects it.
    * One run: a step that is still launch-bound at the run's batch gains samples/s at a
      larger one, which the line from zero does not predict (short, not over): the
      candidate's second run, at its predicted batch, measures it.
    * The largest allocation that bounds a prediction at the cap (``cap_bytes``) is eager's
      estimate: a whole-model compile that fuses that tensor away (a loss's logits) is then
      predicted short of its edge, and its confirmation's upward search finds the rest
      where it is the winner (where it is not, its capped line may be why). Two runs'
      reserved peaks replace it where they draw a bound (:func:`fit_step`); one run's do
      not: one run's line is eager's shape scaled, and the GPT example's one pass-1 run
      (151) said 301 where 302 ran out.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import JsonValue

from memadvisor.estimate import estimate
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.plan import StepFit
from memadvisor.schema.profile import Profile
from memadvisor.strategy import Strategy

__all__ = ["EagerLines", "Line", "fit_step", "predicted", "samples_per_s"]


@dataclass(frozen=True)
class Line:
    """``fixed + per_sample * b``."""

    fixed: float
    per_sample: float

    def at(self, batch: float) -> float:
        return self.fixed + self.per_sample * batch

    @classmethod
    def through(cls, points: Sequence[tuple[float, float]]) -> Line | None:
        """The least-squares line through ``points`` (batch, value); None with fewer than two
        distinct batches."""
        xs = [x for x, _ in points]
        if len(set(xs)) < 2:
            return None
        n = len(points)
        mean_x, mean_y = sum(xs) / n, sum(y for _, y in points) / n
        sxx = sum((x - mean_x) ** 2 for x in xs)
        sxy = sum((x - mean_x) * (y - mean_y) for x, y in points)
        slope = sxy / sxx
        return cls(fixed=mean_y - slope * mean_x, per_sample=slope)


@dataclass(frozen=True)
class EagerLines:
    """The eager estimate's peak bytes and step time for some choices, as lines taken between
    ``batch`` and twice it (the estimate is convex in the batch: the slope above a run); and
    its largest allocation (reserved peak less peak: the block the allocator must find free
    at the cap), where the estimate has one."""

    bytes: Line
    ms: Line
    largest_allocation: Line | None = None

    @classmethod
    def of(
        cls,
        profile: Profile,
        choices: dict[str, JsonValue],
        strategies: Sequence[Strategy],
        batch: int,
    ) -> EagerLines:
        low, high = max(1, batch), 2 * max(1, batch)
        at = {
            b: estimate(profile, Candidate(batch_size=b, choices=choices), strategies)
            for b in (low, high)
        }
        bytes_line = Line.through([(b, e.peak_bytes) for b, e in at.items()])
        ms_line = Line.through([(b, e.step_ms) for b, e in at.items()])
        assert bytes_line is not None and ms_line is not None  # two distinct batches
        largest = None
        if all(e.reserved_peak_bytes is not None for e in at.values()):
            largest = Line.through(
                [(b, max(0, (e.reserved_peak_bytes or 0) - e.peak_bytes)) for b, e in at.items()]
            )
            if largest is not None and largest.per_sample < 0:
                largest = Line(fixed=largest.at(high), per_sample=0.0)  # never below the top's
        return cls(bytes=bytes_line, ms=ms_line, largest_allocation=largest)


def fit_step(
    runs: Mapping[int, tuple[int, float]],
    eager: EagerLines,
    *,
    limit_bytes: int,
    max_batch: int,
    lowest_failure: int | None = None,
    below_failure: int | None = None,
    cap_bytes: int | None = None,
    reserved: Mapping[int, int] | None = None,
) -> StepFit | None:
    """The lines of a configuration from its ``runs`` (batch -> (held bytes, step ms)) that
    fitted, and what they predict under ``limit_bytes``; None without a run.

    Args:
        runs: the configuration's runs that fitted, by batch.
        eager: the eager estimate's lines for the same choices (used with one run, or where
            two runs give no rising line).
        limit_bytes: the most a pick's peak may be.
        max_batch: no batch above this is predicted.
        lowest_failure: the lowest batch of the configuration that ran out of memory.
        below_failure: the largest batch a pick may take under ``lowest_failure`` (the
            plan's margin below a failure); default the batch under it. A line that puts
            the edge past a batch that ran out is off near the edge (the allocator's
            fragmentation is not in it): a batch one under the failure mostly ran out too
            (gpt, hf_gpt2 and lm350m on a card, docs/design.md).
        cap_bytes: the memory cap (the budget). Where ``eager`` has the step's largest
            allocation, no batch is predicted at which the bytes line plus that allocation
            passes the cap (``cap_batch``): the allocator needs that block free whatever the
            line says is allocated. The GPT example's compiled form on a card held 6.91 GB
            allocated and 8.45 GB reserved at batch 250 under 8 GiB; its line put the edge at
            294-302, and 255-302 all ran out trying to allocate its 1.5 GiB logits
            (docs/design.md, "Five things the card showed (session 13)"). The cap never
            predicts below a batch of ``runs`` whose held bytes stayed within
            ``limit_bytes``: under expandable segments the same form fitted at 302 and the
            cap said 252, and the search dropped compile on that (docs/design.md, "The
            allocator is part of the plan"). A run that fitted only by the allocator
            retrying in most steps is not among ``runs``: it ran out
            (``AllocatorRetriesError``; the GPT example's at 302 did, 2.3x slower a step
            than at 250, docs/design.md, session 22). Not drawn where two or more runs
            give a rising line and their reserved peaks draw the ``reserved`` bound: that
            bound measures what the allocator keeps beyond the allocated bytes, which the
            block guesses at. hf_gpt2's compiled form without checkpointing on an H200
            (every plan of sessions 38-40) held 6.44 GB allocated and 6.52 GB reserved at
            1020 under expandable segments; eager's 2 MiB a sample of logits capped it at
            1020 where the line said 1323, and its hand cell held 1339 and ran 135,000
            samples/s, 1.04x the plan's pick (docs/design.md, session 41).
        reserved: the reserved peaks of ``runs`` that recorded one, by batch (a card's runs;
            only beside allocated ``runs``, the measured margin's). No batch is predicted at
            which a line through them passes ``limit_bytes`` (``reserved_batch``): least
            squares through two or more, else from the bytes line's fixed bytes through the
            largest. The reserved bytes run ahead of the allocated ones by what the
            allocator's segments keep unused, and that gap grows with the batch where the
            step fragments them: t5_base's compiled candidates on an H200 (session 35 call 2)
            held 24 blocks checkpointed at 6.28 GB allocated, 6.72 GB reserved at 36 and
            7.85 / 8.48 at 55, and ran out at 58 (the allocated line's pass-2 batch) by the
            allocator's retries; 21 blocks held 7.23 / 8.14 at 36 (the allocated line said
            44, 39 ran out in session 34). Through those runs' reserved bytes the line says
            53 and 37. As the cap, it never predicts below a batch of ``runs`` whose held
            bytes stayed within ``limit_bytes``; and no bound is drawn where a run's reserved
            peak reached ``limit_bytes`` (it may be the memory cap's, which a card's reserved
            peak stops at while the allocated one still grows).
    """
    if not runs:
        return None
    points = sorted(runs.items())
    memory = Line.through([(b, held) for b, (held, _) in points])
    time = Line.through([(b, ms) for b, (_, ms) in points])
    top_batch, (top_bytes, top_ms) = points[-1]
    bytes_ratio = time_ratio = None
    basis = "fitted"
    if memory is None or memory.per_sample <= 0:
        memory, bytes_ratio = _scaled_bytes(top_batch, top_bytes, eager.bytes)
        basis = "scaled"
    if time is None or time.per_sample <= 0:
        time, time_ratio = _scaled_ms(top_batch, top_ms, eager.ms)
    largest = predicted(memory, limit_bytes, max_batch, lowest_failure)
    # A batch of these runs that fitted within the limit is measured: a bound, a prediction,
    # never goes below it.
    held_fit = max((b for b, (held, _) in points if held <= limit_bytes), default=0)
    if lowest_failure is not None and below_failure is not None:
        largest = max(0, min(largest, below_failure))
    cap_batch = None
    spare = eager.largest_allocation
    bound = _reserved_bound(points, memory, reserved or {}, limit_bytes, max_batch, lowest_failure)
    # Two runs' reserved peaks measure what the allocator keeps beyond the allocated bytes,
    # the block eager's largest allocation guesses at: where they draw a bound, it stands
    # for the guess (fit_step's ``cap_bytes``).
    strand_measured = bound is not None and basis == "fitted"
    if cap_bytes is not None and spare is not None and not strand_measured:
        with_block = Line(memory.fixed + spare.fixed, memory.per_sample + spare.per_sample)
        capped = max(predicted(with_block, cap_bytes, max_batch, lowest_failure), held_fit)
        if capped < largest:
            cap_batch = largest = capped
    reserved_batch = None
    if bound is not None:
        bound = max(bound, held_fit)
        if bound < largest:
            reserved_batch = largest = bound
    return StepFit(
        fixed_bytes=round(memory.fixed),
        per_sample_bytes=round(memory.per_sample),
        fixed_ms=time.fixed,
        per_sample_ms=time.per_sample,
        batches=[b for b, _ in points],
        basis=basis,
        bytes_ratio=bytes_ratio,
        time_ratio=time_ratio,
        lowest_failure=lowest_failure,
        limit_bytes=limit_bytes,
        cap_batch=cap_batch,
        reserved_batch=reserved_batch,
        largest_batch=largest,
        samples_per_s=samples_per_s(time, largest),
    )


def _reserved_bound(
    points: Sequence[tuple[int, tuple[int, float]]],
    memory: Line,
    reserved: Mapping[int, int],
    limit_bytes: int,
    max_batch: int,
    lowest_failure: int | None,
) -> int | None:
    """The largest batch a line through the runs' ``reserved`` peaks keeps within
    ``limit_bytes`` (:func:`fit_step`'s ``reserved``, which keeps it no lower than a run
    whose held bytes stayed within the limit); None where no run recorded a reserved peak,
    or one reached the limit."""
    batches = {b for b, _ in points}
    dots = sorted((b, r) for b, r in reserved.items() if b in batches)
    if not dots or any(r >= limit_bytes for _, r in dots):
        # At the limit a reserved peak may be the memory cap's, not the step's: a card's
        # reserved peak stops growing where it meets the cap (the allocator frees its cache
        # and retries), so such a run says nothing of how the reserved bytes grow.
        return None
    line = Line.through(dots)
    if line is None or line.per_sample <= 0:
        top, top_reserved = dots[-1]
        above = top_reserved - memory.fixed
        line = (
            Line(fixed=memory.fixed, per_sample=above / top)
            if above > 0
            else Line(fixed=0.0, per_sample=top_reserved / top)
        )
    return predicted(line, limit_bytes, max_batch, lowest_failure)


def predicted(memory: Line, limit_bytes: int, max_batch: int, lowest_failure: int | None) -> int:
    """The largest batch whose peak on ``memory`` stays within ``limit_bytes``, at most
    ``max_batch`` and below ``lowest_failure``; 0 when not even one sample does."""
    if memory.per_sample <= 0:
        largest = max_batch if memory.fixed <= limit_bytes else 0
    else:
        largest = math.floor((limit_bytes - memory.fixed) / memory.per_sample)
    if lowest_failure is not None:
        largest = min(largest, lowest_failure - 1)
    return max(0, min(largest, max_batch))


def samples_per_s(time: Line, batch: int) -> float:
    """Throughput on the time line at ``batch`` (0 for no batch or no time)."""
    step_ms = time.at(batch)
    return batch / step_ms * 1e3 if batch > 0 and step_ms > 0 else 0.0


def _scaled_bytes(batch: int, held: int, eager: Line) -> tuple[Line, float | None]:
    """Eager's fixed bytes, and its per-sample bytes scaled so the line meets the run; where
    the estimate leaves no batch-dependent bytes to scale (or the run holds less than eager's
    fixed bytes), the line from zero through the run (ratio None)."""
    eager_part = eager.per_sample * batch
    ratio = (held - eager.fixed) / eager_part if eager_part > 0 else 0.0
    if ratio <= 0:
        return Line(fixed=0.0, per_sample=held / batch), None
    return Line(fixed=eager.fixed, per_sample=ratio * eager.per_sample), ratio


def _scaled_ms(batch: int, step_ms: float, eager: Line) -> tuple[Line, float | None]:
    """The time line from zero through the run (its rate held at every batch), and the
    run's step over eager's estimate at its batch (None where the estimate has no time).
    Not eager's line scaled: see the module docstring, "One run"."""
    eager_ms = eager.at(batch)
    ratio = step_ms / eager_ms if eager_ms > 0 else None
    return Line(fixed=0.0, per_sample=step_ms / batch), ratio
