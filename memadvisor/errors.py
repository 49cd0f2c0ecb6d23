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

import sysconfig
import traceback
from collections.abc import Collection, Sequence
from pathlib import Path
from types import CodeType
from typing import Any

import torch

__all__ = [
    "ALLOCATOR_RETRIES",
    "RETRIED_STEPS_SHARE",
    "AllocatorRetriesError",
    "BadInputError",
    "InfeasibleBudgetError",
    "MemadvisorError",
    "PlanningError",
    "ProbeProcessError",
    "SimulatedOutOfMemoryError",
    "UserCodeError",
    "check_allocator_retries",
    "is_oom",
    "is_our_bug",
    "mark_retry_ran_out",
    "ran_out_by_retries",
    "retry_ran_out",
    "root_cause",
    "user_code_frame",
    "validation_problems",
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


class UserCodeError(BadInputError):
    """Code the user gave raised (the model's forward or backward, ``loss_fn``,
    ``make_batch``, the optimizer factory): theirs to fix, not a bug in memadvisor.

    The message names what raised, the exception, the user's line, and what to check; the
    original exception is the ``__cause__`` (``--debug`` prints both tracebacks).
    """

    def __init__(self, message: str, *, frame: traceback.FrameSummary | None = None) -> None:
        super().__init__(message)
        self.frame = frame


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


class ProbeProcessError(PlanningError):
    """A probe process failed with an error of its own (not an OOM, not bad input).

    ``raised`` is the name of the exception type the child raised (its objects stay in the
    child): how the parent tells a compiler's failure (``BackendCompilerFailed``) from
    others without reading the message."""

    def __init__(self, message: str, raised: str | None = None) -> None:
        super().__init__(message)
        self.raised = raised


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


#: The share of a run's timed steps (all but the first) in which the CUDA caching allocator
#: retried an allocation, at or above which the run counts as out of memory
#: (:class:`AllocatorRetriesError`).
RETRIED_STEPS_SHARE = 0.5
#: How :class:`AllocatorRetriesError`'s message begins (a probe's record keeps the message's
#: first line; :func:`ran_out_by_retries` reads it back).
ALLOCATOR_RETRIES = "Out of memory in effect:"


class AllocatorRetriesError(MemadvisorError, torch.OutOfMemoryError):
    """A run's batch fitted only by the CUDA caching allocator freeing its cache and retrying
    an allocation in most of its timed steps: it counts as out of memory.

    Why: such a step is slow, and a batch a little smaller is not. The GPT example's
    whole-model compiled step at batch 302 under 8 GiB (expandable segments) held 7.75 GiB
    allocated, retried in 11 of 12 steps and took 22.7-23.8 ms a step; uncapped, the same
    graph took 10.9-11.5 ms with a reserved peak of 9.59 GiB, and capped at batch 250 it
    retried never and took 9.31 ms (docs/design.md, "A batch that fits only by the
    allocator's retries (session 22)"). Counted as fitting, the search ranked that candidate
    on the slow steps and dropped compile for the eager pick, 0.82x of the compiled one.
    It is a ``torch.OutOfMemoryError`` so that every stage that asks :func:`is_oom` (the
    probes' batch search, a run's retry at a smaller batch, the compile search's failures)
    takes it as the run having run out.

    Known limitations:
        * The share (:data:`RETRIED_STEPS_SHARE`) was set on two models on one card (gpt,
          cnn): where a step is long against a retry (cnn's 150 ms, 1.5% slower with them)
          the batch comes down about 3% for little, and the probes take a run more.
        * A run with few timed steps (a timing run's 7) decides on those few.
        * The failed batch's allocated peak and step time are not kept (the error carries
          no measurement), so its bytes do not reach the compiled candidate's line.
    """

    exit_code = 4

    def __init__(
        self,
        batch: int,
        retried_steps: int,
        timed_steps: int,
        step_ms: float,
        planned_steps: int | None = None,
    ) -> None:
        where = f"{retried_steps} of {timed_steps} timed steps"
        if planned_steps is not None and planned_steps > timed_steps:
            where = (
                f"{retried_steps} of its first {timed_steps} timed steps (stopped there: "
                f"{retried_steps} of the run's {planned_steps} already decide it)"
            )
        super().__init__(
            f"{ALLOCATOR_RETRIES} batch {batch} fitted only by the CUDA caching allocator "
            f"freeing its cache and retrying an allocation in {where} "
            f"({step_ms:.1f} ms a step); memadvisor counts such a batch as not "
            "fitting, as a smaller one steps without the retries."
        )
        self.batch = batch
        self.retried_steps = retried_steps
        self.timed_steps = timed_steps


def ran_out_by_retries(message: str | None) -> bool:
    """Whether a run's out-of-memory message (a probe's ``error``) is
    :class:`AllocatorRetriesError`'s: it fitted, but only by the allocator's retries."""
    return bool(message) and message.startswith(ALLOCATOR_RETRIES)


def check_allocator_retries(
    counts: Sequence[int], batch: int, times_ms: Sequence[float], planned_timed: int | None = None
) -> None:
    """Raise :class:`AllocatorRetriesError` where the allocator retried in at least
    :data:`RETRIED_STEPS_SHARE` of a run's timed steps, at a batch above 1: at batch 1 no
    smaller batch steps without the retries, and a slow step beats no plan (the budget
    would otherwise read as too small for a model that trains in it).

    With ``planned_timed`` (the timed steps the run will take, called after each step) it
    raises as soon as the steps retried so far reach that share of the planned ones: the
    rest cannot undo the verdict, and their time is spent for nothing. Why: such a run
    retries in nearly every timed step (t5_base on an H200, session 34: one plan's 6 such
    20-step runs retried in 17-19 of their 19), so it ran 20 steps where 11 decided it:
    9.2-11.9 s an eager probe at about 0.4 s a step, 5.6-6.3 s once stopped (call 2), and a
    compiled run's steps are taken in turn with the runs beside it.

    Args:
        counts: the allocator's cumulative retry count before the first step, then after
            each step done (one more than the steps).
        batch: the run's batch, for the message.
        times_ms: each step's time, for the message (the middle one of all but the first,
            sorted).
        planned_timed: the run's timed steps in all (None: the steps done are all of them).
    """
    timed = len(counts) - 2  # the first step (compile, warm-up, the optimizer's state) is not
    if timed < 1 or batch <= 1:
        return
    retried = sum(1 for i in range(1, timed + 1) if counts[i + 1] > counts[i])
    total = timed if planned_timed is None else max(planned_timed, timed)
    if retried and retried >= RETRIED_STEPS_SHARE * total:
        steady = sorted(times_ms[1:]) or [0.0]
        raise AllocatorRetriesError(batch, retried, timed, steady[len(steady) // 2], total)


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


def mark_retry_ran_out(error: BaseException, batch: int, *, same_process: bool) -> None:
    """Note on ``error`` (a run's out-of-memory) that its retry at the smaller ``batch`` ran
    out too, in the run's own process or as a run of its own (``Device.run_many_retrying``):
    the one place the two attributes are spelled, read back by :func:`retry_ran_out`."""
    error.memadvisor_retry_ran_out = int(batch)  # type: ignore[attr-defined]
    error.memadvisor_retry_same_process = bool(same_process)  # type: ignore[attr-defined]


def retry_ran_out(error: BaseException) -> tuple[int, bool] | None:
    """(the retry's batch, whether it ran in the run's own process) where ``error`` says its
    retry ran out too (:func:`mark_retry_ran_out`); None where it does not."""
    batch = getattr(error, "memadvisor_retry_ran_out", None)
    if batch is None:
        return None
    return int(batch), bool(getattr(error, "memadvisor_retry_same_process", False))


# torch's own files and the standard library's: code that runs the user's, not code they wrote.
_LIBRARY_CODE = tuple(
    {
        f"{Path(torch.__file__).resolve().parent}/",
        *(f"{Path(sysconfig.get_paths()[k]).resolve()}/" for k in ("stdlib", "platstdlib")),
    }
)


def _resolved(filename: str) -> str:
    return filename if filename.startswith("<") else str(Path(filename).resolve())


def user_code_frame(
    error: BaseException, calls: Collection[CodeType]
) -> traceback.FrameSummary | None:
    """The line that makes ``error`` the user's code's, or None when it is not theirs.

    Walking ``error``'s traceback from the innermost frame out, past torch's and the standard
    library's frames, the first frame decides: one of the user's files (their model, their
    loss, a library model such as transformers') makes it theirs, and is returned; a
    memadvisor frame whose code is in ``calls`` (the line that called the user's callable,
    e.g. ``Workload.forward``) makes it theirs too: torch alone ran below it (an
    ``nn.Linear`` of their model, ``F.cross_entropy`` passed as the loss), and the innermost
    frame is returned. Any other memadvisor frame makes it ours, as do :func:`is_our_bug`,
    an error raised on purpose (:class:`MemadvisorError`) and running out of memory: None.
    The exception's type plays no part.
    """
    if isinstance(error, MemadvisorError) or is_oom(error) or is_our_bug(error):
        return None
    frames = traceback.extract_tb(error.__traceback__)
    tbs = []
    tb = error.__traceback__
    while tb is not None:
        tbs.append(tb)
        tb = tb.tb_next
    for summary, tb in zip(reversed(frames), reversed(tbs), strict=True):
        filename = _resolved(summary.filename)
        if filename.startswith(_LIBRARY_CODE) or filename.startswith("<frozen"):
            continue
        if not filename.startswith(_OUR_CODE):
            return summary
        if tb.tb_frame.f_code in calls:
            return frames[-1]
        return None
    return None


def _raised_in_our_code(error: BaseException) -> bool:
    tb = error.__traceback__
    if tb is None:
        return False
    while tb.tb_next is not None:
        tb = tb.tb_next
    filename = str(Path(tb.tb_frame.f_code.co_filename).resolve())
    return filename.startswith(_OUR_CODE)


def root_cause(error: BaseException) -> BaseException:
    """The innermost error along ``error``'s chain of causes (``__cause__``, or a wrapper's
    ``inner_exception``: dynamo's BackendCompilerFailed keeps the backend's there); ``error``
    itself where it was raised from none. The innermost one says what actually went wrong:
    train_step turns a RuntimeError into "the model rejected the batch", and transformers'
    lazy import says "Could not import module 'GPT2LMHeadModel'" where torchvision's ops
    failed to load."""
    seen = {id(error)}
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if not isinstance(inner, BaseException) or id(inner) in seen:
            return error
        error = inner
        seen.add(id(error))


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


def validation_problems(error: Any, whole: str) -> str:
    """A pydantic ``ValidationError``'s problems in one line, for a :class:`BadInputError`:
    each as ``field.path: message (got value)``, ``whole`` naming a problem of the whole
    input (an empty path)."""
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or whole}: {err['msg']} (got {err.get('input')!r})"
        for err in error.errors()
    )
