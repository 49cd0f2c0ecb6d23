"""The Device contract: run a candidate's training steps from a clean state, report the peak."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

from memadvisor import errors
from memadvisor.schema.candidate import RanOutFirst
from memadvisor.schema.device import DeviceCapabilities

if TYPE_CHECKING:
    from memadvisor.schema.candidate import Candidate, Measurement
    from memadvisor.workload import Workload

__all__ = ["Device"]


class Device(ABC):
    """Where probes, timing and verification run.

    ``run`` must start from a clean state every call (a fresh process, or a state proven equal
    to one: ``docs/design.md``, "A clean state per run") and raise an error for which
    :meth:`is_oom` is true when the candidate does not fit ``budget_bytes``. It never changes
    the caller's model, optimizer or RNG state.

    What the planner asks of a device besides ``run`` is its :attr:`capabilities` (what it
    can do: said once, read by every stage, never its kind), :meth:`is_oom`, :attr:`notes`
    and :meth:`close`; :meth:`run_many` where it has several runs to make (one after another
    unless the device overrides it). A device (a test's, a third party's) states its
    capabilities as a class attribute, sets them in ``__init__``, or computes them in a
    property (a card's free bytes).
    """

    def __init__(self, budget_bytes: int, name: str) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, but got {budget_bytes=}.")
        self.budget_bytes = budget_bytes
        self.name = name
        #: What a person should know about how the runs went (fallbacks); the plan's notes.
        self.notes: list[str] = []

    @property
    def capabilities(self) -> DeviceCapabilities:
        """What this device can do (:class:`~memadvisor.schema.device.DeviceCapabilities`)."""
        caps = self.__dict__.get("_capabilities")
        if caps is None:
            raise TypeError(
                f"{type(self).__name__} states no capabilities: give it a class attribute "
                "`capabilities = DeviceCapabilities(kind=..., tensor_device=...)` (from "
                "memadvisor.schema), or set self.capabilities in its __init__."
            )
        return caps

    @capabilities.setter
    def capabilities(self, caps: DeviceCapabilities) -> None:
        if not isinstance(caps, DeviceCapabilities):
            raise TypeError(f"capabilities must be DeviceCapabilities, but got {caps!r}.")
        self.__dict__["_capabilities"] = caps

    def is_oom(self, error: BaseException) -> bool:
        """Whether ``error`` from :meth:`run` means the candidate did not fit (an answer, not
        a failure); default :func:`memadvisor.errors.is_oom` (torch's, CUDA's, cuDNN's and
        cuBLAS's allocation errors). A device whose runtime raises its own overrides it."""
        return errors.is_oom(error)

    def close(self) -> None:
        """Give back what the device holds (processes, files); default: nothing to give."""
        return None

    def run_many_retrying(
        self, workload: Workload, runs: Sequence[tuple[Candidate, int, int | None]]
    ) -> list[Measurement | Exception]:
        """Each ``(candidate, steps, retry_at)`` of ``runs`` as :meth:`run_many` makes it;
        where a candidate runs out of memory and ``retry_at`` is a smaller batch, that batch
        of it is measured too, and answers with ``ran_out_first`` saying what ran out (an
        out-of-memory where the retry ran out too, ``memadvisor_retry_ran_out`` on it the
        retry's batch, ``memadvisor_retry_same_process`` whether it ran in the first's
        process). Default: the runs, then the retries as
        runs of their own, each from a clean state (``same_process`` False). A device that
        keeps a run's process (``CudaDevice``'s fork server) makes the retry in it: a
        compiled step with a dynamic batch then trains the smaller batch without a second
        compile. A device may also answer a run without its retry (the out-of-memory error),
        as ``CudaDevice`` does where its fork server fell back within the call."""
        answers = self.run_many(workload, [(c, steps) for c, steps, _ in runs])
        again = [
            (i, candidate.model_copy(update={"batch_size": retry}), steps, answers[i])
            for i, (candidate, steps, retry) in enumerate(runs)
            if retry is not None
            and 0 < retry < candidate.batch_size
            and isinstance(answers[i], Exception)
            and self.is_oom(answers[i])  # type: ignore[arg-type]
        ]
        if not again:
            return answers
        retried = self.run_many(workload, [(c, steps) for _, c, steps, _ in again])
        for (i, retry, _, error), answer in zip(again, retried, strict=True):
            if isinstance(answer, Exception):
                # The retry ran out (or failed): the first batch's error stands, and says
                # where the retry ran out.
                if self.is_oom(answer):
                    errors.mark_retry_ran_out(error, retry.batch_size, same_process=False)
                continue
            steps = int(getattr(error, "memadvisor_steps_completed", 0))
            first = RanOutFirst.of(runs[i][0].batch_size, error, steps, same_process=False)
            answers[i] = answer.model_copy(update={"ran_out_first": first})
        return answers

    def host_busy(self) -> AbstractContextManager[None]:
        """While the block runs the planner works in its own process beside this device's
        runs (the compile trial beside pass 1): a device whose runs time their steps on the
        planner's host makes them wait until it ends. Default: nothing waits."""
        return contextlib.nullcontext()

    @abstractmethod
    def run(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        """Train ``candidate`` for ``steps`` steps on a copy of ``workload``'s model."""

    def run_many(
        self, workload: Workload, runs: Sequence[tuple[Candidate, int]]
    ) -> list[Measurement | Exception]:
        """Each ``(candidate, steps)`` of ``runs`` as :meth:`run` makes it, each from a clean
        state; the answers in order, each the measurement or the error its run raised (an
        out-of-memory is one). Default: one after another. A device whose capabilities say
        ``concurrent_runs`` > 1 makes up to that many at once (their starts and compiles
        overlapping) and takes their timed steps in turn, so each step time is its own.
        """
        answers: list[Measurement | Exception] = []
        for candidate, steps in runs:
            try:
                answers.append(self.run(workload, candidate, steps))
            except Exception as e:  # noqa: BLE001 - every run's error is its answer
                answers.append(e)
        return answers
