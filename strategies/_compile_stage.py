"""The compile strategy's measured stage: the eager pick compiled, measured, kept when faster.

The estimate cannot rank a compiled model: the compile strategy is ``measured_only``
(fusion removes intermediates and the partitioner chooses what backward keeps, which the
eager profile does not show), so the search ranks eager combinations only. Once the device
has chosen the eager pick, the planner calls ``Compile.refine`` (:func:`compiled_pick`),
which judges compiled variants of it by measuring them through the planner's
:class:`~memadvisor.strategy.PickStage`:

1. Variants. The pick's choices with each compiled choice the compile strategy offers. The
   plain one (``"default"``) keeps the pick's checkpointed blocks, compiled with the model.
   A choice with a partitioner budget is the recompute knob of a compiled model (it
   recomputes inside the fused graph instead of re-running whole blocks): it replaces
   block checkpointing, so it is tried only when the pick checkpoints blocks, with the
   budget set to the share of activations the pick keeps (:func:`kept_share`): both
   variants then hold about the pick's memory at its batch and the device says which
   recompute is cheaper.
2. Trial. Each variant is compiled once in this process
   (:func:`~strategies.compile.try_compile`), which also times the one-off compile: at the
   eager pick's confirmed batch when the card has room for it beside a probe (:func:`trial_batch`),
   so the first compiled probe loads that graph from inductor's cache instead of compiling
   it again (21 s saved for a 124M GPT on an H200, docs/design.md), else at the sample
   batch. A model that does not compile (an error, no graph, graph breaks everywhere) is a
   note and the plan stays eager.
3. Device. Each variant that compiled gets the batch search eager candidates get
   (``PickStage.confirm``), bracketed from the eager pick's confirmed batch, inside one shared
   inductor cache (:func:`~strategies._compile_cache.shared_compile_cache`), so a probe
   process at a batch already compiled (the verify run, the user's own first step) loads
   the kernels instead of building them.
4. Verdict. The best compiled variant replaces the eager pick only when its measured
   steady-state throughput beats eager's by :data:`MIN_SPEEDUP` (objective
   ``largest_batch``: a larger batch, or the same batch that much faster). The plan keeps
   the one-off compile time and the cache's cost (a ``StageOutcome``) and a note.

Known limitations:
    * Only the eager pick is compiled, not the other re-ranked candidates: each compiled
      probe pays a compile (``docs/design.md``, "torch.compile"), so the stage stays at two
      variants of two or three probes each.
    * The partitioner budget is a share between the least and the most that the min-cut
      partitioner would save, not of eager's activations: matching it to the pick's kept
      share is a starting point the device then confirms, not an estimate.
    * Probes use the same steps as eager's (the first one compiles; the median of the rest
      is the steady state), so a compile that gains less than the timing noise is not kept.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from pydantic import JsonValue

from memadvisor.errors import is_our_bug
from memadvisor.memory import release_cached_memory
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.plan import StageOutcome, StageVariant
from memadvisor.schema.profile import Profile
from memadvisor.strategy import Confirmed, PickStage, Refinement, chosen_strategies, facts_of
from memadvisor.units import fmt_bytes, fmt_ms, fmt_rate
from memadvisor.workload import Workload
from strategies._compile_cache import SharedCompileCache, shared_compile_cache
from strategies._compile_trial import CompileResult
from strategies._compiled_forward import CompileChoice, parse_choice


@dataclass(frozen=True)
class DeviceGain:
    """What the device measured for a compiled choice against the eager pick (the planner's)."""

    batch_size: int
    samples_per_s: float
    eager_batch_size: int
    eager_samples_per_s: float


class Compile(Protocol):
    """What the stage needs of the compile strategy: its offered choices, its trial (kept
    for its check and advice), and where to keep the gains the device measured."""

    offered: list[JsonValue]
    gains: dict[CompileChoice, DeviceGain]

    def trial(
        self,
        workload: Workload,
        choice: JsonValue,
        *,
        candidate: Candidate | None = None,
        device: torch.device | str | None = None,
    ) -> CompileResult: ...


__all__ = [
    "MIN_SPEEDUP",
    "POLICIES",
    "DeviceGain",
    "compiled_pick",
    "compiled_variants",
    "kept_share",
    "trial_batch",
]

COMPILE = "compile"
STAGE = COMPILE  # Probe.stage of the compiled variants' runs: the strategy's name
#: The compile strategy's settings (``PlanConfig.options["compile"]``): auto weighs compiling
#: on CUDA only, where a compiled step can be measured (each compiled candidate costs a
#: compile per probe process, seconds to minutes; the simulated CPU device runs a compiled
#: step eagerly under its byte meter, so it cannot judge one); off never; on wherever the
#: device's step times rank.
POLICIES = ("auto", "off", "on")
# Two timed steps a side: gains of a percent or two are within their noise, and a compiled
# model pays a compile in every process that trains it. Below this, eager is kept.
MIN_SPEEDUP = 1.03
# Budgets in twentieths: a plan reads 0.65, not 0.6473; rounded up, so the variant keeps
# at least what the pick keeps (it recomputes no more than it must).
_BUDGET_STEP = 0.05
# What the card must hold beyond two budgets (a probe process's and the trial's, which runs
# in this process) before the trial runs at the probes' batch: two CUDA contexts and this
# process's leftovers.
ROOM_BESIDES_PROBES_BYTES = 2 * 2**30


def compiled_pick(
    stage: PickStage,
    eager_best: Confirmed,
    strategy: Compile,
    *,
    cache_dir: str | Path | None = None,
    cache: SharedCompileCache | None = None,
) -> Refinement:
    """The pick to verify: ``eager_best``, or a compiled variant of it the device found faster.

    Args:
        stage: the planner's stage (its config, profile, workload, device's capabilities and
            batch search).
        eager_best: the eager pick, confirmed on the device.
        strategy: the compile strategy (its offered choices; it keeps the trials and gains).
        cache_dir: the inductor cache the variants' processes share; None keeps the user's,
            so what the plan compiled is warm for the user's own training.
        cache: a shared cache entered already for the whole plan (``Compile.plan_scope``, so
            the fork server starts once with it); ``cache_dir`` is then unused.

    The trial runs at the eager pick's batch where the card has room beside a probe
    (``stage.free_bytes``, :func:`trial_batch`), else at the sample batch.

    Returns:
        The confirmed pick (``eager_best`` itself when compiling was not considered, failed
        or lost), what compiling measured (None when it was not considered) and the notes
        (the verdict and the compile cache's cost).
    """
    why_not = _not_considered(stage, strategy)
    if why_not is not None:
        return Refinement(pick=eager_best, notes=[why_not] if why_not else [])
    variants = compiled_variants(
        eager_best.candidate.choices, strategy.offered, stage.profile, eager_best.found_batch
    )
    if not variants:  # only budget choices offered, and the pick recomputes nothing
        return Refinement(pick=eager_best)
    runs_before = len(stage.probes)
    records: list[StageVariant] = []
    confirmed: list[tuple[StageVariant, Confirmed]] = []
    scope = contextlib.nullcontext(cache) if cache is not None else shared_compile_cache(cache_dir)
    with stage.progress(), scope as shared:
        for choices in variants:
            stage.describe(f"compile: trying {_label(choices)}")
            record, found = _measure_variant(
                stage, strategy, choices, eager_best.found_batch, stage.free_bytes
            )
            records.append(record)
            if found is not None:
                confirmed.append((record, found))
        # The cache is the device runs' (the trials run here): only they make it worth a note.
        ran = len(stage.probes) > runs_before
        cache_report = shared.report() if ran else None

    objective = stage.config.objective
    winner = _best(objective, confirmed)
    picked = winner is not None and _beats(objective, winner[1], eager_best)
    one_off_ms = winner[0].one_off_ms if picked and winner is not None else None
    costs = []
    if one_off_ms is not None:
        costs.append(
            f"first step compiles for about {fmt_ms(one_off_ms)}, once per process and input shape"
        )
    if cache_report is not None and cache_report.added_bytes > 0:
        costs.append(
            f"the plan added {fmt_bytes(cache_report.added_bytes)} to inductor's cache in "
            f"{cache_report.cache_dir}"
        )
    outcome = StageOutcome(
        strategy=COMPILE,
        label="Compile",
        runs_label="compiling (compiled variants)",
        picked=picked,
        summary=_verdict(records, winner, eager_best, picked),
        pick_words=_pick_words(winner[1].candidate) if picked and winner is not None else "",
        answer=_kept_eager(records, eager_best),
        costs=costs,
        eager_batch_size=eager_best.candidate.batch_size,
        eager_candidate=eager_best.candidate,
        eager_samples_per_s=eager_best.measured.samples_per_s,
        eager_measured=eager_best.measured,
        variants=records,
        one_off_ms=one_off_ms,
        details={"cache": _cache_details(cache_report)} if cache_report is not None else {},
    )
    notes = [outcome.summary]
    if cache_report is not None:
        notes.append(cache_report.note)
    if not picked or winner is None:
        return Refinement(pick=eager_best, outcome=outcome, notes=notes)
    _record_gain(strategy, winner[1], eager_best)
    return Refinement(pick=winner[1], outcome=outcome, notes=notes)


def _cache_details(report) -> dict[str, JsonValue]:
    """The shared cache's cost as plain JSON for ``StageOutcome.details``."""
    return {**report.model_dump(), "added_bytes": report.added_bytes}


def _kept_eager(records: Sequence[StageVariant], eager: Confirmed) -> str:
    """The report's Compile row when the eager pick was kept: why, in a clause."""
    measured = [v.measured for v in records if v.measured is not None]
    if measured:
        best = max(m.samples_per_s for m in measured)
        return (
            f"weighed, planned eager: compiled ran {fmt_rate(best)} samples/s against the "
            f"eager pick's {fmt_rate(eager.measured.samples_per_s)} samples/s, not enough to "
            "pay for compiling"
        )
    if any(v.ok for v in records):
        return "weighed, planned eager: the compiled runs failed on the device (see notes)"
    return "weighed, planned eager: the model does not compile (see notes)"


def _pick_words(candidate: Candidate) -> str:
    """``'torch.compile (default mode)'``; a budget adds its activation memory budget."""
    parsed = _parse(candidate.choices.get(COMPILE))
    if parsed is None:
        return ""
    return f"torch.compile ({parsed.words()})"


# -- which variants -----------------------------------------------------------------------


def compiled_variants(
    choices: dict[str, JsonValue],
    offered: Sequence[JsonValue],
    profile: Profile,
    batch_size: int,
) -> list[dict[str, JsonValue]]:
    """The eager ``choices`` compiled each way ``offered`` says, in that order, no repeats.

    A compiled choice without a partitioner budget keeps every eager choice (checkpointed
    blocks are compiled with the model). One with a budget replaces block checkpointing and
    is included only when ``choices`` checkpoints blocks; its budget becomes the share the
    eager choices keep at ``batch_size`` (:func:`kept_share`), its mode stays as offered.
    """
    eager = {name: choice for name, choice in choices.items() if name != COMPILE}
    recomputing = _recomputing(eager)
    out: list[dict[str, JsonValue]] = []
    seen: set[str] = set()
    for offer in offered:
        parsed = _parse(offer)
        if parsed is None:
            continue
        if parsed.activation_memory_budget is None:
            variant = {**eager, COMPILE: parsed.to_json()}
        elif recomputing:
            budget = kept_share(profile, eager, batch_size)
            recompute = parsed.model_copy(update={"activation_memory_budget": budget})
            without = {name: c for name, c in eager.items() if name not in recomputing}
            variant = {**without, COMPILE: recompute.to_json()}
        else:
            continue  # nothing is recomputed in the eager pick: no recompute to replace
        key = json.dumps(variant, sort_keys=True)
        if key not in seen:
            seen.add(key)
            out.append(variant)
    return out


def _recomputing(choices: dict[str, JsonValue]) -> set[str]:
    """The strategies among ``choices`` that recompute blocks (their facts say so)."""
    candidate = Candidate(batch_size=1, choices=choices)
    return {s.name for s, c in chosen_strategies(candidate) if s.facts(c).recomputed_blocks}


def kept_share(profile: Profile, choices: dict[str, JsonValue], batch_size: int) -> float:
    """The share of saved activations ``choices``' checkpointed blocks still keep, in twentieths.

    From the profile's step in the choices' precision: each checkpointed block frees what it
    saved less the outputs something outside it saves (``output_kept``); the share is what
    is left of all saved activations, rounded up to a twentieth, between 0.05 and 0.95.
    """
    facts = facts_of(Candidate(batch_size=batch_size, choices=choices))
    step = profile.steps.get(facts.autocast or "fp32") or profile.steps["fp32"]
    names = _block_names(facts.recomputed_blocks, profile)
    total = step.activation_total.at(batch_size)
    if total <= 0:
        return 1.0 - _BUDGET_STEP
    freed = 0
    for block in step.blocks:
        if block.name in names:
            kept = block.output_kept.at(batch_size) if block.output_kept is not None else 0
            freed += max(0, block.activation.at(batch_size) - kept)
    share = max(0.0, (total - freed) / total)
    twentieths = math.ceil(round(share / _BUDGET_STEP, 6))
    return round(min(1.0 - _BUDGET_STEP, max(_BUDGET_STEP, twentieths * _BUDGET_STEP)), 2)


def _block_names(choice: JsonValue, profile: Profile) -> set[str]:
    """Names a checkpointing choice lists (names, or indices into the profile's blocks)."""
    if not isinstance(choice, list):
        return set()
    names = [b.name for b in profile.blocks]
    return {
        names[item] if isinstance(item, int) and 0 <= item < len(names) else str(item)
        for item in choice
    }


# -- whether to compile at all ------------------------------------------------------------


def _parse(choice: JsonValue) -> CompileChoice | None:
    return parse_choice(choice)


def policy_of(stage: PickStage) -> str:
    """The compile setting the plan's config gives (``options["compile"]``), checked."""
    policy = stage.config.option(COMPILE, "auto")
    if policy not in POLICIES:
        from memadvisor.errors import BadInputError

        raise BadInputError(
            f"The compile option is one of {POLICIES}, but got {policy=}; pass "
            "compile='auto', 'off' or 'on'."
        )
    return str(policy)


def _not_considered(stage: PickStage, strategy: Compile) -> str | None:
    """None when the variants are tried; else why not ('' when nothing needs saying)."""
    policy = policy_of(stage)
    if policy == "off":
        return ""
    if policy == "auto" and stage.device_kind != "cuda":
        return ""  # the simulated device runs a compiled step eagerly: nothing to measure
    if not any(_parse(c) is not None for c in strategy.offered):
        return ""
    if stage.config.parallel != "none":
        # A compiled step per rank (compiled FSDP2 hooks, DDP's graph breaks at buckets) is
        # not what the estimate or the rank runner models.
        return f"Compiling was not weighed for {stage.config.parallel} ranks; planned eager."
    if not stage.step_times_rank:
        return (
            f"compile='on' was asked, but the {stage.device_kind} device's step times cannot "
            "tell a compiled step from an eager one (the simulated device runs a compiled step "
            "eagerly under its byte meter); planned eager. Plan on a CUDA device to weigh "
            "compiling."
        )
    return None


# -- one variant ----------------------------------------------------------------------------


def _measure_variant(
    stage: PickStage,
    strategy: Compile,
    choices: dict[str, JsonValue],
    start_batch: int,
    free_bytes: int | None = None,
) -> tuple[StageVariant, Confirmed | None]:
    """Trial ``choices`` here (:func:`trial_batch`); if it compiles, confirm it on the device.

    At the batch the device search starts from, the trial fills inductor's on-disk cache with
    the graph the first compiled probe needs, and that probe loads it instead of compiling
    (``docs/design.md``, plan speed). A trial that ran out of memory there (this process
    shares the card with the probes) is tried again at the sample batch.
    """
    workload = stage.workload
    others = {name: c for name, c in choices.items() if name != COMPILE}
    sample = workload.sample_batch_size
    batches = [trial_batch(start_batch, sample, stage.config.budget_bytes, free_bytes)]
    if batches[0] != sample:
        batches.append(sample)
    try:
        for batch in batches:
            result = strategy.trial(
                workload,
                choices[COMPILE],
                candidate=Candidate(batch_size=batch, choices=others),
                device="cuda" if stage.device_kind == "cuda" else None,
            )
            release_cached_memory()
            if not result.out_of_memory:
                break
    except Exception as e:  # noqa: BLE001 - the trial's eager step failing is also an answer
        if is_our_bug(e):
            raise
        text = f"the compile trial could not run its eager step ({_first_line(e)})."
        return StageVariant(choices=choices, ok=False, trial=text, error=text), None
    finally:
        # The trial ran in the planner's process: what it cached goes back before the probe
        # processes ask the card for the budget.
        release_cached_memory()
    if not result.ok:
        return StageVariant(choices=choices, ok=False, trial=result.summary), None

    record = StageVariant(
        choices=choices, ok=True, trial=result.summary, one_off_ms=result.compile_ms
    )
    runs_before = len(stage.probes)
    found: Confirmed | None = None
    try:
        found = stage.confirm(choices, start_batch)
    except Exception as e:  # noqa: BLE001 - a compiled run failing on the device keeps eager
        if is_our_bug(e):
            raise
        record.error = _first_line(e)
    record.device_wall_ms = sum(p.wall_ms for p in stage.probes[runs_before:])
    if found is None:
        record.error = record.error or "not even batch 1 fitted on the device."
        return record, None
    record.batch_size = found.candidate.batch_size
    record.measured = found.measured
    return record, found


def trial_batch(
    start_batch: int, sample_batch: int, budget_bytes: int, free_bytes: int | None
) -> int:
    """The batch a compile trial runs at: the device search's start when the card has room,
    else the sample batch.

    The trial runs in this process, beside a probe process capped at the budget: room is two
    budgets and :data:`ROOM_BESIDES_PROBES_BYTES` free; ``free_bytes`` None (no card) is none.
    """
    if free_bytes is not None and free_bytes >= 2 * budget_bytes + ROOM_BESIDES_PROBES_BYTES:
        return max(1, start_batch)
    return max(1, sample_batch)


def _record_gain(strategy: Compile, compiled: Confirmed, eager: Confirmed) -> None:
    """Tell the strategy what the device measured, so its advice quotes the gain."""
    parsed = _parse(compiled.candidate.choices[COMPILE])
    if parsed is not None:
        strategy.gains[parsed] = DeviceGain(
            batch_size=compiled.candidate.batch_size,
            samples_per_s=compiled.measured.samples_per_s,
            eager_batch_size=eager.candidate.batch_size,
            eager_samples_per_s=eager.measured.samples_per_s,
        )


# -- the verdict ------------------------------------------------------------------------------


def _rank(objective: str, confirmed: Confirmed) -> tuple:
    rate = confirmed.measured.samples_per_s
    if objective == "largest_batch":
        return (confirmed.candidate.batch_size, rate)
    return (rate,)


def _best(
    objective: str, confirmed: Sequence[tuple[StageVariant, Confirmed]]
) -> tuple[StageVariant, Confirmed] | None:
    if not confirmed:
        return None
    return max(confirmed, key=lambda pair: _rank(objective, pair[1]))


def _beats(objective: str, compiled: Confirmed, eager: Confirmed) -> bool:
    """Whether ``compiled`` is worth a compile per process over ``eager``, by the objective."""
    batch, eager_batch = compiled.candidate.batch_size, eager.candidate.batch_size
    if objective == "largest_batch" and batch != eager_batch:
        return batch > eager_batch
    return compiled.measured.samples_per_s >= MIN_SPEEDUP * eager.measured.samples_per_s


def _verdict(
    records: Sequence[StageVariant],
    winner: tuple[StageVariant, Confirmed] | None,
    eager: Confirmed,
    picked: bool,
) -> str:
    eager_rate = eager.measured.samples_per_s
    eager_batch = eager.candidate.batch_size
    eager_words = f"the eager pick's {eager_rate:.1f} samples/s at batch {eager_batch}"
    if winner is None:
        reasons = "; ".join(
            f"{_label(r.choices)}: {r.error or _trial_reason(r.trial)}" for r in records
        )
        return f"Planned eager because no compiled variant ran: {reasons}"
    record, found = winner
    rate = found.measured.samples_per_s
    measured = (
        f"torch.compile ({_label(record.choices)}) ran {rate:.1f} samples/s at batch "
        f"{found.candidate.batch_size}, {rate / eager_rate:.2f}x {eager_words}"
    )
    if not picked:
        return (
            f"Planned eager because compiling did not pay: {measured}; a compiled pick must be "
            f"{MIN_SPEEDUP - 1:.0%} faster (or, for the largest batch, larger) to be worth a "
            "compile in every process."
        )
    compile_s = (record.one_off_ms or 0.0) / 1e3
    return (
        f"Compiled: {measured}. The first step compiles for about {compile_s:.1f} s, once per "
        "process and input shape; throughput is the steady state. The estimate shown is "
        "eager's: compiled memory and time are measured, not estimated."
    )


def _label(choices: dict[str, JsonValue]) -> str:
    """``'default mode, 3 blocks checkpointed'``: a variant in a few words."""
    parsed = _parse(choices.get(COMPILE))
    if parsed is None:
        return "eager"
    words = parsed.words()
    blocks = facts_of(Candidate(batch_size=1, choices=choices)).recomputed_blocks
    if blocks:
        words += f", {len(blocks)} blocks checkpointed"
    return words


def _trial_reason(summary: str) -> str:
    # The trial's sentence ends "Planned eager." for a failure: the verdict says that once.
    return summary.removesuffix(" Planned eager.")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    first = text.splitlines()[0] if text else ""
    return f"{type(error).__name__}: {first[:300]}" if first else type(error).__name__
