"""Fail at once when the budget cannot hold the model itself, saying what would."""

from __future__ import annotations

import math

from memadvisor.errors import InfeasibleBudgetError
from memadvisor.schema.config import GIB, PlanConfig
from memadvisor.schema.profile import Profile

__all__ = ["budget_needed_bytes", "check_static_fits", "infeasible", "static_advice"]


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
    profile: Profile, config: PlanConfig, cheapest_peak_bytes: int, why: str
) -> InfeasibleBudgetError:
    """The error that names the minimum budget, from the cheapest estimated batch-1 peak."""
    needed = budget_needed_bytes(
        max(cheapest_peak_bytes, profile.static_bytes), config.margin_fraction
    )
    advice = static_advice(profile, config, max(cheapest_peak_bytes, profile.static_bytes))
    return InfeasibleBudgetError(
        f"{why} That is more than the {_gib_given(config.usable_bytes)} usable of the "
        f"{_gib_given(config.budget_bytes)} budget ({config.margin_fraction:.0%} is kept as a "
        f"safety margin). The minimum budget that would work is {_gib(needed)} (estimated at "
        "batch 1 with the most memory-saving configuration):",
        minimum_bytes=needed,
        minimum_gib=_gib(needed)[: -len(" GiB")],
        advice=advice,
    )


# AdamW in 8 bits (bitsandbytes' AdamW8bit): two one-byte moments a parameter (block-wise
# quantisation statistics add well under 1%).
_EIGHT_BIT_STATE_BYTES = 2
_SHARDS = (2, 4, 8, 16, 32, 64)
_WORTH_SAYING = 0.1  # of the minimum: hints that save less are left out


def _count(n: int) -> str:
    """``6_738_415_616`` -> ``'6.74B'``; ``16_777_216`` -> ``'16.8M'``."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


def static_advice(profile: Profile, config: PlanConfig, cheapest_peak_bytes: int) -> str:
    """Where the weights, gradients and optimizer state go, and what would shrink them.

    Advice only, in sentences appended to the infeasible error: an 8-bit optimizer or
    sharding over several cards change the training (its numerics, or the machine), so no
    plan is made for them. Empty when there are no gradients or optimizer state to speak of.
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
    words = (
        f" Of that, weights take {_gib(profile.param_bytes)}, gradients {_gib(grads)} and "
        f"optimizer state {_gib(state)} ({kind}; {_count(trainable)} trainable parameters)."
    )
    hints = []
    worth = _WORTH_SAYING * cheapest_peak_bytes  # a hint that saves less is not given
    eight_bit = state - _EIGHT_BIT_STATE_BYTES * trainable
    if eight_bit > worth:
        smaller = budget_needed_bytes(cheapest_peak_bytes - eight_bit, config.margin_fraction)
        hints.append(
            f"an 8-bit optimizer (bitsandbytes' AdamW8bit, {_EIGHT_BIT_STATE_BYTES} bytes of "
            f"state a parameter) would need about {_gib(smaller)}"
        )
    sharded = profile.param_bytes + grads + state
    rest = cheapest_peak_bytes - sharded
    gathered = 2 * max((b.param_bytes for b in profile.blocks), default=0)
    already_sharded = config.parallel == "fsdp2"
    for cards in _SHARDS if sharded > worth and not already_sharded else ():
        per_card = sharded // cards + rest + gathered
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


def check_static_fits(profile: Profile, config: PlanConfig, cheapest_peak_bytes: int) -> None:
    """Raise when weights, gradients and optimizer state alone exceed the usable budget.

    No batch size, precision or checkpointing changes those bytes, so no search is needed.

    Raises:
        InfeasibleBudgetError: with ``minimum_bytes`` the smallest budget that would work.
    """
    if profile.static_bytes <= config.usable_bytes or config.parallel == "fsdp2":
        return  # FSDP2 shards them: the search's per-rank estimate decides
    raise infeasible(
        profile,
        config,
        cheapest_peak_bytes,
        f"The model's weights, gradients and optimizer state alone take "
        f"{_gib(profile.static_bytes)}.",
    )
