"""memadvisor.profiler.find_blocks: the repeated units by default, or what the caller names."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.profiler import find_blocks


def _example(examples_dir: Path, name: str) -> nn.Module:
    sys.path.insert(0, str(examples_dir))
    try:
        module = __import__(name)
    finally:
        sys.path.remove(str(examples_dir))
    return module.build()["model"]


def test_gpt_blocks_are_its_transformer_layers(examples_dir: Path) -> None:
    """The GPT's ModuleList of four Blocks, not its Linear layers or embeddings."""
    assert find_blocks(_example(examples_dir, "gpt")) == ["h.0", "h.1", "h.2", "h.3"]


def test_cnn_blocks_are_its_bottlenecks_not_the_stem(examples_dir: Path) -> None:
    """The Sequential of six Bottlenecks; the stem's Sequential mixes types and is skipped."""
    assert find_blocks(_example(examples_dir, "cnn")) == [f"layers.{i}" for i in range(6)]


class Unit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(2, 2)
        self.b = nn.Linear(2, 2)


class Staged(nn.Module):
    """A ResNet-like layout: stages of Units, and a ModuleList of three heads."""

    def __init__(self) -> None:
        super().__init__()
        self.stage1 = nn.Sequential(Unit(), Unit())
        self.stage2 = nn.Sequential(Unit(), Unit(), Unit())
        self.heads = nn.ModuleList(nn.Linear(2, 2) for _ in range(3))


def test_sibling_stages_of_one_block_type_count_together() -> None:
    """Two stages of Units (five in all) beat three heads, and give all five, in order."""
    assert find_blocks(Staged()) == [
        "stage1.0",
        "stage1.1",
        "stage2.0",
        "stage2.1",
        "stage2.2",
    ]


class DenseStage(nn.ModuleDict):
    """torchvision's _DenseBlock: a ModuleDict of layers that its forward runs in order."""

    def __init__(self) -> None:
        super().__init__({f"denselayer{i}": Unit() for i in (1, 2, 3)})


def test_units_kept_in_a_module_dict_are_blocks() -> None:
    """Rule: a ModuleDict is a container like the others (DenseNet had no blocks at all)."""
    model = nn.Sequential(nn.Linear(2, 2), DenseStage(), nn.ReLU(), DenseStage())
    assert find_blocks(model) == [f"{s}.denselayer{i}" for s in (1, 3) for i in (1, 2, 3)]


def test_a_model_without_repeated_units_has_no_blocks() -> None:
    """Nothing repeats: no blocks (everything is profiled as outside owners)."""
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) == []


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("stage2.*", ["stage2.0", "stage2.1", "stage2.2"]),  # '*' stays in one component
        ("stage1.1", ["stage1.1"]),
        ("**.a", [f"stage{s}.{i}.a" for s, n in ((1, 2), (2, 3)) for i in range(n)]),
        (Unit, ["stage1.0", "stage1.1", "stage2.0", "stage2.1", "stage2.2"]),
        ("Unit", ["stage1.0", "stage1.1", "stage2.0", "stage2.1", "stage2.2"]),
        (["heads.0", "stage1.0"], ["stage1.0", "heads.0"]),  # model order, not argument order
        ([], []),
    ],
)
def test_blocks_can_be_named_by_glob_name_type_or_class_name(spec, expected) -> None:
    """Every form of override picks exactly the modules it names."""
    assert find_blocks(Staged(), spec) == expected


def test_a_pattern_that_matches_nothing_is_refused_with_the_top_level_names() -> None:
    """The error names the pattern and what the model has."""
    with pytest.raises(BadInputError, match=r"'layers\.\*'.*stage1"):
        find_blocks(Staged(), "layers.*")


def test_nested_blocks_are_refused() -> None:
    """A block inside another block cannot be checkpointed separately."""
    with pytest.raises(BadInputError, match="contains"):
        find_blocks(Staged(), ["stage1.0", "stage1.0.a"])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = nn.Linear(4, 4)


class Stem(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)


def test_blocks_beside_a_head_in_one_sequential_are_found() -> None:
    """nn.Sequential(*blocks, head): the run of Blocks, not the head."""
    model = nn.Sequential(*(Block() for _ in range(3)), nn.Linear(4, 2))
    assert find_blocks(model) == ["0", "1", "2"]


def test_blocks_between_a_stem_and_a_head_in_a_container_are_found() -> None:
    """A stem, four Blocks and a head in one Sequential (or one ModuleList, as a model that
    loops over it would keep them): the Blocks, by their place in the container."""
    parts = [Stem(), *(Block() for _ in range(4)), nn.Linear(4, 2)]
    for container in (nn.Sequential(*parts), nn.ModuleList(parts)):
        wrapper = nn.Module()
        wrapper.net = container
        assert find_blocks(wrapper) == ["net.1", "net.2", "net.3", "net.4"]


def test_the_longest_kind_of_run_wins_and_activations_are_never_blocks() -> None:
    """Two Stems and three Blocks side by side: the Blocks; a run of ReLUs has no parameters
    and a Linear-ReLU alternation has no run: no blocks."""
    mixed = nn.Sequential(Stem(), Stem(), nn.ReLU(), Block(), Block(), Block(), nn.ReLU())
    assert find_blocks(mixed) == ["3", "4", "5"]
    assert find_blocks(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.ReLU())) == []
    alternating = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.ReLU())
    assert find_blocks(alternating) == []
