"""The contract every memory strategy implements, and the registry that finds them.

A strategy is one way to trade memory for something else. The planner and the report know
none by name: they ask each registered strategy the questions of :class:`Strategy`. Built-ins
live in the top-level ``strategies`` package and register through the entry-point group
``memadvisor.strategies`` exactly as a third-party package does::

    [project.entry-points."memadvisor.strategies"]
    my_strategy = "my_package.module:MyStrategy"

The core is four questions (``choices``, ``effect``, ``apply``, ``explain``) and three with
defaults that change nothing (``validate``, ``is_neutral``, ``facts``). ``apply`` rewrites
the training :class:`~memadvisor.step.Step`: the model, and where the strategy needs it, the
forward and the loss together. ``facts`` says what a choice does (autocast dtype, recomputed
blocks, compiled, a parallel wrap, a changed loss) for the layers that must not read a
strategy by name.

Everything else is opt-in, by subclassing a protocol; the planner asks ``isinstance``:

* :class:`Checked`: measure a choice on copies of the user's workload (precision's numerics).
* :class:`Measured`: choices the estimate cannot predict, measured in ``refine`` after the
  eager pick, on its variants and those of other eager combinations the search space holds
  (torch.compile searches the checkpointed set under compile).
* :class:`Scoped`: an environment the whole plan runs in, which the probe processes inherit
  (compile's inductor cache, the allocator's setting); every Measured strategy may have one.
* :class:`Recorded`: record the planner's pick for the advice (the batch).
* :class:`HandTried`: the choice a person would try first, for the report's comparison rows.
* :class:`TimedEachChoice`, :class:`TimedAlternatives`: markers asking the planner to time
  choices the estimate cannot rank (autocast; DDP against FSDP2).
* :class:`Described`: the report's words for a choice, what ``apply_plan`` installs.
* :class:`WrapsRanks`: wrap the model in each rank's process (DDP, FSDP2).

docs/design.md, "Writing a strategy", walks through one.

Known limitations:
    * ``refine`` runs after the eager pick, once per measured strategy in registration
      order; a variant is judged against the pick the previous stage returned. A stage may
      measure variants of other eager combinations (``PickStage.score``, ``PickStage.run``:
      compile searches the checkpointed set), but only its own strategy's choices: two
      measured strategies are never searched together.
"""

from __future__ import annotations

import contextlib
import json
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, ClassVar

from pydantic import JsonValue
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Advice, Check, ReportPart
from memadvisor.schema.candidate import Candidate, Estimate, Measurement, RanOutFirst
from memadvisor.schema.facts import Facts
from memadvisor.schema.plan import Probe, StageOutcome
from memadvisor.step import Step, step_from_call_form

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.device import DeviceCapabilities
    from memadvisor.schema.plan import Plan
    from memadvisor.schema.profile import Profile
    from memadvisor.workload import Workload

__all__ = [
    "ENTRY_POINT_GROUP",
    "RUNS_COMPILE_VARIABLE",
    "Checked",
    "Configured",
    "Confirmed",
    "Described",
    "EffectOrder",
    "Estimated",
    "HandTried",
    "Measured",
    "PickStage",
    "Recorded",
    "Refinement",
    "Scoped",
    "Strategy",
    "TimedAlternatives",
    "TimedEachChoice",
    "WrapsRanks",
    "apply_candidate",
    "apply_to_model",
    "changes_step",
    "chosen_strategies",
    "describe_choice",
    "facts_of",
    "installs",
    "load_strategies",
    "registered_names",
    "wrap_ranks",
]

ENTRY_POINT_GROUP = "memadvisor.strategies"
# A strategy's plan scope (Scoped) sets this to "1" where the plan's runs may call
# torch.compile: a device that forks its runs from one server then imports inductor's
# compiler there once, for every child (memadvisor/device/_zygote.py, _warm_compiler).
# A user's "0" is kept (no such import).
RUNS_COMPILE_VARIABLE = "MEMADVISOR_RUNS_COMPILE"


