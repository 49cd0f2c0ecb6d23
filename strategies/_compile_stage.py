"""The compile strategy's measured stage: compiled configurations searched, kept when faster.

The estimate cannot rank a compiled model: the compile strategy is ``Measured``
(fusion removes intermediates and the partitioner chooses what backward keeps, which the
eager profile does not show), so the search ranks eager combinations only. Once the device
has chosen the eager pick, the planner calls ``Compile.refine`` (:func:`compiled_pick`),
which searches compiled configurations through the planner's
:class:`~memadvisor.strategy.PickStage`:

1. Candidates (:func:`strategies._compile_search.search_variants`): the eager pick's
   choices compiled, the same with other checkpointed sets (none, half, all), and a
   partitioner budget in place of the pick's checkpointing (:func:`kept_share`: the share of
   activations the pick keeps, so both hold about the pick's memory at its batch). A compiled
   step holds less than eager, so the eager pick's checkpointed set is not the compiled
   optimum (issue 27). Each is measured in its search form: each repeated block compiled,
   where blocks repeat (a compile about as many times shorter as there are blocks).
2. Trial. Each search form is compiled once in this process
   (:func:`~strategies.compile.try_compile`), which also times the one-off compile: at the
   eager pick's confirmed batch when the card has room for it beside a probe (:func:`trial_batch`),
   else at the sample batch. Where the device makes its runs in processes of their own
   (a card's fork server), the trial runs while the candidates' first runs compile there
   (``Search.measure``'s ``meanwhile``), so its seconds overlap theirs; elsewhere it runs
   first, and the first compiled probe loads its graph from inductor's cache (21 s saved
   for a 124M GPT on an H200, docs/design.md). A model that does not compile (an error, no
   graph, graph breaks everywhere) is a note and the plan stays eager; a candidate whose
   form failed its trial is dropped, whatever its run measured.
3. Device (:class:`strategies._compile_search.Search`): a run or two of each candidate,
   a line of its compiled memory and time from them (:class:`~memadvisor.schema.plan.StepFit`),
   the best by its line confirmed by the batch search eager candidates get
   (``PickStage.confirm``) from the batch its line predicts (and, only with
   ``CompileSearch.confirm_offered``, the offered whole-model form at that batch); all
   within :class:`~strategies._compile_search.CompileSearch`'s budget of runs,
   inside one shared inductor cache (:func:`~strategies._compile_cache.shared_compile_cache`).
4. Verdict. The best confirmed compiled configuration replaces the eager pick only when its
   measured steady-state throughput beats eager's by :data:`MIN_SPEEDUP` (objective
   ``largest_batch``: a larger batch, or the same batch that much faster). The plan keeps
   the candidates with their lines, the one-off compile time and the cache's cost (a
   ``StageOutcome``) and a note.
5. CUDA graphs. Where the pick's card waited on the host (its launches took
   ``CompileSearch.host_bound_share`` of its step or more), the pick is confirmed again in
   ``reduce-overhead`` mode at a batch of its own, and kept where faster
   (:func:`strategies._compile_graphs.graphs_pick`). Where no compiled configuration beat
   the eager pick, the best one the search ran is replayed so, against the eager pick.

Known limitations:
    * The seconds a compile costs are measured by the trial of the search form only: where
      the pick is the offered (whole-model) form, its compile time is not timed by the plan
      until the strategy's check compiles it once more in this process.
    * The partitioner budget is a share between the least and the most that the min-cut
      partitioner would save, not of eager's activations: matching it to the pick's kept
      share is a starting point the device then confirms, not an estimate.
    * Probes use the same steps as eager's (the first one compiles; the median of the rest
      is the steady state), so a compile that gains less than the timing noise is not kept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from pydantic import JsonValue, ValidationError

from memadvisor.errors import is_our_bug
from memadvisor.memory import release_cached_memory
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.plan import StageOutcome, StageVariant
from memadvisor.schema.profile import Profile
from memadvisor.strategy import Confirmed, PickStage, Refinement, facts_of
from memadvisor.units import fmt_bytes, fmt_ms, fmt_rate
from memadvisor.workload import Workload
from strategies._compile_cache import SharedCompileCache, shared_compile_cache
from strategies._compile_graphs import (
    HOST_BOUND_TIE,
    Graphs,
    bets_within,
    first_round,
    graphs_of,
    graphs_pick,
    graphs_words,
    held_rates,
    next_round,
    waits_on_host,
)
from strategies._compile_search import (
    COMPILE,
    FINAL_FORM_RUNS,
    MIN_SPEEDUP,
    SECOND_RUN_SHARE,
    CompileSearch,
    Search,
    Variant,
    beats_eager,
    compiles_every_run,
    first_line,
    handed_on,
    is_dynamic,
    search_variants,
    static_when_checkpointed,
    worth,
)
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
    search: CompileSearch

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
    "CompileSearch",
    "DeviceGain",
    "compiled_pick",
    "kept_share",
    "parse_setting",
    "policy_of",
    "trial_batch",
]

STAGE = COMPILE  # Probe.stage of the compiled variants' runs: the strategy's name
#: The compile strategy's settings (``PlanConfig.options["compile"]``): auto weighs compiling
#: on CUDA only, where a compiled step can be measured (each compiled candidate costs a
#: compile per probe process, seconds to minutes; the simulated CPU device runs a compiled
#: step eagerly under its byte meter, so it cannot judge one); off never; on wherever the
#: device's step times rank.
POLICIES = ("auto", "off", "on")
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
    """The pick to verify: ``eager_best``, or a compiled configuration the device found faster.

    Args:
        stage: the planner's stage (its config, profile, workload, device's capabilities,
            the search space's options and the batch search).
        eager_best: the eager pick, confirmed on the device.
        strategy: the compile strategy (its offered choices and search settings; it keeps
            the trials and gains).
        cache_dir: the inductor cache the variants' processes share; None keeps the user's,
            so what the plan compiled is warm for the user's own training.
        cache: a shared cache entered already for the whole plan (``Compile.plan_scope``, so
            the fork server starts once with it); ``cache_dir`` is then unused.

    The trial runs at the eager pick's batch where the card has room beside a probe
    (``stage.free_bytes``, :func:`trial_batch`), else at the sample batch.

    Returns:
        The confirmed pick (``eager_best`` itself when compiling was not considered, failed
        or lost), what compiling measured (None when it was not considered) and the notes
        (the verdict, how the pick's compiled memory was learned, the compile cache's cost).
    """
    why_not = _not_considered(stage, strategy)
    if why_not is not None:
        return Refinement(pick=eager_best, notes=[why_not] if why_not else [])
    settings = search_of(stage.config, strategy)
    variants, left_out = search_variants(
        stage,
        eager_best,
        strategy.offered,
        settings,
        lambda choices, batch: kept_share(stage.profile, choices, batch),
    )
    if not variants:  # only budget choices offered, and the pick recomputes nothing
        return Refinement(pick=eager_best)
    runs_before = len(stage.probes)
    objective = stage.config.objective
    scope = contextlib.nullcontext(cache) if cache is not None else shared_compile_cache(cache_dir)
    with stage.progress(), scope as shared:
        search = Search(stage, settings, eager_best)
        search.graphs_ahead = lambda v: _graphs_ahead(stage, settings, v)
        search.trial_whole = lambda choices: _trial_beside(stage, strategy, choices)
        search.graphs_bet = lambda v, batch, room: bets_within(
            stage, settings, v.static_choices, batch, eager_best.measured, room
        )
        trials: dict[str, _Trial] = {}
        later: list[_StaticLater] = []

        def refused() -> dict[int, str | None]:
            return {id(v): trials[_key(v.trial_form)].error for v in variants if not _ok(trials, v)}

        def trial() -> dict[int, str | None]:
            # Beside pass 1's runs on a card (Search.measure): the trial's compile in this
            # process overlaps theirs (lm350m on an H100: a 23 s trial before a 28 s pass).
            # A dynamic form that fails is trialled static beside its static runs (then).
            beside = later if stage.concurrent_runs > 1 else None
            trials.update(_trial_forms(stage, strategy, variants, eager_best.found_batch, beside))
            return refused()

        def then() -> dict[int, str | None]:
            _trial_static(stage, strategy, later, trials)
            return refused()

        winner = search.measure(variants, meanwhile=trial, then=then)
        measurable = [v for v in variants if _ok(trials, v)]
        found = final = searched = displaced = whole = None
        final_why = static_why = rode_words = ""
        if winner is not None:
            differs = winner.final_differs
            # Where every run of the winner compiles anyway, its confirmation runs the static
            # form: the run the pick is judged on and verified by, one run fewer (lm350m's
            # full checkpointing on an H100: 15.8 s).
            direct = not differs and is_dynamic(winner.form) and compiles_every_run(winner)
            # Elsewhere its static form, the verification, goes with the confirmation's first
            # run where the device makes runs at once (Search.confirm's static_beside).
            # And the CUDA graphs' first round with it, where the winner's largest run
            # waited on the host: the bet the static form makes, that the batch holds.
            static_along = not differs and not direct
            graphs_beside = _graphs_ahead(stage, settings, winner) if static_along else []
            # Where the bets were made (with pass 2), the graphs search's next run goes with
            # the confirmation's first instead of waiting for it (_compile_graphs.next_round).
            found = search.confirm(
                winner,
                FINAL_FORM_RUNS if differs else 0,
                static=direct,
                static_beside=static_along,
                graphs_beside=graphs_beside,
                graphs_next=[] if graphs_beside else _graphs_next(stage, settings, winner),
            )
            # A line from one run can promise more than its confirmation finds, below what
            # another candidate already measured: that one is confirmed too (from its runs
            # where none are left) and the better kept.
            rival = search.rival(measurable, winner, found)
            if rival is not None:
                other = search.confirm(rival, FINAL_FORM_RUNS if rival.final_differs else 0)
                if other is not None and (
                    found is None or _rank(objective, other) > _rank(objective, found)
                ):
                    if found is not None and direct:  # its static run judged and verified it
                        displaced = (winner, found)
                    winner, found, direct = rival, other, False
                    differs = winner.final_differs
            if found is not None and differs:
                final, final_why = search.confirm_final(winner, found)
            elif found is not None and is_dynamic(winner.form) and not direct:
                # Judged on the form the user runs; its run is the pick's verification.
                # The CUDA graphs' first runs go with it where its searched run waited on
                # the host: the graphs step finds them made (first_round).
                ahead = first_round(
                    stage,
                    settings,
                    handed_on(found).candidate.choices,
                    found.candidate.batch_size,
                    found.measured,
                )
                static, static_why = search.confirm_static(winner, found, ahead)
                if static is not None:
                    searched, found = found, static
            if (
                found is not None
                and not differs
                and not is_dynamic(found.candidate.choices[COMPILE])
            ):
                # A static form that rode with pass 2 and measured more (Search.rode_past).
                rode = search.rode_past(measurable, winner, found)
                if rode is not None:
                    if displaced is None:
                        displaced = (winner, found)
                    rode_words = _rode_words(rode, winner, found)
                    winner, found = rode
                    searched, static_why = None, ""
                # The winner's whole model compiled, run beside pass 2 and faster by
                # MIN_SPEEDUP (Search.whole_past): the pick, beside the regional form.
                whole = search.whole_past(winner, found)
                if whole is not None and not _trial_compiled(strategy, whole):
                    whole = None  # its trial here (beside pass 2) failed: not handed on
        # The cache is the device runs' (the trials run here): only they make it worth a note.
        ran = len(stage.probes) > runs_before
        cache_report = shared.report() if ran else None

    records = [_record(stage, v, trials[_key(v.trial_form)], runs_before) for v in variants]
    confirmed: list[tuple[StageVariant, Confirmed]] = []
    if displaced is not None:
        index = variants.index(displaced[0])
        records[index] = _confirmed_record(records[index], displaced[1])
        confirmed.append((records[index], displaced[1]))
    if winner is not None and found is not None:
        index = variants.index(winner)
        records[index] = _confirmed_record(records[index], found)
        confirmed.append((records[index], found))
        if winner.final_differs:
            record = _final_record(stage, winner, final, final_why, runs_before)
            records.append(record)
            if final is not None:
                confirmed.append((record, final))
        elif whole is not None:
            whole_choices = whole.candidate.choices
            record = _final_record(stage, winner, whole, "", runs_before, whole_choices)
            records.append(record)
            confirmed.append((record, whole))
            rode_words = f"{rode_words} {_whole_words(winner, whole, found)}".strip()
    best = _best(objective, confirmed)
    picked = best is not None and _beats(objective, best[1], eager_best)
    graphs = graphs_note = None
    # The pick replayed as CUDA graphs where its card waited on the host: another batch.
    # Where compiling in default mode did not pay, the best compiled configuration the search
    # ran is replayed, against the eager pick: a step that waits on the host is as slow
    # compiled as eager, and graphs are what removes its launches (the GPT example on an
    # H200, session 30: eager 0.92 of its step launching, compiled 0.996, 0.95x eager).
    base = best if picked else _graphs_base(records, best)
    if base is not None:
        base = _bet_base(stage, settings, records, base, picked, eager_best)
        against = None if picked else eager_best
        again = (
            contextlib.nullcontext(cache) if cache is not None else shared_compile_cache(cache_dir)
        )
        graphs_before = len(stage.probes)
        with stage.progress(), again:
            line = base[0].fit
            fixed = line.fixed_bytes if line is not None else None
            graphs = graphs_pick(stage, settings, base[1], objective, fixed, against)
        search.graphs_runs += len(stage.probes) - graphs_before
        graphs_note = graphs_words(graphs, base[1], search.graphs_runs, against)
        if graphs.found is not None:
            record = _graphs_record(stage, graphs.found, base[0], runs_before)
            records.append(record)
            if graphs.wins:
                best, picked = (record, graphs.found), True
    # Bets not used and not said why by the graphs step's own words (waited_elsewhere's).
    if search.graphs_runs and (graphs is None or (not graphs.tried and not graphs.elsewhere)):
        graphs_note = _unused_graphs_words(search.graphs_runs, graphs)
    one_off_ms = best[0].one_off_ms if picked and best is not None else None
    costs = []
    if picked and best is not None:
        costs.append(_compile_cost(best[0], trials))
    if cache_report is not None and cache_report.added_bytes > 0:
        costs.append(
            f"the plan added {fmt_bytes(cache_report.added_bytes)} to inductor's cache in "
            f"{cache_report.cache_dir}"
        )
    unconfirmed = None
    if winner is not None and found is None:
        unconfirmed = (
            f"its confirmation failed ({winner.error})"
            if winner.error
            else "its confirmation found no batch of it within the budget's margin before the "
            f"search's {settings.max_runs} device runs were spent"
        )
    summary = _verdict(records, best, eager_best, picked, unconfirmed)
    if found is not None and (searched is not None or static_why):
        summary += " " + _static_words(found, searched, static_why)
    if rode_words:
        summary += " " + rode_words
    if graphs_note:
        summary += " " + graphs_note
    summary += " " + _searched(search, variants, left_out, best[0] if best else None)
    outcome = StageOutcome(
        strategy=COMPILE,
        label="Compile",
        runs_label="compiling (compiled variants)",
        picked=picked,
        summary=summary,
        pick_words=_pick_words(best[1].candidate) if picked and best is not None else "",
        # The report's row where the eager pick was kept (StageOutcome.answer): none else.
        answer="" if picked else _kept_eager(records, eager_best),
        costs=costs,
        eager_batch_size=eager_best.candidate.batch_size,
        eager_candidate=eager_best.candidate,
        eager_samples_per_s=eager_best.measured.samples_per_s,
        eager_measured=eager_best.measured,
        variants=records,
        one_off_ms=one_off_ms,
        details=_details(search, settings, left_out, cache_report, graphs),
    )
    notes = [outcome.summary]
    # The line that chose the pick's configuration: the searched form's (the offered form's
    # confirmation has none of its own).
    chosen = winner
    if displaced is not None and best is not None and best[1] is displaced[1]:
        chosen = displaced[0]
    fit_note = _fit_note(records[variants.index(chosen)] if picked and chosen else None)
    if fit_note:
        notes.append(fit_note)
    if cache_report is not None:
        notes.append(cache_report.note)
    if not picked or best is None:
        return Refinement(pick=eager_best, outcome=outcome, notes=notes)
    pick = handed_on(best[1])
    _record_gain(strategy, pick, eager_best)
    return Refinement(pick=pick, outcome=outcome, notes=notes)


def _graphs_next(
    stage: PickStage, settings: CompileSearch, winner: Variant
) -> list[tuple[dict[str, JsonValue], int]]:
    """The graphs search's first run after its bets (``next_round``) for ``winner``'s static
    form at its predicted batch, where its largest run waited on the host; [] where not."""
    if winner.fit is None or not winner.runs or winner.final_differs:
        return []
    measured = winner.runs[max(winner.runs)]
    fixed = winner.fit.fixed_bytes
    return next_round(
        stage, settings, winner.static_choices, winner.fit.largest_batch, measured, fixed
    )


def _graphs_ahead(
    stage: PickStage, settings: CompileSearch, winner: Variant
) -> list[tuple[dict[str, JsonValue], int]]:
    """The CUDA graphs' first round (``first_round``) for ``winner``'s static form at its
    predicted batch, where its largest run waited on the host; [] where not."""
    if winner.fit is None or not winner.runs:
        return []
    measured = winner.runs[max(winner.runs)]
    return first_round(stage, settings, winner.static_choices, winner.fit.largest_batch, measured)


def _unused_graphs_words(runs: int, graphs: Graphs | None) -> str:
    """Why the CUDA graphs runs made ahead beside other runs (``first_round``'s bets,
    ``next_round``'s run) went unused: the pick's own run was not replayed as graphs (it
    did not wait on the host as the leader's runs had), or there was no compiled
    configuration to replay."""
    made = f"{runs} CUDA graphs run{'s' if runs != 1 else ''} made ahead beside other runs"
    if graphs is not None and graphs.host_share is not None:
        return (
            f"{made} went unused: the leader's runs had waited on the host, but the pick's "
            f"own run took {graphs.host_share:.0%} of its step to launch it and was not "
            "replayed as graphs."
        )
    return f"{made} went unused: no compiled configuration was left to replay."


def _rode_words(rode: tuple[Variant, Confirmed], winner: Variant, found: Confirmed) -> str:
    """Why the pick is a rider's candidate (Search.rode_past), in a sentence."""
    v, static = rode
    return (
        f"The static form of {v.label}, run beside the second pass at batch "
        f"{static.candidate.batch_size}, ran {static.measured.samples_per_s:.1f} samples/s, "
        f"more than {winner.label}'s {found.measured.samples_per_s:.1f} at batch "
        f"{found.candidate.batch_size}, the best by the lines"
        f"{'' if is_dynamic(winner.form) else ' (searched static)'}: it is the pick, its run "
        "the verification."
    )


def _whole_words(winner: Variant, whole: Confirmed, found: Confirmed) -> str:
    """Why the pick is the winner's whole model compiled (Search.whole_past), in a sentence."""
    rate, regional = whole.measured.samples_per_s, found.measured.samples_per_s
    return (
        f"The whole model compiled ({winner.label}), run beside the second pass at batch "
        f"{whole.candidate.batch_size}, ran {rate:.1f} samples/s, {rate / regional:.2f}x each "
        f"repeated block compiled ({regional:.1f} at batch {found.candidate.batch_size}): it "
        "is the pick, its run the verification; its first step compiles the whole model, "
        "longer than block by block."
    )


def _static_words(found: Confirmed, searched: Confirmed | None, why: str) -> str:
    """What the winner's static run said beside its searched (dynamic batch) one."""
    if searched is None:
        return (
            "Its static form, which the plan hands on, was not measured before the "
            f"verification: {why}."
        )
    rate, dynamic = found.measured.samples_per_s, searched.measured.samples_per_s
    return (
        f"That is its static form, which the plan hands on and you run; searched with a "
        f"dynamic batch it ran {dynamic:.1f} samples/s at that batch ({rate / dynamic:.2f}x)."
    )


def _key(choice: JsonValue) -> str:
    return json.dumps(choice, sort_keys=True)


def _details(
    search: Search,
    settings: CompileSearch,
    left_out: Sequence[str],
    report,
    graphs: Graphs | None = None,
) -> dict[str, JsonValue]:
    """The search's budget and use, the shared cache's cost and the CUDA-graphs step
    (the host's share of the pick's step, whether graphs ran and won), as plain JSON."""
    out: dict[str, JsonValue] = {
        "search": {
            **settings.model_dump(),
            # checkpointed_static as this plan took it (None: by this torch's caches).
            "checkpointed_searched": "static" if static_when_checkpointed(settings) else "dynamic",
            "runs": search.runs_used,
            "static_runs": search.static_runs,
            "graphs_runs": search.graphs_runs,
            "riders": list(search.riders),
            "not_riding": dict(search.not_riding),
            "left_out": list(left_out),
        }
    }
    if report is not None:
        out["cache"] = {**report.model_dump(), "added_bytes": report.added_bytes}
    if graphs is not None:
        out["graphs"] = {
            "host_share": graphs.host_share,
            "tried": graphs.tried,
            "batch_size": graphs.found.candidate.batch_size if graphs.found else None,
            "samples_per_s": graphs.found.measured.samples_per_s if graphs.found else None,
            "picked": graphs.wins,
            # What graphs had to beat: the compiled pick, or the eager pick where compiling
            # in default mode did not pay.
            "against": graphs.against,
            "error": graphs.error,
            # Not tried: the bets on another checkpointed set still waited on the host.
            "waited_elsewhere": dataclasses.asdict(graphs.elsewhere) if graphs.elsewhere else None,
            # Found among the runs made ahead for a pick under the host's bar: that bar.
            "made_under_bar": graphs.made_under,
        }
    return out


def _kept_eager(records: Sequence[StageVariant], eager: Confirmed) -> str:
    """The report's Compile row when the eager pick was kept: why, in a clause."""
    measured = [v.measured for v in records if v.measured is not None]
    if measured:
        best = max(m.samples_per_s for m in measured)
        predicted = [v.fit.samples_per_s for v in records if v.fit is not None]
        words = f"compiled ran {fmt_rate(best)} samples/s"
        if predicted and max(predicted) > best:
            words += f" (its best line predicted {fmt_rate(max(predicted))} at its largest batch)"
        return (
            f"weighed, planned eager: {words} against the eager pick's "
            f"{fmt_rate(eager.measured.samples_per_s)} samples/s, not enough to pay for compiling"
        )
    if any(v.ok for v in records):
        return "weighed, planned eager: the compiled runs failed on the device (see notes)"
    return "weighed, planned eager: the model does not compile (see notes)"


def _pick_words(candidate: Candidate) -> str:
    """``'torch.compile (default mode)'``; a budget adds its activation memory budget."""
    parsed = _parse(candidate.choices.get(COMPILE))
    if parsed is None:
        return ""
    return f"torch.compile ({parsed.static().words()})"


# -- what was measured, as the plan keeps it ---------------------------------------------------


def _record(stage: PickStage, v: Variant, trial: _Trial, runs_before: int) -> StageVariant:
    """``v`` as the plan keeps it: its trial, its line, its largest run that fitted."""
    sentence = trial.sentence
    if v.static_because:
        sentence += (
            f" This candidate's dynamic-batch compile failed ({v.static_because}): searched "
            "with a static batch, a compile per batch."
        )
    record = StageVariant(
        choices=v.choices,
        ok=trial.ok,
        trial=sentence,
        one_off_ms=trial.one_off_ms,
        fit=v.fit,
        device_wall_ms=_wall_ms(stage, v.choices, runs_before),
        error=v.error if trial.ok else trial.error,
    )
    if v.runs:
        batch = max(v.runs)
        record.batch_size, record.measured = batch, v.runs[batch]
    return record


def _confirmed_record(record: StageVariant, found: Confirmed) -> StageVariant:
    return record.model_copy(
        update={
            "batch_size": found.candidate.batch_size,
            "measured": found.measured,
            "confirmed": True,
        }
    )


def _graphs_base(
    records: Sequence[StageVariant], best: tuple[StageVariant, Confirmed] | None
) -> tuple[StageVariant, Confirmed] | None:
    """The compiled configuration to replay as CUDA graphs where compiling did not beat the
    eager pick: the best confirmed one (``best``), else the best by its line among those the
    device ran (the one the verdict quotes), static, at the batch of its largest run that
    held, with that run's measurement (the host's share); None where none ran."""
    if best is not None:
        return best
    lines = [r for r in records if _ran(r)]
    if not lines:
        return None
    record = max(lines, key=lambda r: r.fit.samples_per_s if r.fit else 0.0)
    return _as_base(record)


def _ran(record: StageVariant) -> bool:
    """Whether ``record`` has a line and a run that held (it can be replayed as graphs)."""
    return (
        record.ok
        and record.fit is not None
        and record.fit.largest_batch >= 1
        and record.measured is not None
    )


def _as_base(record: StageVariant) -> tuple[StageVariant, Confirmed] | None:
    """``record`` as a configuration to replay as CUDA graphs: static, at the batch of its
    largest run that held, with that run's measurement (the host's share)."""
    assert record.fit is not None and record.measured is not None
    parsed = _parse(record.choices.get(COMPILE))
    if parsed is None:
        return None
    batch = record.batch_size or record.fit.largest_batch
    choices = {**record.choices, COMPILE: parsed.static().to_json()}
    candidate = Candidate(batch_size=batch, choices=choices)
    return record, Confirmed(candidate=candidate, found_batch=batch, measured=record.measured)


def _bet_base(
    stage: PickStage,
    settings: CompileSearch,
    records: Sequence[StageVariant],
    base: tuple[StageVariant, Confirmed],
    picked: bool,
    eager: Confirmed,
) -> tuple[StageVariant, Confirmed]:
    """The configuration the graphs step replays: ``base``, or another candidate whose
    default-mode run read within :data:`HOST_BOUND_TIE` of the base's (two host-bound rates
    that close are the host's, not the candidates') and whose CUDA graphs were made ahead
    (the bets of pass 1 or 2) and held at a rate that already wins against what the graphs
    step must beat (``picked``: what the pick's own graphs would have to reach, where its
    run waited on the host, :data:`HOST_BOUND_TIE` of its rate, as in ``graphs_pick``;
    where it did not, its rate; else the eager pick's by MIN_SPEEDUP), the fastest such. Its
    graphs search then starts from that run, which settles it where its line allows no 5%
    more (no device run).

    Why: the bets go on the candidate expected to lead before its runs are read, and where
    another leads by its default-mode runs, which on a host-bound step move with the host,
    the graphs of the base were searched in a round of their own while a run that already
    won sat unused: the GPT example on an H200 (session 35 call 2) had its bet, 2 blocks
    checkpointed replayed as graphs at 246, hold at 31,267 samples/s; its default-mode
    runs read 22,442 (2 blocks) and 24,541 (4 blocks) against eager's 28,973, so the graphs
    of 4 blocks were searched after the stage (156 and 249, 28.7 s) and picked at 29,908.

    Until session 38 the bar against a compiled pick that waited on the host was its full
    rate, where ``graphs_pick`` keeps the pick's own graphs at 0.90 of it: a bet between the
    two was left unused and the pick's graphs searched in a round of their own (session 38
    call 2's GPT plan paid such a round, 21.9 s, beside a bet on 2 blocks at 246 that held;
    that plan was not kept, so which bar left the bet unused is not known), for a rate the
    GPT example's graphs of 2 and 4 blocks reach alike (on H200s, sessions 30-38: 2
    blocks at 246 30,343-31,963 samples/s in 24 runs, 4 blocks at 249 29,908-31,039 in 4;
    their default-mode runs at 307 and 311, the host's rates, 17,294-34,748 in 93).

    A candidate whose own default-mode run did not wait on the host is not taken: the
    graphs step tries no graphs of such a base, and the bet would go unused.

    Known limitations: the base's own graphs, not run, might have run faster still, by
    as much as its default-mode rate led (under a tenth)."""
    rate = base[1].measured.samples_per_s
    if not picked:
        bar = MIN_SPEEDUP * eager.measured.samples_per_s
    elif waits_on_host(settings, base[1].measured):
        bar = HOST_BOUND_TIE * rate  # what the base's own graphs would need (graphs_pick)
    else:
        bar = rate
    tie = HOST_BOUND_TIE * rate
    found: list[tuple[float, tuple[StageVariant, Confirmed]]] = []
    for record in records:
        if record is base[0] or not _ran(record):
            continue
        assert record.measured is not None
        if record.measured.samples_per_s < tie:
            continue
        other = _as_base(record)
        graphs = graphs_of(settings, other[1].candidate.choices) if other else None
        if other is None or graphs is None or not waits_on_host(settings, other[1].measured):
            continue  # (graphs_pick tries no graphs of a base whose run did not wait)
        top = other[1].candidate.batch_size
        rates = held_rates(
            stage, lambda p, g=graphs, b=top: p.candidate.choices == g and p.batch_size <= b
        )
        if rates and max(rates) >= bar:
            found.append((max(rates), other))
    return max(found, key=lambda item: item[0])[1] if found else base


def _graphs_record(
    stage: PickStage, found: Confirmed, pick: StageVariant, runs_before: int
) -> StageVariant:
    """The pick replayed as CUDA graphs, confirmed at its own batch; its compile is the
    pick's graph (its trial stands for it: the same graph, replayed)."""
    record = StageVariant(
        choices=found.candidate.choices,
        ok=True,
        trial="not trialled here: the pick's graph, replayed as CUDA graphs; the device ran it.",
        one_off_ms=pick.one_off_ms,
        device_wall_ms=_wall_ms(stage, found.candidate.choices, runs_before),
    )
    return _confirmed_record(record, found)


def _final_record(
    stage: PickStage,
    winner: Variant,
    final: Confirmed | None,
    why: str,
    runs_before: int,
    choices: dict[str, JsonValue] | None = None,
) -> StageVariant:
    """The winner in its offered form (``choices``, else its ``final_choices``: the whole
    model's rider's, Search.whole_past), confirmed from its batch (not trialled here: the
    search trialled its search form)."""
    choices = choices if choices is not None else winner.final_choices
    record = StageVariant(
        choices=choices,
        ok=True,
        trial="not trialled here: the search compiled its search form; the device ran this one.",
        device_wall_ms=_wall_ms(stage, choices, runs_before),
        error=why or None,
    )
    if final is not None:
        record = _confirmed_record(record, final)
    return record


def _wall_ms(stage: PickStage, choices: dict[str, JsonValue], runs_before: int) -> float:
    return sum(
        p.wall_ms
        for p in stage.probes[runs_before:]
        if p.candidate is not None and p.candidate.choices == choices
    )


def _compile_cost(record: StageVariant, trials: dict[str, _Trial]) -> str:
    """The pick's one-off compile, in a phrase."""
    if record.one_off_ms is not None:
        return (
            f"first step compiles for about {fmt_ms(record.one_off_ms)}, once per process and "
            "input shape"
        )
    timed = [t for t in trials.values() if t.one_off_ms is not None]
    searched = f" (the search form compiled in {fmt_ms(timed[0].one_off_ms)})" if timed else ""
    return (
        "first step compiles, once per process and input shape; the plan did not time this "
        f"form's compile{searched}"
    )


def _fit_note(record: StageVariant | None) -> str:
    """How the pick's compiled memory was learned, in a sentence; '' without a line."""
    if record is None or record.fit is None:
        return ""
    fit = record.fit
    label = _label(record.choices)
    line = (
        f"{fmt_bytes(fit.fixed_bytes)} + {fmt_bytes(fit.per_sample_bytes)} a sample, "
        f"largest batch {fit.largest_batch} within {fmt_bytes(fit.limit_bytes)}"
    )
    if fit.reserved_batch is not None:
        line += " (there a line through the runs' reserved bytes reaches that limit)"
    elif fit.cap_batch is not None:
        line += (
            " (there the line plus the step's largest allocation, a block the allocator must "
            "find free, reaches the budget)"
        )
    batches = ", ".join(str(b) for b in fit.batches)
    if fit.basis == "fitted":
        return f"Compiled memory of {label}: {line}, fitted from runs at batches {batches}."
    ratio = (
        f"eager's per-sample bytes scaled by {fit.bytes_ratio:.2f}, the compiled/eager ratio "
        "of the batch-dependent bytes measured there"
        if fit.bytes_ratio is not None
        else "a line from zero through that run (the estimate left nothing to scale)"
    )
    return f"Compiled memory of {label}: {line}, from one run (batch {batches}): {ratio}."


def _searched(
    search: Search,
    variants: Sequence[Variant],
    left_out: Sequence[str],
    best: StageVariant | None,
) -> str:
    """What the search covered, in a sentence."""
    ran = [v.label for v in variants if v.runs or v.lowest_failure is not None]
    words = (
        f"Searched {len(ran)} compiled configuration{'s' if len(ran) != 1 else ''} "
        f"({'; '.join(ran) or 'none'}) in {search.runs_used} device runs "
        f"(at most {search.settings.max_runs})"
    )
    skipped = [v.label for v in variants if not v.runs and v.lowest_failure is None]
    if skipped or left_out:
        words += f"; not run: {'; '.join([*skipped, *left_out])}"
    if search.second_skipped:
        words += (
            f"; one run only, as each of its runs compiles afresh and its line is below "
            f"{SECOND_RUN_SHARE:.0%} of the best's: {'; '.join(search.second_skipped)}"
        )
    return words + "."


# -- which variants -----------------------------------------------------------------------


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


def parse_setting(value: JsonValue) -> tuple[str, dict[str, JsonValue]]:
    """The compile setting a plan's options give (``options["compile"]``): its policy, and
    the :class:`CompileSearch` fields it sets for this plan ({} where none), checked.

    A setting is a policy (:data:`POLICIES`) or ``{"policy": ..., "search": {...}}``, where
    ``search`` holds :class:`CompileSearch`'s fields (``{"host_bound_share": 0.7}``) and
    ``policy`` defaults to auto: ``memadvisor.plan(..., compile={"search": {...}})``
    reaches the settings ``Compile(search=...)`` takes.

    Raises:
        BadInputError: anything else, with the value and what to pass.
    """
    from memadvisor.errors import BadInputError, validation_problems

    example = "compile='auto', 'off' or 'on', or compile={'policy': 'auto', 'search': {...}}"
    if isinstance(value, str) and value in POLICIES:
        return value, {}
    if not isinstance(value, dict):
        raise BadInputError(
            f"The compile option is one of {POLICIES} or a dict, but got {value!r}; pass {example}."
        )
    extra = sorted(set(value) - {"policy", "search"})
    policy = value.get("policy", "auto")
    search = value.get("search", {})
    if extra or policy not in POLICIES or not isinstance(search, dict):
        raise BadInputError(
            f"The compile option's dict takes 'policy' (one of {POLICIES}) and 'search' (a "
            f"dict of CompileSearch's fields), but got {value!r}; pass {example}."
        )
    try:
        CompileSearch.model_validate(search)
    except ValidationError as e:
        problems = validation_problems(e, "search")
        raise BadInputError(
            f"The compile option's search settings are not CompileSearch's: {problems}; "
            f"its fields are {sorted(CompileSearch.model_fields)}."
        ) from None
    return str(policy), dict(search)


def policy_of(config: PlanConfig) -> str:
    """The compile policy a plan's config gives (``options["compile"]``), checked."""
    return parse_setting(config.option(COMPILE, "auto"))[0]


def search_of(config: PlanConfig, strategy: Compile) -> CompileSearch:
    """``strategy``'s search settings, with those a plan's config sets over them."""
    fields = parse_setting(config.option(COMPILE, "auto"))[1]
    if not fields:
        return strategy.search
    return CompileSearch.model_validate({**strategy.search.model_dump(), **fields})


def _not_considered(stage: PickStage, strategy: Compile) -> str | None:
    """None when the variants are tried; else why not ('' when nothing needs saying)."""
    policy = policy_of(stage.config)
    if policy == "off":
        return ""
    if policy == "auto" and not stage.device.can_compile:
        return ""  # the simulated device runs a compiled step eagerly: nothing to measure
    if not any(_parse(c) is not None for c in strategy.offered):
        return ""
    if stage.config.parallel != "none":
        # A compiled step per rank (compiled FSDP2 hooks, DDP's graph breaks at buckets) is
        # not what the estimate or the rank runner models.
        return f"Compiling was not weighed for {stage.config.parallel} ranks; planned eager."
    if not stage.step_times_rank:
        return (
            f"compile='on' was asked, but the {stage.device.kind} device's step times cannot "
            "tell a compiled step from an eager one (the simulated device runs a compiled step "
            "eagerly under its byte meter); planned eager. Plan on a CUDA device to weigh "
            "compiling."
        )
    return None


# -- one variant ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Trial:
    """A search form compiled once in this process: whether it compiled, and its cost."""

    ok: bool
    sentence: str  # the trial's sentence: its one-off cost, or why it failed
    one_off_ms: float | None = None
    error: str | None = None


@dataclass
class _StaticLater:
    """A dynamic form that failed its trial, whose static form is trialled later
    (:func:`_trial_static`), beside its candidates' static runs."""

    key: str  # the dynamic form's
    static: JsonValue
    choices: dict[str, JsonValue]  # the first candidate's, in the static form
    batch: int
    why: str  # the dynamic trial's failure
    also: list[str] = dataclasses.field(default_factory=list)  # budget forms it stands for


def _trial_forms(
    stage: PickStage,
    strategy: Compile,
    variants: Sequence[Variant],
    start_batch: int,
    static_later: list[_StaticLater] | None = None,
) -> dict[str, _Trial]:
    """Each search form among ``variants`` trialled once (:func:`_trial`), by its JSON, with
    the choices of the first candidate in that form. A dynamic-batch form that fails is
    trialled static, and where that compiles its candidates are searched static; with
    ``static_later``, that static trial is left to :func:`_trial_static` (listed there), its
    candidates moved to the static form at once, as if it compiled. A form that differs
    from one trialled ok only by a partitioner budget is not trialled: that trial stands for
    it (candidates come the budget-free first, :func:`search_variants`)."""
    out: dict[str, _Trial] = {}
    static_for: dict[str, JsonValue] = {}  # a dynamic form that failed -> its static form
    for v in variants:
        key = _key(v.form)
        base = _budget_free(v.form)
        if key not in out and base is not None and _key(base) in out and out[_key(base)].ok:
            # The same compile but for the partitioner's budget (what backward recomputes,
            # not what is computed): the trial of the form without it answers whether it
            # compiles and matches eager; its first device run compiles it (~15 s of the
            # planner's time saved for lm350m on a card, docs/design.md).
            done = out[_key(base)]
            out[key] = _standing_for(done)
            if _key(base) in static_for:  # the form without it is searched static: so is this
                parsed_form = _parse(v.form)
                assert parsed_form is not None  # a budget form parses
                static_for[key] = parsed_form.static().to_json()
                out[_key(static_for[key])] = out[key]
                for item in static_later or []:
                    if item.key == _key(base):
                        item.also += [key, _key(static_for[key])]
        twin = _batch_twin(v.form)
        if key not in out and twin is not None and _key(twin) in out and out[_key(twin)].ok:
            # The same compile but for a static or dynamic batch (a checkpointed candidate
            # searched static beside dynamic ones: checkpointed_static): the twin's trial
            # answers whether the model compiles and matches eager, and this form's first
            # device run compiles it; a dynamic form that then fails in the compiler is
            # searched static (Search._static_instead).
            out[key] = _standing_for_twin(out[_key(twin)], twin)
        if key not in out:
            batch = v.start_batch if v.start_batch else start_batch
            out[key] = _trial(stage, strategy, v.choices, batch)
            parsed = _parse(v.form)
            if not out[key].ok and parsed is not None and parsed.dynamic_batch:
                # A model whose graph a symbolic batch breaks is still searched, statically
                # (a compile per batch, as before the dynamic form).
                static = parsed.static().to_json()
                why = out[key].error or out[key].sentence
                if static_later is not None:
                    later = _StaticLater(key, static, {**v.choices, COMPILE: static}, batch, why)
                    static_later.append(later)
                    out[key] = out[_key(static)] = _Trial(ok=True, sentence="")
                    static_for[key] = static
                    v.choices = {**v.choices, COMPILE: static}
                    continue
                tried = _trial(stage, strategy, {**v.choices, COMPILE: static}, batch)
                if tried.ok:
                    sentence = f"{tried.sentence} Searched with a static batch: {why}"
                    out[key] = out[_key(static)] = dataclasses.replace(tried, sentence=sentence)
                    static_for[key] = static
        if key in static_for:
            v.choices = {**v.choices, COMPILE: static_for[key]}
    return out


def _trial_static(
    stage: PickStage, strategy: Compile, later: Sequence[_StaticLater], trials: dict[str, _Trial]
) -> None:
    """The static trials :func:`_trial_forms` left for later, their answers in ``trials``
    under both the dynamic form's key and the static one's: the static one's sentence and
    why it is searched static, or why it failed too."""
    for item in later:
        tried = _trial(stage, strategy, item.choices, item.batch)
        if tried.ok:
            sentence = f"{tried.sentence} Searched with a static batch: {item.why}"
            tried = dataclasses.replace(tried, sentence=sentence)
        trials[item.key] = trials[_key(item.static)] = tried
        for key in item.also:
            trials[key] = _standing_for(tried)


def _standing_for(
    done: _Trial, form: str = "without a partitioner budget", one_off_ms: float | None = None
) -> _Trial:
    """The trial of a form answered by ``done``, that of the same compile but for ``form``
    (how the trialled one differs): the form without its partitioner budget, or with the
    batch the other way (static or dynamic), whose compile time is then kept
    (``one_off_ms``) as the pick's estimate of its one-off cost, a compile of the same graph
    but for the batch's symbol."""
    return _Trial(
        ok=done.ok,
        sentence=f"not trialled: the same compile as the form {form}, whose trial stands for "
        f"it ({done.sentence})",
        error=done.error,
        one_off_ms=one_off_ms,
    )


def _standing_for_twin(done: _Trial, twin: JsonValue) -> _Trial:
    """:func:`_standing_for` for ``twin``'s trial, ``twin`` the same form with the batch the
    other way."""
    parsed = _parse(twin)
    batch = "dynamic" if parsed is not None and parsed.dynamic_batch else "static"
    return _standing_for(done, f"with a {batch} batch", done.one_off_ms)


def _batch_twin(form: JsonValue) -> JsonValue | None:
    """``form`` with its batch the other way, static for dynamic and dynamic for static, as
    JSON; None when it does not parse."""
    parsed = _parse(form)
    if parsed is None:
        return None
    return parsed.model_copy(update={"dynamic_batch": not parsed.dynamic_batch}).to_json()


def _trial_beside(stage: PickStage, strategy: Compile, choices: dict[str, JsonValue]) -> None:
    """``choices``' compile form trialled here at the sample batch (:func:`_trial`), unless
    a trial of it was kept: the whole model's, beside pass 2's group where it rides
    (``Search.trial_whole``), so that the plan's compile check of a whole-model pick
    (``Compile.check``) reuses it instead of compiling after the search. Its answer is
    the check's; the rider's device run is the measurement."""
    parsed = _parse(choices[COMPILE])
    if parsed is None or strategy._result_for(parsed) is not None:
        return
    _trial(stage, strategy, choices, stage.workload.sample_batch_size)


def _trial_compiled(strategy: Compile, found: Confirmed) -> bool:
    """Whether ``found``'s compile form compiled in the trial kept for it here (True where
    none was kept: the plan's compile check then trials it)."""
    parsed = _parse(found.candidate.choices[COMPILE])
    result = strategy._result_for(parsed) if parsed is not None else None
    return result is None or result.ok


def _trial(
    stage: PickStage, strategy: Compile, choices: dict[str, JsonValue], start_batch: int
) -> _Trial:
    """Trial ``choices`` here (:func:`trial_batch`): whether it compiles, and in how long.

    At the batch the device runs start from, the trial fills inductor's on-disk cache with
    the graph the first compiled probe needs, and that probe loads it instead of compiling
    (``docs/design.md``, plan speed). A trial that ran out of memory there (this process
    shares the card with the probes) is tried again at the sample batch.
    """
    workload = stage.workload
    others = {name: c for name, c in choices.items() if name != COMPILE}
    sample = workload.sample_batch_size
    batches = [trial_batch(start_batch, sample, stage.config.budget_bytes, stage.free_bytes)]
    if batches[0] != sample:
        batches.append(sample)
    parsed = _parse(choices[COMPILE])
    stage.describe(
        f"compile: compiling {parsed.words() if parsed else 'eager'} in this process "
        f"(a trial at batch {batches[0]})"
    )
    try:
        for batch in batches:
            result = strategy.trial(
                workload,
                choices[COMPILE],
                candidate=Candidate(batch_size=batch, choices=others),
                device=stage.device.tensor_device if stage.device.can_compile else None,
            )
            release_cached_memory()
            if not result.out_of_memory:
                break
    except Exception as e:  # noqa: BLE001 - the trial's eager step failing is also an answer
        if is_our_bug(e):
            raise
        text = f"the compile trial could not run its eager step ({first_line(e)})."
        return _Trial(ok=False, sentence=text, error=text)
    finally:
        # The trial ran in the planner's process: what it cached goes back before the probe
        # processes ask the card for the budget.
        release_cached_memory()
    if not result.ok:
        return _Trial(ok=False, sentence=result.summary)
    return _Trial(ok=True, sentence=result.summary, one_off_ms=result.compile_ms)


def _ok(trials: dict[str, _Trial], v: Variant) -> bool:
    """Whether ``v``'s search form compiled in its trial."""
    return trials[_key(v.trial_form)].ok


def _budget_free(form: JsonValue) -> JsonValue | None:
    """``form`` without its partitioner budget, as JSON; None when it has none."""
    parsed = _parse(form)
    if parsed is None or parsed.activation_memory_budget is None:
        return None
    return parsed.model_copy(update={"activation_memory_budget": None}).to_json()


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
    return worth(objective, confirmed.candidate.batch_size, confirmed.measured.samples_per_s)


def _best(
    objective: str, confirmed: Sequence[tuple[StageVariant, Confirmed]]
) -> tuple[StageVariant, Confirmed] | None:
    if not confirmed:
        return None
    return max(confirmed, key=lambda pair: _rank(objective, pair[1]))


def _beats(objective: str, compiled: Confirmed, eager: Confirmed) -> bool:
    """Whether ``compiled`` is worth a compile per process over ``eager``, by the objective."""
    rate = compiled.measured.samples_per_s
    return beats_eager(objective, compiled.candidate.batch_size, rate, eager)


def _verdict(
    records: Sequence[StageVariant],
    winner: tuple[StageVariant, Confirmed] | None,
    eager: Confirmed,
    picked: bool,
    unconfirmed: str | None = None,
) -> str:
    """The compile stage's sentence: what it picked and why (``unconfirmed``: why the best
    configuration by its line is not the pick, where its confirmation found nothing)."""
    eager_rate = eager.measured.samples_per_s
    eager_batch = eager.candidate.batch_size
    eager_words = f"the eager pick's {eager_rate:.1f} samples/s at batch {eager_batch}"
    must = (
        f"a compiled pick must be {MIN_SPEEDUP - 1:.0%} faster (or, for the largest batch, "
        "larger) to be worth a compile in every process."
    )
    if winner is None:
        lines = [r for r in records if r.fit is not None and r.fit.largest_batch >= 1]
        if lines:
            best = max(lines, key=lambda r: r.fit.samples_per_s if r.fit else 0.0)
            assert best.fit is not None
            rate = best.fit.samples_per_s
            if unconfirmed is not None:
                return (
                    "Planned eager because no compiled configuration was confirmed: the best "
                    f"by the line through its runs, torch.compile ({_label(best.choices)}), "
                    f"predicted at {rate:.1f} samples/s at batch {best.fit.largest_batch} "
                    f"({rate / eager_rate:.2f}x {eager_words}), is not the pick because "
                    f"{unconfirmed}."
                )
            return (
                "Planned eager because compiling did not pay: the best compiled configuration, "
                f"torch.compile ({_label(best.choices)}), was predicted at {rate:.1f} samples/s "
                f"at batch {best.fit.largest_batch} by the line through its runs, "
                f"{rate / eager_rate:.2f}x {eager_words}; {must}"
            )
        reasons = "; ".join(
            f"{_label(r.choices)}: {r.error or _trial_reason(r.trial)}" for r in records
        )
        return f"Planned eager because no compiled variant ran: {reasons}"
    record, found = winner
    rate = found.measured.samples_per_s
    measured = (
        f"torch.compile ({_label(record.choices)}) ran {rate:.1f} samples/s at batch "
        f"{found.candidate.batch_size}, {rate / eager_rate:.2f}x {eager_words}"
        f"{_precision_moved(record.choices, eager.candidate.choices)}"
    )
    if not picked:
        return f"Planned eager because compiling did not pay: {measured}; {must}"
    if record.one_off_ms is not None:
        compiles = f"The first step compiles for about {record.one_off_ms / 1e3:.1f} s"
    else:
        compiles = "The first step compiles (not timed by the plan in this form)"
    return (
        f"Compiled: {measured}. {compiles}, once per process and input shape; throughput is "
        "the steady state. The estimate shown is eager's: compiled memory and time are "
        "measured, not estimated."
    )


def _precision_moved(choices: dict[str, JsonValue], eager: dict[str, JsonValue]) -> str:
    """``' (in bf16; the eager pick trains without autocast)'``, where the compiled pick's
    autocast differs from the eager pick's (the search's autocast candidate), else ''."""
    mine = facts_of(Candidate(batch_size=1, choices=choices)).autocast
    theirs = facts_of(Candidate(batch_size=1, choices=eager)).autocast
    if mine == theirs:
        return ""
    if mine is None:
        return f" (without autocast; the eager pick trains in {theirs})"
    was = f"in {theirs}" if theirs else "without autocast"
    return f" (in {mine}; the eager pick trains {was})"


def _label(choices: dict[str, JsonValue]) -> str:
    """``'default mode, 3 blocks checkpointed'``: a variant in a few words (its static form:
    a dynamic batch is how the search measured it, not a setting the user takes)."""
    parsed = _parse(choices.get(COMPILE))
    if parsed is None:
        return "eager"
    words = parsed.static().words()
    blocks = facts_of(Candidate(batch_size=1, choices=choices)).recomputed_blocks
    if blocks:
        words += f", {len(blocks)} blocks checkpointed"
    return words


def _trial_reason(summary: str) -> str:
    # The trial's sentence ends "Planned eager." for a failure: the verdict says that once.
    return summary.removesuffix(" Planned eager.")
