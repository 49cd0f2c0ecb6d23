"""The prober's batch search after a failure made before it, on the fake device: no card.

A sweep of ``Prober.confirm`` on ``tests/planner/test_prober.py``'s RetriesDevice (a card
whose batches from a failure up run out by the allocator's retries): a fit at 20 and the
failure are run first, then the search starts from 3 below the margin under the failure to
1 above it, with two device runs left (a compiled confirmation's bound). Per case it prints
the margin (``Prober.below``), the start, the pick ("spent": the runs ran out before the
search ended) and the batches the device ran. Run it at two commits to compare searches
(docs/design.md, session 32: "The prober's bound below a failure").

    python bench/prober_bound.py

Known limitations: one fake model (tests/planner/conftest.py's ``make_profile(20)`` under
160 MiB); the sweep says how the search's rules meet, not what a card's edge does.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from memadvisor.estimate import estimate  # noqa: E402
from memadvisor.planner._prober import Prober, RunsSpent  # noqa: E402
from memadvisor.planner._space import Scored, SearchSpace  # noqa: E402
from memadvisor.schema.candidate import Candidate  # noqa: E402
from memadvisor.schema.config import PlanConfig  # noqa: E402
from tests.planner.conftest import (  # noqa: E402
    MIB,
    FakeCheckpointing,
    FakePrecision,
    make_profile,
    tiny_workload,
)
from tests.planner.test_prober import BF16, RetriesDevice  # noqa: E402


def sweep(failures: range) -> list[tuple[int, int, int, str, list[int]]]:
    """(failure, margin below it, start, pick or 'spent', batches run) per case."""
    strategies = [FakePrecision(), FakeCheckpointing()]
    workload, profile, budget = tiny_workload(), make_profile(param_mib=20), 160 * MIB
    rows = []
    for failure in failures:
        for offset in (-3, -1, 0, 1):
            device = RetriesDevice(profile, strategies, budget, retries_from=failure)
            config = PlanConfig(budget_bytes=budget, probe_steps=2, timing_steps=2, verify_steps=4)
            prober = Prober(device, workload, SearchSpace(profile, strategies, config), config)
            prober.run(Candidate(batch_size=20, choices=BF16), prober.steps, "probe")
            prober.run(Candidate(batch_size=failure, choices=BF16), prober.steps, "probe")
            margin = prober.below(BF16, failure)
            del device.calls[:]
            start = Candidate(batch_size=margin + offset, choices=BF16)
            scored = Scored(
                candidate=start, estimate=estimate(profile, start, strategies),
                largest_batch=start.batch_size, active=1,
            )  # fmt: skip
            prober.runs_left = 2
            try:
                found = prober.confirm(scored, "compile", floor=20)
                pick = str(found.candidate.batch_size) if found is not None else "none"
            except RunsSpent:
                pick = "spent"
            rows.append((failure, margin, start.batch_size, pick, [b for b, _, _ in device.calls]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--failures", default="33-39", help="the failing batches, FIRST-LAST")
    args = parser.parse_args()
    first, last = (int(x) for x in args.failures.split("-"))
    rows = sweep(range(first, last + 1))
    print(f"{'failure':>7}  {'margin':>6}  {'start':>5}  {'pick':>5}  runs")
    for failure, margin, start, pick, runs in rows:
        print(f"{failure:>7}  {margin:>6}  {start:>5}  {pick:>5}  {runs}")
    spent = sum(1 for r in rows if r[3] == "spent")
    print(f"spent {spent} of {len(rows)}; runs {sum(len(r[4]) for r in rows)}")


if __name__ == "__main__":
    main()
