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
  level where its backward begins: ``start_k - D_k + transient_k`` (the transient less
  autocast's weight copies, which ``s_k`` brings back already).
* Forward peaks at the loss, everything but what checkpointed blocks freed held, or as
  the model's forward ends, where autocast still caches the checkpointed blocks' weight
  copies. The optimizer step (AdamW's state, its foreach or per-tensor temporaries,
  first-step state creation: measured as a steady step after a warm-up) does not depend
  on the blocks.
* Precision reads a different measured step (autocast: halved activations where the op
  runs low, fp32 weights plus their low-precision copies during forward).
* A step without autocast's weight copies (FSDP2 gathers its units in the low dtype:
  ``drop_weight_copies``) loses each copy once, where the walk held it: all of them in
  forward and at the head, blocks ``0..k``'s while block ``k``'s backward runs; a
  checkpointed block then frees (and recomputes) its activations alone.
* A step whose blocks' inputs arrive cast to 2 bytes (FSDP2 casts each unit's floating
  inputs to its bf16 ``param_dtype``: ``cast_block_inputs``) keeps, for a checkpointed
  block, ``input_low`` of its input where the profile's step kept ``input`` (fp32 where the
  residual stream followed fp32 weights under autocast): the difference comes off what the
  predecessor keeps for it when that is checkpointed, else off what the block frees.
* Gradient accumulation holds the gradients through the next micro-batches' forward and
  backward.

Each piece was checked against :class:`~memadvisor.device.simulated.SimulatedDevice`'s
measured peak over checkpointing, precision and batch size (``tests/test_estimate.py``).
Profiles without the walk (hand-built, older) fall back to a walk derived from per-block
activations and parameter bytes, less exact.

Known limitations (what a card adds that tensor bytes do not show; the measurements are in
``docs/design.md``):
    * cuBLAS workspaces and the allocator's rounding ("What a card holds beyond tensors"):
      the CUDA profiler measures and adds them (``Profile.fixed_overhead_bytes``);
      fake-tensor profiles planned for CUDA add the measured total
      (``memadvisor.device.fake``).
    * cuDNN's convolution workspaces ("cuDNN's workspaces grow with the batch"): invisible
      to a dispatch mode and growing with the batch past some tensor size. The CUDA
      profiler fits them per phase at two larger sizes (``StepProfile.untracked``) and the
      estimate adds what the line gives beyond what the fixed overhead and the phase peaks
      hold. Below the size where the growth starts the line is above the truth (safe, but
      it costs batch on small budgets); where checkpointing changes cuDNN's choice it is
      under; fake-tensor profiles planned for a card have no lines.
    * Fragmentation ("Reserved above allocated"): a memory fraction caps reserved bytes.
      :attr:`Estimate.peak_bytes` is allocated bytes; :attr:`Estimate.reserved_peak_bytes`
      adds the step's largest single allocation (``StepProfile.largest_allocation``), which a
      capped allocator can strand for the next step; without that line it scales by the
      small-batch reserved/allocated ratio. The planner fits :attr:`Estimate.limit_bytes`,
      the larger of the two. Where nothing gets stranded the line errs high by up to one
      largest tensor; the planner's extrapolation from a measured run takes that back.
    * The CUDA context is outside both, as it is outside the budget.
    * A checkpointed block whose input no op of its own saved keeps that input in
      addition (rare: most blocks start with a norm or a matmul, which save it).
    * ``cast_block_inputs`` changes what checkpointed blocks keep, nothing else: what the
      blocks' ops save and what a recompute brings back stay the profiled step's (fp32
      weights under autocast), high under FSDP2's bf16 weights; where a cast input's
      maker is not a checkpointed block (block 0: the embedding), the walk still counts it
      whole at that block's own backward. An fp32 input every block shares (a mask) is no
      block's input (counted once, to its maker), though each unit casts, and a
      checkpointed one keeps, a bf16 copy of its own: low by those copies. The 1B at 2
      ranks (docs/design.md, issue 31): 10.997 GiB predicted before, 10.318 now, 10.3125
      measured.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from pydantic import JsonValue

from memadvisor.schema.candidate import Candidate, Estimate, PeakPhase
from memadvisor.schema.config import samples_per_s
from memadvisor.schema.profile import LinearBytes, Profile, StepProfile

__all__ = ["Effect", "StepModel", "estimate"]


class Effect(Protocol):
    """What the estimate asks of a strategy: its name, its order, and its effect on a step.

    :class:`memadvisor.strategy.Strategy` is one; the estimate names only this much of it,
    so that it stays below the strategy contract (which builds on :class:`StepModel`).
    """

    name: str
    effect_order: int

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None: ...


