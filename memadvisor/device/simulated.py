"""A card simulated on the CPU: tensor bytes tracked as they come and go, the budget enforced.

CI has no GPU, yet probing, verification and the estimate's accuracy must be tested
honestly. :class:`SimulatedDevice` trains real CPU tensors (or fake ones, see
:mod:`memadvisor.device.fake`) under a :class:`~memadvisor.memory.MemoryMeter` whose budget
is the card's: the op that would take the live bytes past it raises
:class:`~memadvisor.errors.SimulatedOutOfMemoryError`, a ``torch.OutOfMemoryError`` that
:func:`~memadvisor.device.is_oom` recognises, as the CUDA allocator raises its own.

Clean state is exact here, not approximated: every run meters a fresh copy of the model
with a fresh meter, so nothing a previous run left behind (a fragmented cache, a leaked
tensor) can change the next one's answer, which on a card needs a fresh process.

Known limitations (what the meter sees is tensor bytes, as ``memory_allocated`` counts):
    * No allocator: no 512-byte block rounding, no cached blocks, no fragmentation, so a
      card fails somewhat earlier than this device (``docs/design.md``, "Reserved above
      allocated"). The planner's margin covers it.
    * No cuBLAS workspaces or CUDA context ("What a card holds beyond tensors").
    * Step times are the CPU's, slowed by the meter: good for ranking nothing; the CUDA
      device times steps.
"""

from __future__ import annotations

import contextlib
import copy
import os
import time
from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from memadvisor.device._autocast import cuda_autocast_policy
from memadvisor.device._base import Device
from memadvisor.errors import BadInputError, SimulatedOutOfMemoryError, is_oom
from memadvisor.memory import MemoryMeter
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import samples_per_s, steady_ms
from memadvisor.schema.device import SIMULATED
from memadvisor.schema.profile import Profile
from memadvisor.workload import Workload, tensor_leaves, train_step

__all__ = [
    "AutocastPolicy",
    "SimulatedDevice",
    "check_host_holds",
    "host_available_bytes",
    "tensor_leaves",
]


