"""One candidate's training steps on a card, measured: what every CUDA run executes.

The same function runs in a fork-server child (:mod:`memadvisor.device._zygote`), in a
fresh worker process (:mod:`memadvisor.device._worker`) and in the planner's own process
(:class:`~memadvisor.device.cuda.CudaDevice`'s fallback), so the three measure one step.

Runs made at once (``CudaDevice.run_many``: children of one fork server on one card) take
their timed steps in turn: each compiles and warms up in its first step beside the others,
then waits (:func:`~memadvisor.device._turns.taking_turn`) until every sibling's first step
has ended and no other run holds the turn, and holds the turn through its last step, so
neither another run's timed steps nor its compile share the card and the CPU with its own.

Known limitations:
    * A sibling's teardown (freeing its memory, exiting) may still overlap a run's timed
      steps. The planner confirms a search's winner in a run of its own.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import time
from collections.abc import Sequence

import torch

from memadvisor import _torch_private
from memadvisor.device._turns import taking_turn
from memadvisor.errors import check_allocator_retries, is_oom, mark_retry_ran_out
from memadvisor.schema.candidate import Candidate, Measurement, RanOutFirst
from memadvisor.schema.config import samples_per_s, steady_ms
from memadvisor.schema.profile import Profile
from memadvisor.step import base_step, running
from memadvisor.strategy import Strategy, apply_candidate, load_strategies
from memadvisor.workload import Workload, train_step

__all__ = ["RESULT_MARKER", "taking_turn", "train_candidate"]

RESULT_MARKER = "MEMADVISOR_RESULT "  # prefixes the child's answer; the model may print too


def _apply(
    workload: Workload,
    model: torch.nn.Module,
    candidate: Candidate,
    strategy_names: Sequence[str] | None,
    profile: Profile | None,
    strategies: Sequence[Strategy] | None = None,
) -> Workload:
    """``workload`` running ``candidate``'s rewritten step over ``model``."""
    if strategies is None:
        strategies = load_strategies(list(strategy_names) if strategy_names is not None else None)
    step = apply_candidate(base_step(workload, model, profile), candidate, strategies)
    return running(workload, step)