@dataclass
class Confirmed:
    """A candidate the device ran at the batch its probes allow, and what that run measured."""

    candidate: Candidate
    found_batch: int  # the largest micro-batch the probes allow (before the objective's pick)
    measured: Measurement  # a run of exactly ``candidate``


@dataclass(frozen=True)
class Estimated:
    """An eager combination as the estimate scores it: at the batch the objective takes."""

    candidate: Candidate
    estimate: Estimate  # at candidate's batch
    largest_batch: int  # the estimate's largest micro-batch under the usable budget


class PickStage(ABC):
    """What the planner lends a measured-only strategy after the eager pick.

    The strategy sees the plan's inputs and the device's capabilities, the search space
    (:attr:`options`, :meth:`score`), and measures its variants only through :meth:`run`
    (one run) and :meth:`confirm`, which runs the same batch search the eager pick got (so a
    variant and the eager pick are judged by one rule). Every run is logged in the plan's
    probes under the strategy's name; a run already made is answered without the device.
    """

    config: PlanConfig
    profile: Profile
    workload: Workload
    strategies: Sequence[Strategy]
    #: What the device can do (read when the stage began): whether its times rank, whether
    #: it compiles, where its tensors are. Never compare its kind: it is for display.
    device: DeviceCapabilities
    #: Each strategy's choices in this plan's search, by name (a measured-only strategy's:
    #: its neutral one alone).
    options: dict[str, list[JsonValue]]

    @property
    def step_times_rank(self) -> bool:
        """Whether the device's step times rank candidates (a card's do; a CPU meter's not)."""
        return self.device.step_times_rank

    @property
    def fresh_processes(self) -> bool:
        """Whether every run starts in a fresh process (False: runs share the planner's)."""
        return self.device.fresh_processes

    @property
    def free_bytes(self) -> int | None:
        """Bytes free on the device's card (None: not a card): room for work in this process."""
        return self.device.free_bytes

    @abstractmethod
    def confirm(
        self,
        choices: dict[str, JsonValue],
        start_batch: int,
        *,
        like: Confirmed | None = None,
        max_runs: int | None = None,
        within: float = 0.0,
        floor_from: dict[str, JsonValue] | None = None,
        ceiling: int | None = None,
        beside: Sequence[tuple[dict[str, JsonValue], int]] = (),
    ) -> Confirmed | None:
        """``choices`` at the largest batch the device allows, searched from ``start_batch``
        (the eager pick's confirmed batch is a good start); None when not even batch 1 fits.

        Args:
            choices: the variant's choices.
            start_batch: where the batch search starts.
            like: a confirmed pick whose step this variant's is another form of (default: the
                pick the stage refines): at its batch, a run that allocates no more than it
                did is confirmed without searching its own edge.
            max_runs: at most this many device runs; when they are spent, the largest batch
                of ``choices`` that fitted within the limit is the answer. None: no bound.
            within: after a failure, stop bisecting once the batch still to gain is at most
                this fraction above the largest fit (each run of a compiled variant is a
                compile; a batch 3% larger gains less than the 3% a compile must). 0: bisect
                to the sample.
            floor_from: other choices, the same step in another form (a compiled variant's
                dynamic-batch form), whose runs bound the descent as ``choices``' own would:
                a batch of them that fitted within the limit is where it stops. None: only
                ``choices``' own runs.
            ceiling: no upward probe above this batch (a compiled line capped by its largest
                allocation: gpt's confirmation on a card ran 317, 306 and 279 above its cap
                at 252, all out of memory). None: the extrapolation decides.
            beside: other runs, each ``(choices, batch)`` (the compile stage's static form
                at the start: the pick's verification where the search keeps its start; the
                CUDA graphs' first round), made at once with the search's first device run
                where the device makes runs at once (:attr:`concurrent_runs`: as many as it
                makes beside that run, in order), and kept as :meth:`run` keeps a run, so
                that asking for one later costs no device run; not counted in ``max_runs``.
                Not made on a device of one run at a time, or where the search makes no
                run.
        """

    @abstractmethod
    def run(self, choices: dict[str, JsonValue], batch: int) -> Measurement | None:
        """One device run of ``choices`` at ``batch`` (None: it ran out of memory), logged;
        a run already made of the same is answered without the device."""

    def run_many(
        self,
        runs: Sequence[tuple[dict[str, JsonValue], int]],
        retry_at: Sequence[int | None] | None = None,
        ahead: Sequence[bool] | None = None,
        steps: int | None = None,
    ) -> list[Measurement | None | Exception]:
        """Each ``(choices, batch)`` of ``runs`` as :meth:`run` makes it, on the device at once
        where it can (:attr:`concurrent_runs`); per run, in order: its measurement, None (it
        ran out), or the error of a run that failed otherwise. Default: one after another.

        ``steps``: the steps each run takes where not the stage's own (None): a run that only
        ranks or draws a line may take fewer; a later ask for the stage's steps runs it
        again. Default: ignored, each run as :meth:`run` makes it.

        ``retry_at``: per run, a smaller batch measured where the run runs out (in the same
        process where the device keeps it: ``Device.run_many_retrying``); that run's answer
        is then the smaller batch's measurement, its ``ran_out_first`` set, and both batches
        are logged. Default: the retry is a run of its own.

        ``ahead``: per run, True for a run made ahead of the stage's asking for it: neither
        logged nor counted until :meth:`run`, a batch search (:meth:`confirm`) or this
        method asks for the same run, which then takes it without a device run. Default:
        such a run is not made (its answer None): one after another it saves no wait."""
        answers: list[Measurement | None | Exception] = []
        for i, (choices, batch) in enumerate(runs):
            if ahead is not None and ahead[i]:
                answers.append(None)
                continue
            try:
                answer = self.run(choices, batch)
                retry = retry_at[i] if retry_at is not None else None
                if answer is None and retry is not None and 0 < retry < batch:
                    smaller = self.run(choices, retry)
                    if smaller is not None:
                        first = RanOutFirst(
                            batch_size=batch, message="out of memory", steps=0, same_process=False
                        )
                        answer = smaller.model_copy(update={"ran_out_first": first})
                answers.append(answer)
            except Exception as e:  # noqa: BLE001 - every run's error is its answer
                answers.append(e)
        return answers

    @property
    def concurrent_runs(self) -> int:
        """Runs :meth:`run_many` makes at once on the device (1: one after another)."""
        return self.device.concurrent_runs

    @abstractmethod
    def score(self, choices: dict[str, JsonValue]) -> Estimated | None:
        """The estimate's view of ``choices`` (eager's, for a measured-only choice): the
        largest batch under the usable budget; None when not even batch 1 fits."""

    @abstractmethod
    def held_bytes(self, measured: Measurement) -> int:
        """The bytes of a run the batch search reads (with the measured margin the
        allocated peak, else the reserved one)."""

    @property
    @abstractmethod
    def limit_bytes(self) -> int:
        """The most :meth:`held_bytes` may be for a run's batch to be a pick."""

    @property
    @abstractmethod
    def probes(self) -> Sequence[Probe]:
        """Every device run of the plan so far, this stage's included."""

    @abstractmethod
    def describe(self, text: str) -> None:
        """Say on the progress line what the stage is doing now; the device runs that follow
        say their batch after it (``compiling candidate 2/4 (...): batch 8 running``)."""

    def below_failure(self, choices: dict[str, JsonValue], failed: int) -> int:
        """The largest batch a pick of ``choices`` may take under ``failed``, a batch of them
        that ran out of memory: the plan's margin below a failure (default: the batch
        under it)."""
        return failed - 1

    @contextlib.contextmanager
    def progress(self) -> Iterator[None]:
        """The stage's own progress line, while its device runs happen (default: none)."""
        yield

    @contextlib.contextmanager
    def side_by_side(self) -> Iterator[None]:
        """While this thread compiles and another waits on the device's runs (the compile
        trial beside pass 1): :meth:`describe` from this thread says what this process does,
        from the other what the device runs, and the progress line shows both, so neither
        hides the other (default: nothing changes)."""
        yield

    def compiling_here(self) -> contextlib.AbstractContextManager[None]:
        """While the block runs this process works beside the device's runs (the compile
        trial beside pass 1): the device's runs take their timed steps after it, not beside
        it (the planner's stage: ``Device.host_busy``). Leave the block before waiting for
        those runs: they wait for it to end. Default: nothing waits."""
        return contextlib.nullcontext()


