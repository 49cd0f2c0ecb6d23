"""A CUDA card under the user's budget, each run in a fresh process.

The budget is the user's, not the card's: ``torch.cuda.set_per_process_memory_fraction``
caps what the caching allocator may reserve, so an 80 GB card plans for an 8 GB one.

Why a fresh process per run (DESIGN.md, measured on an H200): after a few out-of-memory
errors the allocator is fragmented and tensors leak, so a search in one process found batch
25 for a ViT that holds 92 in a fresh one. Each :meth:`CudaDevice.run` starts
``python -m memadvisor.device._worker``, which rebuilds the workload from the user's
factory (``target``) or from a ``torch.save``'d copy of it, trains, and prints a
:class:`Measurement` as JSON on stdout.

When the workload cannot be saved (a ``lambda`` loss does not pickle) or the child cannot
load it (a model class defined in ``__main__``), runs fall back to this process, each from a
checked clean state: garbage collected, the cache emptied, ``memory_allocated`` back to its
baseline, peak stats reset. :attr:`CudaDevice.notes` says so, and the planner copies it
into ``Plan.notes``.

Known limitations:
    * A fresh process costs a few seconds (importing torch, creating the CUDA context,
      building the model): a plan's probes add up to about a minute on examples.
    * The budget caps *reserved* memory; the CUDA context (~500 MiB) is outside it, as it
      is outside what ``torch.cuda.mem_get_info`` reports a card can give to tensors.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch

from memadvisor.device._base import Device, Measurement
from memadvisor.device._oom import is_oom
from memadvisor.errors import BadInputError, PlanningError
from memadvisor.estimate import Candidate
from memadvisor.profiler import Profile
from memadvisor.workload import Workload, train_step

__all__ = ["RESULT_MARKER", "CudaDevice", "train_candidate"]

RESULT_MARKER = "MEMADVISOR_RESULT "  # prefixes the child's answer; the model may print too
MIB = 2**20


def _apply(
    model: torch.nn.Module,
    candidate: Candidate,
    strategy_names: Sequence[str] | None,
    profile: Profile | None,
) -> torch.nn.Module:
    from memadvisor.apply import apply_candidate  # the strategies' package; imported late
    from memadvisor.strategy import load_strategies

    strategies = load_strategies(list(strategy_names) if strategy_names is not None else None)
    return apply_candidate(model, candidate, strategies, profile=profile)


def train_candidate(
    workload: Workload,
    candidate: Candidate,
    steps: int,
    *,
    device: torch.device,
    strategy_names: Sequence[str] | None = None,
    profile: Profile | None = None,
    copy_model: bool = True,
) -> Measurement:
    """Train ``candidate`` for ``steps`` steps on ``device`` and measure it.

    The peak is what this run added to what was allocated when it began (in a fresh process
    that is everything: weights, optimizer state, activations).

    Raises:
        torch.OutOfMemoryError: (or another error ``is_oom`` accepts) when it does not fit;
            ``memadvisor_steps_completed`` on the error says how many steps finished.
    """
    torch.cuda.synchronize(device)
    base_allocated = torch.cuda.memory_allocated(device)
    base_reserved = torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    times_ms: list[float] = []
    try:
        model = copy.deepcopy(workload.model) if copy_model else workload.model
        for p in model.parameters():
            p.grad = None  # a run starts without gradients, as train_step leaves them
        model = _apply(model.to(device), candidate, strategy_names, profile)
        optimizer = workload.make_optimizer(model)
        batch = workload.batch(candidate.batch_size, device)
        for _ in range(steps):
            t0 = time.perf_counter()
            train_step(
                workload, model, optimizer, batch, accumulation_steps=candidate.accumulation_steps
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
    return Measurement(
        steps=steps,
        peak_bytes=peak,
        reserved_peak_bytes=max(reserved, 0),
        step_ms=step_ms,
        samples_per_s=samples / step_ms * 1e3 if step_ms > 0 else float("inf"),
    )


def _get_fraction(index: int) -> float:
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    return float(getter(index)) if getter is not None else 1.0


class CudaDevice(Device):
    """One CUDA card, its memory capped to ``budget_bytes``; every run in a fresh process.

    Args:
        budget_bytes: what the card may give to tensors (the CUDA context is outside it).
        target: ``"file.py:factory"`` the child rebuilds the workload from; without it the
            workload is ``torch.save``'d once and loaded by each child.
        profile: passed to ``apply_candidate`` (checkpointing reads block names from it).
        strategy_names: the strategies to apply candidates with (None: all registered).
        index: the card; default the current one.
        fresh_process: False runs in this process (with clean-state checks) from the start.
        timeout_s: a child taking longer is killed and reported as a PlanningError.
    """

    kind: ClassVar[Literal["cuda"]] = "cuda"

    def __init__(
        self,
        budget_bytes: int,
        *,
        target: str | None = None,
        profile: Profile | None = None,
        strategy_names: Sequence[str] | None = None,
        index: int | None = None,
        fresh_process: bool = True,
        timeout_s: float = 600.0,
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
        self.notes: list[str] = []
        self.mode: Literal["fresh_process", "in_process"] = (
            "fresh_process" if fresh_process else "in_process"
        )
        self._dir = Path(tempfile.mkdtemp(prefix="memadvisor-cuda-"))
        self._finalizer = weakref.finalize(self, shutil.rmtree, self._dir, True)
        self._workload_path: Path | None = None
        self._baseline_allocated: int | None = None

    def close(self) -> None:
        """Remove the saved workload and requests."""
        self._finalizer()

    # -- the contract -----------------------------------------------------------------------

    def run(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        if self.mode == "fresh_process" and self.target is None and self._workload_path is None:
            self._save_workload(workload)
        if self.mode == "fresh_process":
            answer = self._run_child(candidate, steps)
            if answer is not None:
                return answer
        return self._run_here(workload, candidate, steps)

    # -- fresh process ----------------------------------------------------------------------

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
            torch.save(parts, path)
        except Exception as e:  # noqa: BLE001 - any pickling failure means "cannot send it"
            self._fall_back(f"the workload does not pickle ({type(e).__name__}: {e})")
            return
        self._workload_path = path

    def _fall_back(self, why: str) -> None:
        self.mode = "in_process"
        self.notes.append(
            f"Probes ran in this process, not in fresh ones, because {why}. Each started from a "
            "checked clean state (cache emptied, allocated memory back to its baseline); pass "
            "a target ('file.py:factory') or a picklable loss_fn for fresh-process probes."
        )

    def _request(self, candidate: Candidate, steps: int) -> Path:
        profile_path = self._dir / "profile.json"
        if self.profile is not None and not profile_path.exists():
            profile_path.write_text(self.profile.model_dump_json())
        request = {
            "budget_bytes": self.budget_bytes,
            "device_index": self.index,
            "candidate": candidate.model_dump(mode="json"),
            "steps": steps,
            "target": self.target,
            "workload_path": str(self._workload_path) if self._workload_path else None,
            "profile_path": str(profile_path) if self.profile is not None else None,
            "strategies": self.strategy_names,
            "sys_path": [p for p in sys.path if p],
            "target_files": _target_files(),
        }
        path = self._dir / "request.json"
        path.write_text(json.dumps(request))
        return path

    def _run_child(self, candidate: Candidate, steps: int) -> Measurement | None:
        request = self._request(candidate, steps)
        cmd = [sys.executable, "-m", "memadvisor.device._worker", str(request)]
        try:
            done = subprocess.run(
                cmd, capture_output=True, text=True, timeout=self.timeout_s, cwd=os.getcwd()
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
        status = answer["status"]
        if status == "ok":
            return Measurement.model_validate(answer["measurement"])
        if status == "oom":
            error = torch.OutOfMemoryError(answer["message"])
            error.memadvisor_steps_completed = answer.get("steps_completed", 0)  # type: ignore[attr-defined]
            raise error
        if status == "unloadable":
            self._fall_back(f"a fresh process could not load the workload ({answer['message']})")
            return None
        if answer.get("type") == "BadInputError":
            raise BadInputError(answer["message"])
        raise PlanningError(
            f"A probe process (batch {candidate.batch_size}) failed with "
            f"{answer.get('type')}: {answer.get('message')}\n{answer.get('traceback', '')[-3000:]}"
        )

    # -- this process -----------------------------------------------------------------------

    def _run_here(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        device = torch.device("cuda", self.index)
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
