"""memadvisor.profiler._untracked: the sizes, the fitted line, and what a failed measure gives."""

from __future__ import annotations

import pytest
import torch

from memadvisor.errors import BadInputError, is_oom
from memadvisor.memory import MemoryMeter
from memadvisor.profiler import profile_workload
from memadvisor.profiler._untracked import (
    UNTRACKED_BATCH_BYTES,
    LargestAllocation,
    fit_untracked,
    measure_untracked,
    untracked_batch_sizes,
)
from memadvisor.schema.profile import LinearBytes
from memadvisor.workload import Workload

MIB, GIB = 2**20, 2**30


def _cnn_fp32_backward(b: int) -> dict[str, int]:
    """examples/cnn.py fp32 on an H200: backward's untracked bytes (MiB as measured, rounded),
    flat 65 MiB to batch 32, then 65 + 1.4375 MiB a sample; the optimizer's a flat 65."""
    backward = 65 * MIB if b <= 32 else int((65 + 1.4375 * b) * MIB)
    return {"forward": 17 * MIB, "backward": backward, "optimizer": 65 * MIB}


# -- the sizes --------------------------------------------------------------------------------


def test_b_holds_two_gib_of_batch_dependent_bytes() -> None:
    """cnn fp32 adds ~7 MiB a sample: B = ceil(2 GiB / 7 MiB) = 293, 2B = 586."""
    assert untracked_batch_sizes(7 * MIB, (2, 4), 100 * GIB) == (293, 586)
    assert 293 * 7 * MIB >= UNTRACKED_BATCH_BYTES > 292 * 7 * MIB


def test_b_is_at_least_the_profiled_larger_size() -> None:
    """A GiB a sample (a large LM) would give B = 2; the line must reach past the profile's 4."""
    assert untracked_batch_sizes(GIB, (2, 4), 100 * GIB) == (4, 8)


def test_two_b_needs_at_most_half_the_free_memory() -> None:
    """2 GiB free: 2B may take 1 GiB, 7 MiB a sample: B = 73 (2B = 146 takes 1022 MiB)."""
    sizes = untracked_batch_sizes(7 * MIB, (2, 4), 2 * GIB)
    assert sizes == (73, 146)
    assert sizes[1] * 7 * MIB <= GIB < (sizes[1] + 2) * 7 * MIB


def test_no_sizes_when_the_card_cannot_hold_past_the_profile_or_nothing_grows() -> None:
    assert untracked_batch_sizes(GIB, (2, 4), 10 * GIB) is None  # 2B = 8 needs 8 GiB of 5
    assert untracked_batch_sizes(0.0, (2, 4), 100 * GIB) is None
    assert untracked_batch_sizes(-5.0, (2, 4), 100 * GIB) is None


# -- the line ---------------------------------------------------------------------------------


def test_the_line_through_two_larger_sizes_predicts_cnn_s_batch_256() -> None:
    """Through 64 (157 MiB) and 128 (249 MiB): 65 MiB + 1.4375 MiB a sample, 433 MiB at 256
    as measured; each phase fitted on its own, with what the profile's peak held of it."""
    lines = fit_untracked(
        (64, 128),
        (_cnn_fp32_backward(64), _cnn_fp32_backward(128)),
        {"backward": 65 * MIB, "optimizer": 66 * MIB},
    )
    by_phase = {u.phase: u for u in lines}
    assert set(by_phase) == {"forward", "backward", "optimizer"}
    backward = by_phase["backward"]
    assert backward.untracked.per_sample_bytes == pytest.approx(1.4375 * MIB, rel=1e-6)
    assert backward.untracked.constant_bytes == pytest.approx(65 * MIB, abs=2)
    assert backward.untracked.at(256) == pytest.approx(433 * MIB, abs=2)
    assert backward.profiled_bytes == 65 * MIB and by_phase["forward"].profiled_bytes == 0
    assert by_phase["optimizer"].untracked == LinearBytes(constant_bytes=65 * MIB)


def test_a_phase_measured_at_one_size_only_gets_no_line() -> None:
    lines = fit_untracked((8, 16), ({"backward": 1}, {"backward": 2, "zero_grad": 3}), {})
    assert [u.phase for u in lines] == ["backward"]


