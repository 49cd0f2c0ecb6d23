"""One training step, metered: who made each storage, what backward keeps, the peak per phase.

A :class:`~memadvisor.memory.MemoryMeter` follows every storage made during the step; module
hooks keep a stack of the modules whose forward is running, so each new storage is tagged
with the innermost module (and the block, if any) that made it. After forward (when
``train_step`` announces backward) the autograd graph behind the loss is walked
(:func:`~memadvisor.profiler._graph.saved_storages`) and each saved storage is charged to its
maker. Storages that existed before the step (weights, the batch, optimizer state) carry no
tag and are not activations.

Peaks per phase come from the meter on the CPU and under fake tensors, and from the caching
allocator's counters on CUDA (``reset_peak_memory_stats`` at each phase boundary), taken
relative to what the process held outside this step's tensors. That leaves out cuBLAS's
workspaces, made in the warm-up step and held since: the pass measures them once and adds
them back (``_profile._Pass``).
"""

from __future__ import annotations

import dataclasses
import gc
import itertools
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from memadvisor.memory import MemoryMeter
from memadvisor.profiler._device import Target
from memadvisor.profiler._graph import saved_storages
from memadvisor.profiler._walk import BackwardWalk
from memadvisor.workload import Workload, train_step
from memadvisor.workload import tensor_leaves as tensors_in

__all__ = [
    "LOSS_OWNER",
    "OTHER_OWNER",
    "MemoryMeasurement",
    "MemoryStep",
    "PhasePeakMeter",
    "tensors_in",
]

LOSS_OWNER = "<loss>"  # made while the loss was computed, outside every module
OTHER_OWNER = "<other>"  # made outside every named module (the model's own forward, glue)

_TO_COPY = torch.ops.aten._to_copy.default
StorageId = tuple[int, int]  # (id(storage), serial): unique even when Python reuses an id


@dataclasses.dataclass
class MemoryMeasurement:
    """What one metered step found, at one batch size and precision."""

    block_activation: list[int]
    block_input: list[int]
    block_output: list[int]
    block_transient: list[int]
    outside: dict[str, int]  # owner -> saved bytes
    activation_total: int
    cast_weight_bytes: int
    phases: dict[str, tuple[int, int | None]]  # phase -> (allocated, reserved)
    module_activation: dict[str, int]  # module name -> saved bytes it made itself
    module_grad: dict[str, int]  # module name -> gradient bytes of its subtree
    grad_bytes: int
    tracked_peak_bytes: int
    allocator_peak_bytes: int | None
    # Each block's input with its floating-point tensors at 2 bytes an element: what a unit
    # whose inputs are cast to bf16/fp16 (FSDP2's MixedPrecisionPolicy) holds of it.
    block_input_low: list[int] = dataclasses.field(default_factory=list)
    # The backward walk (memadvisor.profiler._walk), relative to end_of_forward.
    block_cast: list[int] = dataclasses.field(default_factory=list)
    block_output_kept: list[int] = dataclasses.field(default_factory=list)
    block_backward_start: list[int | None] = dataclasses.field(default_factory=list)
    block_backward_peak: list[int | None] = dataclasses.field(default_factory=list)
    end_of_forward: int | None = None
    backward_head_peak: int | None = None
    # phase -> the meter's (tracked) peak; with ``phases`` it gives what the allocator held
    # beyond tracked tensors in each phase (CUDA).
    phase_tracked: dict[str, int] = dataclasses.field(default_factory=dict)
    # The largest storage forward and the loss made (autocast's weight copies aside): what
    # grows with the batch (logits). Fake tensors planned for a card fit
    # StepProfile.largest_allocation from it.
    largest_allocation: int = 0
    # The largest storage made inside the blocks (autocast's weight copies aside): what the
    # step's largest allocation becomes where a strategy removes a larger one outside them
    # (the chunked loss's whole logits).
    largest_block_allocation: int = 0
    # For what no submodule made (<loss>, <other>): owner -> op name -> saved bytes, and the
    # submodule whose forward had finished last when the largest of them was made.
    outside_ops: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    outside_after: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class _Record:
    serial: int
    nbytes: int
    module: int  # index into MemoryStep.names; -1 outside every module
    block: int  # index into the blocks; -1 outside every block
    in_loss: bool
    cast_weight: bool
    # The storage itself: records are keyed by id(storage), and the id of one that died can
    # be taken by a storage the step did not make (a constant whose first Python wrapper is
    # made only when the graph is walked). Seen as a flaky extra b x row in a block.
    storage: weakref.ref
    op: str = ""  # the aten op that made it (``_log_softmax``), to name what no module owns
    after: int = -1  # the submodule whose forward finished last before it was made; -1 none


