"""compiled_pick (Compile.refine): compiled configurations are tried, measured and kept only
when faster.

The device is the planner's fake one with a compiled speed-up of the test's choosing, and the
compile trial is replaced by a stand-in that answers at once, so what is checked is the
planner's rule: a model that does not compile is a note and the plan stays eager; a compiled
variant is kept only when its measured throughput beats eager's by MIN_SPEEDUP; the one-off
compile time and the cache's cost reach the plan and its report. These tests compile the
eager pick's own choices in the offered form (``PICK_ONLY``); the search over checkpointed
sets and the regional form has tests/planner/test_compiled_search.py. One test compiles for real
with inductor (marked slow); one lets dynamo find nothing to compile (fast, no inductor).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from memadvisor.planner import Progress
from memadvisor.planner._prober import Prober
from memadvisor.planner._space import SearchSpace
from memadvisor.planner._stage import ProberStage
from memadvisor.report._facts import answer, device_runs
from memadvisor.report._words import answer_rows
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.plan import Plan
from memadvisor.schema.profile import DeviceInfo
from memadvisor.workload import Workload
from strategies._compile_search import search_variants
from strategies._compile_stage import MIN_SPEEDUP, compiled_pick, kept_share
from strategies.compile import Compile, CompileResult, CompileSearch, parse_choice
from tests.fixtures.compile_trials import TRIAL_FIRST_MS, TRIAL_STEADY_MS, trial_result

MIB = 2**20
QUIET = Progress(enabled=False)
ALL = ["b0", "b1", "b2", "b3"]  # every block of the planner's fake profile


def _config(**overrides) -> PlanConfig:
    fast = {"probe_steps": 2, "timing_steps": 2, "verify_steps": 4, "options": {"compile": "on"}}
    if "compile" in overrides:
        fast["options"] = {"compile": overrides.pop("compile")}
    return PlanConfig(**{"budget_bytes": 100 * MIB, **fast, **overrides})


# The search form of "default" (runs measure it; the pick is "default" again).
DYNAMIC = {"mode": "default", "dynamic_batch": True}


def _compiling_device(fake_device, speedup: dict[str, float], *, writes=True, **kwargs):
    """The fake device, its compiled runs ``speedup[static choice as JSON]`` times faster; with
    ``writes`` each compiled run writes 1 KiB of "kernels" where a probe's inductor would."""

    class CompilingDevice(fake_device):
        def run(self, workload, candidate, steps) -> Measurement:
            m = super().run(workload, candidate, steps)
            choice = candidate.choices.get("compile")
            if choice is not None and writes:
                cache = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
                (cache / f"kernel-{len(self.calls)}.so").write_bytes(b"k" * 1024)
            # The search's dynamic batch runs as its static form does here (same graph).
            static = parse_choice(choice).static().to_json() if choice is not None else None
            factor = speedup.get(json.dumps(static), 1.0) if choice is not None else 1.0
            return m.model_copy(
                update={"step_ms": m.step_ms / factor, "samples_per_s": m.samples_per_s * factor}
            )

    return CompilingDevice(**kwargs)


@pytest.fixture
def trials(monkeypatch) -> list[dict]:
    """try_compile replaced: every choice compiles at once; the calls are listed."""
    calls: list[dict] = []

    def stand_in(workload, choice, *, candidate=None, device=None, **kwargs) -> CompileResult:
        calls.append({"choice": choice, "candidate": candidate, "device": device})
        return trial_result(choice, candidate)

    monkeypatch.setattr("strategies.compile.try_compile", stand_in)
    return calls


# The eager pick's own choices compiled in the offered form: the verdict's rules alone.
PICK_ONLY = CompileSearch(regional=False, max_candidates=1)