# -- measuring ----------------------------------------------------------------------------------


def test_both_sizes_are_measured_and_fitted() -> None:
    asked: list[int] = []

    def measure(b: int) -> dict[str, int]:
        asked.append(b)
        return _cnn_fp32_backward(b)

    fit = measure_untracked(measure, (100, 200), {"backward": 65 * MIB}, is_oom)
    assert asked == [100, 200]
    sizes, lines = fit
    assert sizes == (100, 200)
    assert {u.phase: u.untracked.at(300) for u in lines}["backward"] == int(
        (65 + 1.4375 * 300) * MIB
    )


def test_no_sizes_measure_nothing() -> None:
    def measure(b: int) -> dict[str, int]:
        raise AssertionError("measured without sizes")

    assert measure_untracked(measure, None, {}, is_oom) is None


def test_an_out_of_memory_error_leaves_the_lines_out() -> None:
    """The card was busier than its free memory said: no lines, the profile goes on."""

    def measure(b: int) -> dict[str, int]:
        if b > 150:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return _cnn_fp32_backward(b)

    assert measure_untracked(measure, (100, 200), {}, is_oom) is None


def test_any_other_error_is_raised_unchanged() -> None:
    def measure(b: int) -> dict[str, int]:
        raise BadInputError("the model rejected the batch")

    with pytest.raises(BadInputError, match="rejected"):
        measure_untracked(measure, (100, 200), {}, is_oom)


# -- in a profile -------------------------------------------------------------------------------


def test_a_cpu_profile_measures_no_untracked_bytes() -> None:
    """On the CPU every byte is a tracked tensor: nothing to fit, nothing extra measured."""
    calls: list[tuple[str, int, int]] = []
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    profile = profile_workload(
        Workload(model=model, sample_batch=torch.randn(2, 8), loss_fn=lambda out, _b: out.sum()),
        device="cpu",
        precisions=["fp32"],
        progress=lambda what, done, total: calls.append((what, done, total)),
    )
    step = profile.steps["fp32"]
    assert step.untracked == [] and step.untracked_batch_sizes is None
    assert not any("untracked" in what for what, _, _ in calls)
    assert calls[-1][1] == calls[-1][2]  # the progress total counts no untracked steps


@pytest.mark.gpu
def test_on_cuda_cnn_fp32_backward_untracked_bytes_grow_with_the_batch(examples_dir) -> None:  # noqa: ANN001
    """examples/cnn.py fp32 on a card: the backward line is fitted past the profile's sizes,
    its slope is cuDNN's workspace growth (1.44 MiB a sample on an H200), and at 2B it is
    within 10% of a fresh measurement (the line goes through it)."""
    from memadvisor.target import load_target

    workload = load_target(f"{examples_dir}/cnn.py:build")
    profile = profile_workload(workload, device="cuda", precisions=["fp32"])
    step = profile.steps["fp32"]
    assert step.untracked_batch_sizes is not None
    assert step.untracked_batch_sizes[0] > profile.batch_sizes[1]
    backward = {u.phase: u for u in step.untracked}["backward"]
    assert backward.untracked.per_sample_bytes > 0.5 * MIB
    assert backward.profiled_bytes > 0


# -- the largest allocation ---------------------------------------------------------------------


def test_largest_allocation_is_the_biggest_storage_made_on_its_device() -> None:
    """It keeps the largest storage a meter sees made on its device type; tensors adopted
    before it listens, and storages on other devices, do not count."""
    adopted = torch.zeros(1024)  # 4 KiB, held before the listener
    meter = MemoryMeter()
    meter.adopt([adopted])
    largest, elsewhere = LargestAllocation("cpu"), LargestAllocation("cuda")
    meter.add_storage_listener(largest)
    meter.add_storage_listener(elsewhere)
    with meter:
        a = torch.ones(100)  # 400 B
        b = torch.ones(300)  # 1200 B, the largest made
        c = (a.sum() + b.sum()).expand(10)
    del a, b, c
    assert largest.bytes == 300 * 4
    assert elsewhere.bytes == 0
