"""Fake tensors: the same bytes as real ones, no memory used, a 7B model planned on a laptop."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from memadvisor.device.fake import (
    CUDA_FIXED_BYTES,
    FakeDevice,
    FakeWorkload,
    fake_workload,
    profile_fake,
)
from memadvisor.device.simulated import SimulatedDevice
from memadvisor.errors import BadInputError, SimulatedOutOfMemoryError
from memadvisor.estimate import estimate
from memadvisor.schema.candidate import Candidate
from memadvisor.strategy import load_strategies
from memadvisor.target import load_factory, workload_from_result

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
GIB = 2**30


def _llama(**kwargs):  # noqa: ANN003, ANN202
    return load_factory(f"{EXAMPLES}/llama.py:build")(**kwargs)


def test_a_fake_step_meters_the_bytes_of_the_same_real_step() -> None:
    """At most AdamW's 4-byte step counters apart (``torch.tensor(0.)``, which reaches the
    meter only as ``lift_fresh``)."""
    real = workload_from_result(load_factory(f"{EXAMPLES}/gpt.py:build")(n_layer=2, vocab_size=512))
    fake = fake_workload(real, plan_for="cpu")
    candidate = Candidate(batch_size=2, choices={"precision": "bf16", "checkpointing": ["h.1"]})
    measured_real = SimulatedDevice(2**34).run(real, candidate, 2).peak_bytes
    measured_fake = FakeDevice(2**34).run(fake, candidate, 2).peak_bytes
    params = len(list(real.model.parameters()))
    assert 0 <= measured_fake - measured_real <= 4 * params


def test_the_fake_device_raises_at_the_budget_and_not_below_it() -> None:
    workload = fake_workload(lambda: _llama(batch_size=2, n_layers=2))
    candidate = Candidate(batch_size=4)
    peak = FakeDevice(2**40).run(workload, candidate, 2).peak_bytes
    assert FakeDevice(peak).run(workload, candidate, 2).peak_bytes == peak
    with pytest.raises(SimulatedOutOfMemoryError):
        FakeDevice(peak - 1).run(workload, candidate, 2)


def test_planning_for_cuda_uses_foreach_adamw_and_the_card_s_fixed_costs() -> None:
    workload = fake_workload(lambda: _llama(batch_size=2, n_layers=2))
    with workload.fake():
        optimizer = workload.make_optimizer(workload.model)
    assert optimizer.defaults["foreach"] is True
    profile = profile_fake(workload, precisions=["fp32"])
    assert profile.device.kind == "fake" and profile.fixed_overhead_bytes == CUDA_FIXED_BYTES
    cpu = fake_workload(lambda: _llama(batch_size=2, n_layers=2), plan_for="cpu")
    assert profile_fake(cpu, precisions=["fp32"]).fixed_overhead_bytes == 0


def test_a_factory_that_builds_outside_the_mode_is_refused() -> None:
    built = _llama(batch_size=1, n_layers=1)
    with pytest.raises(BadInputError, match="outside the fake mode"):
        fake_workload(lambda: built)
    with pytest.raises(BadInputError, match="FakeWorkload"):
        FakeDevice(2**30).run(workload_from_result(built), Candidate(batch_size=1), 1)


def test_a_factory_that_casts_its_model_builds_under_fake_tensors_as_it_does_for_real() -> None:
    """Rule: ``model.to(torch.bfloat16)`` in a factory (the usual LoRA base) converts fake
    parameters as it converts real ones: same dtypes, same bytes, the frozen flags kept, and
    torch's own swap_tensors back afterwards. torch's Module._apply swaps fake parameters,
    which their mode's memo holds weakly: "_apply(): Couldn't swap Embedding.weight"."""
    import torch
    from torch import nn

    swap = torch.utils.swap_tensors

    def build():  # noqa: ANN202
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 16), nn.Linear(16, 64))
        model.to(torch.bfloat16)
        model[0].requires_grad_(False)
        model[2].to(torch.float32)
        return {"model": model, "sample_batch": torch.randint(0, 64, (2, 8)), "loss_fn": None}

    real = workload_from_result(build())
    fake = fake_workload(build)
    assert torch.utils.swap_tensors is swap
    pairs = list(zip(real.model.named_parameters(), fake.model.named_parameters(), strict=True))
    for (name, r), (fake_name, f) in pairs:
        assert name == fake_name and f.dtype == r.dtype and f.shape == r.shape, name
        assert isinstance(f, nn.Parameter) and f.requires_grad == r.requires_grad, name
    assert fake.param_bytes == sum(p.numel() * p.element_size() for p in real.model.parameters())


@pytest.mark.slow
def test_a_7b_llama_is_profiled_under_fake_tensors_using_no_memory() -> None:
    """Llama-2-7B's shape, sequence 2048: 25 GiB of weights and 50 GiB of AdamW state that
    this machine does not have. Its fp32 step peaks in the optimizer: weights, gradients,
    state (twice the weights) and foreach AdamW's one temporary per parameter: five times
    the weights. Its time (under a minute) is a benchmark, not a unit test: a shared 2-core
    machine makes wall time noise (bench/fake_7b.py)."""
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workload = fake_workload(lambda: _llama(batch_size=1, seq_len=2048, preset="7b"))
    assert isinstance(workload, FakeWorkload)
    profile = profile_fake(workload, precisions=["fp32", "bf16"])
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 2**20
    assert grown_gib < 2, f"profiling grew the process by {grown_gib:.1f} GiB"
    assert 6.7e9 * 4 < profile.param_bytes < 6.8e9 * 4
    assert profile.optimizer_state_bytes >= 2 * profile.param_bytes
    assert len(profile.blocks) == 32
    fp32 = estimate(profile, Candidate(batch_size=1), load_strategies(["precision"]))
    weights = profile.param_bytes
    assert fp32.peak_phase == "optimizer"
    assert fp32.peak_bytes == pytest.approx(5 * weights + CUDA_FIXED_BYTES, rel=0.01)
    # bf16 autocast at batch 8 with no checkpointing is activation-bound, and checkpointing
    # all 32 layers brings it down.
    strategies = load_strategies(["precision", "checkpointing"])
    names = [b.name for b in profile.blocks]
    plain = estimate(profile, Candidate(batch_size=8, choices={"precision": "bf16"}), strategies)
    ckpt = Candidate(batch_size=8, choices={"precision": "bf16", "checkpointing": names})
    assert plain.peak_phase == "backward"
    assert estimate(profile, ckpt, strategies).peak_bytes < plain.peak_bytes
