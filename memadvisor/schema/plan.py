"""The planner's answer: what to run, why, and what was measured to back it."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Advice, Check
from memadvisor.schema.candidate import Candidate, Estimate, Measurement
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.device import DeviceCapabilities, capabilities_of_kind
from memadvisor.schema.loader import LoaderAdvice
from memadvisor.schema.profile import Profile, StepTimeModel

__all__ = ["Plan", "PlanViews", "Probe", "Row", "StageOutcome", "StageVariant", "lend_views"]

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "SCHEMA_VERSION",
    "EstimateBasis",
    "ModelFingerprint",
    "Plan",
    "PlanViews",
    "Probe",
    "Row",
    "StageOutcome",
    "StageVariant",
    "StepFit",
    "lend_views",
]

# The Plan layout this version reads and writes; a file of another version is refused, not
# guessed at. 2: model_fingerprint. 3: stages (a measured-only strategy's outcome, in place of
# compile) and config.options (in place of config.compile).
SCHEMA_VERSION = 3


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Probe(_Model):
    """One run of a candidate on the device from a clean state."""

    batch_size: int
    fits: bool
    steps: int = Field(description="Steps it ran (all of them when it fits).")
    peak_bytes: int | None = Field(None, description="Measured peak; None when it ran out.")
    step_ms: float | None = Field(
        None,
        description="Its timed steps' mean step time (the measurement's); None when it ran "
        "out. Kept so a plan's record says what each run measured, not only whether it fit.",
    )
    reserved_peak_bytes: int | None = Field(
        None,
        description="The allocator's reserved peak where the device reports one (a card), "
        "when it fit. Kept so a plan's record shows how far the reserved bytes ran ahead of "
        "the allocated ones near the edge (a batch that fits only by the allocator's retries "
        "counts as running out: docs/design.md, session 22).",
    )
    host_ms: float | None = Field(
        None,
        description="The host's time to hand a step to the device, where the device times "
        "it, when it fit: over step_ms, whether the card waited on the host (the CUDA graphs "
        "search's signal, strategies/_compile_graphs.py).",
    )
    error: str | None = Field(None, description="The out-of-memory message, when it ran out.")
    wall_ms: float = 0.0
    stage: str = Field(
        "probe",
        description="probe: searching the batch; timing: re-ranking the best candidates; "
        "verify: the pick's sustained run; compare: a comparison row's own batch search; "
        "a measured-only strategy's name: its variants' batch search ('compile').",
    )
    candidate: Candidate | None = Field(None, description="What ran (batch and choices).")


class Row(_Model):
    """One line of the comparison a person would build by hand (Baseline, +AMP, ...)."""

    label: str
    candidate: Candidate
    estimate: Estimate
    largest_batch: int | None = Field(None, description="Largest batch that fits, this config.")
    measured: Measurement | None = Field(None, description="None when only estimated.")


class StepFit(_Model):
    """A configuration's step as lines in the batch, learned from its device runs: what a
    measured stage (torch.compile) predicts a configuration's largest batch and throughput
    with, where the eager estimate cannot (``strategies/_compile_model.py``).

    ``peak(b) = fixed_bytes + per_sample_bytes * b`` (the bytes the batch search reads: the
    allocated peak with the measured margin, else the reserved one) and
    ``step(b) = fixed_ms + per_sample_ms * b``.

    Known limitations:
        * A line: a step whose peak moves from one phase to another between the runs'
          batches (the optimizer's at small batches, backward's at large) bends, and a line
          through runs on both sides of the bend is off at either end.
    """

    fixed_bytes: int = Field(description="Bytes held whatever the batch (weights, states).")
    per_sample_bytes: int = Field(description="Bytes one more sample adds to the peak.")
    fixed_ms: float = Field(description="Step time whatever the batch (launches, optimizer).")
    per_sample_ms: float = Field(description="Step time one more sample adds.")
    batches: list[int] = Field(description="The batches of the runs that fitted, ascending.")
    basis: Literal["fitted", "scaled"] = Field(
        description="How the bytes line was learned. fitted: through two or more runs; "
        "scaled: from one run (or runs whose line did not rise), the eager estimate's "
        "per-sample bytes scaled by the ratio measured there."
    )
    bytes_ratio: float | None = Field(
        None,
        description="scaled: the run's batch-dependent bytes over the eager estimate's at its "
        "batch (0.7: the compiled step keeps 70% of what eager keeps per sample).",
    )
    time_ratio: float | None = Field(
        None,
        description="Where the time line comes from one run (one run, or runs whose times did "
        "not rise with the batch; the line goes from zero through it, its rate held at every "
        "batch): the run's step time over the eager estimate's at its batch.",
    )
    lowest_failure: int | None = Field(
        None, description="The lowest batch of these choices that ran out of memory, if any."
    )
    limit_bytes: int = Field(
        description="The most a pick's peak may be: the budget less the measured headroom."
    )
    cap_batch: int | None = Field(
        None,
        description="The largest batch at which the bytes line plus the step's largest "
        "allocation (the eager estimate's reserved peak less its peak: a block the allocator "
        "must find free at the cap) stays within the budget, where that bounds largest_batch "
        "below the line's own; None where it does not bind or no estimate of it exists.",
    )
    reserved_batch: int | None = Field(
        None,
        description="The largest batch at which a line through the runs' reserved peaks (the "
        "allocator's segments, used or not) stays within limit_bytes, where that bounds "
        "largest_batch below the other bounds; None where it does not bind or no run "
        "recorded its reserved peak.",
    )
    largest_batch: int = Field(
        description="The largest batch the line keeps within limit_bytes (below lowest_failure)."
    )
    samples_per_s: float = Field(description="The time line's throughput at largest_batch.")


class StageVariant(_Model):
    """One variant a measured stage tried: whether its trial ran, and what the device measured."""

    choices: dict[str, JsonValue] = Field(description="Its choices, the stage's own included.")
    ok: bool = Field(description="Its trial here ran well (torch.compile: it compiled).")
    trial: str = Field(description="The trial's sentence: its one-off cost, or why it failed.")
    one_off_ms: float | None = Field(
        None, description="What the trial paid once (a compile: first step less a steady one)."
    )
    batch_size: int | None = Field(
        None,
        description="The batch the device confirmed; for a variant measured but not confirmed, "
        "the largest batch of its runs that fitted. None when it never ran.",
    )
    measured: Measurement | None = Field(None, description="Its steady steps at that batch.")
    confirmed: bool = Field(
        False, description="True when batch_size is the device's batch search's answer."
    )
    fit: StepFit | None = Field(
        None, description="Its memory and time lines, learned from its runs (when it ran)."
    )
    device_wall_ms: float = Field(0.0, description="Its device runs' wall time.")
    error: str | None = Field(None, description="Why its device runs failed, when they did.")


class StageOutcome(_Model):
    """What a measured-only strategy's stage found for the eager pick (``Strategy.refine``).

    The report shows one answer row per outcome: ``label``, then ``pick_words`` with the
    measured gain and ``costs`` when the stage's variant was picked, else ``answer``.
    """

    strategy: str = Field(description="The measured-only strategy whose stage this was.")
    label: str = Field(description="The report's row label: 'Compile'.")
    runs_label: str = Field(
        description="How the report counts this stage's device runs: 'compiling (compiled "
        "variants)'."
    )
    picked: bool = Field(description="True when the plan's pick is the stage's variant.")
    summary: str = Field(description="The verdict in a sentence (also among the plan's notes).")
    pick_words: str = Field("", description="The picked variant in a few words.")
    answer: str = Field("", description="The report's row when the eager pick was kept: why.")
    costs: list[str] = Field(
        default_factory=list, description="What the picked variant costs once, in phrases."
    )
    eager_batch_size: int = Field(description="The eager pick's batch the variants started from.")
    eager_candidate: Candidate | None = Field(None, description="The eager pick itself.")
    eager_samples_per_s: float = Field(description="The eager pick's measured throughput.")
    eager_measured: Measurement | None = Field(
        None, description="The eager pick's measured steps (its peak too), before verification."
    )
    variants: list[StageVariant] = Field(default_factory=list)
    one_off_ms: float | None = Field(
        None, description="The pick's one-off cost (once per process); None when eager."
    )
    details: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="What else the strategy measured, by name (compile: its shared cache).",
    )
    wall_ms: float = Field(0.0, description="Planner wall time spent in the stage.")


class EstimateBasis(_Model):
    """What a plan made without a card (``device="estimate"``) rests on, besides the profile."""

    time_model: StepTimeModel = Field(
        description="The rates its step times assume, applied to the profile's FLOPs."
    )
    cannot_know: list[str] = Field(
        default_factory=list, description="What only a card can say, in sentences."
    )


class ModelFingerprint(_Model):
    """What identifies the model a plan was made for: its class and every parameter's name
    and shape. Not its values: a plan fits the same model at any point of its training."""

    class_name: str = Field(description="The model's class (__qualname__).")
    parameters: list[tuple[str, list[int]]] = Field(
        description="(name, shape) of every parameter, in named_parameters() order."
    )

    @classmethod
    def of(cls, model: nn.Module) -> ModelFingerprint:
        return cls(
            class_name=type(model).__qualname__,
            parameters=[(n, list(p.shape)) for n, p in model.named_parameters()],
        )

    def difference(self, model: nn.Module) -> str | None:
        """What differs between ``model`` and the model this fingerprint was taken of, in a
        sentence; None when nothing does."""
        other = ModelFingerprint.of(model)
        if other.class_name != self.class_name:
            return f"it was made for {self.class_name}, but the model is {other.class_name}"
        mine, theirs = dict(self.parameters), dict(other.parameters)
        missing = [n for n in mine if n not in theirs]
        extra = [n for n in theirs if n not in mine]
        if missing or extra:
            return (
                f"the model's parameters differ: missing {missing[:5]}, not in the plan {extra[:5]}"
            )
        for name, shape in mine.items():
            if theirs[name] != shape:
                return f"parameter {name} has shape {theirs[name]}; the plan's model had {shape}"
        return None


def _non_finite(value: Any, path: str) -> str | None:
    """The path of the first NaN or infinity in ``value``, a model or container of them."""
    if isinstance(value, float):
        return None if math.isfinite(value) else path
    if isinstance(value, BaseModel):
        items: Any = ((k, getattr(value, k)) for k in type(value).model_fields)
    elif isinstance(value, dict):
        items = value.items()
    elif isinstance(value, (list, tuple)):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _non_finite(item, f"{path}.{key}" if path else str(key))
        if found is not None:
            return found
    return None


class Plan(_Model):
    """The chosen configuration; ``apply_plan(model, plan)`` rewrites a model to it.

    A plan loads only when it is one this version can trust: its own schema version, every
    float finite (JSON has no infinity; Python's json writes NaN and Infinity, which pydantic
    would read), and the pick's batch within ``config.max_batch``.
    """

    schema_version: int = SCHEMA_VERSION
    model_name: str
    model_fingerprint: ModelFingerprint | None = Field(
        None,
        description="The model the plan was made for; apply_plan refuses another. None in "
        "hand-built plans (nothing to check against).",
    )
    config: PlanConfig
    device_kind: str = Field(
        description="What the device the pick was confirmed on is called (capabilities.kind; "
        "'estimate': nowhere, every figure estimated). For display: read capabilities."
    )
    device_name: str
    capabilities: DeviceCapabilities = Field(
        None,  # type: ignore[assignment]  # made from device_kind where a file has none
        description="What that device can do: whether its times rank, how it measures "
        "memory, what it trains on. A plan written without them gets its kind's.",
    )
    candidate: Candidate = Field(description="The pick.")
    estimate: Estimate = Field(description="The estimate of the pick.")
    verified: Measurement | None = Field(None, description="The pick's sustained run.")
    probes: list[Probe] = Field(default_factory=list)
    comparison: list[Row] = Field(default_factory=list)
    advice: list[Advice] = Field(default_factory=list)
    checks: list[Check] = Field(
        default_factory=list,
        description="What the chosen strategies measured on the workload (precision numerics).",
    )
    notes: list[str] = Field(
        default_factory=list,
        description="What a person should know: step-downs, fallbacks, what was only estimated.",
    )
    plan_wall_ms: float = 0.0
    stage_wall_ms: dict[str, float] = Field(
        default_factory=dict,
        description="Wall time of each planner stage (profiling, search, probes, compile, "
        "verify, checks, ...), in the order they ran; plan_wall_ms less their sum is glue.",
    )
    stages: list[StageOutcome] = Field(
        default_factory=list,
        description="What each measured-only strategy's stage found for the eager pick.",
    )
    profile: Profile | None = Field(None, description="The profile the plan was made from.")
    basis: EstimateBasis | None = Field(
        None, description="device='estimate': the step-time model and what it cannot know."
    )
    data_loading: LoaderAdvice | None = Field(
        None, description="The user's DataLoader timed against the planned step, when given."
    )
    # The workload it was planned on (memadvisor.plan() sets it): to_html records the plan's
    # step on a copy of its model. Not saved: a plan read back from JSON has none.
    _workload: Any = PrivateAttr(default=None)

    # The report from Python: the same output the CLI prints and writes. The report sits
    # above this vocabulary, so it lends its views (PlanViews) when it is imported, and the
    # package face imports it: this module never imports the report.

    def report(self, console: Console | None = None) -> None:
        """Print the terminal report ``memadvisor plan`` prints (to stdout by default)."""
        _views().print(self, console)

    @classmethod
    def load(cls, path: str | Path) -> Plan:
        """Read a plan written by :meth:`to_json` or ``memadvisor plan --json``.

        Example::

            plan = memadvisor.Plan.load("plan.json")
            model = memadvisor.apply_plan(model, plan)  # or apply_plan(model, "plan.json")

        Raises:
            BadInputError: the file cannot be read, or is not a plan this version reads
                (another schema version, a non-finite number, not a plan at all).
        """
        path = Path(path)
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise BadInputError(
                f"Cannot read a plan from {str(path)!r}: {e.strerror}. Pass the file "
                "`memadvisor plan ... --json plan.json` (or plan.to_json) wrote."
            ) from e
        try:
            # Strict: "3" is not schema_version 3 and true is not batch 1. A file cannot raise
            # its own bounds: its batch stays within the default max_batch as well as its own.
            plan = cls.model_validate_json(text, strict=True)
            ceiling = min(plan.config.max_batch, PlanConfig.model_fields["max_batch"].default)
            for field in ("batch_size", "accumulation_steps"):
                value = getattr(plan.candidate, field)
                if value > ceiling:
                    raise BadInputError(
                        f"{str(path)!r} is not a plan this memadvisor reads: candidate.{field} "
                        f"is {value}, above {ceiling}, the largest batch memadvisor plans by "
                        "default (a plan file cannot raise its own limit, which an edit could). "
                        "If you planned past it on purpose (max_batch), read the file with "
                        "Plan.model_validate_json(text) instead."
                    )
            return plan
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(x) for x in first["loc"]) or "the file"
            raise BadInputError(
                f"{str(path)!r} is not a plan this memadvisor reads: {where}: {first['msg']} "
                f"({e.error_count()} problem(s)). Make the plan again with `memadvisor plan "
                "... --json`."
            ) from e

    def to_json(self, path: str | Path) -> Path:
        """Write the plan as ``memadvisor plan --json`` does; :meth:`Plan.load` reads it
        back and ``memadvisor.apply_plan`` applies it.

        Raises:
            BadInputError: the file cannot be written.
        """
        return _views().write_json(self, path)

    def to_html(self, path: str | Path, *, record_step: bool = True) -> Path:
        """Write the self-contained HTML report ``memadvisor plan --html`` writes.

        Args:
            path: the file to write.
            record_step: record one step of the plan for the memory chart, on a copy of the
                model it was planned on (yours is not touched), as the CLI does. A plan read
                back from JSON has no model: its chart shows the profile's per-phase peaks.

        Raises:
            BadInputError: the file cannot be written.
        """
        # An estimate plan's model may be fake or on the meta device: nothing to record.
        recordable = record_step and self.capabilities.measures_memory
        workload = self._workload if recordable else None
        return _views().write_html(self, path, workload)

    @field_validator("schema_version")
    @classmethod
    def _this_schema(cls, value: int) -> int:
        if value != SCHEMA_VERSION:
            raise ValueError(
                f"this memadvisor reads plans of schema_version {SCHEMA_VERSION}, but the file "
                f"has schema_version {value}; make the plan again with this version"
            )
        return value

    @model_validator(mode="after")
    def _finite_and_in_range(self) -> Plan:
        if self.capabilities is None:  # a plan written before capabilities
            self.capabilities = capabilities_of_kind(self.device_kind)
        if self.capabilities.kind != self.device_kind:
            raise ValueError(
                f"device_kind is {self.device_kind!r} but capabilities.kind is "
                f"{self.capabilities.kind!r}; one device says both"
            )
        where = _non_finite(self, "")
        if where is not None:
            raise ValueError(f"{where} is not a finite number; a plan holds only finite ones")
        limit = self.config.max_batch
        for field in ("batch_size", "accumulation_steps"):
            value = getattr(self.candidate, field)
            if value > limit:
                raise ValueError(
                    f"candidate.{field} is {value}, above config.max_batch={limit}; this is not "
                    "a plan memadvisor made"
                )
        return self


class PlanViews(Protocol):
    """What :class:`Plan`'s report methods ask of the report (``memadvisor.report`` lends
    one through :func:`lend_views` when it is imported)."""

    def print(self, plan: Plan, console: Console | None) -> None: ...

    def write_json(self, plan: Plan, path: str | Path) -> Path: ...

    def write_html(self, plan: Plan, path: str | Path, workload: Any) -> Path: ...


_VIEWS: list[PlanViews] = []


def lend_views(views: PlanViews) -> None:
    """Give :class:`Plan` its report (called once, by ``memadvisor.report``)."""
    _VIEWS[:] = [views]


def _views() -> PlanViews:
    if not _VIEWS:
        raise RuntimeError(
            "Plan.report()/to_json()/to_html() need memadvisor's report: `import memadvisor` "
            "(or memadvisor.report) first."
        )
    return _VIEWS[0]