def train_candidate(
    workload: Workload,
    candidate: Candidate,
    steps: int,
    *,
    device: torch.device,
    strategy_names: Sequence[str] | None = None,
    profile: Profile | None = None,
    copy_model: bool = True,
    strategies: Sequence[Strategy] | None = None,
    turn_lock: str | None = None,
    retry_at: int | None = None,
) -> Measurement:
    """Train ``candidate`` for ``steps`` steps on ``device`` and measure it.

    The peak is what this run added to what was allocated when it began (in a fresh process
    that is everything: weights, optimizer state, activations). ``strategies`` (instances)
    spares loading them again; else they are loaded by ``strategy_names``. ``turn_lock``: the
    lock file of runs made at once (:func:`taking_turn`); the first step (compile, warm-up)
    runs without it, the timed steps after it hold it. None: a lone run, no lock.

    ``retry_at``: a smaller batch to train in this process, with the same model, optimizer
    and rewritten step (a compiled one's graph), where ``candidate`` runs out of memory; the
    measurement is then that batch's, its ``ran_out_first`` says what ran out. Its peak
    counts from the run's start as a fresh run's does, once the failed steps' memory is
    freed (their frames collected, their gradients dropped, the allocator's cache
    emptied); the optimizer's state, where the failed batch made a step, stays, as a fresh
    run makes it in its first step. Its first step runs in the turn (runs made at once:
    the siblings may be timing), and ``first_step_ms`` is the failed batch's first step
    where it ended (the compile), else the time to its error. Why: a compiled candidate
    with a dynamic batch that ran out in the compile search's first pass was run again at
    half its batch in a process of its own, a compile and a round of the search (cnn's
    regional plan on an H200: 21.5 s of an 88 s plan, session 20).

    Raises:
        torch.OutOfMemoryError: (or another error ``is_oom`` accepts) when it does not fit
            (with ``retry_at``: the first batch's message and steps, where the retry ran out
            too, ``memadvisor_retry_ran_out`` on it the retry's batch and
            ``memadvisor_retry_same_process`` True);
            ``memadvisor_steps_completed`` on the error says how many steps finished.
    """
    torch.cuda.synchronize(device)
    base_allocated = torch.cuda.memory_allocated(device)
    base_reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache_before = _torch_private.compile_cache_counts()
    times_ms: list[float] = []
    host_ms: list[float] = []  # each step's time until train_step returned, before the sync
    first: RanOutFirst | None = None
    first_ms = 0.0
    try:
        model = copy.deepcopy(workload.model) if copy_model else workload.model
        for p in model.parameters():
            p.grad = None  # a run starts without gradients, as train_step leaves them
        run = _apply(workload, model.to(device), candidate, strategy_names, profile, strategies)
        model = run.model
        optimizer = run.make_optimizer(model)
        steps_began = time.perf_counter()
        try:
            _steps(run, model, optimizer, candidate, steps, device, turn_lock, times_ms, host_ms)
        except Exception as e:
            if retry_at is None or not is_oom(e) or not 0 < retry_at < candidate.batch_size:
                raise
            first = RanOutFirst.of(candidate.batch_size, e, len(times_ms), same_process=True)
            # The compile is in the first step: its time where it ended, else until the error.
            first_ms = times_ms[0] if times_ms else (time.perf_counter() - steps_began) * 1e3
        if first is not None and retry_at is not None:
            # Out of the except block: the failed steps' frames can go. Their gradients too
            # (train_step frees them only after a step that ends): a fresh run has none.
            for p in model.parameters():
                p.grad = None
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            candidate = candidate.model_copy(update={"batch_size": retry_at})
            times_ms.clear()
            host_ms.clear()
            try:
                # In the turn from its first step: the process's warming ended with the
                # batch that ran out, and siblings may be timing.
                _steps(
                    run, model, optimizer, candidate, steps, device, turn_lock, times_ms, host_ms, 0
                )
            except Exception as e:
                if not is_oom(e):
                    raise
                ran_out = True
            else:
                ran_out = False
            if ran_out:  # the first batch's error stands (what ran out first, its steps)
                error = torch.OutOfMemoryError(first.message)
                error.memadvisor_steps_completed = first.steps  # type: ignore[attr-defined]
                # ... and says the retry ran out too: the search then tries no batch above it
                mark_retry_ran_out(error, retry_at, same_process=True)
                raise error
            times_ms[0] = max(times_ms[0], first_ms)
    except Exception as e:
        if is_oom(e) and not hasattr(e, "memadvisor_steps_completed"):  # a retry's has its own
            e.memadvisor_steps_completed = len(times_ms)  # type: ignore[attr-defined]
        raise
    peak = torch.cuda.max_memory_allocated(device) - base_allocated
    reserved = torch.cuda.max_memory_reserved(device) - base_reserved
    # The first step creates the optimizer state and warms up kernels: not a steady step.
    step_ms = steady_ms(times_ms)
    launch_ms = steady_ms(host_ms)
    samples = candidate.batch_size * candidate.accumulation_steps
    hits, misses, bypasses = (
        after - before
        for after, before in zip(_torch_private.compile_cache_counts(), cache_before, strict=True)
    )
    compiled = hits + misses + bypasses > 0
    return Measurement(
        steps=steps,
        peak_bytes=peak,
        reserved_peak_bytes=max(reserved, 0),
        step_ms=step_ms,
        samples_per_s=samples_per_s(samples, step_ms),
        first_step_ms=times_ms[0],
        host_ms=launch_ms,
        compile_cache_hits=hits if compiled else None,
        compile_cache_misses=misses if compiled else None,
        compile_cache_bypasses=bypasses if compiled else None,
        ran_out_first=first,
    )


def _steps(
    run: Workload,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    candidate: Candidate,
    steps: int,
    device: torch.device,
    turn_lock: str | None,
    times_ms: list[float],
    host_ms: list[float],
    turn_from: int = 1,
) -> None:
    """``steps`` training steps of ``candidate``'s batch, each step's time appended to
    ``times_ms`` as it ends, and its time until ``train_step`` returned, before the sync, to
    ``host_ms`` (the host's share: near the step's time, the card waited on it); the steps
    from ``turn_from`` on (the timed ones: all but the first) in the turn. Where the
    allocator retried an allocation in most timed steps, the batch counts as out of memory
    (``AllocatorRetriesError``, raised after the step whose retry decides it: the steps after
    it could not undo the verdict)."""
    batch = run.batch(candidate.batch_size, device)
    held: list = []  # the last output, alive into the next step as a user's loop keeps it
    retries = [_torch_private.cuda_memory_counters(device)["alloc_retries"]]
    with contextlib.ExitStack() as turn:  # the turn ends with the steps, by an error too
        for done in range(steps):
            if done == turn_from:  # before the first timed step; the wait is in no step's time
                turn.enter_context(taking_turn(turn_lock))
            t0 = time.perf_counter()
            train_step(
                run,
                model,
                optimizer,
                batch,
                accumulation_steps=candidate.accumulation_steps,
                held=held,
            )
            host_ms.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize(device)
            times_ms.append((time.perf_counter() - t0) * 1e3)
            retries.append(_torch_private.cuda_memory_counters(device)["alloc_retries"])
            # Decided before its last step: the rest would be spent for nothing.
            check_allocator_retries(
                retries, candidate.batch_size, times_ms[-(done + 1) :], planned_timed=steps - 1
            )
