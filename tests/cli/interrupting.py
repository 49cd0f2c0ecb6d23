"""``factories.py:mlp`` whose process sends itself one SIGINT at a chosen moment of its plan.

A real signal, from inside: the moment is exact, where a signal from the test process lands
wherever the plan happens to be. Each factory names the planner's stage it interrupts
(profiling, search, probes) and how the signal is taken there:

* ``direct``: in the loss function itself (or the search's scoring), plain Python code.
* ``weakref``: inside a weakref callback, where an exception cannot propagate (the
  simulated device's MemoryMeter counts every freed tensor in one).
* ``exec``: inside code run by ``exec`` of a string (``dataclasses`` builds its methods that
  way; a KeyboardInterrupt leaving one marks the process to end by SIGINT).

The planner's current stage is read by wrapping ``Progress.stage``, which every stage opens.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from factories import _cross_entropy, mlp  # noqa: E402

_stage: list[str] = []  # the planner's open stages, innermost last
_sent: list[bool] = []
_refs: list[weakref.ref] = []  # a weakref's callback runs only while the ref itself lives


class _Doomed:
    pass


def _in_callback(_ref: weakref.ref) -> None:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(99):  # a loop: the handler runs here, whatever the Python version
        pass


def _sigint(way: str) -> None:
    """Send this process one SIGINT, taken ``way`` (the module docstring)."""
    if _sent:
        return
    _sent.append(True)
    if way == "weakref":
        doomed = _Doomed()
        _refs.append(weakref.ref(doomed, _in_callback))
        del doomed  # the callback runs here, and the handler inside it
    elif way == "exec":
        exec("import os, signal\nos.kill(os.getpid(), signal.SIGINT)\nfor _ in range(99): pass")
    else:
        os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10**6):  # where the plan would go on if the interrupt were lost
        pass


def _watch_stages() -> None:
    from memadvisor.planner._progress import Progress

    stage = Progress.stage

    @contextlib.contextmanager
    def watched(self: Progress, description: str, total: int | None = None) -> Iterator[Any]:
        _stage.append(description)
        try:
            with stage(self, description, total) as bar:
                yield bar
        finally:
            _stage.pop()

    Progress.stage = watched  # type: ignore[method-assign]


def _in(stage: str) -> bool:
    return bool(_stage) and _stage[-1] == stage


def _interrupting(stage: str, way: str) -> Callable[[], dict]:
    def factory() -> dict:
        _watch_stages()
        if stage == "search":  # no step runs there: the search scores combinations
            from memadvisor.planner._space import SearchSpace

            score = SearchSpace.score

            def scored(self: SearchSpace, indices: Any) -> Any:
                if _in("search"):
                    _sigint(way)
                return score(self, indices)

            SearchSpace.score = scored  # type: ignore[method-assign]

        def loss(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            if _in(stage):
                _sigint(way)
            return _cross_entropy(logits, batch)

        return {**mlp(), "loss_fn": loss}

    factory.__name__ = f"{stage}_{way}"
    return factory


profiling_weakref = _interrupting("profiling", "weakref")
profiling_exec = _interrupting("profiling", "exec")
search_direct = _interrupting("search", "direct")
probes_weakref = _interrupting("probes", "weakref")
