"""preserved_state puts back RNG states and train/eval flags, also when planning fails."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from memadvisor.process_state import preserved_state


def test_rng_and_modes_are_restored_even_after_an_error() -> None:
    """Random draws and mode changes inside the block are undone, exception or not."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.5), nn.BatchNorm1d(2))
    model[2].eval()
    modes = [m.training for m in model.modules()]
    torch_state, python_state = torch.get_rng_state(), random.getstate()
    with pytest.raises(RuntimeError, match="boom"), preserved_state(model):
        torch.randn(10)
        random.random()
        model.eval()
        model[1].train()
        raise RuntimeError("boom")
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state
    assert [m.training for m in model.modules()] == modes


def test_numpy_rng_is_restored() -> None:
    """NumPy's global generator is put back too (user code seeds it)."""
    numpy = pytest.importorskip("numpy")
    before = numpy.random.get_state()
    with preserved_state(nn.Linear(1, 1)):
        numpy.random.rand(5)
    after = numpy.random.get_state()
    assert before[0] == after[0] and (before[1] == after[1]).all() and before[2:] == after[2:]


def test_the_fp32_matmul_precision_is_restored() -> None:
    """A TF32 candidate applied in the planning process (a compile trial in a thread) sets
    the process-wide matmul precision; the plan puts the caller's back."""
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("highest")
        with preserved_state(nn.Linear(1, 1)):
            torch.set_float32_matmul_precision("high")
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)
