"""memadvisor.target: TARGET strings load factories or fail with a message that helps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memadvisor.errors import BadInputError
from memadvisor.target import load_target, workload_from_result


def test_example_files_load_into_workloads(examples_dir: Path) -> None:
    for name in ("gpt", "cnn"):
        w = load_target(f"{examples_dir / name}.py:build")
        assert isinstance(w.model, torch.nn.Module) and w.loss_fn is not None


def test_module_targets_load_too() -> None:
    w = load_target("tests.fixtures.factories:tiny")
    assert w.sample_batch_size == 2


@pytest.mark.parametrize(
    ("target", "match"),
    [
        ("no_colon", "TARGET must be"),
        ("missing_file.py:build", "No such file"),
        ("no_such_module_xyz:build", "Cannot import module"),
        ("tests.fixtures.factories:nothing_here", "has no callable"),
        ("tests.fixtures.factories:raises", "ZeroDivisionError"),
        ("tests.fixtures.factories:bad_shape", "must return"),
    ],
)
def test_bad_targets_say_what_was_wrong(target: str, match: str) -> None:
    with pytest.raises(BadInputError, match=match):
        load_target(target)


def test_a_file_that_fails_to_import_is_bad_input(tmp_path: Path) -> None:
    f = tmp_path / "broken.py"
    f.write_text("import does_not_exist_anywhere\n")
    with pytest.raises(BadInputError, match="Importing"):
        load_target(f"{f}:build")


def test_mapping_with_unknown_keys_lists_the_allowed_ones() -> None:
    with pytest.raises(BadInputError, match="may have"):
        workload_from_result(
            {"model": torch.nn.Linear(1, 1), "sample_batch": torch.ones(1, 1), "lossfn": None}
        )


def test_a_factory_error_raised_from_another_names_the_innermost_cause(tmp_path: Path) -> None:
    """Rule: where the factory's error was raised from another (a library's lazy import
    wrapping what failed), the message names the innermost cause too: transformers'
    "Could not import module 'GPT2LMHeadModel'" hid torchvision's ops failing to load beside
    a CPU build of torch (session 24)."""
    f = tmp_path / "lazy.py"
    f.write_text(
        "def build():\n"
        "    try:\n"
        "        raise RuntimeError('operator torchvision::nms does not exist\\nmore')\n"
        "    except RuntimeError as e:\n"
        "        raise ModuleNotFoundError(\"Could not import module 'GPT2LMHeadModel'\") from e\n"
    )
    with pytest.raises(BadInputError) as caught:
        load_target(f"{f}:build")
    message = str(caught.value)
    assert "ModuleNotFoundError: Could not import module 'GPT2LMHeadModel'" in message
    assert "(caused by RuntimeError: operator torchvision::nms does not exist)" in message
    assert "more" not in message  # the cause's first line only


def test_a_factory_error_raised_from_none_says_only_itself(tmp_path: Path) -> None:
    f = tmp_path / "plain.py"
    f.write_text("def build():\n    raise ValueError('no data here')\n")
    with pytest.raises(BadInputError) as caught:
        load_target(f"{f}:build")
    assert str(caught.value).endswith("raised ValueError: no data here")
