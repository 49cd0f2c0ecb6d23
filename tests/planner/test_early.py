"""Compile trials started early: on a thread while the eager probes run, taken by the compile stage.

Against the planner's fake device (which runs "apart" here, as a card's fork server does) and
a stand-in trial, so what is checked is the scheduling: the trial starts before the eager
probes finish, at the timing batch only when the card has room, is not run twice, is waited
for before any run in this process, and a trial the compile stage cannot use (another
variant, out of memory) is replaced by the old in-stage trial at the sample batch. Also the
stage times a plan records.
"""

from __future__ import annotations

import threading
import time

import pytest

from memadvisor.config import PlanConfig
from memadvisor.device import Measurement
from memadvisor.planner import Progress, plan_workload
from memadvisor.planner._compiled import compiled_pick, start_early_trials
from memadvisor.planner._early import ROOM_BESIDES_PROBES_BYTES, early_trial_batch
from memadvisor.planner._plan import _Prober
from memadvisor.planner._space import SearchSpace
from strategies.compile import Compile, CompileResult, parse_choice

MIB = 2**20
BUDGET = 100 * MIB
QUIET = Progress(enabled=False)
ROOM = 2 * BUDGET + ROOM_BESIDES_PROBES_BYTES  # free bytes that let the trial use the probe batch


def _config(**overrides) -> PlanConfig:
    fast = {"probe_steps": 2, "timing_steps": 2, "verify_steps": 4, "compile": "on"}
    return PlanConfig(**{"budget_bytes": BUDGET, **fast, **overrides})


def _apart(fake_device, speedup: float = 1.5, **kwargs):
    """The fake device, its runs in "other processes" (runs_apart), compiled runs faster;
    each run records whether the trial had started when it began (waiting up to a second
    for it in the first run, so a trial that only starts later shows as False)."""

    class Apart(fake_device):
        apart = True

        def __init__(self, trial_started: threading.Event, **kw) -> None:
            super().__init__(**kw)
            self.trial_started = trial_started
            self.seen_trial: list[bool] = []
            self.started_at: list[float] = []

        def runs_apart(self) -> bool:
            return self.apart

        def run(self, workload, candidate, steps) -> Measurement:
            if not self.calls:
                self.trial_started.wait(1.0)
            self.seen_trial.append(self.trial_started.is_set())
            self.started_at.append(time.perf_counter())
            m = super().run(workload, candidate, steps)
            if "compile" in candidate.choices:
                m = m.model_copy(
                    update={
                        "step_ms": m.step_ms / speedup,
                        "samples_per_s": m.samples_per_s * speedup,
                    }
                )
            return m

    started = threading.Event()
    return Apart(started, **kwargs), started


