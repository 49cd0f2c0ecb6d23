"""The configurations a person would try by hand, for the report to set the plan against.

Baseline (fp32, nothing checkpointed), +Checkpointing (every block the strategy offers),
+AMP (bf16, else fp16 autocast), +Both. This is the one place in the planner that names
strategies: the rows are defined by what people try, and a row whose strategy is not
registered is left out rather than faked.
"""

from __future__ import annotations

from pydantic import JsonValue

from memadvisor.planner._space import SearchSpace

__all__ = ["hand_configurations"]

CHECKPOINTING = "checkpointing"
PRECISION = "precision"


def _all_blocks(space: SearchSpace) -> JsonValue | None:
    lists = [c for c in space.options.get(CHECKPOINTING, []) if isinstance(c, list) and c]
    return max(lists, key=len) if lists else None


def _autocast(space: SearchSpace) -> str | None:
    offered = space.options.get(PRECISION, [])
    return next((p for p in ("bf16", "fp16") if p in offered), None)


def hand_configurations(space: SearchSpace) -> list[tuple[str, dict[str, JsonValue]]]:
    """(label, choices) of each hand configuration this profile's strategies can express."""
    every_block, amp = _all_blocks(space), _autocast(space)
    rows: list[tuple[str, dict[str, JsonValue]]] = [("Baseline", {})]
    if every_block is not None:
        rows.append(("+Checkpointing", {CHECKPOINTING: every_block}))
    if amp is not None:
        rows.append(("+AMP", {PRECISION: amp}))
    if every_block is not None and amp is not None:
        rows.append(("+Both", {PRECISION: amp, CHECKPOINTING: every_block}))
    return rows
