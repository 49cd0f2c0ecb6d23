"""The allocator strategy: on CUDA the plan runs under expandable segments, records them, and
``apply`` sets them in the user's process; a user's own setting is theirs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from memadvisor import _torch_private
from memadvisor.errors import BadInputError
from memadvisor.planner import plan_workload
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.device import DeviceCapabilities
from memadvisor.step import Step
from strategies.allocator import EXPANDABLE, SETTING, Allocator
from tests.planner.conftest import (
    FakeCheckpointing,
    FakeDevice,
    FakePrecision,
    make_profile,
    tiny_workload,
)
from tests.planner.test_plan import _config

MIB = 2**20
CUDA = DeviceCapabilities(kind="cuda", tensor_device="cuda")
_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in _VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture
def allocator_restored():
    """This process's allocator settings as they were (apply sets them process-wide)."""
    yield
    _torch_private.set_allocator_settings("expandable_segments:False")


def _config_of(**options) -> PlanConfig:
    return PlanConfig(budget_bytes=100 * MIB, options=options)


def _child_sees(name: str) -> str:
    out = subprocess.run(
        [sys.executable, "-c", f"import os; print(os.environ.get({name!r}, ''))"],
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip()


def test_on_cuda_the_whole_plan_runs_under_expandable_segments_and_the_pick_records_it(clean_env):
    """Inside the plan's scope every process started inherits the setting and the pick
    records it; after, the environment is the user's again and nothing is recorded."""
    allocator = Allocator()
    scope = allocator.plan_scope(_config_of(), CUDA)
    assert scope is not None
    with scope:
        assert _child_sees("PYTORCH_CUDA_ALLOC_CONF") == SETTING
        assert allocator.record(None, _config_of()) == EXPANDABLE  # type: ignore[arg-type]
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    assert allocator.record(None, _config_of()) is None  # type: ignore[arg-type]


def test_the_users_own_expandable_setting_is_kept_and_nothing_is_recorded(clean_env):
    """A user whose environment names expandable segments (even False) keeps it."""
    clean_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    allocator = Allocator()
    assert allocator.plan_scope(_config_of(), CUDA) is None
    assert allocator.record(None, _config_of()) is None  # type: ignore[arg-type]


@pytest.mark.parametrize("name", _VARIABLES)
def test_the_users_other_allocator_settings_are_kept_beside_expandable_segments(clean_env, name):
    clean_env.setenv(name, "max_split_size_mb:128,")
    scope = Allocator().plan_scope(_config_of(), CUDA)
    assert scope is not None
    with scope:
        assert os.environ[name] == f"max_split_size_mb:128,{SETTING}"
    assert os.environ[name] == "max_split_size_mb:128,"


def test_off_or_a_device_other_than_cuda_plans_under_the_processs_own_allocator(clean_env):
    allocator = Allocator()
    assert allocator.plan_scope(_config_of(allocator="off"), CUDA) is None
    simulated = DeviceCapabilities(kind="simulated", tensor_device="cpu")
    assert allocator.plan_scope(_config_of(), simulated) is None


def test_applying_a_plan_that_records_it_sets_expandable_segments_for_the_process(
    clean_env, allocator_restored
):
    """apply_plan's rewrite sets the process's allocator (torch reads it back), and leaves
    the step as it was; 'off' (None) sets nothing."""
    _torch_private.set_allocator_settings("expandable_segments:False")
    step = Step.__new__(Step)
    assert Allocator().apply(step, None) is step
    assert "expandable_segments:True" not in _torch_private.allocator_settings()
    assert Allocator().apply(step, EXPANDABLE) is step
    assert "expandable_segments:True" in _torch_private.allocator_settings()


def test_applying_it_leaves_a_users_own_setting_alone(clean_env, allocator_restored, monkeypatch):
    clean_env.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    calls: list[str] = []
    monkeypatch.setattr(_torch_private, "set_allocator_settings", calls.append)
    Allocator().apply(Step.__new__(Step), EXPANDABLE)
    assert calls == []


def test_a_choice_that_is_not_the_allocators_is_refused_with_what_it_takes():
    with pytest.raises(BadInputError, match="expandable_segments.*but got choice='huge'"):
        Allocator().validate(Step.__new__(Step), "huge")  # before any strategy applies
    with pytest.raises(BadInputError, match="expandable_segments.*but got choice='huge'"):
        Allocator().apply(Step.__new__(Step), "huge")


class _CudaLike(FakeDevice):
    """The planner's fake card, whose tensors it says are CUDA's; records the variable each
    run saw."""

    capabilities = FakeDevice.capabilities.model_copy(update={"tensor_device": "cuda"})

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list[str | None] = []

    def run(self, workload, candidate, steps):
        self.seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        return super().run(workload, candidate, steps)


def test_a_plan_on_cuda_runs_every_probe_under_expandable_segments_and_advises_them(clean_env):
    """Through the planner: each device run saw the setting, the pick records it, its advice
    says how to set it by hand, and the user's environment is as it was afterwards."""
    device = _CudaLike(8)
    plan = plan_workload(
        tiny_workload(),
        _config(),
        profile=make_profile(),
        device=device,
        progress=False,
        strategies=[FakePrecision(), FakeCheckpointing(), Allocator()],
        measure_comparison=False,
    )
    assert device.seen and set(device.seen) == {SETTING}
    assert plan.candidate.choices.get("allocator") == EXPANDABLE
    advice = [a for a in plan.advice if a.strategy == "allocator"]
    assert advice and SETTING in advice[0].snippet
    part = Allocator().describe(EXPANDABLE, plan)
    assert part is not None and part.label == "Allocator" and SETTING in part.words
    assert Allocator().describe(None, plan) is None
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


_ON_THE_CARD = """
import sys
import torch
from memadvisor import _torch_private
from memadvisor.step import Step
from strategies.allocator import Allocator

before = None
if sys.argv[1] == "started":  # CUDA in use before apply_plan, as a model moved there
    before = torch.empty(1 << 20, device="cuda")
Allocator().apply(Step.__new__(Step), "expandable_segments")
# 64 MiB: more than a 20 MiB segment opened for a 4 MiB tensor has left: a segment of its own.
after = torch.empty(1 << 24, device="cuda")
kinds = {}
for seg in _torch_private.memory_snapshot()["segments"]:
    for block in seg["blocks"]:
        if block["state"] == "active_allocated":
            kinds[block["address"]] = bool(seg.get("is_expandable"))
print(before is not None and kinds.get(before.data_ptr()), kinds.get(after.data_ptr()))
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("cuda", ["started", "not started"])
def test_on_a_card_apply_puts_new_allocations_in_expandable_segments_and_leaves_old_ones(
    clean_env, cuda
):
    """In a fresh process (the setting is process-wide), CUDA already in use or not: a
    tensor allocated before the rewrite stays in its segment, one allocated after lands in
    an expandable segment."""
    out = subprocess.run(
        [sys.executable, "-c", _ON_THE_CARD, cuda], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "True"], out.stdout
