"""The Plan as a JSON file."""

from __future__ import annotations

from pathlib import Path

from memadvisor.errors import BadInputError
from memadvisor.schema.plan import Plan

__all__ = ["write_plan_json"]


def write_plan_json(plan: Plan, path: str | Path) -> Path:
    """Write ``plan`` to ``path``; ``Plan.load(path)`` reads it back.

    Raises:
        BadInputError: the file cannot be written (no such folder, no permission).
    """
    path = Path(path)
    try:
        path.write_text(plan.model_dump_json(indent=2) + "\n", encoding="utf-8")
    except OSError as e:
        raise BadInputError(f"Cannot write the plan to {str(path)!r}: {e.strerror}.") from e
    return path
