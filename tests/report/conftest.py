"""The hand-built GPT-like Profile and Plan (tests/report/_gpt_plan.py) as fixtures."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from memadvisor.schema.plan import Plan
from memadvisor.schema.profile import Profile


def load_gpt_plan_module():
    """tests/report/_gpt_plan.py, loaded by path (tests are not a package)."""
    path = Path(__file__).resolve().parent / "_gpt_plan.py"
    spec = importlib.util.spec_from_file_location("memadvisor_tests_gpt_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_gpt = load_gpt_plan_module()


@pytest.fixture
def profile() -> Profile:
    return _gpt.gpt_profile()


@pytest.fixture
def plan() -> Plan:
    return _gpt.gpt_plan()
