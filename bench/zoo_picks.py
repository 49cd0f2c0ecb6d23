"""The zoo's picks: each model of ``tests/fixtures/zoo.py`` planned as ``tests/test_zoo.py``
plans it (simulated device, a budget only checkpointing meets, fp32), one table row each.

    python bench/zoo_picks.py                 # every entry
    python bench/zoo_picks.py gpt2 densenet   # some

Needs transformers and torchvision (the README's test command installs both). Rows are
printed as each plan finishes: model, family, how its batch was made, precision,
checkpointed blocks, batch, budget, device runs and wall time.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests import test_zoo  # noqa: E402
from tests.fixtures import zoo  # noqa: E402


def main(names: list[str]) -> None:
    warnings.filterwarnings("ignore")  # HF's notices about tiny configs
    torch.set_num_threads(1)  # as the test runs them
    columns = [
        "model",
        "family",
        "batch-made-by",
        "precision",
        "checkpointed",
        "batch",
        "budget",
        "runs",
        "wall",
    ]
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for entry in [zoo.by_name(n) for n in names] or zoo.entries():
        started = time.perf_counter()
        plan = test_zoo._plan(entry.build())
        pick = plan.candidate
        chosen = pick.choices.get("checkpointing") or []
        print(
            f"| {entry.name} | {entry.family} | {entry.batch_kind} | "
            f"{pick.choices.get('precision', 'fp32')} | {len(chosen)} of "
            f"{len(plan.profile.blocks)}: {', '.join(chosen)} | {pick.batch_size} | "
            f"{plan.config.budget_bytes / 2**20:.2f} MiB | {len(plan.probes)} | "
            f"{time.perf_counter() - started:.1f} s |",
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
