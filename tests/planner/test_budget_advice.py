"""The infeasible error's advice: what the static bytes are made of and what would shrink them."""

from __future__ import annotations

from memadvisor.planner._budget import static_advice
from memadvisor.schema.config import GIB, PlanConfig
from memadvisor.schema.profile import BlockInfo, DeviceInfo, LinearBytes, Profile, StepProfile


def _profile(trainable: int) -> Profile:
    """1G fp32 parameters (4 GiB) in one block; AdamW: 4 GiB of gradients, 8 GiB of state
    when all of them train."""
    params = 2**30
    share = trainable / params
    return Profile(
        model_name="Hand",
        device=DeviceInfo(kind="fake", name="hand"),
        batch_sizes=(1, 2),
        param_bytes=4 * GIB,
        grad_bytes=int(4 * GIB * share),
        optimizer_state_bytes=int(8 * GIB * share),
        param_count=params,
        trainable_param_count=trainable,
        blocks=[BlockInfo(name="block", type_name="Block", param_bytes=4 * GIB)],
        steps={"fp32": StepProfile(precision="fp32", blocks=[], activation_total=LinearBytes())},
    )


def test_full_training_names_16_bytes_a_parameter_and_each_alternative_s_budget() -> None:
    """Cheapest peak 17 GiB (16 static + 1 of activations), 8 GiB usable. An 8-bit optimizer
    keeps 2 of the 8 GiB of state: 11 GiB. Sharded, a card holds 16/k + 1 + 8 (the one 4 GiB
    block gathered twice): never 8 GiB, so no shard count is offered."""
    config = PlanConfig(budget_bytes=8 * GIB, margin_fraction=0.0)
    words = static_advice(_profile(2**30), config, 17 * GIB)
    assert "(16.0 bytes a parameter before activations; 1.07B trainable parameters)" in words
    assert "an 8-bit optimizer" in words and "would need about 11.00 GiB" in words
    assert "sharding" not in words
    assert "(LoRA)" in words


def test_sharding_is_offered_at_the_fewest_cards_that_fit() -> None:
    """With the block's weights 1 GiB (gathered twice: 2 GiB), 4 cards hold 16/4 + 1 + 2 =
    7 GiB of the 8 usable; 2 cards (8 + 1 + 2) do not."""
    profile = _profile(2**30)
    profile = profile.model_copy(
        update={"blocks": [BlockInfo(name="block", type_name="Block", param_bytes=GIB)]}
    )
    config = PlanConfig(budget_bytes=8 * GIB, margin_fraction=0.0)
    words = static_advice(profile, config, 17 * GIB)
    assert "over 4 cards (FSDP full shard, ZeRO-3) about 7.00 GiB a card" in words


def test_a_frozen_base_is_described_by_its_trainable_share_without_alternatives() -> None:
    """1% trainable: gradients and state are too small for any hint to matter."""
    trainable = 2**30 // 100
    words = static_advice(_profile(trainable), PlanConfig(budget_bytes=GIB), 5 * GIB)
    assert "10.7M of 1.07B parameters trainable" in words
    assert "Not planned here" not in words
