"""The parallel strategy: per-rank bytes as edits of the single card's estimate, its choices,
its advice and its wrap (no process group needed here; tests/device/test_ranks.py runs ranks)."""

from __future__ import annotations

import pytest
import torch

from memadvisor.device._autocast import cuda_autocast_policy
from memadvisor.errors import BadInputError
from memadvisor.estimate import estimate
from memadvisor.profiler import profile_workload
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.profile import Profile
from memadvisor.strategy import load_strategies
from memadvisor.target import load_target
from strategies.parallel import Parallel, parse_choice, wrap_for_rank
from tests.fixtures.steps import applied

TARGET = "tests.fixtures.factories:residual_mlp"


@pytest.fixture(scope="module")
def profile() -> Profile:
    with cuda_autocast_policy():
        return profile_workload(load_target(TARGET), device="cpu")


STRATEGIES = load_strategies(["precision", "checkpointing", "parallel"])


def _fsdp2(profile: Profile, world: int, reshard: bool = True) -> dict:
    units = [b.name for b in profile.blocks]
    return {"kind": "fsdp2", "world_size": world, "units": units, "reshard_after_forward": reshard}


def _peak(profile: Profile, batch: int, **choices: object) -> int:
    candidate = Candidate(batch_size=batch, choices={k: v for k, v in choices.items() if v})
    return estimate(profile, candidate, STRATEGIES).peak_bytes


def test_ddp_adds_one_flat_copy_of_the_gradients_to_every_moment(profile: Profile) -> None:
    # DDP's reducer allocates a bucket copy of every gradient at the wrap; nothing is sharded.
    for batch in (1, 32, 256):
        single = _peak(profile, batch)
        ddp = _peak(profile, batch, parallel={"kind": "ddp", "world_size": 4})
        assert ddp - single == profile.grad_bytes


def test_fsdp2_shards_weights_and_optimizer_state_over_the_ranks(profile: Profile) -> None:
    # At batch 1 the static bytes dominate: more ranks, less per rank, and never below the
    # state's shard.
    peaks = [_peak(profile, 1, parallel=_fsdp2(profile, n)) for n in (1, 2, 4, 8)]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4
    assert _peak(profile, 1) > peaks[1]
    state_share = (profile.param_bytes + profile.optimizer_state_bytes) // 8
    assert peaks[-1] > state_share


def test_keeping_units_gathered_after_forward_costs_memory_and_saves_time(
    profile: Profile,
) -> None:
    batch = 64
    resharded = Candidate(batch_size=batch, choices={"parallel": _fsdp2(profile, 2, True)})
    gathered = Candidate(batch_size=batch, choices={"parallel": _fsdp2(profile, 2, False)})
    a, b = estimate(profile, resharded, STRATEGIES), estimate(profile, gathered, STRATEGIES)
    assert b.peak_bytes > a.peak_bytes
    assert b.step_ms < a.step_ms  # the all-gather in backward is saved


def test_fsdp2_in_bf16_gathers_units_at_half_the_bytes(profile: Profile) -> None:
    fp32 = _peak(profile, 1, parallel=_fsdp2(profile, 2))
    bf16 = _peak(profile, 1, parallel=_fsdp2(profile, 2), precision="bf16")
    assert bf16 < fp32


def test_choices_follow_the_config(profile: Profile) -> None:
    strategy = Parallel()
    base = {"budget_bytes": 2**30}
    assert strategy.choices(profile, PlanConfig(**base)) == [None]
    ddp = strategy.choices(profile, PlanConfig(**base, world_size=2, parallel="ddp"))
    assert ddp == [{"kind": "ddp", "world_size": 2}]
    fsdp2 = strategy.choices(profile, PlanConfig(**base, world_size=4, parallel="fsdp2"))
    assert [c["reshard_after_forward"] for c in fsdp2] == [True, False]
    assert all(c["units"] == [b.name for b in profile.blocks] for c in fsdp2)


def test_a_world_size_without_a_way_to_share_is_refused() -> None:
    with pytest.raises(ValueError, match="parallel='ddp', 'fsdp2' or 'auto'"):
        PlanConfig(budget_bytes=2**30, world_size=2)


def test_the_fsdp2_advice_is_code_that_shards_each_unit_then_the_root(profile: Profile) -> None:
    choice = {**_fsdp2(profile, 2, False), "param_dtype": "bf16"}
    advice = Parallel().explain(choice, profile)
    assert advice is not None
    compile(advice.snippet, "<advice>", "exec")  # it parses
    for unit in choice["units"]:
        assert repr(unit) in advice.snippet
    assert "fully_shard(model, reshard_after_forward=False" in advice.snippet
    assert "param_dtype=torch.bfloat16" in advice.snippet
    assert Parallel().explain(None, profile) is None


@pytest.mark.parametrize(
    "choice",
    [
        {"kind": "zero3", "world_size": 2},
        {"kind": "ddp", "world_size": 0},
        {"kind": "fsdp2", "world_size": 2, "units": [3]},
        "fsdp2",
    ],
)
def test_bad_choices_say_what_a_choice_is(choice: object) -> None:
    with pytest.raises(BadInputError, match="parallel choice"):
        parse_choice(choice)


def test_wrapping_a_unit_the_model_lacks_names_it() -> None:
    model = load_target(TARGET).model
    with pytest.raises(BadInputError, match="no_such"):
        wrap_for_rank(model, {"kind": "fsdp2", "world_size": 1, "units": ["no_such"]})


def test_applying_in_one_process_leaves_the_model_as_it_was() -> None:
    model = load_target(TARGET).model
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert applied(Parallel(), model, {"kind": "ddp", "world_size": 2}, None) is model
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_the_fsdp2_breakdown_counts_a_rank_s_shards(profile: Profile) -> None:
    # The report's "where the memory goes" reads the breakdown: under FSDP2 over 4 ranks a
    # rank holds a quarter of the weights and optimizer state, and the breakdown adds up to
    # the per-rank peak (the gathered units among the temporaries), never past it.
    single = estimate(profile, Candidate(batch_size=1), STRATEGIES)
    sharded = estimate(
        profile, Candidate(batch_size=1, choices={"parallel": _fsdp2(profile, 4)}), STRATEGIES
    )
    quarter = profile.param_bytes // 4 + profile.buffer_bytes
    assert sharded.breakdown["params"] == quarter < single.breakdown["params"]
    assert sharded.breakdown["optimizer_state"] == profile.optimizer_state_bytes // 4
    assert sum(sharded.breakdown.values()) <= sharded.peak_bytes
