"""Fail at once when the budget cannot hold the model itself, saying what would."""

from __future__ import annotations

import math
from typing import NamedTuple

from memadvisor.errors import InfeasibleBudgetError
from memadvisor.schema.config import GIB, PlanConfig
from memadvisor.schema.profile import Profile

__all__ = [
    "SHARD_COUNTS",
    "ShardedFit",
    "budget_needed_bytes",
    "check_static_fits",
    "infeasible",
    "static_advice",
]


class ShardedFit(NamedTuple):
    """The fewest FSDP2 ranks whose per-rank estimate fits the budget at batch 1."""

    world_size: int
    peak_bytes: int  # the cheapest configuration's estimated per-rank peak at batch 1


def budget_needed_bytes(peak_bytes: int, margin_fraction: float) -> int:
    """The smallest budget whose usable part (budget less margin) holds ``peak_bytes``."""
    return math.ceil(peak_bytes / (1.0 - margin_fraction))


def _gib(nbytes: int) -> str:
    """An amount needed, rounded up to 0.01 GiB: a budget printed as enough must be enough.
    (The tolerance keeps a float's last bit from adding 0.01: 0.08 GiB stays 0.08.)"""
    return f"{math.ceil(nbytes / GIB * 100 - 1e-6) / 100:.2f} GiB"


def _gib_given(nbytes: int) -> str:
    """A budget the caller gave (or its usable part), as they would write it: 0.08, 0.004, 8."""
    return f"{round(nbytes / GIB, 4):g} GiB"


def infeasible(
    profile: Profile,
    config: PlanConfig,
    cheapest_peak_bytes: int,
    why: str,
    sharded: ShardedFit | None = None,
) -> InfeasibleBudgetError:
    """The error that names the minimum budget, from the cheapest estimated batch-1 peak;
    ``sharded``, when given, is the FSDP2 world size the per-rank estimate fits at."""
    # A rank under FSDP2 holds a shard of the static bytes: its own estimate is the floor.
    floor = 0 if config.may_shard else profile.static_bytes
    cheapest_peak_bytes = max(cheapest_peak_bytes, floor)
    needed = budget_needed_bytes(cheapest_peak_bytes, config.margin_fraction)
    advice = static_advice(profile, config, cheapest_peak_bytes, sharded)
    error = InfeasibleBudgetError(
        f"{why} That is more than the {_gib_given(config.usable_bytes)} usable of the "
        f"{_gib_given(config.budget_bytes)} budget ({config.margin_fraction:.0%} is kept as a "
        f"safety margin). The minimum budget that would work is {_gib(needed)} (estimated at "
        "batch 1 with the most memory-saving configuration):",
        minimum_bytes=needed,
        minimum_gib=_gib(needed)[: -len(" GiB")],
        advice=advice,
    )
    error.sharded_world_size = sharded.world_size if sharded is not None else None
    return error


# AdamW in 8 bits (bitsandbytes' AdamW8bit): two one-byte moments a parameter (block-wise
# quantisation statistics add well under 1%).
_EIGHT_BIT_STATE_BYTES = 2
SHARD_COUNTS = (2, 4, 8, 16, 32, 64)  # world sizes a sharding hint is sought among
_WORTH_SAYING = 0.1  # of the minimum: hints that save less are left out