class _StepMeter(MemoryMeter):
    """The meter, also telling its storage listeners whether an op casts a weight.

    Autocast casts each weight to low precision once per forward (``aten._to_copy`` of a
    parameter); those copies are reported as ``cast_weight_bytes``, not as activations.
    """

    def __init__(self, param_keys: set[int]) -> None:
        super().__init__()
        self.param_keys = param_keys
        self.casting_weight = False
        self.op = ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # noqa: ANN001
        self.casting_weight = (
            func is _TO_COPY
            and bool(args)
            and isinstance(args[0], torch.Tensor)
            and id(args[0].untyped_storage()) in self.param_keys
        )
        self.op = func.overloadpacket.__name__
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.casting_weight = False
            self.op = ""


class PhasePeakMeter:
    """The peak of each phase: reset at a phase's start, read at its end."""

    def __init__(self, meter: MemoryMeter, target: Target) -> None:
        self.meter = meter
        self.target = target
        self.current: str | None = None
        self.allocated: dict[str, int] = {}
        self.reserved: dict[str, int] = {}
        self.tracked: dict[str, int] = {}
        self.base_outside = 0
        if target.is_cuda:
            # What the process holds besides this step's own tensors (the caller's model,
            # other work): left out, so the numbers read as a fresh process would.
            self.base_outside = torch.cuda.memory_allocated(target.device) - meter.live_bytes

    def start(self, phase: str) -> None:
        self.finish()
        self.current = phase
        self.meter.reset_peak()
        if self.target.is_cuda:
            torch.cuda.reset_peak_memory_stats(self.target.device)

    def finish(self) -> None:
        phase, self.current = self.current, None
        if phase is None:
            return
        tracked = self.meter.peak_bytes
        self.tracked[phase] = max(self.tracked.get(phase, 0), tracked)
        if self.target.is_cuda:
            dev = self.target.device
            allocated = torch.cuda.max_memory_allocated(dev) - self.base_outside
            reserved = torch.cuda.max_memory_reserved(dev) - self.base_outside
            self.reserved[phase] = max(self.reserved.get(phase, 0), reserved)
        else:
            allocated = tracked
        self.allocated[phase] = max(self.allocated.get(phase, 0), allocated)


