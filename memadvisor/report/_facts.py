"""What the report says, computed once from a Plan or a Profile.

The terminal and the HTML renderers only lay these facts out; neither does arithmetic of
its own, so the two can never disagree. The facts are pydantic models because the HTML
embeds them as JSON for its charts. What a strategy's choice means (its answer row, the
profiled step it runs, the blocks it recomputes) each strategy says itself
(``report._parts``): the report names none.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from memadvisor.errors import BadInputError
from memadvisor.report._mfu import LanguageModelRate, language_model_rate
from memadvisor.report._parts import changes, others, parts, plan_strategies
from memadvisor.schema.advice import ReportPart
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.plan import Plan, Row, StageOutcome
from memadvisor.schema.precision import FULL
from memadvisor.schema.profile import Profile, StepProfile
from memadvisor.strategy import Strategy, chosen_strategies

__all__ = [
    "Answer",
    "ComparisonLine",
    "Consumer",
    "KindLine",
    "LossRewrite",
    "MemorySeries",
    "PhaseLine",
    "PredictedPhases",
    "answer",
    "comparison",
    "consumers",
    "is_loss",
    "device_runs",
    "kinds_at_plan_peak",
    "kinds_of_profile",
    "phases",
    "predicted_phases",
    "series_from_events",
    "series_from_phases",
    "series_from_timeline",
]


# Ops that compute a softmax-based loss: what they save grows with batch x classes (x tokens).
LOSS_OPS = frozenset(
    {"_log_softmax", "log_softmax", "_softmax", "softmax", "nll_loss", "nll_loss_forward",
     "nll_loss2d_forward", "cross_entropy_loss", "binary_cross_entropy_with_logits"}
)  # fmt: skip


def is_loss(name: str, made_by: Iterable[str]) -> bool:
    """Whether an owner outside the blocks is the loss: the user's loss_fn (``<loss>``), or
    what a softmax-based loss op made (a model computing its own loss: ``<other>``)."""
    return name == "<loss>" or bool(LOSS_OPS.intersection(made_by))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LossRewrite(_Model):
    """How the pick computes the loss, where its strategies' facts say it computes it another
    way than the user's loss (``Facts.loss_changed``: the chunked loss head), in their words.

    The loss's saved bytes are then shown as not kept: the loss that made them is not run.
    """

    words: str = Field(description="The strategies' own words for it ('chunked cross-entropy…').")
    brief: str = Field(description="A few words for the owners table ('loss in 8 chunks').")


class Answer(_Model):
    """The plan in one screen: what to run and what it buys."""

    model_name: str
    device_kind: str
    device_name: str
    budget_bytes: int
    usable_bytes: int = Field(description="The budget less the safety margin.")
    margin_fraction: float
    measured_margin: bool = Field(
        False, description="The pick was sized from its runs (a measured peak within headroom)."
    )
    headroom_fraction: float = Field(0.0, description="What the measured margin leaves free.")
    objective: str
    precision: str = Field(
        description="The profiled step the pick runs (a key of Profile.steps), as its "
        "strategies say; fp32 when none changes it."
    )
    checkpointed: list[str] = Field(
        description="Names of the blocks the pick recomputes in backward, as its strategies say."
    )
    loss_rewrite: LossRewrite | None = Field(
        None,
        description="How the pick computes the loss, where it does not run the user's; None: "
        "it runs the user's loss, whose saved bytes it keeps as profiled.",
    )
    choice_rows: list[tuple[str, str]] = Field(
        default_factory=list,
        description="(label, words) of each strategy that gives the pick's choice a row of its "
        "own, in effect order, in the strategy's words.",
    )
    briefs: list[str] = Field(
        default_factory=list, description="The strategies' phrases in the one-line answer."
    )
    block_count: int | None = Field(None, description="Blocks the profile found; None unknown.")
    batch_size: int
    accumulation_steps: int
    estimated_peak_bytes: int
    estimated_peak_phase: str
    verified_peak_bytes: int | None = None
    verified_reserved_peak_bytes: int | None = None
    verified_steps: int | None = None
    step_ms: float
    samples_per_s: float
    measured: bool = Field(description="True when step time and rate come from the device.")
    times_rank: bool = Field(
        True, description="The device's times rank configurations (a card); else the estimate's."
    )
    lm: LanguageModelRate | None = Field(
        None, description="A language model's tokens/s and MFU; None for other inputs."
    )
    baseline_samples_per_s: float | None = None
    baseline_batch_size: int | None = None
    baseline_measured: bool = False
    speedup: float | None = Field(
        None,
        description="Plan samples/s over the baseline's, both sides from one method: both "
        "measured when the baseline ran on the device, else both estimated.",
    )
    speedup_basis: Literal["measured", "estimated"] | None = Field(
        None, description="How both sides of ``speedup`` were found; None without a ratio."
    )
    same_as_baseline: bool = Field(
        False, description="The pick runs what the baseline runs: same precision, blocks, batch."
    )
    other_choices: dict[str, str] = Field(
        default_factory=dict, description="Non-neutral choices of other strategies, as JSON."
    )
    stages: list[StageOutcome] = Field(
        default_factory=list,
        description="What each measured-only strategy's stage found; a row of its own each.",
    )
    notes: list[str] = Field(default_factory=list)

    @property
    def effective_batch(self) -> int:
        return self.batch_size * self.accumulation_steps


class ComparisonLine(_Model):
    """One row of Baseline / +Checkpointing / +AMP / +Both / Plan."""

    label: str
    batch_size: int
    accumulation_steps: int
    peak_bytes: int = Field(description="Measured peak where a device ran it, else estimated.")
    estimated_peak_bytes: int
    step_ms: float
    samples_per_s: float
    largest_batch: int | None
    measured: bool
    time_measured: bool = Field(
        False,
        description="Step and samples/s come from the device: measured on a device whose "
        "times rank (a card); else the estimate's, which ranks (the simulated CPU device).",
    )
    over_budget: bool
    is_plan: bool


class PredictedPhases(_Model):
    """One configuration's estimated peak in each phase of its step, at its batch."""

    label: str
    batch_size: int
    accumulation_steps: int
    largest_batch: int | None
    forward_bytes: int
    backward_bytes: int
    optimizer_bytes: int
    peak_phase: str
    is_plan: bool


