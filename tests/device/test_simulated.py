"""SimulatedDevice: exact tensor bytes of a fresh copy's steps; the budget enforced as on a card."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from memadvisor.device.simulated import SimulatedDevice
from memadvisor.errors import BadInputError, SimulatedOutOfMemoryError, is_oom
from memadvisor.schema.candidate import Candidate
from memadvisor.target import load_target
from memadvisor.workload import Workload

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture(scope="module")
def cnn() -> Workload:
    """examples/cnn.py's ResNet, narrowed and on 16x16 images to run in well under a second."""
    example = load_target(f"{EXAMPLES}/cnn.py:build")  # imports the example's classes
    model = type(example.model)(channels=16, width=8, depth=3)
    images, labels = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
    return Workload(model=model, sample_batch=(images, labels), loss_fn=example.loss_fn)


def _linear_workload(n: int = 64, batch: int = 8, optimizer=None) -> Workload:  # noqa: ANN001
    torch.manual_seed(0)
    return Workload(
        model=nn.Linear(n, n, bias=False),
        sample_batch=torch.randn(batch, n),
        loss_fn=lambda out, _batch: out.sum(),
        optimizer_factory=optimizer,
    )


def test_a_linear_layer_under_adamw_peaks_in_the_optimizer_step_by_hand_count() -> None:
    """y = x W^T, loss = y.sum(), AdamW (CPU: one parameter at a time), 4-byte floats.

    The peak is in the optimizer step: W, its gradient, the batch x, the output y (held
    through the step as a user's loop holds it, memadvisor.workload.train_step), AdamW's two
    state tensors, and two W-sized temporaries (sqrt(exp_avg_sq) and its division by the
    bias correction, alive together for a moment), plus the 4-byte loss and AdamW's 4-byte
    step counter.
    """
    n, b = 64, 8
    measured = SimulatedDevice(2**30).run(_linear_workload(n, b), Candidate(batch_size=b), 2)
    weight, rows = 4 * n * n, 4 * b * n
    assert measured.peak_bytes == weight + weight + rows + rows + 2 * weight + 2 * weight + 4 + 4


def test_the_caller_s_model_gradients_and_rng_are_untouched(cnn: Workload) -> None:
    before = {k: v.clone() for k, v in cnn.model.state_dict().items()}
    for p in cnn.model.parameters():
        p.grad = torch.ones_like(p)
    rng = torch.get_rng_state()
    SimulatedDevice(2**30).run(cnn, Candidate(batch_size=4), 2)
    assert torch.equal(rng, torch.get_rng_state())
    assert all(torch.equal(before[k], v) for k, v in cnn.model.state_dict().items())
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in cnn.model.parameters())
    for p in cnn.model.parameters():
        p.grad = None


def test_runs_start_clean_so_the_same_candidate_measures_the_same(cnn: Workload) -> None:
    device = SimulatedDevice(2**30)
    first = device.run(cnn, Candidate(batch_size=4), 2).peak_bytes
    assert device.run(cnn, Candidate(batch_size=4), 2).peak_bytes == first


def test_raises_at_the_budget_and_not_below_it(cnn: Workload) -> None:
    candidate = Candidate(batch_size=4)
    peak = SimulatedDevice(2**30).run(cnn, candidate, 3).peak_bytes
    assert SimulatedDevice(peak).run(cnn, candidate, 3).peak_bytes == peak
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        SimulatedDevice(peak - 1).run(cnn, candidate, 3)
    assert is_oom(info.value) and isinstance(info.value, torch.OutOfMemoryError)
    # The first step has no optimizer state during forward and backward: the second peaks.
    assert info.value.memadvisor_steps_completed == 1


def test_weights_over_the_budget_fail_before_any_step(cnn: Workload) -> None:
    with pytest.raises(SimulatedOutOfMemoryError) as info:
        SimulatedDevice(1024).run(cnn, Candidate(batch_size=1), 2)
    assert info.value.memadvisor_steps_completed == 0


def test_checkpointing_every_block_lowers_the_measured_peak(cnn: Workload) -> None:
    device = SimulatedDevice(2**30)
    blocks = [f"layers.{i}" for i in range(3)]
    plain = device.run(cnn, Candidate(batch_size=4), 2).peak_bytes
    ckpt = device.run(cnn, Candidate(batch_size=4, choices={"checkpointing": blocks}), 2)
    assert ckpt.peak_bytes < 0.7 * plain


def test_accumulation_keeps_gradients_through_the_next_micro_batch() -> None:
    """With 2 micro-batches the second one's backward also holds the first one's W grad."""
    n, b = 64, 8
    w = _linear_workload(n, b, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    one = SimulatedDevice(2**30).run(w, Candidate(batch_size=b), 2)
    two = SimulatedDevice(2**30).run(w, Candidate(batch_size=b, accumulation_steps=2), 2)
    # Backward of micro-batch 2 makes its W gradient (n*n) while the first one is held, and
    # the loss divided by the accumulation steps is one 4-byte scalar more.
    assert two.peak_bytes == one.peak_bytes + 4 * n * n + 4
    assert two.samples_per_s == pytest.approx(2 * b / two.step_ms * 1e3)


def test_bad_arguments_say_what_was_wrong(cnn: Workload) -> None:
    with pytest.raises(BadInputError, match="steps=0"):
        SimulatedDevice(2**30).run(cnn, Candidate(batch_size=1), 0)
    with pytest.raises(BadInputError, match="autocast_policy"):
        SimulatedDevice(2**30, autocast_policy="tpu")  # type: ignore[arg-type]
