"""A failed check changes the pick: precision's numerics check runs before the search, and
a precision that fails it is not picked unless the config says checks='report'."""

from __future__ import annotations

import pytest

from memadvisor.config import PlanConfig
from memadvisor.planner import plan_workload
from memadvisor.target import load_target
from strategies.precision import Precision

MIB = 2**20
FAST = {"probe_steps": 2, "timing_steps": 2, "verify_steps": 3}


def _plan(profile, checkpointing, fake_device, checks: str):
    """The hand-built profile (bf16 halves activations and time: the estimate's favourite)
    with the real precision strategy, on a fake device where every batch up to 64 fits."""
    workload = load_target("tests.fixtures.factories:offset")
    config = PlanConfig(budget_bytes=100 * MIB, checks=checks, **FAST)
    return plan_workload(
        workload,
        config,
        profile=profile,
        device=fake_device(64),
        progress=False,
        strategies=[Precision(), checkpointing],
        measure_comparison=False,
    )


@pytest.fixture
def checkpointing(strategies):
    return strategies[1]  # the conftest's FakeCheckpointing


def test_bf16_failing_its_check_is_not_picked_and_the_plan_says_why_first(
    profile, checkpointing, fake_device
) -> None:
    plan = _plan(profile, checkpointing, fake_device, checks="decide")
    assert plan.candidate.choices.get("precision", "fp32") == "fp32"
    assert [(c.choice, c.passed) for c in plan.checks] == [("bf16", False)]  # run once
    assert "precision bf16 was not considered: its check failed" in plan.notes[0]
    assert "--checks report" in plan.notes[0]
    assert all(p.candidate.choices.get("precision", "fp32") == "fp32" for p in plan.probes)


def test_checks_report_keeps_the_failed_precision_in_the_running(
    profile, checkpointing, fake_device
) -> None:
    plan = _plan(profile, checkpointing, fake_device, checks="report")
    assert plan.candidate.choices["precision"] == "bf16"  # the estimate's and device's best
    assert [(c.choice, c.passed) for c in plan.checks] == [("bf16", False)]
    assert "considered anyway" in plan.notes[0]
