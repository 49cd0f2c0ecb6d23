"""The search space: every strategy's choices, and the batch each combination can afford.

The batch is not searched: for one combination of choices the estimated peak grows with
the batch (activations are linear in it), so the largest batch under a byte limit is found
by bisection on the estimate in ~2 log2(b) calls instead of being sampled.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from pydantic import JsonValue

from memadvisor.estimate import estimate
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.profile import Profile
from memadvisor.strategy import Estimated, Measured, Strategy

__all__ = [
    "Scored",
    "SearchSpace",
    "largest_batch",
    "limit_at",
    "micro_batch_for",
    "rank_key",
]


def limit_at(
    profile: Profile, choices: dict[str, JsonValue], strategies: Sequence[Strategy], batch: int
) -> int:
    """The estimate's :attr:`Estimate.limit_bytes` for ``choices`` at ``batch``."""
    return estimate(profile, Candidate(batch_size=batch, choices=choices), strategies).limit_bytes


def largest_batch(
    profile: Profile,
    choices: dict[str, JsonValue],
    strategies: Sequence[Strategy],
    limit_bytes: int,
    max_batch: int,
) -> int:
    """The largest batch whose estimated peak is at most ``limit_bytes`` (0: not even one).

    The peak is :attr:`Estimate.limit_bytes`: on a card, what the allocator reserves.

    The estimated peak is non-decreasing and convex in the batch (each phase is linear in it,
    the peak their maximum), so the chord between a fitting and a failing batch crosses the
    limit at a batch that fits: a few chord steps land on the answer (about 5 estimate calls
    where bisection takes 2 log2(b)). Bisection takes over if a strategy's effect breaks
    convexity; either way the bracket ``peak(lo) <= limit < peak(hi)`` holds throughout.
    """

    def peak(b: int) -> int:
        return limit_at(profile, choices, strategies, b)

    lo, peak_lo = 1, peak(1)
    if peak_lo > limit_bytes:
        return 0
    hi, peak_hi = max_batch, peak(max_batch)
    if peak_hi <= limit_bytes:
        return max_batch
    chord_steps = 0
    while hi - lo > 1:
        if chord_steps < _CHORD_STEPS and peak_hi > peak_lo:
            chord_steps += 1
            crossing = lo + (limit_bytes - peak_lo) * (hi - lo) / (peak_hi - peak_lo)
            mid = min(max(int(crossing), lo + 1), hi - 1)
        else:
            mid = (lo + hi) // 2
        peak_mid = peak(mid)
        if peak_mid > limit_bytes:
            hi, peak_hi = mid, peak_mid
            continue
        lo, peak_lo = mid, peak_mid
        if mid + 1 < hi:  # a tight chord: one more call usually closes the bracket
            peak_next = peak(mid + 1)
            if peak_next > limit_bytes:
                hi, peak_hi = mid + 1, peak_next
            else:
                lo, peak_lo = mid + 1, peak_next
    return lo


_CHORD_STEPS = 6  # a peak with more kinks than this in range is finished by bisection


def micro_batch_for(effective_batch: int, largest: int) -> tuple[int, int]:
    """(micro-batch, accumulation steps) that reach ``effective_batch``; ``(0, 0)`` if none fits.

    Fewest accumulation steps is fastest (each micro-batch pays the step's fixed costs
    again), so start from ``k = ceil(effective / largest)``. The effective batch is kept
    exactly when some k up to twice that divides it (72 with 35 fitting: 3 x 24); otherwise
    (a prime such as 73 would need 73 x 1) the fewest steps are taken and the micro-batch
    rounded up, overshooting by fewer than k samples (73 -> 3 x 25 = 75), and the plan says so.
    """
    if largest < 1:
        return 0, 0
    if effective_batch <= largest:
        return effective_batch, 1
    fewest = math.ceil(effective_batch / largest)
    for steps in range(fewest, 2 * fewest + 1):
        if effective_batch % steps == 0:
            return effective_batch // steps, steps
    return math.ceil(effective_batch / fewest), fewest


@dataclass(frozen=True)
class Scored(Estimated):
    """One combination of choices at the batch the objective picks, with its estimate; a
    measured stage gets it as the contract's :class:`memadvisor.strategy.Estimated`."""

    active: int  # how many strategies are not neutral

    @property
    def choices_json(self) -> str:
        return json.dumps(self.candidate.choices, sort_keys=True)


def rank_key(objective: str, batch: int, samples_per_s: float, active: int, tie: str) -> tuple:
    """Sort key, best first: the objective, then the simpler plan, then a stable tie-break."""
    if objective == "largest_batch":
        return (-batch, -samples_per_s, active, tie)
    return (-samples_per_s, active, tie)