class KindLine(_Model):
    """Bytes of one kind (params, grads, optimizer state, activations, ...)."""

    kind: str
    nbytes: int
    share: float = Field(description="Fraction of the total shown next to it.")


class Consumer(_Model):
    """A module (block or not) and the activation bytes it keeps for backward."""

    name: str
    type_name: str
    owner: Literal["block", "outside"]
    activation_bytes: int
    share: float = Field(description="Fraction of all saved activations.")
    checkpointed: bool = False
    kept_bytes: int = Field(description="What it keeps under the plan: its input if checkpointed.")
    loss_rewrite: LossRewrite | None = Field(
        None,
        description="For the loss's own bytes (its log-softmax), where the pick computes the "
        "loss another way: how; kept_bytes is then 0.",
    )
    forward_ms: float = Field(
        0.0,
        description="Its forward time, what a recompute costs: for a block, the median over "
        "the blocks identical to it (same type and bytes), whose timings are repeats of one "
        "computation; one reading alone can be off by 30x on a busy machine.",
    )
    forward_ms_low: float = Field(0.0, description="The fastest of those identical blocks.")
    forward_ms_high: float = Field(0.0, description="The slowest of those identical blocks.")
    repeats: int = Field(1, description="How many identical blocks the median is over.")
    made_by: list[str] = Field(
        default_factory=list, description="For what no module made: the ops that made it."
    )
    after: str | None = Field(
        None, description="For what no module made: the submodule whose output it comes from."
    )


class PhaseLine(_Model):
    """The highest bytes held in one phase of the step."""

    phase: str
    allocated_bytes: int
    reserved_bytes: int | None = None


class MemorySeries(_Model):
    """Memory over the step, for the HTML chart."""

    source: Literal["timeline", "phase peaks"]
    caption: str
    time_unit: Literal["ms", "step"] = Field(
        "ms", description="'step' when the profile holds no times: the x axis is only order."
    )
    points: list[tuple[float, int, int | None]] = Field(
        description="(time, allocated bytes, reserved bytes or None), in time order."
    )
    spans: list[tuple[str, float, float]] = Field(description="(phase, start, end).")