@dataclass
class Refinement:
    """What a measured stage decided: the pick to verify, and what it measured."""

    pick: Confirmed
    outcome: StageOutcome | None = None
    notes: list[str] = field(default_factory=list)


class EffectOrder(IntEnum):
    """When a strategy's effect and rewrite apply relative to the others, lowest first.

    Each place says what the strategies after it may rely on; a third party picks the place
    its rewrite belongs to (or an int between two).
    """

    PRECISION = 0  #: the dtype every later effect and rewrite sees
    BATCH = 10  #: the loop's batch (records the pick only)
    RECOMPUTE = 50  #: which activations are kept (checkpointed blocks)
    LOSS = 55  #: how the head and the loss are computed
    OFFLOAD = 60  #: where kept activations live
    COMPILE = 80  #: compiles what the rewrites above left
    OPTIMIZER = 85  #: the loop's optimizer habits (advice only)
    PARALLEL = 90  #: wraps the rewritten model for each rank
    INFERENCE = 95  #: no backward at all: last


class Strategy(ABC):
    """One way to trade memory for time (or for nothing): the core contract.

    Subclasses set ``name`` and answer four questions (:meth:`choices`, :meth:`effect`,
    :meth:`apply`, :meth:`explain`). A *choice* is any JSON value; the strategy's first
    choice from :meth:`choices` is its neutral one (off). What more a strategy does it opts
    into by also subclassing a protocol of this module (:class:`Checked`, :class:`Measured`,
    :class:`Recorded`, :class:`HandTried`, :class:`TimedEachChoice`,
    :class:`TimedAlternatives`, :class:`Described`, :class:`WrapsRanks`); the planner and the
    report ask ``isinstance``, never compare methods.
    """

    name: ClassVar[str]
    #: When this strategy's effect and rewrite apply (:class:`EffectOrder`).
    effect_order: ClassVar[int] = EffectOrder.RECOMPUTE
    #: The :class:`~memadvisor.schema.facts.Facts` fields this strategy's choices may set
    #: ({"autocast", "tf32"} for precision): what a layer can know of it before any choice,
    #: e.g. an integration that leaves the precision to the user's framework.
    states: ClassVar[frozenset[str]] = frozenset()

    @abstractmethod
    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        """The choices worth searching for this profile, the neutral one first."""

    @abstractmethod
    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        """Edit ``model`` to what ``choice`` does to memory and time (pure, no device)."""

    @abstractmethod
    def apply(self, step: Step, choice: JsonValue) -> Step:
        """Rewrite the training ``step`` for ``choice`` and return it.

        A module strategy rewrites ``step.model`` in place and returns ``step``; a strategy
        that changes how the loss is computed returns ``step.replace(forward=..., loss=...,
        loss_changed_by=step.loss_changed_by + (self.name,))``. Parameter names and
        ``state_dict`` keys stay unchanged. ``step.profile`` is the profile the choice was
        planned from (None where there is none).
        """

    @abstractmethod
    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        """A sentence and a snippet a person can adopt; None when the choice is neutral."""

    def validate(self, step: Step, choice: JsonValue) -> None:
        """Raise ``BadInputError`` when :meth:`apply` would refuse ``choice`` for ``step``.

        Called for every chosen strategy before any of them applies, so that a plan that does
        not fit the model rewrites none of it. Default: every choice is accepted (apply's own
        errors are then caught and the rewrite taken back).
        """
        return None

    def is_neutral(self, choice: JsonValue) -> bool:
        """True when ``choice`` changes nothing (default: falsy, or 'off').

        A strategy whose neutral choice is another word (precision's 'fp32') says so here.
        """
        return choice in (None, False, 0, [], "off")

    def facts(self, choice: JsonValue) -> Facts:
        """What ``choice`` does to the step, for layers that must not read this strategy by
        name (the devices, the integrations, other strategies): its autocast dtype, the
        blocks it recomputes, whether it compiles, how ranks wrap the model, whether the loss
        is computed another way. Default: no facts (a choice those layers need not know).
        """
        return Facts()


