"""The Device contract: run a candidate's training steps from a clean state, report the peak."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from memadvisor.schema.candidate import Candidate, Measurement
    from memadvisor.workload import Workload

__all__ = ["Device"]


class Device(ABC):
    """Where probes, timing and verification run.

    ``run`` must start from a clean state every call (a fresh process, or a state proven equal
    to one: ``docs/design.md``, "A clean state per run") and raise an error for which
    :func:`memadvisor.errors.is_oom` is true when the candidate does not fit
    ``budget_bytes``. It never changes the caller's model, optimizer or RNG state.

    What the planner asks of a device besides ``run`` is declared here with a default, so a
    device (a test's, a third party's) overrides only what differs from it:
    :attr:`runs_cost_more_than_steps`, :attr:`step_times_rank`, :attr:`steady_memory`,
    :attr:`fresh_processes`,
    :attr:`notes`, :meth:`close` and :meth:`free_bytes`.
    """

    kind: ClassVar[str]
    #: Whether a run's fixed cost dwarfs its steps. On a card it does (a process, a CUDA
    #: context, the first step's kernel loading: seconds, against milliseconds a step): the
    #: planner then gives every probe the verification's steps, so a fitting run at the final
    #: batch *is* the verification. Default False: runs are short, the pick gets its own run.
    runs_cost_more_than_steps: bool = False
    #: Whether the device's step times can rank candidates. A card's can; a CPU meter's are
    #: slowed by its tracking and fake tensors take no time. Default False: the planner then
    #: ranks the confirmed batches by the estimate's step time.
    step_times_rank: bool = False
    #: Whether a run's memory repeats exactly from its second step on: no allocator cache
    #: and no fragmentation (the simulated device meters tensor bytes), so steps past a
    #: probe's show nothing new and the pick is verified over ``run_steps`` steps, not
    #: ``verify_steps`` (unless the user set those). Default False: a card's allocator can
    #: fail a later step that an earlier one passed.
    steady_memory: bool = False
    #: Whether every run starts in a process of its own. Default True; a device that runs in
    #: the planner's process says False (a compiled variant cannot be measured there).
    fresh_processes: bool = True

    def __init__(self, budget_bytes: int, name: str) -> None:
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, but got {budget_bytes=}.")
        self.budget_bytes = budget_bytes
        self.name = name
        #: What a person should know about how the runs went (fallbacks); the plan's notes.
        self.notes: list[str] = []

    def close(self) -> None:
        """Give back what the device holds (processes, files); default: nothing to give."""
        return None

    def free_bytes(self) -> int | None:
        """Bytes free on the device's card now, for work the planner's own process does
        beside the runs (a strategy's trial); default None: not a card."""
        return None

    @abstractmethod
    def run(self, workload: Workload, candidate: Candidate, steps: int) -> Measurement:
        """Train ``candidate`` for ``steps`` steps on a copy of ``workload``'s model."""
