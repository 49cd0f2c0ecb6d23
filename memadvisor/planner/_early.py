"""Compile trials started early, on a thread, while the eager probes run in their processes.

Why: a compile trial (:func:`strategies.compile.try_compile`) compiles the model in the
planner's own process, 17-23 s on an H200 for the GPT examples, and the compile stage used
to start it only once the eager probes had chosen the pick. It times nothing the plan
decides by (the device's runs decide; the trial says whether the model compiles, how long
that takes, and how close it comes to eager), so it can run while the device's runs do,
provided those runs happen in processes of their own (``Device.runs_apart``): then the
trial shares neither their interpreter nor their CUDA context, only the card and the CPU
(docs/design.md, plan speed, measures what that overlap did to the eager timings).

What it trials: the compiled variants of the estimate's best timed candidate (usually the
eager pick), at that candidate's timing batch when the card has room for a budget's worth
besides the probes, else at the sample batch. At the timing batch the trial also fills
inductor's on-disk caches with the very graph the compiled probe at that batch will need,
so that probe loads the kernels instead of compiling them (5 s instead of 21 s for the
124M GPT on an H200). A variant the compile stage needs but this did not trial is tried
there, as before.

Known limitations:
    * One thread, the variants one after another; a trial that is running cannot be
      stopped, so a plan that fails during the probes waits for it before returning.
    * The trial's own step times (in its summary) are taken while probes run: they say
      what compiling did, not what the card gives; the plan's numbers are the device's.
    * A trial that ran out of memory here (the card shared with others) is not an answer:
      the compile stage tries again at the sample batch.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import JsonValue

from memadvisor.estimate import Candidate

if TYPE_CHECKING:
    from memadvisor.workload import Workload
    from strategies.compile import Compile, CompileResult

__all__ = ["ROOM_BESIDES_PROBES_BYTES", "EarlyTrials", "TrialRequest", "early_trial_batch"]

# What the card must hold beyond two budgets (the probe child's and the trial's) before the
# trial runs at the probes' batch: two CUDA contexts and the planner's own leftovers.
ROOM_BESIDES_PROBES_BYTES = 2 * 2**30
_POLL_S = 1.0  # how often a wait refreshes what the progress bar says


def early_trial_batch(
    timing_batch: int, sample_batch: int, budget_bytes: int, free_bytes: int | None
) -> int:
    """The batch the early trial runs at: the probes' when the card has room, else the sample's.

    Room is two budgets (the probe's process and this one's trial) and
    :data:`ROOM_BESIDES_PROBES_BYTES` free on the card; ``free_bytes`` None (not a card)
    means no room.
    """
    if free_bytes is not None and free_bytes >= 2 * budget_bytes + ROOM_BESIDES_PROBES_BYTES:
        return max(1, timing_batch)
    return max(1, sample_batch)


def choices_key(choices: dict[str, JsonValue]) -> str:
    return json.dumps(choices, sort_keys=True)


@dataclass(frozen=True)
class TrialRequest:
    """One variant to trial: its choices (compile included) and where the trial runs."""

    choices: dict[str, JsonValue]
    candidate: Candidate  # the batch and the other strategies' choices (compile excluded)


class EarlyTrials:
    """Compile trials running on one thread of this process, their results kept by variant.

    Args:
        strategy: the plan's compile strategy (its ``trial`` keeps results for its advice).
        workload: the user's workload (the trial trains copies of it).
        device: where the trials run (``"cuda"``), None for the model's device.
    """

    def __init__(self, strategy: Compile, workload: Workload, device: str | None) -> None:
        self.strategy, self.workload, self.device = strategy, workload, device
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-trial")
        self._futures: dict[str, tuple[TrialRequest, Future[CompileResult], float]] = {}

    def start(self, requests: Sequence[TrialRequest]) -> None:
        """Queue ``requests`` on the thread, in order; a variant already queued is skipped."""
        for request in requests:
            key = choices_key(request.choices)
            if key in self._futures:
                continue
            future = self._executor.submit(self._trial, request)
            self._futures[key] = (request, future, time.perf_counter())

    def _trial(self, request: TrialRequest) -> CompileResult:
        return self.strategy.trial(
            self.workload,
            request.choices["compile"],
            candidate=request.candidate,
            device=self.device,
        )

    @property
    def requested(self) -> list[dict[str, JsonValue]]:
        """The variants queued, in order."""
        return [request.choices for request, _, _ in self._futures.values()]

    @property
    def busy(self) -> bool:
        """Whether a trial is queued or running."""
        return any(not future.done() for _, future, _ in self._futures.values())

    def take(
        self,
        choices: dict[str, JsonValue],
        on_wait: Callable[[str], None] | None = None,
    ) -> CompileResult | None:
        """The trial of exactly ``choices``, waited for; None when it was not queued here or
        ran out of memory (the caller then trials as before).

        ``on_wait`` gets a sentence each second while the trial is still running.

        Raises:
            Exception: whatever the trial raised (the eager step failing), as the trial does.
        """
        entry = self._futures.get(choices_key(choices))
        if entry is None:
            return None
        request, future, started = entry
        while True:
            try:
                result = future.result(timeout=_POLL_S)
                break
            except FutureTimeout:
                if on_wait is not None:
                    waited = time.perf_counter() - started
                    on_wait(
                        f"compile: waiting on the compile trial at batch "
                        f"{request.candidate.batch_size} (running for {waited:.0f} s)"
                    )
        return None if result.out_of_memory else result

    def wait(self) -> None:
        """Wait until no trial runs (their results stay); errors are left to :meth:`take`."""
        for _, future, _ in list(self._futures.values()):
            if not future.done():
                future.exception()  # waits; re-raises nothing

    def close(self) -> None:
        """Drop what has not started, and wait for the trial that runs."""
        self._executor.shutdown(wait=True, cancel_futures=True)