# -- opt-in protocols ------------------------------------------------------------------------


class WrapsRanks(ABC):
    """Opt-in protocol: a strategy whose choice wraps the model in each rank's process.

    The ranks (:mod:`memadvisor.device.ranks`) call :meth:`wrap_rank` in every rank after
    the process group is up and the candidate's other choices are applied, and build the
    optimizer over what it returns. They find such a strategy by ``isinstance``, never by
    name, and learn from the candidate's :class:`~memadvisor.schema.facts.Facts` that it
    runs on several ranks (``facts.parallel``).
    """

    @abstractmethod
    def wrap_rank(self, step: Step, choice: JsonValue, facts: Facts, device_id: int | None) -> Step:
        """``step`` with its model wrapped for this rank (``device_id``: the rank's CUDA
        device index, None on the CPU); ``facts``: the whole candidate's, e.g. the autocast
        dtype FSDP2 gathers its units in."""


class Checked(ABC):  # noqa: B024 - a protocol of two optional methods
    """Opt-in: the strategy measures its choices on copies of the user's workload."""

    #: Whether :meth:`screen` may be given a workload of fake tensors (``device="estimate"``:
    #: no card, no values) and decide on what it recognises without running the model
    #: (the loss head: whether memadvisor owns the loss). Estimate plans screen only such
    #: strategies, and a plan that measures nothing stays fast; the others' choices are
    #: offered there unchecked (precision: its numerics need values), and the plan says so.
    screens_fake_tensors: ClassVar[bool] = False

    def check(self, workload: Workload, choice: JsonValue) -> Check | None:
        """Measure ``choice`` on copies of the user's workload (the user's model untouched),
        after the search, for the plan's checks. Default: nothing."""
        return None

    def screen(self, workload: Workload, profile: Profile, config: PlanConfig) -> list[Check]:
        """Check choices before the search, so that a choice that fails is never picked.

        A strategy whose checks decide runs them here and leaves a choice whose check failed
        out of ``choices`` for the rest of the plan, unless ``config.checks`` is 'report'.
        The planner reports every check returned. Default: nothing (and :meth:`check` then
        reports on the pick after the search).
        """
        return []


