"""The compile stage searches the checkpointed set and the batch under compile (issue 27).

Against LinearDevice (tests/planner/conftest.py), whose eager and compiled memory and time are
lines known by construction, and a stand-in compile trial (no inductor), through the whole
planner: the search reaches a compiled configuration the eager pick does not have, learns each
candidate's compiled memory from its runs, keeps within its budget of device runs, says on the
progress line which candidate it waits on, and leaves the eager pick where compiling does not
pay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import threading
import time
from collections import Counter

import pytest
import torch
from pydantic import JsonValue

import strategies._compile_search as search_module
import strategies._compile_stage as stage_module
from memadvisor.errors import ProbeProcessError
from memadvisor.planner import Progress, plan_workload
from memadvisor.planner._prober import Prober
from memadvisor.planner._space import SearchSpace
from memadvisor.planner._stage import ProberStage
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.facts import Facts
from memadvisor.schema.plan import Plan
from memadvisor.strategy import Confirmed, Strategy
from strategies._compile_model import Line
from strategies._compile_search import (
    CONFIRM_RUNS,
    MIN_SPEEDUP,
    Search,
    recomputed_count,
    search_variants,
)
from strategies.compile import Compile, CompileResult, CompileSearch, parse_choice
from tests.fixtures.compile_trials import trial_result

MIB = 2**20
BLOCKS = 4
REGIONAL = {"mode": "default", "regional": True}
# What the search runs: the regional form with a dynamic batch (the pick is REGIONAL).
SEARCHED = {**REGIONAL, "dynamic_batch": True}

# A decoder's step in bf16, MiB a sample by checkpointed blocks: eager never holds less than
# the loss's fp32 logits (1.3 MiB a sample), however many blocks recompute, so past two
# blocks checkpointing buys eager nothing; compiled, the logits are fused away and what is
# left is 0.7 of the blocks' activations (2.0 MiB a sample, 0.4 less per block checkpointed).
ACTIVATIONS = {k: 2.0 - 0.4 * k for k in range(BLOCKS + 1)}
EAGER_LM = {
    **{("bf16", k): max(a, 1.3) for k, a in ACTIVATIONS.items()},
    **{("fp32", k): 2 * max(a, 1.3) for k, a in ACTIVATIONS.items()},
}
COMPILED_LM = {
    **{("bf16", k): 0.7 * a for k, a in ACTIVATIONS.items()},
    **{("fp32", k): 1.4 * a for k, a in ACTIVATIONS.items()},
}
# The same model with compiled memory 0.7 of eager's at every checkpointed set.
EAGER_FLAT = {
    (p, k): (1.0 if p == "bf16" else 2.0) * (2.0 - 0.4 * k)
    for p in ("bf16", "fp32")
    for k in range(BLOCKS + 1)
}


@pytest.fixture
def trials(monkeypatch) -> list:
    """try_compile replaced: every choice compiles at once (2 s of compiling); calls listed."""
    calls: list = []

    def stand_in(workload, choice, *, candidate=None, device=None, **kwargs) -> CompileResult:
        calls.append((choice, candidate))
        return trial_result(choice, candidate)

    monkeypatch.setattr("strategies.compile.try_compile", stand_in)
    return calls


def _config(**overrides) -> PlanConfig:
    fast = {"probe_steps": 2, "timing_steps": 2, "verify_steps": 4, "options": {"compile": "on"}}
    return PlanConfig(**{"budget_bytes": 100 * MIB, **fast, **overrides})


def _plan(workload, profile, strategies, device, search: CompileSearch | None = None, **config):
    """A whole plan over fake precision and checkpointing and the real compile strategy."""
    return plan_workload(
        workload,
        _config(**config),
        profile=profile,
        device=device,
        progress=False,
        strategies=[*strategies, Compile(search=search)],
        measure_comparison=False,
    )


def _blocks(choices: dict) -> int:
    return len(choices.get("checkpointing", []) or [])


def _compile_runs(plan: Plan) -> list:
    """The compile search's runs: the compile stage's, but for the pick's static form's own
    run (its verification, made in the stage: ``Search.confirm_static``)."""
    return [p for p in plan.probes if p.stage == "compile" and not _static_form(p)]


def _static_form(probe) -> bool:
    form = probe.candidate.choices.get("compile") if probe.candidate is not None else None
    return isinstance(form, dict) and not form.get("dynamic_batch")


def _best_compiled(device, precision: str = "bf16") -> tuple[int, int, float]:
    """(checkpointed blocks, batch, samples/s) of the best compiled configuration on
    ``device``, each at the largest batch that fits: the right answer, by construction."""
    best = (0, 0, 0.0)
    for k in range(BLOCKS + 1):
        choices = {"precision": precision, "compile": "default"}
        if k:
            choices["checkpointing"] = [f"b{i}" for i in range(k)]
        batch = device.edge(Candidate(batch_size=1, choices=choices))
        step_ms = device.step_ms(Candidate(batch_size=batch, choices=choices))
        rate = batch / step_ms * 1e3
        if rate > best[2]:
            best = (k, batch, rate)
    return best


def test_the_search_reaches_a_compiled_configuration_the_eager_pick_does_not_have(
    workload, profile, strategies, linear_device, trials
) -> None:
    """The issue's decoder: eager checkpoints 2 blocks (more frees nothing under the logits'
    floor); compiled, the logits are gone and all 4 blocks checkpointed hold about 4.6x the
    eager batch. The plan reaches that configuration (another checkpointed set, a larger
    batch), in the offered form when asked to confirm it, within 3% of the best compiled
    configuration's throughput."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    plan = _plan(workload, profile, strategies, device, search=CompileSearch(confirm_offered=True))

    stage = plan.stages[0]
    eager = stage.eager_candidate
    assert eager is not None and _blocks(eager.choices) == 2
    assert stage.picked and plan.candidate.choices["compile"] == "default"
    assert _blocks(plan.candidate.choices) != _blocks(eager.choices)
    assert plan.candidate.batch_size > eager.batch_size
    blocks, _, best_rate = _best_compiled(device)
    assert _blocks(plan.candidate.choices) == blocks == BLOCKS
    assert plan.verified is not None and plan.verified.samples_per_s >= 0.97 * best_rate
    # The candidates were measured regionally (each block compiled once), the pick confirmed
    # in the offered form at the regional winner's batch.
    forms = [p.candidate.choices["compile"] for p in _compile_runs(plan)]
    assert forms[-1] == "default" and all(f != "default" for f in forms[:-1])
    assert all(f["regional"] for f in forms[:-1])
    final = stage.variants[-1]
    assert final.choices == plan.candidate.choices and final.confirmed
    assert "Searched 4 compiled configurations" in stage.summary
    assert stage.answer == ""  # the report's row where the eager pick was kept: not this one


