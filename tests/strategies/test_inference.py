"""Inference: offered for workloads that never train; eval + inference_mode, measured saving."""

from __future__ import annotations

import torch
from torch import nn

from memadvisor.schema.config import PlanConfig
from memadvisor.workload import Workload
from strategies import _forward
from strategies.inference import Inference, measure_inference
from tests.fixtures.steps import applied

INFERENCE = Inference()
CONFIG = PlanConfig(budget_bytes=2**30)


def _deep_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*(nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(8)))


def test_offered_only_when_the_profile_trains_nothing(profile_factory) -> None:
    training = profile_factory([(10, 2, 1)])
    assert INFERENCE.choices(training, CONFIG) == ["off"]
    inference = training.model_copy(update={"grad_bytes": 0, "optimizer_state_bytes": 0})
    assert INFERENCE.choices(inference, CONFIG) == ["advice"]
    assert INFERENCE.explain("off", inference) is None
    assert "inference_mode" in INFERENCE.explain("advice", inference).snippet


def test_apply_evals_and_runs_without_autograd_with_keys_unchanged() -> None:
    model = _deep_mlp()
    keys = list(model.state_dict())
    applied(INFERENCE, model, "advice", None)
    out = model(torch.randn(2, 64))
    assert not model.training and out.is_inference() and list(model.state_dict()) == keys
    applied(INFERENCE, model, "off", None)
    assert list(_forward.wrappers(model)) == []


def test_measured_saving_inference_mode_and_chunks_cut_the_forward_peak() -> None:
    """8 layers of (32, 64) fp32 kept with grad; one layer's working set without; a quarter
    of that per chunk of 8. The user's model stays in train mode, unwrapped."""
    model = _deep_mlp()
    workload = Workload(model=model, sample_batch=torch.randn(32, 64))
    m = measure_inference(workload, chunks=4)
    assert m["forward_with_grad_peak_bytes"] >= 8 * 32 * 64 * 4  # every output kept
    assert m["inference_mode_peak_bytes"] <= 3 * 32 * 64 * 4  # about two layers' outputs
    assert m["chunk_size"] == 8
    assert m["chunk_peak_bytes"] < m["inference_mode_peak_bytes"]
    assert model.training and "forward" not in model.__dict__
    check = INFERENCE.check(workload, "advice")
    assert check.metrics == m and "inference_mode" in check.summary
