"""Optimizer habits: advice with the profile's measured numbers; no change to model or estimate."""

from __future__ import annotations

from torch import nn

from memadvisor.estimate import estimate
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from strategies import _forward
from strategies.optimizer_habits import OptimizerHabits, optimizer_temporary_bytes
from tests.fixtures.steps import applied

HABITS = OptimizerHabits()
CONFIG = PlanConfig(budget_bytes=2**30)
MIB = 2**20


def test_offered_as_advice_when_training_and_not_for_inference(profile_factory) -> None:
    profile = profile_factory([(10, 2, 1)])
    assert HABITS.choices(profile, CONFIG) == ["advice"]
    inference = profile.model_copy(update={"grad_bytes": 0, "optimizer_state_bytes": 0})
    assert HABITS.choices(inference, CONFIG) == ["off"]


def test_it_changes_neither_the_estimate_nor_the_model(profile_factory) -> None:
    profile = profile_factory([(10, 2, 1)])
    plain = estimate(profile, Candidate(batch_size=3), [HABITS])
    advised = estimate(profile, Candidate(batch_size=3, choices={HABITS.name: "advice"}), [HABITS])
    assert plain == advised
    model = nn.Linear(2, 2)
    assert applied(HABITS, model, "advice", profile) is model and "forward" not in model.__dict__
    assert list(_forward.wrappers(model)) == []


def test_temporaries_are_read_from_the_optimizer_phase(profile_factory) -> None:
    """Optimizer peak (4 MiB static + 6 MiB extra) less weights, grads and state (4 MiB)."""
    profile = profile_factory([(10, 2, 1)], optimizer_peak_extra=6)
    assert optimizer_temporary_bytes(profile) == 6 * MIB
    no_phases = profile.model_copy(
        update={"steps": {"fp32": profile.steps["fp32"].model_copy(update={"phases": []})}}
    )
    assert optimizer_temporary_bytes(no_phases) is None


def test_explain_names_the_measured_temporaries_and_whether_they_set_the_peak(
    profile_factory,
) -> None:
    small = HABITS.explain("advice", profile_factory([(10, 2, 1)], optimizer_peak_extra=6))
    assert "6.0 MiB of temporaries" in small.effect and "peak is elsewhere" in small.effect
    assert "foreach=False" in small.snippet  # a CPU profile: no fused advice
    big = HABITS.explain(
        "advice", profile_factory([(1, 1, 1)], kind="cuda", optimizer_peak_extra=90)
    )
    assert "is this step's peak" in big.effect and "fused=True" in big.snippet
    assert HABITS.explain("off", profile_factory([(10, 2, 1)])) is None
