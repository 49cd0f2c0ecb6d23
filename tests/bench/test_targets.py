"""bench/_targets.py: every bench target builds by its name.

Rule: a target the benches name (issue 27's models among them) is a factory that builds a
workload, or, where its package is missing here, is skipped with a message that names the
package; a factory renamed, or a config a library stopped accepting, fails here and not on
the GPU machine. Built on the meta device: shapes only, no memory, no time.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


_targets = _load("_targets")


def test_issue_27_names_its_kinds_of_model() -> None:
    """Issue 27's list is at least 8 targets, every one of them a target."""
    assert len(_targets.ISSUE_27) >= 8
    assert set(_targets.ISSUE_27) <= set(_targets.TARGETS)
    assert {"lm350m", "t5_base", "swin_t", "resnet50", "gpt", "cnn", "llama", "hf_gpt2"} <= set(
        _targets.ISSUE_27
    )


@pytest.mark.parametrize("name", sorted(_targets.TARGETS))
def test_every_target_builds_by_name(name: str) -> None:
    from memadvisor.target import load_target

    if reason := _targets.missing(name):
        assert _targets.NEEDS[name] in reason
        pytest.skip(reason)
    with torch.device("meta"):
        workload = load_target(_targets.TARGETS[name])
    params = sum(p.numel() for p in workload.model.parameters())
    assert params > 0
    if name == "lm350m":  # issue 27: a decoder of at least 0.3B parameters at seq 1024
        assert params >= 0.3e9 and workload.sample_batch[0].shape[1] == 1024
    if name == "t5_base":  # t5-base's config: 223M, 512 input and 128 label tokens
        assert 0.2e9 < params < 0.25e9
        assert workload.sample_batch["input_ids"].shape[1] == 512
        assert workload.sample_batch["labels"].shape[1] == 128
