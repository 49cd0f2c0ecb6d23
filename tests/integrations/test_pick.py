"""plan_options: what every integration changes in memadvisor.plan's options: no bars unless
asked, and the batch capped at the dataset's length where the dataset has one."""

from __future__ import annotations

import torch
from torch.utils.data import IterableDataset, TensorDataset

from memadvisor.integrations._pick import plan_options


class _Stream(IterableDataset):
    def __iter__(self):  # noqa: ANN204
        yield torch.zeros(1)


def test_the_batch_is_capped_at_the_datasets_length_and_bars_are_off() -> None:
    ds = TensorDataset(torch.zeros(100, 2))
    assert plan_options({}, ds) == {"progress": False, "max_batch": 100}


def test_what_you_passed_wins_where_it_is_tighter() -> None:
    ds = TensorDataset(torch.zeros(100, 2))
    assert plan_options({"progress": True, "max_batch": 16}, ds) == {
        "progress": True,
        "max_batch": 16,
    }
    assert plan_options({"max_batch": 1000}, ds)["max_batch"] == 100


def test_a_dataset_without_a_length_is_not_capped() -> None:
    assert plan_options({}, _Stream()) == {"progress": False}
    assert plan_options({}, None) == {"progress": False}
