"""Run the ``memadvisor`` command in-process (typer's runner): stdout and stderr apart."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from memadvisor.cli import app

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = Path(__file__).resolve().parent / "factories.py"


class Cli:
    def __init__(self) -> None:
        self.runner = CliRunner()

    def __call__(self, *args: str):
        # Wide enough that rich wraps no sentence the tests look for.
        return self.runner.invoke(app, list(args), env={"COLUMNS": "200"})


@pytest.fixture
def cli() -> Cli:
    return Cli()


@pytest.fixture
def factory():
    """``factory("mlp")`` -> 'path/to/tests/cli/factories.py:mlp'."""
    return lambda name: f"{FACTORIES}:{name}"


@pytest.fixture
def gpt_plan():
    """The hand-built GPT-like Plan of tests/report/_gpt_plan.py (no planning needed)."""
    path = ROOT / "tests" / "report" / "_gpt_plan.py"
    spec = importlib.util.spec_from_file_location("memadvisor_tests_gpt_plan", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.gpt_plan()


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models on one thread: intra-op threads only add synchronisation on these sizes,
    and on a shared CI box their spin-waits make a step many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