class MemoryStep:
    """Runs one metered ``train_step`` on ``model`` and returns a :class:`MemoryMeasurement`.

    Args:
        model: the (private copy of the) model; hooks are added for the step and removed.
        block_names: qualified names of the blocks, in order.
        target: the device the step runs on.
    """

    def __init__(self, model: nn.Module, block_names: list[str], target: Target) -> None:
        self.model = model
        self.target = target
        named = list(model.named_modules())
        self.names = [n for n, _ in named]
        self.modules = [m for _, m in named]
        index = {n: i for i, n in enumerate(self.names)}
        self.block_of_module = {index[n]: bi for bi, n in enumerate(block_names)}
        self.n_blocks = len(block_names)

    # -- the step ---------------------------------------------------------------------------

    def run(
        self, workload: Workload, optimizer: torch.optim.Optimizer, batch: Any
    ) -> MemoryMeasurement:
        """One step of ``workload`` on ``batch``; the model and optimizer carry on from it."""
        self._reset()
        if self.target.is_cuda:
            # The allocator counts every tensor of the process: cyclic garbage from earlier
            # steps must not be freed inside this one. (The meter sees only this step's.)
            gc.collect()
            torch.cuda.synchronize(self.target.device)
            torch.cuda.empty_cache()
        params = [p for p in self.model.parameters()]
        meter = _StepMeter({id(p.untyped_storage()) for p in params})
        self.walk = BackwardWalk(
            meter, self.n_blocks, self._current_block, storage_key=self._step_storage
        )
        on_device = self._on_device
        meter.adopt(t for t in params if on_device(t))
        meter.adopt(t for t in self.model.buffers() if on_device(t))
        meter.adopt(t for t in _optimizer_tensors(optimizer) if on_device(t))
        meter.adopt(t for t in tensors_in(batch) if on_device(t))
        meter.add_storage_listener(self._on_storage)
        meter.add_listener(self._on_live)
        self.meter = meter
        self.peaks = PhasePeakMeter(meter, self.target)
        handles = self._install_hooks()
        try:
            with meter, self.walk.saving():
                train_step(self._capturing(workload), self.model, optimizer, batch,
                           on_phase=self._on_phase)  # fmt: skip
        finally:
            for h in handles:
                h.remove()
            self._loss = None
            self.peaks.finish()
        return self._measurement()

    def _on_device(self, t: torch.Tensor) -> bool:
        # On a card, host tensors (AdamW's step counters) are not the card's memory.
        return not self.target.is_cuda or t.device.type == "cuda"

    def _reset(self) -> None:
        self.records: dict[int, _Record] = {}
        self.serial = itertools.count()
        self.stack: list[int] = []
        self.block_stack: list[int] = []
        self.last_exited = -1
        self.recording = False
        self.in_loss = False
        self.window: list[int] | None = None  # [live at start, peak] of the running block
        self.windows: list[list[tuple[int, int]]] = [[] for _ in range(self.n_blocks)]
        self.inputs: list[dict[StorageId, int]] = [{} for _ in range(self.n_blocks)]
        self.inputs_low: list[dict[StorageId, int]] = [{} for _ in range(self.n_blocks)]
        self.outputs: list[dict[StorageId, int]] = [{} for _ in range(self.n_blocks)]
        self.saved: dict[int, torch.UntypedStorage] = {}
        self.grads: dict[str, int] = {}
        self.grad_bytes = 0
        self._loss: torch.Tensor | None = None

    def _capturing(self, workload: Workload) -> Workload:
        """``workload`` with its loss kept here, so the graph behind it can be walked."""

        def loss_fn(output: Any, batch: Any) -> torch.Tensor:
            self._loss = workload.loss(output, batch)
            return self._loss

        return dataclasses.replace(workload, loss_fn=loss_fn)

    # -- callbacks --------------------------------------------------------------------------

    def _on_phase(self, phase: str) -> None:
        if phase == "forward":
            self.recording = True
            self.peaks.start("forward")
        elif phase == "loss":
            self.in_loss = True  # still the forward phase: the loss is part of forward
        elif phase == "backward":
            if self._loss is not None:
                self.saved = saved_storages([self._loss])
                self._attribute()
            self.walk.begin_backward()
            self.recording = self.in_loss = False
            self.saved = {}
            self.peaks.start("backward")
        elif phase == "optimizer":
            self.walk.end_backward()
            self._measure_grads()
            self.peaks.start("optimizer")
        elif phase == "zero_grad":
            self.peaks.start("zero_grad")
        elif phase == "end":
            self.peaks.finish()

    def _on_storage(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        if not self.recording:
            return
        self.records[id(storage)] = _Record(
            serial=next(self.serial),
            nbytes=nbytes,
            module=self.stack[-1] if self.stack else -1,
            block=self.block_stack[-1] if self.block_stack else -1,
            in_loss=self.in_loss,
            cast_weight=self.meter.casting_weight,
            op=self.meter.op,
            after=self.last_exited,
            storage=weakref.ref(storage),
        )

    def _record_of(self, storage: torch.UntypedStorage) -> _Record | None:
        """This step's record of ``storage``; None when the step did not make it."""
        rec = self.records.get(id(storage))
        return rec if rec is not None and rec.storage() is storage else None

    def _on_live(self, _delta: int, live: int) -> None:
        if self.window is not None and live > self.window[1]:
            self.window[1] = live
        self.walk.on_live(live)

    def _current_block(self) -> int:
        return self.block_stack[-1] if self.block_stack else -1

    def _install_hooks(self) -> list[Any]:
        handles = []
        for i, module in enumerate(self.modules):
            handles.append(module.register_forward_pre_hook(self._pre(i), with_kwargs=True))
            handles.append(module.register_forward_hook(self._post(i), always_call=True))
        return handles

    def _pre(self, i: int) -> Any:
        block = self.block_of_module.get(i)

        def hook(_module: nn.Module, args: Any, kwargs: Any) -> None:
            self.stack.append(i)
            if block is None or not self.recording:
                return
            self.block_stack.append(block)
            live = self.meter.live_bytes
            self.window = [live, live]
            for t in tensors_in((args, kwargs)):
                sid = self._step_storage(t)
                if sid is not None:
                    nbytes = self.records[sid[0]].nbytes
                    self.inputs[block][sid] = nbytes
                    self.inputs_low[block][sid] = _at_two_bytes(t, nbytes)

        return hook

    def _post(self, i: int) -> Any:
        block = self.block_of_module.get(i)

        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if i in self.stack:  # always_call: also runs when forward raised
                del self.stack[len(self.stack) - 1 - self.stack[::-1].index(i) :]
            if self.names[i]:  # a submodule, not the model itself
                self.last_exited = i
            if block is None or not self.block_stack or self.block_stack[-1] != block:
                return
            self.block_stack.pop()
            if self.window is not None:
                self.windows[block].append((self.window[0], self.window[1]))
                self.window = None
            for t in tensors_in(output):
                sid = self._step_storage(t)
                if sid is not None and self.records[sid[0]].block == block:
                    self.outputs[block][sid] = self.records[sid[0]].nbytes
            self.walk.watch_output(block, tensors_in(output), self.outputs[block])

        return hook

    def _step_storage(self, t: torch.Tensor) -> StorageId | None:
        """The storage's identity if this step made it (its record is checked to be its own:
        an id alone can be a dead storage's)."""
        if t.device.type == "meta":
            return None
        storage = t.untyped_storage()
        rec = self._record_of(storage)
        return (id(storage), rec.serial) if rec is not None else None

    # -- accounting -------------------------------------------------------------------------

    def _attribute(self) -> None:
        self.block_activation = [0] * self.n_blocks
        self.block_cast = [0] * self.n_blocks
        self.outside: dict[str, int] = {}
        self.outside_ops: dict[str, dict[str, int]] = {}
        largest: dict[str, _Record] = {}
        self.module_activation: dict[str, int] = {}
        self.activation_total = 0
        self.cast_weight_bytes = 0
        for storage in self.saved.values():
            rec = self._record_of(storage)
            if rec is None:
                continue  # existed before the step: a weight, the batch, a constant
            if self.target.is_cuda and storage.device.type != "cuda":
                continue  # packed to host memory by a saved-tensors hook: not on the card
            if rec.cast_weight:
                self.cast_weight_bytes += rec.nbytes
                if rec.block >= 0:
                    self.block_cast[rec.block] += rec.nbytes
                continue
            self.activation_total += rec.nbytes
            owner = self._owner(rec)
            self.module_activation[owner] = self.module_activation.get(owner, 0) + rec.nbytes
            if rec.block >= 0:
                self.block_activation[rec.block] += rec.nbytes
            else:
                self.outside[owner] = self.outside.get(owner, 0) + rec.nbytes
                if owner in (LOSS_OWNER, OTHER_OWNER):
                    ops = self.outside_ops.setdefault(owner, {})
                    ops[rec.op or "?"] = ops.get(rec.op or "?", 0) + rec.nbytes
                    if owner not in largest or rec.nbytes > largest[owner].nbytes:
                        largest[owner] = rec
        self.outside_after = {
            owner: self.names[rec.after] for owner, rec in largest.items() if rec.after >= 0
        }

    def _owner(self, rec: _Record) -> str:
        name = self.names[rec.module] if rec.module >= 0 else ""
        if name:
            return name
        return LOSS_OWNER if rec.in_loss and rec.module < 0 else OTHER_OWNER

    def _measure_grads(self) -> None:
        seen: dict[int, int] = {}
        for p in self.model.parameters():
            if p.grad is not None and self._on_device(p.grad):
                st = p.grad.untyped_storage()
                seen[id(st)] = st.nbytes()
        self.grad_bytes = sum(seen.values())
        for name, module in zip(self.names, self.modules, strict=True):
            mine: dict[int, int] = {}
            for p in module.parameters():
                if p.grad is not None and self._on_device(p.grad):
                    st = p.grad.untyped_storage()
                    mine[id(st)] = st.nbytes()
            self.grads[name] = sum(mine.values())

    def _measurement(self) -> MemoryMeasurement:
        if not hasattr(self, "block_activation"):
            self._attribute()  # no loss was captured: nothing was saved
        shared = _shared_inputs(self.inputs)
        block_input, block_input_low = (
            [sum(n for sid, n in ins.items() if sid not in shared) for ins in inputs]
            for inputs in (self.inputs, self.inputs_low)
        )
        transient = [
            max([0] + [peak - start - self.block_activation[b] for start, peak in self.windows[b]])
            for b in range(self.n_blocks)
        ]
        peaks = self.peaks
        order = ("forward", "backward", "optimizer", "zero_grad")
        phases = {
            ph: (peaks.allocated[ph], peaks.reserved.get(ph) if self.target.is_cuda else None)
            for ph in order
            if ph in peaks.allocated
        }
        return MemoryMeasurement(
            block_activation=self.block_activation,
            block_input=block_input,
            block_input_low=block_input_low,
            block_output=[sum(o.values()) for o in self.outputs],
            block_transient=transient,
            outside=self.outside,
            activation_total=self.activation_total,
            cast_weight_bytes=self.cast_weight_bytes,
            phases=phases,
            module_activation=self.module_activation,
            module_grad=self.grads,
            grad_bytes=self.grad_bytes,
            tracked_peak_bytes=max(peaks.tracked.values(), default=0),
            allocator_peak_bytes=(
                max(peaks.allocated.values(), default=0) if self.target.is_cuda else None
            ),
            block_cast=self.block_cast,
            block_output_kept=self.walk.output_kept(),
            block_backward_start=self.walk.start,
            block_backward_peak=self.walk.peak,
            end_of_forward=self.walk.end_of_forward,
            backward_head_peak=self.walk.head_peak,
            phase_tracked=dict(peaks.tracked),
            largest_allocation=max(
                (r.nbytes for r in self.records.values() if not r.cast_weight), default=0
            ),
            largest_block_allocation=max(
                (r.nbytes for r in self.records.values() if r.block >= 0 and not r.cast_weight),
                default=0,
            ),
            outside_ops=self.outside_ops,
            outside_after=self.outside_after,
        )


def _at_two_bytes(t: torch.Tensor, nbytes: int) -> int:
    """``nbytes`` of ``t``'s storage as they would be cast to a 2-byte floating dtype (what
    FSDP2's ``cast_forward_inputs`` makes of a unit's floating inputs); other dtypes as they
    are."""
    if not t.is_floating_point():
        return nbytes
    return nbytes * 2 // t.element_size()


def _shared_inputs(inputs: list[dict[StorageId, int]]) -> set[StorageId]:
    """Storages that are an input of more than one block (a mask, rotary tables).

    A checkpointed block adds nothing for them: they are kept for every block anyway.
    """
    seen: set[StorageId] = set()
    shared: set[StorageId] = set()
    for ins in inputs:
        for sid in ins:
            (shared if sid in seen else seen).add(sid)
    return shared


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from tensors_in(state)
