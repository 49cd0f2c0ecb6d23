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


_CHECKPOINTED_CHILD = """
import json, sys, torch
from torch import nn
from memadvisor import _torch_private
from memadvisor.schema.candidate import Candidate
from memadvisor.strategy import apply_to_model

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(32, 32)
        self.drop = nn.Dropout(0.1)
    def forward(self, x):
        return x + self.drop(torch.relu(self.fc(x)))

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(3))
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x

batch = int(sys.argv[1])
dynamic = len(sys.argv) > 2 and sys.argv[2] == "dynamic"  # a next session's attribution run
torch.manual_seed(0)
model = Net().cuda().train()
choices = {"checkpointing": ["blocks.0", "blocks.1", "blocks.2"],
           "compile": {"mode": "default", "regional": True, "dynamic_batch": dynamic}}
step = apply_to_model(model, Candidate(batch_size=batch, choices=choices))
before = _torch_private.compile_cache_counts()
step.model(torch.randn(batch, 32, device="cuda")).sum().backward()
after = _torch_private.compile_cache_counts()
print("COUNTS " + json.dumps([a - b for a, b in zip(after, before, strict=True)]))
"""


@pytest.mark.gpu
def test_switched_on_a_checkpointed_block_with_dropout_is_loaded_by_the_next_process(
    tmp_path: Path, monkeypatch
) -> None:
    """Rule: with MEMADVISOR_CACHED_RNG=1 a checkpointed block's random ops compile to graphs
    the caches take, so a second process of the same form and batch loads them (torch
    2.11's default random state bypassed the FX graph cache: every process compiled it
    afresh). Static: a dynamic batch failed to compile this model with the switch on
    (session 33), unattributed."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    monkeypatch.setenv(_torch_private.CACHED_RNG_ENV, "1")  # the children inherit it
    counts = []
    with shared_compile_cache(tmp_path / "cache"):
        for batch in (8, 8):
            done = subprocess.run(
                [sys.executable, "-c", _CHECKPOINTED_CHILD, str(batch)],
                capture_output=True,
                text=True,
                timeout=600,
            )
            assert done.returncode == 0, done.stderr[-2000:]
            line = next(s for s in done.stdout.splitlines() if s.startswith("COUNTS "))
            counts.append(json.loads(line[len("COUNTS ") :]))
    (_, first_misses, first_bypasses), (hits, misses, bypasses) = counts
    version = torch.__version__
    assert first_misses >= 1 and first_bypasses == 0, (version, counts)
    assert hits >= 1 and misses == 0 and bypasses == 0, (version, counts)
