"""A third party's measured-only strategy, registered through the entry point like any other,
is planned through the Strategy contract's refine hook: its variant of the eager pick is run
on the device by the planner's batch search, picked when the device says it is faster, and
reported in its own words. Nothing in the planner or the report knows its name.
"""

from __future__ import annotations

import textwrap

import pytest

from memadvisor.planner import plan_workload
from memadvisor.report._facts import answer, device_runs
from memadvisor.report._words import answer_rows
from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.config import PlanConfig
from memadvisor.strategy import Measured, load_strategies

MIB = 2**20

# The plug-in, as a third party would ship it: a module and a dist-info whose entry point
# registers it in the group memadvisor.strategies.
PLUGIN = textwrap.dedent(
    '''
    from memadvisor.schema.advice import Advice
    from memadvisor.schema.plan import StageOutcome
    from memadvisor.strategy import Measured, Refinement, Strategy

    CALLS = []


    class Turbo(Strategy, Measured):
        """Some kernel swap whose gain only a device can measure."""

        name = "turbo"

        def choices(self, profile, config):
            return ["off", "on"]

        def effect(self, profile, choice, model):
            return None  # measured only: the estimate stays as it is

        def apply(self, step, choice):
            return step

        def explain(self, choice, profile):
            return Advice(strategy=self.name, title="Turbo", sentence="Turn turbo on.")

        def refine(self, stage, eager):
            CALLS.append(eager.candidate)
            choices = {**eager.candidate.choices, self.name: "on"}
            found = stage.confirm(choices, eager.found_batch)
            rate = eager.measured.samples_per_s
            faster = found is not None and found.measured.samples_per_s > 1.1 * rate
            pick = found if faster else eager
            outcome = StageOutcome(
                strategy=self.name,
                label="Turbo",
                runs_label="with turbo on",
                picked=faster,
                summary="Turbo measured." if faster else "Turbo did not pay.",
                pick_words="turbo on",
                answer="weighed, kept off",
                costs=["no one-off cost"],
                eager_batch_size=eager.candidate.batch_size,
                eager_samples_per_s=rate,
            )
            return Refinement(pick=pick, outcome=outcome, notes=[outcome.summary])
    '''
)


@pytest.fixture
def turbo_installed(install_plugin):
    """turbo_plugin installed on sys.path with its entry point, as pip would leave it."""
    install_plugin("turbo_plugin", PLUGIN, {"turbo": "turbo_plugin:Turbo"})


def _turbo_device(fake_device, speedup: float, memory: float = 1.0):
    class TurboDevice(fake_device):
        """Runs with turbo on take 1/speedup of the time and ``memory`` times the bytes (the
        threshold moves with them)."""

        def limit(self, candidate: Candidate, steps: int) -> int:
            base = super().limit(candidate, steps)
            return int(base / memory) if candidate.choices.get("turbo") == "on" else base

        def run(self, workload, candidate: Candidate, steps: int) -> Measurement:
            m = super().run(workload, candidate, steps)
            if candidate.choices.get("turbo") != "on":
                return m
            return m.model_copy(
                update={"step_ms": m.step_ms / speedup, "samples_per_s": m.samples_per_s * speedup}
            )

    return TurboDevice(threshold=40)


def _plan(workload, profile, strategies, device) -> object:
    """The planner's fake precision and checkpointing, and turbo as the entry point loads it."""
    config = PlanConfig(budget_bytes=100 * MIB, probe_steps=2, timing_steps=2, verify_steps=4)
    chosen = [*strategies, *load_strategies(["turbo"])]
    return plan_workload(
        workload, config, profile=profile, device=device, progress=False, strategies=chosen
    )


def test_the_entry_point_registers_the_plugin(turbo_installed) -> None:
    """load_strategies finds the third party's strategy beside the built-ins."""
    names = [s.name for s in load_strategies()]
    assert "turbo" in names and "precision" in names
    turbo = load_strategies(["turbo"])[0]
    assert isinstance(turbo, Measured) and type(turbo).__module__ == "turbo_plugin"


