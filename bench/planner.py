"""The planner on a GPU: runs, time to plan, and the plan against four hand configurations.

For each model and budget (GiB), one JSON line as soon as it is done (stdout, and appended
to ``--json PATH``), then the table:

* plan: ``plan_workload`` as ``memadvisor plan`` runs it (the profile made once per model,
  on the card, and timed apart; the estimate's search; one timing run per candidate, the
  winner's batch search, its verification), every run a forked child of the CudaDevice's
  fork server. Reported: the winner's batch-search runs (``probes``), all device runs of
  the plan (``runs``, verification included), wall time to plan, the pick and its verified
  samples/s (``verify_steps`` = 20 steps from a clean state, the first excluded).
* hand: fp32 / bf16 x no / all-blocks checkpointing, each at its own largest batch found by
  ``measure_configuration`` (the same bracketed search and margin rule as the plan's: a
  hand-tuner who kept no margin would not be comparable), measured through the same device
  with the same steps, so the plan and the hand rows are one measurement each, made alike.
* plan >= best: the plan's samples/s over the best hand configuration's; "yes" when at least
  ``1 - --tolerance`` (default 2%: two measurements of one configuration differ by timing
  noise, and the plan's pick is often one of the four).
* 200 steps: the pick trains ``--long-steps`` steps in a fresh process (not a forked child:
  the way a user's own job starts); OOMs counted.

Wall time per (model, budget), measured on an H200 (torch 2.11): 96-136 s a row for gpt,
cnn and llama (the plan 54-101 s of it, its compile stage the largest part; the four hand
rows 1-2 runs each; the 200-step run), 164 s for resnet18 and 285 s for convnext_tiny at
8 GiB, plus the profile once per model (4-30 s). Three budgets of one light model fit a
9-minute chunk; run models in parallel on separate cards with CUDA_VISIBLE_DEVICES.

    python bench/planner.py --models gpt --budgets 4,8,16 --json out/planner.jsonl
    python bench/planner.py --models gpt,cnn --budgets 8 --skip-hand   # plan and 200 steps
    python bench/planner.py --table out/planner.jsonl                  # the table again

Models: gpt, cnn, llama (examples/); resnet18, convnext_tiny (torchvision); bert
(transformers BertForMaskedLM, bert-base config); llama_small (transformers LlamaForCausalLM,
a small config). All built from configs, no downloads; a model whose package is missing is
reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _targets import targets  # bench/, first on sys.path when run as a script

GIB = 2**30

MODELS = targets("gpt", "cnn", "llama", "resnet18", "convnext_tiny", "bert", "llama_small")
DEFAULT_MODELS = "gpt,cnn,resnet18,convnext_tiny,bert,llama_small"


# -- one (model, budget) ---------------------------------------------------------------------


def _hand_configurations(profile: Any) -> list[tuple[str, dict]]:
    every_block = [b.name for b in profile.blocks]
    ckpt = {"checkpointing": every_block} if every_block else {}
    return [
        ("fp32", {}),
        ("fp32+ckpt", dict(ckpt)),
        ("bf16", {"precision": "bf16"}),
        ("bf16+ckpt", {"precision": "bf16", **ckpt}),
    ]


def _device_runs(plan: Any) -> dict[str, int]:
    """The plan's device runs: all of them, and the winner's batch search among them (for a
    compiled pick, the search of the eager choices it was compiled from)."""

    def eager(choices: dict) -> dict:
        return {k: v for k, v in choices.items() if k not in ("batch_size", "compile")}

    own = [p for p in plan.probes if p.stage in ("timing", "probe") and p.candidate is not None]
    winner = [p for p in own if eager(p.candidate.choices) == eager(plan.candidate.choices)]
    return {
        "runs": sum(p.stage in ("timing", "probe", "verify") for p in plan.probes),
        "probes": len(winner),
        "timing": sum(p.stage == "timing" for p in plan.probes),
        "verify": sum(p.stage == "verify" for p in plan.probes),
    }


def _hand(workload: Any, config: Any, profile: Any, device: Any) -> dict[str, dict]:
    from memadvisor.planner import measure_configuration

    out: dict[str, dict] = {}
    for label, choices in _hand_configurations(profile):
        t0 = time.perf_counter()
        row, runs = measure_configuration(
            workload, config, choices, profile=profile, device=device, label=label
        )
        out[label] = {
            "batch": row.largest_batch or 0,
            "runs": len(runs),
            "search_s": time.perf_counter() - t0,
            "samples_per_s": row.measured.samples_per_s if row.measured else None,
            "peak_gib": row.measured.peak_bytes / GIB if row.measured else None,
        }
    return out


def _make_device(kind: str, budget_bytes: int, target: str, profile: Any, fork: bool) -> Any:
    """The CUDA device (a fork server, or ``fork=False``: a fresh process per run), or the
    simulated CPU device for a smoke run of this script."""
    if kind == "simulated":
        from memadvisor.device.simulated import SimulatedDevice

        return SimulatedDevice(budget_bytes, profile=profile)
    from memadvisor.device.cuda import CudaDevice

    return CudaDevice(budget_bytes, target=target, profile=profile, fork_server=fork)


def _long_run(
    kind: str, target: str, budget_bytes: int, profile: Any, pick: Any, steps: int
) -> dict:
    """``pick`` for ``steps`` steps in a fresh process (no fork server), as a user's job."""
    from memadvisor.errors import is_oom
    from memadvisor.target import load_target

    device = _make_device(kind, budget_bytes, target, profile, fork=False)
    t0 = time.perf_counter()
    try:
        m = device.run(load_target(target), pick, steps)
        out = {"oom": False, "samples_per_s": m.samples_per_s, "peak_gib": m.peak_bytes / GIB}
    except Exception as e:
        if not is_oom(e):
            raise
        out = {"oom": True, "error": str(e).splitlines()[0][:200]}
    finally:
        device.close()
    return {"steps": steps, "s": time.perf_counter() - t0, **out}


