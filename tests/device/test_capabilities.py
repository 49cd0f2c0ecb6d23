"""Each built-in device states its capabilities; a device that states none is told how.

The planner reads these fields where it compared kinds before, so each device's must say
what the old comparisons meant: a card's times rank and its runs cost more than its steps;
the simulated device's memory repeats from the second step and its times do not rank;
fake tensors hold no values and plan for a card.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memadvisor.device import Device
from memadvisor.device.cuda import CudaDevice
from memadvisor.device.fake import FakeDevice
from memadvisor.device.ranks import Ranks
from memadvisor.device.simulated import SimulatedDevice

GIB = 2**30


def test_the_simulated_device_meters_cpu_tensors_under_cuda_cast_lists() -> None:
    caps = SimulatedDevice(GIB).capabilities
    assert (caps.kind, caps.tensor_device, caps.trains_on) == ("simulated", "cpu", "cpu")
    assert caps.steady_memory and not caps.step_times_rank and not caps.can_compile
    assert caps.memory == "tensors" and caps.autocast.cuda_cast_lists
    # Its own CPU autocast policy, where asked: the capabilities say so, and its runs read them.
    assert not SimulatedDevice(GIB, autocast_policy="cpu").capabilities.autocast.cuda_cast_lists


def test_fake_tensors_hold_no_values_and_plan_for_a_card() -> None:
    caps = FakeDevice(GIB).capabilities
    assert caps.kind == "fake" and caps.fake_tensors and caps.trains_on == "cuda"
    assert caps.measures_memory and not caps.step_times_rank


def test_simulated_ranks_are_processes_whose_memory_is_not_steady() -> None:
    """CPU ranks keep the simulated card's words (kind, times that do not rank) but not its
    steady memory: collectives run between the steps."""
    caps = Ranks(GIB, 2).capabilities
    assert caps.kind == "simulated" and not caps.steady_memory and not caps.step_times_rank


def test_a_card_reads_its_bytes_and_bf16_and_says_when_runs_share_this_process(
    monkeypatch,
) -> None:
    """The card's properties faked (no GPU here): its total and free bytes are the card's,
    bf16 is offered only where the card runs it, and fresh_processes is False for a device
    whose runs share the planner's process."""
    card = SimpleNamespace(name="fake card", total_memory=80 * GIB)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (70 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    device = CudaDevice(GIB, fresh_process=False)
    try:
        caps = device.capabilities
    finally:
        device.close()
    assert (caps.kind, caps.tensor_device, caps.memory) == ("cuda", "cuda", "allocator")
    assert caps.step_times_rank and caps.runs_cost_more_than_steps and caps.can_compile
    assert (caps.total_bytes, caps.free_bytes) == (80 * GIB, 70 * GIB)
    assert caps.autocast.dtypes == ("fp16",) and not caps.fresh_processes


def test_a_device_without_capabilities_is_told_what_to_give() -> None:
    class Bare(Device):
        def run(self, workload, candidate, steps):
            raise NotImplementedError

    with pytest.raises(TypeError, match="Bare states no capabilities: give it a class attribute"):
        _ = Bare(GIB, "bare").capabilities
