"""What the caching allocator holds that no dispatch mode sees, at batches large enough to show it.

cuDNN allocates its convolution workspaces through the caching allocator from inside its own
C++ code: a ``TorchDispatchMode`` never sees them. At the profile's small batch sizes they sit,
with cuBLAS's workspaces, in a near-constant difference between the allocator's peak and the
tracked one (``Profile.fixed_overhead_bytes``). From some tensor size on, cuDNN picks
algorithms whose workspace grows with the batch, which the small sizes cannot show.

Left out, the estimate fell well under the allocator's peak at batches filling a card
(``docs/design.md``, "cuDNN's workspaces grow with the batch", has the table). So on CUDA
the profiler measures the difference per phase at two larger sizes ``(B, 2B)``
(:func:`untracked_batch_sizes`) and fits a line; where the growth has not started yet the
line is above the truth, which errs on the safe side; the estimate adds what the line gives
beyond what its phase peaks already hold.

Each size gets one plain warm-up step (cuDNN's choice for the shape is made, caches filled),
then one step under a bare :class:`~memadvisor.memory.MemoryMeter` with the allocator's peak
reset at each phase: no per-block hooks, so the step costs little more than training.
"""

from __future__ import annotations

import gc
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memadvisor._torch_private import clear_cublas_workspaces
from memadvisor.memory import MemoryMeter
from memadvisor.profiler._device import Target
from memadvisor.profiler._memory_step import PhasePeakMeter, tensors_in
from memadvisor.schema.profile import LinearBytes, UntrackedBytes
from memadvisor.workload import Workload, train_step

__all__ = [
    "UNTRACKED_BATCH_BYTES",
    "UNTRACKED_FREE_FRACTION",
    "fit_untracked",
    "LargestAllocation",
    "measure_untracked",
    "untracked_batch_sizes",
    "untracked_step",
]

# B is chosen by bytes, not by a multiple of the sample batch: cuDNN picks an algorithm (and
# so its workspace) from the tensors' sizes. 2 GiB at B (4 GiB at 2B) is past where the
# growth starts for the models measured, and 2B - B wide enough that the readings' noise
# moves the slope little; a multiple of the sample batch can straddle the knee and double the
# slope (docs/design.md, "Choosing the untracked sizes").
UNTRACKED_BATCH_BYTES = 2 * 2**30
# 2B may need at most this share of the memory free on the card when the pass gets there: the
# rest is the allocator's fragmentation, the workspaces themselves and anything else running.
UNTRACKED_FREE_FRACTION = 0.5

UntrackedFit = tuple[tuple[int, int], list[UntrackedBytes]]


def untracked_batch_sizes(
    per_sample_bytes: float, profiled: tuple[int, int], free_bytes: int
) -> tuple[int, int] | None:
    """The sizes ``(B, 2B)`` the untracked bytes are measured at, or None when none fit.

    ``B`` holds :data:`UNTRACKED_BATCH_BYTES` of batch-dependent bytes, and is at least the
    profile's larger size (the line must reach past what was measured); ``2B`` may need at
    most :data:`UNTRACKED_FREE_FRACTION` of ``free_bytes``.

    Args:
        per_sample_bytes: what one more sample adds to the step's peak (the profile's line).
        profiled: the profile's two batch sizes.
        free_bytes: memory free on the card now.
    """
    if per_sample_bytes <= 0:
        return None  # nothing grows with the batch, so no workspace grows with it either
    wanted = max(profiled[1], math.ceil(UNTRACKED_BATCH_BYTES / per_sample_bytes))
    largest = int(UNTRACKED_FREE_FRACTION * free_bytes / (2 * per_sample_bytes))
    b = min(wanted, largest)
    return (b, 2 * b) if b >= profiled[1] else None


def fit_untracked(
    sizes: tuple[int, int],
    measured: tuple[dict[str, int], dict[str, int]],
    profiled: dict[str, int],
) -> list[UntrackedBytes]:
    """Per phase, the line through the untracked bytes measured at ``sizes``.

    Args:
        sizes: the two batch sizes.
        measured: per size, phase -> allocator minus tracked peak.
        profiled: phase -> the same difference at the profile's larger size (what the
            phase's measured peak already holds); 0 where absent.
    """
    (b1, b2), (u1, u2) = sizes, measured
    return [
        UntrackedBytes(
            phase=phase,
            untracked=LinearBytes.fit(b1, u1[phase], b2, u2[phase]),
            profiled_bytes=max(0, profiled.get(phase, 0)),
        )
        for phase in u2
        if phase in u1
    ]


def measure_untracked(
    measure: Callable[[int], dict[str, int]],
    sizes: tuple[int, int] | None,
    profiled: dict[str, int],
    is_oom: Callable[[BaseException], bool],
) -> UntrackedFit | None:
    """Measure at both sizes with ``measure(b)`` and fit; None when skipped or out of memory.

    An out-of-memory error means the card is busier than its free memory said: the profile
    goes on without the lines (the estimate then adds nothing, as before they existed).
    Anything else is raised unchanged.
    """
    if sizes is None:
        return None
    try:
        measured = (measure(sizes[0]), measure(sizes[1]))
    except Exception as e:
        if not is_oom(e):
            raise
        return None
    return sizes, fit_untracked(sizes, measured, profiled)


def untracked_step(
    model: nn.Module,
    optimizer: Any,
    workload: Workload,
    batch: Any,
    target: Target,
    largest: LargestAllocation | None = None,
) -> dict[str, int]:
    """One CUDA step: per phase, the allocator's peak minus the tracked peak.

    cuBLAS's workspaces are freed first and made again inside the step, as in a fresh
    process: they are part of the difference, as they are of ``fixed_overhead_bytes``.
    ``largest``, when given, sees every storage the step makes.
    """
    dev = target.device
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    clear_cublas_workspaces()
    meter = MemoryMeter()
    on_card = [t for t in _step_tensors(model, optimizer, batch) if t.device.type == "cuda"]
    meter.adopt(on_card)
    del on_card
    if largest is not None:
        meter.add_storage_listener(largest)
    peaks = PhasePeakMeter(meter, target)

    def on_phase(phase: str) -> None:
        if phase == "end":
            peaks.finish()
        elif phase != "loss":  # the loss is part of forward, as in the metered step
            peaks.start(phase)

    with meter:
        train_step(workload, model, optimizer, batch, on_phase=on_phase)
    peaks.finish()
    torch.cuda.synchronize(dev)
    return {ph: max(0, peaks.allocated[ph] - peaks.tracked[ph]) for ph in peaks.allocated}


class LargestAllocation:
    """The largest single storage a :class:`~memadvisor.memory.MemoryMeter` saw made.

    Why it matters on a card: ``set_per_process_memory_fraction`` caps *reserved* bytes, and
    a freed block of the step's largest tensor can be split by smaller requests and left
    stranded for the next step's largest one (``docs/design.md``, "Reserved above
    allocated": the GPT example's failures under a cap, and the gap of about one largest
    tensor between reserved and allocated). An uncapped allocator just adds a block.
    """

    def __init__(self, device_type: str = "cuda") -> None:
        self.device_type = device_type
        self.bytes = 0

    def __call__(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        if nbytes > self.bytes and storage.device.type == self.device_type:
            self.bytes = nbytes


def _step_tensors(model: nn.Module, optimizer: Any, batch: Any) -> list[torch.Tensor]:
    tensors = [*model.parameters(), *model.buffers(), *tensors_in(batch)]
    for state in optimizer.state.values():
        tensors.extend(tensors_in(state))
    return tensors
