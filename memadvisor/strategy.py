"""The contract every memory strategy implements, and the registry that finds them.

A strategy is one way to trade memory for something else. The planner knows none by name:
it asks each registered strategy four questions (:class:`Strategy`). Built-ins live in the
top-level ``strategies`` package and register through the entry-point group
``memadvisor.strategies`` exactly as a third-party package does::

    [project.entry-points."memadvisor.strategies"]
    my_strategy = "my_package.module:MyStrategy"
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, ClassVar

from pydantic import BaseModel, ConfigDict, Field, JsonValue
from torch import nn

from memadvisor.errors import BadInputError

if TYPE_CHECKING:
    from memadvisor.config import PlanConfig
    from memadvisor.estimate import StepModel
    from memadvisor.profiler import Profile
    from memadvisor.workload import Workload

__all__ = ["ENTRY_POINT_GROUP", "Advice", "Check", "Strategy", "load_strategies"]

ENTRY_POINT_GROUP = "memadvisor.strategies"


class Advice(BaseModel):
    """One recommendation a person can adopt by hand."""

    model_config = ConfigDict(extra="forbid")

    strategy: str = Field(description="The strategy's registered name.")
    title: str = Field(description="A few words: 'Checkpoint 6 of 12 blocks'.")
    sentence: str = Field(description="What to do and why, in plain words.")
    snippet: str = Field("", description="Code to paste into one's own training script.")
    effect: str = Field("", description="Its effect, measured or marked as estimated.")


class Check(BaseModel):
    """What a strategy measured about a choice on the user's own workload (e.g. numerics)."""

    model_config = ConfigDict(extra="forbid")

    strategy: str = Field(description="The strategy's registered name.")
    choice: JsonValue = Field(None, description="The choice that was checked.")
    summary: str = Field(description="One sentence a person reads: what differed, by how much.")
    passed: bool = Field(description="False when the difference is worth a person's attention.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="The measured numbers, named with their units."
    )


class Strategy(ABC):
    """One way to trade memory for time (or for nothing).

    Subclasses set ``name`` and answer four questions. A *choice* is any JSON value; the
    strategy's first choice from :meth:`choices` is its neutral one (off).
    """

    name: ClassVar[str]
    #: Order in which effects are applied to the StepModel (precision runs first).
    effect_order: ClassVar[int] = 50
    #: True when the eager profile does not predict this strategy's choices (torch.compile):
    #: its ``effect()`` leaves the estimate as eager, so the planner must not rank a
    #: non-neutral choice on the estimate but measure candidates with it on the device.
    measured_only: ClassVar[bool] = False

    @abstractmethod
    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        """The choices worth searching for this profile, the neutral one first."""

    @abstractmethod
    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        """Edit ``model`` to what ``choice`` does to memory and time (pure, no device)."""

    @abstractmethod
    def apply(self, model: nn.Module, choice: JsonValue, profile: Profile | None) -> nn.Module:
        """Rewrite ``model`` for ``choice``; parameter names and state_dict keys unchanged."""

    def validate(self, model: nn.Module, choice: JsonValue, profile: Profile | None) -> None:
        """Raise ``BadInputError`` when :meth:`apply` would refuse ``choice`` for ``model``.

        Called for every chosen strategy before any of them applies, so that a plan that does
        not fit the model rewrites none of it. Optional: the default accepts every choice
        (apply's own errors are then caught and the rewrite taken back).
        """
        return None

    @abstractmethod
    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        """A sentence and a snippet a person can adopt; None when the choice is neutral."""

    def check(self, workload: Workload, choice: JsonValue) -> Check | None:
        """Measure ``choice`` on copies of the user's workload (the user's model untouched).

        Optional: the default measures nothing. Precision compares a few steps' losses and
        gradients with fp32's.
        """
        return None

    def screen(self, workload: Workload, profile: Profile, config: PlanConfig) -> list[Check]:
        """Check choices on copies of the user's workload before the search, so that a
        choice that fails its check is never picked.

        A strategy whose checks decide runs them here and leaves a choice whose check failed
        out of :meth:`choices` for the rest of the plan, unless ``config.checks`` is
        'report'. The planner reports every check returned. Optional: the default checks
        nothing (and :meth:`check` then reports on the pick after the search).
        """
        return []

    def is_neutral(self, choice: JsonValue) -> bool:
        """True when ``choice`` changes nothing (default: falsy, or 'fp32'/'off')."""
        return choice in (None, False, 0, [], "off", "fp32")


def load_strategies(names: list[str] | None = None) -> list[Strategy]:
    """Instances of every strategy registered under ``memadvisor.strategies``.

    Args:
        names: keep only these (by registered name), in this order.

    Raises:
        BadInputError: a name in ``names`` is not registered, or an entry point does not load
            a Strategy subclass.
    """
    found: dict[str, Strategy] = {}
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        cls = ep.load()
        if not (isinstance(cls, type) and issubclass(cls, Strategy)):
            raise BadInputError(
                f"Entry point {ep.name!r} = {ep.value!r} in group {ENTRY_POINT_GROUP!r} is not a "
                "memadvisor.strategy.Strategy subclass."
            )
        found.setdefault(cls.name, cls())
    if names is None:
        return list(found.values())
    unknown = [n for n in names if n not in found]
    if unknown:
        raise BadInputError(
            f"Unknown strategies {unknown}; registered: {sorted(found)}. Install the package "
            f"that provides them or fix the name."
        )
    return [found[n] for n in names]