def test_a_plugins_measured_stage_is_planned_on_the_device(
    turbo_installed, workload, profile, strategies, fake_device
) -> None:
    """Turbo 1.5x faster on the device: the planner hands the eager pick to turbo's refine,
    turbo's variant is searched on the device under its own stage name and becomes the pick,
    the verification runs it, and the report shows turbo's row, runs and advice."""
    device = _turbo_device(fake_device, speedup=1.5)
    plan = _plan(workload, profile, strategies, device)

    import turbo_plugin

    assert len(turbo_plugin.CALLS) == 1 and "turbo" not in turbo_plugin.CALLS[0].choices
    assert plan.candidate.choices.get("turbo") == "on"
    assert [s.strategy for s in plan.stages] == ["turbo"] and plan.stages[0].picked
    turbo_runs = [p for p in plan.probes if p.stage == "turbo"]
    assert turbo_runs and all(p.candidate.choices["turbo"] == "on" for p in turbo_runs)
    assert plan.verified is not None and plan.verified.samples_per_s > (
        plan.stages[0].eager_samples_per_s
    )
    assert "Turbo measured." in plan.notes
    assert any(a.strategy == "turbo" for a in plan.advice)
    rows = dict(answer_rows(answer(plan)))
    assert rows["Turbo"].startswith("turbo on: ") and "no one-off cost" in rows["Turbo"]
    assert f"{len(turbo_runs)} with turbo on" in device_runs(plan)


def test_a_plugins_variant_that_does_not_pay_leaves_the_eager_pick(
    turbo_installed, workload, profile, strategies, fake_device
) -> None:
    """Turbo no faster: its runs happen, the pick stays eager, its row says why."""
    plan = _plan(workload, profile, strategies, _turbo_device(fake_device, speedup=1.0))
    assert "turbo" not in plan.candidate.choices
    assert any(p.stage == "turbo" for p in plan.probes)
    assert not plan.stages[0].picked
    assert dict(answer_rows(answer(plan)))["Turbo"] == "weighed, kept off"


def test_refine_is_not_asked_of_strategies_that_are_not_measured(
    workload, profile, fake_device, strategies
) -> None:
    """A strategy the estimate can rank never gets a measured stage, even if it defines one."""

    class Eager(type(strategies[0])):
        def refine(self, stage, eager):  # pragma: no cover - must not run
            raise AssertionError("refine called on a strategy the estimate ranks")

    config = PlanConfig(budget_bytes=100 * MIB, probe_steps=2, timing_steps=2, verify_steps=4)
    plan = plan_workload(
        workload,
        config,
        profile=profile,
        device=fake_device(threshold=40),
        progress=False,
        strategies=[Eager(), strategies[1]],
    )
    assert plan.stages == [] and isinstance(plan.candidate, Candidate)


@pytest.mark.parametrize("memory", [1.0, 0.7, 1.2])
def test_a_variant_that_allocates_no_more_than_the_pick_is_confirmed_without_its_edge(
    turbo_installed, workload, profile, strategies, fake_device, memory: float
) -> None:
    """A measured variant (on a card, each new batch of a compiled one compiles again):
    - allocating what the eager pick did at its batch: confirmed there in one run, as that
      batch already stays the headroom below the edge the device measured;
    - allocating 30% less: one run more, at the batch where it allocates what the pick did
      (along the pick's measured bytes per sample), taken as it fits within them;
    - allocating 20% more: its own edge searched (a run that runs out), a smaller batch."""
    device = _turbo_device(fake_device, speedup=1.5, memory=memory)
    plan = _plan(workload, profile, strategies, device)
    eager_batch = plan.stages[0].eager_batch_size
    eager_peak = next(
        p.peak_bytes
        for p in plan.probes
        if p.fits and p.batch_size == eager_batch and "turbo" not in p.candidate.choices
    )
    turbo_runs = [(p.batch_size, p.fits) for p in plan.probes if p.stage == "turbo"]
    batch = plan.candidate.batch_size
    if memory == 1.0:
        assert turbo_runs == [(eager_batch, True)] and batch == eager_batch
    elif memory < 1.0:
        assert turbo_runs == [(eager_batch, True), (batch, True)] and batch > eager_batch
        assert plan.verified.peak_bytes <= eager_peak
        # The plan's note counts both runs of the pick's batch, not the last one alone.
        runs = f"took 2 device runs ({eager_batch} fits, {batch} fits)"
        assert any(runs in n for n in plan.notes), plan.notes
    else:
        assert any(not fits for _, fits in turbo_runs) and batch < eager_batch
