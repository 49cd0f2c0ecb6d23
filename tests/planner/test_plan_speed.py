"""What makes a plan faster: the compile trial at the probe batch, and the stage times a plan keeps.

Against the planner's fake device and a stand-in compile trial (no inductor): the trial runs
at the eager pick's confirmed batch only when the card has room for it beside a probe (so
the first compiled probe finds that graph in inductor's cache), else at the sample batch; a
trial that ran out of memory there is tried again at the sample batch. Progress and the plan
record each stage's wall time.
"""

from __future__ import annotations

import time

import pytest

from memadvisor.planner import Progress, plan_workload
from memadvisor.planner._prober import Prober as _Prober
from memadvisor.planner._space import SearchSpace
from memadvisor.planner._stage import ProberStage
from memadvisor.schema.candidate import Measurement
from memadvisor.schema.config import PlanConfig
from strategies._compile_stage import ROOM_BESIDES_PROBES_BYTES, compiled_pick, trial_batch
from strategies.compile import Compile, CompileResult, parse_choice

MIB = 2**20
BUDGET = 100 * MIB
QUIET = Progress(enabled=False)
ROOM = 2 * BUDGET + ROOM_BESIDES_PROBES_BYTES  # free bytes that let the trial use the probe batch


def _config(**overrides) -> PlanConfig:
    fast = {"probe_steps": 2, "timing_steps": 2, "verify_steps": 4, "options": {"compile": "on"}}
    if "compile" in overrides:
        fast["options"] = {"compile": overrides.pop("compile")}
    return PlanConfig(**{"budget_bytes": BUDGET, **fast, **overrides})


@pytest.fixture
def trials(monkeypatch) -> list:
    """try_compile replaced: answers at once; runs out of memory above ``trials.oom_above``."""

    class Trials(list):
        oom_above: int | None = None

        def __call__(self, workload, choice, *, candidate=None, device=None, **kwargs):
            self.append(candidate)
            oom = self.oom_above is not None and candidate.batch_size > self.oom_above
            return CompileResult(
                choice=parse_choice(choice).to_json(),
                ok=not oom,
                reason="the compiled step ran out of memory." if oom else "",
                out_of_memory=oom,
                batch_size=candidate.batch_size,
                steps=3,
                eager_step_ms=10.0,
                first_step_ms=None if oom else 2010.0,
                compiled_step_ms=None if oom else 8.0,
                graphs=1,
            )

    stand_in = Trials()
    monkeypatch.setattr("strategies.compile.try_compile", stand_in)
    return stand_in


def _faster_compiled(fake_device, **kwargs):
    class Faster(fake_device):
        def run(self, workload, candidate, steps) -> Measurement:
            m = super().run(workload, candidate, steps)
            if "compile" not in candidate.choices:
                return m
            return m.model_copy(
                update={"step_ms": m.step_ms / 1.5, "samples_per_s": m.samples_per_s * 1.5}
            )

    return Faster(**kwargs)


def _refine(prober, eager, *, cache_dir, free_bytes):
    """The compile strategy's stage through the planner's PickStage, on a card with
    ``free_bytes`` free: (the pick, the outcome)."""
    strategy = next(s for s in prober.space.strategies if s.name == "compile")
    stage = ProberStage(prober, "compile", QUIET)
    stage.device = stage.device.model_copy(update={"free_bytes": free_bytes})
    result = compiled_pick(stage, eager, strategy, cache_dir=cache_dir)
    return result.pick, result.outcome


def _eager_pick(profile, strategies, device, workload):
    space = SearchSpace(profile, [*strategies, Compile(choices=["default"])], _config())
    prober = _Prober(device, workload, space, space.config)
    eager = prober.confirm(space.score_choices({"precision": "bf16"}))
    assert eager is not None
    return prober, eager


@pytest.mark.parametrize(
    ("free_bytes", "expected"),
    [
        (None, 4),  # not a card: the sample batch
        (ROOM, 40),  # two budgets and the room besides: the probes' batch
        (ROOM - 1, 4),  # a byte short: the sample batch
        (10 * ROOM, 40),
    ],
)
def test_the_trial_uses_the_probe_batch_only_where_the_card_has_room(free_bytes, expected):
    """The trial runs in the planner's process beside a probe capped at the budget: it takes
    the search's start batch only when the card holds two budgets and ROOM_BESIDES_PROBES_BYTES
    more."""
    assert trial_batch(40, 4, BUDGET, free_bytes) == expected


def test_with_room_the_trial_compiles_the_graph_the_first_compiled_probe_runs(
    profile, strategies, workload, fake_device, trials, tmp_path
) -> None:
    """The trial ran once, at the eager pick's confirmed batch with its choices, and the first
    compiled run is at that batch: the graph inductor cached for it."""
    device = _faster_compiled(fake_device, threshold=40)
    prober, eager = _eager_pick(profile, strategies, device, workload)
    _, outcome = _refine(prober, eager, cache_dir=tmp_path, free_bytes=ROOM)
    assert [(c.batch_size, c.choices) for c in trials] == [
        (eager.found_batch, {"precision": "bf16"})
    ]
    first = next(p for p in prober.probes if p.stage == "compile")
    assert first.batch_size == eager.found_batch
    assert outcome is not None and outcome.picked


def test_a_trial_out_of_memory_at_the_probe_batch_is_tried_at_the_sample_batch(
    profile, strategies, workload, fake_device, trials, tmp_path
) -> None:
    """Out of memory in the planner's process says nothing about compiling: the trial runs
    again at the sample batch, and the variant is measured on the device."""
    trials.oom_above = workload.sample_batch_size
    device = _faster_compiled(fake_device, threshold=40)
    prober, eager = _eager_pick(profile, strategies, device, workload)
    _, outcome = _refine(prober, eager, cache_dir=tmp_path, free_bytes=ROOM)
    assert [c.batch_size for c in trials] == [eager.found_batch, workload.sample_batch_size]
    assert outcome is not None and outcome.variants[0].ok
    assert outcome.variants[0].measured is not None


def test_progress_times_each_stage_also_silent_and_when_it_raises() -> None:
    """stage_wall_ms adds up per name, with the bars off, and counts a stage that raised."""
    ui = Progress(enabled=False)
    for _ in range(2):
        with ui.stage("a"):
            time.sleep(0.01)
    with pytest.raises(RuntimeError), ui.stage("b"):
        time.sleep(0.01)
        raise RuntimeError("boom")
    assert list(ui.stage_wall_ms) == ["a", "b"]
    assert ui.stage_wall_ms["a"] >= 20.0 and ui.stage_wall_ms["b"] >= 10.0


def test_a_plan_records_its_own_stage_times(profile, strategies, workload, fake_device) -> None:
    """Plan.stage_wall_ms lists the stages in the order they ran, none longer than the plan;
    a Progress shared with an earlier plan does not carry that plan's stages over."""
    ui = Progress(enabled=False)
    with ui.stage("profiling"):
        time.sleep(0.05)  # an earlier plan's profiling
    plan = plan_workload(
        workload,
        _config(compile="off"),
        profile=profile,
        device=fake_device(threshold=40),
        progress=ui,
        strategies=list(strategies),
    )
    stages = list(plan.stage_wall_ms)
    assert stages[:2] == ["search", "probes"] and stages[-1] == "checks"
    assert "verify" in stages
    assert "profiling" not in stages  # the profile was given; the earlier plan's is not ours
    assert sum(plan.stage_wall_ms.values()) <= plan.plan_wall_ms
