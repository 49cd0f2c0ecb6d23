"""One inductor on-disk cache for every process of a plan, and what it cost on disk.

Compiled candidates are measured in fresh probe processes (a probe is only trusted from a
clean state, ``docs/design.md``, "A clean state per run"), and each process compiles the
model again. Inductor keeps what it
compiled on disk: the FX graph cache (generated kernels, keyed by the graph and its input
shapes) and the AOTAutograd cache (the forward/backward split) under
``$TORCHINDUCTOR_CACHE_DIR``. A child process reads the same directory when it inherits the
same environment, so :func:`shared_compile_cache` sets that environment for the duration of
a plan and children started inside it (``subprocess`` passes ``os.environ`` on) share it.

What sharing buys and what it does not:
    * A second process that compiles the same graph at the same shapes loads it instead of
      generating and building kernels: verify and timing runs at a batch a probe already
      compiled, a plan run twice, the user's own first compiled step at the plan's batch.
    * A probe at another batch size is another graph (static shapes, as the user's training
      compiles them) and misses; dynamo's tracing runs again in every process either way.
    * torch 2.13 already enables both caches by default under ``/tmp/torchinductor_$USER``;
      this module keeps them on even where a user's environment turned them off or pointed
      each process somewhere else, turns off dynamo's cross-process "automatic dynamic"
      profile (which would compile later probes with a dynamic batch the user's run does
      not have), and reports the bytes the plan added (:class:`CompileCacheReport`).

The default directory is the user's own inductor cache, so what the plan compiled is warm
for the user's training run at the plan's batch.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from memadvisor import _torch_private
from memadvisor.process_state import environ_set

__all__ = [
    "CompileCacheReport",
    "SharedCompileCache",
    "cache_env",
    "directory_bytes",
    "shared_compile_cache",
]

MIB = 2**20


def cache_env(cache_dir: str | Path | None = None) -> dict[str, str]:
    """The environment variables that make a process use (and fill) ``cache_dir``'s caches.

    Args:
        cache_dir: the directory; None keeps the one inductor uses now (the user's).
    """
    directory = (
        Path(cache_dir) if cache_dir is not None else Path(_torch_private.inductor_cache_dir())
    )
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(directory.resolve()),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
        # With a job id set, dynamo would carry "this dim changed" across processes and
        # compile later probes with a dynamic batch; each probe should compile as one
        # training run does, with the batch it was given.
        "TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO": "0",
    }


def directory_bytes(path: str | Path) -> int:
    """Bytes of the regular files under ``path`` (0 when it does not exist)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):  # a file another process is replacing
                total += os.stat(os.path.join(root, name), follow_symlinks=False).st_size
    return total


class CompileCacheReport(BaseModel):
    """The cost of the shared compile cache: where it is and what the plan wrote there."""

    model_config = ConfigDict(extra="forbid")

    cache_dir: str = Field(description="The inductor cache directory every process used.")
    bytes_before: int = Field(ge=0, description="Its size when the plan began.")
    bytes_after: int = Field(ge=0, description="Its size when the plan ended.")
    wall_ms: float = Field(0.0, ge=0.0, description="Time the plan spent inside the cache's scope.")

    @property
    def added_bytes(self) -> int:
        return max(0, self.bytes_after - self.bytes_before)

    @property
    def note(self) -> str:
        """One sentence for ``Plan.notes``."""
        return (
            f"Compiled candidates shared inductor's on-disk cache in {self.cache_dir}: this plan "
            f"added {self.added_bytes / MIB:.1f} MiB to it (now {self.bytes_after / MIB:.1f} MiB); "
            "delete the directory to reclaim it, at the cost of compiling again."
        )


@dataclass
class SharedCompileCache:
    """The cache directory of a :func:`shared_compile_cache` block and its size at the start."""

    cache_dir: Path
    bytes_before: int
    started_s: float

    def report(self) -> CompileCacheReport:
        """The cache's cost so far (walks the directory: milliseconds for a few thousand files)."""
        return CompileCacheReport(
            cache_dir=str(self.cache_dir),
            bytes_before=self.bytes_before,
            bytes_after=directory_bytes(self.cache_dir),
            wall_ms=(time.perf_counter() - self.started_s) * 1e3,
        )


@contextlib.contextmanager
def shared_compile_cache(cache_dir: str | Path | None = None) -> Iterator[SharedCompileCache]:
    """Share one inductor cache with every process started inside this block.

    Sets :func:`cache_env` in ``os.environ`` and puts each variable back as it was on exit
    (removed where it was unset). This process's own inductor keeps its configuration; only
    its cache directory follows ``TORCHINDUCTOR_CACHE_DIR``, which inductor reads at each use.

    Example::

        with shared_compile_cache() as cache:
            plan = plan_workload(workload, config, target="train.py:build")
        plan.notes.append(cache.report().note)

    Args:
        cache_dir: the directory; None keeps the user's inductor cache directory.
    """
    env = cache_env(cache_dir)
    directory = Path(env["TORCHINDUCTOR_CACHE_DIR"])
    with environ_set(env):
        yield SharedCompileCache(directory, directory_bytes(directory), time.perf_counter())