def bench_one(
    name: str, target: str, budget_gib: float, profile: Any, args: argparse.Namespace
) -> dict:
    from memadvisor.planner import plan_workload
    from memadvisor.schema.candidate import Candidate
    from memadvisor.schema.config import PlanConfig, gib_to_bytes
    from memadvisor.target import load_target

    workload = load_target(target)
    config = PlanConfig(budget_bytes=gib_to_bytes(budget_gib), rerank_top=args.rerank_top)
    out: dict[str, Any] = {"model": name, "budget_gib": budget_gib}
    # One device (one fork server) for the plan and the hand rows: measured alike.
    device = _make_device(args.device, config.budget_bytes, target, profile, fork=True)
    try:
        t0 = time.perf_counter()
        plan = plan_workload(
            workload, config, target=target, profile=profile, device=device, progress=False
        )
        out["plan_s"] = time.perf_counter() - t0
        out.update(_device_runs(plan))
        out["pick"] = plan.candidate.model_dump(mode="json")
        out["pick_label"] = _label(plan.candidate.choices, len(profile.blocks))
        out["plan_samples_per_s"] = plan.verified.samples_per_s if plan.verified else None
        out["verified"] = plan.verified.model_dump(mode="json") if plan.verified else None
        out["estimate_peak_gib"] = plan.estimate.peak_bytes / GIB
        out["notes"] = plan.notes
        out["device_mode"] = getattr(device, "mode", device.kind)  # CudaDevice: how runs ran
        out["hand"] = {} if args.skip_hand else _hand(workload, config, profile, device)
    finally:
        device.close()
    rates = [h["samples_per_s"] for h in out["hand"].values() if h["samples_per_s"]]
    if rates and out["plan_samples_per_s"]:
        out["best_hand_samples_per_s"] = max(rates)
        out["plan_over_best"] = out["plan_samples_per_s"] / max(rates)
        out["plan_ge_best"] = out["plan_over_best"] >= 1.0 - args.tolerance
    if args.long_steps:
        pick = Candidate(
            batch_size=plan.candidate.batch_size,
            accumulation_steps=plan.candidate.accumulation_steps,
            choices=plan.candidate.choices,
        )
        out["long_run"] = _long_run(
            args.device, target, config.budget_bytes, profile, pick, args.long_steps
        )
    return out


def _label(choices: dict, n_blocks: int) -> str:
    precision = choices.get("precision", "fp32")
    ckpt = choices.get("checkpointing") or []
    extra = sorted(
        k
        for k in choices
        if k not in ("precision", "checkpointing", "batch_size", "optimizer_habits", "inference")
    )
    text = f"{precision} ckpt {len(ckpt)}/{n_blocks}"
    return text + (f" +{'+'.join(extra)}" if extra else "")


def _profile(workload: Any, kind: str) -> Any:
    from memadvisor.device._factory import planned_capabilities
    from memadvisor.planner._plan import _profile as planner_profile
    from memadvisor.planner._progress import Progress

    # As plan_workload profiles for that device (the simulated one under CUDA's autocast).
    return planner_profile(workload, planned_capabilities(kind), Progress(enabled=False))