def _setup(profile, strategies, device, workload, eager_choices, search=PICK_ONLY, **config):
    """A prober over fake precision, checkpointing and the real compile strategy (searching as
    ``search`` says), and the eager pick ``eager_choices`` confirmed on ``device``."""
    compile_strategy = Compile(search=search)
    space = SearchSpace(profile, [*strategies, compile_strategy], _config(**config))
    prober = Prober(device, workload, space, space.config)
    eager = prober.confirm(space.score_choices(eager_choices))
    assert eager is not None
    return prober, eager, compile_strategy


def _refine(prober, eager, notes: list[str], *, cache_dir=None):
    """The compile strategy's stage through the planner's PickStage, as plan_workload runs it:
    (the pick, the outcome), its notes added to ``notes``."""
    strategy = next(s for s in prober.space.strategies if s.name == "compile")
    stage = ProberStage(prober, "compile", QUIET)
    result = compiled_pick(stage, eager, strategy, cache_dir=cache_dir)
    notes += result.notes
    return result.pick, result.outcome


def _compile_runs(prober) -> list:
    return [p for p in prober.probes if p.stage == "compile"]


# -- the verdict ------------------------------------------------------------------------------


def test_a_faster_compiled_variant_is_the_pick_with_its_compile_time(
    profile, strategies, workload, fake_device, trials, tmp_path
) -> None:
    """1.5x faster on the device: the compiled variant is returned, its search starts at the
    eager pick's confirmed batch, and the outcome carries the trial's compile time and the
    shared cache; the strategy's check reuses the trial instead of compiling again."""
    device = _compiling_device(fake_device, {'"default"': 1.5}, threshold=40)
    prober, eager, strategy = _setup(profile, strategies, device, workload, {"precision": "bf16"})
    notes: list[str] = []
    pick, outcome = _refine(prober, eager, notes, cache_dir=tmp_path)

    assert pick is not eager
    assert pick.candidate.choices == {"precision": "bf16", "compile": "default"}
    assert pick.measured.samples_per_s >= MIN_SPEEDUP * eager.measured.samples_per_s
    runs = _compile_runs(prober)
    assert runs and runs[0].batch_size == eager.found_batch
    # The search's runs measured a dynamic batch (one cached graph for every batch); the
    # pick, handed on to the verification and the user, is the static form, run once last
    # at its batch: whether compiling pays is judged on that run.
    assert all(r.candidate.choices["compile"] == DYNAMIC for r in runs[:-1])
    assert runs[-1].candidate == pick.candidate and runs[-1].fits
    assert outcome is not None and outcome.picked
    assert outcome.one_off_ms == pytest.approx(TRIAL_FIRST_MS - TRIAL_STEADY_MS)
    # The device runs saw the shared cache in their environment, and it was measured.
    cache = outcome.details["cache"]
    assert isinstance(cache, dict) and cache["cache_dir"] == str(tmp_path.resolve())
    assert cache["added_bytes"] == 1024 * sum(r.fits for r in runs)  # a fit writes
    ratio = pick.measured.samples_per_s / eager.measured.samples_per_s
    assert notes[0].startswith("Compiled:") and f"{ratio:.2f}x the eager pick's" in notes[0]
    assert notes[1].startswith("Compiled memory of")  # how its line was learned
    assert "inductor's on-disk cache" in notes[2]
    # The trial ran once, at the sample batch with the pick's other choices.
    assert len(trials) == 1 and trials[0]["candidate"] == Candidate(
        batch_size=workload.sample_batch_size, choices={"precision": "bf16"}
    )
    check = strategy.check(workload, "default")
    assert len(trials) == 1 and check is not None and check.passed
    effect = strategy.explain("default", profile).effect
    assert f"({ratio:.2f}x, steady state)" in effect and "2.0 s of compiling" in effect


