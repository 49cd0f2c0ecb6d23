"""The profiling pass: a private copy of the model, metered and timed steps, a Profile.

How a pass runs (``profile_workload``):
    1. The blocks are chosen (:func:`~memadvisor.profiler._blocks.find_blocks`) and the model
       is cloned onto the device; the caller's model, gradients and optimizer are never used
       (a model that cannot be deep-copied is profiled in place and put back:
       :func:`~memadvisor.profiler._state.private_model`).
    2. For each precision (fp32, then autocast bf16/fp16 around the model's forward, as the
       precision strategy applies it): one plain warm-up step, so the optimizer's state
       exists and every measured step is a steady-state step (weights + optimizer state +
       this step's activations); then for each of the two batch sizes one metered step
       (:class:`~memadvisor.profiler._memory_step.MemoryStep`) and two timed steps
       (:class:`~memadvisor.profiler._timing_step.TimingStep`, the faster reading kept).
    3. On CUDA, cuBLAS's workspaces (held since the warm-up, so in every metered step's
       baseline) are measured by freeing them, and added to every phase peak.
    4. On CUDA, for each precision, what the allocator holds beyond tracked tensors (cuDNN's
       workspaces, which grow with the batch only past the small sizes) is measured at two
       larger sizes, a warm-up and one bare metered step each
       (:mod:`~memadvisor.profiler._untracked`), then two timed steps at each: where both
       sizes ran, every time is fitted at them, not at the small sizes, whose steps on a
       card are launch latency (``docs/design.md``, "Timing at small batches").
    5. Every size that grows with the batch is fitted through its two measurements.

The RNG states are put back at the end. Under ``FakeTensorMode`` no step is timed (fake ops
take no real time) and every time is 0; the warm-up counts the step's matmul FLOPs instead
(``Profile.flops``), from which a planner can model times, and only the first precision
warms up (nothing but the optimizer's state persists between fake steps).

Batch sizes: by default the sample batch's size ``n`` and ``2n``; where that runs out of
memory on a card, ``(n/2, n)`` and so on down to ``(1, 2)``. Two sizes separate what each
sample adds from what any batch costs (a block that saves a constant-size tensor).

Known limitations:
    * The private copy costs one more copy of the weights on the device while profiling.
    * Two timed steps per size: times on a busy or throttled device are rough.
    * On CUDA the allocator's cache is emptied before each metered step, so reserved bytes
      (and the fragmentation ratio) are those of a first step, not of a long run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import nn

from memadvisor._torch_private import clear_cublas_workspaces
from memadvisor.errors import BadInputError
from memadvisor.process_state import rng_restored
from memadvisor.profiler._blocks import BlockSpec, find_blocks
from memadvisor.profiler._device import Target, resolve_target
from memadvisor.profiler._flops import FlopCounter
from memadvisor.profiler._memory_step import (
    LOSS_OWNER,
    OTHER_OWNER,
    MemoryMeasurement,
    MemoryStep,
    tensors_in,
)
from memadvisor.profiler._progress import ProgressArg, ProgressReporter
from memadvisor.profiler._state import private_model
from memadvisor.profiler._timing_step import TimingMeasurement, TimingStep
from memadvisor.profiler._untracked import (
    LargestAllocation,
    UntrackedFit,
    measure_untracked,
    untracked_batch_sizes,
    untracked_step,
)
from memadvisor.schema.call import CallForm
from memadvisor.schema.precision import AUTOCAST_DTYPES, PRECISIONS
from memadvisor.schema.profile import (
    BlockActivity,
    BlockInfo,
    LayerRow,
    LinearBytes,
    LinearMs,
    ModuleActivity,
    PhasePeak,
    Profile,
    StepFlops,
    StepProfile,
)
from memadvisor.workload import Workload, tensor_leaves, train_step

__all__ = ["autocast_workload", "profile_workload"]

TIMED_STEPS = 2  # per batch size and precision; the faster reading of each number is kept
UNTRACKED_SIZES = 2  # CUDA: the larger sizes the untracked bytes are fitted at, per precision


def profile_workload(
    workload: Workload,
    *,
    blocks: BlockSpec | None = None,
    device: str = "auto",
    precisions: Sequence[str] | None = None,
    batch_sizes: tuple[int, int] | None = None,
    progress: ProgressArg = None,
) -> Profile:
    """Profile ``workload``'s training step (see the module docstring for how).

    Raises:
        BadInputError: an unknown or unsupported precision, bad batch sizes or block
            patterns, a device that is not there, or a model that rejects its batch.
    """
    # memadvisor.device imports the profiler's schema: imported here, not at the top.
    from memadvisor.errors import is_oom

    started = time.perf_counter()
    if not isinstance(workload, Workload):
        raise BadInputError(
            f"profile_workload takes a memadvisor Workload, but got {type(workload).__name__}: "
            "call memadvisor.profile(model, sample_batch, ...) for plain inputs."
        )
    target = resolve_target(workload.model, device)
    chosen = _precisions(precisions, target)
    block_names = find_blocks(workload.model, blocks)
    pairs = _batch_pairs(batch_sizes, workload.sample_batch_size)
    with rng_restored(uses_cuda=target.is_cuda):
        for k, pair in enumerate(pairs):
            try:
                result = _Pass(workload, target, block_names, chosen, pair, progress).run()
            except Exception as e:
                if not is_oom(e) or k == len(pairs) - 1:
                    raise
            else:
                result.profiling_ms = (time.perf_counter() - started) * 1000.0
                return result
            # Too big for the card at these sizes: free it all (now that the exception, and
            # the frames holding the copy, are gone) and try the halves.
            _release(target)
    raise AssertionError("unreachable: the last pair either returns or raises")


def _precisions(precisions: Sequence[str] | None, target: Target) -> list[str]:
    if precisions is None:
        return ["fp32", "bf16"] if target.supports("bf16") else ["fp32"]
    if isinstance(precisions, str):
        precisions = [precisions]
    unknown = [p for p in precisions if p not in PRECISIONS]
    if unknown:
        raise BadInputError(f"precisions are among {PRECISIONS}, but got {unknown=}.")
    unsupported = [p for p in precisions if not target.supports(p)]
    if unsupported:
        raise BadInputError(
            f"Autocast on {target.kind} does not run {unsupported}: leave them out of "
            "precisions (fp32 always runs)."
        )
    # fp32 always, first: every other precision is read against it.
    return ["fp32"] + [p for p in dict.fromkeys(precisions) if p != "fp32"]


def _batch_pairs(batch_sizes: tuple[int, int] | None, sample_size: int) -> list[tuple[int, int]]:
    if batch_sizes is not None:
        sizes = tuple(batch_sizes)
        if (
            len(sizes) != 2
            or not all(isinstance(b, int) and b > 0 for b in sizes)
            or sizes[0] == sizes[1]
        ):
            raise BadInputError(
                f"batch_sizes must be two distinct positive ints, but got {batch_sizes=}."
            )
        return [(min(sizes), max(sizes))]
    n = max(1, sample_size)
    pairs = [(n, 2 * n)]
    while n > 1:
        n //= 2
        pairs.append((n, 2 * n))
    return pairs


def _release(target: Target) -> None:
    gc.collect()
    if target.is_cuda:
        torch.cuda.empty_cache()


def autocast_workload(workload: Workload, precision: str, target: Target) -> Workload:
    """``workload`` with the model's forward under autocast (the loss stays outside it, as
    the precision strategy applies it: on the model's forward)."""
    if precision == "fp32":
        return workload
    dtype, device_type = AUTOCAST_DTYPES[precision], target.device.type

    def forward_fn(model: nn.Module, batch: Any) -> Any:
        with torch.autocast(device_type, dtype=dtype):
            return workload.forward(model, batch)

    return dataclasses.replace(workload, forward_fn=forward_fn)