class SearchSpace:
    """The strategies' choices for one profile, and the scoring of any combination."""

    def __init__(
        self, profile: Profile, strategies: Sequence[Strategy], config: PlanConfig
    ) -> None:
        self.profile = profile
        self.strategies = list(strategies)
        self.config = config
        self.options: dict[str, list[JsonValue]] = {}
        for s in self.strategies:
            offered = list(s.choices(profile, config))
            if isinstance(s, Measured):
                # The estimate cannot rank what it cannot predict (a compiled model's memory
                # and time): such a strategy keeps its neutral choice here, and its other
                # choices are only ever judged by measuring them on the device.
                offered = offered[:1]
            self.options[s.name] = offered if offered else [None]
        self._cache: dict[tuple[int, ...], Scored | None] = {}

    @property
    def size(self) -> int:
        size = 1
        for opts in self.options.values():
            size *= len(opts)
        return size

    @property
    def names(self) -> list[str]:
        return list(self.options)

    def combinations(self) -> Iterator[tuple[int, ...]]:
        """Every combination as indices into each strategy's choices, in a fixed order."""
        return itertools.product(*(range(len(o)) for o in self.options.values()))

    def choices_of(self, indices: Sequence[int]) -> dict[str, JsonValue]:
        """The candidate's ``choices`` for these indices; neutral choices are left out (off)."""
        out: dict[str, JsonValue] = {}
        for s, i in zip(self.strategies, indices, strict=True):
            choice = self.options[s.name][i]
            if choice is not None and not s.is_neutral(choice):
                out[s.name] = choice
        return out

    def plain_indices(self) -> list[int] | None:
        """Per strategy the index of its first neutral option (its only one when it offers
        one); None when some strategy offers several options and none of them is neutral."""
        out = []
        for s in self.strategies:
            options = self.options[s.name]
            neutral = [i for i, c in enumerate(options) if c is None or s.is_neutral(c)]
            if not neutral and len(options) > 1:
                return None
            out.append(neutral[0] if neutral else 0)
        return out

    def score(self, indices: Sequence[int]) -> Scored | None:
        """The combination at the batch its objective picks; None when batch 1 does not fit."""
        key = tuple(indices)
        if key not in self._cache:
            self._cache[key] = self.score_choices(self.choices_of(key))
        return self._cache[key]

    def score_choices(self, choices: dict[str, JsonValue]) -> Scored | None:
        cfg = self.config
        largest = largest_batch(
            self.profile, choices, self.strategies, cfg.usable_bytes, cfg.max_batch
        )
        if largest < 1:
            return None
        batch, accumulation = self.batch_for(largest)
        cand = Candidate(batch_size=batch, accumulation_steps=accumulation, choices=choices)
        return Scored(
            candidate=cand,
            estimate=estimate(self.profile, cand, self.strategies),
            largest_batch=largest,
            active=len(choices),
        )

    def upper_batch(self, scored: Scored) -> int:
        """The bracket's top: the largest micro-batch the estimate allows under the whole budget."""
        cfg = self.config
        upper = largest_batch(
            self.profile, scored.candidate.choices, self.strategies, cfg.budget_bytes, cfg.max_batch
        )
        return max(upper, scored.largest_batch)

    def bytes_per_sample(self, choices: dict[str, JsonValue], batch: int) -> float:
        """What one more sample adds to the estimated :attr:`Estimate.limit_bytes` of
        ``choices``, over the upper half of ``[0, batch]``.

        The estimate is convex in the batch (the larger of a fixed phase and the activations'
        phase), so this is at most its slope above ``batch``: the safe side for a margin
        below a failure (:meth:`Prober.below`: a smaller slope, more samples of headroom),
        not for aiming above a fit, where a fixed phase that dominates below ``batch``
        flattens it (the upward probe goes along :meth:`batch_reaching` instead)."""
        low = max(1, batch // 2)
        if batch <= low:
            low, batch = batch, batch + 1
        high_bytes = limit_at(self.profile, choices, self.strategies, batch)
        low_bytes = limit_at(self.profile, choices, self.strategies, low)
        return (high_bytes - low_bytes) / (batch - low)

    def batch_reaching(self, choices: dict[str, JsonValue], batch: int, more_bytes: float) -> int:
        """The largest batch from ``batch`` up whose estimated :attr:`Estimate.limit_bytes`
        of ``choices`` is at most ``more_bytes`` above ``batch``'s (``batch`` itself where
        the next one is already more; at most ``config.max_batch``): with ``more_bytes``
        the room a run measured under what is aimed at, the estimate shifted by the
        measured-minus-estimated error at ``batch``.

        Why along the estimate itself, not a slope: a step's estimate is the larger of a fixed
        phase (the optimizer's update) and the activations' phase, so its slope below
        ``batch`` can be far under the slope above it. lm350m on a card held 7.53 GB at batch
        18 (budget 8.59 GB, about 0.17 GB a sample there); the estimate's slope over [9, 18],
        mostly the fixed phase, was about 0.03 GB a sample and sent the next probe to 38
        where 21 ran out."""
        base = limit_at(self.profile, choices, self.strategies, batch)
        limit = math.floor(base + more_bytes)
        reach = largest_batch(self.profile, choices, self.strategies, limit, self.config.max_batch)
        return max(batch, reach)

    def batch_for(self, largest: int) -> tuple[int, int]:
        """(micro-batch, accumulation) the objective takes when ``largest`` fits."""
        if self.config.objective == "effective_batch":
            # PlanConfig refuses this objective without an effective batch.
            return micro_batch_for(int(self.config.effective_batch or 1), largest)
        return largest, 1

    def key(self, scored: Scored) -> tuple:
        return rank_key(
            self.config.objective,
            scored.candidate.batch_size,
            scored.estimate.samples_per_s,
            scored.active,
            scored.choices_json,
        )

    def cheapest_peak_bytes(self, limit: int = 4096) -> int:
        """The smallest estimated peak at batch 1 over (up to ``limit``) combinations."""
        best: int | None = None
        for indices in itertools.islice(self.combinations(), limit):
            peak = limit_at(self.profile, self.choices_of(indices), self.strategies, 1)
            best = peak if best is None else min(best, peak)
        return best if best is not None else 0
