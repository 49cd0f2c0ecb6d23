"""Data loading against the planned step: the loader's measured rate, the variants that beat
it, and the words that say when the loader limits throughput."""

from __future__ import annotations

import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from memadvisor.dataloading import advise_loader, time_loader
from memadvisor.errors import BadInputError

SLEEP_S = 0.01  # per sample: 4 samples a batch take >= 40 ms in the main process


class SlowSamples(Dataset):
    """Each sample takes SLEEP_S to load: a decode or augmentation stand-in."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        time.sleep(SLEEP_S)
        return torch.full((8,), float(i)), torch.tensor(i % 3)


class FastSamples(SlowSamples):
    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.full((8,), float(i)), torch.tensor(i % 3)


def test_time_loader_measures_the_per_batch_time_of_the_loader() -> None:
    trial = time_loader(DataLoader(SlowSamples(), batch_size=4), batches=3)
    assert trial.batches == 3 and trial.samples_per_batch == 4 and trial.num_workers == 0
    assert trial.batch_ms >= 4 * SLEEP_S * 1e3 * 0.9
    assert trial.batch_ms_spread[0] <= trial.batch_ms <= trial.batch_ms_spread[1]


def test_a_loader_slower_than_the_step_limits_throughput_and_workers_are_advised() -> None:
    loader = DataLoader(SlowSamples(), batch_size=4)
    advice = advise_loader(loader, step_samples_per_s=1000.0, batches=3, worker_counts=(0, 2))
    assert advice.limits_throughput
    assert advice.current.samples_per_s < 1000.0
    assert "The loader, not memory, limits throughput" in " ".join(advice.sentences)
    (variant,) = advice.variants
    assert variant.num_workers == 2
    # Two workers load two batches at once: recommended only because it measured faster.
    assert advice.recommended["num_workers"] == 2
    assert variant.batch_ms <= 0.8 * advice.current.batch_ms
    assert advice.recommended["persistent_workers"] is True
    assert "num_workers=2" in advice.snippet and "persistent_workers=True" in advice.snippet
    assert loader.num_workers == 0  # the user's loader is not changed


def test_a_fast_loader_keeps_up_and_nothing_is_recommended_without_a_measured_gain() -> None:
    advice = advise_loader(
        DataLoader(FastSamples(), batch_size=4), step_samples_per_s=10.0, batches=3,
        worker_counts=(0,),
    )  # fmt: skip
    assert not advice.limits_throughput
    assert advice.recommended == {} and advice.snippet == ""
    assert any("num_workers=0 loading does not overlap" in s for s in advice.sentences)


def test_bad_loaders_are_refused() -> None:
    with pytest.raises(BadInputError, match="must be a torch.utils.data.DataLoader"):
        advise_loader([1, 2, 3], step_samples_per_s=1.0)
    with pytest.raises(BadInputError, match="at least two"):
        time_loader(DataLoader(FastSamples(), batch_size=64))
