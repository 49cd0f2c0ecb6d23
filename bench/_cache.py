"""A cold compile cache for the benches that time a user's first plan of a model.

``bench/plan_speed.py`` and ``bench/user_path.py`` give each model fresh inductor and triton
cache directories unless ``--warm-cache`` is passed: a user's first plan compiles from
nothing. One flag pair and one set of variables, shared here.
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from memadvisor.process_state import environ_set

__all__ = ["add_cache_flags", "cold_cache", "cold_cache_env"]


def add_cache_flags(parser: argparse.ArgumentParser) -> None:
    """``--cold-cache`` (the default) / ``--warm-cache``, read back as ``args.warm_cache``."""
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument(
        "--cold-cache",
        dest="warm_cache",
        action="store_false",
        help="a fresh inductor and triton cache directory per model (the default)",
    )
    cache.add_argument("--warm-cache", action="store_true", help="keep the user's inductor cache")
    parser.set_defaults(warm_cache=False)  # cold unless asked (--cold-cache's default is True)


def cold_cache_env(scratch: str | Path) -> dict[str, str]:
    """Inductor's FX graph and AOTAutograd caches, and triton's kernels, under ``scratch``."""
    return {
        "TORCHINDUCTOR_CACHE_DIR": str(Path(scratch) / "inductor"),
        "TRITON_CACHE_DIR": str(Path(scratch) / "triton"),
    }


@contextlib.contextmanager
def cold_cache(name: str, cold: bool) -> Iterator[None]:
    """A fresh inductor and triton cache directory for ``name`` in ``os.environ`` (the
    processes started inside inherit it), removed after; nothing when not ``cold``."""
    if not cold:
        yield
        return
    scratch = tempfile.mkdtemp(prefix=f"cold-cache-{name}-")
    try:
        with environ_set(cold_cache_env(scratch)):
            yield
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