# -- the plan ---------------------------------------------------------------------------------


def _baseline(rows: Sequence[Row]) -> Row | None:
    for row in rows:
        if row.label.strip().lower().startswith("baseline"):
            return row
    return rows[0] if rows else None


def _rate(row: Row, ranks: bool = True) -> tuple[float, bool]:
    """A row's samples/s and whether measured: the device's where its times rank."""
    if row.measured is not None and ranks:
        return row.measured.samples_per_s, True
    return row.estimate.samples_per_s, False


def _runs(cand: Candidate, strategies: Sequence[Strategy]) -> tuple:
    """What a candidate runs: its batch and every choice that changes the step (each
    strategy says which of its choices do: a record of the batch or advice does not)."""
    return cand.batch_size, cand.accumulation_steps, changes(cand, strategies)


def _headroom_fraction() -> float:
    from memadvisor.planner._prober import HEADROOM_FRACTION

    return HEADROOM_FRACTION


def _speedup(
    plan: Plan, base: Row | None, measured_rate: float | None
) -> tuple[float | None, Literal["measured", "estimated"] | None]:
    """The plan's rate over the baseline's, never one measured side over one estimated.

    A measured run and the estimate differ by more than the gap between configurations (on
    the simulated device a tracked step runs several times slower than the estimate's), so
    a ratio across methods reads as 0.02x or 18x for the same plan. With a measured baseline
    both sides are measured; otherwise both are the estimate's.
    """
    if base is None:
        return None, None
    if base.measured is not None and measured_rate is not None and times_rank(plan):
        if base.measured.samples_per_s <= 0:
            return None, None
        return measured_rate / base.measured.samples_per_s, "measured"
    if base.estimate.samples_per_s <= 0:
        return None, None
    return plan.estimate.samples_per_s / base.estimate.samples_per_s, "estimated"


def answer(plan: Plan) -> Answer:
    """The answer a person reads first."""
    cand, est, ver = plan.candidate, plan.estimate, plan.verified
    profile = plan.profile
    # Where the device's times rank nothing the estimate's rate is the answer's, and no
    # ratio of two measured rates is shown: it would be noise (CPU times, slowed by tracking).
    ranks = times_rank(plan)
    timed = ver if ranks else None
    measured = timed is not None
    rate = timed.samples_per_s if timed is not None else est.samples_per_s
    base = _baseline(plan.comparison)
    base_rate, base_measured = _rate(base, ranks) if base is not None else (None, False)
    speedup, basis = _speedup(plan, base, rate if measured else None)
    strategies = plan_strategies(plan)
    found = parts(plan, strategies)
    steps = [p.step_precision for p in found.values() if p.step_precision is not None]
    return Answer(
        model_name=plan.model_name,
        device_kind=plan.device_kind,
        device_name=plan.device_name,
        budget_bytes=plan.config.budget_bytes,
        usable_bytes=plan.config.usable_bytes,
        margin_fraction=plan.config.margin_fraction,
        measured_margin=plan.config.measured_margin,
        headroom_fraction=_headroom_fraction(),
        objective=plan.config.objective,
        precision=steps[-1] if steps else FULL,
        checkpointed=[b for p in found.values() for b in p.recomputed_blocks],
        loss_rewrite=_loss_rewrite(plan, strategies, found),
        choice_rows=[(p.label, p.words) for p in found.values() if p.label],
        briefs=[p.brief for p in found.values() if p.brief],
        block_count=len(profile.blocks) if profile is not None else None,
        batch_size=cand.batch_size,
        accumulation_steps=cand.accumulation_steps,
        estimated_peak_bytes=est.peak_bytes,
        estimated_peak_phase=est.peak_phase,
        verified_peak_bytes=ver.peak_bytes if ver is not None else None,
        verified_reserved_peak_bytes=ver.reserved_peak_bytes if ver is not None else None,
        verified_steps=ver.steps if ver is not None else None,
        step_ms=timed.step_ms if timed is not None else est.step_ms,
        samples_per_s=rate,
        measured=measured,
        times_rank=ranks,
        lm=language_model_rate(plan, rate, steps[-1] if steps else FULL, ranks),
        baseline_samples_per_s=base_rate,
        baseline_batch_size=base.candidate.batch_size if base is not None else None,
        baseline_measured=base_measured,
        speedup=speedup,
        speedup_basis=basis,
        same_as_baseline=base is not None
        and _runs(base.candidate, strategies) == _runs(cand, strategies),
        other_choices=others(plan, strategies, found),
        stages=list(plan.stages),
        notes=list(plan.notes),
    )


