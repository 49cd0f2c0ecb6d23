"""The hand-built GPT-like plan (tests/report/_gpt_plan.py), and a way to hide a library."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest
from torch import nn

from memadvisor.planner import Plan

ROOT = Path(__file__).resolve().parents[2]


def _gpt_plan_module():
    path = ROOT / "tests" / "report" / "_gpt_plan.py"
    spec = importlib.util.spec_from_file_location("memadvisor_tests_gpt_plan_i", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def gpt_plan() -> Plan:
    """bf16, 3 of 4 blocks (transformer.h.0-2) checkpointed, batch 12 x 2."""
    return _gpt_plan_module().gpt_plan()


class FourBlocks(nn.Module):
    """Submodules named as the hand-built plan's blocks: transformer.h.0 to .3."""

    def __init__(self) -> None:
        super().__init__()
        self.transformer = nn.Module()
        self.transformer.h = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])


@pytest.fixture
def four_blocks() -> FourBlocks:
    return FourBlocks()


@pytest.fixture
def examples() -> Path:
    return ROOT / "examples"


@pytest.fixture
def without():
    """``without(library, code)``: run code where ``library`` cannot be imported."""
    return _run_without


def _run_without(library: str, code: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python where importing ``library`` fails as if not installed."""
    blocker = f"""
import sys
class _Hide:
    def find_spec(self, name, path=None, target=None):
        if name == {library!r} or name.startswith({library!r} + "."):
            raise ModuleNotFoundError(f"No module named {{name!r}}")
        return None
sys.meta_path.insert(0, _Hide())
"""
    return subprocess.run(
        [sys.executable, "-c", blocker + code], capture_output=True, text=True, cwd=ROOT,
        timeout=300,
    )  # fmt: skip
