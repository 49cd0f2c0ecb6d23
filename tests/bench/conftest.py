"""The benches' tests load a bench script by its path (bench/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).parents[2] / "bench"


@pytest.fixture
def load_bench(monkeypatch: pytest.MonkeyPatch) -> Callable[[str], ModuleType]:
    """``load_bench("user_path")``: bench/user_path.py as a module, with bench/ on the path
    for this test (a bench imports its siblings: _recorder, _hand_grid, user_path)."""
    monkeypatch.syspath_prepend(str(BENCH))

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # its dataclasses look their module up
        spec.loader.exec_module(module)
        return module

    return load