class Configured(ABC):
    """Opt-in: the strategy takes a setting from a plan's options under its name
    (``compile="off"``), and checks it when the plan's config is made
    (``memadvisor.api.plan_config``), not when its stage runs.

    Why: a setting read only by a stage fails where that stage begins; compile's runs after
    the profile, the screening and the eager probes, so a misspelt ``compile="of"`` failed
    minutes into a plan on a card.
    """

    @abstractmethod
    def check_setting(self, value: JsonValue) -> None:
        """Return where ``value`` is a setting of this strategy; else raise.

        Raises:
            BadInputError: saying what was wrong, with the value, and what to pass instead.
        """


class Scoped(ABC):  # noqa: B024 - the one method has a default
    """Opt-in: the whole plan runs inside an environment of this strategy's
    (:meth:`plan_scope`): compile's one inductor cache, the allocator's expandable segments."""

    def plan_scope(
        self, config: PlanConfig, device: DeviceCapabilities
    ) -> contextlib.AbstractContextManager | None:
        """An environment the whole plan runs in, entered before the device starts its
        processes so that they inherit it (compile: one inductor cache for every probe);
        None: nothing. Exited when the plan ends, whatever happens."""
        return None


class Measured(Scoped):
    """Opt-in: the eager profile does not predict this strategy's choices (torch.compile).

    Its ``effect()`` leaves the estimate as eager, so the planner never ranks a non-neutral
    choice on the estimate: the strategy measures them itself in :meth:`refine`, after the
    eager pick.
    """

    @abstractmethod
    def refine(self, stage: PickStage, eager: Confirmed) -> Refinement | None:
        """Measure variants of ``eager`` (or of other combinations: ``stage.options``,
        ``stage.score``) through ``stage`` and return the pick to verify; None: keep
        ``eager``. Called after the device has chosen the eager pick and before verification,
        once per measured strategy in registration order."""


