"""The configurations a person would try by hand, for the report to set the plan against.

Baseline (fp32, nothing checkpointed), +Checkpointing (every block the strategy offers),
+AMP (bf16, else fp16 autocast), +Both. This is the one place in the planner that names
strategies: the rows are defined by what people try, and a row whose strategy is not
registered is left out rather than faked.
"""

from __future__ import annotations

from pydantic import JsonValue

from memadvisor.planner._space import SearchSpace

__all__ = ["hand_configurations", "unchecked_hand_choices"]

CHECKPOINTING = "checkpointing"
PRECISION = "precision"
PARALLEL = "parallel"


def _all_blocks(space: SearchSpace) -> JsonValue | None:
    lists = [c for c in space.options.get(CHECKPOINTING, []) if isinstance(c, list) and c]
    return max(lists, key=len) if lists else None


def _autocast(space: SearchSpace) -> str | None:
    offered = space.options.get(PRECISION, [])
    return next((p for p in ("bf16", "fp16") if p in offered), None)


def _parallel(space: SearchSpace) -> dict[str, JsonValue]:
    """The ranks' wrap as a person would write it first (FSDP2's default resharding): every
    row of a per-rank plan is per rank too."""
    offered = [c for c in space.options.get(PARALLEL, []) if c is not None]
    return {PARALLEL: offered[0]} if offered else {}


def hand_configurations(space: SearchSpace) -> list[tuple[str, dict[str, JsonValue]]]:
    """(label, choices) of each hand configuration this profile's strategies can express."""
    every_block, amp = _all_blocks(space), _autocast(space)
    ranks = _parallel(space)
    rows: list[tuple[str, dict[str, JsonValue]]] = [("Baseline", {**ranks})]
    if every_block is not None:
        rows.append(("+Checkpointing", {CHECKPOINTING: every_block, **ranks}))
    if amp is not None:
        rows.append(("+AMP", {PRECISION: amp, **ranks}))
    if every_block is not None and amp is not None:
        rows.append(("+Both", {PRECISION: amp, CHECKPOINTING: every_block, **ranks}))
    return rows


def unchecked_hand_choices(space: SearchSpace) -> list[dict[str, JsonValue]]:
    """Baseline and +AMP (each precision offered, nothing checkpointed) as the search writes
    candidates: a strategy with one option keeps it (an advice-only strategy is in every
    candidate), every other strategy its neutral option.

    The planner times these beside the estimate's best, so that an error in the estimate's
    step times (up to 1.6x for bf16 on an H200) cannot make the plan lose to a
    configuration a person tries first. Empty when the space has no neutral option for a
    strategy other than precision to fall back on.
    """
    plain = space.plain_indices()
    if plain is None:
        return []
    names = space.names
    precisions = space.options.get(PRECISION)
    if precisions is None:
        return [space.choices_of(plain)]
    at = names.index(PRECISION)
    out = []
    for index in range(len(precisions)):
        indices = list(plain)
        indices[at] = index
        out.append(space.choices_of(indices))
    return out
