"""A plan file loads only when it can be trusted: the schema this version writes, finite
numbers in range, and (in apply_plan) the model it was made for."""

from __future__ import annotations

import json
import math

import pytest
import torch
from pydantic import ValidationError
from torch import nn

import memadvisor
from memadvisor.errors import BadInputError
from memadvisor.estimate import estimate
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.plan import ModelFingerprint, Plan
from memadvisor.schema.profile import (
    BlockActivity,
    BlockInfo,
    DeviceInfo,
    LinearBytes,
    Profile,
    StepProfile,
)
from strategies import _forward

MIB = 2**20


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.GELU()) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _profile() -> Profile:
    act = LinearBytes(per_sample_bytes=MIB)
    step = StepProfile(
        precision="fp32",
        blocks=[BlockActivity(name=f"blocks.{i}", activation=act, input=act) for i in range(2)],
        activation_total=LinearBytes(per_sample_bytes=2 * MIB),
    )
    return Profile(
        model_name="Net",
        device=DeviceInfo(kind="cpu", name="cpu", bf16_supported=True),
        batch_sizes=(1, 2),
        param_bytes=MIB,
        grad_bytes=MIB,
        optimizer_state_bytes=2 * MIB,
        blocks=[BlockInfo(name=f"blocks.{i}", type_name="Sequential") for i in range(2)],
        steps={"fp32": step},
    )


def _plan(model: nn.Module | None = None, **choices) -> Plan:
    candidate = Candidate(batch_size=4, choices=choices or {"checkpointing": ["blocks.0"]})
    # The profile has no times: the estimated step takes 0 ms.
    return Plan(
        model_name="Net",
        config=PlanConfig(budget_bytes=2**30),
        device_kind="simulated",
        device_name="cpu",
        candidate=candidate,
        estimate=estimate(_profile(), candidate),
        profile=_profile(),
        model_fingerprint=ModelFingerprint.of(model if model is not None else Net()),
    )


def _load(edit) -> Plan:
    data = json.loads(_plan().model_dump_json())
    edit(data)
    return Plan.model_validate_json(json.dumps(data))


def test_a_step_measured_at_0_ms_is_written_as_a_number_and_loads_back() -> None:
    """Rule: no plan holds an infinite samples/s (JSON has no inf: it was written as null and
    the file did not load); a step too fast to time counts as one clock tick."""
    plan = _plan()
    assert math.isfinite(plan.estimate.samples_per_s)
    assert Plan.model_validate_json(plan.model_dump_json()) == plan


def test_another_schema_version_is_refused_naming_both() -> None:
    """Rule: a file of another schema version does not load as if it were this one."""

    def edit(d):
        d["schema_version"] = 999

    with pytest.raises(ValidationError, match="schema_version 999"):
        _load(edit)


@pytest.mark.parametrize("batch", [1e30, 2**40, 0])
def test_a_batch_size_out_of_range_is_refused(batch) -> None:
    """Rule: the pick's batch is a positive number no larger than the config's max_batch."""

    def edit(d):
        d["candidate"]["batch_size"] = batch

    with pytest.raises(ValidationError, match="batch_size"):
        _load(edit)


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_infinity_in_float_fields_are_refused_with_the_field(value: float) -> None:
    """Rule: NaN and Infinity (which Python's json writes and pydantic reads) are refused,
    naming the field."""

    def edit(d):
        d["estimate"]["step_ms"] = value

    with pytest.raises(ValidationError, match="estimate.step_ms"):
        _load(edit)


def test_a_plan_for_another_model_is_refused_and_rewrites_nothing() -> None:
    """Rule: apply_plan checks the model's fingerprint (class, parameter names and shapes)
    before any rewrite, and says what differs."""
    other = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(BadInputError, match="made for Net.*Sequential"):
        memadvisor.apply_plan(other, _plan())
    assert not any(_forward.find_wrapper(m, _forward.ForwardWrapper) for m in other.modules())


def test_a_plan_for_another_shape_names_the_first_difference() -> None:
    wider = Net()
    wider.head = nn.Linear(8, 3)
    plan = _plan(wider)
    with pytest.raises(BadInputError, match=r"head.weight has shape \[2, 8\].*had \[3, 8\]"):
        memadvisor.apply_plan(Net(), plan)
    again = Net()
    again.head = nn.Linear(8, 3)
    assert memadvisor.apply_plan(again, plan).memadvisor_plan is plan


def test_an_inference_choice_on_a_training_plan_is_refused() -> None:
    """Rule: a training plan's model never gets switched to eval() and inference_mode."""
    model = Net()
    with pytest.raises(BadInputError, match="training"):
        memadvisor.apply_plan(model, _plan(inference="advice"))
    assert model.training and _forward.find_wrapper(model, _forward.ForwardWrapper) is None


# -- a plan file read strictly (issue 29) ------------------------------------------------------


def _edited_file(tmp_path, **changes) -> object:
    """This file's plan saved as JSON with ``changes`` made (``a__b``: the field b of a)."""
    data = json.loads(_plan().model_dump_json())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for key in parents:
            node = node[key]
        node[leaf] = value
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    return path


def test_a_plan_file_is_read_strictly_and_cannot_raise_its_own_bounds(tmp_path) -> None:
    """ "3" is not schema_version 3, true is not batch 1, an edited max_batch does not let an
    edited batch through, and a plan without a fingerprint is not applied."""
    from memadvisor.apply import apply_plan

    assert Plan.load(_edited_file(tmp_path)).candidate.batch_size == 4
    version = json.loads(_plan().model_dump_json())["schema_version"]
    with pytest.raises(BadInputError, match="schema_version"):
        Plan.load(_edited_file(tmp_path, schema_version=str(version)))
    with pytest.raises(BadInputError, match="batch_size"):
        Plan.load(_edited_file(tmp_path, candidate__batch_size=True))
    edited = _edited_file(tmp_path, config__max_batch=10**9, candidate__batch_size=10**8)
    with pytest.raises(BadInputError, match="cannot raise its own limit"):
        Plan.load(edited)
    with pytest.raises(BadInputError, match="no model_fingerprint"):
        apply_plan(Net(), _edited_file(tmp_path, model_fingerprint=None))
