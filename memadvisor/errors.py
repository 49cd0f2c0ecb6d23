"""The exceptions memadvisor raises.

One base class, :class:`MemadvisorError`; the CLI catches only these and turns each into one
message on stderr and the exit code named on its class. Anything else is a bug in memadvisor
(or in the user's model) and keeps its traceback.

:func:`is_oom` is the one place that decides "is this an out-of-memory error?": the
simulated device's error below and the CUDA stack's own both count, so every stage that
runs a step (workload, profiler, devices, strategies' trials) asks it and re-raises
anything else unchanged.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = [
    "BadInputError",
    "InfeasibleBudgetError",
    "MemadvisorError",
    "PlanningError",
    "SimulatedOutOfMemoryError",
    "is_oom",
    "is_our_bug",
]

# memadvisor and its built-in strategies, installed side by side (pyproject.toml).
_OUR_CODE = tuple(
    f"{Path(__file__).resolve().parents[1] / name}/" for name in ("memadvisor", "strategies")
)


class MemadvisorError(Exception):
    """Base class of every error memadvisor raises on purpose."""

    exit_code: int = 1


class BadInputError(MemadvisorError, ValueError):
    """The model, batch, loss, target or an option is not usable as given."""

    exit_code = 2


class InfeasibleBudgetError(MemadvisorError):
    """No configuration memadvisor knows fits the budget."""

    exit_code = 3

    def __init__(
        self,
        message: str,
        *,
        minimum_bytes: int | None = None,
        minimum_gib: str | None = None,
        advice: str = "",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.minimum_bytes = minimum_bytes
        self.minimum_gib = minimum_gib
        # Sentences after the minimum: what takes the bytes and what would shrink them.
        self.advice = advice
        # How the caller passes a budget: Python's keyword by default; the CLI sets its flag.
        self.option = "budget_gb="
        # The fewest FSDP2 ranks whose per-rank estimate fits (None: none up to 64, or no
        # strategy plans ranks); the advice names it too.
        self.sharded_world_size: int | None = None

    def __str__(self) -> str:
        if self.minimum_gib is None:
            return self.message + self.advice
        return f"{self.message} pass {self.option}{self.minimum_gib} or more.{self.advice}"


class PlanningError(MemadvisorError):
    """Planning failed for a reason that is neither bad input nor the budget."""

    exit_code = 4


class SimulatedOutOfMemoryError(MemadvisorError, torch.OutOfMemoryError):
    """The simulated device's tracked bytes passed its budget.

    It is a ``torch.OutOfMemoryError`` so that code written for a card (ours and the user's)
    treats it exactly as it treats the CUDA allocator's error.
    """

    exit_code = 4

    def __init__(self, requested_bytes: int, live_bytes: int, budget_bytes: int) -> None:
        gib = 2**30
        super().__init__(
            f"Simulated device out of memory: tried to allocate {requested_bytes / gib:.3f} GiB "
            f"with {live_bytes / gib:.3f} GiB already allocated, over the budget of "
            f"{budget_bytes / gib:.3f} GiB."
        )
        self.requested_bytes = requested_bytes
        self.live_bytes = live_bytes
        self.budget_bytes = budget_bytes


# Messages the CUDA stack uses for an allocation failure that arrives as a plain RuntimeError
# (cuDNN and cuBLAS report their own allocation failures this way, not as OutOfMemoryError).
_OOM_MESSAGES = (
    "CUDA out of memory",
    "CUDA error: out of memory",
    "CUDNN_STATUS_ALLOC_FAILED",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "cuDNN error: CUDNN_STATUS_NOT_ENOUGH_WORKSPACE",
    "Simulated device out of memory",
)


def is_oom(error: BaseException) -> bool:
    """True when ``error`` means the device ran out of memory.

    ``torch.OutOfMemoryError`` (which the simulated device's error subclasses) and the CUDA,
    cuDNN and cuBLAS allocation messages count; anything else does not, and the caller
    re-raises it unchanged.
    """
    if isinstance(error, torch.OutOfMemoryError):
        return True
    if isinstance(error, RuntimeError) and len(error.args) == 1:
        message = str(error.args[0])
        return any(m in message for m in _OOM_MESSAGES)
    return False


def _raised_in_our_code(error: BaseException) -> bool:
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = str(Path(tb.tb_frame.f_code.co_filename).resolve())
    return filename.startswith(_OUR_CODE)


def is_our_bug(error: BaseException) -> bool:
    """Whether ``error`` is a bug in memadvisor: raised by a line of its own code (the
    innermost frame of the traceback, here or along the chain of causes a wrapper such as
    dynamo's BackendCompilerFailed keeps), not by torch or the user's model, and neither one
    of its errors on purpose (:class:`MemadvisorError`) nor running out of memory.

    Code that turns failures into answers ("the model rejected the batch", "does not
    compile") asks this first and re-raises what is ours, so our bugs keep their traceback.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if (
            not isinstance(current, MemadvisorError)
            and not is_oom(current)
            and _raised_in_our_code(current)
        ):
            return True
        inner = getattr(current, "inner_exception", None)
        current = inner if isinstance(inner, BaseException) else current.__cause__
    return False
