"""A third party's device of a kind memadvisor never heard of plans as a built-in one does.

Before devices stated capabilities, a Device whose kind was not "cuda" was profiled on the
CPU under the simulated device's rules and then failed ``Plan`` validation (the kind was a
closed list) after every probe had run. Here an "npu-like" device (CPU tensors, its own
out-of-memory error, autocast in fp16 only) plans through ``memadvisor.plan``: the planner,
the strategies and the report read its capabilities, and ask it whether an error is an
out-of-memory.
"""

from __future__ import annotations

import io

import torch
import torch.nn.functional as F
from rich.console import Console
from torch import nn

import memadvisor
from memadvisor.device import Device
from memadvisor.device.simulated import SimulatedDevice
from memadvisor.errors import is_oom
from memadvisor.report import print_plan
from memadvisor.schema import AutocastPolicy, DeviceCapabilities, Plan
from memadvisor.schema.config import gib_to_bytes
from memadvisor.strategy import load_strategies

BUDGET_GB = 4 / 1024  # 4 MiB: a few hundred samples of the model below

NPU = DeviceCapabilities(
    kind="npu-like",
    tensor_device="cpu",
    steady_memory=True,
    autocast=AutocastPolicy(device_type="cpu", dtypes=("fp16",)),  # no bf16 on this part
)


class NpuOutOfMemoryError(RuntimeError):
    """What the npu-like runtime raises when a step does not fit: not torch's error, and no
    message memadvisor's own matcher knows."""


class NpuLike(Device):
    """A device of another kind: CPU tensors metered under the budget (a SimulatedDevice does
    the metering), its out-of-memory its own error, recognised by its own :meth:`is_oom`."""

    capabilities = NPU

    def __init__(self, budget_bytes: int) -> None:
        super().__init__(budget_bytes, "npu-like accelerator (CPU tensors)")
        self._meter = SimulatedDevice(budget_bytes, autocast_policy="cpu")
        self.runs = 0
        self.out_of_memory = 0

    def is_oom(self, error: BaseException) -> bool:
        return isinstance(error, NpuOutOfMemoryError)

    def run(self, workload, candidate, steps):
        self.runs += 1
        try:
            return self._meter.run(workload, candidate, steps)
        except Exception as e:
            if not is_oom(e):
                raise
            self.out_of_memory += 1
            error = NpuOutOfMemoryError(f"npu: allocation failed at batch {candidate.batch_size}")
            error.memadvisor_steps_completed = e.memadvisor_steps_completed  # type: ignore[attr-defined]
            raise error from None


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(32, 256), nn.ReLU()),
        nn.Sequential(nn.Linear(256, 256), nn.ReLU()),
        nn.Linear(256, 4),
    )


def _plan(device: NpuLike) -> Plan:
    batch = (torch.randn(8, 32), torch.randint(0, 4, (8,)))
    return memadvisor.plan(
        _model(),
        batch,
        loss_fn=lambda out, b: F.cross_entropy(out, b[1]),
        budget_gb=BUDGET_GB,
        device=device,
        progress=False,
        measure_comparison=False,
        probe_steps=2,
        timing_steps=2,
        verify_steps=3,
    )


def test_a_device_of_a_new_kind_plans_end_to_end_by_its_capabilities() -> None:
    """The plan is confirmed on the npu-like device and says so; it loads back from JSON;
    its profile carries the device's capabilities (made where its tensors are, the CPU); the
    precision strategy offers fp16 and not bf16, as the device's autocast says, though the
    CPU itself runs bf16; and the device's own out-of-memory error was an answer."""
    device = NpuLike(gib_to_bytes(BUDGET_GB))
    plan = _plan(device)

    assert plan.device_kind == "npu-like" and plan.capabilities == NPU
    assert plan.verified is not None and plan.verified.peak_bytes <= plan.config.budget_bytes
    assert Plan.model_validate_json(plan.model_dump_json()).model_dump() == plan.model_dump()
    assert plan.profile.device.kind == "cpu"  # profiled where its tensors are
    assert plan.profile.device.capabilities.kind == "npu-like"
    assert plan.profile.device.bf16_supported  # the CPU runs bf16; the device does not

    (precision,) = load_strategies(["precision"])
    offered = precision.choices(plan.profile, plan.config)
    assert "bf16" not in offered and "fp16" in offered
    ran = {p.candidate.choices.get("precision") for p in plan.probes if p.candidate}
    assert "bf16" not in ran

    assert device.runs == len(plan.probes)
    assert device.out_of_memory >= 1
    failed = [p for p in plan.probes if not p.fits]
    assert len(failed) == device.out_of_memory and all("npu:" in p.error for p in failed)


def test_the_report_names_the_new_kind_and_reads_its_times_as_it_says() -> None:
    """The report's words come from the capabilities: the device by its kind, and its step
    times (which do not rank, its capabilities say) marked as the estimate's, as for the
    simulated device."""
    plan = _plan(NpuLike(gib_to_bytes(BUDGET_GB)))
    out = io.StringIO()
    print_plan(plan, Console(file=out, width=200))
    text = out.getvalue()
    assert "npu-like" in text
    assert "this device's times do not" in text


def test_the_default_retry_that_runs_out_too_leaves_the_first_error_naming_the_retry() -> None:
    """Rule: ``Device.run_many_retrying``'s default makes a retry as a run of its own; where
    it runs out too, the answer is the first batch's out-of-memory error (the device's own),
    with ``memadvisor_retry_ran_out`` the retry's batch; where the retry fits, its
    measurement says what ran out first; a run given no retry carries no such word."""
    from memadvisor.schema.candidate import Candidate
    from memadvisor.workload import Workload

    batch = (torch.randn(8, 32), torch.randint(0, 4, (8,)))
    workload = Workload(
        model=_model(), sample_batch=batch, loss_fn=lambda out, b: F.cross_entropy(out, b[1])
    )
    device = NpuLike(gib_to_bytes(BUDGET_GB))
    huge, fits = 1_000_000, 4
    answers = device.run_many_retrying(
        workload,
        [
            (Candidate(batch_size=huge), 2, huge // 2),  # both run out
            (Candidate(batch_size=huge), 2, fits),  # the retry fits
            (Candidate(batch_size=huge), 2, None),  # no retry asked
        ],
    )
    both, retried, alone = answers
    assert isinstance(both, NpuOutOfMemoryError), both
    assert f"batch {huge}" in str(both) and both.memadvisor_retry_ran_out == huge // 2
    assert both.memadvisor_retry_same_process is False  # a run of its own
    assert not isinstance(retried, Exception) and retried.ran_out_first is not None
    assert retried.ran_out_first.batch_size == huge
    assert isinstance(alone, NpuOutOfMemoryError)
    assert not hasattr(alone, "memadvisor_retry_ran_out")
