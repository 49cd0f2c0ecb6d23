"""A candidate trained by ``world_size`` processes at once, each under its own memory cap.

A DDP or FSDP2 plan is per rank: every rank trains the candidate's batch on a card of
``budget_bytes``. :class:`Ranks` starts one process per rank (``torch.multiprocessing``),
each joins a process group (gloo on the CPU, NCCL on cards), wraps its fresh model copy as
the candidate's ``parallel`` choice says (:func:`strategies.parallel.wrap_for_rank`) and
trains; the run's peak is the fullest rank's, and every rank's peak is kept
(:attr:`Measurement.rank_peak_bytes`).

* ``backend="simulated"``: forked CPU processes, each under a
  :class:`~memadvisor.memory.MemoryMeter` with the budget (and FSDP2's storage resizes
  followed); the workload is inherited, not pickled.
* ``backend="cuda"``: spawned processes, rank r on card r capped with
  ``set_per_process_memory_fraction``; each rebuilds the workload from ``target``
  (``file.py:factory``), as the single-card probes do.

When a rank runs out of memory the others would wait in a collective for ever: the parent
stops them as soon as one reports, and the run raises the out-of-memory error.

Known limitations:
    * Every rank trains the same batch (memory does not depend on which samples).
    * The simulated ranks' step times are CPU times of several processes on shared cores.
"""

from __future__ import annotations

import copy
import os
import queue
import time
import traceback
from collections.abc import Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from memadvisor.device._base import Device
from memadvisor.device._lifetime import die_with_parent, private_dir, remove_private_dir
from memadvisor.errors import BadInputError, PlanningError, SimulatedOutOfMemoryError, is_oom
from memadvisor.memory import MemoryMeter
from memadvisor.process_state import environ_set
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import samples_per_s, steady_ms
from memadvisor.schema.device import SIMULATED, card_capabilities
from memadvisor.schema.profile import Profile
from memadvisor.strategy import facts_of, load_strategies
from memadvisor.workload import Workload, tensor_leaves, train_step

__all__ = ["Ranks"]

_WAIT_S = 900.0  # a run that says nothing for this long is stopped


