"""memadvisor.memory.MemoryMeter: storages counted once, freed on release, budget enforced."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from memadvisor.device import is_oom
from memadvisor.errors import SimulatedOutOfMemoryError
from memadvisor.memory import MemoryMeter, unique_storage_bytes


def test_views_share_their_base_storage_and_count_once() -> None:
    meter = MemoryMeter()
    with meter:
        x = torch.empty(256, 4)  # 4096 bytes
        _views = (x[1:], x.t(), x.view(-1))
    assert meter.live_bytes == 4096


def test_freed_storages_leave_the_count_and_the_peak_stays() -> None:
    meter = MemoryMeter()
    with meter:
        x = torch.empty(1000)
        y = torch.empty(500)
    del x
    assert meter.live_bytes == 2000 and meter.peak_bytes == 6000
    del y
    assert meter.live_bytes == 0


def test_adopted_tensors_count_and_shared_storages_count_once() -> None:
    lin = torch.nn.Linear(8, 8)
    meter = MemoryMeter()
    added = meter.adopt([lin.weight, lin.weight, lin.bias])
    assert added == (64 + 8) * 4 == unique_storage_bytes([lin.weight, lin.bias])


def test_a_linear_relu_forward_keeps_what_autograd_saves() -> None:
    lin = torch.nn.Linear(256, 256)
    x = torch.randn(64, 256)
    meter = MemoryMeter()
    with meter:
        y = lin(x).relu()  # addmm's output is freed; relu keeps its result (64x256 fp32)
    assert meter.live_bytes == 64 * 256 * 4
    del y


def test_budget_raises_at_the_budget_and_not_below() -> None:
    meter = MemoryMeter(budget_bytes=4000)
    with meter:
        ok = torch.empty(1000)  # exactly 4000 bytes: fits
    assert meter.live_bytes == 4000
    with pytest.raises(SimulatedOutOfMemoryError) as info, meter:
        torch.empty(1)
    assert is_oom(info.value) and isinstance(info.value, torch.OutOfMemoryError)
    del ok


def test_fake_tensors_are_metered_without_memory() -> None:
    with FakeTensorMode():
        meter = MemoryMeter()
        with meter:
            t = torch.empty(2**30, 4)  # 16 GiB, more than this machine should hand out
        assert meter.live_bytes == 16 * 2**30
        del t


def test_is_oom_recognises_cuda_messages_and_nothing_else() -> None:
    assert is_oom(torch.OutOfMemoryError("x"))
    assert is_oom(RuntimeError("CUDA error: out of memory"))
    assert is_oom(RuntimeError("cuDNN error: CUDNN_STATUS_ALLOC_FAILED"))
    assert not is_oom(RuntimeError("size mismatch"))
    assert not is_oom(ValueError("CUDA out of memory"))


def test_storage_listeners_hear_each_new_storage_once_with_its_key() -> None:
    """A storage listener gets every storage the meter starts counting (made or adopted),
    keyed as the meter keys it, and never a view of one it already counts."""
    heard: list[tuple[int, int]] = []
    meter = MemoryMeter()
    meter.add_storage_listener(lambda st, n: heard.append((id(st), n)))
    w = torch.empty(10)
    meter.adopt([w, w])
    with meter:
        x = torch.empty(100)
        _view = x[1:]
    assert heard == [(id(w.untyped_storage()), 40), (id(x.untyped_storage()), 400)]


def test_tensors_built_from_python_values_are_counted() -> None:
    """torch.tensor(...) reaches the dispatcher only through lift_fresh: it is still new memory."""
    meter = MemoryMeter()
    with meter:
        t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    assert meter.live_bytes == 16
    del t


def test_a_meter_that_tracks_resizes_counts_storage_freed_and_regrown() -> None:
    # FSDP2 frees its gathered weights with UntypedStorage.resize_(0), which no dispatch
    # mode sees: track_resizes follows it, and restores resize_ when done.
    original = torch.UntypedStorage.resize_
    with MemoryMeter(track_resizes=True) as meter:
        t = torch.empty(1024)  # 4 KiB
        t.untyped_storage().resize_(0)
        assert meter.live_bytes == 0
        t.untyped_storage().resize_(8192)
        assert meter.live_bytes == 8192
    assert meter.peak_bytes == 8192
    assert torch.UntypedStorage.resize_ is original


def test_a_resize_past_the_budget_fails_as_an_allocation_would() -> None:
    with MemoryMeter(budget_bytes=8192, track_resizes=True) as meter:
        t = torch.empty(1024)
        with pytest.raises(torch.OutOfMemoryError):
            t.untyped_storage().resize_(16384)
        assert meter.live_bytes == 4096 and t.untyped_storage().nbytes() == 4096


def test_without_tracking_resizes_are_not_seen() -> None:
    with MemoryMeter() as meter:
        t = torch.empty(1024)
        t.untyped_storage().resize_(0)
        assert meter.live_bytes == 4096
