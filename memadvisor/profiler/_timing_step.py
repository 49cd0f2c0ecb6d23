"""One training step, timed: each phase, each block's forward and backward, the other owners.

Kept apart from the metered step because the meter's Python dispatch mode runs on every op
and would inflate the times. Only the blocks and the modules named as activation owners are
hooked here. CUDA is timed with events (resolved after one synchronize at the end), the CPU
with the wall clock.

A block's backward starts when the gradient of its first output is ready (a tensor hook on
its outputs) and ends when the gradients of all its inputs that need one are
(``register_multi_grad_hook``); a block whose inputs need no gradient (the first block over
raw inputs) ends with the backward phase.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from torch import nn

from memadvisor.profiler._device import Target
from memadvisor.profiler._memory_step import tensors_in
from memadvisor.workload import Workload, train_step

__all__ = ["TimingMeasurement", "TimingStep"]


@dataclasses.dataclass
class TimingMeasurement:
    """Milliseconds of one step at one batch size and precision."""

    block_forward_ms: list[float]
    block_backward_ms: list[float]
    module_forward_ms: dict[str, float]
    forward_ms: float  # forward and loss
    loss_ms: float
    backward_ms: float
    optimizer_ms: float
    step_ms: float

    @staticmethod
    def fastest(runs: list[TimingMeasurement]) -> TimingMeasurement:
        """Each number's minimum over ``runs``: the least disturbed reading of each."""
        first = runs[0]
        return TimingMeasurement(
            block_forward_ms=[min(r.block_forward_ms[i] for r in runs)
                              for i in range(len(first.block_forward_ms))],
            block_backward_ms=[min(r.block_backward_ms[i] for r in runs)
                               for i in range(len(first.block_backward_ms))],
            module_forward_ms={k: min(r.module_forward_ms.get(k, 0.0) for r in runs)
                               for k in first.module_forward_ms},
            forward_ms=min(r.forward_ms for r in runs),
            loss_ms=min(r.loss_ms for r in runs),
            backward_ms=min(r.backward_ms for r in runs),
            optimizer_ms=min(r.optimizer_ms for r in runs),
            step_ms=min(r.step_ms for r in runs),
        )  # fmt: skip


class _Clock:
    """Stamps that become milliseconds since the first one: CUDA events or the wall clock."""

    def __init__(self, target: Target) -> None:
        self.cuda = target.is_cuda
        self.device = target.device
        self.origin = self.stamp()

    def stamp(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def resolve(self, stamps: list[Any]) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return [self.origin.elapsed_time(s) for s in stamps]
        return [(s - self.origin) * 1000.0 for s in stamps]


class TimingStep:
    """Runs one timed ``train_step``.

    Args:
        model: the (private copy of the) model.
        block_names: qualified names of the blocks, in order.
        module_names: other modules whose forward time is wanted (activation owners).
        target: the device.
    """

    def __init__(
        self, model: nn.Module, block_names: list[str], module_names: list[str], target: Target
    ) -> None:
        self.model = model
        self.block_names = block_names
        self.module_names = [n for n in module_names if n not in set(block_names)]
        self.target = target

    def run(
        self, workload: Workload, optimizer: torch.optim.Optimizer, batch: Any
    ) -> TimingMeasurement:
        n = len(self.block_names)
        self.clock = _Clock(self.target)
        self.phase = ""
        self.phase_stamps: dict[str, Any] = {}
        self.fwd: list[list[tuple[Any, Any]]] = [[] for _ in range(n)]
        self.bwd_start: list[list[Any]] = [[] for _ in range(n)]
        self.bwd_end: list[list[Any]] = [[] for _ in range(n)]
        self.mod: dict[str, list[tuple[Any, Any]]] = {m: [] for m in self.module_names}
        handles = []
        for i, name in enumerate(self.block_names):
            handles += self._hook(self.model.get_submodule(name), block=i, name=name)
        for name in self.module_names:
            handles += self._hook(self.model.get_submodule(name), block=None, name=name)
        try:
            train_step(workload, self.model, optimizer, batch, on_phase=self._on_phase)
        finally:
            for h in handles:
                h.remove()
        return self._resolve()

    def _on_phase(self, phase: str) -> None:
        self.phase = phase
        self.phase_stamps[phase] = self.clock.stamp()

    def _hook(self, module: nn.Module, block: int | None, name: str) -> list[Any]:
        start: list[Any] = []

        def pre(_m: nn.Module, args: Any, kwargs: Any) -> None:
            if self.phase not in ("forward", "loss"):
                return  # a recomputation inside backward is backward time
            start.append(self.clock.stamp())
            if block is None or not torch.is_grad_enabled():
                return
            needing = [t for t in tensors_in((args, kwargs)) if t.requires_grad]
            if needing:
                torch.autograd.graph.register_multi_grad_hook(
                    needing, lambda _g: self.bwd_end[block].append(self.clock.stamp()), mode="all"
                )

        def post(_m: nn.Module, _args: Any, output: Any) -> None:
            if not start:
                return
            pair = (start.pop(), self.clock.stamp())
            if block is None:
                self.mod[name].append(pair)
                return
            self.fwd[block].append(pair)
            if torch.is_grad_enabled():
                for t in tensors_in(output):
                    if t.requires_grad:
                        t.register_hook(lambda _g: self.bwd_start[block].append(self.clock.stamp()))

        return [
            module.register_forward_pre_hook(pre, with_kwargs=True),
            module.register_forward_hook(post),
        ]

    def _resolve(self) -> TimingMeasurement:
        stamps: list[Any] = []

        def at(s: Any) -> int:
            stamps.append(s)
            return len(stamps) - 1

        phase_ix = {p: at(s) for p, s in self.phase_stamps.items()}
        fwd_ix = [[(at(a), at(b)) for a, b in pairs] for pairs in self.fwd]
        bs_ix = [[at(s) for s in ss] for ss in self.bwd_start]
        be_ix = [[at(s) for s in ss] for ss in self.bwd_end]
        mod_ix = {m: [(at(a), at(b)) for a, b in pairs] for m, pairs in self.mod.items()}
        ms = self.clock.resolve(stamps)

        def phase_ms(p: str) -> float:
            return ms[phase_ix[p]] if p in phase_ix else 0.0

        backward_end = phase_ms("optimizer")
        block_bwd = []
        for starts, ends in zip(bs_ix, be_ix, strict=True):
            if not starts:
                block_bwd.append(0.0)
                continue
            end = max(ms[i] for i in ends) if ends else backward_end
            block_bwd.append(max(0.0, end - min(ms[i] for i in starts)))
        return TimingMeasurement(
            block_forward_ms=[sum(ms[b] - ms[a] for a, b in pairs) for pairs in fwd_ix],
            block_backward_ms=block_bwd,
            module_forward_ms={
                m: sum(ms[b] - ms[a] for a, b in pairs) for m, pairs in mod_ix.items()
            },
            forward_ms=phase_ms("backward") - phase_ms("forward"),
            loss_ms=phase_ms("backward") - phase_ms("loss"),
            backward_ms=backward_end - phase_ms("backward"),
            optimizer_ms=phase_ms("zero_grad") - backward_end,
            step_ms=phase_ms("end") - phase_ms("forward"),
        )
