"""A step's memory over time, for people: the timeline (and its speedscope flame graph), and
on CUDA the allocator's own snapshot with torch's viewer.

Both record one more step of a private copy of the model, after a warm-up step so the
optimizer's state exists, and put every RNG back, as :func:`profile_workload` does. The
timeline is :mod:`memadvisor.timeline`'s (one format for the profiler and the monitor):
its ``to_speedscope()`` gives the flame graph weighted by bytes.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch

from memadvisor._torch_private import memory_snapshot, memory_snapshot_html, record_memory_history
from memadvisor.errors import BadInputError
from memadvisor.files import write_bytes_atomic, write_text_atomic
from memadvisor.memory import MemoryMeter
from memadvisor.process_state import rng_restored
from memadvisor.profiler._device import Target, resolve_target
from memadvisor.profiler._memory_step import tensors_in
from memadvisor.profiler._profile import autocast_workload
from memadvisor.profiler._state import private_model
from memadvisor.schema.precision import PRECISIONS
from memadvisor.timeline import (
    CudaMemoryReader,
    MeterMemoryReader,
    ModuleEventRecorder,
    Timeline,
)
from memadvisor.workload import Workload, train_step

__all__ = ["record_timeline", "write_memory_snapshot"]


def record_timeline(
    workload: Workload,
    *,
    batch_size: int | None = None,
    precision: str = "fp32",
    device: str = "auto",
    max_events: int = 100_000,
) -> Timeline:
    """One training step recorded module by module: enter/exit in forward and backward,
    phase marks, and the bytes allocated at each event.

    On the CPU (and under fake tensors) a :class:`~memadvisor.memory.MemoryMeter` counts the
    step's tensors and every allocation and free is an event; on CUDA the allocator's
    allocated/reserved bytes are read at each event (the whole process's, as it reports them).

    Args:
        workload: the model and its step; the model itself is not changed.
        batch_size: the batch to record; the sample batch's size if None.
        precision: fp32, or bf16/fp16 autocast around the model's forward.
        device: auto, cpu or cuda (as for :func:`profile_workload`).
        max_events: the newest events kept.

    Raises:
        BadInputError: an unknown or unsupported precision, a bad batch size or device.
    """
    target = resolve_target(workload.model, device)
    step_wl, b = _checked(workload, target, precision, batch_size)
    with (
        rng_restored(uses_cuda=target.is_cuda),
        private_model(workload.model, target.device) as model,
    ):
        optimizer = _warmed_optimizer(step_wl, model, target, b)
        batch = workload.batch(b, target.device)
        kwargs: dict[str, Any] = {
            "max_events": max_events,
            "device": str(target.device) if not target.fake else target.kind,
            "model_name": type(workload.model).__name__,
        }
        if target.is_cuda:
            reader = CudaMemoryReader(target.device, interval_peaks=True)
            with ModuleEventRecorder(model, reader, **kwargs) as rec:
                train_step(step_wl, model, optimizer, batch, on_phase=rec.mark_phase)
            return rec.timeline()
        meter = MemoryMeter()
        meter.adopt(model.parameters())
        meter.adopt(model.buffers())
        meter.adopt(t for s in optimizer.state.values() for t in tensors_in(s))
        meter.adopt(tensors_in(batch))
        rec = ModuleEventRecorder(model, MeterMemoryReader(meter), **kwargs)
        # Every change of the count is an event, so no rise or fall between hooks is missed.
        meter.add_listener(lambda _delta, _live: rec.record("alloc"))
        with rec, meter:
            train_step(step_wl, model, optimizer, batch, on_phase=rec.mark_phase)
        return rec.timeline()


def write_memory_snapshot(
    workload: Workload,
    path: str | Path,
    *,
    html_path: str | Path | None = None,
    batch_size: int | None = None,
    precision: str = "fp32",
    max_entries: int = 100_000,
) -> Path:
    """Record one CUDA training step in the allocator's history and write its snapshot.

    ``path`` gets the pickled snapshot (open it at https://pytorch.org/memory_viz);
    ``html_path``, if given, torch's viewer page with the snapshot embedded (the page loads
    torch's viewer script from a CDN: it needs a network connection to open).

    Raises:
        BadInputError: no CUDA device, or an unknown precision or bad batch size.
    """
    target = resolve_target(workload.model, "cuda")
    if not target.is_cuda:
        raise BadInputError(
            "The allocator snapshot is CUDA's: this model runs on fake tensors. Use "
            "record_timeline() for a memory timeline on any device."
        )
    step_wl, b = _checked(workload, target, precision, batch_size)
    with rng_restored(uses_cuda=True), private_model(workload.model, target.device) as model:
        optimizer = _warmed_optimizer(step_wl, model, target, b)
        batch = workload.batch(b, target.device)
        record_memory_history(True, max_entries=max_entries)
        try:
            train_step(step_wl, model, optimizer, batch)
            torch.cuda.synchronize(target.device)
            snapshot = memory_snapshot()
        finally:
            record_memory_history(False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomic(path, pickle.dumps(snapshot), "the memory snapshot")
    if html_path is not None:
        html_path = Path(html_path)
        html_path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(html_path, memory_snapshot_html(snapshot), "the snapshot's page")
    return path


def _checked(
    workload: Workload, target: Target, precision: str, batch_size: int | None
) -> tuple[Workload, int]:
    if precision not in PRECISIONS or not target.supports(precision):
        raise BadInputError(
            f"precision must be one of {PRECISIONS} that {target.kind} autocast runs, "
            f"but got {precision=}."
        )
    b = workload.sample_batch_size if batch_size is None else batch_size
    if not isinstance(b, int) or b <= 0:
        raise BadInputError(f"batch_size must be a positive int, but got {batch_size=}.")
    return autocast_workload(workload, precision, target), b


def _warmed_optimizer(workload: Workload, model: Any, target: Target, b: int) -> Any:
    """The model's optimizer, after one step (so its state exists, as in steady state)."""
    optimizer = workload.make_optimizer(model)
    train_step(workload, model, optimizer, workload.batch(b, target.device))
    return optimizer
