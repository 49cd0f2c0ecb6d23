"""The estimate against a card's own runs, replayed on any machine: no card needed.

A plan saved on a card (``bench/plan_speed.py --save-plans DIR``) holds its CUDA profile and
every probe's measured allocated peak. This script scores each eager run that fitted with
today's :func:`memadvisor.estimate.estimate` and prints the error, so an estimate change can
be checked against card data on a laptop: the chunked loss's bf16 fix (docs/design.md, "The
allocator is part of the plan") moved lm350m's batch 21 from 6.59 GB to 7.97 against a
measured 8.05.

Usage::

    python bench/estimate_replay.py bench/results/plans/*.json \\
        --json bench/results/estimate_replay.jsonl

Known limitations:
    * Compiled runs are left out: the estimate is eager's (compiled memory is measured).
    * The peak compared is the allocated one of the run's steps; a run that ran out has
      none and is left out.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results" / "estimate_replay.jsonl"


def replay(path: Path) -> list[dict[str, Any]]:
    """One row per eager run of the plan at ``path`` that fitted: measured against estimated."""
    from memadvisor.estimate import estimate
    from memadvisor.schema.plan import Plan
    from memadvisor.strategy import load_strategies

    plan = Plan.load(path)
    if plan.profile is None:
        return []
    strategies = load_strategies()
    rows = []
    for probe in plan.probes:
        choices = probe.candidate.choices
        if "compile" in choices or not probe.fits or probe.peak_bytes is None:
            continue
        est = estimate(plan.profile, probe.candidate, strategies)
        rows.append(
            {
                "plan": str(path),
                "model": plan.model_name,
                "device": plan.device_name,
                "stage": probe.stage,
                "batch": probe.candidate.batch_size,
                "choices": choices,
                "measured_bytes": probe.peak_bytes,
                "estimated_bytes": est.peak_bytes,
                "estimated_phase": est.peak_phase,
                "error": round((est.peak_bytes - probe.peak_bytes) / probe.peak_bytes, 4),
            }
        )
    return rows


def _label(choices: dict[str, Any]) -> str:
    return ",".join(
        f"{k}={len(v) if isinstance(v, list) else v}"
        for k, v in choices.items()
        if k not in ("optimizer_habits", "allocator")
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("plans", nargs="+", type=Path, help="plans saved on a card (JSON)")
    parser.add_argument("--json", type=Path, default=None, help=f"append rows (e.g. {RESULTS})")
    args = parser.parse_args(argv)
    rows = [row for path in args.plans for row in replay(path)]
    print(f"{'model':12} {'stage':7} {'batch':>6} {'choices':45} {'measured':>9} {'est':>9} error")
    for r in rows:
        print(
            f"{r['model']:12} {r['stage']:7} {r['batch']:>6} {_label(r['choices']):45} "
            f"{r['measured_bytes'] / 1e9:9.3f} {r['estimated_bytes'] / 1e9:9.3f} "
            f"{r['error']:+.1%}"
        )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