def _count(n: int) -> str:
    """``6_738_415_616`` -> ``'6.74B'``; ``16_777_216`` -> ``'16.8M'``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def static_advice(
    profile: Profile,
    config: PlanConfig,
    cheapest_peak_bytes: int,
    sharded: ShardedFit | None = None,
) -> str:
    """Where the weights, gradients and optimizer state go, and what would shrink them.

    ``sharded`` (the fewest FSDP2 ranks the per-rank estimate fits) comes first, as what to
    plan next: memadvisor plans FSDP2 itself. The rest is advice only: an 8-bit optimizer
    or LoRA change the training's numerics, so no plan is made for them. Without
    ``sharded`` (no strategy plans ranks), sharding is hinted from a rough count instead.
    Empty when there are no gradients or optimizer state to speak of.
    """
    trainable = profile.trainable_param_count
    grads, state = profile.grad_bytes, profile.optimizer_state_bytes
    if not (grads or state) or not trainable:
        return ""
    total = profile.param_count or trainable
    per_param = (profile.param_bytes + grads + state) / total if total == trainable else None
    kind = (
        f"{per_param:.1f} bytes a parameter before activations"
        if per_param is not None
        else f"{_count(trainable)} of {_count(total)} parameters trainable"
    )
    # Under FSDP2 a rank holds 1/world_size of each (the minimum above is per rank).
    shards = config.world_size if config.may_shard else 1
    whole = " before sharding" if shards > 1 else ""
    words = (
        f" Of that, weights take {_gib(profile.param_bytes)}, gradients {_gib(grads)} and "
        f"optimizer state {_gib(state)}{whole} ({kind}; {_count(trainable)} trainable "
        "parameters)."
    )
    if sharded is not None:
        n = sharded.world_size
        words += (
            f" Sharded with FSDP2 over {n} ranks it fits: plan it with world_size={n}, "
            f"parallel='fsdp2' (the CLI's --world-size {n} --parallel fsdp2); about "
            f"{_gib(budget_needed_bytes(sharded.peak_bytes, config.margin_fraction))} a rank "
            "at batch 1."
        )
    hints = []
    worth = _WORTH_SAYING * cheapest_peak_bytes  # a hint that saves less is not given
    eight_bit = (state - _EIGHT_BIT_STATE_BYTES * trainable) // shards
    if eight_bit > worth:
        smaller = budget_needed_bytes(cheapest_peak_bytes - eight_bit, config.margin_fraction)
        hints.append(
            f"an 8-bit optimizer (bitsandbytes' AdamW8bit, {_EIGHT_BIT_STATE_BYTES} bytes of "
            f"state a parameter) would need about {_gib(smaller)}"
        )
    static = profile.param_bytes + grads + state
    rest = cheapest_peak_bytes - static
    gathered = 2 * max((b.param_bytes for b in profile.blocks), default=0)
    rough = sharded is None and not config.may_shard
    for cards in SHARD_COUNTS if static > worth and rough else ():
        per_card = static // cards + rest + gathered
        if per_card <= config.usable_bytes:
            hints.append(
                f"sharding weights, gradients and optimizer state over {cards} cards (FSDP "
                f"full shard, ZeRO-3) about {_gib(budget_needed_bytes(per_card, 0.0))} a card, "
                "two blocks' gathered weights included"
            )
            break
    if total == trainable and grads + state > worth:
        hints.append(
            "training low-rank adapters on a frozen base (LoRA) would keep gradients and "
            "optimizer state for the adapters alone"
        )
    if hints:
        words += (
            " Not planned here, as they change the training: "
            + "; ".join(hints)
            + " (budgets at batch 1 with the most memory-saving configuration)."
        )
    return words


def check_static_fits(
    profile: Profile,
    config: PlanConfig,
    cheapest_peak_bytes: int,
    sharded: ShardedFit | None = None,
) -> None:
    """Raise when weights, gradients and optimizer state alone exceed the usable budget.

    No batch size, precision or checkpointing changes those bytes, so no search is needed.
    Under DDP every rank holds them all (and its gradient buckets besides: the minimum, from
    the per-rank estimate, counts those).

    Raises:
        InfeasibleBudgetError: with ``minimum_bytes`` the smallest budget that would work.
    """
    if profile.static_bytes <= config.usable_bytes or config.may_shard:
        return  # FSDP2 shards them: the search's per-rank estimate decides
    whose = (
        f"Under DDP each of the {config.world_size} ranks holds the whole model: its"
        if config.parallel == "ddp"
        else "The model's"
    )
    raise infeasible(
        profile,
        config,
        cheapest_peak_bytes,
        f"{whose} weights, gradients and optimizer state alone take {_gib(profile.static_bytes)}.",
        sharded,
    )
