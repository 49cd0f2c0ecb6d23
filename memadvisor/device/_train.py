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
import statistics
import time
from collections.abc import Sequence

import torch

from memadvisor import _torch_private
from memadvisor.device._turns import taking_turn
from memadvisor.errors import is_oom
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import samples_per_s
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
) -> Measurement:
    """Train ``candidate`` for ``steps`` steps on ``device`` and measure it.

    The peak is what this run added to what was allocated when it began (in a fresh process
    that is everything: weights, optimizer state, activations). ``strategies`` (instances)
    spares loading them again; else they are loaded by ``strategy_names``. ``turn_lock``: the
    lock file of runs made at once (:func:`taking_turn`); the first step (compile, warm-up)
    runs without it, the timed steps after it hold it. None: a lone run, no lock.

    Raises:
        torch.OutOfMemoryError: (or another error ``is_oom`` accepts) when it does not fit;
            ``memadvisor_steps_completed`` on the error says how many steps finished.
    """
    torch.cuda.synchronize(device)
    base_allocated = torch.cuda.memory_allocated(device)
    base_reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    cache_before = _torch_private.compile_cache_counts()
    times_ms: list[float] = []
    try:
        model = copy.deepcopy(workload.model) if copy_model else workload.model
        for p in model.parameters():
            p.grad = None  # a run starts without gradients, as train_step leaves them
        run = _apply(workload, model.to(device), candidate, strategy_names, profile, strategies)
        model = run.model
        optimizer = run.make_optimizer(model)
        batch = run.batch(candidate.batch_size, device)
        held: list = []  # the last output, alive into the next step as a user's loop keeps it
        with contextlib.ExitStack() as turn:  # the turn ends with the steps, by an error too
            for done in range(steps):
                if done == 1:  # before the first timed step; the wait is in no step's time
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
                torch.cuda.synchronize(device)
                times_ms.append((time.perf_counter() - t0) * 1e3)
    except Exception as e:
        if is_oom(e):
            e.memadvisor_steps_completed = len(times_ms)  # type: ignore[attr-defined]
        raise
    peak = torch.cuda.max_memory_allocated(device) - base_allocated
    reserved = torch.cuda.max_memory_reserved(device) - base_reserved
    # The first step creates the optimizer state and warms up kernels: not a steady step.
    step_ms = statistics.median(times_ms[1:] if len(times_ms) > 1 else times_ms)
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
        compile_cache_hits=hits if compiled else None,
        compile_cache_misses=misses if compiled else None,
        compile_cache_bypasses=bypasses if compiled else None,
    )
