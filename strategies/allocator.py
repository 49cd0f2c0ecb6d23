"""The CUDA caching allocator's expandable segments: the plan measures under them, and so
does the user's loop.

On a card, the default caching allocator carves each segment once and cannot grow it; a step
whose tensors change size from phase to phase leaves reserved memory it cannot reuse for the
next large block. Under a budget, the batch search then meets that fragmentation rather
than the step's bytes: lm350m (the 0.35B decoder LM, bf16, 24 blocks checkpointed) ran out
of memory at batch 16 with 6.71 GiB allocated and 1.21 GiB reserved but unallocated, under
8 GiB. With ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` a segment grows in place and
the same step held batch 21, and the compiled pick went from 98.5 samples/s at batch 16 to
129.7 at batch 24 (docs/design.md, "The allocator is part of the plan").

So on CUDA, unless the user's environment already says how segments behave, the whole plan
runs under expandable segments (:meth:`Allocator.plan_scope`: every probe process inherits
the variable), the pick records it (``"expandable_segments"``), and
:func:`memadvisor.apply_plan` sets it in the user's process
(``torch._C._accelerator_setAllocatorSettings``, behind ``memadvisor._torch_private``):
the numbers the plan measured are the numbers the user's loop can reach. ``options``
``allocator="off"`` plans under the process's own allocator and records nothing.

Known limitations:
    * The setting is the process's, not the model's: applying a plan that records it
      changes the CUDA allocator for everything the process allocates afterwards. Memory
      already reserved keeps its segments: a model moved to the card before
      ``apply_plan`` keeps its weights in the segments they were allocated in.
    * Where the planner's own process first touches CUDA inside the plan (the profiler),
      its allocator starts under the plan's setting too and keeps it after the plan.
    * Not searched: the plan does not time the default allocator against expandable
      segments. On the card the two models planned both ways (gpt, lm350m) were faster
      under expandable segments at the same budget (larger batches); a step that is slower
      under them is not detected.
    * A user's own ``PYTORCH_CUDA_ALLOC_CONF`` (or ``PYTORCH_ALLOC_CONF``) that names
      ``expandable_segments`` is kept as it is, True or False, and nothing is recorded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from pydantic import JsonValue

from memadvisor import _torch_private
from memadvisor.errors import BadInputError
from memadvisor.process_state import environ_set
from memadvisor.schema.advice import Advice, ReportPart
from memadvisor.step import Step
from memadvisor.strategy import (
    Configured,
    Described,
    EffectOrder,
    Recorded,
    Scoped,
    Strategy,
)

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.candidate import Candidate
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.device import DeviceCapabilities
    from memadvisor.schema.plan import Plan
    from memadvisor.schema.profile import Profile

__all__ = [
    "EXPANDABLE",
    "SETTING",
    "VARIABLES",
    "Allocator",
    "planned_environment",
    "users_setting",
]

#: The choice a plan records when it ran under expandable segments.
EXPANDABLE = "expandable_segments"
#: The allocator setting it stands for, as ``PYTORCH_CUDA_ALLOC_CONF`` spells it.
SETTING = "expandable_segments:True"
#: The variables torch reads the allocator's settings from (the generic name first: torch
#: 2.9 and later read it before the CUDA one).
VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
_OFF = ("off", None)
#: The plan's ``allocator=`` settings (:meth:`Allocator.check_setting`).
SETTINGS = ("auto", "on", "off")


def users_setting() -> str | None:
    """The user's own setting of expandable segments ('VARIABLE=value'), None where their
    environment does not name it."""
    for name in VARIABLES:
        value = os.environ.get(name, "")
        if "expandable_segments" in value:
            return f"{name}={value}"
    return None


def planned_environment() -> dict[str, str]:
    """The variable to set for the plan: the user's own variable with the setting added
    (their other settings kept), else ``PYTORCH_CUDA_ALLOC_CONF`` with it alone."""
    for name in VARIABLES:
        value = os.environ.get(name, "").strip().strip(",")
        if value:
            return {name: f"{value},{SETTING}"}
    return {"PYTORCH_CUDA_ALLOC_CONF": SETTING}


def _check_choice(choice: JsonValue) -> str | None:
    if choice in _OFF:
        return None
    if choice != EXPANDABLE:
        raise BadInputError(
            f"An allocator choice is {EXPANDABLE!r} or 'off', but got {choice=}. Plans record "
            "it themselves; leave it out of a hand-written plan to keep your allocator."
        )
    return EXPANDABLE


class Allocator(Strategy, Described, Recorded, Scoped, Configured):
    """Plans on CUDA under the caching allocator's expandable segments and records it for
    ``apply_plan`` and the advice; changes neither the model nor the estimate."""

    name = "allocator"
    effect_order = EffectOrder.BATCH
    installs = "expandable segments"

    def __init__(self) -> None:
        self._planned: str | None = None  # the setting the plan in progress runs under

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        # Not searched: the whole plan runs under one setting (plan_scope); record() says it.
        return [None]

    def is_neutral(self, choice: JsonValue) -> bool:
        return choice in _OFF

    def changes_step(self, choice: JsonValue) -> bool:
        """Never: the step is the same; the process's allocator holds it differently."""
        return False

    def describe(self, choice: JsonValue, plan: Plan) -> ReportPart | None:
        """An answer row: the plan's numbers hold under this allocator, so the answer says it
        beside the precision and the batch (None where the plan recorded none)."""
        if _check_choice(choice) is None:
            return None
        return ReportPart(
            label="Allocator",
            words=f"expandable segments (PYTORCH_CUDA_ALLOC_CONF={SETTING}; apply_plan sets it)",
            brief="expandable segments",
        )

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        """Nothing: the estimate prices allocated bytes, which the setting does not change."""
        _check_choice(choice)

    def validate(self, step: Step, choice: JsonValue) -> None:
        """Refuses a choice other than the allocator's before any strategy applies."""
        _check_choice(choice)

    def apply(self, step: Step, choice: JsonValue) -> Step:
        """Sets expandable segments for this process's CUDA allocator where the plan ran
        under them (a process-wide setting: see the module's Known limitations); returns
        ``step`` unchanged."""
        if _check_choice(choice) is not None and users_setting() is None:
            _torch_private.set_allocator_settings(SETTING)
        return step

    def check_setting(self, value: JsonValue) -> None:
        """A plan's ``allocator=`` setting: ``"auto"`` (or ``"on"``), ``"off"`` (or None).

        Raises:
            BadInputError: anything else (read as on, a misspelt ``"of"`` planned under
                expandable segments), with the value and what to pass.
        """
        if value not in (*SETTINGS, None):
            raise BadInputError(
                f"The allocator option is one of {SETTINGS}, but got {value!r}; pass "
                "allocator='off' to plan without expandable segments, or leave it out."
            )

    def plan_scope(
        self, config: PlanConfig, device: DeviceCapabilities
    ) -> contextlib.AbstractContextManager | None:
        """On CUDA, the whole plan under expandable segments (every probe process inherits
        the variable), unless ``options`` ``allocator="off"`` or the user's environment
        already names the setting."""
        if device.tensor_device != "cuda" or config.option(self.name, "auto") in _OFF:
            return None
        if users_setting() is not None:
            return None
        return self._expandable()

    @contextlib.contextmanager
    def _expandable(self) -> Iterator[None]:
        with environ_set(planned_environment()):
            self._planned = EXPANDABLE
            try:
                yield
            finally:
                self._planned = None

    def record(self, pick: Candidate, config: PlanConfig) -> JsonValue | None:
        """``"expandable_segments"`` where the plan ran under them; None otherwise."""
        return self._planned

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        if _check_choice(choice) is None:
            return None
        return Advice(
            strategy=self.name,
            title="Expandable segments",
            sentence=(
                "Every run of this plan used the CUDA caching allocator's expandable segments, "
                "which grow a segment in place instead of leaving reserved memory the next "
                "large block cannot use; its batch holds under them. apply_plan sets them for "
                "this process (new allocations; memory already reserved stays as it is). "
                "Training without apply_plan, set the variable before the first CUDA "
                "allocation."
            ),
            snippet=(
                "# before the process's first CUDA allocation (or in the shell: "
                f"export PYTORCH_CUDA_ALLOC_CONF={SETTING})\n"
                "import os\n"
                f'os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "{SETTING}")\n'
            ),
            effect="the batch the plan measured; fewer out-of-memory errors from fragmentation",
        )
