"""A run's steps on a card (memadvisor/device/_train.py), on the CPU with the CUDA calls it
makes stubbed: what the allocator's retry counter decides."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memadvisor.device import _train
from memadvisor.errors import AllocatorRetriesError, is_oom
from memadvisor.schema.candidate import Candidate
from memadvisor.workload import Workload
from tests.fixtures.cuda_stubs import stub_cuda


@pytest.fixture
def retrying(monkeypatch) -> dict:
    """train_candidate's CUDA calls on the CPU; the allocator's retry count rises by one
    each time it is read after a step of a batch in ``state["at"]`` (the loss records the
    batch it saw)."""
    state: dict = {"at": set(), "batch": None, "count": 0, "steps": 0}

    def count() -> int:
        if state["batch"] in state["at"]:
            state["count"] += 1
        state["batch"] = None
        return state["count"]

    stub_cuda(monkeypatch, retries=count)
    return state


def _workload(state: dict) -> Workload:
    def loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        state["batch"] = len(batch)
        state["steps"] += 1
        return out.square().mean()

    torch.manual_seed(0)
    return Workload(model=nn.Linear(8, 4), sample_batch=torch.randn(4, 8), loss_fn=loss)


def _run(state: dict, batch: int, steps: int = 5, retry_at: int | None = None):
    return _train.train_candidate(
        _workload(state),
        Candidate(batch_size=batch),
        steps,
        device=torch.device("cpu"),
        strategies=[],
        retry_at=retry_at,
    )


def test_a_batch_the_allocator_retries_in_every_timed_step_ran_out(retrying: dict) -> None:
    """Rule: a run whose timed steps (all but the first) made the caching allocator free its
    cache and retry, most of them, raises an out-of-memory error that says so and how many
    steps ended; one that retried in its first step only (warm-up, the optimizer's state)
    fits."""
    retrying["at"] = {8}
    with pytest.raises(AllocatorRetriesError) as caught:
        _run(retrying, 8)
    assert is_oom(caught.value)
    # 2 of 4 timed steps decide it (the share, RETRIED_STEPS_SHARE): it stops after them
    assert caught.value.retried_steps == 2 and caught.value.timed_steps == 2
    assert caught.value.memadvisor_steps_completed == 3
    assert retrying["steps"] == 3  # the steps that could not undo the verdict were not run
    assert "batch 8" in str(caught.value) and "2 of its first 2 timed steps" in str(caught.value)
    assert "\n" not in str(caught.value)  # a fork server's child sends the first line

    retrying["at"] = set()
    retrying["count"] = 0
    measured = _run(retrying, 8)
    assert measured.steps == 5 and measured.ran_out_first is None


def test_a_retried_batch_is_run_again_smaller_in_the_same_process(retrying: dict) -> None:
    """Rule: with ``retry_at``, a batch that ran out by the allocator's retries is measured
    at the smaller batch in the same run, which says what ran out first and why."""
    retrying["at"] = {8}
    measured = _run(retrying, 8, retry_at=4)
    assert measured.ran_out_first is not None
    assert measured.ran_out_first.batch_size == 8
    assert "caching allocator" in measured.ran_out_first.message
    assert measured.samples_per_s > 0

    retrying["at"] = {8, 4}
    with pytest.raises(torch.OutOfMemoryError) as caught:
        _run(retrying, 8, retry_at=4)
    assert getattr(caught.value, "memadvisor_retry_ran_out", None) == 4
