"""Batch size: accumulation that keeps the effective batch, and a loop snippet that does it."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from memadvisor.errors import BadInputError
from memadvisor.estimate import StepModel, estimate
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from strategies.batch_size import BatchSize, accumulation_steps_for, choice_for
from tests.fixtures.steps import applied

BATCH = BatchSize()


@pytest.mark.parametrize(
    ("effective", "micro", "steps"), [(72, 12, 6), (72, 10, 8), (8, 16, 1), (1, 1, 1)]
)
def test_accumulation_reaches_at_least_the_effective_batch(
    effective: int, micro: int, steps: int
) -> None:
    assert accumulation_steps_for(effective, micro) == steps


def test_accumulation_rejects_non_positive_sizes() -> None:
    with pytest.raises(BadInputError, match="effective_batch=0"):
        accumulation_steps_for(0, 4)


def test_choice_records_the_candidate_and_effect_checks_it_matches(profile_factory) -> None:
    cand = Candidate(batch_size=12, accumulation_steps=6)
    choice = choice_for(cand, effective_batch=72)
    assert choice == {"batch_size": 12, "accumulation_steps": 6, "effective_batch": 72}
    assert choice_for(Candidate(batch_size=12)) is None
    profile = profile_factory([(10, 2, 1)])
    recorded = Candidate(batch_size=12, accumulation_steps=6, choices={"batch_size": choice})
    assert estimate(profile, recorded, [BATCH]) == estimate(profile, cand, [BATCH])
    with pytest.raises(BadInputError, match="disagrees"):
        BATCH.effect(profile, choice, StepModel(profile, batch_size=8, accumulation_steps=6))


def test_search_leaves_the_batch_to_the_planner(profile_factory) -> None:
    config = PlanConfig(budget_bytes=2**30, objective="effective_batch", effective_batch=64)
    assert BATCH.choices(profile_factory([(10, 2, 1)]), config) == [None]


def test_the_loop_snippet_accumulates_to_the_full_batch_gradient(profile_factory) -> None:
    """Running the advice's loop gives the gradient of the mean loss over the effective batch."""
    advice = BATCH.explain(
        {"batch_size": 4, "accumulation_steps": 3, "effective_batch": 12},
        profile_factory([(10, 2, 1)]),
    )
    assert "accumulation_steps = 3" in advice.snippet and "batch_size=4" in advice.snippet
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    x, y = torch.randn(12, 3), torch.randint(0, 2, (12,))
    loss_fn = nn.functional.cross_entropy
    loss_fn(model(x), y).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)

    class Capture:
        grads: list = []

        def step(self) -> None:
            self.grads.append([p.grad.clone() for p in model.parameters()])

        def zero_grad(self, set_to_none: bool = True) -> None:
            model.zero_grad(set_to_none=set_to_none)

    optimizer = Capture()
    namespace = {
        "DataLoader": DataLoader,
        "dataset": TensorDataset(x, y),
        "model": model,
        "loss_fn": loss_fn,
        "optimizer": optimizer,
    }
    exec(advice.snippet, namespace)  # noqa: S102 - the advice is code meant to be run
    assert len(optimizer.grads) == 1
    for got, want in zip(optimizer.grads[0], expected, strict=True):
        torch.testing.assert_close(got, want)


def test_apply_leaves_the_model_alone_and_neutral_explains_nothing(profile_factory) -> None:
    model = nn.Linear(2, 2)
    assert applied(BATCH, model, {"batch_size": 4}, None) is model
    assert BATCH.explain(None, profile_factory([(10, 2, 1)])) is None
    with pytest.raises(BadInputError, match="batch_size"):
        applied(BATCH, model, [4], None)