def test_a_candidates_compiled_memory_is_fitted_from_its_runs(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Compiled per-sample bytes 0.7 of eager's and 2 MiB of compiled workspace: the winner's
    line, through its two runs, recovers the device's fixed and per-sample bytes (to the
    byte's rounding), and its batch is what that line says; the plan keeps the line."""
    device = linear_device(EAGER_FLAT, compiled_fixed_bytes=2 * MIB, fixed_ms=3.0)
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    assert stage.picked
    winner = next(v for v in stage.variants if v.confirmed and v.choices["compile"] == SEARCHED)
    fit = winner.fit
    assert fit is not None and fit.basis == "fitted" and len(fit.batches) >= 2
    fixed, per_sample = device.line(Candidate(batch_size=1, choices=winner.choices))
    assert fixed == 12 * MIB
    assert abs(fit.fixed_bytes - fixed) <= 1
    assert abs(fit.per_sample_bytes - per_sample) <= 1
    assert fit.largest_batch == (fit.limit_bytes - fixed) // per_sample
    assert any(n.startswith("Compiled memory of") and "fitted from runs" in n for n in plan.notes)
    # Candidates measured once have a line scaled from the eager estimate, and say so.
    once = [v.fit for v in stage.variants if v.fit is not None and len(v.fit.batches) == 1]
    assert once and all(f.basis == "scaled" and f.bytes_ratio for f in once)
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


@pytest.mark.parametrize(("max_runs", "max_candidates"), [(1, 4), (3, 4), (5, 2), (8, 4), (12, 5)])
def test_the_device_runs_stay_within_the_search_budget(
    workload, profile, strategies, linear_device, trials, max_runs: int, max_candidates: int
) -> None:
    """However small the budget, the compile stage makes at most max_runs device runs (its
    batch searches included) over at most max_candidates configurations, and says how many."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    search = CompileSearch(max_runs=max_runs, max_candidates=max_candidates)
    plan = _plan(workload, profile, strategies, device, search)
    runs = _compile_runs(plan)
    assert 1 <= len(runs) <= max_runs
    measured = {
        str(p.candidate.choices) for p in runs if p.candidate.choices["compile"] == SEARCHED
    }
    assert len(measured) <= max_candidates
    stage = plan.stages[0]
    assert stage.details["search"]["runs"] == len(runs)
    assert len([v for v in stage.variants if v.choices["compile"] == SEARCHED]) <= max_candidates
    if max_runs >= 8:  # enough for a second run of the winner and its confirmation
        assert stage.picked and _blocks(plan.candidate.choices) == BLOCKS


def test_a_seconds_budget_stops_further_candidates(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Past max_seconds no candidate's run starts: the eager pick's own compiled variant runs
    (the first always does), the others say why they did not."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    plan = _plan(workload, profile, strategies, device, CompileSearch(max_seconds=1e-9))
    stage = plan.stages[0]
    first, *others = [v for v in stage.variants if v.choices["compile"] == SEARCHED]
    assert first.measured is not None and first.error is None
    assert others and all(v.measured is None and "s were spent" in v.error for v in others)
    assert "not run:" in stage.summary


def test_when_compiling_does_not_pay_the_eager_pick_stays(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Compiled steps 20% slower at eager's memory: every candidate's line predicts less than
    the eager pick, so none is confirmed and the plan stays eager."""
    device = linear_device(EAGER_LM, compiled_ratio=1.0, speedup=0.8, fixed_ms=3.0)
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    assert not stage.picked and "compile" not in plan.candidate.choices
    assert plan.candidate == stage.eager_candidate
    runs = _compile_runs(plan)
    # No batch search and no whole-model form: a run per candidate, and one at half the batch
    # for one that ran out where the budget had runs to spare.
    per_candidate = Counter(str(p.candidate.choices) for p in runs)
    assert len(per_candidate) == len(stage.variants) == 4
    assert max(per_candidate.values()) <= 2 and len([p for p in runs if p.fits]) >= 1
    assert all(p.candidate.choices["compile"]["regional"] for p in runs)
    assert not any(v.confirmed for v in stage.variants)
    assert stage.summary.startswith("Planned eager because compiling did not pay")
    assert "predicted" in stage.summary
    assert stage.answer.startswith("weighed, planned eager: compiled ran")


def test_the_regional_form_is_kept_where_the_whole_model_is_not_faster(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Where the offered (whole-model) form runs slower than the regional one at the winner's
    batch, the regional configuration the device confirmed is the pick: what was measured."""
    device = linear_device(
        EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0, regional_speed=1.1
    )
    plan = _plan(workload, profile, strategies, device, search=CompileSearch(confirm_offered=True))
    assert plan.stages[0].picked and plan.candidate.choices["compile"] == REGIONAL
    assert plan.stages[0].variants[-1].choices["compile"] == "default"  # tried, and lost


def test_by_default_the_pick_is_the_searched_form_and_no_whole_model_runs(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: by default (``confirm_offered`` off) no run compiles the whole model: every
    compiled run, the confirmation included, is the regional form, and the pick is the
    regional configuration at the batch the device confirmed, within 3% of the best
    regional configuration (all 4 blocks checkpointed, as in the test above)."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    plan = _plan(workload, profile, strategies, device)
    forms = [p.candidate.choices["compile"] for p in _compile_runs(plan)]
    assert forms and all(isinstance(f, dict) and f.get("regional") for f in forms), forms
    assert plan.stages[0].picked and plan.candidate.choices["compile"] == REGIONAL
    assert _blocks(plan.candidate.choices) == BLOCKS
    edge = device.edge(Candidate(batch_size=1, choices=plan.candidate.choices))
    best_rate = (
        edge / device.step_ms(Candidate(batch_size=edge, choices=plan.candidate.choices)) * 1e3
    )
    assert plan.verified is not None and plan.verified.samples_per_s >= 0.97 * best_rate


def test_progress_says_which_candidate_the_plan_waits_on(
    workload, profile, strategies, linear_device, trials, caplog
) -> None:
    """Each compiled run's progress line names the candidate (its number of all, its
    checkpointed blocks) and its batch, as it starts; then the confirmation's."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    with caplog.at_level(logging.DEBUG, logger="memadvisor"):
        plan = _plan(workload, profile, strategies, device)
    lines = [r.getMessage() for r in caplog.records]
    waiting = [
        m for m in lines if re.fullmatch(r"compiling candidate \d/4 \(.*\): batch \d+ running", m)
    ]
    first = next(p for p in _compile_runs(plan))
    blocks = _blocks(first.candidate.choices)
    assert waiting[0] == (
        f"compiling candidate 1/4 (checkpoint {blocks}/4 blocks): batch {first.batch_size} running"
    )
    assert {m.split(" (")[0] for m in waiting} >= {f"compiling candidate {i}/4" for i in (1, 2, 3)}
    assert any(m.startswith("compile: confirming checkpoint 4/4 blocks from batch") for m in lines)


def _stage(workload, profile, strategies, linear_device, eager=EAGER_FLAT, budget_bytes=None):
    """(device, space, prober, the compile stage's PickStage) over a device with ``eager``'s
    MiB a sample (EAGER_FLAT's), the plan and the card under ``budget_bytes`` (100 MiB)."""
    device = linear_device(eager)
    budget = {} if budget_bytes is None else {"budget_bytes": budget_bytes}
    if budget_bytes is not None:
        device.budget_bytes = budget_bytes
    space = SearchSpace(profile, [*strategies, Compile()], _config(**budget))
    prober = Prober(device, workload, space, space.config)
    return device, space, prober, ProberStage(prober, "compile", Progress(enabled=False))


BF16 = {"precision": "bf16"}


def _bf16_stage(workload, profile, strategies, linear_device, mib_per_sample: float):
    """(device, prober, the compile stage's PickStage, the largest batch that fits, (fixed
    bytes, bytes a sample)) for bf16 without checkpointing at ``mib_per_sample`` MiB a sample
    (fp32 twice that) under a 1000 MiB budget: the device's line, known by construction."""
    device, _, prober, stage = _stage(
        workload, profile, strategies, linear_device,
        eager={("bf16", 0): mib_per_sample, ("fp32", 0): 2 * mib_per_sample},
        budget_bytes=1000 * MIB,
    )  # fmt: skip
    one = Candidate(batch_size=1, choices=BF16)
    return device, prober, stage, device.edge(one), device.line(one)


def test_a_bounded_batch_search_answers_from_its_runs(
    workload, profile, strategies, linear_device
) -> None:
    """PickStage.confirm with max_runs: the search stops when its runs are spent and answers
    with the largest batch that fitted within the limit, below every failure."""
    device, space, prober, stage = _stage(workload, profile, strategies, linear_device)
    choices = {"precision": "bf16"}
    edge = device.edge(Candidate(batch_size=1, choices=choices))
    assert stage.run(choices, 10) is not None  # a run before the search: it answers for free
    found = stage.confirm(choices, edge + 5, max_runs=1)
    assert len(prober.probes) == 2 and not prober.probes[-1].fits
    assert found is not None and found.candidate.batch_size == 10
    assert prober.runs_left is None  # the bound ends with the search


def test_a_bounded_batch_search_answers_from_runs_as_long_as_the_stages_only(
    workload, profile, strategies, linear_device
) -> None:
    """Rule: a search whose runs are spent answers from runs of the stage's own steps: a
    shorter run (CompileSearch.pass_one_steps) fitted, but is no pick's measurement, so with
    only such a run the answer is none, and with a full one below it, that one."""
    device = linear_device(EAGER_FLAT)
    space = SearchSpace(profile, [*strategies, Compile()], _config(probe_steps=6))
    prober = Prober(device, workload, space, space.config)
    stage = ProberStage(prober, "compile", Progress(enabled=False))
    choices = {"precision": "bf16"}
    edge = device.edge(Candidate(batch_size=1, choices=choices))
    (short,) = stage.run_many([(choices, 10)], steps=3)
    assert short is not None and short.steps == 3 < prober.steps == 6
    assert stage.confirm(choices, edge + 5, max_runs=0) is None
    assert stage.run(choices, 8) is not None
    found = stage.confirm(choices, edge + 5, max_runs=0)
    assert found is not None and found.candidate.batch_size == 8
    assert found.measured.steps == prober.steps


def test_a_candidates_line_stays_the_plans_margin_below_its_failure(
    workload, profile, strategies, linear_device
) -> None:
    """The stage's margin below a failure is the prober's (what the planner's batch search
    takes under a batch that ran out), so a compiled candidate's line, and the confirmation
    that starts from it, stay that far below the failure, not one batch under it."""
    device, space, prober, stage = _stage(workload, profile, strategies, linear_device)
    choices = {"precision": "bf16"}
    edge = device.edge(Candidate(batch_size=1, choices=choices))
    assert stage.run(choices, edge // 2) is not None and stage.run(choices, edge + 1) is None
    margin = stage.below_failure(choices, edge + 1)
    assert margin == prober.below(choices, edge + 1) and margin < edge
    # A compiled candidate whose run ran out: its line's batch is the margin below.
    eager = prober.confirm(space.score_choices(choices))
    settings = CompileSearch()
    variants, _ = search_variants(stage, eager, ["default"], settings, lambda c, b: 0.5)
    v, search = variants[0], Search(stage, settings, eager)
    compiled_edge = device.edge(Candidate(batch_size=1, choices=v.choices))
    # Two runs that fit: the line is the device's own; then the card runs out a little
    # below where that line puts the limit (fragmentation the line does not know).
    assert search._run(v, compiled_edge // 3, 1, 1) and search._run(v, compiled_edge // 2, 1, 1)
    assert v.fit is not None
    failed = v.fit.largest_batch - 2
    device.error, device.error_at = torch.OutOfMemoryError("fake: fragmented"), failed
    assert search._run(v, failed, 1, 1) is False
    assert v.fit is not None and v.fit.lowest_failure == failed
    margin = stage.below_failure(v.choices, failed)
    assert margin < failed - 1 and v.fit.largest_batch == margin


def test_a_compiled_confirmation_stops_bisecting_within_the_gain_a_compile_must_make(
    workload, profile, strategies, linear_device
) -> None:
    """Rule: a confirmation asked to stop ``within`` a fraction (the compile search passes
    3%, what a compile must gain) makes no run at a batch that little above its largest fit:
    each compiled run is a compile (the GPT example on a card bisected 294, 272, 261, 255
    down to a fit at 250, all out of memory, 6-8 s each). Bisecting to the sample makes
    more runs and ends no more than 3% higher."""
    answers = {}
    for within in (0.0, 0.03):
        device, prober, stage, edge, _ = _bf16_stage(
            workload, profile, strategies, linear_device, mib_per_sample=2.0
        )
        known = int(0.9 * edge)  # within the pick's limit: the descent's floor
        assert stage.run(BF16, known) is not None
        found = stage.confirm(BF16, edge + 60, within=within)
        assert found is not None
        tried = [p.batch_size for p in prober.probes[1:]]
        answers[within] = (found.candidate.batch_size, tried)
        assert prober.within == 0.0  # the setting ends with the search
    (loose, loose_tried), (sample, sample_tried) = answers[0.03], answers[0.0]
    assert all(b > 1.03 * known for b in loose_tried), (known, loose_tried)
    assert len(loose_tried) < len(sample_tried)
    assert known <= loose <= sample <= 1.03 * loose + 1


def test_a_confirmation_given_a_ceiling_probes_nothing_above_it(
    workload, profile, strategies, linear_device
) -> None:
    """Rule: a confirmation with a ``ceiling`` (the compile search passes a capped line's
    batch) makes no run above it, and none at all where the ceiling is within ``within`` of
    the batch it starts from, known to fit. (The GPT example's capped confirmation on a card
    ran 317, 306 and 279 above its cap at 252, all out of memory, 18 s.) Without one, the
    same search probes above."""
    tried_by = {}
    for ceiling in (None, "start"):
        device, prober, stage, edge, _ = _bf16_stage(
            workload, profile, strategies, linear_device, mib_per_sample=2.0
        )
        start = int(0.9 * edge)
        assert stage.run(BF16, start) is not None
        found = stage.confirm(BF16, start, within=0.03, ceiling=start + 2 if ceiling else None)
        assert found is not None and found.candidate.batch_size >= start
        tried_by[ceiling] = [p.batch_size for p in prober.probes[1:]]
        assert prober.ceiling is None  # the setting ends with the search
    assert tried_by["start"] == [], tried_by
    assert any(b > start + 2 for b in tried_by[None]), tried_by


def _with_largest_allocation(workload, profile, strategies, device_of):
    """(prober, stage, the first compiled candidate of bf16, its Search, the device's edge for
    it) where eager's largest allocation is as large a sample as the candidate's own line:
    the cap it draws falls near half the edge."""
    device, space, prober, stage = _stage(workload, profile, strategies, device_of)
    eager = prober.confirm(space.score_choices(BF16))
    settings = CompileSearch()
    variants, _ = search_variants(stage, eager, ["default"], settings, lambda c, b: 0.5)
    v, search = variants[0], Search(stage, settings, eager)
    compiled_edge = device.edge(Candidate(batch_size=1, choices=v.choices))
    _, per_sample = device.line(Candidate(batch_size=1, choices=v.choices))
    v.eager = dataclasses.replace(v.eager, largest_allocation=Line(0.0, per_sample))
    return prober, stage, v, search, compiled_edge


def test_a_capped_winners_confirmation_probes_nothing_above_its_cap_or_its_largest_run(
    workload, profile, strategies, linear_device
) -> None:
    """Rule: where the winner's line was capped by the largest allocation, the compile search
    gives its confirmation a ceiling: the cap's batch or the largest batch of the winner that
    ran, whichever is larger (that run found the block free). The extrapolation from the
    measured peak, which does not know the block, makes no run above it (the GPT example's
    confirmation on a card from its cap at 252 ran 317, 306 and 279, all out of memory, 18 s;
    its pass-2 runs had fitted at 252 and 256). Between the cap and a larger run the
    confirmation still searches: here the winner's run one under the device's edge held more
    than the pick's limit, and the confirmation finds a batch above the cap below it."""
    prober, stage, v, search, compiled_edge = _with_largest_allocation(
        workload, profile, strategies, linear_device
    )
    ran = compiled_edge - 1  # fits on the device, held past the pick's limit (3% headroom)
    for b in (compiled_edge // 4, ran):
        assert search._run(v, b, 1, 1)
    assert stage.held_bytes(v.runs[ran]) > stage.limit_bytes
    assert v.fit is not None and v.fit.cap_batch is not None and v.fit.cap_batch < ran - 10
    cap = v.fit.cap_batch
    before = len(prober.probes)
    found = search.confirm(v, 0)
    tried = [p.batch_size for p in prober.probes[before:]]
    assert all(b <= ran for b in tried), (cap, ran, tried)
    assert found is not None and cap < found.candidate.batch_size <= ran, (cap, ran, tried)


@pytest.mark.parametrize("reserved_over", [None, 0.02])
def test_where_two_runs_reserved_peaks_bound_a_candidate_the_largest_allocation_caps_it_not(
    workload, profile, strategies, linear_device, reserved_over
) -> None:
    """Rule: a candidate run at two batches that held within the limit, on a device that
    records reserved peaks (a card's), is predicted by its lines and its reserved bound, and
    its confirmation finds a batch above where eager's largest allocation would have capped
    it; on a device without reserved peaks the cap stands and the prediction stops there.
    (hf_gpt2's compiled form without checkpointing on an H200, sessions 38-40: capped at 1020
    where its line said 1323 and its hand cell held 1339.)"""

    def device_of(eager):
        return linear_device(eager, reserved_over=reserved_over)

    _, stage, v, search, compiled_edge = _with_largest_allocation(
        workload, profile, strategies, device_of
    )
    for b in (compiled_edge // 4, compiled_edge // 3):
        assert search._run(v, b, 1, 1)
    assert all(stage.held_bytes(m) <= stage.limit_bytes for m in v.runs.values())
    assert v.fit is not None and v.fit.basis == "fitted"
    if reserved_over is None:
        assert v.fit.cap_batch == v.fit.largest_batch < compiled_edge * 0.6, v.fit
        return
    assert v.fit.cap_batch is None, v.fit
    assert v.fit.largest_batch > compiled_edge * 0.9, (v.fit.largest_batch, compiled_edge)
    found = search.confirm(v, 0)
    assert found is not None and found.candidate.batch_size > compiled_edge * 0.9
    assert found.candidate.batch_size <= compiled_edge


def test_a_confirmation_never_descends_below_a_batch_that_fitted(
    workload, profile, strategies, linear_device
) -> None:
    """The stage's batch search after a failure bisects down to the largest batch of the
    same choices an earlier run fitted (within the limit), not below it."""
    device, space, prober, stage = _stage(workload, profile, strategies, linear_device)
    choices = {"precision": "bf16"}
    edge = device.edge(Candidate(batch_size=1, choices=choices))
    known = edge - 6
    assert stage.run(choices, known) is not None
    found = stage.confirm(choices, edge + 30)
    tried = [p.batch_size for p in prober.probes]
    assert min(tried[1:]) > known, tried
    assert found is not None and known <= found.candidate.batch_size <= edge


def test_a_flat_peak_below_the_edge_keeps_the_line_next_to_its_failure(
    workload, profile, strategies, linear_device
) -> None:
    """Where every run's peak is a fixed phase (the optimizer's update) that the activations
    overtake only near the edge, the runs' slope says nothing of a sample's cost; a failure
    proves the peak climbed the rest of the budget since the largest fit, so the margin below
    it stays a few samples and a confirmation from above bisects down to that fit, not below
    it (lm350m's compiled candidate on a card: 13 fitted at 7.28 GB, 2 at 7.39 GB, 17 ran out
    under 8 GiB, and its confirmation fell to batch 2). A sample costs the device 20 MiB,
    the estimate 2.7: its slope alone puts the headroom (30 MiB) 12 samples down."""
    device, prober, stage, edge, (fixed, per_sample) = _bf16_stage(
        workload, profile, strategies, linear_device, 20.0
    )
    choices = BF16
    device.step_peak_bytes = fixed + per_sample * (edge - 3)
    known = edge - 4
    small, large = stage.run(choices, 2), stage.run(choices, known)
    assert small is not None and large is not None and small.peak_bytes == large.peak_bytes
    assert stage.run(choices, edge + 1) is None
    line = stage.below_failure(choices, edge + 1)
    assert known <= line <= edge, (known, line, edge)
    found = stage.confirm(choices, edge + 1)
    tried = [p.batch_size for p in prober.probes][3:]
    assert all(b > known for b in tried), tried
    assert found is not None and known <= found.candidate.batch_size <= edge


def test_a_samples_bytes_near_the_edge_come_from_every_fit_there_not_two_neighbours(
    workload, profile, strategies, linear_device
) -> None:
    """Two fits a sample apart differ by the allocator's rounding as much as by a sample; the
    slope the margin below a failure reads is fitted through every run near the largest fit
    (the GPT example at 1 GiB on a card: 533, 539, 540 and 543 fitted, and the margin moved
    by tens of samples between neighbours)."""
    device, prober, stage, edge, (_, per_sample) = _bf16_stage(
        workload, profile, strategies, linear_device, 2.0
    )
    choices = BF16
    _, per_sample = device.line(Candidate(batch_size=1, choices=choices))
    real_run = device.run

    def rounded(workload, candidate, steps):  # the allocator rounds the last two to one size
        m = real_run(workload, candidate, steps)
        if candidate.batch_size == edge - 8:
            m = m.model_copy(update={"peak_bytes": m.peak_bytes - per_sample + 512})
        return m

    device.run = rounded
    for b in (edge - 45, edge - 15, edge - 9, edge - 8):
        assert stage.run(choices, b) is not None
    assert prober.sample_bytes(choices, edge) == pytest.approx(per_sample, rel=0.03)


def test_a_fit_far_below_in_a_flat_phase_does_not_flatten_the_slope_near_the_edge(
    workload, profile, strategies, linear_device
) -> None:
    """Where the step's peak is a fixed phase until near the edge, a fit far below the rest
    says nothing of a sample's cost there: the slope comes from the fits near the largest."""
    device, prober, stage, edge, (fixed, per_sample) = _bf16_stage(
        workload, profile, strategies, linear_device, 20.0
    )
    choices = BF16
    device.step_peak_bytes = fixed + per_sample * (edge - 4)
    for b in (2, edge - 3, edge - 1):
        assert stage.run(choices, b) is not None
    assert prober.sample_bytes(choices, edge) == pytest.approx(per_sample, rel=0.01)


def test_two_fits_far_apart_across_a_flat_phase_do_not_put_the_margin_below_every_fit(
    workload, profile, strategies, linear_device
) -> None:
    """Where the two fits a slope comes from lie far apart (none other within the window of
    the largest), the smaller in the step's fixed phase and the larger just past it, their
    slope is low; the climb the failure proves bounds it from below, so a search whose runs
    are spent answers with the largest fit, not with nothing (lm350m's compiled candidate on
    a card: 14 and 16 fitted, 19 ran out, and the plan kept eager at half the compiled
    rate: its margin of 3% of the budget at the two fits' slope reached below 14)."""
    device, prober, stage, edge, (fixed, per_sample) = _bf16_stage(
        workload, profile, strategies, linear_device, 40.0
    )
    choices = BF16
    small, large = edge - 7, edge - 3
    assert small < large * 0.9  # the window around the largest fit holds only it
    device.step_peak_bytes = fixed + round(per_sample * (large - 0.1))
    runs = [stage.run(choices, small), stage.run(choices, large)]
    assert all(r is not None for r in runs)
    assert 0 < runs[1].peak_bytes - runs[0].peak_bytes < per_sample / 5  # the low slope
    assert stage.run(choices, edge + 1) is None
    assert small < stage.below_failure(choices, edge + 1) <= edge
    found = stage.confirm(choices, edge + 1, max_runs=0)
    assert found is not None and found.candidate.batch_size == large


def test_fits_near_each_other_in_a_flat_phase_far_below_the_failure_keep_the_margin_above_them(
    workload, profile, strategies, linear_device
) -> None:
    """Where the fits near the largest grow by the allocator's rounding only (a flat phase:
    the step's peak its fixed bytes) and the failure lies beyond the slope's window above
    them, their slope says nothing of the way to the failure: the climb the failure proves
    bounds it from below, so the margin below the failure stays above the fits and a search
    whose runs are spent answers with the largest fit. lm350m's CUDA graphs on an H200
    (session 43 call C): 10 and 11 held at 7.016 and 7.020 GB, 17 ran out; the 4 MB slope
    put the margin 62 samples below 17 and the graphs search ran batch 1."""
    device, prober, stage, edge, (fixed, per_sample) = _bf16_stage(
        workload, profile, strategies, linear_device, 40.0
    )
    choices = BF16
    low, high = edge - 9, edge - 8
    assert high < (edge + 1) * 0.9  # the failure lies beyond the fits' window
    device.step_peak_bytes = fixed + per_sample * (edge - 2)  # both fits in the flat phase
    real_run = device.run

    def rounded(workload, candidate, steps):  # the allocator rounds the larger a block up
        m = real_run(workload, candidate, steps)
        if candidate.batch_size == high:
            m = m.model_copy(update={"peak_bytes": m.peak_bytes + 4 * 2**20 // 1000})
        return m

    device.run = rounded
    runs = [stage.run(choices, low), stage.run(choices, high)]
    assert all(r is not None for r in runs)
    assert 0 < runs[1].peak_bytes - runs[0].peak_bytes < per_sample / 100  # rounding only
    assert stage.run(choices, edge + 1) is None
    assert high <= stage.below_failure(choices, edge + 1) <= edge
    found = stage.confirm(choices, edge + 1, max_runs=0)
    assert found is not None and found.candidate.batch_size == high


def test_a_winner_whose_confirmation_found_nothing_is_not_called_a_loss(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Where the best compiled configuration by its line is faster than eager but its
    confirmation found no batch, the plan stays eager and says so: the sentence names the
    confirmation, not "compiling did not pay" beside a prediction of twice eager's rate."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    monkeypatch.setattr(Search, "confirm", lambda self, winner, hold_back, **_: None)
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    assert not stage.picked and plan.candidate == stage.eager_candidate
    assert "did not pay" not in stage.summary, stage.summary
    assert stage.summary.startswith("Planned eager because no compiled configuration was")
    assert "confirmation found no batch" in stage.summary


def test_a_compiled_pick_slower_than_eager_in_its_verifying_run_is_not_handed_on(
    workload, profile, strategies, linear_device, trials
) -> None:
    """The compile stage searches with a dynamic batch; its winner's static form, run in the
    stage as the pick's verification, measured slower than the eager pick: the plan hands on
    the eager pick with its own measured run, and the stage says why, naming both forms'
    rates (the GPT example on a card beside another plan: compiled searched at 1.04x eager,
    verified at 0.82x)."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    real_run = device.run

    def slow_static(workload, candidate, steps):
        m = real_run(workload, candidate, steps)
        form = candidate.choices.get("compile")
        if isinstance(form, dict) and not form.get("dynamic_batch"):
            step_ms = m.step_ms * 10
            m = m.model_copy(
                update={"step_ms": step_ms, "samples_per_s": candidate.batch_size / step_ms * 1e3}
            )
        return m

    device.run = slow_static
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    assert "compile" not in plan.candidate.choices and plan.candidate == stage.eager_candidate
    assert not stage.picked and stage.one_off_ms is None
    assert plan.verified.samples_per_s == pytest.approx(stage.eager_samples_per_s)
    forms = [p.candidate.choices.get("compile") for p in plan.probes]
    statics = [f for f in forms if isinstance(f, dict) and not f.get("dynamic_batch")]
    assert statics, "the compiled pick's verifying run happened"
    assert "Planned eager because compiling did not pay" in stage.summary
    assert "That is its static form" in stage.summary and "searched with a dynamic" in stage.summary
    assert stage.summary in plan.notes


def test_whether_compiling_pays_is_judged_on_the_static_form_which_is_the_verification(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: the search measures a dynamic batch, but the user runs the static graph, which
    on a card ran faster (lm350m 103.4 against 111.3 samples/s; the GPT example 0.98x eager
    dynamic, 1.09x static). Here the dynamic form runs at 0.85 of the static one, below the
    3% a compile must gain, and the static form above it: the winner's static form is run
    once at its confirmed batch, the plan picks compile on that run's rate, and that run is
    the pick's verification (no verify run of its own)."""
    device = linear_device(EAGER_FLAT, fixed_ms=0.01, speedup=1.2 / 0.95)
    real_run = device.run

    def dynamic_slower(workload, candidate, steps):
        m = real_run(workload, candidate, steps)
        form = candidate.choices.get("compile")
        if isinstance(form, dict) and form.get("dynamic_batch"):
            step_ms = m.step_ms / 0.85
            m = m.model_copy(
                update={"step_ms": step_ms, "samples_per_s": candidate.batch_size / step_ms * 1e3}
            )
        return m

    device.run = dynamic_slower
    # A run takes the verifying steps, as on a card (runs_cost_more_than_steps).
    plan = _plan(workload, profile, strategies, device, verify_steps=2)
    stage = plan.stages[0]
    assert stage.picked, stage.summary
    statics = [p for p in plan.probes if _static_form(p)]
    assert len(statics) == 1 and statics[0].stage == "compile"
    assert plan.candidate == statics[0].candidate
    assert plan.verified.peak_bytes == statics[0].peak_bytes
    (confirmed,) = [v for v in stage.variants if v.confirmed]
    assert confirmed.measured == plan.verified  # the stage judged the run that verifies
    assert not [p for p in plan.probes if p.stage == "verify"]
    assert plan.verified.samples_per_s >= 1.03 * stage.eager_samples_per_s
    assert "That is its static form" in stage.summary
    assert stage.details["search"]["static_runs"] == 1


def test_a_winner_whose_every_run_compiles_is_confirmed_in_its_static_form(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: where every run of the winner compiled afresh (the cache would not take its
    checkpointed graphs: torch 2.11 on a card), its dynamic batch saves nothing, so its
    confirmation runs the static form, the one handed on, from its predicted batch, its
    searched runs bounding the descent; that confirmation's run is the pick's verification,
    and no static run follows it (lm350m on an H100: a 15.8 s run at the batch the
    confirmation had just run). The pick is the two-form plan's configuration."""
    config = {"verify_steps": 2}  # a run takes the verifying steps, as on a card

    def plan_on(uncached: bool):
        device = linear_device(
            EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0,
            uncached_checkpointed=uncached,
        )  # fmt: skip
        return _plan(workload, profile, strategies, device, **config)

    two_forms, direct = plan_on(False), plan_on(True)
    stage = direct.stages[0]
    assert stage.picked and _blocks(direct.candidate.choices) > 0, stage.summary
    # The same configuration; its batch within the 3% the confirmation stops bisecting at
    # (the margin's slope reads the static form's own runs).
    assert direct.candidate.choices == two_forms.candidate.choices
    assert abs(direct.candidate.batch_size / two_forms.candidate.batch_size - 1) <= 0.03
    statics = [p for p in direct.probes if _static_form(p)]
    assert statics and all(p.stage == "compile" for p in statics)
    assert direct.candidate in [p.candidate for p in statics if p.fits]
    confirm_from = len(direct.probes) - len(statics)
    assert all(_static_form(p) for p in direct.probes[confirm_from:])  # the confirmation's
    assert not [p for p in direct.probes if p.stage == "verify"]
    assert stage.details["search"]["static_runs"] == 0
    assert "That is its static form" not in stage.summary
    assert len(direct.probes) < len(two_forms.probes)


def _concurrent(device, runs_at_once: int, record, compiled_only: bool = True) -> list[list[int]]:
    """``device`` made to run ``runs_at_once`` runs at once (its capabilities say so; its
    run_many the base class's, one after another); returns the batches of each run_many
    call, filled as the plan calls it (``record``: the record_run_many fixture), only the
    compile search's calls unless ``compiled_only`` is False (the eager timing runs go at
    once too)."""
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": runs_at_once})
    return record(device, compiled_only)


@pytest.mark.parametrize("max_runs", [3, 8, 12])
def test_runs_at_once_measure_the_same_candidates_as_one_at_a_time(
    workload, profile, strategies, linear_device, trials, record_run_many, max_runs: int
) -> None:
    """Where the device makes several runs at once (a card with room for several budgets),
    the compile search's passes go to it in groups: every candidate's first run in one group
    (their compiles overlap on a card: 4 runs of 9-19 s each took 59 s one after another for
    lm350m), within the same run budget, and the plan picks what it picks one at a time."""
    alone = _plan(
        workload,
        profile,
        strategies,
        linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0),
        CompileSearch(max_runs=max_runs),
    )
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    groups = _concurrent(device, 4, record_run_many)
    together = _plan(workload, profile, strategies, device, CompileSearch(max_runs=max_runs))
    assert together.candidate == alone.candidate
    assert together.verified == alone.verified
    runs = _compile_runs(together)
    assert len(runs) <= max_runs
    # The same runs, fewer waits: every candidate's first run went to the device at once.
    key = lambda p: (p.batch_size, json.dumps(p.candidate.choices, sort_keys=True))  # noqa: E731
    assert sorted(map(key, runs)) == sorted(map(key, _compile_runs(alone)))
    if max_runs - CONFIRM_RUNS < 2:  # one candidate's run before the confirmation's
        # Only the confirmation's probe that may run out, with the batch taken if it does.
        assert all(len(g) == 2 for g in groups)
    else:
        assert len(groups[0]) == min(4, max_runs - CONFIRM_RUNS)
        assert len(groups) < len(runs)


def test_the_first_timing_runs_go_to_the_device_at_once_and_pick_what_one_at_a_time_picks(
    workload, profile, strategies, linear_device, trials, record_run_many
) -> None:
    """Rule: where the device makes runs at once and its times rank (a card), every timed
    candidate's first run at its estimated batch is asked together (independent runs: on an
    H100 lm350m's four took 8.4 s one after another, the GPT example's six 24 s); the plan
    makes the same timing runs and picks what it picks one at a time."""
    alone = _plan(
        workload, profile, strategies,
        linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0),
    )  # fmt: skip
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    groups = _concurrent(device, 4, record_run_many, compiled_only=False)
    together = _plan(workload, profile, strategies, device)
    assert together.candidate == alone.candidate and together.verified == alone.verified

    def timing(plan):
        return [(p.batch_size, p.fits, str(p.candidate.choices)) for p in plan.probes
                if p.stage == "timing"]  # fmt: skip

    assert timing(together) == timing(alone) and len(timing(alone)) >= 2
    assert groups[0] == [b for b, _, _ in timing(alone)]


def _budget_form_runs_out_first(device) -> dict[str, int]:
    """``device`` made to run the partitioner-budget candidate out of memory at the first
    batch it is run at (kept as ``starts["budget"]`` in the dict returned) and nowhere else."""
    real_run, starts = device.run, {}

    def budget_form_runs_out_first(workload, candidate, steps):
        form = candidate.choices.get("compile")
        if isinstance(form, dict) and form.get("activation_memory_budget") is not None:
            first = starts.setdefault("budget", candidate.batch_size)
            if candidate.batch_size == first:
                raise torch.OutOfMemoryError("fake: the budget form ran out at its start")
        return real_run(workload, candidate, steps)

    device.run = budget_form_runs_out_first
    return starts


@pytest.mark.parametrize("in_process", [True, False])
def test_where_the_retry_in_its_own_process_runs_out_too_pass_two_retries_below_it(
    workload, profile, strategies, linear_device, trials, record_run_many, in_process: bool
) -> None:
    """Rule: a pass-1 run retried at half its batch that runs out there too records both
    batches as run out, and pass 2's retry goes below the half, not to it: that batch had
    its answer, and a retry in pass 2 is a process and a compile of its own (session 20's
    review). The retry's record is not counted among the search's runs where it ran in the
    first's process (a card's fork server), and is where it was a run of its own (the
    default ``Device.run_many_retrying``, a fork server that fell back)."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    _concurrent(device, 4, record_run_many)
    device.capabilities = device.capabilities.model_copy(update={"retries_in_process": True})
    real_run, starts = device.run, {}

    def budget_form_runs_out_above_a_quarter(workload, candidate, steps):
        form = candidate.choices.get("compile")
        if isinstance(form, dict) and form.get("activation_memory_budget") is not None:
            first = starts.setdefault("budget", candidate.batch_size)
            if candidate.batch_size > first // 4:
                raise torch.OutOfMemoryError("fake: the budget form ran out")
        return real_run(workload, candidate, steps)

    device.run = budget_form_runs_out_above_a_quarter
    real_retrying = device.run_many_retrying

    def retrying(workload, runs):
        answers = real_retrying(workload, runs)
        for a in answers:  # as a card's child answers: the retry in its own process
            if in_process and hasattr(a, "memadvisor_retry_ran_out"):
                a.memadvisor_retry_same_process = True
        return answers

    device.run_many_retrying = retrying
    plan = _plan(workload, profile, strategies, device, CompileSearch(max_runs=12))
    first = starts["budget"]
    budget_runs = [
        (p.batch_size, p.fits)
        for p in plan.probes
        if isinstance(p.candidate.choices.get("compile"), dict)
        and p.candidate.choices["compile"].get("activation_memory_budget") is not None
    ]
    assert budget_runs[:2] == [(first, False), (first // 2, False)], budget_runs
    assert (first // 4, True) in budget_runs, budget_runs
    assert budget_runs.count((first // 2, False)) == 1, budget_runs  # not retried again
    search = plan.stages[0].details["search"]
    free = 1 if in_process else 0
    assert search["runs"] == len(_compile_runs(plan)) - free, search


def test_a_retry_at_half_the_batch_goes_with_the_second_pass_runs_at_once(
    workload, profile, strategies, linear_device, trials, record_run_many
) -> None:
    """A candidate whose only run ran out gets its retry at half the batch in the same group
    as the second pass's runs, not a group of its own after them (lm350m on a card: the
    partitioner-budget candidate ran out at 14, its retry at 7 waited for the winner's second
    run, 8.7 s after 12.3 s)."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    groups = _concurrent(device, 4, record_run_many)
    starts = _budget_form_runs_out_first(device)
    _plan(workload, profile, strategies, device, CompileSearch(max_runs=12))  # room for it
    assert "budget" in starts and len(groups) >= 2, groups
    retry = starts["budget"] // 2
    second = groups[1]
    assert retry in second and len(second) >= 2, groups


def test_a_candidates_eager_lines_carry_the_estimates_largest_allocation(
    profile, strategies
) -> None:
    """Rule: the eager lines a candidate's compiled line is scaled from carry the estimate's
    largest allocation (reserved peak less peak) at the two batches they are taken at, where
    the profile measured the step's largest allocation (a card's); None where it did not."""
    from memadvisor.estimate import estimate
    from memadvisor.schema.profile import LinearBytes
    from strategies._compile_model import EagerLines

    choices = {"precision": "bf16"}
    assert EagerLines.of(profile, choices, strategies, 10).largest_allocation is None
    step = profile.steps["bf16"].model_copy(
        update={"largest_allocation": LinearBytes(per_sample_bytes=0.3 * MIB)}
    )
    carded = profile.model_copy(update={"steps": {**profile.steps, "bf16": step}})
    lines = EagerLines.of(carded, choices, strategies, 10)
    assert lines.largest_allocation is not None
    for b in (10, 20):
        e = estimate(carded, Candidate(batch_size=b, choices=choices), strategies)
        assert e.reserved_peak_bytes is not None and e.reserved_peak_bytes > e.peak_bytes
        want = e.reserved_peak_bytes - e.peak_bytes
        assert lines.largest_allocation.at(b) == pytest.approx(want, abs=1)


def test_a_winner_whose_confirmation_finds_less_than_a_rivals_run_yields_to_the_rival(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: the winner is chosen by its line, and its confirmation may find less than the
    line promised; where what it found measures below another candidate's own run (one that
    fitted within the limit), that candidate is confirmed too and the better one is the pick.
    On a card (lm350m, H100, 8 GiB) a partitioner-budget candidate's one-run line promised
    133.4 samples/s, its confirmation found 118.2, and full checkpointing, which had run
    126.9 at its line's edge, was never confirmed. Here the winner's confirmation is made to
    find 0.8 of the best rate another candidate's runs measured (still a compile's gain over
    eager)."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    real_measure, real_confirm = Search.measure, Search.confirm
    seen: dict = {"confirmed": [], "variants": []}

    def measure(self, variants, meanwhile=None, then=None):
        seen["variants"] = list(variants)
        return real_measure(self, variants, meanwhile, then)

    def short_first(self, winner, hold_back, **kwargs):
        found = real_confirm(self, winner, hold_back, **kwargs)
        seen["confirmed"].append(_blocks(winner.choices))
        if len(seen["confirmed"]) > 1 or found is None:
            return found
        others = [v for v in seen["variants"] if v is not winner]
        seen["rival"] = max(m.samples_per_s for v in others for m in v.runs.values())
        short = found.measured.model_copy(update={"samples_per_s": 0.8 * seen["rival"]})
        return dataclasses.replace(found, measured=short)

    monkeypatch.setattr(Search, "measure", measure)
    monkeypatch.setattr(Search, "confirm", short_first)
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    assert stage.picked, stage.summary
    first, *rest = seen["confirmed"]
    assert rest and rest[0] != first, seen["confirmed"]
    assert _blocks(plan.candidate.choices) == rest[0]
    assert 0.8 * seen["rival"] >= 1.03 * stage.eager_samples_per_s  # the short one beat eager
    assert plan.verified.samples_per_s >= 0.97 * seen["rival"]


def _trial_beside_pass_one(device, monkeypatch) -> list[bool]:
    """``device`` made to run 4 at once, its pass-1 runs waiting for the trial to start and
    the trial for them to reach the device (in turn, neither would come); returns, per
    trial, whether pass 1's runs had reached the device (filled as the plan runs)."""
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": 4})
    trial_started, pass_one_started = threading.Event(), threading.Event()
    real_many, real_trial = device.run_many, Compile.trial

    def run_many(workload, runs):
        if all("compile" in c.choices for c, _ in runs) and not pass_one_started.is_set():
            pass_one_started.set()
            assert trial_started.wait(5), "pass 1 reached the device; the trial never started"
        return real_many(workload, runs)

    waited: list[bool] = []

    def trial(self, *args, **kwargs):
        trial_started.set()
        waited.append(pass_one_started.wait(5))
        return real_trial(self, *args, **kwargs)

    device.run_many = run_many
    monkeypatch.setattr(Compile, "trial", trial)
    return waited


def test_the_device_is_told_its_host_is_busy_while_the_trial_compiles_beside_its_runs(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: while the compile trial runs in the planner's process beside pass 1's runs, the
    device's ``host_busy`` is held (a card's runs wait for it before their timed steps: the
    trial's compile takes the host's cores, as a sibling's compile would), and it is let go
    once the trial ends, before the runs are waited
    for: here, as on a card, the runs end only once it is free (a first form held it while
    it waited for them, and the plans on the card hung until killed)."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    _trial_beside_pass_one(device, monkeypatch)
    busy = threading.Event()
    during_trial: list[bool] = []
    outside: list[bool] = []

    @contextlib.contextmanager
    def host_busy():
        busy.set()
        try:
            yield
        finally:
            busy.clear()

    device.host_busy = host_busy
    real_trial, real_many = Compile.trial, device.run_many

    def trial(self, *args, **kwargs):
        during_trial.append(busy.is_set())
        return real_trial(self, *args, **kwargs)

    def run_many(workload, runs):
        answers = real_many(workload, runs)
        for _ in range(500):  # their timed steps wait for the host, as a card's runs do
            if not busy.is_set():
                break
            time.sleep(0.01)
        outside.append(busy.is_set())
        return answers

    monkeypatch.setattr(Compile, "trial", trial)
    device.run_many = run_many
    plan = _plan(workload, profile, strategies, device)
    assert plan.stages[0].picked, plan.stages[0].summary
    assert during_trial and all(during_trial), during_trial
    assert outside and not any(outside), outside  # every run saw the host free in the end


def test_the_trial_compiles_while_the_first_runs_are_on_a_device_of_processes(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: where the device makes its runs in processes of their own (several at once: a
    card's fork server), the compile trial in the planner's process runs while the
    candidates' first runs are on the device, not before them (lm350m on an H100: a 23 s
    trial, then a 28 s pass whose runs compiled anyway)."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    waited = _trial_beside_pass_one(device, monkeypatch)
    plan = _plan(workload, profile, strategies, device)
    assert waited and all(waited), "the trial ran before pass 1's runs reached the device"
    assert plan.stages[0].picked, plan.stages[0].summary
    assert _blocks(plan.candidate.choices) == BLOCKS


def test_the_progress_line_says_the_trial_and_the_runs_beside_it_both(
    workload, profile, strategies, linear_device, trials, monkeypatch, caplog
) -> None:
    """Rule: while the trial compiles in the planner's process beside pass 1's runs, the
    progress line says both, the trial's words first, and the runs' batches are said after
    their own words, not the trial's (swin_t on a card: the trial's line stood alone for
    200 s, the runs beside it unsaid)."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    waited = _trial_beside_pass_one(device, monkeypatch)
    with caplog.at_level(logging.DEBUG, logger="memadvisor"):
        _plan(workload, profile, strategies, device)
    assert waited and all(waited)
    lines = [r.getMessage() for r in caplog.records]
    trial_then_runs = r"compile: compiling .* in this process \(a trial at batch \d+\); beside it, "
    both = [m for m in lines if re.match(trial_then_runs, m) and "at once" in m]
    assert both, lines
    assert not [m for m in lines if re.search(r"\(a trial at batch \d+\): batch", m)], lines


def test_a_candidate_whose_form_fails_its_trial_is_dropped_though_its_run_fitted(
    workload, profile, strategies, linear_device, monkeypatch
) -> None:
    """Rule: the trial decides whether a form may be searched, even where its candidates'
    first runs went to the device beside it: a form that does not compile (here every form:
    "no graph") leaves the plan eager, whatever those runs measured."""

    def no_graph(workload, choice, *, candidate=None, device=None, **kwargs) -> CompileResult:
        return trial_result(choice, candidate, ok=False, error="dynamo captured no graph")

    monkeypatch.setattr("strategies.compile.try_compile", no_graph)
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": 4})
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    assert [p for p in plan.probes if p.stage == "compile"], "pass 1 ran beside the trial"
    assert not stage.picked and "compile" not in plan.candidate.choices
    assert all(v.batch_size is None and not v.confirmed for v in stage.variants)


@pytest.mark.parametrize("static_compiles", [True, False])
def test_a_dynamic_form_that_fails_is_trialled_static_beside_its_static_runs(
    workload, profile, strategies, linear_device, monkeypatch, static_compiles: bool
) -> None:
    """Rule: on a device of processes, where the dynamic form fails its trial (t5_base's
    checkpointed blocks on a card: an assertion in the partitioner), its candidates' first
    runs are made again static while the static form's trial compiles here, not after it
    (swin_t's static trial took 116 s on a card); where the static form fails too, its
    candidates are dropped whatever their runs measured and the plan stays eager."""
    static_runs_started = threading.Event()
    order: list[str] = []

    def stand_in(workload, choice, *, candidate=None, device=None, **kwargs) -> CompileResult:
        dynamic = parse_choice(choice).dynamic_batch
        if not dynamic:
            order.append("static trial")
            assert static_runs_started.wait(5), "the static trial ran before its runs"
        if not dynamic and static_compiles:
            return trial_result(choice, candidate)
        error = "AssertionError: Node add_373 was invalid, but is output"
        return trial_result(choice, candidate, ok=False, error=error)

    monkeypatch.setattr("strategies.compile.try_compile", stand_in)
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": 4})
    real_many = device.run_many

    def run_many(workload, runs):
        forms = [c.choices.get("compile") for c, _ in runs]
        if forms and all(isinstance(f, dict) and not f.get("dynamic_batch") for f in forms):
            order.append("static runs")
            static_runs_started.set()
        return real_many(workload, runs)

    device.run_many = run_many
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    assert order[:2] == ["static runs", "static trial"], order
    searched = [p.candidate.choices["compile"] for p in _compile_runs(plan)]
    assert any(f.get("dynamic_batch") for f in searched)  # pass 1 went before the verdict
    # The first runs made again static are the search's; the dynamic ones it could not use
    # are not: every candidate got its static first run within the default budget.
    statics = [p for p in plan.probes if p.stage == "compile" and _static_form(p)]
    assert len(statics) >= len(stage.variants), [p.candidate.choices for p in statics]
    if static_compiles:
        assert stage.picked and plan.candidate.choices["compile"] == REGIONAL, stage.summary
        assert any("Searched with a static batch" in v.trial for v in stage.variants)
    else:
        assert not stage.picked and "compile" not in plan.candidate.choices
        assert all(v.batch_size is None for v in stage.variants)


def test_a_ctrl_c_during_the_trial_beside_pass_1_is_not_held_until_the_runs_end(
    workload, profile, strategies, linear_device, monkeypatch
) -> None:
    """Rule: where the trial runs beside pass 1's runs (a card), an interrupt during the trial
    reaches the user at once, not after the runs on the device end (tens of seconds on a
    card): here the runs wait up to 10 s for a release that comes only after the interrupt
    was seen."""
    release = threading.Event()

    def interrupted(workload, choice, *, candidate=None, device=None, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("strategies.compile.try_compile", interrupted)
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": 4})
    real_many = device.run_many

    def slow_many(workload, runs):
        if all("compile" in c.choices for c, _ in runs):
            release.wait(10)
        return real_many(workload, runs)

    device.run_many = slow_many
    started = time.perf_counter()
    try:
        with pytest.raises(KeyboardInterrupt):
            _plan(workload, profile, strategies, device)
        assert time.perf_counter() - started < 5
    finally:
        release.set()


def _forms_at_once(device) -> list[list[tuple[int, bool]]]:
    """``device``'s run_many made to note each call's runs as (batch, static form?)."""
    calls: list[list[tuple[int, bool]]] = []
    real = device.run_many

    def recorded(workload, runs):
        form = lambda c: c.choices.get("compile")  # noqa: E731
        calls.append(
            [
                (c.batch_size, isinstance(form(c), dict) and not form(c).get("dynamic_batch"))
                for c, _ in runs
            ]
        )
        return real(workload, runs)

    device.run_many = recorded
    return calls


def test_the_static_form_goes_with_the_confirmations_first_run_on_a_device_of_runs_at_once(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: where the device makes runs at once, the winner's static form (the pick's
    verification) runs at its predicted batch together with its confirmation's first device
    run, not after the confirmation: where the confirmation keeps that batch, no static run
    follows, and the plan picks and verifies what one run at a time does (swin_t on an
    H100: a confirmation run of 19.8 s, then the static form's 58.4 s, one after the other).
    It is counted as the static run, not one of the search's."""

    def device_of(at_once: int):
        device = linear_device(EAGER_FLAT, fixed_ms=0.01, speedup=1.2 / 0.95)
        if at_once > 1:
            device.capabilities = device.capabilities.model_copy(
                update={"concurrent_runs": at_once}
            )
        return device

    # Pass 2's rider off (its own test): on this device the leader's line moves it from its
    # pass-2 batch to the confirmation's, which then takes the static run along.
    monkeypatch.setattr(Search, "_static_riders", lambda self, ranked, runs, reserve: [])
    alone = _plan(workload, profile, strategies, device_of(1), verify_steps=2)
    device = device_of(4)
    calls = _forms_at_once(device)
    together = _plan(workload, profile, strategies, device, verify_steps=2)
    assert together.stages[0].picked and alone.stages[0].picked
    assert together.candidate == alone.candidate
    assert together.verified == alone.verified
    statics = [p for p in together.probes if _static_form(p)]
    assert len(statics) == 1 and together.candidate == statics[0].candidate
    beside = [call for call in calls if any(static for _, static in call)]
    assert len(beside) == 1 and len(beside[0]) >= 2, calls
    # With the confirmation's first run (its predicted batch), and its runs went on after it
    # (one at a time, the static run is the last of all).
    assert beside[0][-1][1] and beside[0][0] == (statics[0].batch_size, False)
    assert _static_form(alone.probes[-1]) and not _static_form(together.probes[-1])
    assert together.stages[0].details["search"]["static_runs"] == 1
    assert _compile_runs(together) and len(_compile_runs(together)) == len(_compile_runs(alone))


def test_a_static_run_made_beside_a_confirmation_that_then_moved_is_counted_and_run_again(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: where the confirmation ends at another batch than the one its static form ran
    beside it, the static form runs again at the batch found (the pick's verification is
    that run), and both static runs are counted as static runs, not as the search's: the
    search's runs are those of one run at a time."""
    real_confirm = Search.confirm

    def moved(self, winner, hold_back, static=False, **kwargs):
        found = real_confirm(self, winner, hold_back, static=static, **kwargs)
        if found is None or static:
            return found
        lower = found.candidate.model_copy(update={"batch_size": found.candidate.batch_size - 1})
        return dataclasses.replace(found, candidate=lower)

    monkeypatch.setattr(Search, "confirm", moved)
    # As above: no rider.
    monkeypatch.setattr(Search, "_static_riders", lambda self, ranked, runs, reserve: [])

    def plan_with(at_once: int):
        device = linear_device(EAGER_FLAT, fixed_ms=0.01, speedup=1.2 / 0.95)
        device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": at_once})
        return _plan(workload, profile, strategies, device, verify_steps=2)

    alone, together = plan_with(1), plan_with(4)
    search = together.stages[0].details["search"]
    assert search["static_runs"] == 2 and alone.stages[0].details["search"]["static_runs"] == 1
    assert search["runs"] == alone.stages[0].details["search"]["runs"]
    statics = [p for p in together.probes if _static_form(p)]
    picked = together.candidate.batch_size
    assert [p.batch_size for p in statics] == [picked + 1, picked]
    assert together.candidate == alone.candidate and together.verified == alone.verified


def test_a_candidate_whose_dynamic_compile_fails_in_the_compiler_is_searched_static(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: the trial passed (no checkpointing), but a checkpointed candidate's dynamic-batch
    run fails in the compiler (a probe process's BackendCompilerFailed, as hf_gpt2's and
    swin_t's did on a card): that candidate is run again in its static form at the same
    batch and searched so, not dropped; the plan still reaches the best compiled
    configuration (all blocks checkpointed), and the record says why it went static."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    real_run = device.run
    failed: list[int] = []

    def run(workload, candidate, steps):
        form = candidate.choices.get("compile")
        if _blocks(candidate.choices) and isinstance(form, dict) and form.get("dynamic_batch"):
            failed.append(candidate.batch_size)
            raise ProbeProcessError(
                f"A probe process (batch {candidate.batch_size}) failed with "
                "BackendCompilerFailed: backend='inductor' raised:\n"
                "AssertionError: Node add_296 was invalid, but is output",
                raised="BackendCompilerFailed",
            )
        return real_run(workload, candidate, steps)

    device.run = run
    plan = _plan(workload, profile, strategies, device, search=CompileSearch(confirm_offered=True))
    stage = plan.stages[0]
    assert failed, "no checkpointed candidate ran in the dynamic form"
    searched = [v for v in stage.variants if isinstance(v.choices["compile"], dict)]
    checkpointed = [v for v in searched if _blocks(v.choices)]
    assert checkpointed and all(v.error is None for v in checkpointed), [
        v.error for v in checkpointed
    ]
    assert all(not v.choices["compile"].get("dynamic_batch") for v in checkpointed)
    assert all("Node add_296 was invalid" in v.trial for v in checkpointed)
    assert all(v.batch_size for v in checkpointed)
    blocks, _, best_rate = _best_compiled(device)
    assert stage.picked and _blocks(plan.candidate.choices) == blocks == BLOCKS
    assert plan.verified is not None and plan.verified.samples_per_s >= 0.97 * best_rate


def test_a_dynamic_run_failing_otherwise_than_in_the_compiler_drops_the_candidate(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: only the compiler's failure sends a candidate static; any other error of a probe
    process (here a RuntimeError in the step) is the candidate's error, as before."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    real_run = device.run

    def run(workload, candidate, steps):
        if _blocks(candidate.choices) and "compile" in candidate.choices:
            raise ProbeProcessError("A probe process failed with RuntimeError: x", "RuntimeError")
        return real_run(workload, candidate, steps)

    device.run = run
    plan = _plan(workload, profile, strategies, device)
    checkpointed = [v for v in plan.stages[0].variants if _blocks(v.choices)]
    assert checkpointed and all("RuntimeError: x" in (v.error or "") for v in checkpointed)
    assert all(v.choices["compile"].get("dynamic_batch") for v in checkpointed)


def _failing_dynamic_checkpointed(device) -> list[int]:
    """``device``'s dynamic-batch runs of checkpointed choices fail in the compiler, as a
    probe process reports it (hf_gpt2's and swin_t's on an H100, torch 2.11)."""
    real_run, failed = device.run, []

    def run(workload, candidate, steps):
        form = candidate.choices.get("compile")
        if _blocks(candidate.choices) and isinstance(form, dict) and form.get("dynamic_batch"):
            failed.append(candidate.batch_size)
            raise ProbeProcessError(
                "A probe process failed with BackendCompilerFailed: backend='inductor' "
                "raised:\nAssertionError: Node add_296 was invalid, but is output",
                raised="BackendCompilerFailed",
            )
        return real_run(workload, candidate, steps)

    device.run = run
    return failed


def test_where_the_eager_pick_checkpoints_nothing_a_failed_checkpointed_form_is_not_compiled_static(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: the eager pick checkpoints nothing (recompute costs as much as the step), so a
    checkpointed candidate whose dynamic compile fails gets no static compile unless its
    eager estimate promises 0.97 of the eager pick's rate: here none does; each says why,
    and no static run of checkpointed choices is made (each would be a compile of its own:
    swin_t's two took more than 120 s on a card)."""
    device = linear_device(EAGER_FLAT, fixed_ms=0.0, recompute=1.0)
    failed = _failing_dynamic_checkpointed(device)
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    assert _blocks(stage.eager_candidate.choices) == 0
    assert failed
    checkpointed = [v for v in stage.variants if _blocks(v.choices)]
    assert checkpointed and all("not searched static" in (v.error or "") for v in checkpointed)
    static_checkpointed = [
        p for p in plan.probes if p.stage == "compile" and _blocks(p.candidate.choices)
        and _static_form(p)
    ]  # fmt: skip
    assert not static_checkpointed


def test_failed_dynamic_forms_go_static_together_on_a_device_of_runs_at_once(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: on a device of runs at once, the checkpointed candidates whose dynamic compile
    failed in one group are made static in one group too (hf_gpt2's two went one after
    the other on a card: 31 s then 25 s)."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": 4})
    failed = _failing_dynamic_checkpointed(device)
    real_many, groups = device.run_many, []

    def run_many(workload, runs):
        groups.append([c.choices for c, _ in runs])
        return real_many(workload, runs)

    device.run_many = run_many
    plan = _plan(workload, profile, strategies, device)
    assert len(failed) >= 2
    static_groups = [
        g for g in groups
        if len(g) >= 2 and all(_blocks(c) and not c["compile"].get("dynamic_batch") for c in g
                               if isinstance(c.get("compile"), dict))
        and all(isinstance(c.get("compile"), dict) for c in g)
    ]  # fmt: skip
    assert static_groups, groups
    assert plan.stages[0].picked and _blocks(plan.candidate.choices) == BLOCKS


def _plan_where_eager_keeps_fp32(workload, profile, strategies, linear_device) -> Plan:
    """A plan where bf16 is an autocast and eager's bf16 steps take 3x fp32's (its casts cost
    more than they save), so the eager pick keeps fp32; compiled, the casts are free."""
    precision = next(s for s in strategies if s.name == "precision")
    precision.facts = lambda c: Facts(autocast="bf16") if c == "bf16" else Facts()
    device = linear_device(EAGER_FLAT, fixed_ms=3.0)
    step_ms = device.step_ms

    def slow_eager_bf16(candidate):
        ms = step_ms(candidate)
        eager_bf16 = device.compiled(candidate) is None and device.key(candidate)[0] == "bf16"
        return 3.0 * ms if eager_bf16 else ms

    device.step_ms = slow_eager_bf16
    return _plan(workload, profile, strategies, device)


def test_where_eager_keeps_fp32_the_search_compiles_the_autocast_precision_too(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: eager, bf16's casts cost more than they save (its steps 3x fp32's here), so
    the eager pick is fp32; compiled, the casts fuse away and bf16's halved bytes hold a
    larger batch. The search compiles the eager pick's choices in bf16 too, and picks it
    (hf_gpt2 on an H100: eager tf32 624 at 23,473/s; compiled tf32 52,706/s; bf16
    compiled held 1,339 at 90,619/s with a dynamic batch, never searched: session 17)."""
    plan = _plan_where_eager_keeps_fp32(workload, profile, strategies, linear_device)
    stage = plan.stages[0]
    assert stage.eager_candidate.choices.get("precision", "fp32") == "fp32"
    lowered = [v for v in stage.variants if v.choices.get("precision") == "bf16"]
    assert lowered and lowered[0].batch_size, [v.choices for v in stage.variants]
    assert stage.picked and plan.candidate.choices.get("precision") == "bf16"
    # The sentence says the precision moved, and the candidate's label which one it tried.
    assert "(in bf16; the eager pick trains without autocast)" in stage.summary
    assert "no checkpointing, bf16" in stage.summary


def test_where_the_autocast_candidate_is_searched_the_checkpointing_axis_varies_it(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: where the eager pick keeps fp32 and the search compiles the autocast precision
    too, the candidates that vary the checkpointing are built on the autocast one, not on
    the eager pick's precision, and their labels say so. On an H100 (session 21) hf_gpt2's
    eager pick came out tf32 in one plan and bf16 in the next (near in eager); the tf32 plan
    searched tf32 with 2 and 4 blocks checkpointed and picked bf16 without checkpointing,
    75,238 samples/s, where the bf16 plan's candidates (bf16, 2 and 4 blocks) found bf16 with
    4 blocks, 92,602 samples/s; compiled, bf16 ran 1.3-1.46x tf32's rate at batch 1020."""
    plan = _plan_where_eager_keeps_fp32(workload, profile, strategies, linear_device)
    stage = plan.stages[0]
    assert stage.eager_candidate.choices.get("precision", "fp32") == "fp32"
    checkpointed = [v for v in stage.variants if _blocks(v.choices)]
    assert checkpointed, [v.choices for v in stage.variants]
    assert all(v.choices.get("precision") == "bf16" for v in checkpointed), [
        v.choices for v in stage.variants
    ]
    # The eager pick's own choices are still searched.
    assert any(v.choices.get("precision", "fp32") == "fp32" for v in stage.variants)
    assert re.search(r"checkpoint \d+/\d+ blocks, bf16", stage.summary), stage.summary


def test_where_the_eager_pick_has_an_autocast_no_other_precision_is_compiled(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: the eager pick in bf16 already: every candidate keeps bf16 (no fp32 one)."""
    precision = next(s for s in strategies if s.name == "precision")
    precision.facts = lambda c: Facts(autocast="bf16") if c == "bf16" else Facts()
    plan = _plan(workload, profile, strategies, linear_device(EAGER_FLAT, fixed_ms=3.0))
    stage = plan.stages[0]
    assert stage.eager_candidate.choices.get("precision") == "bf16"
    assert all(v.choices.get("precision") == "bf16" for v in stage.variants)


def test_pass_two_leaves_a_candidate_that_compiles_every_run_and_trails_at_one_run(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: pass 2's second run costs a checkpointed candidate a whole compile where the
    cache does not take its graph (torch 2.11 CUDA); runs made at once wait for the slowest
    (hf_gpt2 on an H100: 61 s for two such runs beside the best's 20 s). Such a candidate
    whose line is below SECOND_RUN_SHARE of the best's keeps its one run; the same candidate
    whose graph the cache takes gets its second; the pick is the same either way, and the
    summary names the candidate left at one run."""
    from strategies._compile_search import SECOND_RUN_SHARE

    plans = {}
    for uncached in (False, True):
        device = linear_device(
            EAGER_FLAT, compiled_ratio=0.7, recompute=1.0, uncached_checkpointed=uncached
        )
        plans[uncached] = _plan(workload, profile, strategies, device)
    runs = {
        uncached: Counter(_blocks(p.candidate.choices) for p in _compile_runs(plan))
        for uncached, plan in plans.items()
    }
    assert runs[False][2] == 2 and runs[True][2] == 1, runs
    half = next(v for v in plans[True].stages[0].variants if _blocks(v.choices) == 2)
    best = next(v for v in plans[True].stages[0].variants if v.confirmed)
    assert half.fit.samples_per_s < SECOND_RUN_SHARE * best.fit.samples_per_s
    assert plans[True].candidate == plans[False].candidate
    assert _blocks(plans[True].candidate.choices) == 0
    assert "one run only" in plans[True].stages[0].summary
    assert "one run only" not in plans[False].stages[0].summary
    assert "checkpoint 2/4 blocks." in plans[True].stages[0].summary


def test_pass_twos_leader_takes_its_static_form_along_where_its_group_has_room(
    workload, profile, strategies, linear_device, trials, caplog
) -> None:
    """Rule: on a device of runs at once, pass 2's leader's static form (what the plan hands
    on) goes with pass 2's runs where their group leaves a run free, at the leader's
    predicted batch; where the confirmation keeps that batch without a device run, that run
    is the verification and no static run follows the search (resnet50 on an H100: a 30.4 s
    pass 2, then its static form alone for 56.9 s at the same batch). The plan picks and
    verifies what one run at a time does, and the static run is not one of the search's."""

    def device_of(at_once: int):
        device = linear_device(EAGER_FLAT, fixed_ms=0.01, speedup=1.2 / 0.95)
        device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": at_once})
        return device

    # max_batch 50: the leader's line from one run puts it there, and the confirmation too.
    # The whole model's rider is its own rule (test_pass_twos_leaders_whole_model_rides_...).
    search = CompileSearch(whole_rider=False)
    alone = _plan(workload, profile, strategies, device_of(1), search, verify_steps=2, max_batch=50)
    device = device_of(4)
    calls = _forms_at_once(device)
    with caplog.at_level(logging.DEBUG, logger="memadvisor"):
        together = _plan(
            workload, profile, strategies, device, search, verify_steps=2, max_batch=50
        )
    assert together.stages[0].picked and alone.stages[0].picked
    assert together.candidate == alone.candidate and together.verified == alone.verified
    statics = [p for p in together.probes if _static_form(p)]
    assert len(statics) == 1 and statics[0].candidate == together.candidate
    riding = [call for call in calls if any(static for _, static in call)]
    assert len(riding) == 1, calls
    # With pass 2's run of the leader at the same batch (one at a time, they were 2 calls).
    assert (together.candidate.batch_size, False) in riding[0], calls
    search = together.stages[0].details["search"]
    assert search["static_runs"] == 1
    assert search["runs"] == alone.stages[0].details["search"]["runs"]
    # The progress line says the static form goes along.
    lines = [r.getMessage() for r in caplog.records]
    assert any(re.search(r"at once \(.*; the static form at batch 50\)", m) for m in lines), lines


def _whole_rider_plan(
    workload, profile, strategies, linear_device, at_once: int, regional_speed: float, **search
) -> Plan:
    """A plan on a device of ``at_once`` runs at once whose whole-model compiled step runs
    ``1 / regional_speed`` times the regional one's (the search form: the profile's blocks
    repeat), its leader's line from one run at max_batch 50."""
    device = linear_device(
        EAGER_FLAT, fixed_ms=0.01, speedup=1.2 / 0.95, regional_speed=regional_speed
    )
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": at_once})
    settings = CompileSearch(**search)
    return _plan(workload, profile, strategies, device, settings, verify_steps=2, max_batch=50)


def _whole_runs(plan: Plan) -> list:
    """The compile stage's runs of the whole model (a compile form that is not regional)."""
    return [
        p
        for p in plan.probes
        if p.stage == "compile"
        and (form := parse_choice(p.candidate.choices.get("compile"))) is not None
        and not form.regional
    ]


def test_pass_twos_leaders_whole_model_rides_with_pass_two_and_is_the_pick_where_faster(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: where the search compiles each repeated block (regional) and the model has at
    most WHOLE_RIDER_MAX_BLOCKS blocks, pass 2's leader's whole model compiled (static, at
    the leader's predicted batch) goes with pass 2's group where it has room; where it ran
    MIN_SPEEDUP more than the winner's static form, it is the pick, its run the
    verification, with no device run of the search's more (cnn on an H200, session 42 call
    B: the whole model ran 57,605 samples/s at 3203 where the regional one ran 50,247)."""
    # Whole 1/0.95 = 1.053x the regional form: past MIN_SPEEDUP.
    plan = _whole_rider_plan(workload, profile, strategies, linear_device, 4, 0.95)
    without = _whole_rider_plan(
        workload, profile, strategies, linear_device, 4, 0.95, whole_rider=False
    )
    stage, off = plan.stages[0], without.stages[0]
    assert stage.picked and off.picked
    pick = parse_choice(plan.candidate.choices["compile"])
    assert pick is not None and not pick.regional and not pick.dynamic_batch, plan.candidate
    assert parse_choice(without.candidate.choices["compile"]).regional
    # One whole-model run, at the batch it is picked at: the rider's run is the verification.
    whole = _whole_runs(plan)
    assert [p.batch_size for p in whole] == [plan.candidate.batch_size]
    assert _whole_runs(without) == []
    assert plan.verified.samples_per_s >= MIN_SPEEDUP * without.verified.samples_per_s
    search = stage.details["search"]
    assert any(r.startswith("the whole model of") for r in search["riders"]), search
    # A static run beside the group, not one of the search's.
    assert search["runs"] == off.details["search"]["runs"]
    assert search["static_runs"] == off.details["search"]["static_runs"] + 1
    assert "The whole model compiled" in stage.summary, stage.summary


def test_the_whole_models_rider_not_faster_by_min_speedup_leaves_the_regional_pick(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: where the whole model's rider ran less than MIN_SPEEDUP more than the winner's
    static form (the Llama example on an H200, session 42 call B: 55,464 against 54,731 at
    1603), the regional pick stands; the rider was a static run spent. On a device of one
    run at a time no rider goes: the pick is the regional one, as without the rider."""
    # Whole 1/0.99 = 1.01x the regional form: within MIN_SPEEDUP.
    plan = _whole_rider_plan(workload, profile, strategies, linear_device, 4, 0.99)
    without = _whole_rider_plan(
        workload, profile, strategies, linear_device, 4, 0.99, whole_rider=False
    )
    assert plan.candidate == without.candidate, (plan.candidate, without.candidate)
    assert len(_whole_runs(plan)) == 1
    search = plan.stages[0].details["search"]
    assert search["static_runs"] == without.stages[0].details["search"]["static_runs"] + 1
    assert "The whole model compiled" not in plan.stages[0].summary
    alone = _whole_rider_plan(workload, profile, strategies, linear_device, 1, 0.95)
    assert _whole_runs(alone) == []
    assert parse_choice(alone.candidate.choices["compile"]).regional


def test_the_whole_model_rides_for_the_first_rider_and_is_trialled_beside_pass_two(
    workload, profile, strategies, linear_device, trials, record_run_many, caplog
) -> None:
    """Rule: the whole model rides for the first candidate by its line whose static form
    rides with pass 2, not for pass 2's leader where that is another (cnn on an H200,
    session 42 call D: its leader, 6 of 6 blocks checkpointed and searched static, lost to
    no checkpointing, whose static form rode, and the whole model's rider, sent for the
    leader, was spent). And the whole model's trial, which the plan's compile check of a
    whole-model pick reuses, is made in this process beside pass 2's group, not after the
    search (the Llama example: 13.5 s of checks after it). Here pass 2's leader checkpoints
    2 blocks (static), and no checkpointing's static form rides at the static form's gain
    (a dynamic step 1.3x its static one)."""
    device = linear_device(
        EAGER_FLAT, fixed_ms=1.0, recompute=0.4, uncached_checkpointed=True, dynamic_slowdown=1.3
    )
    _concurrent(device, 8, record_run_many)
    search = CompileSearch(checkpointed_static=True)
    with caplog.at_level(logging.DEBUG, logger="memadvisor"):
        plan = _plan(workload, profile, strategies, device, search, verify_steps=2)
    details = plan.stages[0].details["search"]
    riders = details["riders"]
    assert "no checkpointing at 60" in riders, details
    assert "the whole model of no checkpointing at 60" in riders, details
    assert not any(r.startswith("the whole model of checkpoint") for r in riders), details
    assert "searched static" in details["not_riding"]["checkpoint 2/4 blocks"], details
    assert _blocks(plan.candidate.choices) == 0 and plan.candidate.choices["compile"] == "default"
    # The whole model's trial: once (the compile check reused it), within the compile stage.
    assert [c for c, _ in trials].count("default") == 1, trials
    lines = [r.getMessage() for r in caplog.records]
    trialled = [i for i, m in enumerate(lines) if "compiling default mode in this" in m]
    checks = next(i for i, m in enumerate(lines) if m.startswith("checks"))
    assert trialled and trialled[0] < checks, lines[:checks]


def test_a_whole_model_whose_trial_failed_is_not_the_pick_though_its_rider_ran_faster(
    workload, profile, strategies, linear_device, monkeypatch
) -> None:
    """Rule: the whole model's rider is handed on only where its trial in this process
    (made beside pass 2's group) compiled: a device run says how fast it is, the trial
    whether it compiles and matches eager, which the plan's compile check repeats. Here the
    whole model runs 1.05x the regional form on the device but its trial fails."""

    def stand_in(workload, choice, *, candidate=None, device=None, **kwargs) -> CompileResult:
        if not parse_choice(choice).regional:
            return trial_result(choice, candidate, ok=False, error="dynamo: unsupported op")
        return trial_result(choice, candidate)

    monkeypatch.setattr("strategies.compile.try_compile", stand_in)
    plan = _whole_rider_plan(workload, profile, strategies, linear_device, 4, 0.95)
    assert len(_whole_runs(plan)) == 1  # it rode, and ran faster
    assert parse_choice(plan.candidate.choices["compile"]).regional, plan.candidate
    assert "The whole model compiled" not in plan.stages[0].summary


def test_a_model_of_more_blocks_than_whole_rider_max_blocks_sends_no_whole_model_rider(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: the whole model rides only where the profile has at most WHOLE_RIDER_MAX_BLOCKS
    blocks: each block is compiled again in a whole compile, and lm350m's 24 took 42-66 s
    cold, longer than pass 2's group; the plan says why it did not ride."""
    monkeypatch.setattr(search_module, "WHOLE_RIDER_MAX_BLOCKS", len(profile.blocks) - 1)
    plan = _whole_rider_plan(workload, profile, strategies, linear_device, 4, 0.95)
    assert _whole_runs(plan) == []
    assert parse_choice(plan.candidate.choices["compile"]).regional
    not_riding = plan.stages[0].details["search"]["not_riding"]
    why = [w for k, w in not_riding.items() if k.startswith("the whole model of")]
    assert why and f"{len(profile.blocks)} blocks" in why[0], not_riding


def test_a_rider_whose_leader_moves_is_counted_static_and_the_pick_verified_where_it_went(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: where the leader's confirmation ends at another batch than its pass-2 one (here
    its line from one run was short: 60, then 62), the static form that rode with pass 2 is
    a static run, not one of the search's, and the static form runs again at the batch found
    (the verification is that run): the plan picks and verifies what one run at a time does."""

    def device_of(at_once: int):
        device = linear_device(EAGER_FLAT, fixed_ms=0.01, speedup=1.2 / 0.95)
        device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": at_once})
        return device

    alone = _plan(workload, profile, strategies, device_of(1), verify_steps=2)
    together = _plan(workload, profile, strategies, device_of(4), verify_steps=2)
    assert together.candidate == alone.candidate and together.verified == alone.verified
    statics = [p.batch_size for p in together.probes if _static_form(p)]
    picked = together.candidate.batch_size
    assert len(statics) == 2 and statics[-1] == picked and statics[0] < picked, statics
    search = together.stages[0].details["search"]
    assert search["static_runs"] == 2
    assert search["runs"] == alone.stages[0].details["search"]["runs"]


def test_a_near_rivals_static_form_rides_with_pass_two_and_verifies_it_where_it_wins(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: on a device of runs at once, the static forms of the candidates whose pass-1
    line is within SECOND_RUN_SHARE of the leader's go with pass 2's runs where its group
    has room, each at its predicted batch; where such a candidate becomes the pick (the
    leader's confirmation found less than its run: ``Search.rival``), its static run, the
    verification, was made there and none follows. On a card hf_gpt2's leader (4 blocks
    checkpointed) lost to a candidate 0.2% behind it by its line, whose static form then ran
    alone for 30.1 s (H200, session 19). The pick is the one a device of one run at a time
    makes."""
    from strategies._compile_search import SECOND_RUN_SHARE

    seen: dict = {}
    real_measure, real_confirm = Search.measure, Search.confirm

    def measure(self, variants, meanwhile=None, then=None):
        seen["variants"] = list(variants)
        return real_measure(self, variants, meanwhile, then)

    def short_first(self, winner, hold_back, **kwargs):
        found = real_confirm(self, winner, hold_back, **kwargs)
        if "leader" in seen or found is None:
            return found
        seen["leader"] = winner
        others = [v for v in seen["variants"] if v is not winner]
        rival = max(m.samples_per_s for v in others for m in v.runs.values())
        short = found.measured.model_copy(update={"samples_per_s": 0.8 * rival})
        return dataclasses.replace(found, measured=short)

    monkeypatch.setattr(Search, "measure", measure)
    monkeypatch.setattr(Search, "confirm", short_first)

    def device_of(at_once: int):
        # Checkpointing nearly free: every candidate's rate within a few percent.
        device = linear_device(EAGER_FLAT, fixed_ms=0.01, recompute=0.04)
        device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": at_once})
        return device

    # verify_steps 2, the probes' steps: as on a card, a run of a probe's steps verifies.
    alone = _plan(workload, profile, strategies, device_of(1), verify_steps=2)
    seen.clear()
    device = device_of(6)  # pass 2 makes 3 runs: room for 3 more
    calls = _forms_at_once(device)
    together = _plan(workload, profile, strategies, device, verify_steps=2)
    assert together.stages[0].picked
    assert together.candidate == alone.candidate and together.verified == alone.verified
    leader = seen["leader"]
    pick = next(
        v for v in seen["variants"] if _blocks(v.choices) == _blocks(together.candidate.choices)
    )
    assert pick is not leader
    assert pick.fit.samples_per_s >= SECOND_RUN_SHARE * leader.fit.samples_per_s
    riding = [call for call in calls if any(static for _, static in call)]
    # Pass 2's three runs, and the three near lines' static forms beside them.
    assert riding and sum(static for _, static in riding[0]) == 3, calls
    assert (together.candidate.batch_size, True) in riding[0], calls
    # The pick's static form ran once, with pass 2: no static run followed the rival's win.
    statics = [p.candidate for p in together.probes if _static_form(p)]
    assert statics.count(together.candidate) == 1, statics


def test_the_search_says_which_static_forms_rode_with_pass_two_and_why_a_near_one_did_not(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: the compile stage's search details name pass 2's riders ("label at batch") and,
    by label, why a near candidate's static form did not ride. On a card (H100, session 21)
    hf_gpt2's pass 2 made two runs with four at once and no rider went, and the plan's record
    could not say why; its winner's static form then ran alone for 36.2 s."""
    device = linear_device(EAGER_FLAT, fixed_ms=0.01, recompute=0.04)
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": 4})
    calls = _forms_at_once(device)
    plan = _plan(workload, profile, strategies, device, verify_steps=2)
    search = plan.stages[0].details["search"]
    riding = [call for call in calls if any(static for _, static in call)]
    assert len(search["riders"]) == sum(static for _, static in riding[0]), (search, calls)
    assert search["riders"] and all(" at " in r for r in search["riders"])
    # Four at once leave room for one rider beside pass 2's three runs: near candidates
    # beyond it are named with the reason.
    assert search["not_riding"], search
    assert all(why.startswith("no room") for why in search["not_riding"].values()), search


def test_the_riders_room_is_what_pass_twos_runs_leave_as_the_budget_allows_them(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: pass 2's queued runs beyond what the search's runs allow (the rest held back for
    the confirmations) take no room from the riders: the room is at_once less the runs the
    first group makes. On an H100 (session 21) hf_gpt2's pass 2 queued four, made two, four at
    once, and no static form rode; the winner's then ran alone for 13.6 s. Here three at
    once, three candidates: pass 1 makes three runs, pass 2 queues three and the budget of
    seven (two held back) allows two."""
    device = linear_device(EAGER_FLAT, fixed_ms=0.01, recompute=0.04)
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": 3})
    calls = _forms_at_once(device)
    search = CompileSearch(max_runs=7, max_candidates=3)
    plan = _plan(workload, profile, strategies, device, search=search, verify_steps=2)
    details = plan.stages[0].details["search"]
    compiled = [c for c in calls if c is not calls[0]]  # the first: eager's timing runs
    first, second = compiled[0], compiled[1]
    assert len(first) == 3 and not any(static for _, static in first), calls
    made = [b for b, static in second if not static]
    assert len(made) == 2, calls  # three queued, two allowed
    assert [static for _, static in second].count(True) == 1, (calls, details)
    assert len(details["riders"]) == 1, details


def test_a_rider_is_refused_for_the_reason_its_candidate_gives() -> None:
    """Rule: a near candidate's static form does not ride where its line predicts no batch,
    where the form handed on differs from the searched one, where it was searched static, or
    where every run of it compiled afresh; each with its own reason, and None where it may."""
    from types import SimpleNamespace

    from strategies._compile_search import _why_not_riding

    dynamic = {"mode": "default", "dynamic_batch": True}

    def variant(batch=10, differs=False, form=dynamic, bypasses=0):
        run = SimpleNamespace(compile_cache_bypasses=bypasses)
        return SimpleNamespace(
            fit=SimpleNamespace(largest_batch=batch),
            final_differs=differs,
            form=form,
            runs={batch: run},
        )

    assert _why_not_riding(variant()) is None
    assert "no batch" in _why_not_riding(variant(batch=0))
    assert "differs" in _why_not_riding(variant(differs=True))
    assert "static" in _why_not_riding(variant(form="default"))
    assert "afresh" in _why_not_riding(variant(bypasses=2))


class _ChunkedLoss(Strategy):
    """The loss in chunks (its facts say it computes the loss another way), no other effect:
    the chunked loss head's shape, for the compile search's candidates."""

    name = "loss_head"

    def is_neutral(self, choice) -> bool:
        return not choice

    def choices(self, profile, config) -> list[JsonValue]:
        return [None, 4]

    def effect(self, profile, choice, model) -> None:
        return None

    def apply(self, step, choice):
        return step

    def facts(self, choice) -> Facts:
        return Facts(loss_changed=bool(choice))

    def explain(self, choice, profile):
        return None


def test_where_the_eager_pick_chunks_the_loss_a_candidate_computes_it_as_the_users(
    workload, profile, strategies, linear_device, monkeypatch
) -> None:
    """Rule: where the eager pick computes the loss another way (a chunked loss head) and the
    search compiles the whole model, one candidate drops that choice with the pick's own
    checkpointing, in the autocast precision where the search adds one, and the
    checkpointing axis's candidates drop it too; the pick's own choices keep it. On an H200
    hf_gpt2's eager pick carried the loss in 32 chunks, every compiled candidate kept them,
    and the pick ran 0.54 of bf16 compiled with the user's loss (sessions 19-20); with one
    user's-loss candidate at the pick's 4 checkpointed blocks, the axis's no-checkpointing
    candidate kept the chunks (33,881 samples/s) and the pick ran 0.50 of session 39's
    (session 40). Where the form is regional (the loss stays eager, the chunks keep their
    saving), or the pick does not chunk, there is no such candidate."""
    every = [*strategies, _ChunkedLoss()]
    device = linear_device(EAGER_FLAT)
    space = SearchSpace(profile, [*every, Compile()], _config())
    prober = Prober(device, workload, space, space.config)
    stage = ProberStage(prober, "compile", Progress(enabled=False))

    def candidates(eager_choices: dict, settings: CompileSearch) -> list:
        eager = prober.confirm(space.score_choices(eager_choices))
        assert eager is not None
        variants, _ = search_variants(stage, eager, ["default"], settings, lambda c, b: 0.5)
        return variants

    whole = CompileSearch(regional=False, max_candidates=8)
    found = candidates({"precision": "fp32", "loss_head": 4}, whole)
    users = [v for v in found if "loss_head" not in v.choices]
    kept = [v for v in found if v.choices.get("loss_head") == 4]
    # The pick's own choices keep the chunks; its checkpointing (none here) with the user's
    # loss, then the axis's other sets (2 and 4 of 4 blocks) on the user's loss.
    assert [v.label for v in kept] == ["no checkpointing"], [v.label for v in found]
    assert len(users) == 3 and len(found) == 4, [v.label for v in found]
    assert [recomputed_count(v.choices, [*every, Compile()]) for v in users] == [0, 2, 4], [
        v.label for v in found
    ]
    # The fake precision states no autocast (no lowered candidate): the pick's own precision.
    assert all(v.choices["precision"] == "fp32" for v in users)
    assert all(v.label.endswith(", the loss as yours") for v in users), [v.label for v in users]
    assert all(v.final_choices.get("loss_head") is None for v in users)  # handed on as searched
    # Regional, or an eager pick that does not chunk: none.
    regional = CompileSearch(regional=True, max_candidates=8)
    assert parse_choice(
        candidates({"precision": "fp32", "loss_head": 4}, regional)[0].form
    ).regional
    assert all(
        "loss_head" in v.choices
        for v in candidates({"precision": "fp32", "loss_head": 4}, regional)
    )
    assert all("loss_head" not in v.choices for v in candidates({"precision": "bf16"}, whole))
    assert not any(v.label.endswith("the loss as yours") for v in candidates(BF16, whole))
    # Where the search adds an autocast candidate, the user's loss goes with its precision.
    monkeypatch.setattr(
        "strategies._compile_search._autocast_instead", lambda stage, own: {**own, **BF16}
    )
    found = candidates({"precision": "fp32", "loss_head": 4}, whole)
    users = [v for v in found if "loss_head" not in v.choices]
    assert len(users) == 3 and all(v.choices["precision"] == "bf16" for v in users)
    assert all(v.label.endswith(", bf16, the loss as yours") for v in users), found
    assert all(v.label.count("bf16") == 1 for v in users), found  # said once
    # The autocast candidate (the pick's checkpointing, bf16) keeps the chunks.
    assert [v.choices.get("loss_head") for v in found[:2]] == [4, 4], found


def test_a_first_run_that_runs_out_is_retried_at_half_in_its_own_process_where_the_device_can(
    workload, profile, strategies, linear_device, trials, record_run_many
) -> None:
    """Rule: on a device that retries a run in its own process (``retries_in_process``: a
    card's fork server, where a dynamic-batch graph serves the smaller batch without a second
    compile), a pass-1 run of a dynamic form that runs out is measured at half its batch
    within pass 1 (``Device.run_many_retrying``), not in pass 2; both batches are recorded,
    the retry is not counted among the search's runs, and the plan picks what it picks
    where pass 2 retries it. cnn's regional plan on an H200 spent a 21.5 s round of 88 s on
    pass 2's retries (session 20)."""

    def device_of(in_process: bool):
        device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
        groups = _concurrent(device, 4, record_run_many)
        device.capabilities = device.capabilities.model_copy(
            update={"retries_in_process": in_process}
        )
        starts = _budget_form_runs_out_first(device)
        retried: list[list] = []
        real_retrying = device.run_many_retrying

        def retrying(workload, runs):
            retried.append([(c.batch_size, r) for c, _, r in runs])
            answers = real_retrying(workload, runs)
            for i, a in enumerate(answers):  # as a card's child answers: in its own process
                if not isinstance(a, Exception) and a.ran_out_first is not None:
                    first = a.ran_out_first.model_copy(update={"same_process": True})
                    answers[i] = a.model_copy(update={"ran_out_first": first})
            return answers

        device.run_many_retrying = retrying
        return device, groups, starts, retried

    before, _, _, not_asked = device_of(False)
    late = _plan(workload, profile, strategies, before, CompileSearch(max_runs=12))
    device, groups, starts, retried = device_of(True)
    plan = _plan(workload, profile, strategies, device, CompileSearch(max_runs=12))
    assert not not_asked and plan.candidate == late.candidate, (not_asked, plan.candidate)
    half = starts["budget"] // 2
    # Pass 1's group asked for retries; the budget form's came back at half its batch.
    assert retried and any((starts["budget"], half) in call for call in retried), retried
    budget_runs = [
        p.batch_size
        for p in plan.probes
        if isinstance(p.candidate.choices.get("compile"), dict)
        and p.candidate.choices["compile"].get("activation_memory_budget") is not None
    ]
    assert budget_runs[:2] == [starts["budget"], half], budget_runs
    search = plan.stages[0].details["search"]
    assert search["runs"] == len(_compile_runs(plan)) - 1, search  # the retry not counted


def test_checkpointed_candidates_searched_static_are_verified_by_their_own_run(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: where the caches do not take a checkpointed graph (torch 2.11 on a card), a
    candidate that checkpoints blocks is searched in its static form
    (``CompileSearch.checkpointed_static``), the others with a dynamic batch: its runs
    compile afresh either way, and its run at the batch it is picked at is the pick's
    verification, where the dynamic form needs a static run more (the GPT example on an
    H100, session 22: a 21.7 s static run after a 28.6 s pass). The twin forms share one
    trial; the pick is the dynamic search's configuration, in no more device runs."""
    config = {"verify_steps": 2}  # a run takes the verifying steps, as on a card

    def plan_on(static: bool):
        device = linear_device(EAGER_FLAT, fixed_ms=30.0, uncached_checkpointed=True)
        trials.clear()
        search = CompileSearch(checkpointed_static=static)
        plan = _plan(workload, profile, strategies, device, search, **config)
        return plan, [choice for choice, _ in trials]

    (dynamic, dynamic_trials), (static, static_trials) = plan_on(False), plan_on(True)
    stage = static.stages[0]
    assert stage.picked and _blocks(static.candidate.choices) > 0, stage.summary
    assert static.candidate.choices == dynamic.candidate.choices
    assert abs(static.candidate.batch_size / dynamic.candidate.batch_size - 1) <= 0.03
    runs = [p for p in static.probes if p.stage == "compile"]
    # Checkpointed candidates ran static only, the one without checkpointing dynamic only.
    assert {_static_form(p) for p in runs if _blocks(p.candidate.choices)} == {True}
    assert {_static_form(p) for p in runs if not _blocks(p.candidate.choices)} == {False}
    # The pick's own search run verified it: no static run beside or after the search.
    assert static.candidate in [p.candidate for p in runs if p.fits]
    assert stage.details["search"]["static_runs"] == 0
    assert stage.details["search"]["checkpointed_searched"] == "static"
    assert dynamic.stages[0].details["search"]["checkpointed_searched"] == "dynamic"
    assert not [p for p in static.probes if p.stage == "verify"]
    # Here the confirmation moves past pass 2's batch, so both plans confirm in static runs
    # and make as many; the run saved is where the pick's batch is one the search ran (the
    # GPT example's capped line on a card), measured there, not here.
    assert len(runs) <= len([p for p in dynamic.probes if p.stage == "compile"])
    # One trial for both forms, as for the dynamic search; the static forms name it.
    assert len(static_trials) == len(dynamic_trials) == 1, static_trials
    twin = "not trialled: the same compile as the form with a"
    twins = [v for v in stage.variants if v.trial.startswith(twin)]
    assert twins and all(v.ok for v in twins), [v.trial for v in stage.variants]


def test_checkpointed_candidates_are_searched_static_where_this_torch_is_not_known_to_cache_them(
    monkeypatch, profile
) -> None:
    """Rule: by default (``checkpointed_static`` None) a checkpointed candidate is searched
    static on a torch whose caches bypass its graph (2.11 on a card) and dynamic where they
    take it (2.13); a setting says so either way, and a search without a dynamic batch
    searches everything static."""
    from strategies import _compile_search as cs

    assert not cs.checkpointed_graphs_cached("2.11.0+cu130")
    assert not cs.checkpointed_graphs_cached("2.12.1")
    assert cs.checkpointed_graphs_cached("2.13.0+cpu")
    assert cs.checkpointed_graphs_cached("2.14.0.dev20261120")
    assert cs.checkpointed_graphs_cached("3.0.0")
    choice = parse_choice(REGIONAL)

    def dynamic(settings: CompileSearch, checkpoints: bool) -> bool:
        return cs.search_form(choice, profile, settings, checkpoints).dynamic_batch

    for version, cached in (("2.11.0+cu130", False), ("2.13.0", True)):
        monkeypatch.setattr(torch, "__version__", version)
        assert dynamic(CompileSearch(), checkpoints=True) is cached, version
        assert dynamic(CompileSearch(), checkpoints=False), version
        assert not dynamic(CompileSearch(checkpointed_static=True), checkpoints=True)
        assert dynamic(CompileSearch(checkpointed_static=False), checkpoints=True)
        assert not dynamic(CompileSearch(dynamic_batch=False), checkpoints=False)


def test_a_dynamic_candidates_static_form_rides_against_a_static_leader_and_wins_where_faster(
    workload, profile, strategies, linear_device, trials, record_run_many
) -> None:
    """Rule: where pass 2's leader is searched static (checkpointed) and its group makes a
    cold compile anyway, a dynamic candidate's line is set against it at the static form's
    gain (STATIC_GAIN_MAX), so its static form rides; where that rider then measures more
    than the winner's static confirmation, it is the pick, its run the verification. cnn on
    an H100 (session 23): no checkpointing ran 37,964 samples/s dynamic at 2098, so 3 blocks
    checkpointed (static, 43,722 at 3207) was picked, where its static form had run 48,111
    (session 22). Here a dynamic step takes 1.3x its static one, and a checkpointed block
    recomputes at 0.4 of its forward."""
    from strategies._compile_search import MIN_SPEEDUP

    def plan_on(slowdown: float):
        device = linear_device(
            EAGER_FLAT, fixed_ms=1.0, recompute=0.4, uncached_checkpointed=True,
            dynamic_slowdown=slowdown,
        )  # fmt: skip
        _concurrent(device, 4, record_run_many)
        search = CompileSearch(checkpointed_static=True)
        return device, _plan(workload, profile, strategies, device, search, verify_steps=2)

    device, plan = plan_on(1.3)
    stage = plan.stages[0]
    assert stage.picked and _blocks(plan.candidate.choices) == 0, stage.summary
    assert plan.candidate.choices["compile"] == REGIONAL  # its static form
    assert stage.details["search"]["riders"], stage.details["search"]
    assert "run beside the second pass" in stage.summary
    # The best by the lines, checkpointed and static, was confirmed and ran slower, by more
    # than two runs' noise (MIN_SPEEDUP).
    static_winner = [
        v for v in stage.variants if v.confirmed and _blocks(v.choices) and v.measured is not None
    ]
    assert static_winner and all(
        MIN_SPEEDUP * v.measured.samples_per_s <= plan.verified.samples_per_s for v in static_winner
    )
    # Within 3% of the best static configuration, by construction.
    rates = []
    for k in range(BLOCKS + 1):
        choices = {"precision": "bf16", "compile": REGIONAL}
        if k:
            choices["checkpointing"] = [f"b{i}" for i in range(k)]
        batch = device.edge(Candidate(batch_size=1, choices=choices))
        rates.append(batch / device.step_ms(Candidate(batch_size=batch, choices=choices)) * 1e3)
    assert plan.verified.samples_per_s >= 0.97 * max(rates)
    assert max(range(BLOCKS + 1), key=lambda k: rates[k]) == 0
    # Where a dynamic step is as fast as a static one, no such rider goes.
    _, even = plan_on(1.0)
    assert "run beside the second pass" not in even.stages[0].summary


def test_a_near_riders_static_form_that_ran_faster_than_the_winners_by_the_noise_is_the_pick(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: a near candidate's static form that rode with pass 2 and measured more than the
    winner's static confirmation by MIN_SPEEDUP or more is the pick, its run the
    verification; ahead by less, the winner stands (two 20-step runs alike). hf_gpt2 on an
    H100 (session 24): the tf32 candidate led bf16's by 1% on their dynamic lines, its static
    form ran 65,559 samples/s at 860, and bf16's static rider 76,927 at 1020, yet the pick was
    tf32's. Here one candidate's static graph runs faster than its dynamic one; the others'
    run as fast as theirs."""
    from strategies._compile_search import MIN_SPEEDUP

    def device_of(at_once: int, faster: int | None = None, gain: float = 1.0):
        # Checkpointing nearly free: every candidate's line within a few percent.
        device = linear_device(EAGER_FLAT, fixed_ms=0.01, recompute=0.04)
        device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": at_once})
        real = device.step_ms

        def step_ms(candidate):
            form = candidate.choices.get("compile")
            static = isinstance(form, dict) and not form.get("dynamic_batch")
            quick = static and _blocks(candidate.choices) == faster
            return real(candidate) / (gain if quick else 1.0)

        device.step_ms = step_ms
        return device

    plain = _plan(workload, profile, strategies, device_of(6), verify_steps=2)
    winner = _blocks(plain.candidate.choices)
    searched = {_blocks(v.choices) for v in plain.stages[0].variants}
    other = min(searched - {winner})

    def together(gain: float):
        device = device_of(6, other, gain)
        calls = _forms_at_once(device)
        return _plan(workload, profile, strategies, device, verify_steps=2), calls

    fast, calls = together(1.2)
    stage = fast.stages[0]
    assert stage.picked and _blocks(fast.candidate.choices) == other, stage.summary
    assert "run beside the second pass" in stage.summary
    # Its run with pass 2 is the verification: its static form ran once, beside pass 2.
    statics = [p.candidate for p in fast.probes if _static_form(p)]
    assert statics.count(fast.candidate) == 1, statics
    riding = [call for call in calls if any(static for _, static in call)]
    assert (fast.candidate.batch_size, True) in riding[0], calls
    # Measured more than the winner's static confirmation by the margin.
    (beaten,) = [v for v in stage.variants if v.confirmed and _blocks(v.choices) == winner]
    assert fast.verified.samples_per_s >= MIN_SPEEDUP * beaten.measured.samples_per_s
    # Ahead by less than the margin: the winner stands, the pick of the plain device.
    close, _ = together(1.01)
    assert close.candidate == plain.candidate, close.stages[0].summary
    assert "run beside the second pass" not in close.stages[0].summary


# -- CUDA graphs where the card waits on the host (strategies/_compile_graphs.py) ------------


def _graphs_runs(plan: Plan, device) -> list:
    """The compile stage's runs of a graphs form (not the plan's verification of one)."""
    return [
        p
        for p in plan.probes
        if p.stage == "compile" and p.candidate is not None and device.graphs(p.candidate)
    ]


def test_a_pick_whose_card_waits_on_the_host_is_replayed_as_cuda_graphs_at_a_batch_of_its_own(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: where the compiled pick's host takes its whole step to launch it (40 ms against
    the card's 18 or so), the stage confirms the same choices in reduce-overhead mode, whose
    graphs hold 1.3x the bytes a sample: from below the pick's batch, never above it, within
    CompileSearch.graphs_runs runs. It launches in a tenth of the card's time, so it runs at
    the card's speed and is the pick, at no batch that does not fit, its run the
    verification; the plan says why, and its advice and its loop's lines say a step's
    outputs do not outlive the next step. No trial compiles the graphs form: the default
    mode's stands for it."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0, host_ms=40.0)
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    graphs = stage.details["graphs"]
    assert graphs["host_share"] == pytest.approx(1.0) and graphs["tried"] and graphs["picked"]
    form = plan.candidate.choices["compile"]
    assert form == {**REGIONAL, "mode": "reduce-overhead"}
    # The default mode's pick: the searched candidate, confirmed and verified static.
    static = next(v for v in stage.variants if v.confirmed and v.choices["compile"] == SEARCHED)
    assert {k: v for k, v in plan.candidate.choices.items() if k != "compile"} == {
        k: v for k, v in static.choices.items() if k != "compile"
    }
    runs = _graphs_runs(plan, device)
    assert 1 <= len(runs) <= CompileSearch().graphs_runs
    assert all(p.batch_size <= static.batch_size for p in runs)
    edge = device.edge(Candidate(batch_size=1, choices=plan.candidate.choices))
    assert edge < static.batch_size  # graphs hold more: the pick's own batch would not fit
    assert 0.9 * edge <= plan.candidate.batch_size <= edge
    assert plan.verified is not None and static.measured is not None
    assert plan.verified.samples_per_s >= 1.5 * static.measured.samples_per_s
    assert "The card waited on the host" in stage.summary and "the pick" in stage.summary
    advice = next(a for a in plan.advice if a.strategy == "compile")
    assert "reduce-overhead" in advice.title and "loss.item()" in advice.sentence
    part = Compile().describe(plan.candidate.choices["compile"], plan)
    assert part is not None and part.loop is not None
    assert any("loss.item()" in note for note in part.loop.forward_notes)
    assert not any("reduce-overhead" in json.dumps(choice) for choice, _ in trials)
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_a_pick_whose_card_is_busy_through_the_step_runs_no_cuda_graphs(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: below CompileSearch.host_bound_share (the host launches the step in 1 ms of the
    card's 18 or so), graphs, which save launches only, are not run: no probe is a graphs
    form, the pick is the default mode's, and the stage says the host's share it read."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0, host_ms=1.0)
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    assert stage.picked and plan.candidate.choices["compile"] == REGIONAL
    assert not _graphs_runs(plan, device)
    graphs = stage.details["graphs"]
    assert not graphs["tried"] and graphs["host_share"] < CompileSearch().host_bound_share
    assert "waited on the host" not in stage.summary
    part = Compile().describe(plan.candidate.choices["compile"], plan)
    assert part is not None and part.loop is not None and part.loop.forward_notes == []


def test_cuda_graphs_that_do_not_pay_for_their_memory_leave_the_default_mode_pick(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: graphs are the pick only where they beat the default mode's pick by
    MIN_SPEEDUP. Here the host is barely slower than the card (20 ms) and graphs hold 3x the
    bytes a sample: the third of the batch they allow runs slower, so the pick stays, the
    graphs form is kept among the stage's variants with what it measured, and the stage says
    it did not pay; its runs are counted as the graphs' own, not against the search's
    max_runs."""
    device = linear_device(
        EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0, host_ms=20.0, graphs_ratio=3.0
    )
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    assert stage.picked and plan.candidate.choices["compile"] == REGIONAL
    assert _graphs_runs(plan, device) and stage.details["graphs"]["tried"]
    assert not stage.details["graphs"]["picked"]
    graphs = next(v for v in stage.variants if "reduce-overhead" in json.dumps(v.choices))
    assert graphs.confirmed and graphs.measured is not None and plan.verified is not None
    assert graphs.measured.samples_per_s < MIN_SPEEDUP * plan.verified.samples_per_s
    assert "not enough to pay" in stage.summary
    # The graphs' runs are their own (graphs_runs), not the search's (max_runs).
    search = stage.details["search"]
    assert search["graphs_runs"] == len(_graphs_runs(plan, device))
    assert search["graphs_runs"] <= CompileSearch().graphs_runs
    assert search["runs"] <= CompileSearch().max_runs
    assert f"in {search['runs']} device runs (at most 8)" in stage.summary


def test_cuda_graphs_are_not_tried_when_the_search_is_told_not_to(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: CompileSearch(graphs_when_host_bound=False) runs no graphs form, host-bound or
    not."""
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0, host_ms=40.0)
    plan = _plan(workload, profile, strategies, device, CompileSearch(graphs_when_host_bound=False))
    assert plan.stages[0].picked and plan.candidate.choices["compile"] == REGIONAL
    assert not _graphs_runs(plan, device) and not plan.stages[0].details["graphs"]["tried"]


def test_with_one_graphs_run_its_run_is_the_answer_confirmed_by_the_stage(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: with CompileSearch(graphs_runs=1) the graphs' one run, at half the pick's batch,
    is the answer where it held, confirmed through the stage as every pick is (a pick the
    stage did not confirm is refused by the planner: it raised PlanningError before the
    graphs step answered through stage.confirm); where it ran out, the pick stays."""
    for ratio, picked in ((1.3, True), (10.0, False)):
        device = linear_device(
            EAGER_LM,
            compiled_per_sample=COMPILED_LM,
            fixed_ms=3.0,
            host_ms=40.0,
            graphs_ratio=ratio,
        )
        plan = _plan(workload, profile, strategies, device, CompileSearch(graphs_runs=1))
        runs = _graphs_runs(plan, device)
        graphs = plan.stages[0].details["graphs"]
        assert len(runs) == 1 and runs[0].fits is picked and graphs["picked"] is picked
        mode = plan.candidate.choices["compile"]["mode"]
        assert mode == ("reduce-overhead" if picked else "default")
        if picked:
            assert plan.candidate.batch_size == runs[0].batch_size


def test_where_compiling_does_not_pay_on_a_host_bound_step_graphs_are_weighed_against_eager(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: where the host launches every step in 40 ms and a compiled step holds what
    eager's does (compiled_per_sample = eager's) and the card's time is the same
    (speedup 1.0), compiling in default mode does not pay: both wait on the host at the same
    batch. The best compiled configuration the search ran is then replayed as CUDA graphs,
    which launch in a tenth of the card's time, within CompileSearch.graphs_runs runs, and
    judged against the eager pick by the bar a compile must clear: here they clear it, so
    they are the pick, their run the verification, and the stage says what they beat."""
    device = linear_device(
        EAGER_LM, compiled_per_sample=EAGER_LM, speedup=1.0, fixed_ms=3.0, host_ms=40.0
    )
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    graphs = stage.details["graphs"]
    assert graphs["tried"] and graphs["picked"] and graphs["against"] == "eager"
    assert stage.picked and plan.candidate.choices["compile"]["mode"] == "reduce-overhead"
    runs = _graphs_runs(plan, device)
    assert 1 <= len(runs) <= CompileSearch().graphs_runs
    assert plan.candidate.batch_size <= device.edge(
        Candidate(batch_size=1, choices=plan.candidate.choices)
    )
    assert plan.verified is not None and stage.eager_measured is not None
    assert plan.verified.samples_per_s >= MIN_SPEEDUP * stage.eager_measured.samples_per_s
    # No default-mode compiled configuration beat eager: graphs are what made the pick.
    default = [
        v
        for v in stage.variants
        if v.measured is not None and "reduce-overhead" not in json.dumps(v.choices)
    ]
    assert default and all(
        v.measured.samples_per_s < MIN_SPEEDUP * stage.eager_measured.samples_per_s for v in default
    )
    assert (
        "the eager pick's" in stage.summary and "the best compiled configuration" in stage.summary
    )
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_where_compiling_does_not_pay_and_the_card_is_busy_no_graphs_run(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: the same model with the host launching a step in 1 ms (the card busy through
    it): compiling does not pay, graphs are not run, and the eager pick stays; told not to
    (graphs_when_host_bound=False), a host-bound step runs none either."""
    quick = linear_device(
        EAGER_LM, compiled_per_sample=EAGER_LM, speedup=1.0, fixed_ms=3.0, host_ms=1.0
    )
    plan = _plan(workload, profile, strategies, quick)
    assert not plan.stages[0].picked and "compile" not in plan.candidate.choices
    assert not _graphs_runs(plan, quick) and not plan.stages[0].details["graphs"]["tried"]
    slow = linear_device(
        EAGER_LM, compiled_per_sample=EAGER_LM, speedup=1.0, fixed_ms=3.0, host_ms=40.0
    )
    off = CompileSearch(graphs_when_host_bound=False)
    plan = _plan(workload, profile, strategies, slow, off)
    assert not plan.stages[0].picked and "compile" not in plan.candidate.choices
    assert not _graphs_runs(plan, slow)


@pytest.mark.parametrize("ratio", [1.1, 1.3])
def test_on_a_device_of_runs_at_once_the_graphs_guess_rides_with_the_first_run(
    workload, profile, strategies, linear_device, trials, record_run_many, monkeypatch, ratio
) -> None:
    """Rule: where the device makes runs at once, the graphs' first run and the guess
    (GUESS_SHARE of the pick's batch) go together, and the pick still lands within 10% below
    the graphs form's edge, never past it, in at most CompileSearch.graphs_runs runs: graphs
    holding 1.3x a sample (edge 0.77 of the pick's batch, the guess runs out: the line aims
    below it) or 1.1x (edge 0.91: the guess holds and the line's 5% more is tried)."""
    device = linear_device(
        EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0, host_ms=40.0, graphs_ratio=ratio
    )
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": 4})
    # The graphs step's own first round: none made ahead beside a static run.
    monkeypatch.setattr(stage_module, "first_round", lambda *args: [])
    calls = record_run_many(device, compiled_only=True)
    plan = _plan(workload, profile, strategies, device)
    graphs = plan.stages[0].details["graphs"]
    assert graphs["tried"] and graphs["picked"], plan.stages[0].summary
    runs = _graphs_runs(plan, device)
    assert 2 <= len(runs) <= CompileSearch().graphs_runs
    # The first two graphs runs went to the device in one call, at once.
    first_two = [p.batch_size for p in runs[:2]]
    assert any(_within(first_two, c) for c in calls), calls
    edge = device.edge(Candidate(batch_size=1, choices=plan.candidate.choices))
    assert 0.9 * edge <= plan.candidate.batch_size <= edge


def _within(batches: list[int], call: list[int]) -> bool:
    """Whether every one of ``batches`` is among ``call``'s (as many times)."""
    left = list(call)
    for b in batches:
        if b not in left:
            return False
        left.remove(b)
    return True


def _static_and_graphs_calls(plan: Plan, device, calls: list[list[int]]) -> list[list[int]]:
    """The device calls (``calls``: record_run_many's) in which a static default-mode form
    went with the first graphs run: each such call's batches."""
    graphs = [p.batch_size for p in _graphs_runs(plan, device)]
    static = [
        p.batch_size
        for p in plan.probes
        if p.stage == "compile" and _static_form(p) and not device.graphs(p.candidate)
    ]
    return [c for c in calls if graphs and graphs[0] in c and any(b in c for b in static)]


def _host_bound_at_once(linear_device):
    """A fake card of four runs at once whose compiled steps wait on the host (40 ms a step)
    and whose CUDA graphs hold 1.3x a sample's bytes."""
    d = linear_device(
        EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0, host_ms=40.0, graphs_ratio=1.3
    )
    d.capabilities = d.capabilities.model_copy(update={"concurrent_runs": 4})
    return d


@pytest.mark.parametrize("beside", ["pass 2", "confirmation", "static run"])
def test_the_graphs_first_round_goes_with_a_static_run_where_the_leader_waited_on_the_host(
    workload,
    profile,
    strategies,
    linear_device,
    trials,
    record_run_many,
    monkeypatch,
    beside: str,
) -> None:
    """Rule: on a device of runs at once, where the leading candidate's own runs waited on
    the host (40 ms a step), the CUDA graphs' first round for its static form at its
    predicted batch goes to the device in the same call as a static-form run, where the
    group has room: pass 2's (beside the leader's static rider), else the confirmation's
    first run (riders off), else the pick's static run alone (the confirmation sends nothing
    beside it, as where pass 2 ran its batch already). One round of such bets per graphs
    form. The graphs step starts from what they found, here where the leader's batch moved
    from pass 2's 259 to 310: no graphs run is made twice, at most CompileSearch.graphs_runs
    runs more than the bets, the pick within 10% below the graphs form's edge, and the
    search's own runs no more than with graphs switched off."""
    if beside != "pass 2":
        monkeypatch.setattr(Search, "_static_riders", lambda self, ranked, runs, reserve: [])
    if beside == "static run":
        real_confirm = Search.confirm

        def no_beside(self, winner, hold_back, **kwargs):
            kwargs.update(static_beside=False, graphs_beside=())
            return real_confirm(self, winner, hold_back, **kwargs)

        monkeypatch.setattr(Search, "confirm", no_beside)

    def device():
        return _host_bound_at_once(linear_device)

    ahead = device()
    calls = record_run_many(ahead, compiled_only=True)
    plan = _plan(workload, profile, strategies, ahead)
    stage = plan.stages[0]
    assert stage.details["graphs"]["picked"], stage.summary
    assert _static_and_graphs_calls(plan, ahead, calls), calls
    runs = _graphs_runs(plan, ahead)
    made = [(json.dumps(p.candidate.choices, sort_keys=True), p.batch_size) for p in runs]
    assert len(made) == len(set(made))
    search = stage.details["search"]
    rode = [r for r in search["riders"] if r.startswith("CUDA graphs of")]
    assert bool(rode) is (beside == "pass 2"), search["riders"]
    assert search["graphs_runs"] == len(runs) <= CompileSearch().graphs_runs + 2
    edge = ahead.edge(Candidate(batch_size=1, choices=plan.candidate.choices))
    assert 0.9 * edge <= plan.candidate.batch_size <= edge
    off = _plan(
        workload, profile, strategies, device(), CompileSearch(graphs_when_host_bound=False)
    )
    assert search["runs"] <= off.stages[0].details["search"]["runs"]


def test_graphs_runs_made_ahead_that_the_graphs_step_does_not_use_are_counted_and_said(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: where the graphs' first round went with the static form's run but the pick's
    run did not wait on the host (1 ms a step: graphs not tried), those runs are counted as
    graphs runs, not the search's, and the summary says they went unused and why."""
    real = stage_module.first_round

    def regardless(stage, settings, choices, batch, measured):
        host_bound = measured.model_copy(update={"host_ms": measured.step_ms})
        return real(stage, settings, choices, batch, host_bound)

    monkeypatch.setattr(stage_module, "first_round", regardless)
    device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0, host_ms=1.0)
    device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": 4})
    plan = _plan(workload, profile, strategies, device)
    stage = plan.stages[0]
    runs = _graphs_runs(plan, device)
    assert runs and not stage.details["graphs"]["tried"]
    assert plan.candidate.choices["compile"] == REGIONAL
    search = stage.details["search"]
    assert search["graphs_runs"] == len(runs) and search["runs"] <= CompileSearch().max_runs
    assert f"{len(runs)} CUDA graphs runs made ahead beside other runs went unused" in (
        stage.summary
    )


def _compile_rounds(device) -> list[list[tuple[bool, int]]]:
    """``device``'s compiled device calls, alone or at once, as they are made: each call's
    runs as (whether a graphs form, batch)."""
    rounds: list[list[tuple[bool, int]]] = []
    real_many, real_one = device.run_many, device.run
    inside: list[bool] = []  # the fake's run_many makes its runs through run

    def many(workload, runs):
        if all("compile" in c.choices for c, _ in runs):
            rounds.append([(bool(device.graphs(c)), c.batch_size) for c, _ in runs])
        inside.append(True)
        try:
            return real_many(workload, runs)
        finally:
            inside.pop()

    def one(workload, candidate, *args, **kwargs):
        if "compile" in candidate.choices and not inside:
            rounds.append([(bool(device.graphs(candidate)), candidate.batch_size)])
        return real_one(workload, candidate, *args, **kwargs)

    device.run_many, device.run = many, one
    return rounds


def test_the_graphs_search_after_its_bets_goes_with_the_confirmations_first_run(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: where the graphs' bets rode pass 2 and the confirmation then runs on the
    device, the graphs search's first run after the bets (next_round) goes in the
    confirmation's first device call, not in a call after it; the graphs step finds it made
    (no graphs batch run twice), it is counted as a graphs run, and the plan takes fewer
    compiled device calls than with that run left to the graphs step, to the same pick."""

    def device():
        return _host_bound_at_once(linear_device)

    along = device()
    rounds = _compile_rounds(along)
    plan = _plan(workload, profile, strategies, along)
    stage = plan.stages[0]
    search = stage.details["search"]
    assert stage.details["graphs"]["picked"], stage.summary
    assert any(r.startswith("CUDA graphs of") for r in search["riders"]), search["riders"]
    runs = _graphs_runs(plan, along)
    made = [(json.dumps(p.candidate.choices, sort_keys=True), p.batch_size) for p in runs]
    assert len(made) == len(set(made))
    assert search["graphs_runs"] == len(runs)
    # the bets' call, then a call with the confirmation's run and the graphs' next
    with_graphs = [r for r in rounds if any(g for g, _ in r)]
    mixed = [r for r in with_graphs if any(not g for g, _ in r)]
    assert len(mixed) >= 2, rounds

    monkeypatch.setattr(stage_module, "_graphs_next", lambda stage, settings, winner: [])
    after = device()
    later = _compile_rounds(after)
    other = _plan(workload, profile, strategies, after)
    assert other.candidate == plan.candidate
    assert len(rounds) < len(later), (rounds, later)


def test_the_graphs_bets_ride_pass_one_where_it_leaves_room_and_the_eager_pick_waited_on_the_host(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: on a device of runs at once, where pass 1's group leaves runs free and the eager
    pick's own runs waited on the host (40 ms a step), the CUDA graphs' bets for the first
    candidate searched static, at its pass-1 batch, go in pass 1's device call, and the
    search says so ("with pass 1"). The graphs step finds them made: no graphs batch is run
    twice, they are counted as graphs runs, and the plan takes fewer compiled device calls
    than with no bets in pass 1, to the same pick. Where the host launches the eager step in
    1 ms, no bet rides pass 1."""
    settings = CompileSearch(checkpointed_static=True, max_candidates=2)

    def device(host_ms: float = 40.0):
        d = linear_device(
            EAGER_LM, compiled_per_sample=EAGER_LM, fixed_ms=3.0, host_ms=host_ms, graphs_ratio=1.3
        )
        d.capabilities = d.capabilities.model_copy(update={"concurrent_runs": 4})
        return d

    bets = device()
    rounds = _compile_rounds(bets)
    plan = _plan(workload, profile, strategies, bets, settings)
    stage = plan.stages[0]
    search = stage.details["search"]
    assert stage.details["graphs"]["picked"], stage.summary
    assert any(r.endswith("with pass 1") for r in search["riders"]), search["riders"]
    assert any(g for g, _ in rounds[0]) and any(not g for g, _ in rounds[0]), rounds
    runs = _graphs_runs(plan, bets)
    made = [(json.dumps(p.candidate.choices, sort_keys=True), p.batch_size) for p in runs]
    assert len(made) == len(set(made))
    assert search["graphs_runs"] == len(runs)

    quick = _plan(workload, profile, strategies, device(host_ms=1.0), settings)
    assert not any("with pass 1" in r for r in quick.stages[0].details["search"]["riders"])

    monkeypatch.setattr(Search, "_pass_one_bets", lambda self, first, reserve: [])
    off = device()
    later = _compile_rounds(off)
    other = _plan(workload, profile, strategies, off, settings)
    assert other.candidate == plan.candidate
    assert len(rounds) < len(later), (rounds, later)


def test_graphs_that_still_wait_on_the_host_make_no_graphs_run_after_the_first_that_held(
    workload, profile, strategies, linear_device, trials
) -> None:
    """Rule: where the CUDA graphs' runs still take 90% of their step to launch it (at or
    above CompileSearch.host_bound_share: graphs did not relieve the host), the plan makes
    fewer graphs runs than where graphs launch in a tenth of their step, the summary says
    the host's share under them, and no graphs run comes after the first graphs run that
    held (the runs made with it in one call aside)."""
    waits = _host_bound_at_once(linear_device)
    waits.graphs_host_share = 0.9
    plan = _plan(workload, profile, strategies, waits)
    stage = plan.stages[0]
    graphs = stage.details["graphs"]
    assert graphs["tried"], stage.summary
    assert "under them the host still took 90% of the step" in stage.summary, stage.summary
    runs = _graphs_runs(plan, waits)
    first_held = next(i for i, p in enumerate(plan.probes) if p in runs and p.fits)
    later = [p for p in runs if plan.probes.index(p) > first_held]
    same_call = [p for p in later if p.wall_ms == plan.probes[first_held].wall_ms]
    assert later == same_call, [(p.batch_size, p.fits) for p in runs]

    relieved = _plan(workload, profile, strategies, _host_bound_at_once(linear_device))
    searched = relieved.stages[0].details["search"]["graphs_runs"]
    assert stage.details["search"]["graphs_runs"] < searched, (runs, searched)
    assert "still took" not in relieved.stages[0].summary


def _rounds(device) -> list[list[int]]:
    """``device``'s compiled runs as the plan waits on them: each run_many call's batches,
    and each run made alone (one batch), in order; the eager runs left out."""
    rounds: list[list[int]] = []
    inside = [False]
    real_many, real_run = device.run_many, device.run

    def many(workload, runs):
        compiled = [c.batch_size for c, _ in runs if "compile" in c.choices]
        if compiled:
            rounds.append(compiled)
        inside[0] = True
        try:
            return real_many(workload, runs)
        finally:
            inside[0] = False

    def run(workload, candidate, steps):
        if not inside[0] and "compile" in candidate.choices:
            rounds.append([candidate.batch_size])
        return real_run(workload, candidate, steps)

    device.run_many, device.run = many, run
    return rounds


def test_a_static_pass_two_run_takes_its_fallback_along_and_it_answers_where_that_run_runs_out(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: on a device of runs at once, where a static pass-2 run at its line's batch
    leaves its group a run free, the same form at the plan's margin below that batch (the
    run the confirmation would make first) goes with it, made ahead: where the pass-2 run
    runs out, the fallback is taken as the candidate's run (its line gets the point) and
    the confirmation makes no device round (t5_base on an H200, session 36 call 1: 53 ran
    out by the allocator's retries, then 51 and 43 in a round of their own, 41.6 s); where
    it fits, the fallback is neither logged nor counted. Same pick, same search runs, a
    round fewer."""
    # The whole model's rider (its own rule: test_pass_twos_leaders_whole_model_rides_...)
    # would take the group's room and the pick.
    search = CompileSearch(checkpointed_static=True, whole_rider=False)
    edge: dict[str, object] = {}

    def device_of():
        device = linear_device(EAGER_FLAT, fixed_ms=30.0, uncached_checkpointed=True)
        device.capabilities = device.capabilities.model_copy(update={"concurrent_runs": 4})
        real = device.run

        def run(workload, candidate, steps):  # the leader's pass-2 batch runs out (retries)
            if candidate.choices == edge.get("choices") and candidate.batch_size >= edge["at"]:
                device.calls.append((candidate.batch_size, steps, dict(candidate.choices)))
                raise torch.OutOfMemoryError("fake: out by the allocator's retries")
            return real(workload, candidate, steps)

        device.run = run
        return device

    # The leader's pass-2 run fits: its fallback rides, and is nowhere in the plan's runs.
    fits = _plan(workload, profile, strategies, device_of(), search, verify_steps=2)
    leader = fits.candidate.choices
    ran = [p.batch_size for p in fits.probes if p.candidate.choices == leader]
    pass_two = ran[1]  # its pass-1 run, then pass 2's at its line's batch (static)
    rode = fits.stages[0].details["search"]["riders"]
    fallback = [r for r in rode if r.endswith(f"should {pass_two} run out")]
    assert len(fallback) == 1, rode
    at = int(fallback[0].split(" at ")[1].split(",")[0])
    assert 0 < at < pass_two and at not in ran, (at, ran)

    # It runs out: with the fallback the confirmation makes no device run; without, one.
    edge.update(choices=leader, at=pass_two)
    device = device_of()
    rounds = _rounds(device)
    ahead = _plan(workload, profile, strategies, device, search, verify_steps=2)
    monkeypatch.setattr(Search, "_fallback", lambda self, v, batch: None)
    device = device_of()
    rounds_alone = _rounds(device)
    alone = _plan(workload, profile, strategies, device, search, verify_steps=2)
    assert ahead.candidate == alone.candidate and ahead.candidate.batch_size == at
    assert ahead.verified == alone.verified
    assert [r for r in rounds if pass_two in r] == [r for r in rounds if at in r], rounds
    assert len(rounds) == len(rounds_alone) - 1, (rounds, rounds_alone)
    runs = ahead.stages[0].details["search"]["runs"]
    assert runs == alone.stages[0].details["search"]["runs"]
    logged = [p.batch_size for p in ahead.probes if p.candidate.choices == leader]
    assert logged.count(at) == 1, logged
    # Taken as the leader's pass-2 run: its line has the point, before any confirmation.
    (taken,) = [v for v in ahead.stages[0].variants if v.choices == leader and v.fit]
    assert at in taken.fit.batches, taken.fit
    (kept,) = [v for v in alone.stages[0].variants if v.choices == leader and v.fit]
    assert at not in kept.fit.batches, kept.fit


@pytest.mark.parametrize(("pick_share_of_graphs", "wins"), [(0.9, True), (0.99, False)])
def test_graphs_made_ahead_for_a_pick_under_the_host_bar_are_answered_from_the_stages_runs(
    workload, profile, strategies, linear_device, pick_share_of_graphs: float, wins: bool
) -> None:
    """Rule: for a pick whose host took less than the bar of its step, the graphs step makes
    no device run; where runs of the pick's graphs form were made (bets), the largest that
    held within the limit is read from the stage's runs (PickStage.confirm with no run left)
    and is the pick where it ran MIN_SPEEDUP faster (here the pick at 0.9 of its rate: 1.11x;
    at 0.99: 1.01x, not enough)."""
    from strategies._compile_graphs import GRAPHS_MODE, graphs_pick

    device, _, prober, stage = _stage(workload, profile, strategies, linear_device)
    default = {"precision": "bf16", "compile": "default"}
    graphs = {**default, "compile": GRAPHS_MODE}
    edge = device.edge(Candidate(batch_size=1, choices=graphs))
    made = [edge // 3, edge - 2]
    ran = [stage.run(graphs, b) for b in made]  # the bets, made beside other runs
    assert all(m is not None for m in ran)
    rate = ran[1].samples_per_s * pick_share_of_graphs
    step_ms = edge / rate * 1e3
    pick_measured = ran[1].model_copy(
        update={"step_ms": step_ms, "samples_per_s": rate, "host_ms": 0.5 * step_ms}
    )
    pick = Confirmed(
        candidate=Candidate(batch_size=edge, choices=default),
        found_batch=edge,
        measured=pick_measured,
    )
    before = len(prober.probes)
    got = graphs_pick(stage, CompileSearch(), pick, "throughput", 0)
    assert len(prober.probes) == before  # no device run
    assert got.wins is wins
    if wins:
        assert got.found is not None and got.found.candidate.batch_size == made[1]
        assert got.found.measured.samples_per_s == ran[1].samples_per_s
        assert got.made_under == CompileSearch().host_bound_share


def test_graphs_are_not_searched_for_a_pick_where_the_bets_on_another_set_still_waited(
    workload, profile, strategies, linear_device, trials, monkeypatch
) -> None:
    """Rule: where the CUDA graphs' bets went on another checkpointed set than the graphs
    step's base (here pass 1's bets, sent for 4 blocks), held, and still took the whole of
    their step on the host, slower than that set's default mode (t5_base's graphs on an
    H200, session 37), the graphs step makes no graphs run of its own: the plan makes fewer
    graphs runs than with that rule off (strategies._compile_graphs.waited_elsewhere), to
    the same pick, and the summary says why graphs were not tried."""
    import strategies._compile_graphs as graphs_module

    settings = CompileSearch(checkpointed_static=True, max_candidates=3)
    real_bets = Search._pass_one_bets

    def on_four_blocks(self, first, reserve):  # the bets go on 4 blocks, at a batch it holds
        four = [(v, 40) for v, _ in first if _blocks(v.choices) == 4]
        rest = [(v, b) for v, b in first if _blocks(v.choices) != 4]
        return real_bets(self, four + rest, reserve)

    monkeypatch.setattr(Search, "_pass_one_bets", on_four_blocks)

    def device():
        d = linear_device(
            EAGER_LM, compiled_per_sample=EAGER_LM, fixed_ms=3.0, host_ms=40.0, graphs_ratio=1.3
        )
        d.capabilities = d.capabilities.model_copy(update={"concurrent_runs": 4})
        real_launch = d.launch_ms

        def launch_ms(candidate):  # graphs still wait on the host, and longer than default
            return 1.2 * d.host_ms if d.graphs(candidate) else real_launch(candidate)

        d.launch_ms = launch_ms
        return d

    waits = device()
    plan = _plan(workload, profile, strategies, waits, settings)
    stage = plan.stages[0]
    runs = _graphs_runs(plan, waits)
    assert runs and {_blocks(p.candidate.choices) for p in runs} == {4}, runs
    assert any(p.fits for p in runs)
    graphs = stage.details["graphs"]
    assert not graphs["tried"] and graphs["waited_elsewhere"]["blocks"] == 4, graphs
    assert "were not tried on it: made ahead with 4 blocks checkpointed" in stage.summary
    assert "went unused" not in stage.summary

    monkeypatch.setattr(graphs_module, "waited_elsewhere", lambda stage, settings, choices: None)
    searched = device()
    other = _plan(workload, profile, strategies, searched, settings)
    assert other.candidate == plan.candidate
    assert len(runs) < len(_graphs_runs(other, searched))
    assert other.stages[0].details["graphs"]["tried"]


@pytest.mark.parametrize("runs_at_once", [1, 4])
def test_pass_one_runs_take_the_steps_the_search_sets_and_the_pick_is_measured_in_full(
    workload, profile, strategies, linear_device, trials, record_run_many, runs_at_once: int
) -> None:
    """Rule: with CompileSearch.pass_one_steps, pass 1's runs take that many steps, one at a
    time or at once; no other run does, and the pick's measurement and verification are runs
    of the plan's own steps. On this device, whose lines are exact, the pick is the one the
    search makes without the setting. Why: a card's runs at once take their timed steps in
    turn, 18.3 s of t5_base's 48.1 s pass 1 on an H200 (session 44)."""

    def plan(search: CompileSearch) -> Plan:
        device = linear_device(EAGER_LM, compiled_per_sample=COMPILED_LM, fixed_ms=3.0)
        if runs_at_once > 1:
            _concurrent(device, runs_at_once, record_run_many)
        return _plan(workload, profile, strategies, device, search, probe_steps=6, verify_steps=6)

    full, short = plan(CompileSearch()), plan(CompileSearch(pass_one_steps=3))
    assert short.candidate == full.candidate
    assert all(p.steps == 6 for p in _compile_runs(full) if p.fits)
    runs = [p for p in short.probes if p.stage == "compile" and p.fits]
    shortened = [p for p in runs if p.steps == 3]
    assert shortened and all(p.steps in (3, 6) for p in runs)
    # Pass 1: one run of each candidate at its first batch; those are the short ones.
    first = {json.dumps(p.candidate.choices, sort_keys=True): p for p in reversed(runs)}
    assert {id(p) for p in shortened} <= {id(p) for p in first.values()}
    assert short.verified is not None and short.verified.steps >= 6
    assert short.stages[0].picked
    pick = short.candidate
    own = [
        p
        for p in runs
        if p.batch_size == pick.batch_size
        and p.candidate.choices.get("compile") == pick.choices.get("compile")
        and _blocks(p.candidate.choices) == _blocks(pick.choices)
    ]
    assert own and all(p.steps == 6 for p in own), own
