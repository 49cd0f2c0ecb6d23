"""MemoryStep's records: keyed by id(storage), each answers only for its own storage."""

from __future__ import annotations

import weakref

import torch
from torch import nn

from memadvisor.profiler._device import resolve_target
from memadvisor.profiler._memory_step import MemoryStep, _Record


def test_a_record_answers_only_for_the_storage_it_was_made_for() -> None:
    """The id of a storage that died can be taken by one the step never made (a constant
    whose Python wrapper appears only when the graph is walked): the record of the dead one
    must not be read as the new one's, or its bytes land in a block (a flaky extra row)."""
    model = nn.Linear(2, 2)
    step = MemoryStep(model, [], resolve_target(model, "cpu"))
    step._reset()
    made, other = torch.zeros(4).untyped_storage(), torch.zeros(8).untyped_storage()
    record = _Record(serial=0, nbytes=16, module=-1, block=0, in_loss=False, cast_weight=False,
                     storage=weakref.ref(made))  # fmt: skip
    step.records[id(made)] = record
    assert step._record_of(made) is record
    step.records[id(other)] = step.records.pop(id(made))  # as if `other` took the dead id
    assert step._record_of(other) is None