def host_available_bytes() -> int | None:
    """Host memory a new allocation can get now (Linux's MemAvailable: free memory plus the
    page cache it can drop); None where the platform does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def check_host_holds(budget_bytes: int) -> None:
    """Refuse a budget the simulated device could not hold: its tensors live in host RAM.

    Without this a plan fills a budget larger than the host's memory and fails on a CPU
    allocation, which reads as the model rejecting the batch.

    Raises:
        BadInputError: ``budget_bytes`` is more than the host memory available now.
    """
    available = host_available_bytes()
    if available is None or budget_bytes <= available:
        return
    raise BadInputError(
        f"The simulated device keeps its tensors in host RAM, and this machine has "
        f"{available / 2**30:.2f} GiB available, less than the budget of "
        f"{budget_bytes / 2**30:.2f} GiB: host RAM is the limit here. Plan for a budget "
        "below that, or on a card (device='cuda')."
    )


AutocastPolicy = Literal["cuda", "cpu"]


class SimulatedDevice(Device):
    """A card of ``budget_bytes`` simulated on the CPU; every run on a fresh copy.

    Args:
        budget_bytes: what the simulated card gives to tensors.
        profile: passed to ``apply_candidate`` (strategies may check a choice against it).
        strategy_names: the strategies candidates are applied with; None loads the ones
            each candidate names.
        autocast_policy: ``"cuda"`` (default) casts under bf16/fp16 autocast as a card
            would (:mod:`memadvisor.device._autocast`); ``"cpu"`` keeps CPU autocast's own
            policy. The profile the estimate reads should be measured with the same one.
        name: how reports name this device.
    """

    capabilities = SIMULATED

    def __init__(
        self,
        budget_bytes: int,
        *,
        profile: Profile | None = None,
        strategy_names: Sequence[str] | None = None,
        autocast_policy: AutocastPolicy = "cuda",
        name: str = "simulated card (CPU)",
    ) -> None:
        super().__init__(budget_bytes, name)
        if autocast_policy not in ("cuda", "cpu"):
            raise BadInputError(f"autocast_policy is 'cuda' or 'cpu', but got {autocast_policy=}.")
        self.profile = profile
        self.strategy_names = list(strategy_names) if strategy_names is not None else None
        self.autocast_policy = autocast_policy
        cuda_lists = autocast_policy == "cuda"
        if type(self).capabilities.autocast.cuda_cast_lists != cuda_lists:
            autocast = type(self).capabilities.autocast.model_copy(
                update={"cuda_cast_lists": cuda_lists}
            )
            self.capabilities = type(self).capabilities.model_copy(update={"autocast": autocast})

    # -- the contract -----------------------------------------------------------------------

    def run(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        """Train a fresh copy of ``workload``'s model ``steps`` steps under the budget.

        The caller's model, its gradients and the RNG state are left as they were.

        Raises:
            SimulatedOutOfMemoryError: the step (or the weights alone) pass the budget;
                ``memadvisor_steps_completed`` on it says how many steps finished.
            BadInputError: ``steps`` < 1, or the candidate does not fit the model.
        """
        if steps < 1:
            raise BadInputError(f"A run needs at least one step, but got {steps=}.")
        times_ms: list[float] = []
        meter = MemoryMeter(self.budget_bytes)
        try:
            with torch.random.fork_rng(devices=[]), self._context(workload):
                run = self._apply(workload, self._fresh_model(workload), candidate)
                model = run.model
                optimizer = run.make_optimizer(model)
                batch = run.batch(candidate.batch_size)
                # On a card the weights and the batch are in memory before the step starts.
                meter.adopt(model.parameters())
                meter.adopt(model.buffers())
                meter.adopt(tensor_leaves(batch))
                if meter.live_bytes > self.budget_bytes:
                    raise SimulatedOutOfMemoryError(meter.live_bytes, 0, self.budget_bytes)
                held: list = []  # the last output, kept into the next step as a loop does
                with self._policy(), meter:
                    for _ in range(steps):
                        t0 = time.perf_counter()
                        train_step(
                            run,
                            model,
                            optimizer,
                            batch,
                            accumulation_steps=candidate.accumulation_steps,
                            held=held,
                        )
                        times_ms.append((time.perf_counter() - t0) * 1e3)
        except Exception as e:
            if is_oom(e):
                e.memadvisor_steps_completed = len(times_ms)  # type: ignore[attr-defined]
            raise
        # The first step creates the optimizer state: not a steady step.
        step_ms = steady_ms(times_ms)
        samples = candidate.batch_size * candidate.accumulation_steps
        return Measurement(
            steps=steps,
            peak_bytes=meter.peak_bytes,
            reserved_peak_bytes=None,
            step_ms=step_ms,
            samples_per_s=samples_per_s(samples, step_ms),
        )

    # -- pieces a fake device replaces ------------------------------------------------------

    def _context(self, workload: Workload) -> contextlib.AbstractContextManager:
        """Where the run's tensors are made (the fake device enters its FakeTensorMode)."""
        return contextlib.nullcontext()

    def _fresh_model(self, workload: Workload) -> nn.Module:
        model = copy.deepcopy(workload.model)
        # A copied .grad would be accumulated into without being counted (it predates the
        # meter); a fresh run starts without gradients, as train_step leaves them.
        for p in model.parameters():
            p.grad = None
        return model

    # -- helpers ----------------------------------------------------------------------------

    def _apply(self, workload: Workload, model: nn.Module, candidate: Candidate) -> Workload:
        """``workload`` running ``candidate``'s rewritten step over ``model``."""
        from memadvisor.step import base_step, running

        step = base_step(workload, model, self.profile)
        if not candidate.choices:
            return running(workload, step)
        from memadvisor.strategy import apply_candidate, load_strategies

        names = self.strategy_names if self.strategy_names is not None else list(candidate.choices)
        strategies = load_strategies(names)
        return running(workload, apply_candidate(step, candidate, strategies))

    def _policy(self) -> contextlib.AbstractContextManager:
        lists = self.capabilities.autocast.cuda_cast_lists
        return cuda_autocast_policy() if lists else contextlib.nullcontext()
