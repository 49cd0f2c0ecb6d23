"""Host <-> device copy bandwidth: what activation offload's transfers cost.

Measured once per profile on CUDA with pinned host memory (what
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` copies to and from); what to expect is
in ``docs/design.md``, "Host bandwidth for offload".
"""

from __future__ import annotations

import statistics

import torch

from memadvisor.errors import BadInputError

__all__ = ["measure_host_bandwidth"]

MIB = 2**20


def measure_host_bandwidth(
    device: torch.device | str = "cuda", nbytes: int = 64 * MIB, repeats: int = 5
) -> float:
    """Bytes per millisecond of the slower direction of a pinned host <-> ``device`` copy.

    Each direction is copied ``repeats`` times after one warm-up copy and timed with CUDA
    events; the median of each is kept, and the smaller of the two returned (offload pays
    both: device -> host in forward, host -> device in backward).

    Raises:
        BadInputError: ``device`` is not a CUDA device or CUDA is not available, or
            ``nbytes`` / ``repeats`` are not positive.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise BadInputError(
            f"Host bandwidth is measured on a CUDA device, but got {device=} "
            f"(CUDA available: {torch.cuda.is_available()})."
        )
    if nbytes <= 0 or repeats <= 0:
        raise BadInputError(f"nbytes and repeats must be positive, but got {nbytes=}, {repeats=}.")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    card = torch.empty(nbytes, dtype=torch.uint8, device=device)
    medians = []
    for dst, src in ((host, card), (card, host)):
        dst.copy_(src, non_blocking=True)  # warm-up: first copies pay for setup
        times = []
        for _ in range(repeats):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        medians.append(statistics.median(times))
    del host, card
    return nbytes / max(medians)
