"""The operations that allocate most in one training step, each attributed to its module.

What ``torch.profiler``'s ``key_averages()`` sorted by self memory shows, grouped by the
module that ran the op (forward) or whose backward ran it, so a row reads "``lm_head``'s
``mm`` made 786 MiB in forward". One step of a private copy of the model is run under a
:class:`~memadvisor.memory.MemoryMeter` (the bytes of every storage an op makes, on the CPU
and on CUDA alike) with a :class:`~memadvisor.timeline.ModuleEventRecorder` for the module.

Known limitations:
    * Bytes are what each op's new storages hold when made (``self`` allocations, as the
      profiler's "self memory" counts them without subtracting frees); a temporary freed at
      once counts as much as a kept tensor. The activation tables say what is kept.
    * Backward ops are charged to the innermost module whose backward has begun and not
      ended (gradient hooks mark them); ops after the last such hook go to ``(backward)``.
"""

from __future__ import annotations

from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from memadvisor.memory import MemoryMeter
from memadvisor.profiler._device import resolve_target
from memadvisor.profiler._memory_step import tensors_in
from memadvisor.profiler._state import private_model, rng_restored
from memadvisor.timeline import ModuleEventRecorder
from memadvisor.workload import Workload, train_step

__all__ = ["OpAllocation", "top_allocations"]


class OpAllocation(BaseModel):
    """One op in one module and phase, summed over its calls in the step."""

    model_config = ConfigDict(extra="forbid")

    op: str = Field(description="The aten op, e.g. 'mm' or '_log_softmax'.")
    module: str = Field(description="Qualified module name; '' is the model's own forward.")
    phase: str = Field(description="forward (the loss included), backward or optimizer.")
    calls: int = Field(ge=1)
    allocated_bytes: int = Field(ge=0, description="Bytes of the storages its calls made.")


class _OpMeter(MemoryMeter):
    """The meter, charging each new storage to the op that made it and where it ran."""

    def __init__(self, where: Any) -> None:
        super().__init__()
        self.where = where  # () -> (module, phase)
        self.op = ""
        self.rows: dict[tuple[str, str, str], list[int]] = {}
        self.add_storage_listener(self._on_storage)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # noqa: ANN001
        self.op = func.overloadpacket.__name__
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        finally:
            self.op = ""

    def _on_storage(self, _storage: torch.UntypedStorage, nbytes: int) -> None:
        if not self.op:  # adopted, not made by an op
            return
        module, phase = self.where()
        row = self.rows.setdefault((self.op, module, phase), [0, 0])
        row[0] += 1
        row[1] += nbytes


class _Where:
    """Which module and phase the step is in, from the recorder's enter/exit events."""

    def __init__(self, recorder: ModuleEventRecorder) -> None:
        self.recorder = recorder
        self.phase = "forward"
        self.backward: list[str] = []
        recorder.add_listener(self._on_module)

    def mark(self, phase: str) -> None:
        self.recorder.mark_phase(phase)
        if phase != "loss":  # the loss is part of forward, as in the profile
            self.phase = phase

    def _on_module(self, kind: str, module: str, pass_: str) -> None:
        if pass_ != "backward":
            return
        if kind == "enter":
            self.backward.append(module)
        elif module in self.backward:
            del self.backward[len(self.backward) - 1 - self.backward[::-1].index(module) :]

    def __call__(self) -> tuple[str, str]:
        if self.phase == "backward":
            return (self.backward[-1] if self.backward else "(backward)"), "backward"
        if self.phase == "forward":
            return self.recorder.current_module() or "", "forward"
        return "", self.phase


def top_allocations(
    workload: Workload, *, batch_size: int | None = None, device: str = "auto", top: int = 15
) -> list[OpAllocation]:
    """The ``top`` (op, module, phase) rows of one step by bytes allocated, largest first.

    Args:
        workload: the model and its step; a private copy runs it (the model is not changed).
        batch_size: the batch to run; the sample batch's size if None.
        device: auto, cpu or cuda (as for :func:`~memadvisor.profiler.profile_workload`).
        top: how many rows to return.
    """
    target = resolve_target(workload.model, device)
    b = batch_size or workload.sample_batch_size
    with (
        rng_restored(uses_cuda=target.is_cuda),
        private_model(workload.model, target.device) as model,
    ):
        optimizer = workload.make_optimizer(model)
        train_step(workload, model, optimizer, workload.batch(b, target.device))  # warm-up
        batch = workload.batch(b, target.device)
        recorder = ModuleEventRecorder(model, lambda: (0, None), model_name="")
        where = _Where(recorder)
        meter = _OpMeter(where)
        meter.adopt(model.parameters())
        meter.adopt(t for s in optimizer.state.values() for t in tensors_in(s))
        meter.adopt(tensors_in(batch))
        with recorder, meter:
            train_step(workload, model, optimizer, batch, on_phase=where.mark)
    rows = [
        OpAllocation(op=op, module=module, phase=phase, calls=calls, allocated_bytes=nbytes)
        for (op, module, phase), (calls, nbytes) in meter.rows.items()
        if nbytes > 0
    ]
    rows.sort(key=lambda r: r.allocated_bytes, reverse=True)
    return rows[:top]
