"""memadvisor.profiler._state: the private copy, the in-place fallback, the RNG put back."""

from __future__ import annotations

import random
import threading

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from memadvisor.process_state import rng_restored
from memadvisor.profiler import profile_workload
from memadvisor.profiler._state import clone_module, private_model
from memadvisor.workload import Workload


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight
        self.register_buffer("scale", torch.ones(4))
        self.mask = torch.ones(4)  # a plain tensor attribute


def test_a_clone_keeps_ties_and_shares_no_tensor_with_the_original() -> None:
    """Tied weights stay tied in the clone; no parameter, buffer or attribute is shared."""
    model = Tied()
    model.emb.weight.grad = torch.ones(10, 4)
    clone = clone_module(model)
    assert clone.head.weight is clone.emb.weight
    assert clone.emb.weight is not model.emb.weight and clone.emb.weight.grad is None
    assert torch.equal(clone.emb.weight, model.emb.weight)
    assert clone.scale is not model.scale and clone.mask is not model.mask


def test_a_clone_made_on_the_device_the_model_is_on_still_shares_nothing() -> None:
    """Rule: cloned onto a device (the profile's: straight to the card, not through a host
    clone), a tensor already there is copied all the same; ties stay tied; a plain tensor
    attribute is cloned where it is, as Module.to leaves it."""
    model = Tied()
    clone = clone_module(model, torch.device("cpu"))
    assert clone.head.weight is clone.emb.weight
    assert clone.emb.weight.data_ptr() != model.emb.weight.data_ptr()
    assert clone.scale.data_ptr() != model.scale.data_ptr()
    assert clone.mask is not model.mask and torch.equal(clone.mask, model.mask)
    assert isinstance(clone.emb.weight, nn.Parameter) and clone.emb.weight.requires_grad
    with torch.no_grad():
        clone.emb.weight.add_(1.0)
    assert not torch.equal(clone.emb.weight, model.emb.weight)


@pytest.mark.gpu
def test_a_clone_made_on_a_card_holds_its_parameters_and_buffers_there() -> None:
    """Rule: a model on the host cloned to a card has its parameters and buffers on the card
    with the same values (ties kept); plain tensor attributes stay on the host."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = Tied()
    clone = clone_module(model, torch.device("cuda"))
    assert clone.emb.weight.is_cuda and clone.scale.is_cuda and not clone.mask.is_cuda
    assert clone.head.weight is clone.emb.weight
    assert torch.equal(clone.emb.weight.cpu(), model.emb.weight)


def test_fake_models_clone_in_their_own_fake_mode() -> None:
    """A plain deepcopy of a fake model lands in a second mode; the clone runs in the first."""
    with FakeTensorMode():
        model = nn.Linear(4, 4)
        clone = clone_module(model)
        out = clone(torch.randn(2, 4))  # would raise "Mixing fake modes" otherwise
    assert out.shape == (2, 4)


class Uncopyable(nn.Module):
    """BatchNorm (buffers a step changes) and a lock, which deepcopy refuses."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(
            *(nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8)) for _ in range(2))
        )
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x).square().mean()


def test_a_model_that_cannot_be_copied_is_profiled_in_place_and_put_back() -> None:
    """Weights, gradients and BatchNorm's running statistics are exactly as before, and the
    profile equals that of a copyable twin."""
    torch.manual_seed(0)
    model = Uncopyable()
    model(torch.randn(4, 8)).backward()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    buffers = {n: b for n, b in model.named_buffers()}
    batch = torch.randn(4, 8)
    p = profile_workload(Workload(model, batch), device="cpu", precisions=["fp32"])
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert all(torch.equal(p_.grad, grads[n]) for n, p_ in model.named_parameters())
    assert all(b is buffers[n] for n, b in model.named_buffers())

    twin = Uncopyable()
    twin.lock = None  # copyable now
    twin.load_state_dict(model.state_dict())
    q = profile_workload(Workload(twin, batch), device="cpu", precisions=["fp32"])
    assert [b.activation for b in p.steps["fp32"].blocks] == [
        b.activation for b in q.steps["fp32"].blocks
    ]


def test_in_place_fallback_restores_even_when_the_step_fails() -> None:
    """An exception inside the block still puts the weights back."""
    model = Uncopyable()
    before = model.layers[0][0].weight.detach().clone()
    try:
        with private_model(model, torch.device("cpu")) as same:
            assert same is model
            with torch.no_grad():
                same.layers[0][0].weight.add_(1.0)
            raise RuntimeError("boom")
    except RuntimeError:
        pass
    assert torch.equal(model.layers[0][0].weight, before)


def test_rng_states_are_put_back() -> None:
    """torch's and Python's generators continue as if nothing had drawn from them."""
    torch.manual_seed(5)
    random.seed(5)
    expected = (torch.rand(3), random.random())
    torch.manual_seed(5)
    random.seed(5)
    with rng_restored():
        torch.rand(100)
        random.random()
    assert torch.equal(torch.rand(3), expected[0]) and random.random() == expected[1]