def _line(value: LinearBytes | None) -> tuple[float, float] | None:
    return None if value is None else (value.per_sample_bytes, value.constant_bytes)


def _at(line: tuple[float, float] | None, b: int) -> int:
    """A line at batch ``b``, signed (walk levels are differences); 0 when unmeasured."""
    return 0 if line is None else int(round(line[0] * b + line[1]))


def _pos(line: tuple[float, float] | None, b: int) -> int:
    return max(0, _at(line, b))


class _AtBatch:
    """One measured step's numbers at one batch size (what :class:`StepModel` starts from)."""

    __slots__ = (
        "activation",
        "inputs",
        "inputs_low",
        "outputs",
        "transient",
        "forward_ms",
        "output_kept",
        "start",
        "peak",
        "activation_total",
        "end_of_forward",
        "head_peak",
        "phases",
        "step_forward_ms",
        "step_backward_ms",
        "untracked",
        "largest_allocation",
        "largest_block_allocation",
    )

    def __init__(self, lines: _Lines, b: int) -> None:
        self.activation = [_pos(x, b) for x in lines.activation]
        self.inputs = [_pos(x, b) for x in lines.inputs]
        self.inputs_low = [None if x is None else _pos(x, b) for x in lines.inputs_low]
        self.outputs = [_pos(x, b) for x in lines.outputs]
        self.transient = [_pos(x, b) for x in lines.transient]
        self.forward_ms = [max(0.0, a * b + c) for a, c in lines.forward_ms]
        self.output_kept = [None if x is None else _pos(x, b) for x in lines.output_kept]
        self.start = [_at(x, b) for x in lines.start]
        self.peak = [_at(x, b) for x in lines.peak]
        self.activation_total = _pos(lines.activation_total, b)
        self.end_of_forward = _at(lines.end_of_forward, b)
        self.head_peak = _at(lines.head_peak, b)
        self.phases = {phase: _at(x, b) for phase, x in lines.phases.items()}
        self.step_forward_ms = max(0.0, lines.step_forward_ms[0] * b + lines.step_forward_ms[1])
        self.step_backward_ms = max(0.0, lines.step_backward_ms[0] * b + lines.step_backward_ms[1])
        # phase -> (untracked bytes at b, what the phase's measured peak already holds)
        self.untracked = {ph: (_pos(x, b), held) for ph, (x, held) in lines.untracked.items()}
        self.largest_allocation = (
            None if lines.largest_allocation is None else _pos(lines.largest_allocation, b)
        )
        self.largest_block_allocation = (
            None
            if lines.largest_block_allocation is None
            else _pos(lines.largest_block_allocation, b)
        )


class _Lines:
    """One measured step's numbers as ``(per_sample, constant)`` lines, read once per step.

    Reading pydantic fields costs more than the arithmetic; the search estimates the same
    profile at the same few batch sizes thousands of times, so each step's lines are
    extracted once, and evaluated once per batch size (:meth:`at`).
    """

    __slots__ = (
        "activation",
        "inputs",
        "inputs_low",
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
        "untracked",
        "largest_allocation",
        "largest_block_allocation",
        "batches",
    )

    def __init__(self, step: StepProfile) -> None:
        blocks = step.blocks
        self.activation = [_line(b.activation) for b in blocks]
        self.inputs = [_line(b.input) for b in blocks]
        self.inputs_low = [_line(b.input_low) for b in blocks]
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
        self.untracked = {u.phase: (_line(u.untracked), u.profiled_bytes) for u in step.untracked}
        self.largest_allocation = _line(step.largest_allocation)
        self.largest_block_allocation = _line(step.largest_block_allocation)
        self.batches: dict[int, _AtBatch] = {}

    def at(self, b: int) -> _AtBatch:
        hit = self.batches.get(b)
        if hit is None:
            if len(self.batches) >= _BATCHES_CACHED:
                self.batches.clear()
            hit = self.batches[b] = _AtBatch(self, b)
        return hit


_CACHE: dict[int, tuple[StepProfile, _Lines]] = {}
_STEPS_CACHED = 64
_BATCHES_CACHED = 4096