def _loss_rewrite(
    plan: Plan, strategies: Sequence[Strategy], found: dict[str, ReportPart]
) -> LossRewrite | None:
    """How the pick computes the loss where a choice's facts say it changes it (read from the
    facts, never the strategy's name); None where every chosen strategy keeps the user's loss.
    A strategy not installed here states no facts, nor does a choice of an older form its
    ``facts`` refuses (checkpointing's block indices, which its description still reads)."""
    installed = {s.name for s in strategies}
    known = plan.candidate.model_copy(
        update={"choices": {n: c for n, c in plan.candidate.choices.items() if n in installed}}
    )
    rewriting = [s for s, c in chosen_strategies(known, strategies) if _changes_loss(s, c)]
    if not rewriting:
        return None
    # Each in its own words (its name where it describes nothing).
    said = [found.get(s.name) or ReportPart(words=s.name) for s in rewriting]
    return LossRewrite(
        words="; ".join(p.words for p in said), brief=", ".join(p.brief or p.words for p in said)
    )


def _changes_loss(strategy: Strategy, choice: JsonValue) -> bool:
    """Whether ``choice`` computes the loss another way, by its facts (False where the
    strategy refuses the choice's form: a report of an older plan still prints)."""
    try:
        return strategy.facts(choice).loss_changed
    except BadInputError:
        return False


def comparison(plan: Plan) -> list[ComparisonLine]:
    """The plan's comparison rows, with the pick itself last if the planner left it out."""
    budget = plan.config.budget_bytes
    ranks = times_rank(plan)
    lines = [
        _line(row, budget, is_plan=row.label.strip().lower() == "plan", ranks=ranks)
        for row in plan.comparison
    ]
    if not any(line.is_plan for line in lines):
        pick = Row(
            label="Plan",
            candidate=plan.candidate,
            estimate=plan.estimate,
            largest_batch=None,
            measured=plan.verified,
        )
        lines.append(_line(pick, budget, is_plan=True, ranks=ranks))
    return lines


def times_rank(plan: Plan) -> bool:
    """Whether the plan's device times rank configurations (its capabilities say): a card's
    do. The simulated CPU device's are CPU times slowed by its tracking, and an estimate
    plan ran nothing: there the estimate ranks, and the report shows its times (marked),
    never a measured ratio."""
    return plan.capabilities.step_times_rank


def _line(row: Row, budget_bytes: int, *, is_plan: bool, ranks: bool = True) -> ComparisonLine:
    m = row.measured
    timed = m if ranks else None
    peak = m.peak_bytes if m is not None else row.estimate.peak_bytes
    # The budget caps what the allocator reserves, not only what tensors hold.
    held = m.limit_bytes if m is not None else peak
    return ComparisonLine(
        label=row.label,
        batch_size=row.candidate.batch_size,
        accumulation_steps=row.candidate.accumulation_steps,
        peak_bytes=peak,
        estimated_peak_bytes=row.estimate.peak_bytes,
        step_ms=timed.step_ms if timed is not None else row.estimate.step_ms,
        samples_per_s=timed.samples_per_s if timed is not None else row.estimate.samples_per_s,
        largest_batch=row.largest_batch,
        measured=m is not None,
        time_measured=timed is not None,
        over_budget=held > budget_bytes,
        is_plan=is_plan,
    )


