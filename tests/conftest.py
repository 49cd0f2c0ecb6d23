"""Shared test setup: the gpu marker skips without CUDA; examples load by path; a third
party's strategy installs with its entry point as pip would leave it; torchvision imports
where its C++ ops cannot load."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from tests.fixtures.zoo import allow_torchvision_without_ops

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# PyPI's torchvision (the README's test command installs it for tests/test_zoo.py) beside a
# CPU torch cannot load its C++ ops, and its import, and transformers' with it, would fail.
allow_torchvision_without_ops()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def examples_dir() -> Path:
    return EXAMPLES


@pytest.fixture
def install_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable]:
    """``install_plugin(module, source, {name: "module:Class"})``: the module on sys.path with
    a dist-info whose entry points register its strategies in ``memadvisor.strategies``, as
    pip would install a third party's package; taken away after the test."""
    modules: list[str] = []

    def install(module: str, source: str, entry_points: dict[str, str]) -> None:
        (tmp_path / f"{module}.py").write_text(source)
        info = tmp_path / f"{module}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 1.0\n")
        lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
        (info / "entry_points.txt").write_text(f"[memadvisor.strategies]\n{lines}")
        modules.append(module)
        importlib.invalidate_caches()

    monkeypatch.syspath_prepend(str(tmp_path))
    yield install
    for module in modules:
        sys.modules.pop(module, None)
