"""SearchSpace: the batch each combination affords is solved on what a memory cap must hold."""

from __future__ import annotations

from memadvisor.estimate import estimate
from memadvisor.planner._space import SearchSpace, largest_batch, limit_at
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.profile import LinearBytes, Profile
from tests.planner.conftest import make_profile

MIB = 2**20
GIB = 2**30


def _with_largest(profile: Profile, per_sample_bytes: float) -> Profile:
    steps = {
        name: step.model_copy(
            update={"largest_allocation": LinearBytes(per_sample_bytes=per_sample_bytes)}
        )
        for name, step in profile.steps.items()
    }
    return profile.model_copy(update={"steps": steps})


def test_the_largest_batch_leaves_room_for_a_stranded_largest_tensor(profile, strategies) -> None:
    """With a largest-allocation line (a card's profile) the batch is the largest whose
    allocated peak plus that tensor fits the limit: smaller than the allocated peak alone
    allows, and exactly at the edge."""
    limit = 92 * MIB
    plain = largest_batch(profile, {}, strategies, limit, 65536)
    capped = _with_largest(profile, 1 * MIB)
    b = largest_batch(capped, {}, strategies, limit, 65536)
    assert 0 < b < plain

    def held(batch: int) -> int:
        return estimate(capped, Candidate(batch_size=batch), strategies).limit_bytes

    assert held(b) <= limit < held(b + 1)
    assert held(b) == estimate(capped, Candidate(batch_size=b), strategies).peak_bytes + b * MIB


def test_bytes_per_sample_is_the_estimates_slope_below_the_batch(profile, strategies) -> None:
    """bytes_per_sample(choices, b) is the estimate's growth per sample over [b/2, b], the
    largest-allocation line's slope included (it is what a cap must hold)."""
    config = PlanConfig(budget_bytes=100 * MIB)
    for p, extra in ((profile, 0), (_with_largest(profile, 1 * MIB), MIB)):
        space = SearchSpace(p, strategies, config)
        slope = space.bytes_per_sample({}, 20)
        at = [estimate(p, Candidate(batch_size=b), strategies).limit_bytes for b in (10, 20)]
        assert slope == (at[1] - at[0]) / 10
        assert slope > extra


def test_batch_reaching_climbs_to_max_batch_where_the_room_allows_it(strategies) -> None:
    """Rule: batch_reaching(choices, b, room) is the largest batch from b up whose estimate
    stays within ``room`` of b's, up to ``config.max_batch`` itself: where its doubling steps
    overshoot the cap, it bisects between the last batch within and the cap (it stopped at
    the last doubling step: 26 from 18 under a cap of 30, 82 under 100)."""
    profile = make_profile(param_mib=20)
    bf16 = {"precision": "bf16"}
    for cap in (19, 30, 33, 100):
        space = SearchSpace(profile, strategies, PlanConfig(budget_bytes=GIB, max_batch=cap))
        assert space.batch_reaching(bf16, 18, GIB) == cap
    # Under the room: the largest batch within it, below the cap.
    space = SearchSpace(profile, strategies, PlanConfig(budget_bytes=GIB, max_batch=100))
    base = limit_at(profile, bf16, strategies, 18)
    room = limit_at(profile, bf16, strategies, 30) - base
    assert space.batch_reaching(bf16, 18, room) == 30
    assert space.batch_reaching(bf16, 18, room - 1) == 29
    assert space.batch_reaching(bf16, 18, -1) == 18