def predicted_phases(plan: Plan) -> list[PredictedPhases]:
    """Each comparison row's estimated peak per phase (rows whose estimate lacks them are
    left out): what a plan made without a card can show instead of measured peaks."""
    out = []
    for line, row in zip(comparison(plan), _rows_with_pick(plan), strict=True):
        phases = row.estimate.phase_peak_bytes
        if not phases:
            continue
        out.append(
            PredictedPhases(
                label=row.label,
                batch_size=row.candidate.batch_size,
                accumulation_steps=row.candidate.accumulation_steps,
                largest_batch=row.largest_batch,
                forward_bytes=phases["forward"],
                backward_bytes=phases["backward"],
                optimizer_bytes=phases["optimizer"],
                peak_phase=row.estimate.peak_phase,
                is_plan=line.is_plan,
            )
        )
    return out


def _rows_with_pick(plan: Plan) -> list[Row]:
    """The comparison rows, with the pick last when the planner left it out (as
    :func:`comparison` lays them out)."""
    rows = list(plan.comparison)
    if not any(r.label.strip().lower() == "plan" for r in rows):
        rows.append(Row(label="Plan", candidate=plan.candidate, estimate=plan.estimate))
    return rows


_RUN_STAGES = {
    "timing": "timed",
    "verify": "verifying",
    "compare": "for the comparison rows",
}


def device_runs(plan: Plan, *, shown: int = 8) -> str:
    """The device runs behind the plan in a sentence: the batch probes first, by outcome."""
    search = [p for p in plan.probes if p.stage == "probe"]
    parts = []
    if search:
        outcomes = ", ".join(
            f"{p.batch_size} {'fits' if p.fits else 'OOM'}" for p in search[:shown]
        )
        more = f", … {len(search) - shown} more" if len(search) > shown else ""
        parts.append(f"{len(search)} batch probes ({outcomes}{more})")
    measured_stages = {o.strategy: o.runs_label for o in plan.stages}
    for stage, words in {**measured_stages, **_RUN_STAGES}.items():
        count = sum(p.stage == stage for p in plan.probes)
        if count:
            parts.append(f"{count} {words}")
    return f"Runs on {plan.device_name}: " + ", ".join(parts)


def kinds_at_plan_peak(plan: Plan) -> list[KindLine]:
    """What the pick holds at its estimated peak, by kind; shares are of the estimated peak.

    What the breakdown leaves out of the peak (memory outside tensors, measured on CUDA) is
    its own line, so the lines add up to the peak the answer states.
    """
    breakdown = dict(plan.estimate.breakdown)
    peak = plan.estimate.peak_bytes
    rest = peak - sum(breakdown.values())
    if rest > 0:
        breakdown["fixed overhead"] = rest
    order = ("params", "grads", "optimizer_state", "activations", "temporaries")
    kinds = [k for k in order if k in breakdown] + [k for k in breakdown if k not in order]
    return [KindLine(kind=k, nbytes=breakdown[k], share=breakdown[k] / (peak or 1)) for k in kinds]


# -- the profile ------------------------------------------------------------------------------


def _step(profile: Profile, precision: str) -> StepProfile:
    return profile.steps.get(precision) or profile.steps["fp32"]


def kinds_of_profile(profile: Profile, batch_size: int, precision: str = "fp32") -> list[KindLine]:
    """Weights, gradients, optimizer state, buffers and activations at ``batch_size``."""
    step = _step(profile, precision)
    items = [
        ("params", profile.param_bytes),
        ("grads", profile.grad_bytes),
        ("optimizer_state", profile.optimizer_state_bytes),
        ("buffers", profile.buffer_bytes),
        ("activations", step.activation_total.at(batch_size)),
    ]
    items = [(k, n) for k, n in items if n or k != "buffers"]
    if step.cast_weight_bytes:
        items.append(("autocast weight copies", step.cast_weight_bytes))
    if profile.fixed_overhead_bytes:
        items.append(("fixed overhead", profile.fixed_overhead_bytes))
    total = sum(n for _, n in items) or 1
    return [KindLine(kind=k, nbytes=n, share=n / total) for k, n in items]


