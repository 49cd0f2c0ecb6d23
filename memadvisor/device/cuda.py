"""A CUDA card under the user's budget, each run from a clean state in a process of its own.

The budget is the user's, not the card's: ``torch.cuda.set_per_process_memory_fraction``
caps what the caching allocator may reserve, so an 80 GB card plans for an 8 GB one.

Why a process per run (``docs/design.md``, "A clean state per run"): after a few
out-of-memory errors the allocator is fragmented and tensors leak, so a search in one
process finds a far smaller batch than a fresh one holds. How each run gets its process,
fastest first:

1. Fork server (default where ``os.fork`` exists): one zygote,
   ``python -m memadvisor.device._zygote``, started fresh (so this process's own CUDA
   context is never forked), imports torch, memadvisor and the strategies and builds the
   workload on the CPU without ever touching CUDA; each run is a forked child of it that
   creates its own CUDA context under the cap, trains and exits. Clean state per run is a
   fresh child of a process that never touched CUDA: such a child measured the same peak
   and step time as a fresh process, and an out-of-memory in one child left the next one's
   peak unchanged, at about half the wall time per run.
2. Fresh process per run, ``python -m memadvisor.device._worker``: where there is no fork,
   or when the zygote cannot serve (it died, or CUDA would not start in a forked child).
3. This process: only when the workload truly cannot be sent (it holds a lock, an open
   file, a generator: what even cloudpickle refuses) or a child cannot load it. Each run
   then starts from a checked clean state: garbage collected, the cache emptied,
   ``memory_allocated`` back to its baseline, peak stats reset; a compiled candidate starts
   from a reset dynamo (``torch.compiler.reset()``), so it compiles static shapes for its
   batch as a fresh process would.

Both children rebuild the workload from the user's factory (``target``) or from a copy
saved with ``torch.save(..., pickle_module=cloudpickle)``: cloudpickle sends lambdas,
closures and classes defined in ``__main__`` (a script, a notebook) by value, so the
workloads users write (``loss_fn=lambda out, b: F.cross_entropy(out, b[1])``) reach fresh
processes. :attr:`CudaDevice.notes` says when a run fell back, and the planner puts that
note first among ``Plan.notes``, where the report's first lines show it.

Runs made at once (:meth:`CudaDevice.run_many`, fork server only): up to
:attr:`~memadvisor.schema.device.DeviceCapabilities.concurrent_runs` children of the zygote
at a time, as many as the card's free memory holds at the budget each. A compiled run's
first step (10-20 s on an H100, mostly compiling on the CPU) then overlaps the others';
their timed steps are taken in turn (a lock file, :mod:`memadvisor.device._train`), so no
two runs' timed steps share the card. Each child caps its own allocator at the budget, so
each measures its own peak.

Known limitations:
    * A run still costs seconds, most of them the child's first step loading the CUDA
      kernels; the planner keeps the runs few.
    * A run made at once with others may have another's first step (its compile on the
      CPU, its warm-up on the card) beside its timed steps: its step time is less sure than
      a lone run's; the planner confirms the winner in a run of its own. A card whose free
      memory another program takes while the runs are under way can make a run that fits
      its budget run out of the card's memory instead.
    * The budget caps *reserved* memory; the CUDA context is outside it, as it
      is outside what ``torch.cuda.mem_get_info`` reports a card can give to tensors.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import subprocess
import sys
import weakref
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Literal

import torch

from memadvisor import _torch_private
from memadvisor._log import logger
from memadvisor.device import _turns
from memadvisor.device._base import Device
from memadvisor.device._lifetime import (
    absolute_sys_path,
    private_dir,
    probe_env,
    python_command,
    remove_private_dir,
)
from memadvisor.device._train import RESULT_MARKER, train_candidate
from memadvisor.device._zygote import ForkServer, ZygoteDied
from memadvisor.errors import (
    BadInputError,
    PlanningError,
    ProbeProcessError,
    mark_retry_ran_out,
)
from memadvisor.process_state import usable_cores
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.device import DeviceCapabilities, card_capabilities
from memadvisor.schema.profile import Profile
from memadvisor.workload import Workload

__all__ = [
    "IN_PROCESS_NOTE_START",
    "CORES_PER_RUN",
    "MAX_CONCURRENT_RUNS",
    "PER_PROCESS_BYTES",
    "RESERVE_BYTES",
    "CudaDevice",
    "environment_changed",
    "save_workload",
]

# How the in-process fallback's note begins: the planner finds it and puts it first.
IN_PROCESS_NOTE_START = "Probes ran in this process, not in fresh ones,"
MIB = 2**20
GIB = 2**30
# Runs made at once, at most, and the host's cores each takes: their first steps compile on
# the CPU, each process's dynamo, AOTAutograd and lowering on one thread with inductor's
# workers beside it. On an H200's host of 16 cores (docs/design.md, session 40) 8 at once
# planned hf_gpt2 in 135.0 s and cnn in 67.1 s against 159.0 and 74.7 s at 4 at once, each a
# better pick (more of pass 2's static forms and graphs in one round), the cores 58% busy at
# most; each process's compile took longer (passes 1 and 2: first steps of 29.0-40.8 s
# against 31.1-34.5 s).
MAX_CONCURRENT_RUNS = 8
CORES_PER_RUN = 2
# Left free on the card when runs are made at once: the planner's own process shares it
# (its cached blocks, a profile's tensors, growth while the children run), and so may
# whatever else runs there; a child that finds the card full runs out short of its budget.
RESERVE_BYTES = 2 * GIB
# Each child's card memory beyond its budget: its CUDA context (kernels, cuBLAS/cuDNN
# handles; 0.5-1 GiB on an H100) and what its allocator's cap does not count.
PER_PROCESS_BYTES = 1 * GIB


def save_workload(parts: dict[str, Any], path: Path) -> None:
    """Save the workload's parts for a probe process, lambdas and ``__main__`` classes too.

    ``torch.save`` with cloudpickle as its pickler: what plain pickle saves by name (a
    function or class of an importable module, a target file's loss) goes by name as before;
    what it cannot (a ``lambda``, a closure, a class defined in ``__main__``) goes by value.
    Tensors keep torch's own storage format; ``torch.load`` (plain pickle) reads it back in
    the child, which imports cloudpickle to rebuild what went by value.

    Raises:
        Exception: whatever cloudpickle raises for an object nothing can send (a lock, an
            open file, a generator).
    """
    import cloudpickle

    torch.save(parts, path, pickle_module=cloudpickle)


def _get_fraction(index: int) -> float:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return float(getter(index)) if getter is not None else 1.0


def environment_changed(started: dict[str, str], now: dict[str, str]) -> list[str]:
    """The variables whose change means a fork server started with ``started`` no longer
    runs children as this process would (sorted; empty: it does).

    A variable torch's compile set in this process after the server started
    (``_torch_private.COMPILE_SET_ENVIRONMENT``: triton's cache directory, inductor's pool
    switch) is not one: a child derives the same value when it compiles. A restart costs a
    server's imports and the model's build again; on a card the first compiled run after the
    compile trial took 20-23 s where later ones took 7-10 s, which such a restart would
    explain (inferred, not yet seen in the log this writes; docs/design.md, 'A dynamic batch
    while searching'). A variable of that set that changed from a value the server had
    still counts. So does ``TORCHINDUCTOR_CACHE_DIR`` appearing with inductor's default
    value: inductor writes it there when this process first asks for its cache (the
    profiler does), and a child without it derives the same directory.
    """
    names = set(started) | set(now)
    default: list[str] = []  # inductor's default directory, read once if needed

    def derived(name: str) -> bool:
        if name in started:
            return False
        if name in _torch_private.COMPILE_SET_ENVIRONMENT:
            return True
        if name != "TORCHINDUCTOR_CACHE_DIR":
            return False
        if not default:
            default.append(_torch_private.inductor_default_cache_dir())
        return os.path.abspath(now[name]) == default[0]

    return sorted(
        name for name in names if started.get(name) != now.get(name) and not derived(name)
    )


class CudaDevice(Device):
    """One CUDA card, its memory capped to ``budget_bytes``; every run from a clean state.

    Args:
        budget_bytes: what the card may give to tensors (the CUDA context is outside it).
        target: ``"file.py:factory"`` the children rebuild the workload from; without it the
            workload is ``torch.save``'d once and loaded by them.
        profile: passed to ``apply_candidate`` (checkpointing reads block names from it).
        strategy_names: the strategies to apply candidates with (None: all registered).
        index: the card; default the current one.
        fresh_process: False runs in this process (with clean-state checks) from the start.
        fork_server: False starts a fresh process per run instead of forking a zygote.
        timeout_s: a run taking longer is killed and reported as a PlanningError.
        runner: ``"file.py:function"`` each forked child runs instead of the CUDA runner
            (:mod:`memadvisor.device._zygote`); the CPU tests drive this device with one.
    """

    def __init__(
        self,
        budget_bytes: int,
        *,
        target: str | None = None,
        profile: Profile | None = None,
        strategy_names: Sequence[str] | None = None,
        index: int | None = None,
        fresh_process: bool = True,
        fork_server: bool = True,
        timeout_s: float = 600.0,
        runner: str | None = None,
    ) -> None:
        if not torch.cuda.is_available():
            raise BadInputError(
                "device='cuda' needs a CUDA device, but torch.cuda.is_available() is False; "
                "use device='simulated' (or 'auto') to plan on the CPU."
            )
        self.index = torch.cuda.current_device() if index is None else index
        props = torch.cuda.get_device_properties(self.index)
        super().__init__(budget_bytes, props.name)
        self.total_bytes = int(props.total_memory)
        if budget_bytes > self.total_bytes:
            raise BadInputError(
                f"The budget of {budget_bytes / 2**30:.2f} GiB is more than this card's "
                f"{self.total_bytes / 2**30:.2f} GiB ({props.name}); pass a smaller budget_gb."
            )
        self.target = target
        self.profile = profile
        self.strategy_names = list(strategy_names) if strategy_names is not None else None
        self.timeout_s = timeout_s
        self.runner = runner
        self.mode: Literal["fork_server", "fresh_process", "in_process"] = "in_process"
        if fresh_process:
            forks = fork_server and hasattr(os, "fork")
            self.mode = "fork_server" if forks else "fresh_process"
        # 0700, and removed however this process ends (a janitor process removes it if this
        # one is killed): the saved workload is a pickle of the user's model and code.
        self._dir = private_dir("memadvisor-cuda-")
        # Held by this process while it compiles beside the children's runs (host_busy).
        self._host_lock = str(self._dir / "host.lock")
        self._finalizer = weakref.finalize(self, remove_private_dir, self._dir)
        self._workload_path: Path | None = None
        self._baseline_allocated: int | None = None
        self._zygote: ForkServer | None = None
        self._zygote_finalizer: weakref.finalize | None = None
        self._pending = False  # the zygote was spawned (prestart) and has not answered ready
        self._card: DeviceCapabilities | None = None

    @property
    def capabilities(self) -> DeviceCapabilities:  # type: ignore[override]
        """The card's (:data:`~memadvisor.schema.device.CUDA_CARD`: its times rank, a run's
        fixed cost dwarfs its steps), its bytes free now, fresh processes until runs fell
        back to this one (a workload that cannot be saved), and the runs :meth:`run_many`
        makes at once: as many children of the fork server as the free bytes hold (each its
        budget and :data:`PER_PROCESS_BYTES`, :data:`RESERVE_BYTES` left free) and the
        host's cores (:data:`CORES_PER_RUN` each, :func:`usable_cores`), at most
        :data:`MAX_CONCURRENT_RUNS`; 1 without a fork server.

        Known limitations: the cores' share is from one host of 16 cores, where 8 at once
        was faster than 4; a host of fewer cores per card is bounded by the same share, not
        measured."""
        if self._card is None:  # what does not change: read once
            self._card = card_capabilities(self.index)
        free = int(torch.cuda.mem_get_info(self.index)[0])
        fresh = self.mode != "in_process"
        concurrent = 1
        if self.mode == "fork_server":
            room = (free - RESERVE_BYTES) // (self.budget_bytes + PER_PROCESS_BYTES)
            cores = usable_cores() // CORES_PER_RUN
            concurrent = max(1, min(MAX_CONCURRENT_RUNS, room, cores))
        return self._card.model_copy(
            update={
                "free_bytes": free,
                "fresh_processes": fresh,
                "concurrent_runs": concurrent,
                "retries_in_process": self.mode == "fork_server",
            }
        )

    def close(self) -> None:
        """Stop the zygote; remove the saved workload and requests."""
        self._stop_zygote()
        self._finalizer()

    def host_busy(self) -> AbstractContextManager[None]:
        """See :meth:`Device.host_busy`: the fork server's children, at once or alone, wait
        for it before their timed steps (:func:`memadvisor.device._turns.host_busy`); the
        fresh processes and this process's own runs do not."""
        if self.mode != "fork_server":
            return contextlib.nullcontext()
        return _turns.host_busy(self._host_lock)

    # -- the contract -----------------------------------------------------------------------

    def run(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        self._send_workload(workload)
        if self.mode == "fork_server":
            answer = self._run_forked(candidate, steps)
            if answer is not None:
                return answer
        if self.mode == "fresh_process":
            answer = self._run_child(candidate, steps)
            if answer is not None:
                return answer
        return self._run_here(workload, candidate, steps)

    def run_many(
        self, workload: Workload, runs: Sequence[tuple[Candidate, int]]
    ) -> list[Measurement | Exception]:
        """Each ``(candidate, steps)`` of ``runs`` as :meth:`run` makes it; the answers in
        order, each the measurement or the error its run raised (an out-of-memory is one).

        With a fork server, in groups of at most ``capabilities.concurrent_runs`` runs made
        at once by its children, their timed steps in turn (the module docstring); else, or
        for a single run, one after another. A group's runs share one timeout, ``timeout_s``
        per run. Where the fork server cannot serve a group (it died, or CUDA would not
        start in a forked child) this device falls back to fresh processes, as :meth:`run`
        does, and makes that group's runs without an answer one by one.
        """
        runs = list(runs)
        if len(runs) > 1:
            self._send_workload(workload)
        if self.mode != "fork_server" or len(runs) < 2:
            return super().run_many(workload, runs)
        return self._in_groups(workload, [(c, steps, None) for c, steps in runs])

    # -- what the children need -------------------------------------------------------------

    def _send_workload(self, workload: Workload) -> None:
        """Save the workload for the children unless they rebuild it (a target) or have it."""
        if self.mode != "in_process" and self.target is None and self._workload_path is None:
            self._save_workload(workload)

    def _save_workload(self, workload: Workload) -> None:
        path = self._dir / "workload.pt"
        parts = {
            "model": workload.model,
            "sample_batch": workload.sample_batch,
            "loss_fn": workload.loss_fn,
            "optimizer": workload.optimizer_factory,
            "make_batch": workload.make_batch,
            "forward_fn": workload.forward_fn,
        }
        try:
            save_workload(parts, path)
            path.chmod(0o600)
        except Exception as e:  # noqa: BLE001 - any pickling failure means "cannot send it"
            self._fall_back(f"the workload cannot be sent to one ({type(e).__name__}: {e})")
            return
        self._workload_path = path

    def _fall_back(self, why: str) -> None:
        self._stop_zygote()
        self.mode = "in_process"
        self.notes.append(
            f"{IN_PROCESS_NOTE_START} because {why}. Each started from a checked clean state "
            "(cache emptied, allocated memory back to its baseline, dynamo reset for a "
            "compiled candidate), but measurements near the budget are less sure than a fresh "
            "process's; pass a target ('file.py:factory') whose parts cloudpickle can send "
            "for fresh-process probes."
        )

    def _profile_file(self) -> str | None:
        """The profile, saved for the children (None: no profile yet)."""
        if self.profile is None:
            return None
        path = self._dir / "profile.json"
        if not path.exists():
            path.write_text(self.profile.model_dump_json())
        return str(path)

    def _setup(self) -> dict[str, Any]:
        """What a child needs besides the candidate: the worker's request, less the run."""
        return {
            "budget_bytes": self.budget_bytes,
            "device_index": self.index,
            "target": self.target,
            "workload_path": str(self._workload_path) if self._workload_path else None,
            "profile_path": self._profile_file(),
            "strategies": self.strategy_names,
            # Appended after the child's own stdlib and site-packages, never before them.
            "sys_path": absolute_sys_path(),
            "target_files": _target_files(),
            "host_lock": self._host_lock,
        }

    # -- fork server --------------------------------------------------------------------------

    def prestart(self, workload: Workload) -> None:
        """Start the fork server now, without waiting for it: its imports and the model's
        build (8-14 s on a card for a 0.35B model, paid by the plan's first probe before)
        overlap what the planner does next, its profile and screening. The profile reaches
        the server with the first run. A no-op unless runs fork, or if one is running.

        The environment must be the one the runs use: the caller enters what sets it (a
        strategy's ``plan_scope``) first, or the first run starts another server.
        """
        if self.mode != "fork_server" or self._zygote is not None:
            return
        if self.target is None and self._workload_path is None:
            self._save_workload(workload)
            if self.mode != "fork_server":
                return
        zygote = ForkServer(
            {**self._setup(), "runner": self.runner}, stderr_path=self._dir / "zygote.stderr"
        )
        try:
            zygote.spawn()
        except ZygoteDied as e:
            zygote.kill()
            self._to_fresh_processes(f"the fork server did not start ({e})")
            return
        self._adopt(zygote)
        self._pending = True

    def _serving_zygote(self) -> ForkServer | None:
        """The zygote to fork this process's runs from, ready: the one running (awaited if
        prestarted), or a new one where there is none, it exited, or this process's
        environment changed since it started; None when this device fell back instead."""
        zygote = self._zygote
        changed = environment_changed(zygote.parent_env, dict(os.environ)) if zygote else []
        if changed:
            # Its children would run with the environment it started with, not this one
            # (the compile stage points inductor's cache somewhere): start one that has it.
            logger.debug("a new fork server: the environment changed (%s)", ", ".join(changed))
            self._stop_zygote()
            zygote = None
        if zygote is not None and self._pending:
            return self._await_ready(zygote)
        if zygote is None or not zygote.alive:
            return self._start_zygote()
        return zygote

    def _run_forked(self, candidate: Candidate, steps: int) -> Measurement | None:
        """The run in a forked child of the zygote; None when this device fell back instead."""
        zygote = self._serving_zygote()
        if zygote is None:
            return None
        try:
            answer = zygote.run(
                candidate.model_dump(mode="json"),
                steps,
                self.timeout_s,
                profile_path=self._profile_file(),
            )
        except TimeoutError as e:
            self._stop_zygote()  # killed with its child; the next run starts a new one
            raise PlanningError(
                f"A probe process (batch {candidate.batch_size}) ran past {self.timeout_s:.0f} "
                "s and was killed; pass fewer probe_steps or a larger timeout."
            ) from e
        except ZygoteDied as e:
            self._to_fresh_processes(
                f"the fork server stopped ({e}); its stderr ends:\n{zygote.stderr_tail(500)}"
            )
            return None
        if answer["status"] == "unforkable":
            self._to_fresh_processes(
                f"CUDA did not start in a forked child ({answer.get('message')})"
            )
            return None
        if answer["status"] == "crashed":
            raise self._crashed(answer, candidate)
        return _measurement(answer, candidate, self._fall_back)

    def run_many_retrying(
        self, workload: Workload, runs: Sequence[tuple[Candidate, int, int | None]]
    ) -> list[Measurement | Exception]:
        """See :meth:`Device.run_many_retrying`: with a fork server, each run's retry in its
        own child (``train_candidate``'s ``retry_at``), the runs made at once as
        :meth:`run_many` makes them; elsewhere the default's runs of their own."""
        runs = list(runs)
        if self.mode != "fork_server":
            return super().run_many_retrying(workload, runs)
        self._send_workload(workload)
        return self._in_groups(workload, runs)

    def _in_groups(
        self, workload: Workload, runs: list[tuple[Candidate, int, int | None]]
    ) -> list[Measurement | Exception]:
        """``runs`` (:meth:`run_many`'s, or :meth:`run_many_retrying`'s with their retries)
        in groups of at most ``capabilities.concurrent_runs``, each made at once by the fork
        server's children (:meth:`_run_group`); a lone run without a retry as :meth:`run`
        makes it, and a group after the fork server fell back within the call the base's
        way."""
        size = self.capabilities.concurrent_runs
        answers: list[Measurement | Exception] = []
        for start in range(0, len(runs), size):
            group = runs[start : start + size]
            plain = [(c, steps) for c, steps, _ in group]
            retries = [retry for *_, retry in group]
            if self.mode == "fork_server" and (len(group) > 1 or retries[0] is not None):
                answers += self._run_group(workload, plain, retries)
            elif any(r is not None for r in retries):
                answers += super().run_many_retrying(workload, group)
            else:
                answers += super().run_many(workload, plain)
        return answers

    def _run_group(
        self,
        workload: Workload,
        group: list[tuple[Candidate, int]],
        retries: Sequence[int | None],
    ) -> list[Measurement | Exception]:
        """``group``'s runs at once in children of the zygote (:meth:`run_many`), each
        retried in its child at ``retries``' batch where it runs out (None: not retried)."""
        zygote = self._serving_zygote()
        if zygote is None:
            return super().run_many(workload, group)
        profile_path = self._profile_file()
        requests = [
            {"candidate": c.model_dump(mode="json"), "steps": steps, "profile_path": profile_path}
            for c, steps in group
        ]
        for request, retry in zip(requests, retries, strict=True):
            if retry is not None:
                request["retry_at"] = retry
        timeout_s = self.timeout_s * len(group)
        try:
            answers = zygote.run_many(requests, timeout_s)
        except TimeoutError as e:
            self._stop_zygote()  # killed with its children; the next run starts a new one
            batches = ", ".join(str(c.batch_size) for c, _ in group)
            timed_out: list[Measurement | Exception] = []
            for _ in group:  # which of them overran, none can tell: each run's answer
                error = PlanningError(
                    f"Probe processes made at once (batches {batches}) ran past "
                    f"{timeout_s:.0f} s together and were killed; pass fewer probe_steps or a "
                    "larger timeout."
                )
                error.__cause__ = e
                timed_out.append(error)
            return timed_out
        except ZygoteDied as e:
            self._to_fresh_processes(
                f"the fork server stopped ({e}); its stderr ends:\n{zygote.stderr_tail(500)}"
            )
            return super().run_many(workload, group)
        unforkable = [a for a in answers if a["status"] == "unforkable"]
        if unforkable:
            self._to_fresh_processes(
                f"CUDA did not start in a forked child ({unforkable[0].get('message')})"
            )
        out: list[Measurement | Exception | None] = []
        for (candidate, _), answer in zip(group, answers, strict=True):
            if unforkable and answer["status"] not in ("ok", "oom"):
                out.append(None)  # made again below, in a fresh process
            elif answer["status"] == "crashed":
                out.append(self._crashed(answer, candidate))
            else:
                try:
                    out.append(_measurement(answer, candidate, self._fall_back))
                except Exception as e:  # noqa: BLE001 - every run's error is its answer
                    out.append(e)
        again = [run for run, answer in zip(group, out, strict=True) if answer is None]
        made = iter(super().run_many(workload, again) if again else [])
        return [next(made) if answer is None else answer for answer in out]

    def _crashed(self, answer: dict[str, Any], candidate: Candidate) -> PlanningError:
        """The error for a child that died without answering, its stderr's tail with it."""
        return PlanningError(
            f"A probe process (batch {candidate.batch_size}) died: {answer['message']}. "
            f"Its stderr ends with:\n{self._zygote_stderr_tail()}"
        )

    def _start_zygote(self) -> ForkServer | None:
        """A ready zygote, or None when this device fell back (the mode says to what)."""
        setup = {**self._setup(), "runner": self.runner}
        zygote = ForkServer(setup, stderr_path=self._dir / "zygote.stderr")
        try:
            zygote.spawn()
        except ZygoteDied as e:
            zygote.kill()
            self._to_fresh_processes(f"the fork server did not start ({e})")
            return None
        return self._await_ready(zygote)

    def _await_ready(self, zygote: ForkServer) -> ForkServer | None:
        """``zygote`` once its setup answered ready, or None when this device fell back."""
        self._pending = False
        try:
            answer = zygote.ready(self.timeout_s)
        except (ZygoteDied, TimeoutError) as e:
            zygote.kill()
            self._to_fresh_processes(
                f"the fork server did not start ({e}); its stderr ends with:\n"
                f"{zygote.stderr_tail(500)}"
            )
            return None
        if answer["status"] != "ready":
            # The workload did not load there: a fresh process would fail alike.
            self._forget_zygote()
            _measurement(answer, None, self._fall_back)
            return None
        self._adopt(zygote)
        return zygote

    def _adopt(self, zygote: ForkServer) -> None:
        if self._zygote is zygote:
            return
        self._zygote = zygote
        self._zygote_finalizer = weakref.finalize(self, zygote.kill)

    def _forget_zygote(self) -> None:
        """Drop the handle on a zygote that already closed itself."""
        self._zygote = None
        if self._zygote_finalizer is not None:
            self._zygote_finalizer.detach()
            self._zygote_finalizer = None

    def _stop_zygote(self) -> None:
        pending, self._pending = self._pending, False
        if self._zygote is not None:
            # One still in its setup reads no exit request until the setup ends: kill it.
            self._zygote.kill() if pending else self._zygote.close()
            self._zygote = None
        if self._zygote_finalizer is not None:
            self._zygote_finalizer.detach()
            self._zygote_finalizer = None

    def _zygote_stderr_tail(self) -> str:
        return self._zygote.stderr_tail() if self._zygote is not None else ""

    def _to_fresh_processes(self, why: str) -> None:
        self._stop_zygote()
        self.mode = "fresh_process"
        self.notes.append(
            f"Probes ran in a fresh process each (slower), not as children of a fork server, "
            f"because {why.strip().rstrip('.')}."
        )

    # -- fresh process ------------------------------------------------------------------------

    def _run_child(self, candidate: Candidate, steps: int) -> Measurement | None:
        request = {**self._setup(), "candidate": candidate.model_dump(mode="json"), "steps": steps}
        path = self._dir / "request.json"
        path.write_text(json.dumps(request))
        cmd = python_command("memadvisor.device._worker", str(path))
        try:
            done = subprocess.run(
                cmd,
                capture_output=True,
                text=True,
                timeout=self.timeout_s,
                cwd=os.getcwd(),
                env=probe_env(),
            )
        except subprocess.TimeoutExpired as e:
            raise PlanningError(
                f"A probe process (batch {candidate.batch_size}) ran past {self.timeout_s:.0f} "
                "s and was killed; pass fewer probe_steps or a larger timeout."
            ) from e
        answer = _parse_answer(done.stdout)
        if answer is None:
            raise PlanningError(
                f"A probe process (batch {candidate.batch_size}) exited with code "
                f"{done.returncode} without an answer. Its stderr ends with:\n"
                f"{done.stderr[-2000:]}"
            )
        return _measurement(answer, candidate, self._fall_back)

    # -- this process -----------------------------------------------------------------------

    def _run_here(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        device = torch.device("cuda", self.index)
        from memadvisor.strategy import facts_of

        compiled = facts_of(candidate).compiled  # loads the strategies the candidate names
        if compiled:
            # A fresh process compiles the candidate's batch with static shapes; here dynamo
            # would remember earlier batches and compile this one with a dynamic batch
            # dimension (measured on an H200: 0.59x the static throughput, docs/design.md).
            torch.compiler.reset()
        self._clean(device)
        previous = _get_fraction(self.index)
        # The cap counts everything this process reserves: the caller's own tensors stay, and
        # the run gets the budget on top of them.
        cap = torch.cuda.memory_reserved(device) + self.budget_bytes
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / self.total_bytes), self.index)
        try:
            return train_candidate(
                workload,
                candidate,
                steps,
                device=device,
                strategy_names=self.strategy_names,
                profile=self.profile,
                copy_model=True,
            )
        finally:
            torch.cuda.set_per_process_memory_fraction(previous, self.index)
            if compiled:
                # Nor may the user's own loop, after the plan, inherit this batch's graphs.
                torch.compiler.reset()
            gc.collect()
            torch.cuda.empty_cache()

    def _clean(self, device: torch.device) -> None:
        gc.collect()
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        allocated = torch.cuda.memory_allocated(device)
        if self._baseline_allocated is None:
            self._baseline_allocated = allocated
        elif allocated > self._baseline_allocated:
            leaked = allocated - self._baseline_allocated
            self.notes.append(
                f"{leaked / MIB:.1f} MiB stayed allocated after an in-process probe (a leak in "
                "the step, or tensors an error kept alive); later probes had that much less room."
            )
            self._baseline_allocated = allocated
        torch.cuda.reset_peak_memory_stats(device)


def _measurement(
    answer: dict[str, Any], candidate: Candidate | None, fall_back: Callable[[str], None]
) -> Measurement | None:
    """A child's answer as a Measurement, or the error it stands for.

    ``unloadable`` calls ``fall_back`` with the reason and returns None (run in this process).

    Raises:
        torch.OutOfMemoryError: the child ran out of memory.
        BadInputError: the child rejected the workload as the user's mistake.
        ProbeProcessError: anything else that went wrong in the child (a PlanningError).
    """
    status = answer["status"]
    if status == "ok":
        return Measurement.model_validate(answer["measurement"])
    if status == "oom":
        error = torch.OutOfMemoryError(answer["message"])
        error.memadvisor_steps_completed = answer.get("steps_completed", 0)  # type: ignore[attr-defined]
        if answer.get("retry_ran_out") is not None:  # its retry in the child ran out too
            same = bool(answer.get("retry_same_process", True))
            mark_retry_ran_out(error, answer["retry_ran_out"], same_process=same)
        raise error
    if status == "unloadable":
        fall_back(f"a fresh process could not load the workload ({answer['message']})")
        return None
    if answer.get("bad_input"):  # BadInputError or a subclass (UserCodeError) in the child
        raise BadInputError(answer["message"])
    where = f"batch {candidate.batch_size}" if candidate is not None else "loading the workload"
    raise ProbeProcessError(
        f"A probe process ({where}) failed with "
        f"{answer.get('type')}: {answer.get('message')}\n{answer.get('traceback', '')[-3000:]}",
        raised=answer.get("type"),
    )


def _target_files() -> list[str]:
    """Files loaded by path as targets (``memadvisor.target``) in this process.

    Their functions and classes pickle by the module name the loader gave them; the child
    loads the same files under the same names first, so a saved workload that uses them
    (the example GPT's ``loss_fn``) can be unpickled there.
    """
    from memadvisor.target import TARGET_MODULE_PREFIX

    return sorted(
        str(m.__file__)
        for name, m in list(sys.modules.items())
        if name.startswith(TARGET_MODULE_PREFIX) and getattr(m, "__file__", None)
    )


def _parse_answer(stdout: str) -> dict[str, Any] | None:
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            return json.loads(line[len(RESULT_MARKER) :])
    return None
