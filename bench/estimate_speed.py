"""How many candidates a second the estimate scores: the planner's search budget.

    python bench/estimate_speed.py [--blocks 32] [--seconds 2]

A 32-block profile with every field the profiler measures (the backward walk included),
random candidates over precision, checkpointed blocks and batch size, scored through the
real strategies' effects exactly as the planner scores them. Target: >= 10,000 a second.
"""

from __future__ import annotations

import argparse
import random
import time

from memadvisor.estimate import estimate
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.profile import (
    BlockActivity,
    BlockInfo,
    DeviceInfo,
    LinearBytes,
    LinearMs,
    PhasePeak,
    Profile,
    StepProfile,
)
from memadvisor.strategy import load_strategies

MIB = 2**20


def _lb(per_sample_mib: float, constant_mib: float = 0.0) -> LinearBytes:
    return LinearBytes(per_sample_bytes=per_sample_mib * MIB, constant_bytes=constant_mib * MIB)


def synthetic_profile(n_blocks: int) -> Profile:
    """A Llama-like shape: equal blocks, a large head; sizes are made up, the shape is not."""

    def step(precision: str, scale: float) -> StepProfile:
        blocks = []
        for i in range(n_blocks):
            below = n_blocks - 1 - i  # blocks whose backward ran before this one's
            blocks.append(
                BlockActivity(
                    name=f"layers.{i}",
                    activation=_lb(40 * scale),
                    input=_lb(4 * scale),
                    output=_lb(4 * scale),
                    output_kept=_lb(4 * scale),
                    forward_transient=_lb(8 * scale),
                    cast_weight_bytes=int(400 * MIB * (scale < 1)),
                    forward_ms=LinearMs(per_sample_ms=1.0 * scale),
                    backward_start=_lb(-40 * scale * below, 800 * below),
                    backward_peak=_lb(-40 * scale * below + 8 * scale, 800 * below),
                )
            )
        return StepProfile(
            precision=precision,
            blocks=blocks,
            activation_total=_lb(40 * scale * n_blocks + 500 * scale),
            phases=[
                PhasePeak(phase="forward", allocated=_lb(40 * scale * n_blocks, 80_000)),
                PhasePeak(phase="backward", allocated=_lb(41 * scale * n_blocks, 80_000)),
                PhasePeak(phase="optimizer", allocated=_lb(0, 130_000)),
            ],
            end_of_forward=_lb(40 * scale * n_blocks + 500 * scale, 80_000),
            backward_head_peak=_lb(1000 * scale),
            forward_ms=LinearMs(per_sample_ms=n_blocks * scale, constant_ms=5.0),
            backward_ms=LinearMs(per_sample_ms=2 * n_blocks * scale, constant_ms=5.0),
            optimizer_ms=20.0,
        )

    return Profile(
        model_name="Synthetic",
        device=DeviceInfo(kind="cuda", name="bench", bf16_supported=True),
        batch_sizes=(1, 2),
        param_bytes=26_000 * MIB,
        grad_bytes=26_000 * MIB,
        optimizer_state_bytes=52_000 * MIB,
        blocks=[
            BlockInfo(name=f"layers.{i}", type_name="DecoderLayer", param_bytes=800 * MIB)
            for i in range(n_blocks)
        ],
        steps={"fp32": step("fp32", 1.0), "bf16": step("bf16", 0.5)},
    )


def candidates(profile: Profile, count: int, seed: int = 0) -> list[Candidate]:
    rng = random.Random(seed)
    names = [b.name for b in profile.blocks]
    out = []
    for _ in range(count):
        k = rng.randrange(len(names) + 1)
        out.append(
            Candidate(
                batch_size=rng.randrange(1, 65),
                choices={
                    "precision": rng.choice(["fp32", "bf16"]),
                    "checkpointing": names[:k],
                },
            )
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    profile = synthetic_profile(args.blocks)
    strategies = load_strategies(["precision", "checkpointing"])
    pool = candidates(profile, 2000)
    for cand in pool[:50]:  # warm the caches, as a search's first trials do
        estimate(profile, cand, strategies)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < args.seconds:
        for cand in pool:
            estimate(profile, cand, strategies)
        done += len(pool)
    elapsed = time.perf_counter() - started
    rate = done / elapsed
    print(
        f"blocks={args.blocks}  candidates={done}  seconds={elapsed:.2f}  "
        f"rate={rate:,.0f}/s  per_candidate={elapsed / done * 1e6:.1f} us  "
        f"target=10,000/s  {'OK' if rate >= 10_000 else 'BELOW TARGET'}"
    )


if __name__ == "__main__":
    main()
