"""Per-rank plans on two cards: DDP and FSDP2 at world size 2, predicted against measured.

For each model and each way of sharing it, one JSON line as soon as it is done (stdout, and
appended to ``--json PATH``), then the table:

* single: ``plan_workload`` for one card of ``--budget-gb`` (compile off: the per-rank plan
  does not weigh it), its batch the reference.
* plan: the same with ``world_size=2`` and ``parallel``: the per-rank estimate searched,
  its probes and verification run as 2 processes (rank r on card r, NCCL), each capped to
  the budget with ``set_per_process_memory_fraction``; the fullest rank decides.
* predicted vs measured: the pick's estimated per-rank peak (allocated, and what a cap must
  hold) against the fullest rank's measured ``max_memory_allocated`` (and reserved) over
  the verification's steps; the issue's bar is within 10%.
* 200 steps: the pick trained ``--long-steps`` steps by the 2 ranks from a clean state;
  OOMs counted.

    python bench/multi_gpu.py --models gpt,bert --parallel fsdp2,ddp --budget-gb 8 \\
        --json bench/results/multi_gpu.jsonl
    python bench/multi_gpu.py --table bench/results/multi_gpu.jsonl
    python bench/multi_gpu.py --models mlp --device simulated --budget-gb 0.011   # CPU smoke

Models: gpt (examples/gpt.py), bert (bench/_models.py, BertForMaskedLM with bert-base's
config, transformers needed), mlp (tests/fixtures/factories.py, the CPU smoke's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))  # tests.fixtures for the smoke model
GIB = 2**30
WORLD_SIZE = 2

MODELS = {
    "gpt": f"{ROOT}/examples/gpt.py:build",
    "bert": f"{HERE.parent / '_models.py'}:bert_base_b4",
    "mlp": "tests.fixtures.factories:residual_mlp",
}


def _gib(nbytes: float | None) -> float | None:
    return None if nbytes is None else round(nbytes / GIB, 4)


def _row(model: str, parallel: str, budget_gb: float, device: str, long_steps: int) -> dict:
    from memadvisor.config import PlanConfig, gib_to_bytes
    from memadvisor.device import is_oom
    from memadvisor.device.ranks import Ranks
    from memadvisor.planner import plan_workload
    from memadvisor.target import load_target

    target = MODELS[model]
    workload = load_target(target)
    base = {"budget_bytes": gib_to_bytes(budget_gb), "compile": "off", "device": device}
    started = time.perf_counter()
    single = plan_workload(workload, PlanConfig(**base), target=target, progress=False)
    multi_config = PlanConfig(**base, world_size=WORLD_SIZE, parallel=parallel)
    plan = plan_workload(workload, multi_config, target=target, progress=False)
    plan_s = time.perf_counter() - started
    verified = plan.verified
    ranks = Ranks(
        multi_config.budget_bytes,
        WORLD_SIZE,
        backend="cuda" if device == "cuda" else "simulated",
        target=target,
        profile=plan.profile,
        strategy_names=multi_config.strategies,
    )
    ooms, long_peak = 0, None
    try:
        long_peak = ranks.run(workload, plan.candidate, long_steps)
    except Exception as e:
        if not is_oom(e):
            raise
        ooms = 1
    return {
        "model": model,
        "parallel": parallel,
        "world_size": WORLD_SIZE,
        "budget_gib": budget_gb,
        "batch_per_rank": plan.candidate.batch_size,
        "single_card_batch": single.candidate.batch_size,
        "choices": plan.candidate.choices,
        "predicted_peak_gib": _gib(plan.estimate.peak_bytes),
        "predicted_limit_gib": _gib(plan.estimate.limit_bytes),
        "measured_peak_gib": _gib(verified.peak_bytes),
        "measured_reserved_gib": _gib(verified.reserved_peak_bytes),
        "rank_peaks_gib": [_gib(b) for b in verified.rank_peak_bytes or []],
        "error": round(plan.estimate.peak_bytes / verified.peak_bytes - 1, 4),
        "long_steps": long_steps,
        "long_measured_peak_gib": _gib(long_peak.peak_bytes) if long_peak else None,
        "ooms": ooms,
        "plan_s": round(plan_s, 1),
        "device": plan.device_name,
        "torch": torch.__version__,
    }


def _table(rows: list[dict]) -> str:
    head = (
        f"{'model':6} {'parallel':8} {'batch/rank':>10} {'1 card':>7} {'pred GiB':>9} "
        f"{'meas GiB':>9} {'error':>7} {'OOMs':>5}  device"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"{r['model']:6} {r['parallel']:8} {r['batch_per_rank']:>10} "
            f"{r['single_card_batch']:>7} {r['predicted_peak_gib']:>9.3f} "
            f"{r['measured_peak_gib']:>9.3f} {r['error']:>+7.1%} {r['ooms']:>5}  {r['device']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt,bert")
    parser.add_argument("--parallel", default="fsdp2,ddp")
    parser.add_argument("--budget-gb", type=float, default=8.0, help="per rank")
    parser.add_argument("--device", choices=["cuda", "simulated"], default="cuda")
    parser.add_argument("--long-steps", type=int, default=200)
    parser.add_argument("--json", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--table", type=Path, default=None, help="print the table of a file")
    args = parser.parse_args(argv)
    from memadvisor.errors import InfeasibleBudgetError

    if args.table is not None:
        rows = [json.loads(line) for line in args.table.read_text().splitlines() if line]
        rows = [r for r in rows if "infeasible" not in r]
        print(_table(rows))
        return 0
    if args.device == "cuda" and torch.cuda.device_count() < WORLD_SIZE:
        print(f"needs {WORLD_SIZE} CUDA devices, found {torch.cuda.device_count()}")
        return 2
    rows = []
    for model in args.models.split(","):
        for parallel in args.parallel.split(","):
            try:
                row = _row(model, parallel, args.budget_gb, args.device, args.long_steps)
            except InfeasibleBudgetError as e:  # a row of its own, not the end of the bench
                row = {"model": model, "parallel": parallel, "infeasible": str(e)}
            else:
                rows.append(row)
            line = json.dumps(row)
            print(line, flush=True)
            if args.json is not None:
                args.json.parent.mkdir(parents=True, exist_ok=True)
                with args.json.open("a") as f:
                    f.write(line + "\n")
    print(_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
