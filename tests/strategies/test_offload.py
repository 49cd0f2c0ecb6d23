"""Activation offload: offered only on CUDA with a measured bandwidth, priced by it."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.estimate import StepModel, estimate
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.strategy import load_strategies
from strategies import _forward
from strategies.offload import ActivationOffload, OffloadForward
from tests.fixtures.steps import applied

OFFLOAD = ActivationOffload()
CONFIG = PlanConfig(budget_bytes=2**30)
MIB = 2**20
GBPS = 1e6  # 1 GB/s in bytes per ms


def test_no_choices_on_the_cpu_or_without_a_measured_bandwidth(profile_factory) -> None:
    assert OFFLOAD.choices(profile_factory([(10, 2, 1)], bandwidth=20 * GBPS), CONFIG) == ["off"]
    cuda_unknown = profile_factory([(10, 2, 1)], kind="cuda")
    assert OFFLOAD.choices(cuda_unknown, CONFIG) == ["off"]
    cuda = profile_factory([(10, 2, 1)], kind="cuda", bandwidth=20 * GBPS)
    assert OFFLOAD.choices(cuda, CONFIG) == ["off", "forward"]


def test_effect_moves_all_but_the_loss_and_charges_two_copies(profile_factory) -> None:
    """At batch 4: blocks keep 2 x 10 MiB x 4, the loss 5 MiB x 4 stays; copies both ways."""
    profile = profile_factory(
        [(10, 2, 1), (10, 2, 1)], kind="cuda", bandwidth=20 * GBPS, loss_per_sample=5
    )
    model = StepModel(profile, batch_size=4)
    OFFLOAD.effect(profile, "forward", model)
    moved, kept = 80 * MIB, 100 * MIB
    assert model.offloaded_fraction == pytest.approx(moved / kept)
    assert model.extra_ms == pytest.approx(2 * moved / (20 * GBPS))


def test_effect_after_checkpointing_moves_only_what_is_still_kept(profile_factory) -> None:
    """Checkpointed blocks keep only their inputs: less to copy, so less time."""
    profile = profile_factory([(10, 2, 1), (10, 2, 1)], kind="cuda", bandwidth=20 * GBPS)
    strategies = load_strategies(["checkpointing", "offload"])
    plain = estimate(profile, Candidate(batch_size=4, choices={"offload": "forward"}), strategies)
    ckpt = {"checkpointing": ["layers.0", "layers.1"]}
    both = estimate(
        profile, Candidate(batch_size=4, choices={"offload": "forward", **ckpt}), strategies
    )
    ckpt_only = estimate(profile, Candidate(batch_size=4, choices=ckpt), strategies)
    off = estimate(profile, Candidate(batch_size=4), strategies)
    assert plain.step_ms == pytest.approx(off.step_ms + 2 * 80 * MIB / (20 * GBPS))
    # Checkpointed, the blocks keep only their 2 MiB inputs: 16 MiB to copy, not 80.
    assert both.step_ms == pytest.approx(ckpt_only.step_ms + 2 * 16 * MIB / (20 * GBPS))


def test_effect_without_bandwidth_is_bad_input(profile_factory) -> None:
    profile = profile_factory([(10, 2, 1)], kind="cuda")
    with pytest.raises(BadInputError, match="bandwidth"):
        OFFLOAD.effect(profile, "forward", StepModel(profile, batch_size=2))


def test_apply_keeps_keys_and_is_a_no_op_for_a_cpu_model() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))
    tuned = applied(OFFLOAD, copy.deepcopy(model), "forward", None)
    assert isinstance(tuned.__dict__["forward"], OffloadForward)
    assert list(tuned.state_dict()) == list(model.state_dict())
    x = torch.randn(3, 4)
    assert torch.equal(tuned(x), model(x))
    applied(OFFLOAD, tuned, "off", None)
    assert list(_forward.wrappers(tuned)) == []
    with pytest.raises(BadInputError, match="one of"):
        applied(OFFLOAD, tuned, "half", None)


def test_explain_shows_save_on_cpu_and_the_copy_cost(profile_factory) -> None:
    profile = profile_factory([(10, 2, 1)], kind="cuda", bandwidth=20 * GBPS)
    assert OFFLOAD.explain("off", profile) is None
    advice = OFFLOAD.explain("forward", profile)
    assert "save_on_cpu(pin_memory=True)" in advice.snippet
    assert "20.0 MiB off the card" in advice.effect and "20.0 GB/s" in advice.effect


@pytest.mark.gpu
def test_offload_on_cuda_frees_activations_and_keeps_gradients() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Sequential(nn.Linear(1024, 1024), nn.GELU()) for _ in range(8)))
    model = model.cuda()
    tuned = applied(OFFLOAD, copy.deepcopy(model), "forward", None)
    x = torch.randn(512, 1024, device="cuda")
    grads = []
    held = []
    for m in (model, tuned):
        base = torch.cuda.memory_allocated()
        out = m(x).square().mean()
        held.append(torch.cuda.memory_allocated() - base)
        out.backward()
        grads.append([p.grad for p in m.parameters()])
    assert held[1] < held[0] / 4
    # Offload moves saved tensors to the host and back bit for bit; the gradients may still
    # differ in the last bits because cuBLAS does not promise run-to-run identical sums.
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
