"""The parallel strategy: per-rank bytes as edits of the single card's estimate, its choices,
its advice and its wrap (no process group needed here; tests/device/test_ranks.py runs ranks)."""

from __future__ import annotations

import pytest
import torch

from memadvisor.device._autocast import cuda_autocast_policy
from memadvisor.errors import BadInputError
from memadvisor.estimate import StepModel, estimate
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


@pytest.mark.parametrize("reshard", [True, False], ids=["resharded", "gathered"])
def test_under_bf16_a_unit_s_reduce_scatter_input_stays_fp32(
    profile: Profile, reshard: bool
) -> None:
    # MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32): the units are gathered in
    # bf16, but a unit's gradients are copied into the reduce-scatter's input in fp32, the
    # unit's fp32 bytes, not a bf16 unit's (docs/design.md, "The reduce-scatter's input is
    # fp32 under bf16": counted at bf16 the residual MLP's rank was 4.0% under). So at each
    # block's backward bf16 saves against fp32 only the gathered units' halves.
    def per_block(precision: str) -> list[int]:
        model = StepModel(profile, batch_size=64)
        model.use_precision(precision)
        Parallel().effect(profile, _fsdp2(profile, 2, reshard), model)
        assert model.backward_block_bytes is not None
        return model.backward_block_bytes

    params = [b.param_bytes for b in profile.blocks]
    root = profile.param_bytes - sum(params)

    def half(nbytes: int) -> int:  # what a unit saves gathered in bf16
        return nbytes - int(nbytes * 0.5)

    fp32, bf16 = per_block("fp32"), per_block("bf16")
    for k in range(len(params)):
        gathered = [params[k], params[k - 1]] if reshard and k else params[: k + 1]
        assert fp32[k] - bf16[k] == half(root) + sum(half(p) for p in gathered), k


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
    assert "fully_shard(model, mp_policy=mp_policy)  # the root stays gathered" in advice.snippet
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


@pytest.mark.parametrize("world", [2, 4, 8])
def test_a_rank_s_optimizer_step_is_the_single_card_s_over_the_ranks(
    profile: Profile, world: int
) -> None:
    # FSDP2's optimizer steps over shards: the weights, gradients, AdamW state and AdamW's
    # temporaries of a rank are 1/N of the single card's (buffers and fixed bytes are whole).
    def optimizer_peak(**choices: object) -> int:
        candidate = Candidate(batch_size=8, choices=choices)
        return estimate(profile, candidate, STRATEGIES).phase_peak_bytes["optimizer"]

    whole = profile.buffer_bytes + profile.fixed_overhead_bytes
    single = optimizer_peak() - whole
    per_rank = optimizer_peak(parallel=_fsdp2(profile, world)) - whole
    assert abs(per_rank * world - single) <= world  # int rounding of the shard
    assert single > profile.static_bytes  # the temporaries are in it, and shard with it


@pytest.mark.parametrize("precision", [None, "bf16"])
def test_resharded_units_are_gathered_one_at_a_time_in_forward_not_all(
    profile: Profile, precision: str | None
) -> None:
    # Kept gathered after forward, every unit is held at the loss; resharded, only the one
    # being run (and its all-gather buffer). The forward peaks differ by every unit but one,
    # gathered in the plan's dtype (bf16: half the fp32 weights).
    def forward_peak(reshard: bool) -> int:
        choices = {"parallel": _fsdp2(profile, 2, reshard), "precision": precision}
        candidate = Candidate(batch_size=8, choices={k: v for k, v in choices.items() if v})
        return estimate(profile, candidate, STRATEGIES).phase_peak_bytes["forward"]

    ratio = 0.5 if precision else 1.0
    units = [int(b.param_bytes * ratio) for b in profile.blocks]
    assert len(units) == 4 and min(units) > 0
    assert forward_peak(False) - forward_peak(True) == sum(units) - max(units)


def test_in_bf16_checkpointing_frees_a_rank_s_activations_and_no_weight_copies(
    profile: Profile,
) -> None:
    # Under FSDP2 in bf16 the units are gathered in bf16: autocast makes no weight copies, so
    # checkpointing a block frees its activations alone. On one card it also frees the
    # block's copies, which the per-rank edit must not take away a second time (it did: with
    # every block of the 1B checkpointed, 1.8 GiB too few at the loss and at the head).
    names = [b.name for b in profile.blocks]

    def rank(checkpointing: list[str]) -> tuple[int, int]:
        choices = {"parallel": _fsdp2(profile, 2, False), "precision": "bf16"}
        if checkpointing:
            choices["checkpointing"] = checkpointing
        e = estimate(profile, Candidate(batch_size=64, choices=choices), STRATEGIES)
        assert e.peak_phase != "optimizer"  # the breakdown's activations are then held ones
        return e.phase_peak_bytes["forward"], e.breakdown["activations"]

    (whole, whole_acts), (ckpt, ckpt_acts) = rank([]), rank(names)
    assert profile.steps["bf16"].cast_weight_bytes > 0  # one card's step has copies to drop
    assert whole_acts > ckpt_acts
    assert whole - ckpt == whole_acts - ckpt_acts
