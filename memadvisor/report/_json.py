"""The Plan as a JSON file."""

from __future__ import annotations

from pathlib import Path

from memadvisor.files import write_text_atomic
from memadvisor.schema.plan import Plan

__all__ = ["write_plan_json"]


def write_plan_json(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` to ``path``; ``Plan.model_validate_json(path.read_text())`` reads it back.

    Written whole or not at all, never through a device, a FIFO or another user's symlink
    (:mod:`memadvisor.files`).

    Raises:
        BadInputError: the file cannot be written (no such folder, no permission, a
            non-regular target); a file there before is left whole.
    """
    return write_text_atomic(path, plan.model_dump_json(indent=2) + "\n", "the plan")
