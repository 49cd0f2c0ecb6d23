"""A measured-only strategy (compile) reaches the estimate search with its neutral choice only."""

from __future__ import annotations

from typing import ClassVar

from memadvisor.planner._space import SearchSpace
from memadvisor.schema.config import GIB, PlanConfig
from memadvisor.strategy import Measured, Strategy


class _MeasuredOnly(Strategy, Measured):
    name: ClassVar[str] = "measured_toy"

    def refine(self, stage, eager):  # noqa: ANN001, ANN201
        return None

    def choices(self, profile, config):  # noqa: ANN001, ANN201
        return ["off", "on"]

    def effect(self, profile, choice, model) -> None:  # noqa: ANN001
        return None

    def apply(self, step, choice):  # noqa: ANN001, ANN201
        return step

    def explain(self, choice, profile) -> None:  # noqa: ANN001
        return None


def test_measured_only_strategies_offer_only_their_neutral_choice(tmp_path) -> None:  # noqa: ANN001
    from memadvisor.schema.profile import DeviceInfo, LinearBytes, Profile, StepProfile

    profile = Profile(
        model_name="m",
        device=DeviceInfo(kind="cuda", name="gpu"),
        batch_sizes=(1, 2),
        param_bytes=1,
        grad_bytes=1,
        optimizer_state_bytes=2,
        steps={"fp32": StepProfile(precision="fp32", blocks=[], activation_total=LinearBytes())},
    )
    space = SearchSpace(profile, [_MeasuredOnly()], PlanConfig(budget_bytes=GIB))
    assert space.options == {"measured_toy": ["off"]}