class Recorded(ABC):
    """Opt-in: the strategy searches nothing but records the planner's pick for its advice
    (the batch size)."""

    @abstractmethod
    def record(self, pick: Candidate, config: PlanConfig) -> JsonValue | None:
        """A choice that records ``pick`` for this strategy's advice; None: none."""


class HandTried(ABC):
    """Opt-in: a person would try one of this strategy's choices first by hand, and the
    report sets the plan against that row (and the rows' combination)."""

    @abstractmethod
    def by_hand(self, options: Sequence[JsonValue]) -> tuple[str | None, JsonValue] | None:
        """The choice a person tries first among ``options`` (this profile's) and the
        comparison row's label (``("+AMP", "bf16")``); None: no such row. A label of None
        puts the choice in every row instead (the ranks' wrap of a per-rank plan)."""


class TimedEachChoice(ABC):  # noqa: B024 - a marker
    """Opt-in marker: the estimate's step times for this strategy's choices can be off by
    more than the gap between candidates (autocast), so where times rank the planner times
    each of its choices, everything else plain, beside the estimate's best."""


class TimedAlternatives(ABC):  # noqa: B024 - a marker
    """Opt-in marker: what tells this strategy's choices apart is time the estimate does not
    price (communication: DDP against FSDP2), so where times rank the planner times the
    estimate's best candidate of each choice, and the device's times decide."""


class Described(ABC):  # noqa: B024 - every method has a default
    """Opt-in: the strategy shows its choice in the report in words of its own.

    A strategy that is not :class:`Described` is listed under the answer's "Also" as its
    choice (a string, or its JSON), and a non-neutral choice counts as changing the step
    (:func:`describe_choice`, :func:`changes_step`).
    """

    #: What :func:`memadvisor.apply_plan` installs in the model's forward for this strategy,
    #: in a word ('autocast'), for the comment on the report's adoption code; '': nothing.
    installs: ClassVar[str] = ""

    def describe(self, choice: JsonValue, plan: Plan) -> ReportPart | None:
        """How the report shows ``choice``, the plan's pick's (None when the pick leaves
        this strategy out): an answer row (a label), a phrase in the one-line answer, the
        profiled step it runs, the blocks it recomputes, its lines in a training loop.
        Default: as a strategy that is not Described is shown."""
        return _plain_part(self, choice)  # type: ignore[arg-type]

    def changes_step(self, choice: JsonValue) -> bool:
        """Whether ``choice`` changes the step the device runs (default: a non-neutral one).

        A choice that only records the pick (the batch) or advises (optimizer habits) does
        not: the report then calls a pick that differs from the baseline only by such
        choices the baseline itself.
        """
        return not self.is_neutral(choice)  # type: ignore[attr-defined]


def describe_choice(strategy: Strategy, choice: JsonValue, plan: Plan) -> ReportPart | None:
    """How the report shows ``strategy``'s ``choice``: its own words where it is
    :class:`Described`, else a non-neutral choice under "Also" as itself or its JSON."""
    if isinstance(strategy, Described):
        return strategy.describe(choice, plan)
    return _plain_part(strategy, choice)


def _plain_part(strategy: Strategy, choice: JsonValue) -> ReportPart | None:
    """A non-neutral choice under "Also", as itself (a string) or its JSON; a neutral one
    not at all."""
    if strategy.is_neutral(choice):
        return None
    return ReportPart(words=choice if isinstance(choice, str) else json.dumps(choice))


