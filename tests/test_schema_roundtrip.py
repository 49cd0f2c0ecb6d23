"""Profile and Plan cross process boundaries as JSON: a round trip must be lossless."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from memadvisor.schema.candidate import Candidate, Estimate, Measurement
from memadvisor.schema.config import GIB, PlanConfig, gib_to_bytes
from memadvisor.schema.device import SIMULATED, DeviceCapabilities
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


def _plan() -> Plan:
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
    return plan


def test_plan_json_round_trip_is_equal() -> None:
    plan = _plan()
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_a_plan_written_before_capabilities_loads_with_its_kinds(tmp_path) -> None:
    """A plan file without capabilities (the plan's, the profile's device's) loads, strictly,
    and means what its kinds meant: a simulated plan's times do not rank, it trains on the
    CPU; the profile's autocast runs what its bf16/fp16 flags said."""
    data = json.loads(_plan().model_dump_json())
    del data["capabilities"], data["profile"]["device"]["capabilities"]
    data["profile"]["device"]["bf16_supported"] = True
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    plan = Plan.load(path)
    assert plan.capabilities == SIMULATED
    assert not plan.capabilities.step_times_rank and plan.capabilities.trains_on == "cpu"
    device = plan.profile.device.capabilities
    assert device.kind == "cpu" and device.autocast.dtypes == ("bf16",)


def test_a_new_kind_needs_its_capabilities_and_one_device_says_both() -> None:
    """A kind memadvisor does not know loads only with its capabilities (any kind does,
    with them: the device's own words), and the plan's kind is its capabilities' kind."""
    data = json.loads(_plan().model_dump_json())
    npu = DeviceCapabilities(kind="npu", tensor_device="cpu")
    plan = Plan.model_validate({**data, "device_kind": "npu", "capabilities": npu.model_dump()})
    assert plan.capabilities == npu
    del data["capabilities"]
    with pytest.raises(ValidationError, match="'npu' must state its capabilities"):
        Plan.model_validate({**data, "device_kind": "npu"})
    with pytest.raises(ValidationError, match="one device says both"):
        Plan.model_validate({**data, "capabilities": npu.model_dump()})


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
