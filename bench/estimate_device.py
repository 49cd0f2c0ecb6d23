"""The estimate device against a card: does a plan made without one hold on it?

For each model: plan with ``device="estimate"`` (the factory built as fake tensors, planned
from the estimate alone, in this process, touching no card), then train the pick on the
card in a fresh process (``CudaDevice(fork_server=False)``: ``python -m
memadvisor.device._worker``, the budget set as its memory fraction before anything is
allocated) for ``--steps`` steps (200), and compare the plan's predicted peak
(``Estimate.limit_bytes``: allocated peak plus the largest tensor a memory cap strands)
with the run's ``torch.cuda.max_memory_reserved``. Target: within +-10%, and the run holds
all its steps.

    python bench/estimate_device.py --models resnet18,convnext_tiny,vit_b_16
    python bench/estimate_device.py --models bert,llama_small
    python bench/estimate_device.py --models llama_1b
    python bench/estimate_device.py --table                     # the table from the file
    python bench/estimate_device.py --models llama_tiny --device simulated --steps 3 \\
        --json /tmp/smoke.jsonl                                 # a CPU smoke run (~1 min)

Models (all from configs, no downloads): resnet18, convnext_tiny, vit_b_16 (torchvision);
bert (transformers BertForMaskedLM, bert-base config, sequence 512); llama_small
(transformers LlamaForCausalLM, 8 layers of 1024, sequence 1024); llama_1b (examples/llama.py
at TinyLlama-1.1B's shape, sequence 2048; full fine-tuning with AdamW needs ~21 GiB before
activations, so its budget is 32 GiB); llama_tiny (examples/llama.py's CPU size, for smoke
runs). Budgets: 8 GiB, llama_1b 32; ``--budget-gib`` sets one for all. A model whose package
is missing, or that fails, is reported in its line and the run goes on.

One JSON line per model is appended to ``--json`` (default
bench/results/estimate_device.jsonl) as soon as it is done: model, budget_gib, pick,
predicted_peak_gib, predicted_allocated_gib, measured_reserved_gib, measured_allocated_gib,
error_pct (predicted over measured reserved, less 1), holds_200_steps, steps, device,
plan_s, run_s. The table at the end is of this call's rows (``--table``: every row in the
file).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
MODELS_FILE = HERE.parent / "_models.py"
RESULTS = HERE.parent / "results" / "estimate_device.jsonl"
GIB = 2**30

MODELS = {
    "resnet18": f"{MODELS_FILE}:resnet18",
    "convnext_tiny": f"{MODELS_FILE}:convnext_tiny",
    "vit_b_16": f"{MODELS_FILE}:vit_b_16",
    "bert": f"{MODELS_FILE}:bert_base_b4",
    "llama_small": f"{MODELS_FILE}:llama_small",
    "llama_1b": f"{MODELS_FILE}:llama_1b",
    "llama_tiny": f"{ROOT}/examples/llama.py:build",
}
BUDGET_GIB = {"llama_1b": 32.0}  # the rest: 8
DEFAULT_MODELS = "resnet18,convnext_tiny,vit_b_16,bert,llama_small,llama_1b"


def _pick_text(plan: Any) -> str:
    cand = plan.candidate
    precision = cand.choices.get("precision", "fp32")
    ckpt = cand.choices.get("checkpointing") or []
    blocks = f"{len(ckpt)}/{len(plan.profile.blocks)} ckpt" if ckpt else "no ckpt"
    batch = f"b{cand.batch_size}" + (
        f"x{cand.accumulation_steps}" if cand.accumulation_steps > 1 else ""
    )
    return f"{precision} {blocks} {batch}"


def _run_on_device(kind: str, target: str, plan: Any, steps: int) -> dict[str, Any]:
    """The pick for ``steps`` steps under the budget, in a fresh process on the card (or on
    the simulated CPU device for a smoke run): the measurement, or how far it got."""
    from memadvisor.errors import is_oom

    budget = plan.config.budget_bytes
    if kind == "simulated":
        from memadvisor.device.simulated import SimulatedDevice
        from memadvisor.target import load_target

        device: Any = SimulatedDevice(budget, profile=plan.profile)
        workload: Any = load_target(target)
    else:
        from memadvisor.device.cuda import CudaDevice
        from memadvisor.device.fake import load_fake_target

        # The child builds the real model from the target; this process holds only a fake
        # one (the workload argument is read only if the child cannot run, which raises).
        device = CudaDevice(budget, target=target, profile=plan.profile, fork_server=False)
        workload = load_fake_target(target)
    t0 = time.perf_counter()
    try:
        m = device.run(workload, plan.candidate, steps)
        out = {
            "holds": True,
            "steps_done": steps,
            "allocated": m.peak_bytes,
            "reserved": m.reserved_peak_bytes,
        }
    except Exception as e:
        if not is_oom(e):
            raise
        done = int(getattr(e, "memadvisor_steps_completed", 0))
        out = {"holds": False, "steps_done": done, "error": str(e).splitlines()[0][:200]}
    finally:
        getattr(device, "close", lambda: None)()
    out["run_s"] = time.perf_counter() - t0
    out["device_name"] = device.name
    return out


def bench_one(name: str, budget_gib: float, args: argparse.Namespace) -> dict[str, Any]:
    from memadvisor.device.fake import load_fake_target
    from memadvisor.planner import plan_workload
    from memadvisor.schema.config import PlanConfig, gib_to_bytes

    target = MODELS[name]
    row: dict[str, Any] = {"model": name, "budget_gib": budget_gib}
    t0 = time.perf_counter()
    config = PlanConfig(budget_bytes=gib_to_bytes(budget_gib), device="estimate")
    plan = plan_workload(load_fake_target(target), config, progress=False)
    row["plan_s"] = round(time.perf_counter() - t0, 1)
    est = plan.estimate
    row.update(
        pick=_pick_text(plan),
        candidate=plan.candidate.model_dump(mode="json"),
        predicted_peak_gib=est.limit_bytes / GIB,
        predicted_allocated_gib=est.peak_bytes / GIB,
        predicted_phases_gib={k: v / GIB for k, v in (est.phase_peak_bytes or {}).items()},
    )
    ran = _run_on_device(args.device, target, plan, args.steps)
    reserved = ran.get("reserved")
    measured = reserved if reserved is not None else ran.get("allocated")
    row.update(
        measured_reserved_gib=reserved / GIB if reserved is not None else None,
        measured_allocated_gib=ran["allocated"] / GIB if "allocated" in ran else None,
        error_pct=(est.limit_bytes / measured - 1) * 100 if measured else None,
        holds_200_steps=ran["holds"] and args.steps >= 200,
        holds=ran["holds"],
        steps=ran["steps_done"],
        device=ran["device_name"],
        run_s=round(ran["run_s"], 1),
    )
    if "error" in ran:
        row["error"] = ran["error"]
    return row


def _fmt(value: Any, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'model':14s} {'budget':>6s} {'pick':24s} {'predicted':>9s} {'reserved':>9s} "
        f"{'error':>7s} {'holds':>9s} {'device':18s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "failed" in r:
            print(f"{r['model']:14s} {r.get('budget_gib', 0):6.1f} failed: {r['failed']}")
            continue
        holds = f"{'yes' if r['holds'] else 'OOM'} {r['steps']}"
        print(
            f"{r['model']:14s} {r['budget_gib']:6.1f} {r['pick']:24s} "
            f"{_fmt(r['predicted_peak_gib'], '9.2f')} {_fmt(r['measured_reserved_gib'], '9.2f')} "
            f"{_fmt(r['error_pct'], '+6.1f')}% {holds:>9s} {r['device'][:18]:18s}"
        )
    print(
        "GiB. predicted: the estimate device's limit_bytes (allocated peak + the largest "
        "tensor a memory cap strands); reserved: torch.cuda.max_memory_reserved over the run, "
        "in a fresh process under the budget. Target: error within +-10%, holds all steps."
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"of {sorted(MODELS)}")
    parser.add_argument("--budget-gib", type=float, default=None, help="one budget for all")
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--device", choices=("cuda", "simulated"), default="cuda")
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--table", action="store_true", help="print the file's table and exit")
    args = parser.parse_args()
    if args.table:
        rows = [json.loads(line) for line in args.json.read_text().splitlines() if line.strip()]
        print_table(rows)
        return 0
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; known: {sorted(MODELS)}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    with args.json.open("a") as out:
        for name in names:
            budget = args.budget_gib or BUDGET_GIB.get(name, 8.0)
            print(f"{name}: planning at {budget:g} GiB with the estimate device ...", flush=True)
            try:
                row = bench_one(name, budget, args)
            except ImportError as e:
                row = {"model": name, "budget_gib": budget, "failed": f"skipped ({e})"}
            except Exception as e:  # noqa: BLE001 - one model's failure ends only its row
                traceback.print_exc()
                row = {"model": name, "budget_gib": budget, "failed": f"{type(e).__name__}: {e}"}
            row["torch"] = __import__("torch").__version__
            print(json.dumps(row), flush=True)
            out.write(json.dumps(row) + "\n")
            out.flush()
            rows.append(row)
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE.parent))
    sys.exit(main())