def changes_step(strategy: Strategy, choice: JsonValue) -> bool:
    """Whether ``choice`` changes the step the device runs (see :class:`Described`)."""
    if isinstance(strategy, Described):
        return strategy.changes_step(choice)
    return not strategy.is_neutral(choice)


def installs(strategy: Strategy) -> str:
    """What ``apply_plan`` installs for ``strategy``, in a word; '' where it does not say."""
    return strategy.installs if isinstance(strategy, Described) else ""


# What a strategy class may define only through its protocol: defining the method without
# subclassing the protocol would leave it never called, so load_strategies refuses it.
_PROTOCOL_OF: dict[str, type] = {
    "check": Checked,
    "screen": Checked,
    "screens_fake_tensors": Checked,
    "refine": Measured,
    "plan_scope": Scoped,
    "record": Recorded,
    "by_hand": HandTried,
    "describe": Described,
    "changes_step": Described,
    "installs": Described,
    "wrap_rank": WrapsRanks,
    "guarded": TimedEachChoice,
    "measured_only": Measured,
    "measured_alternatives": TimedAlternatives,
    "check_setting": Configured,
}


def _protocol_gaps(cls: type) -> list[str]:
    """'method (Protocol)' for each method ``cls`` defines outside the protocol that calls it."""
    return [
        f"{attr} ({proto.__name__})"
        for attr, proto in _PROTOCOL_OF.items()
        if hasattr(cls, attr) and not issubclass(cls, proto)
    ]