def consumers(
    profile: Profile,
    batch_size: int,
    precision: str = "fp32",
    checkpointed: Iterable[str] = (),
    loss_rewrite: LossRewrite | None = None,
) -> list[Consumer]:
    """Every activation owner, blocks and not (LM head, loss), largest first.

    What no listed owner accounts for is shown as ``<unattributed>`` when it is more than 1%
    of the total, so the list always adds up to the step's saved activations. With
    ``loss_rewrite`` (the pick does not run the user's loss) the loss's owners keep nothing.

    Known limitations:
        * A rewritten loss is taken to keep none of what the user's loss saved: true of the
          chunked loss head (the estimate drops those bytes and adds one chunk's transient,
          which is no owner's); a strategy that changes the loss and still saves its
          log-softmax would be shown low here (its estimate still counts it).
    """
    step = _step(profile, precision)
    ckpt = set(checkpointed)
    total = step.activation_total.at(batch_size)
    types = {b.name: b.type_name for b in profile.blocks}
    out: list[Consumer] = []
    timings = _identical_block_timings(step, types, batch_size)
    for blk in step.blocks:
        act = blk.activation.at(batch_size)
        is_ckpt = blk.name in ckpt
        median, low, high, repeats = timings[blk.name]
        out.append(
            Consumer(
                name=blk.name,
                type_name=types.get(blk.name, ""),
                owner="block",
                activation_bytes=act,
                share=act / total if total else 0.0,
                checkpointed=is_ckpt,
                kept_bytes=blk.input.at(batch_size) if is_ckpt else act,
                forward_ms=median,
                forward_ms_low=low,
                forward_ms_high=high,
                repeats=repeats,
            )
        )
    for mod in step.outside:
        act = mod.activation.at(batch_size)
        rewritten = loss_rewrite if is_loss(mod.name, mod.made_by) else None
        out.append(
            Consumer(
                name=mod.name,
                type_name=mod.type_name,
                owner="outside",
                activation_bytes=act,
                share=act / total if total else 0.0,
                kept_bytes=0 if rewritten is not None else act,
                loss_rewrite=rewritten,
                forward_ms=mod.forward_ms.at(batch_size),
                made_by=list(mod.made_by),
                after=mod.after,
            )
        )
    rest = total - sum(c.activation_bytes for c in out)
    if total and rest > 0.01 * total:
        out.append(
            Consumer(
                name="<unattributed>",
                type_name="",
                owner="outside",
                activation_bytes=rest,
                share=rest / total,
                kept_bytes=rest,
            )
        )
    return sorted(out, key=lambda c: c.activation_bytes, reverse=True)


def _identical_block_timings(
    step: StepProfile, types: dict[str, str], batch_size: int
) -> dict[str, tuple[float, float, float, int]]:
    """Block name -> (median, fastest, slowest, count) of the forward times of the blocks
    identical to it: same type, same saved and input bytes at ``batch_size``.

    Twelve identical transformer blocks do the same work; their twelve timings are twelve
    repeats of one measurement, and their median is the honest figure for each.
    """
    groups: dict[tuple, list[str]] = {}
    for blk in step.blocks:
        key = (types.get(blk.name, ""), blk.activation.at(batch_size), blk.input.at(batch_size))
        groups.setdefault(key, []).append(blk.name)
    forward = {blk.name: blk.forward_ms.at(batch_size) for blk in step.blocks}
    out: dict[str, tuple[float, float, float, int]] = {}
    for names in groups.values():
        times = sorted(forward[n] for n in names)
        mid = len(times) // 2
        median = times[mid] if len(times) % 2 else (times[mid - 1] + times[mid]) / 2
        for n in names:
            out[n] = (median, times[0], times[-1], len(times))
    return out


def phases(profile: Profile, batch_size: int, precision: str = "fp32") -> list[PhaseLine]:
    """The peak of each phase of the step at ``batch_size``, in step order."""
    return [
        PhaseLine(
            phase=p.phase,
            allocated_bytes=p.allocated.at(batch_size),
            reserved_bytes=p.reserved.at(batch_size) if p.reserved is not None else None,
        )
        for p in _step(profile, precision).phases
    ]


