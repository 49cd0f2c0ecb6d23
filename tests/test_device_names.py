"""One device vocabulary: plan(), profile() and the CLI take the same names (auto, cuda or
gpu, cpu or simulated, estimate), and refuse others with the list."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memadvisor
from memadvisor.api import plan_config
from memadvisor.errors import BadInputError
from memadvisor.schema.config import DEVICE_NAMES, device_kind


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("auto", "auto"),
        ("cuda", "cuda"),
        ("GPU", "cuda"),
        ("cpu", "simulated"),
        ("simulated", "simulated"),
        ("estimate", "estimate"),
    ],
)
def test_each_name_means_one_kind_in_the_plans_config(name: str, kind: str) -> None:
    assert device_kind(name) == kind
    assert plan_config(1.0, device=name).device == kind


@pytest.mark.parametrize("bad", ["tpu", "", None, 0])
def test_another_name_is_refused_with_the_list(bad) -> None:
    with pytest.raises(BadInputError, match="device must be auto, cuda .*but got"):
        plan_config(1.0, device=bad)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


@pytest.mark.parametrize(
    ("name", "kind"), [("cpu", "cpu"), ("simulated", "cpu"), ("estimate", "fake")]
)
def test_profile_takes_the_plans_names(name: str, kind: str) -> None:
    """profile(device='simulated') was refused, plan(device='cpu') too: both now name the
    CPU device; 'estimate' profiles under fake tensors, as plan's does."""
    prof = memadvisor.profile(
        _mlp(), torch.randn(4, 8), loss_fn=lambda out, batch: out.sum(), device=name
    )
    assert prof.device.kind == kind
    assert prof.param_bytes == (8 * 16 + 16 + 16 + 1) * 4


def test_profile_refuses_a_name_plan_refuses() -> None:
    with pytest.raises(BadInputError, match="but got 'tpu'"):
        memadvisor.profile(_mlp(), torch.randn(4, 8), device="tpu")


def test_every_name_is_a_cli_choice() -> None:
    from memadvisor.cli._app import DeviceOption

    assert {o.value for o in DeviceOption} == set(DEVICE_NAMES)