def registered_names() -> list[str]:
    """The names the ``memadvisor.strategies`` entry points register, without loading them."""
    return [ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)]


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
        gaps = _protocol_gaps(cls)
        if gaps:
            raise BadInputError(
                f"Strategy {cls.__name__} (entry point {ep.name!r}) defines {', '.join(gaps)} "
                "without subclassing that protocol of memadvisor.strategy, so the planner "
                "would never call it: add the protocol to the class's bases."
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


def _chosen(
    candidate: Candidate, strategies: Sequence[Strategy] | None
) -> list[tuple[Strategy, JsonValue]]:
    """(strategy, choice) for each strategy the candidate turns on, in effect order.

    Raises:
        BadInputError: the candidate names a strategy that is not registered or given.
    """
    names = list(candidate.choices)
    if strategies is None:
        strategies = load_strategies(names)
    by_name = {s.name: s for s in strategies}
    unknown = [n for n in names if n not in by_name]
    if unknown:
        raise BadInputError(
            f"The candidate uses strategies {unknown} that are not among {sorted(by_name)}. "
            "Install the package that provides them, or pass them in `strategies`."
        )
    chosen = [(by_name[n], c) for n, c in candidate.choices.items() if not by_name[n].is_neutral(c)]
    return sorted(chosen, key=lambda sc: sc[0].effect_order)


def wrap_ranks(
    step: Step, candidate: Candidate, strategies: Sequence[Strategy] | None, device_id: int | None
) -> Step:
    """``step`` wrapped by every chosen strategy that wraps ranks (:class:`WrapsRanks`).

    Raises:
        BadInputError: no chosen strategy wraps ranks.
    """
    facts = facts_of(candidate, strategies)
    wrappers = [(s, c) for s, c in _chosen(candidate, strategies) if isinstance(s, WrapsRanks)]
    if not wrappers:
        raise BadInputError(
            "A run on several ranks needs a choice that wraps the model for each rank (a "
            f"strategy implementing memadvisor.strategy.WrapsRanks), but got choices "
            f"{sorted(candidate.choices)}."
        )
    for strategy, choice in wrappers:
        step = strategy.wrap_rank(step, choice, facts, device_id)
    return step


def facts_of(candidate: Candidate, strategies: Sequence[Strategy] | None = None) -> Facts:
    """The facts of every choice ``candidate`` makes, merged in effect order.

    Raises:
        BadInputError: the candidate names a strategy that is not registered or given.
    """
    facts = Facts()
    for strategy, choice in _chosen(candidate, strategies):
        facts = facts.merged(strategy.facts(choice))
    return facts


def chosen_strategies(
    candidate: Candidate, strategies: Sequence[Strategy] | None = None
) -> list[tuple[Strategy, JsonValue]]:
    """The strategies ``candidate`` turns on, with their choices, in effect order."""
    return _chosen(candidate, strategies)


def apply_candidate(
    step: Step,
    candidate: Candidate,
    strategies: Sequence[Strategy] | None = None,
) -> Step:
    """Rewrite ``step`` to ``candidate``'s choices and return the rewritten step.

    What the devices' probes, the ranks, a strategy's trial, ``optimize()`` and
    ``apply_plan`` all use, so they run the same step. Module strategies rewrite
    ``step.model`` in place; a strategy may also replace the step's forward and loss. Batch
    size and accumulation are not the step's to carry: they are the training loop's.
    Neutral choices are skipped.

    Args:
        step: the user's step (:func:`memadvisor.step.base_step`), or a copy's a device trains.
        candidate: the batch size and each strategy's choice.
        strategies: the strategies to apply with; None loads those the candidate names.

    Raises:
        BadInputError: a strategy is unknown, or a choice does not fit this step's model.
    """
    if not isinstance(step, Step):
        raise BadInputError(
            f"apply_candidate takes a memadvisor.step.Step, but got {type(step).__name__}: "
            "build one with memadvisor.step.base_step(workload, model)."
        )
    if not isinstance(step.model, nn.Module):
        raise BadInputError(
            f"model must be a torch.nn.Module, but got {type(step.model).__name__}."
        )
    chosen = _chosen(candidate, strategies)
    # All or nothing: every choice is checked before any is applied, and what was applied
    # is taken back when a strategy still fails while applying.
    for strategy, choice in chosen:
        strategy.validate(step, choice)
    before = _Rewrite(step.model)
    try:
        for strategy, choice in chosen:
            rewritten = strategy.apply(step, choice)
            if not isinstance(rewritten, Step):
                raise BadInputError(
                    f"Strategy {strategy.name!r} returned {type(rewritten).__name__} from "
                    "apply(); it must return the Step (fix the strategy's apply())."
                )
            if rewritten.model is not step.model:
                _check_same_keys(step.model, rewritten.model, strategy.name)
            step = rewritten
    except BaseException:
        before.restore()
        raise
    return step


def apply_to_model(
    model: nn.Module,
    candidate: Candidate,
    strategies: Sequence[Strategy] | None = None,
    profile: Profile | None = None,
) -> Step:
    """:func:`apply_candidate` on the step of ``model`` called by the plain rules (a tensor,
    a tuple's first item, a mapping's keywords; the output's own loss): for callers that have
    no workload. Returns the rewritten step; its ``model`` is ``model``, rewritten in place
    unless a strategy replaced it."""
    return apply_candidate(step_from_call_form(model, None, profile), candidate, strategies)


class _Rewrite:
    """What strategies change on a model: each module's instance ``forward`` (the wrappers)
    and its train/eval flag, saved to be put back when applying fails half way."""

    _NONE = object()

    def __init__(self, model: nn.Module) -> None:
        self.saved = [
            (m, m.__dict__.get("forward", self._NONE), m.training) for m in model.modules()
        ]

    def restore(self) -> None:
        for module, forward, training in self.saved:
            if forward is self._NONE:
                module.__dict__.pop("forward", None)
            else:
                object.__setattr__(module, "forward", forward)
            module.training = training


def _check_same_keys(before: nn.Module, after: nn.Module, strategy: str) -> None:
    if list(before.state_dict()) != list(after.state_dict()):
        raise BadInputError(
            f"Strategy {strategy!r} returned a model whose state_dict keys differ from the "
            "original's; a strategy must keep them (fix the strategy's apply())."
        )