class Ranks(Device):
    """``world_size`` ranks, each a card of ``budget_bytes``; a run's peak is the fullest's.

    Args:
        budget_bytes: each rank's memory.
        world_size: the processes started per run.
        backend: ``"simulated"`` (CPU, gloo) or ``"cuda"`` (one card per rank, NCCL).
        target: ``file.py:factory`` each CUDA rank rebuilds the workload from.
        profile: passed to the strategies' ``apply``.
        strategy_names: the strategies candidates are applied with.
    """

    def __init__(
        self,
        budget_bytes: int,
        world_size: int,
        *,
        backend: Literal["simulated", "cuda"] = "simulated",
        target: str | None = None,
        profile: Profile | None = None,
        strategy_names: Sequence[str] | None = None,
    ) -> None:
        if world_size < 1:
            raise BadInputError(f"world_size must be at least 1, but got {world_size=}.")
        if backend == "cuda":
            if target is None:
                raise BadInputError(
                    "CUDA ranks rebuild the workload in each process: pass the model as "
                    "target 'file.py:factory' (the CLI's argument), not a live object."
                )
            if torch.cuda.device_count() < world_size:
                raise BadInputError(
                    f"world_size={world_size} needs that many CUDA devices, but "
                    f"{torch.cuda.device_count()} are visible; plan with device='estimate' "
                    "or fewer ranks."
                )
        name = (
            f"{world_size} simulated cards (CPU, gloo)"
            if backend == "simulated"
            else f"{world_size} x {torch.cuda.get_device_name(0)} (NCCL)"
        )
        super().__init__(budget_bytes, name)
        # Each rank is a card of that backend's: the planner reads its capabilities. Card
        # ranks are processes of their own with real step times, as CudaDevice's runs; CPU
        # ranks are forked processes too, their memory metered but not steady (collectives).
        cuda = backend == "cuda"
        self.capabilities = (
            card_capabilities(0) if cuda else SIMULATED.model_copy(update={"steady_memory": False})
        )
        self.world_size = world_size
        self.backend = backend
        self.target = target
        self.profile = profile
        self.strategy_names = list(strategy_names) if strategy_names is not None else None

    def run(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        """Train ``candidate`` in every rank for ``steps`` steps; the fullest rank's peak.

        Raises:
            torch.OutOfMemoryError: a rank ran out (``memadvisor_steps_completed`` on it).
            BadInputError: the candidate has no parallel choice, or a rank rejected it.
            PlanningError: a rank failed otherwise, or stopped answering.
        """
        if steps < 1:
            raise BadInputError(f"A run needs at least one step, but got {steps=}.")
        if facts_of(candidate).parallel is None:
            raise BadInputError(
                "A run on several ranks needs a choice that says how each rank wraps the model "
                f"(a strategy whose facts name a parallel wrap), but got choices "
                f"{sorted(candidate.choices)}."
            )
        context = mp.get_context("fork" if self.backend == "simulated" else "spawn")
        answers: Any = context.Queue()
        # 0700, removed however this process ends (memadvisor.device._lifetime).
        tmp = private_dir("memadvisor-ranks-")
        try:
            store = os.path.join(tmp, "store")
            job = _Job(
                workload=workload if self.backend == "simulated" else None,
                target=self.target,
                candidate=candidate.model_dump(),
                steps=steps,
                budget_bytes=self.budget_bytes,
                world_size=self.world_size,
                store=store,
                backend=self.backend,
                strategy_names=self.strategy_names,
                profile=self.profile.model_dump() if self.profile is not None else None,
            )
            processes = [
                context.Process(
                    target=_rank_main, args=(rank, job, answers, os.getpid()), daemon=True
                )
                for rank in range(self.world_size)
            ]
            start_isolated(processes)
            try:
                results = _collect(answers, processes, self.world_size)
            finally:
                for p in processes:
                    if p.is_alive():
                        p.terminate()
                for p in processes:
                    p.join(timeout=10)
        finally:
            remove_private_dir(tmp)
        return _measurement(results, candidate, steps, self.budget_bytes)


def start_isolated(processes: Sequence[Any]) -> None:
    """Start ``processes`` with ``PYTHONSAFEPATH=1`` in their environment, so a spawned
    child's bootstrap (``python -c ...``) does not put the working directory first on
    ``sys.path``: a ``selectors.py`` left there would run inside the rank. The parent's own
    ``sys.path`` (the user's modules) still reaches the child through spawn's preparation.

    Known limitations:
        * Python 3.10 ignores the variable (it came in 3.11).
    """
    with environ_set({"PYTHONSAFEPATH": "1"}):
        for p in processes:
            p.start()


class _Job:
    """What every rank needs to run (inherited by fork, or pickled for spawn)."""

    def __init__(self, **fields: Any) -> None:
        self.__dict__.update(fields)


def _collect(answers: Any, processes: list, world_size: int) -> dict[int, dict[str, Any]]:
    """Every rank's answer, or the first failure (the other ranks are then stopped)."""
    results: dict[int, dict[str, Any]] = {}
    deadline = time.monotonic() + _WAIT_S
    while len(results) < world_size:
        try:
            answer = answers.get(timeout=1.0)
        except queue.Empty:
            dead = [i for i, p in enumerate(processes) if not p.is_alive() and i not in results]
            if dead and answers.empty():
                # A rank can exit between its answer reaching the queue and our get().
                try:
                    answer = answers.get(timeout=2.0)
                except queue.Empty:
                    codes = {i: processes[i].exitcode for i in dead}
                    raise PlanningError(
                        f"Rank process(es) {dead} exited without an answer (exit codes "
                        f"{codes}); a rank killed by the operating system (out of host "
                        "memory?) says nothing."
                    ) from None
            elif time.monotonic() > deadline:
                raise PlanningError(
                    f"The ranks did not answer within {_WAIT_S:.0f} s; only {sorted(results)} did."
                ) from None
            else:
                continue
        results[answer["rank"]] = answer
        if answer["status"] != "ok":
            return {answer["rank"]: answer}  # one failure decides: the others are stopped
    return results


def _measurement(
    results: dict[int, dict[str, Any]], candidate: Candidate, steps: int, budget_bytes: int
) -> Measurement:
    failed = next((a for a in results.values() if a["status"] != "ok"), None)
    if failed is not None:
        rank = failed["rank"]
        if failed["status"] == "oom":
            error: Exception = torch.OutOfMemoryError(f"rank {rank}: {failed['message']}")
            error.memadvisor_steps_completed = failed["steps_completed"]  # type: ignore[attr-defined]
            raise error
        if failed.get("bad_input"):  # BadInputError or a subclass (UserCodeError)
            raise BadInputError(f"rank {rank}: {failed['message']}")
        raise PlanningError(
            f"Rank {rank} failed at batch {candidate.batch_size} with {failed.get('type')}: "
            f"{failed['message']}\n{failed.get('traceback', '')[-3000:]}"
        )
    ranks = [results[r] for r in sorted(results)]
    peaks = [a["peak_bytes"] for a in ranks]
    reserved = [a["reserved_peak_bytes"] for a in ranks]
    step_ms = max(a["step_ms"] for a in ranks)  # the ranks wait for the slowest
    samples = candidate.batch_size * candidate.accumulation_steps
    return Measurement(
        steps=steps,
        peak_bytes=max(peaks),
        reserved_peak_bytes=max(reserved) if None not in reserved else None,
        step_ms=step_ms,
        samples_per_s=samples_per_s(samples, step_ms),
        rank_peak_bytes=peaks,
    )


# -- in each rank -----------------------------------------------------------------------------


def _rank_main(rank: int, job: _Job, answers: Any, parent_pid: int | None = None) -> None:
    die_with_parent(parent_pid)  # SIGTERM or SIGKILL to the planner ends the ranks too
    steps_done = [0]
    try:
        answer = _train_rank(rank, job, steps_done)
    except BaseException as e:  # noqa: BLE001 - every failure goes back to the parent
        if is_oom(e):
            answer = {
                "status": "oom",
                "message": str(e).splitlines()[0] if str(e) else type(e).__name__,
                "steps_completed": steps_done[0],
            }
        else:
            answer = {
                "status": "error",
                "type": type(e).__name__,
                "bad_input": isinstance(e, BadInputError),
                "message": str(e),
                "traceback": traceback.format_exc(),
            }
    answers.put({"rank": rank, **answer})
    answers.close()
    answers.join_thread()
    # A peer may still wait in a collective; the parent stops this process group's peers.
    os._exit(0)


def _train_rank(rank: int, job: _Job, steps_done: list[int]) -> dict[str, Any]:
    from memadvisor.step import base_step, running
    from memadvisor.strategy import apply_candidate, wrap_ranks

    cuda = job.backend == "cuda"
    if cuda:
        from memadvisor.target import load_target

        torch.cuda.set_device(rank)
        total = torch.cuda.get_device_properties(rank).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, job.budget_bytes / total), rank)
        workload = load_target(job.target)
    else:
        torch.set_num_threads(1)  # the ranks share this machine's cores
        workload = job.workload
    candidate = Candidate.model_validate(job.candidate)
    profile = Profile.model_validate(job.profile) if job.profile is not None else None
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"file://{job.store}",
        rank=rank,
        world_size=job.world_size,
    )
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    names = job.strategy_names if job.strategy_names is not None else list(candidate.choices)
    strategies = load_strategies([n for n in names if n in candidate.choices])
    if cuda:
        # Before the model reaches the card (a fresh process: nothing): a rank's peak is
        # everything it holds, its shards included, as the per-rank estimate counts it.
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    torch.manual_seed(0)
    model = copy.deepcopy(workload.model)
    # Not a loop over the parameters: its variable would keep the last one, and under FSDP2
    # its unsharded storage, alive for the whole run (the 1B's output layer: 0.24 GiB).
    model.zero_grad(set_to_none=True)
    run_step = apply_candidate(
        base_step(workload, model.to(device), profile), candidate, strategies
    )
    meter = MemoryMeter(None if cuda else job.budget_bytes, track_resizes=True)
    if cuda:
        run = running(workload, wrap_ranks(run_step, candidate, strategies, rank))
        # The peak is the steps': the whole model on the card before fully_shard sharded it
        # is the loading's moment, which the estimate does not model (its segments go back).
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with meter:  # DDP's buckets and FSDP2's shards are made here
            run = running(workload, wrap_ranks(run_step, candidate, strategies, None))
    model = run.model
    optimizer = run.make_optimizer(model)
    batch = run.batch(candidate.batch_size, device)
    times_ms: list[float] = []
    held: list = []  # the last output, kept into the next step as a loop does
    if cuda:
        for _ in range(job.steps):
            t0 = time.perf_counter()
            train_step(run, model, optimizer, batch, accumulation_steps=_acc(candidate), held=held)
            torch.cuda.synchronize(device)
            times_ms.append((time.perf_counter() - t0) * 1e3)
            steps_done[0] += 1
        peak = torch.cuda.max_memory_allocated(device) - base[0]
        reserved: int | None = max(0, torch.cuda.max_memory_reserved(device) - base[1])
    else:
        meter.adopt(model.parameters())
        meter.adopt(model.buffers())
        meter.adopt(tensor_leaves(batch))
        if meter.live_bytes > job.budget_bytes:
            raise SimulatedOutOfMemoryError(meter.live_bytes, 0, job.budget_bytes)
        with meter:
            for _ in range(job.steps):
                t0 = time.perf_counter()
                train_step(
                    run, model, optimizer, batch, accumulation_steps=_acc(candidate), held=held
                )
                times_ms.append((time.perf_counter() - t0) * 1e3)
                steps_done[0] += 1
        peak, reserved = meter.peak_bytes, None
    dist.barrier()
    dist.destroy_process_group()
    step_ms = steady_ms(times_ms)
    return {
        "status": "ok",
        "peak_bytes": int(peak),
        "reserved_peak_bytes": reserved,
        "step_ms": step_ms,
    }


def _acc(candidate: Candidate) -> int:
    return candidate.accumulation_steps