@pytest.fixture
def trials(monkeypatch):
    """try_compile replaced: sets ``started`` on entry, can be held back or run out of memory."""

    class Trials:
        def __init__(self) -> None:
            self.calls: list[dict] = []
            self.started: threading.Event | None = None
            self.hold_s = 0.0
            self.done_at: list[float] = []
            self.oom_above: int | None = None

        def __call__(self, workload, choice, *, candidate=None, device=None, **kw):
            if self.started is not None:
                self.started.set()
            self.calls.append({"choice": choice, "candidate": candidate})
            time.sleep(self.hold_s)
            self.done_at.append(time.perf_counter())
            oom = self.oom_above is not None and candidate.batch_size > self.oom_above
            return CompileResult(
                choice=parse_choice(choice).to_json(),
                ok=not oom,
                reason="ran out of memory" if oom else "",
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


def _strategies(strategies) -> list:
    return [*strategies, Compile(choices=["default"])]


# -- the batch the early trial runs at ------------------------------------------------------


@pytest.mark.parametrize(
    ("free_bytes", "expected"),
    [
        (None, 4),  # not a card: the sample batch
        (ROOM, 40),  # two budgets and the room besides: the probes' batch
        (ROOM - 1, 4),  # a byte short: the sample batch
        (10 * ROOM, 40),
    ],
)
def test_the_early_trial_uses_the_probe_batch_only_where_the_card_has_room(
    free_bytes, expected
) -> None:
    """The trial runs in this process beside a probe's process: it takes the timing batch only
    when the card holds two budgets and ROOM_BESIDES_PROBES_BYTES more."""
    assert early_trial_batch(40, 4, BUDGET, free_bytes) == expected


# -- through the whole plan ----------------------------------------------------------------


def test_a_plan_starts_the_trial_before_the_eager_probes_and_runs_it_once(
    profile, strategies, workload, fake_device, trials, monkeypatch
) -> None:
    """With room on the card, the trial of the estimate's best candidate starts before the
    first eager run, at that candidate's timing batch (where the eager pick usually stays, so
    its compiled probe finds the graph in the cache); the compile stage takes it instead of
    trialling again."""
    monkeypatch.setattr("memadvisor.planner._plan._free_bytes", lambda device: ROOM)
    device, started = _apart(fake_device, threshold=40)
    trials.started = started
    precision_only = [s for s in strategies if s.name == "precision"]
    plan = plan_workload(
        workload,
        _config(),
        profile=profile,
        device=device,
        progress=False,
        strategies=_strategies(precision_only),
    )
    assert device.seen_trial[0], "the first eager run began before the trial started"
    assert len(trials.calls) == 1  # not again in the compile stage
    first_timing = next(p for p in plan.probes if p.stage == "timing")
    trial = trials.calls[0]["candidate"]
    assert trial == first_timing.candidate  # bf16 at its timing batch
    assert plan.compile is not None and plan.compile.picked
    assert plan.compile.eager_candidate.choices == trial.choices  # the eager pick's choices


def test_a_device_that_runs_in_this_process_gets_no_early_trial(
    profile, strategies, workload, fake_device, trials
) -> None:
    """runs_apart False (the fake device's default, a card probing in-process): the trial runs
    in the compile stage, at the sample batch, after every eager run."""
    device = fake_device(threshold=40)
    plan = plan_workload(
        workload,
        _config(),
        profile=profile,
        device=device,
        progress=False,
        strategies=_strategies(strategies),
    )
    assert len(trials.calls) == 1
    assert trials.calls[0]["candidate"].batch_size == workload.sample_batch_size
    assert plan.compile is not None


def test_compile_off_starts_no_trial(profile, strategies, workload, fake_device, trials) -> None:
    """compile='off': nothing is trialled, early or late."""
    device, _ = _apart(fake_device, threshold=40)
    plan_workload(
        workload,
        _config(compile="off"),
        profile=profile,
        device=device,
        progress=False,
        strategies=_strategies(strategies),
    )
    assert trials.calls == []


def test_a_run_in_this_process_waits_for_the_running_trial(
    profile, strategies, workload, fake_device, trials, monkeypatch
) -> None:
    """A device that stops running apart (its fork server could not load the workload) gets
    no run while the trial runs: every run after the switch starts after the trial ended."""
    device, started = _apart(fake_device, threshold=40)
    trials.started, trials.hold_s = started, 0.3
    original = type(device).run

    def run_then_switch(self, workload, candidate, steps):
        m = original(self, workload, candidate, steps)
        self.apart = False  # from now on runs come to this process
        return m

    monkeypatch.setattr(type(device), "run", run_then_switch)
    plan_workload(
        workload,
        _config(),
        profile=profile,
        device=device,
        progress=False,
        strategies=_strategies(strategies),
    )
    assert len(device.started_at) > 1 and trials.done_at
    early_done = trials.done_at[0]  # the early trial's end (later ones run in the stage)
    assert all(t >= early_done for t in device.started_at[1:])


# -- the compile stage takes what it can -----------------------------------------------------


def _prober(profile, strategies, device, workload):
    space = SearchSpace(profile, _strategies(strategies), _config())
    return _Prober(device, workload, space, space.config), space


def test_a_trial_of_another_variant_is_not_taken(
    profile, strategies, workload, fake_device, trials
) -> None:
    """The early trial was of bf16, the eager pick is fp32: the compile stage trials fp32 at the
    sample batch itself (two trials in all)."""
    device, started = _apart(fake_device, threshold=40)
    trials.started = started
    prober, space = _prober(profile, strategies, device, workload)
    bf16 = space.score_choices({"precision": "bf16"})
    early = start_early_trials(prober, [bf16], free_bytes=ROOM)
    assert early is not None
    eager = prober.confirm(space.score_choices({}))
    compiled_pick(prober, eager, [], QUIET, early=early)
    early.close()
    assert [c["candidate"].choices for c in trials.calls] == [{"precision": "bf16"}, {}]
    assert trials.calls[1]["candidate"].batch_size == workload.sample_batch_size


def test_a_trial_that_ran_out_of_memory_is_tried_again_at_the_sample_batch(
    profile, strategies, workload, fake_device, trials
) -> None:
    """Out of memory at the probe batch in this process says nothing about compiling: the
    compile stage trials again at the sample batch, and the variant is measured."""
    device, started = _apart(fake_device, threshold=40)
    trials.started, trials.oom_above = started, workload.sample_batch_size
    prober, space = _prober(profile, strategies, device, workload)
    scored = space.score_choices({"precision": "bf16"})
    early = start_early_trials(prober, [scored], free_bytes=ROOM)
    assert early is not None
    eager = prober.confirm(scored)
    _, outcome = compiled_pick(prober, eager, [], QUIET, early=early)
    early.close()
    batches = [c["candidate"].batch_size for c in trials.calls]
    assert batches[0] > workload.sample_batch_size
    assert batches[1:] == [workload.sample_batch_size]
    assert outcome is not None and outcome.variants[0].compiles


# -- stage times ------------------------------------------------------------------------------


def test_progress_times_each_stage_also_silent_and_when_it_raises() -> None:
    """stage_wall_ms adds up per name, with the bars off, and counts a stage that raised."""
    ui = Progress(enabled=False)
    with ui.stage("a"):
        time.sleep(0.01)
    with ui.stage("a"):
        time.sleep(0.01)
    with pytest.raises(RuntimeError), ui.stage("b"):
        time.sleep(0.01)
        raise RuntimeError("boom")
    assert list(ui.stage_wall_ms) == ["a", "b"]
    assert ui.stage_wall_ms["a"] >= 20.0 and ui.stage_wall_ms["b"] >= 10.0


def test_a_plan_records_its_own_stage_times(profile, strategies, workload, fake_device) -> None:
    """Plan.stage_wall_ms lists the stages in the order they ran, each timed, none longer than
    the plan; a Progress shared with an earlier plan does not carry that plan's times over."""
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
