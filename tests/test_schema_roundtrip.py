"""Profile and Plan cross process boundaries as JSON: a round trip must be lossless."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from memadvisor.schema.candidate import Candidate, Estimate, Measurement
from memadvisor.schema.config import GIB, PlanConfig, gib_to_bytes
from memadvisor.schema.plan import Plan, Probe, Row
from memadvisor.schema.profile import (
    BlockActivity,
    BlockInfo,
    DeviceInfo,
    LayerRow,
    LinearBytes,
    ModuleActivity,
    PhasePeak,
    Profile,
    StepProfile,
)


def _profile() -> Profile:
    act = LinearBytes(per_sample_bytes=1024.0, constant_bytes=64.0)
    step = StepProfile(
        precision="fp32",
        blocks=[BlockActivity(name="h.0", activation=act, input=act)],
        outside=[ModuleActivity(name="lm_head", activation=act)],
        activation_total=LinearBytes(per_sample_bytes=2048.0),
        phases=[PhasePeak(phase="forward", allocated=act)],
    )
    return Profile(
        model_name="GPT",
        device=DeviceInfo(kind="cpu", name="cpu"),
        batch_sizes=(2, 4),
        param_bytes=100,
        grad_bytes=100,
        optimizer_state_bytes=200,
        blocks=[BlockInfo(name="h.0", type_name="Block", param_bytes=50)],
        steps={"fp32": step},
        layers=[LayerRow(name="h.0", type_name="Block", param_bytes=50)],
    )


def test_profile_json_round_trip_is_equal() -> None:
    p = _profile()
    assert Profile.model_validate_json(p.model_dump_json()) == p


def test_plan_json_round_trip_is_equal() -> None:
    cand = Candidate(batch_size=8, choices={"precision": "bf16", "checkpointing": ["h.0"]})
    est = Estimate(
        peak_bytes=10,
        peak_phase="backward",
        breakdown={"params": 1},
        step_ms=2.0,
        samples_per_s=4000.0,
    )
    plan = Plan(
        model_name="GPT",
        config=PlanConfig(budget_bytes=gib_to_bytes(8)),
        device_kind="simulated",
        device_name="cpu",
        candidate=cand,
        estimate=est,
        verified=Measurement(steps=20, peak_bytes=9, step_ms=2.1, samples_per_s=3800.0),
        probes=[Probe(batch_size=8, fits=True, steps=3, peak_bytes=9)],
        comparison=[Row(label="Baseline", candidate=cand, estimate=est)],
        profile=_profile(),
    )
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_linear_bytes_fit_recovers_per_sample_and_constant_parts() -> None:
    line = LinearBytes.fit(2, 2 * 300 + 50, 6, 6 * 300 + 50)
    assert line.per_sample_bytes == pytest.approx(300) and line.constant_bytes == pytest.approx(50)
    assert line.at(10) == 3050


def test_unknown_fields_are_rejected() -> None:
    with pytest.raises(ValidationError):
        PlanConfig(budget_bytes=1, budgett=2)  # type: ignore[call-arg]


def test_budget_gib_is_two_to_the_thirty() -> None:
    assert gib_to_bytes(8) == 8 * GIB == 8 * 2**30


def test_effective_batch_objective_needs_the_batch() -> None:
    with pytest.raises(ValidationError, match="effective_batch"):
        PlanConfig(budget_bytes=GIB, objective="effective_batch")