def _unique_bytes(tensors: Iterable[torch.Tensor], keep: Callable[[torch.Tensor], bool]) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if keep(t):
            st = t.untyped_storage()
            seen[id(st)] = st.nbytes()
    return sum(seen.values())


def _unique_count(params: Iterable[torch.Tensor], keep: Callable[[torch.Tensor], bool]) -> int:
    seen = {id(p): p.numel() for p in params if keep(p)}
    return sum(seen.values())


class _Pass:
    """One profiling pass at one pair of batch sizes."""

    def __init__(
        self,
        workload: Workload,
        target: Target,
        block_names: list[str],
        precisions: list[str],
        sizes: tuple[int, int],
        progress: ProgressArg,
    ) -> None:
        self.workload = workload
        self.target = target
        self.block_names = block_names
        self.precisions = precisions
        self.sizes = sizes
        timed = 0 if target.fake else TIMED_STEPS
        # Per precision: a warm-up, two metered steps, the timed ones; on a card the two
        # larger sizes of the untracked bytes (each a warm-up and a bare metered step).
        per_precision = 1 + 2 * (1 + timed) + (UNTRACKED_SIZES if target.is_cuda else 0)
        self.progress = ProgressReporter(progress, len(precisions) * per_precision)
        self.timed_steps = timed
        self.workspace_bytes = 0
        self.owners: dict[str, list[str]] = {}
        self.call_form: CallForm | None = None  # noted in the fp32 warm-up step
        # CUDA: per precision, the steps timed at the untracked bytes' two larger sizes.
        self.large_timing: dict[str, tuple[tuple[int, int], list[TimingMeasurement]]] = {}
        # CUDA: per precision, the step's largest single allocation at those sizes.
        self.largest_allocation: dict[str, LinearBytes] = {}
        self.flops: StepFlops | None = None  # fake tensors: counted in the warm-up

    def _on_device(self, t: torch.Tensor) -> bool:
        return not self.target.is_cuda or t.device.type == "cuda"

    def run(self) -> Profile:
        with private_model(self.workload.model, self.target.device) as model:
            return self._run(model)

    def _run(self, model: nn.Module) -> Profile:
        wl, b1, b2 = self.workload, *self.sizes
        optimizer = wl.make_optimizer(model)
        measured = {}
        for precision in self.precisions:
            step_wl = autocast_workload(wl, precision, self.target)
            # fp32's warm-up also notes how the step calls the model and finds the loss.
            warm_wl = self._noting_call_form(step_wl) if precision == "fp32" else step_wl
            self._warm_up(model, optimizer, warm_wl, precision, first=not measured)
            mem = [self._metered(model, optimizer, step_wl, b, precision) for b in self.sizes]
            owners = sorted({o for m in mem for o in m.outside} - {LOSS_OWNER, OTHER_OWNER})
            timing = [
                self._timed(model, optimizer, step_wl, b, precision, owners) for b in self.sizes
            ]
            measured[precision] = (mem, timing)
            self.owners[precision] = owners
        state_bytes = _unique_bytes(
            (t for s in optimizer.state.values() for t in tensors_in(s)), self._on_device
        )
        self.workspace_bytes = self._measure_workspaces()
        untracked = {
            p: self._untracked(model, optimizer, autocast_workload(wl, p, self.target), p, m[0])
            for p, m in measured.items()
        }
        steps = {p: self._step_profile(p, model, *m_t, untracked[p]) for p, m_t in measured.items()}
        memory_fp32 = measured["fp32"][0][1]
        return Profile(
            model_name=type(wl.model).__name__,
            device=self.target.info(),
            batch_sizes=(b1, b2),
            param_bytes=_unique_bytes(model.parameters(), self._on_device),
            grad_bytes=memory_fp32.grad_bytes,
            optimizer_state_bytes=state_bytes,
            buffer_bytes=_unique_bytes(model.buffers(), self._on_device),
            param_count=_unique_count(model.parameters(), lambda p: True),
            trainable_param_count=_unique_count(model.parameters(), lambda p: p.requires_grad),
            blocks=[
                BlockInfo(
                    name=name,
                    type_name=type(model.get_submodule(name)).__name__,
                    param_bytes=_unique_bytes(
                        model.get_submodule(name).parameters(), self._on_device
                    ),
                )
                for name in self.block_names
            ],
            steps=steps,
            layers=self._layers(model, memory_fp32),
            fixed_overhead_bytes=self._fixed_overhead(memory_fp32),
            fragmentation_ratio=self._fragmentation(memory_fp32),
            flops=self.flops,
            tokens_per_sample=_tokens_per_sample(wl.sample_batch),
            call_form=self.call_form,
        )

    def _noting_call_form(self, wl: Workload) -> Workload:
        """``wl``, noting in ``self.call_form`` how it calls the model and finds the loss."""

        def loss_fn(output: Any, batch: Any) -> torch.Tensor:
            self.call_form = wl.call_form(output)
            return wl.loss(output, batch)

        return dataclasses.replace(wl, loss_fn=loss_fn)

    # -- steps ------------------------------------------------------------------------------

    def _warm_up(
        self, model: nn.Module, optimizer: Any, wl: Workload, precision: str, *, first: bool
    ) -> None:
        """A plain step first: the optimizer's state, and whatever a precision's first step
        makes and keeps (cuBLAS/cuBLASLt workspaces), exist before anything is measured.

        Under fake tensors only the first precision's is needed (nothing but the optimizer's
        state persists), and it counts the step's FLOPs, which stand in for the times a
        fake step cannot have (:mod:`memadvisor.profiler._flops`).
        """
        b2 = self.sizes[1]
        what = f"warm-up step, {precision}, batch {b2}"
        self.progress.begin(what)
        if self.target.fake and not first:
            self.progress.advance(f"{what}: not needed under fake tensors")
            return
        counter = FlopCounter(model) if self.target.fake else None
        with counter or contextlib.nullcontext():
            train_step(
                wl,
                model,
                optimizer,
                self.workload.batch(b2, self.target.device),
                on_phase=counter.on_phase if counter is not None else None,
            )
        if counter is not None:
            self.flops = counter.result(b2)
        self.progress.advance(what)

    def _metered(
        self, model: nn.Module, optimizer: Any, wl: Workload, b: int, precision: str
    ) -> MemoryMeasurement:
        what = f"metered step, {precision}, batch {b}"
        self.progress.begin(what)
        batch = self.workload.batch(b, self.target.device)
        result = MemoryStep(model, self.block_names, self.target).run(wl, optimizer, batch)
        self.progress.advance(what)
        return result

    def _timed(
        self,
        model: nn.Module,
        optimizer: Any,
        wl: Workload,
        b: int,
        precision: str,
        owners: list[str],
    ) -> TimingMeasurement | None:
        if not self.timed_steps:
            return None
        runs = []
        batch = self.workload.batch(b, self.target.device)
        stepper = TimingStep(model, self.block_names, owners, self.target)
        for _ in range(self.timed_steps):
            what = f"timed step, {precision}, batch {b}"
            self.progress.begin(what)
            runs.append(stepper.run(wl, optimizer, batch))
            self.progress.advance(what)
        return TimingMeasurement.fastest(runs)

    def _untracked(
        self,
        model: nn.Module,
        optimizer: Any,
        wl: Workload,
        precision: str,
        mem: list[MemoryMeasurement],
    ) -> UntrackedFit | None:
        """CUDA: the untracked bytes per phase, fitted at two larger sizes; None elsewhere,
        or where the card has no room for them."""
        if not self.target.is_cuda:
            return None
        from memadvisor.errors import is_oom

        dev, (b1, b2) = self.target.device, self.sizes
        m1, m2 = mem
        per_sample = max(
            (
                (m2.phases[ph][0] - m1.phases[ph][0]) / (b2 - b1)
                for ph in m2.phases
                if ph in m1.phases
            ),
            default=0.0,
        )
        ws = self.workspace_bytes
        profiled = {
            ph: allocated + ws - m2.phase_tracked.get(ph, allocated)
            for ph, (allocated, _) in m2.phases.items()
        }
        _release(self.target)
        sizes = untracked_batch_sizes(per_sample, self.sizes, torch.cuda.mem_get_info(dev)[0])
        left = UNTRACKED_SIZES
        timed_at: dict[int, TimingMeasurement] = {}
        largest_at: dict[int, int] = {}

        def measure(b: int) -> dict[str, int]:
            nonlocal left
            what = f"untracked bytes, {precision}, batch {b}"
            self.progress.begin(what)
            batch = self.workload.batch(b, dev)
            train_step(wl, model, optimizer, batch)  # warm-up: cuDNN's choice for the shape
            largest = LargestAllocation()
            result = untracked_step(model, optimizer, wl, batch, self.target, largest)
            largest_at[b] = largest.bytes
            if self.timed_steps:
                stepper = TimingStep(model, self.block_names, self.owners[precision], self.target)
                runs = [stepper.run(wl, optimizer, batch) for _ in range(self.timed_steps)]
                timed_at[b] = TimingMeasurement.fastest(runs)
            left -= 1
            self.progress.advance(what)
            return result

        try:
            fit = measure_untracked(measure, sizes, profiled, is_oom)
            if len(timed_at) == 2:
                # A card's step at the profile's small sizes is launch latency: its time
                # barely grows with the batch (docs/design.md, "Timing at small batches").
                # Times fitted at sizes that fill the card rank batches and precisions.
                (s1, t1), (s2, t2) = sorted(timed_at.items())
                self.large_timing[precision] = ((s1, s2), [t1, t2])
            if fit is not None and len(largest_at) == 2:
                (low, v1), (high, v2) = sorted(largest_at.items())
                self.largest_allocation[precision] = LinearBytes.fit(low, v1, high, v2)
            return fit
        finally:
            # A step cut short by an out-of-memory error leaves gradients behind.
            optimizer.zero_grad(set_to_none=True)
            _release(self.target)
            for _ in range(left):
                self.progress.advance(f"untracked bytes, {precision}: skipped")

    def _measure_workspaces(self) -> int:
        """cuBLAS's workspaces (one per thread that ran matmuls: main and autograd).

        Made in the warm-up step and held since, they sat in every metered step's baseline;
        a training process holds them all along, so they are added back to each phase.
        Measured as what freeing them gives back; the next matmul makes them again.
        """
        if not self.target.is_cuda:
            return 0
        dev = self.target.device
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        if not clear_cublas_workspaces():
            return 0
        return max(0, before - torch.cuda.memory_allocated(dev))

    # -- fitting ----------------------------------------------------------------------------

    def _bytes(self, value1: int, value2: int) -> LinearBytes:
        b1, b2 = self.sizes
        return LinearBytes.fit(b1, value1, b2, value2)

    def _ms(
        self,
        times: list[TimingMeasurement | None],
        read: Callable,
        sizes: tuple[int, int] | None = None,
    ) -> LinearMs:
        b1, b2 = sizes or self.sizes
        if times[0] is None or times[1] is None:
            return LinearMs()
        return LinearMs.fit(b1, read(times[0]), b2, read(times[1]))

    def _step_profile(
        self,
        precision: str,
        model: nn.Module,
        mem: list[MemoryMeasurement],
        timing: list[TimingMeasurement | None],
        untracked: UntrackedFit | None = None,
    ) -> StepProfile:
        # On a card the times come from the larger sizes where there are any (_untracked).
        time_sizes, timing = self.large_timing.get(precision, (self.sizes, timing))

        def ms(read: Callable[[TimingMeasurement], float]) -> LinearMs:
            return self._ms(timing, read, time_sizes)

        m1, m2 = mem
        blocks = [
            BlockActivity(
                name=name,
                activation=self._bytes(m1.block_activation[i], m2.block_activation[i]),
                input=self._bytes(m1.block_input[i], m2.block_input[i]),
                input_low=self._walk_bytes(mem, lambda m, i=i: m.block_input_low[i]),
                output=self._bytes(m1.block_output[i], m2.block_output[i]),
                forward_transient=self._bytes(m1.block_transient[i], m2.block_transient[i]),
                forward_ms=ms(lambda t, i=i: t.block_forward_ms[i]),
                backward_ms=ms(lambda t, i=i: t.block_backward_ms[i]),
                output_kept=self._walk_bytes(mem, lambda m, i=i: m.block_output_kept[i]),
                cast_weight_bytes=m2.block_cast[i] if m2.block_cast else 0,
                backward_start=self._walk_bytes(mem, lambda m, i=i: m.block_backward_start[i]),
                backward_peak=self._walk_bytes(mem, lambda m, i=i: m.block_backward_peak[i]),
            )
            for i, name in enumerate(self.block_names)
        ]
        outside = []
        for owner in {o for m in mem for o in m.outside}:
            a1, a2 = m1.outside.get(owner, 0), m2.outside.get(owner, 0)
            if owner == LOSS_OWNER:
                forward = ms(lambda t: t.loss_ms)
            elif owner == OTHER_OWNER:
                forward = LinearMs()
            else:
                forward = ms(lambda t, o=owner: t.module_forward_ms.get(o, 0.0))
            if owner == OTHER_OWNER:
                type_name = type(model).__name__  # made in the model's own forward
            elif owner.startswith("<"):
                type_name = ""
            else:
                type_name = type(model.get_submodule(owner)).__name__
            ops = m2.outside_ops.get(owner, {})
            outside.append(
                ModuleActivity(
                    name=owner,
                    type_name=type_name,
                    activation=self._bytes(a1, a2),
                    forward_ms=forward,
                    made_by=sorted(ops, key=ops.__getitem__, reverse=True)[:3],
                    after=m2.outside_after.get(owner),
                )
            )
        # Largest first: the report and the advice lead with what holds the most.
        outside.sort(key=lambda m: m.activation.at(self.sizes[1]), reverse=True)
        ws = self.workspace_bytes
        phases = [
            PhasePeak(
                phase=phase,
                allocated=self._bytes(m1.phases[phase][0] + ws, m2.phases[phase][0] + ws),
                reserved=(
                    self._bytes(m1.phases[phase][1] + ws, m2.phases[phase][1] + ws)
                    if m1.phases[phase][1] is not None and m2.phases[phase][1] is not None
                    else None
                ),
            )
            for phase in m2.phases
            if phase in m1.phases
        ]
        optimizer_ms = (
            sum(t.optimizer_ms for t in timing if t is not None) / len(timing)
            if all(t is not None for t in timing)
            else 0.0
        )
        return StepProfile(
            precision=precision,
            blocks=blocks,
            outside=outside,
            activation_total=self._bytes(m1.activation_total, m2.activation_total),
            phases=phases,
            cast_weight_bytes=m2.cast_weight_bytes,
            forward_ms=ms(lambda t: t.forward_ms),
            backward_ms=ms(lambda t: t.backward_ms),
            optimizer_ms=optimizer_ms,
            step_ms=ms(lambda t: t.step_ms),
            end_of_forward=self._walk_bytes(mem, lambda m: m.end_of_forward),
            backward_head_peak=self._walk_bytes(mem, lambda m: m.backward_head_peak),
            untracked_batch_sizes=untracked[0] if untracked else None,
            untracked=untracked[1] if untracked else [],
            largest_allocation=self.largest_allocation.get(precision) or self._fake_largest(mem),
            largest_block_allocation=self._bytes(
                mem[0].largest_block_allocation, mem[1].largest_block_allocation
            ),
        )

    def _fake_largest(self, mem: list[MemoryMeasurement]) -> LinearBytes | None:
        """Fake tensors: the largest tensor forward and the loss made (the logits, for an
        LM), as the metered steps saw it. A card measures the step's largest allocation at
        larger sizes (``_untracked``); fake tensors stand in for one, and its reserved bytes
        add about that much under a memory cap (the estimate's ``reserved_peak_bytes``).
        Parameter-sized allocations (gradients, optimizer temporaries) are left out: they
        do not grow with the batch, and a line through two small sizes would keep them at
        every batch. None on real CPU tensors, which nothing caps that way."""
        if not self.target.fake:
            return None
        return self._bytes(mem[0].largest_allocation, mem[1].largest_allocation)

    def _walk_bytes(
        self, mem: list[MemoryMeasurement], read: Callable[[MemoryMeasurement], int | None]
    ) -> LinearBytes | None:
        """A number of the backward walk (or ``input_low``) fitted over both sizes; None where
        either measurement lacks it."""
        try:
            values = [read(m) for m in mem]
        except IndexError:  # a measurement without the walk
            return None
        if any(v is None for v in values):
            return None
        return self._bytes(values[0], values[1])

    def _layers(self, model: nn.Module, mem: MemoryMeasurement) -> list[LayerRow]:
        names = [n for n, _ in model.named_modules() if n]
        rows = []
        for name in names:
            module = model.get_submodule(name)
            prefix = name + "."
            inclusive = sum(
                v for k, v in mem.module_activation.items() if k == name or k.startswith(prefix)
            )
            rows.append(
                LayerRow(
                    name=name,
                    type_name=type(module).__name__,
                    param_bytes=_unique_bytes(module.parameters(), self._on_device),
                    grad_bytes=mem.module_grad.get(name, 0),
                    activation_bytes=inclusive,
                    self_activation_bytes=mem.module_activation.get(name, 0),
                )
            )
        return rows

    def _fixed_overhead(self, mem: MemoryMeasurement) -> int:
        if mem.allocator_peak_bytes is None:
            return 0
        # What the allocator held at its peak beyond the tensors the meter saw: cuBLAS's
        # workspaces and the allocator's rounding of each block.
        rounding = max(0, mem.allocator_peak_bytes - mem.tracked_peak_bytes)
        return self.workspace_bytes + rounding

    def _fragmentation(self, mem: MemoryMeasurement) -> float | None:
        if not self.target.is_cuda:
            return None
        ws = self.workspace_bytes
        allocated = max((a + ws for a, _ in mem.phases.values()), default=0)
        reserved = max(((r or 0) + ws for _, r in mem.phases.values()), default=0)
        return reserved / allocated if allocated > 0 else None


def _tokens_per_sample(batch: Any) -> int | None:
    """Tokens per sample when the batch's first tensor is integer ids of shape (batch,
    tokens), as a language model takes them; None for any other input."""
    first = next(iter(tensor_leaves(batch)), None)
    if first is None or first.ndim != 2 or first.dtype.is_floating_point or first.is_complex():
        return None
    if first.dtype == torch.bool:
        return None
    return int(first.shape[1])