def test_a_compiled_variant_not_faster_enough_keeps_the_eager_pick(
    profile, strategies, workload, fake_device, trials, tmp_path
) -> None:
    """Measured 1% faster (under MIN_SPEEDUP): eager stays, the note says why."""
    device = _compiling_device(fake_device, {'"default"': 1.01}, threshold=40)
    prober, eager, _ = _setup(profile, strategies, device, workload, {"precision": "bf16"})
    notes: list[str] = []
    pick, outcome = _refine(prober, eager, notes, cache_dir=tmp_path)
    assert pick is eager
    assert outcome is not None and not outcome.picked and outcome.one_off_ms is None
    assert outcome.variants[0].measured is not None  # it was measured, and lost
    assert notes[0].startswith("Planned eager because compiling did not pay")


def test_a_model_that_does_not_compile_is_a_note_and_no_device_run(
    profile, strategies, fake_device
) -> None:
    """The real trial on a forward dynamo must skip: no graph, so planned eager, nothing probed."""

    class Opaque(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(4, 1)

        @torch.compiler.disable
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.a(x)

    workload = Workload(
        model=Opaque(), sample_batch=torch.randn(2, 4), loss_fn=lambda out, batch: out.mean()
    )
    device = _compiling_device(fake_device, {'"default"': 2.0}, threshold=40)
    prober, eager, _ = _setup(profile, strategies, device, workload, {})
    notes: list[str] = []
    pick, outcome = _refine(prober, eager, notes)
    assert pick is eager
    assert outcome is not None and not outcome.picked
    assert outcome.variants and not any(v.ok for v in outcome.variants)
    assert not _compile_runs(prober) and "cache" not in outcome.details
    assert notes == [outcome.summary]
    assert notes[0].startswith("Planned eager because no compiled variant ran")
    assert "no graph" in notes[0]


def test_a_compiled_variant_failing_on_the_device_keeps_the_eager_pick(
    profile, strategies, workload, fake_device, trials
) -> None:
    """A compiled probe raising (not an out-of-memory) is recorded; the plan stays eager."""

    class Exploding(fake_device):
        def run(self, workload, candidate, steps) -> Measurement:
            if "compile" in candidate.choices:
                raise RuntimeError("inductor crashed in the probe process")
            return super().run(workload, candidate, steps)

    prober, eager, _ = _setup(profile, strategies, Exploding(threshold=40), workload, {})
    notes: list[str] = []
    pick, outcome = _refine(prober, eager, notes)
    assert pick is eager and outcome is not None and not outcome.picked
    assert "inductor crashed" in outcome.variants[0].error
    assert "inductor crashed" in notes[0]


def test_largest_batch_objective_takes_a_compiled_variant_that_fits_more(
    profile, strategies, workload, fake_device, trials, tmp_path
) -> None:
    """Objective largest_batch: a compiled variant that holds a larger batch wins though slower."""

    def threshold(candidate: Candidate) -> int:
        return 50 if "compile" in candidate.choices else 40

    device = _compiling_device(fake_device, {'"default"': 0.9}, threshold=threshold)
    prober, eager, _ = _setup(profile, strategies, device, workload, {}, objective="largest_batch")
    pick, outcome = _refine(prober, eager, [], cache_dir=tmp_path)
    assert pick.candidate.batch_size > eager.candidate.batch_size
    assert outcome is not None and outcome.picked


def test_a_model_a_dynamic_batch_breaks_is_searched_static(
    profile, strategies, workload, fake_device, monkeypatch, tmp_path
) -> None:
    """Where the dynamic-batch form does not compile (a graph that a symbolic batch breaks),
    the form is trialled static and its candidates are searched static; the note says why."""
    tried: list = []

    def stand_in(workload, choice, *, candidate=None, device=None, **kwargs) -> CompileResult:
        tried.append(choice)
        dynamic = parse_choice(choice).dynamic_batch
        error = "symbolic batch: a guard failed" if dynamic else None
        return trial_result(choice, candidate, ok=not dynamic, error=error)

    monkeypatch.setattr("strategies.compile.try_compile", stand_in)
    device = _compiling_device(fake_device, {'"default"': 1.5}, threshold=40)
    prober, eager, _ = _setup(profile, strategies, device, workload, {"precision": "bf16"})
    pick, outcome = _refine(prober, eager, [], cache_dir=tmp_path)
    assert tried[:2] == [DYNAMIC, "default"]
    runs = _compile_runs(prober)
    assert runs and all(r.candidate.choices["compile"] == "default" for r in runs)
    assert pick.candidate.choices == {"precision": "bf16", "compile": "default"}
    assert outcome is not None and outcome.picked
    assert any("Searched with a static batch" in v.trial for v in outcome.variants)


# -- which variants ---------------------------------------------------------------------------


def test_the_partitioner_budget_replaces_block_checkpointing_at_the_picks_kept_share(
    profile, strategies, workload, fake_device, trials, tmp_path
) -> None:
    """Each block keeps 1 MiB a sample of 4.5 in all: checkpointing 2 keeps 2.5/4.5 = 0.56,
    rounded up to 0.6. The candidates: the pick's own blocks compiled, the other checkpointed
    sets (none, all: half is the pick's own), then the budget in place of the pick's blocks;
    without blocks in the pick there is no budget candidate."""
    eager_choices = {"checkpointing": ["b0", "b1"]}
    assert kept_share(profile, eager_choices, 10) == 0.6
    budget = {"mode": "default", "activation_memory_budget": 0.6}
    speedup = {'"default"': 1.1, json.dumps(budget): 1.4}
    device = _compiling_device(fake_device, speedup, threshold=40)
    search = CompileSearch(regional=False, dynamic_batch=False)
    prober, eager, strategy = _setup(profile, strategies, device, workload, eager_choices, search)
    stage = ProberStage(prober, "compile", QUIET)

    def share(choices, batch):
        return kept_share(profile, choices, batch)

    variants, left_out = search_variants(stage, eager, strategy.offered, strategy.search, share)
    chosen = [v.choices for v in variants]
    assert chosen[0] == {"checkpointing": ["b0", "b1"], "compile": "default"}
    assert sorted(map(json.dumps, chosen[1:3])) == sorted(
        map(json.dumps, [{"compile": "default"}, {"checkpointing": ALL, "compile": "default"}])
    )
    assert kept_share(profile, eager_choices, eager.found_batch) == 0.6  # at any batch
    assert chosen[3] == {"compile": budget} and left_out == []
    plain = dataclasses.replace(eager, candidate=Candidate(batch_size=eager.found_batch))
    no_blocks, _ = search_variants(stage, plain, strategy.offered, strategy.search, share)
    assert all("activation_memory_budget" not in json.dumps(v.choices) for v in no_blocks)

    # On the device the partitioner's recompute is the faster one: it is the pick.
    pick, outcome = _refine(prober, eager, [], cache_dir=tmp_path)
    assert pick.candidate.choices == {"compile": budget}
    assert outcome is not None and all(v.ok for v in outcome.variants)


def test_a_budget_form_is_not_trialled_where_its_budget_free_form_was(
    profile, strategies, workload, fake_device, trials, tmp_path
) -> None:
    """The partitioner budget changes what backward recomputes, not what is computed: its
    form is not compiled again in the planner's process where the form without it was
    trialled (the trial stands for it, said in its record), and the strategy's check of a
    budget pick reuses that trial instead of compiling."""
    eager_choices = {"checkpointing": ["b0", "b1"]}
    budget = {"mode": "default", "activation_memory_budget": 0.6}
    device = _compiling_device(
        fake_device, {'"default"': 1.1, json.dumps(budget): 1.4}, threshold=40
    )
    search = CompileSearch(regional=False)
    prober, eager, strategy = _setup(profile, strategies, device, workload, eager_choices, search)
    pick, outcome = _refine(prober, eager, [], cache_dir=tmp_path)
    assert [t["choice"] for t in trials] == [DYNAMIC]  # one trial, the budget-free form
    assert pick.candidate.choices == {"compile": budget}
    assert outcome is not None and outcome.picked
    budgeted = [v for v in outcome.variants if "activation_memory_budget" in json.dumps(v.choices)]
    assert budgeted and all(v.ok and v.trial.startswith("not trialled") for v in budgeted)
    check = strategy.check(workload, budget)
    assert check is not None and check.passed and len(trials) == 1


def test_compile_is_weighed_only_when_asked_and_measurable(
    profile, strategies, workload, fake_device, trials
) -> None:
    """auto: not on a device that is not CUDA; off: never; on: not where step times don't rank
    (said in a note). Nothing is compiled or run in these cases. Probes sharing one process
    (CudaDevice's last fallback, which resets dynamo around each compiled run) still weigh
    compiling."""
    device = _compiling_device(fake_device, {'"default"': 2.0}, threshold=40)
    for policy in ("auto", "off"):
        prober, eager, _ = _setup(profile, strategies, device, workload, {}, compile=policy)
        notes: list[str] = []
        assert _refine(prober, eager, notes) == (eager, None)
        assert notes == [] and not _compile_runs(prober)

    class Untimed(fake_device):
        capabilities = fake_device.capabilities.model_copy(update={"step_times_rank": False})

    class InProcess(fake_device):
        # As CudaDevice when its probes cannot run in fresh processes.
        capabilities = fake_device.capabilities.model_copy(update={"fresh_processes": False})

    prober, eager, _ = _setup(profile, strategies, Untimed(threshold=40), workload, {})
    notes = []
    assert _refine(prober, eager, notes) == (eager, None)
    assert "cannot tell a compiled step" in notes[0] and not _compile_runs(prober)
    assert trials == []

    prober, eager, _ = _setup(profile, strategies, InProcess(threshold=40), workload, {})
    _, outcome = _refine(prober, eager, [])
    assert outcome is not None and _compile_runs(prober) and trials


def test_compile_on_needs_the_compile_strategy() -> None:
    """A compile option with strategies that leave compile out is refused, naming the fix."""
    with pytest.raises(ValueError, match="add 'compile'"):
        PlanConfig(budget_bytes=MIB, options={"compile": "on"}, strategies=["precision"])


# -- the plan and its report ------------------------------------------------------------------


def test_the_report_shows_the_speedup_compile_time_and_cache(
    profile, strategies, workload, fake_device, trials, tmp_path
) -> None:
    """The answer's Compile row: the ratio to eager, the one-off compile and the cache; the
    compiled choice is not repeated under 'Also'; the runs line counts the compiling runs;
    the plan round-trips through JSON with its outcome."""
    device = _compiling_device(fake_device, {'"default"': 1.5}, threshold=40)
    prober, eager, strategy = _setup(profile, strategies, device, workload, {})
    notes: list[str] = []
    pick, outcome = _refine(prober, eager, notes, cache_dir=tmp_path)
    plan = Plan(
        model_name="Toy",
        config=prober.config,
        device_kind="fake",
        device_name="fake",
        candidate=pick.candidate,
        estimate=pick.scored.estimate,
        verified=pick.measured,
        probes=prober.probes,
        notes=notes,
        stages=[outcome],
        profile=profile.model_copy(update={"device": DeviceInfo(kind="cuda", name="gpu")}),
    )
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    rows = dict(answer_rows(answer(plan)))
    ratio = pick.measured.samples_per_s / eager.measured.samples_per_s
    assert rows["Compile"].startswith(f"torch.compile (default mode): {ratio:.2f}× the eager")
    assert "2002 ms" in rows["Compile"] and str(tmp_path.resolve()) in rows["Compile"]
    assert "Also" not in rows
    assert "compiling (compiled variants)" in device_runs(plan)

    lost = outcome.model_copy(update={"picked": False, "one_off_ms": None})
    eager_plan = plan.model_copy(update={"stages": [lost], "candidate": eager.candidate})
    assert "planned eager" in dict(answer_rows(answer(eager_plan)))["Compile"]


# -- for real ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_real_inductor_compile_is_tried_and_a_faster_variant_kept(
    profile, strategies, fake_device
) -> None:
    """Inductor compiles a tiny MLP on this machine's gcc (the trial times it), the device
    says compiled is faster, so it is the pick, and the plan's check reuses that trial.

    The MLP, batch and loss are tests/strategies/test_compile.py's, so with the user's
    inductor cache warm from those tests this one loads their kernels (seconds, not ~20 s).
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))
    torch.manual_seed(1)
    workload = Workload(
        model=model,
        sample_batch=(torch.randn(8, 16), torch.randn(8, 4)),
        loss_fn=lambda out, batch: nn.functional.mse_loss(out, batch[1]),
    )
    device = _compiling_device(fake_device, {'"default"': 1.5}, writes=False, threshold=40)
    prober, eager, strategy = _setup(profile, strategies, device, workload, {})
    pick, outcome = _refine(prober, eager, [])
    assert outcome is not None and outcome.picked, outcome.summary
    assert outcome.one_off_ms is not None and outcome.one_off_ms > 0
    assert strategy.results and strategy.check(workload, "default").passed


@pytest.mark.gpu
def test_cuda_compiled_variant_is_trialled_measured_in_fresh_processes_and_judged(
    examples_dir,
) -> None:
    """On a card: the gpt example's bf16 pick compiles in the trial, the compiled candidates
    run in fresh processes under the shared cache within the search's runs, and the verdict
    follows MIN_SPEEDUP over the confirmed compiled configurations."""
    from memadvisor.device.cuda import CudaDevice
    from memadvisor.profiler import profile_workload
    from memadvisor.strategy import load_strategies
    from memadvisor.target import load_target

    target = f"{examples_dir / 'gpt.py'}:build"
    workload = load_target(target)
    profile = profile_workload(workload, device="cuda")
    config = PlanConfig(budget_bytes=2 * 2**30, device="cuda", options={"compile": "auto"})
    space = SearchSpace(profile, load_strategies(), config)
    device = CudaDevice(config.budget_bytes, target=target, profile=profile)
    try:
        prober = Prober(device, workload, space, config)
        eager = prober.confirm(space.score_choices({"precision": "bf16"}))
        assert eager is not None
        pick, outcome = _refine(prober, eager, [])
    finally:
        device.close()
    assert outcome is not None and outcome.variants[0].ok, outcome.summary
    variant = outcome.variants[0]
    assert variant.measured is not None and variant.one_off_ms and variant.one_off_ms > 0, (
        outcome.summary
    )
    assert all(p.fits or p.error for p in prober.probes if p.stage == "compile"), outcome.summary
    assert outcome.picked == (pick is not eager), outcome.summary
    confirmed = [v.measured for v in outcome.variants if v.confirmed and v.measured]
    best = max((m.samples_per_s for m in confirmed), default=0.0)
    assert outcome.picked == (best >= MIN_SPEEDUP * eager.measured.samples_per_s), (
        best,
        eager.measured.samples_per_s,
        outcome.summary,
    )
    runs = [p for p in prober.probes if p.stage == "compile"]
    made = [(p.batch_size, p.fits, p.candidate.choices.get("compile")) for p in runs]
    # The search's own runs are within max_runs; the winner's static-form run (the search's
    # verdict, cf3ad48) and the CUDA graphs' runs (bets beside pass 1 where the eager pick
    # waited on the host, and the graphs step's) are counted apart (Search.runs_used). Session
    # 42 call A: this test failed on an H200, its message lost (it passed in call B); the
    # bound it had, without the graphs' runs, is the likely cause: hf_gpt2's plan in that call
    # made 14 compile runs, 8 of the search's, 1 static and 5 of the graphs.
    search = outcome.details["search"]
    assert search["runs"] <= search["max_runs"], (search, made)
    assert len(runs) >= search["runs"] + search["static_runs"] + search["graphs_runs"], (
        search,
        made,
    )