def _lines(step: StepProfile) -> _Lines:
    # Keyed by identity; the entry holds the step itself, so its id cannot be reused while
    # cached. A profile edited in place after being estimated is not noticed.
    hit = _CACHE.get(id(step))
    if hit is not None and hit[0] is step:
        return hit[1]
    if len(_CACHE) >= _STEPS_CACHED:
        _CACHE.pop(next(iter(_CACHE)))
    lines = _Lines(step)
    _CACHE[id(step)] = (step, lines)
    return lines


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
        "numbers",
        "block_activation_bytes",
        "block_input_bytes",
        "block_transient_bytes",
        "block_forward_ms",
        "checkpointed",
        "outside_activation_bytes",
        "dropped_activation_bytes",
        "offloaded_fraction",
        "extra_bytes",
        "backward_block_bytes",
        "backward_head_bytes",
        "extra_ms",
        "held_share",
        "weight_copies",
        "largest_allocation_cap",
        "low_inputs",
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
        self.dropped_activation_bytes = 0
        self.extra_bytes: dict[PeakPhase, int] = {"forward": 0, "backward": 0, "optimizer": 0}
        self.backward_block_bytes: list[int] | None = None
        self.backward_head_bytes = 0
        self.extra_ms = 0.0
        self.held_share = 1.0  # of the weights, gradients and optimizer state (the breakdown)
        self.weight_copies = True  # autocast copies the weights (when the step has copies)
        self.largest_allocation_cap: int | None = None
        self.low_inputs: list[bool] | None = None  # blocks whose inputs arrive cast to 2 bytes
        self.use_precision("fp32")

    # -- verbs strategies use ---------------------------------------------------------------

    def use_precision(self, precision: str) -> None:
        """Read activations and times from the profile's step in ``precision``."""
        step = self.profile.steps.get(precision) or self.profile.steps["fp32"]
        lines = _lines(step)
        nums = lines.at(self.batch_size)
        self.precision = precision
        self.step = step
        self.lines = lines
        self.numbers = nums
        # Copies: a strategy may edit its StepModel's lists; the cached numbers stay.
        self.block_activation_bytes = list(nums.activation)
        self.block_input_bytes = list(nums.inputs)
        self.block_transient_bytes = list(nums.transient)
        self.block_forward_ms = list(nums.forward_ms)
        self.outside_activation_bytes = max(0, nums.activation_total - sum(nums.activation))
        self.forward_ms = nums.step_forward_ms
        self.backward_ms = nums.step_backward_ms
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

    def add_backward_bytes(self, per_block: Sequence[int], head: int = 0) -> None:
        """Extra bytes while each block's backward runs (``per_block[k]``, negative where
        fewer are held) and while the head's does: what changes block by block (FSDP2's
        all-gathered units, its sharded gradients)."""
        if len(per_block) != len(self.checkpointed):
            raise ValueError(
                f"per_block needs one entry per block ({len(self.checkpointed)}), but got "
                f"{len(per_block)}."
            )
        current = self.backward_block_bytes or [0] * len(per_block)
        self.backward_block_bytes = [a + int(b) for a, b in zip(current, per_block, strict=True)]
        self.backward_head_bytes += int(head)

    def hold_share(self, share: float) -> None:
        """This process holds ``share`` of the weights, gradients and optimizer state (FSDP2's
        1/world_size): the breakdown counts that share as theirs and what the strategy's
        ``add_bytes`` edits add beyond it (the gathered units) as temporaries. The peak
        itself is the edits' alone."""
        self.held_share = min(1.0, max(0.0, share))

    def drop_weight_copies(self) -> None:
        """Autocast makes no weight copies in this step: the weights it meets are already in
        its dtype (FSDP2's units, gathered in bf16 by a ``MixedPrecisionPolicy``). Every
        moment loses the copies the profile's step held there, once: in forward and at the
        head all of them; while block ``k``'s backward runs those of blocks ``0..k`` (later
        blocks' were freed by their backward, the root's after the head's); a checkpointed
        block then frees, and its recompute brings back, its activations alone."""
        self.weight_copies = False

    def cap_largest_allocation(self, nbytes: int) -> None:
        """This step allocates no single tensor larger than ``nbytes`` (a chunked loss never
        makes the whole logits): what a memory cap can strand beyond the allocated peak
        (:attr:`Estimate.reserved_peak_bytes`) is at most that. Only ever lowers it."""
        nbytes = max(0, int(nbytes))
        cap = self.largest_allocation_cap
        self.largest_allocation_cap = nbytes if cap is None else min(cap, nbytes)

    def cast_block_inputs(self, block_indices: Iterable[int]) -> None:
        """These blocks' floating inputs reach them cast to a 2-byte dtype (FSDP2's
        ``MixedPrecisionPolicy(param_dtype=bf16)`` casts each unit's forward inputs): a
        checkpointed one keeps its input at that size (``BlockActivity.input_low``) where the
        profile's step kept it as it came (fp32 where the residual stream followed fp32
        weights under autocast). Blocks whose profile lacks ``input_low`` are left as they
        are."""
        low = self.low_inputs or [False] * len(self.checkpointed)
        for i in block_indices:
            low[i] = True
        self.low_inputs = low

    def drop_activations(self, nbytes: int) -> None:
        """Bytes the profiled step saved for backward that this one does not save at all (a
        chunked loss's logits): out of the activations the breakdown holds and offload
        moves. The peaks are the strategy's to move (``add_bytes``, ``add_backward_bytes``):
        where they were saved decides which moments they leave."""
        self.dropped_activation_bytes += max(0, int(nbytes))

    def add_ms(self, ms: float) -> None:
        """Extra time per micro-batch."""
        self.extra_ms += ms

    # -- summing up -------------------------------------------------------------------------

    def _unmeasured_kept(self, k: int) -> int:
        """What checkpointed block ``k`` keeps, for a profile without ``output_kept``."""
        nums, n = self.numbers, len(self.checkpointed)
        # Assume the successor (or the head) saves what k returns.
        if nums.outputs[k]:
            return nums.outputs[k]
        return self.block_input_bytes[k + 1] if k + 1 < n else self.block_input_bytes[k]

    def _unmeasured_cast(self, k: int) -> int:
        """Block ``k``'s autocast weight copies, for a profile without them per block."""
        if not self.step.cast_weight_bytes:
            return 0
        # The step's copies shared out by parameter bytes.
        params = self.profile.param_bytes or 1
        return self.step.cast_weight_bytes * self.profile.blocks[k].param_bytes // params

    def result(self) -> Estimate:
        """Walk forward, backward and the optimizer step; return the peak and the time."""
        p, b, nums = self.profile, self.batch_size, self.numbers
        n = len(self.checkpointed)
        act = self.block_activation_bytes
        ckpt = self.checkpointed
        weights = p.param_bytes + p.buffer_bytes
        state, grads = p.optimizer_state_bytes, p.grad_bytes
        # Held through every micro-batch after the first when gradients accumulate.
        held_grads = grads if self.accumulation_steps > 1 else 0

        # What each checkpointed block frees from the end of its forward to its backward.
        freed = [0] * n
        # A recompute's top, above where its block's backward begins: its forward transient,
        # less autocast's weight copies (made inside the transient's window, but counted in
        # what the block frees and the recompute brings back).
        recompute_top = [0] * n
        cast_freed = 0
        freed_activations = 0
        recompute_ms = 0.0
        if True in ckpt:
            outputs, output_kept, inputs = nums.outputs, nums.output_kept, self.block_input_bytes
            casts, transient = self.lines.cast, self.block_transient_bytes
            ms = self.block_forward_ms
            for k in [k for k in range(n) if ckpt[k]]:
                if k + 1 < n and ckpt[k + 1]:
                    # The successor's checkpoint holds its inputs: all of k's outputs stay.
                    kept = outputs[k] or inputs[k + 1]
                else:
                    kept = output_kept[k]
                    if kept is None:
                        kept = self._unmeasured_kept(k)
                gone = act[k] - kept
                if gone < 0:
                    gone = 0
                cast = casts[k] or self._unmeasured_cast(k)
                freed_activations += gone
                # Without copies there is nothing of them to free (drop_weight_copies).
                freed[k] = gone + cast if self.weight_copies else gone
                cast_freed += cast if self.weight_copies else 0
                top = transient[k] - cast
                recompute_top[k] = top if top > 0 else 0
                recompute_ms += ms[k]
            if self.low_inputs is not None:
                freed_activations += self._low_inputs_freed(freed)
        freed_total = sum(freed)
        activations = max(
            0, nums.activation_total - freed_activations - self.dropped_activation_bytes
        )
        offload = self.offloaded_fraction
        offloaded = int(activations * offload)

        if self.lines.walk:
            eof, head, starts, peaks = nums.end_of_forward, nums.head_peak, nums.start, nums.peak
        else:
            eof, head, starts, peaks = self._derived_walk(weights + state)
        # Fixed costs (cuBLAS workspaces, rounding) come on top of tracked tensor bytes; a
        # card's phase peaks were read from its allocator and hold them already.
        overhead = p.fixed_overhead_bytes
        phase_overhead = 0 if p.device.capabilities.memory == "allocator" else overhead
        phases = nums.phases
        forward_peak = phases["forward"] + phase_overhead if "forward" in phases else eof + overhead
        optimizer_peak = (
            phases["optimizer"] + phase_overhead
            if "optimizer" in phases
            else weights + state + grads + self._optimizer_temporaries() + overhead
        )
        extra = self.extra_bytes
        # CUDA: untracked bytes that grow with the batch (cuDNN's workspaces), beyond what the
        # fixed overhead and the phase peaks measured at small sizes already hold.
        end_of_forward_extra = backward_extra = 0
        if nums.untracked:
            grown = self._untracked_growth(overhead)
            forward_peak += grown["forward"]
            optimizer_peak += grown["optimizer"]
            end_of_forward_extra, backward_extra = grown["end_of_forward"], grown["backward"]

        # Each phase's highest moment; the step's peak is the highest of the three (a tie
        # goes to the earlier phase). A backward moment is its block's index, -2 the head.
        # Forward peaks at the loss (autocast's cached weight copies gone) or as the model's
        # forward ends (the copies of checkpointed blocks still cached).
        end_of_model = eof + overhead + end_of_forward_extra - freed_total + cast_freed
        forward_top = max(forward_peak - freed_total, end_of_model)
        # The profile's step held every weight copy in forward and at the head.
        no_copies = 0 if self.weight_copies else self.step.cast_weight_bytes
        forward_top += held_grads + extra["forward"] - offloaded - no_copies
        eof += overhead + backward_extra + held_grads + extra["backward"] - no_copies
        backward_top = eof + head - freed_total - offloaded + self.backward_head_bytes
        backward_block = -2
        below = freed_total  # freed by checkpointed blocks whose backward has not run yet
        by_block = self.backward_block_bytes
        if no_copies:
            by_block = self._copies_not_held(by_block or [0] * n, no_copies)
        if by_block is not None:
            # Per-block extras move each block's level: the walk as written, with them added.
            for k in range(n - 1, -1, -1):
                below -= freed[k]
                level = peaks[k] - below
                if ckpt[k] and starts[k] - below + recompute_top[k] > level:
                    level = starts[k] - below + recompute_top[k]
                level += eof + by_block[k]
                if offload:
                    level -= int(offload * sum(act[:k]))
                if level > backward_top:
                    backward_top, backward_block = level, k
        elif offload:
            offloaded_below = offload * sum(act)
            for k in range(n - 1, -1, -1):
                below -= freed[k]
                # Offloaded activations of blocks not yet reached stay on the host.
                offloaded_below -= offload * act[k]
                level = peaks[k] - below
                if ckpt[k] and starts[k] - below + recompute_top[k] > level:
                    level = starts[k] - below + recompute_top[k]
                level += eof - int(offloaded_below)
                if level > backward_top:
                    backward_top, backward_block = level, k
        else:
            # The hot loop of the search: plain comparisons, relative to the end of forward.
            top = backward_top - eof
            for k in range(n - 1, -1, -1):
                if freed[k]:
                    below -= freed[k]
                level = peaks[k] - below
                if ckpt[k]:
                    recompute = starts[k] - below + recompute_top[k]
                    if recompute > level:
                        level = recompute
                if level > top:
                    top, backward_block = level, k
            backward_top = top + eof
        optimizer_top = optimizer_peak + extra["optimizer"]
        best_phase: PeakPhase = "forward"
        best, best_block = forward_top, -1
        if backward_top > best:
            best_phase, best, best_block = "backward", backward_top, backward_block
        if optimizer_top > best:
            best_phase, best, best_block = "optimizer", optimizer_top, -1
        peak = best
        if best_block == -2:
            peak_at = "backward: head"
        elif best_block >= 0:
            peak_at = f"backward: {p.blocks[best_block].name}"
        else:
            peak_at = best_phase

        micro_ms = self.forward_ms + self.backward_ms + recompute_ms + self.extra_ms
        step_ms = micro_ms * self.accumulation_steps + self.optimizer_ms
        samples = b * self.accumulation_steps
        held_activations = 0 if best_phase == "optimizer" else activations - offloaded
        held_grad_bytes = grads if best_phase == "optimizer" else held_grads
        share = self.held_share
        if share < 1.0:  # a rank's shards (buffers are not sharded)
            weights = int(p.param_bytes * share) + p.buffer_bytes
            state, held_grad_bytes = int(state * share), int(held_grad_bytes * share)
        known = weights + state + held_grad_bytes + held_activations
        return Estimate(
            peak_bytes=peak,
            peak_phase=best_phase,
            peak_at=peak_at,
            breakdown={
                "params": weights,
                "grads": held_grad_bytes,
                "optimizer_state": state,
                "activations": held_activations,
                "temporaries": max(0, peak - known),
            },
            step_ms=step_ms,
            samples_per_s=samples_per_s(samples, step_ms),
            reserved_peak_bytes=self._reserved(peak),
            phase_peak_bytes={
                "forward": forward_top,
                "backward": backward_top,
                "optimizer": optimizer_top,
            },
        )

    def _low_inputs_freed(self, freed: list[int]) -> int:
        """Add to ``freed`` what checkpointed blocks keep less of their inputs when these
        arrive cast to 2 bytes (:meth:`cast_block_inputs`); returns the bytes added.

        The profile's step kept block ``k``'s input as it came (``input``); cast, the
        checkpoint keeps ``input_low`` of it. Where the predecessor is checkpointed the
        difference comes off what it keeps for ``k`` (its outputs, freed until its own
        backward); otherwise off what ``k`` frees (the input was counted to its maker, the
        outside or an uncheckpointed block, and is held until ``k``'s backward: at that
        moment itself the walk still counts it whole, high).
        """
        nums, ckpt, low = self.numbers, self.checkpointed, self.low_inputs or ()
        added = 0
        for k, cast in enumerate(low):
            kept_low = nums.inputs_low[k]
            if not (cast and ckpt[k]) or kept_low is None:
                continue
            less = nums.inputs[k] - kept_low
            if less <= 0:
                continue
            at = k - 1 if k > 0 and ckpt[k - 1] else k
            freed[at] += less
            added += less
        return added

    def _copies_not_held(self, by_block: Sequence[int], dropped: int) -> list[int]:
        """``by_block`` plus, at each block's backward, the weight copies the profile's step
        no longer held there (``dropped``, all of them, is taken from every backward moment):
        the root's, and those of the blocks whose backward has run."""
        held = 0
        out = []
        for k, extra in enumerate(by_block):
            held += self.lines.cast[k] or self._unmeasured_cast(k)
            out.append(extra + dropped - held)
        return out

    def _reserved(self, peak: int) -> int | None:
        largest = self.numbers.largest_allocation
        if largest is not None:
            if self.largest_allocation_cap is not None:
                largest = min(largest, self.largest_allocation_cap)
            return peak + largest
        ratio = self.profile.fragmentation_ratio
        return int(peak * ratio) if ratio else None

    def _untracked_growth(self, overhead: int) -> dict[str, int]:
        """Untracked bytes at this batch beyond what each estimated moment already holds.

        The walk's levels are tensor bytes plus ``overhead`` (the fixed overhead: the
        untracked bytes at the profile's larger size); the forward and optimizer phase peaks
        were read from the allocator at the profile's sizes, holding that phase's untracked
        bytes there (``profiled_bytes``). Never negative: a line that falls below what was
        measured takes nothing away.
        """
        untracked = self.numbers.untracked

        def beyond(phase: str, held: int | None) -> int:
            if phase not in untracked:
                return 0
            at_b, profiled = untracked[phase]
            return max(0, at_b - (profiled if held is None else held))

        return {
            "forward": beyond("forward", None),
            "end_of_forward": beyond("forward", overhead),
            "backward": beyond("backward", overhead),
            "optimizer": beyond("optimizer", None),
        }

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
        p, nums = self.profile, self.numbers
        n = len(self.checkpointed)
        act = self.block_activation_bytes
        eof = static + nums.activation_total + self.step.cast_weight_bytes
        outs = [nums.outputs[k] or self.block_input_bytes[k] for k in range(n)]
        last_out = outs[-1] if n else 0
        backward = nums.phases.get("backward")
        head = backward - eof if backward is not None else last_out
        ratio = p.grad_bytes / p.param_bytes if p.param_bytes else 0.0
        starts, peaks = [0] * n, [0] * n
        level = 0
        for k in range(n - 1, -1, -1):
            starts[k] = level + outs[k]
            peaks[k] = starts[k] + max(outs[k], self.block_transient_bytes[k])
            cast = self.lines.cast[k] or self._unmeasured_cast(k)
            level += int(p.blocks[k].param_bytes * ratio) - act[k] - cast
        return eof, head, starts, peaks


def estimate(profile: Profile, candidate: Candidate, strategies: Sequence[Effect] = ()) -> Estimate:
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
