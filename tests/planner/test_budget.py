"""The infeasible-budget message: the minimum that would work, in the caller's own words."""

from __future__ import annotations

from memadvisor.config import PlanConfig, gib_to_bytes
from memadvisor.planner._budget import infeasible
from memadvisor.profiler import DeviceInfo, LinearBytes, Profile, StepProfile


def _profile() -> Profile:
    return Profile(
        model_name="Net",
        device=DeviceInfo(kind="cpu", name="cpu"),
        batch_sizes=(1, 2),
        param_bytes=2**20,
        grad_bytes=2**20,
        optimizer_state_bytes=2**21,
        steps={
            "fp32": StepProfile(
                precision="fp32", blocks=[], activation_total=LinearBytes(per_sample_bytes=0)
            )
        },
    )


def test_python_callers_are_told_budget_gb_with_the_budget_as_given() -> None:
    """Rule: the budget shown is the one passed (0.08 stays 0.08: rounding up to the next
    hundredth made it 0.09), and the named minimum, rounded up, is enough."""
    config = PlanConfig(budget_bytes=gib_to_bytes(0.08))
    error = infeasible(_profile(), config, gib_to_bytes(0.1), "Too big.")
    assert "of the 0.08 GiB budget" in str(error)
    assert "pass budget_gb=0.11 or more" in str(error)
    assert gib_to_bytes(0.11) * (1 - config.margin_fraction) >= gib_to_bytes(0.1)
    assert error.minimum_bytes <= gib_to_bytes(0.11)


def test_cli_callers_are_told_the_option_they_used() -> None:
    config = PlanConfig(budget_bytes=gib_to_bytes(0.08))
    error = infeasible(_profile(), config, gib_to_bytes(0.1), "Too big.")
    error.option = "--budget-gb "
    assert "pass --budget-gb 0.11 or more" in str(error)
    assert "budget_gb=" not in str(error)
