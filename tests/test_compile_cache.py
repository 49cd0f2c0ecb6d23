"""The shared compile cache: children inherit one inductor cache, the environment is put back,
and the cost on disk is reported."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from memadvisor import _torch_private
from strategies._compile_cache import cache_env, directory_bytes, shared_compile_cache

KEYS = (
    "TORCHINDUCTOR_CACHE_DIR",
    "TORCHINDUCTOR_FX_GRAPH_CACHE",
    "TORCHINDUCTOR_AUTOGRAD_CACHE",
    "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO",
)


def test_default_directory_is_the_users_inductor_cache(monkeypatch) -> None:
    """Without a directory, the plan fills the cache the user's own training run reads."""
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    env = cache_env()
    assert env["TORCHINDUCTOR_CACHE_DIR"] == _torch_private.inductor_cache_dir()
    assert env["TORCHINDUCTOR_FX_GRAPH_CACHE"] == env["TORCHINDUCTOR_AUTOGRAD_CACHE"] == "1"


def test_environment_is_set_inside_and_put_back_after(tmp_path, monkeypatch) -> None:
    """A variable the user had keeps its value afterwards; one they did not have is removed."""
    monkeypatch.setenv("TORCHINDUCTOR_FX_GRAPH_CACHE", "0")
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with shared_compile_cache(tmp_path / "cache") as cache:
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str((tmp_path / "cache").resolve())
        assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "1"
        assert cache.cache_dir == (tmp_path / "cache").resolve()
    assert os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] == "0"
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ


def test_report_counts_the_bytes_added_inside_the_block(tmp_path) -> None:
    directory = tmp_path / "cache"
    (directory / "old").mkdir(parents=True)
    (directory / "old" / "graph.bin").write_bytes(b"x" * 1000)
    with shared_compile_cache(directory) as cache:
        (directory / "new.bin").write_bytes(b"y" * 3 * 2**20)
        report = cache.report()
    assert (report.bytes_before, report.added_bytes) == (1000, 3 * 2**20)
    assert report.bytes_after == directory_bytes(directory)
    assert "added 3.0 MiB" in report.note and str(directory.resolve()) in report.note


_CHILD = """
import json, torch
from torch import nn
from torch._dynamo.utils import counters

torch.manual_seed(0)
# Matmuls only: inductor calls extern kernels and builds no C++ (seconds, not a minute).
model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 2, bias=False))
torch.compile(model)(torch.randn(4, 8)).sum().backward()
print("COUNTS " + json.dumps(dict(counters["inductor"])))
"""


def _child_counts() -> dict[str, int]:
    # No env= argument: the child inherits os.environ, as the CUDA device's probes do.
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=600, check=True
    )
    line = next(s for s in done.stdout.splitlines() if s.startswith("COUNTS "))
    return json.loads(line[len("COUNTS ") :])


@pytest.mark.slow
def test_a_second_process_loads_what_the_first_compiled(tmp_path: Path) -> None:
    """Two fresh processes in one shared cache: the first compiles, the second hits."""
    with shared_compile_cache(tmp_path / "cache") as cache:
        first = _child_counts()
        second = _child_counts()
        report = cache.report()
    assert first.get("fxgraph_cache_miss", 0) >= 1 and first.get("fxgraph_cache_hit", 0) == 0
    assert second.get("fxgraph_cache_hit", 0) >= 1 and second.get("fxgraph_cache_miss", 0) == 0
    assert report.bytes_before == 0 and report.added_bytes > 0
