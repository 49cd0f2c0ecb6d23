"""What the caching allocator holds that no dispatch mode sees, at batches large enough to show it.

cuDNN allocates its convolution workspaces through the caching allocator from inside its own
C++ code: a ``TorchDispatchMode`` never sees them. At the profile's small batch sizes they sit,
with cuBLAS's workspaces, in a near-constant difference between the allocator's peak and the
tracked one (``Profile.fixed_overhead_bytes``). From some tensor size on, cuDNN picks
algorithms whose workspace grows with the batch, which the small sizes cannot show.

Measured on an H200 (torch 2.11): allocator minus tracked peak of backward, one AdamW step
after a warm-up, MiB at batch 16 / 32 / 64 / 128 / 256:

    examples/cnn.py fp32, no block or every block checkpointed   65 / 67 / 157 / 249 / 433
    examples/cnn.py bf16, either                                  65 / 65 /  65 /  65 /  65
    resnet18 fp32, none                                           84 / 87 / 102 / 108 / 119
    resnet18 fp32, every block checkpointed                       85 / 99 / 120 / 169 / 265
    convnext_tiny fp32, none                                      69 / 85 / 107 / 153 / 184
    examples/gpt.py, any                                          ~35, flat

Left out, the estimate was 17% (30% with every block checkpointed) under the allocator's
peak for cnn fp32 at batches filling 4 GiB. So on CUDA the profiler measures the difference
per phase at two larger sizes ``(B, 2B)`` (:func:`untracked_batch_sizes`) and fits a line
(cnn fp32 through 64 and 128: 65 + 1.44 MiB a sample, exact at 256; above the truth where
the growth has not started, 111 against 67 at batch 32, which errs on the safe side); the
estimate adds what the line gives beyond what its phase peaks already hold.

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
# so its workspace) from the tensors' sizes. cnn fp32's workspace starts growing between
# batch 32 and 64, where the batch-dependent bytes pass 0.2-0.45 GiB; in bf16 (half the bytes
# per sample) it has not started at 256 (0.9 GiB). 2 GiB at B (4 GiB at 2B) is well past the
# start for cnn, and 2B - B wide enough that ~10 MiB of noise (convnext_tiny's readings at
# small batches wander by that much) moves the slope little. A 4 GiB step takes a fraction of
# a second on a card. A multiple of the sample batch (16 x 2 = 32) would straddle cnn's knee:
# the line through 32 and 64 doubles the slope and overestimates batch 580 by 700 MiB.
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
    stranded for the next step's largest one. The GPT example in bf16 on an H200 under
    8 GiB: every run that failed (batch 335 to 375) passed step 1 and ran out in step 2
    asking for its logits (2.01-2.25 GiB) with as much again reserved but unallocated; at
    batch 291 it held 5.73 GiB allocated and 7.45 GiB reserved, a gap of 1.72 GiB where its
    largest tensor is 1.75 GiB. Measured uncapped, reserved minus allocated stays far
    smaller (0.4 GiB at batch 204): an uncapped allocator just adds a block.
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