def series_from_phases(profile: Profile, batch_size: int, precision: str = "fp32") -> MemorySeries:
    """A step chart of the per-phase peaks over the phases' measured durations.

    Without a recorded timeline this is all the profile knows: the highest bytes of each
    phase, not the curve within it, and the caption says so.
    """
    step = _step(profile, precision)
    durations = {
        "forward": step.forward_ms.at(batch_size),
        "backward": step.backward_ms.at(batch_size),
        "optimizer": step.optimizer_ms,
    }
    timed = sum(durations.values()) > 0
    if not timed:  # no times in the profile: equal widths, the axis shows only order
        durations = {"forward": 1.0, "backward": 1.0, "optimizer": 0.5}
    # zero_grad takes microseconds; it still gets a sliver so its level shows.
    sliver = 0.03 * sum(durations.values())
    points: list[tuple[float, int, int | None]] = []
    spans: list[tuple[str, float, float]] = []
    t = 0.0
    for line in phases(profile, batch_size, precision):
        width = durations.get(line.phase, 0.0) or sliver
        points.append((t, line.allocated_bytes, line.reserved_bytes))
        points.append((t + width, line.allocated_bytes, line.reserved_bytes))
        spans.append((line.phase, t, t + width))
        t += width
    return MemorySeries(
        source="phase peaks",
        caption=f"Peak of each phase of the profiled step ({precision}, batch {batch_size}); "
        "the curve within a phase needs a recorded timeline.",
        time_unit="ms" if timed else "step",
        points=points,
        spans=spans,
    )


def series_from_events(
    events: Iterable[tuple[float, int, int | None, str | None]], caption: str
) -> MemorySeries:
    """A measured curve from timeline events ``(t_ms, allocated, reserved, phase)``."""
    points: list[tuple[float, int, int | None]] = []
    spans: list[tuple[str, float, float]] = []
    current: str | None = None
    for t_ms, allocated, reserved, phase in sorted(events, key=lambda e: e[0]):
        points.append((t_ms, allocated, reserved))
        if phase != current:
            if current is not None:
                spans[-1] = (current, spans[-1][1], t_ms)
            if phase is not None:
                spans.append((phase, t_ms, t_ms))
            current = phase
    if current is not None:
        spans[-1] = (current, spans[-1][1], points[-1][0])
    return MemorySeries(source="timeline", caption=caption, points=points, spans=spans)


def series_from_timeline(
    timeline: Any, *, caption: str | None = None, max_points: int = 2000
) -> MemorySeries:
    """The measured curve of a :class:`memadvisor.timeline.Timeline`, phases from its marks.

    Long recordings are thinned to ``max_points``, keeping the highest reading of each slice
    of time: a chart's job here is to show the peaks, which averaging would hide.
    """
    events = sorted(timeline.events, key=lambda ev: ev.t_ms)
    rows: list[tuple[float, int, int | None, str | None]] = []
    phase: str | None = None
    for ev in events:
        if ev.kind == "phase" and ev.phase:
            phase = None if ev.phase == "end" else ev.phase
        rows.append((ev.t_ms, ev.allocated_bytes, ev.reserved_bytes, phase))
    if len(rows) > max_points:
        rows = _thin(rows, max_points)
    dropped = getattr(timeline, "dropped_events", 0)
    caption = (
        caption or f"One training step of {timeline.model_name} recorded on {timeline.device}."
    )
    if dropped:
        caption += f" The buffer dropped the {dropped} oldest events."
    return series_from_events(rows, caption)


def _thin(
    rows: list[tuple[float, int, int | None, str | None]], max_points: int
) -> list[tuple[float, int, int | None, str | None]]:
    t0, t1 = rows[0][0], rows[-1][0]
    width = (t1 - t0) / max_points or 1.0
    kept: dict[int, tuple[float, int, int | None, str | None]] = {}
    marks = []  # where the phase changes: kept whatever their bytes, or the bands would move
    for i, row in enumerate(rows):
        if i == 0 or row[3] != rows[i - 1][3]:
            marks.append(row)
            continue
        bucket = int((row[0] - t0) / width)
        if bucket not in kept or row[1] > kept[bucket][1]:
            kept[bucket] = row
    return sorted([*marks, *kept.values()], key=lambda r: r[0])