# -- table -----------------------------------------------------------------------------------

HAND = ("fp32", "fp32+ckpt", "bf16", "bf16+ckpt")


def _rate_text(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.0f}"


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':13s} {'GiB':>4s} {'prb':>3s} {'runs':>4s} {'plan s':>6s}  "
        f"{'pick':22s} {'batch':>7s} {'plan/s':>8s}  "
        + " ".join(f"{h:>14s}" for h in HAND)
        + f"  {'plan/best':>9s} {'>=best':>6s} {'200 steps':>9s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:13s} {r.get('budget_gib', ''):>4} {r['error'][:160]}")
            continue
        pick = r["pick"]
        batch = f"{pick['batch_size']}x{pick['accumulation_steps']}"
        cells = []
        for label in HAND:
            h = r["hand"].get(label)
            cells.append(
                f"{'-':>14s}"
                if h is None
                else f"{h['batch']:>6d}@{_rate_text(h['samples_per_s']):>7s}"
            )
        ratio = f"{r['plan_over_best']:.3f}" if "plan_over_best" in r else "-"
        verdict = "-" if "plan_ge_best" not in r else ("yes" if r["plan_ge_best"] else "NO")
        long = r.get("long_run")
        long_text = "-" if not long else ("OOM" if long["oom"] else f"ok {long['steps']}")
        print(
            f"{r['model']:13s} {r['budget_gib']:>4g} {r['probes']:>3d} {r['runs']:>4d} "
            f"{r['plan_s']:>6.1f}  {r['pick_label'][:22]:22s} {batch:>7s} "
            f"{_rate_text(r['plan_samples_per_s']):>8s}  {' '.join(cells)}  {ratio:>9s} "
            f"{verdict:>6s} {long_text:>9s}"
        )
    print(
        "\nprb: runs of the pick's choices, without compile (its timing run and batch "
        "search); runs: all eager device runs of the plan, verification included (each a "
        "forked child of the fork server). "
        "Hand cells: largest batch @ samples/s, found and measured like the plan's, on the "
        "same device. >=best: plan/best at least 1 - tolerance. 200 steps: the pick in a "
        "fresh process."
    )


def _write(row: dict, path: Path | None) -> None:
    print(json.dumps(row), flush=True)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"of {sorted(MODELS)}")
    parser.add_argument("--budgets", default="4,8,16", help="GiB, comma separated")
    parser.add_argument("--long-steps", type=int, default=200)
    parser.add_argument("--rerank-top", type=int, default=3)
    parser.add_argument("--tolerance", type=float, default=0.02, help="timing noise allowed")
    parser.add_argument("--skip-hand", action="store_true", help="only the plan and long run")
    parser.add_argument("--json", type=Path, default=None, help="append JSON lines here")
    parser.add_argument("--table", type=Path, default=None, help="print the table of a --json file")
    parser.add_argument(
        "--device",
        choices=("cuda", "simulated"),
        default="cuda",
        help="simulated: a CPU smoke run of this script (small budgets such as 0.25)",
    )
    args = parser.parse_args()
    if args.table is not None:
        print_table([json.loads(line) for line in args.table.read_text().splitlines() if line])
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/planner.py needs a CUDA device (or --device simulated for a smoke run).")

    from memadvisor.target import load_target

    name_of_device = torch.cuda.get_device_name() if args.device == "cuda" else "simulated"
    print("torch", torch.__version__, name_of_device, flush=True)
    rows: list[dict] = []
    budgets = [float(b) for b in args.budgets.split(",")]
    for name in args.models.split(","):
        target = MODELS[name]
        try:
            t0 = time.perf_counter()
            profile = _profile(load_target(target), args.device)
            profile_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a missing package or model: report, go on
            row = {"model": name, "error": f"profile failed: {type(e).__name__}: {e}"}
            rows.append(row)
            _write(row, args.json)
            continue
        for budget in budgets:
            t1 = time.perf_counter()
            try:
                row = bench_one(name, target, budget, profile, args)
            except Exception as e:  # noqa: BLE001 - e.g. infeasible at 4 GiB: a row, not a crash
                row = {"model": name, "budget_gib": budget, "error": f"{type(e).__name__}: {e}"}
            row["profile_s"] = profile_s
            row["total_s"] = time.perf_counter() - t1
            rows.append(row)
            _write(row, args.json)
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
