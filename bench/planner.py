"""The planner on a GPU: probes, time to plan, and the plan against four hand configurations.

For each model and budget (GiB):
    * plan: ``plan_workload`` as ``memadvisor plan`` runs it (profile on the card, Optuna on
      the estimate, bracketed OOM probes and the verification, each in a fresh process).
      Reported: device runs used (probes + timing, and verify), wall time (the profile is
      made once per model and timed apart).
    * hand: fp32 / bf16 x no / all-blocks checkpointing, each at its own largest batch,
      found by the same bracketed probing in fresh processes (the same margin rule as the
      plan: a hand-tuner who kept no margin would not be comparable).
    * throughput: the plan's pick and each hand configuration run ``--timing-steps`` steps,
      each in a fresh process (the first step excluded); samples/s.
    * long run: the pick trains ``--long-steps`` (200) steps in a fresh process; OOMs counted.

Prints one table; ``--json PATH`` appends one JSON line per (model, budget) as it goes, so a
run cut short keeps what it measured. Needs torchvision and transformers for their models
(a model whose package is missing is reported and skipped).

    python bench/planner.py --models gpt,cnn --budgets 4          # a few minutes on an H100
    python bench/planner.py --models resnet18 --budgets 4,8,16
    python bench/planner.py                                       # everything: over an hour

Models: gpt, cnn, llama (examples/); resnet18, convnext_tiny (torchvision); bert
(transformers BertForMaskedLM, bert-base config); llama_small (transformers LlamaForCausalLM,
a small config). All built from configs, no downloads.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
GIB = 2**30

MODELS = {
    "gpt": f"{ROOT}/examples/gpt.py:build",
    "cnn": f"{ROOT}/examples/cnn.py:build",
    "llama": f"{ROOT}/examples/llama.py:build",
    "resnet18": f"{HERE}:resnet18",
    "convnext_tiny": f"{HERE}:convnext_tiny",
    "bert": f"{HERE}:bert",
    "llama_small": f"{HERE}:llama_small",
}
DEFAULT_MODELS = "gpt,cnn,resnet18,convnext_tiny,bert,llama_small"


# -- model factories (no downloads: built from configs) ------------------------------------


def classification_loss(logits: torch.Tensor, batch: Any) -> torch.Tensor:
    return F.cross_entropy(logits, batch[1])


def _vision(name: str, batch_size: int = 8) -> dict:
    import torchvision

    torch.manual_seed(0)
    model = getattr(torchvision.models, name)(weights=None)
    images = torch.randn(batch_size, 3, 224, 224)
    labels = torch.randint(0, 1000, (batch_size,))
    return {"model": model, "sample_batch": (images, labels), "loss_fn": classification_loss}


def resnet18() -> dict:
    return _vision("resnet18")


def convnext_tiny() -> dict:
    return _vision("convnext_tiny")


def _tokens(vocab: int, batch_size: int, seq: int) -> dict:
    ids = torch.randint(0, vocab, (batch_size, seq))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def bert(batch_size: int = 4, seq: int = 512) -> dict:
    """BertForMaskedLM with bert-base's config (12 layers, 768 wide, 30522 tokens)."""
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    model = BertForMaskedLM(BertConfig())
    return {"model": model, "sample_batch": _tokens(model.config.vocab_size, batch_size, seq)}


def llama_small(batch_size: int = 2, seq: int = 1024) -> dict:
    """LlamaForCausalLM, ~200M parameters: 8 layers, 1024 wide, 32000 tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=seq,
    )
    model = LlamaForCausalLM(config)
    return {"model": model, "sample_batch": _tokens(config.vocab_size, batch_size, seq)}


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


def _rate(device: Any, workload: Any, candidate: Any, steps: int) -> dict:
    """samples/s of ``candidate`` over ``steps`` steps in a fresh process (None if it OOMs)."""
    from memadvisor.device import is_oom

    try:
        m = device.run(workload, candidate, steps)
    except Exception as e:
        if not is_oom(e):
            raise
        return {"samples_per_s": None, "oom": str(e).splitlines()[0][:200]}
    return {
        "samples_per_s": m.samples_per_s,
        "peak_gib": m.peak_bytes / GIB,
        "reserved_gib": (m.reserved_peak_bytes or 0) / GIB,
    }


def bench_one(
    name: str, target: str, budget_gib: float, profile: Any, args: argparse.Namespace
) -> dict:
    from memadvisor.config import PlanConfig, gib_to_bytes
    from memadvisor.device.cuda import CudaDevice
    from memadvisor.estimate import Candidate
    from memadvisor.planner import measure_configuration, plan_workload
    from memadvisor.target import load_target

    workload = load_target(target)
    config = PlanConfig(budget_bytes=gib_to_bytes(budget_gib), rerank_top=args.rerank_top)
    out: dict[str, Any] = {"model": name, "budget_gib": budget_gib}

    t0 = time.perf_counter()
    plan = plan_workload(workload, config, target=target, profile=profile, progress=False)
    out["plan_s"] = time.perf_counter() - t0
    out["probes"] = sum(p.stage in ("probe", "timing") for p in plan.probes)
    out["verify_runs"] = sum(p.stage == "verify" for p in plan.probes)
    out["pick"] = plan.candidate.model_dump(mode="json")
    out["pick_label"] = _label(plan.candidate.choices, len(profile.blocks))
    out["verified"] = plan.verified.model_dump(mode="json") if plan.verified else None
    out["estimate_peak_gib"] = plan.estimate.peak_bytes / GIB
    out["notes"] = plan.notes

    device = CudaDevice(config.budget_bytes, target=target, profile=profile)
    try:
        pick = Candidate(
            batch_size=plan.candidate.batch_size,
            accumulation_steps=plan.candidate.accumulation_steps,
            choices=plan.candidate.choices,
        )
        out["plan_rate"] = _rate(device, workload, pick, args.timing_steps)
        out["hand"] = {}
        if not args.skip_hand:
            for label, choices in _hand_configurations(profile):
                t1 = time.perf_counter()
                row, runs = measure_configuration(
                    workload, config, choices, profile=profile, device=device, label=label
                )
                entry: dict[str, Any] = {
                    "batch": row.largest_batch,
                    "runs": len(runs),
                    "search_s": time.perf_counter() - t1,
                }
                if row.largest_batch:
                    entry.update(_rate(device, workload, row.candidate, args.timing_steps))
                out["hand"][label] = entry
        if args.long_steps:
            t2 = time.perf_counter()
            long = _rate(device, workload, pick, args.long_steps)
            out["long_run"] = {
                "steps": args.long_steps,
                "oom": long["samples_per_s"] is None,
                "s": time.perf_counter() - t2,
                **long,
            }
    finally:
        device.close()
    return out


def _label(choices: dict, n_blocks: int) -> str:
    precision = choices.get("precision", "fp32")
    ckpt = choices.get("checkpointing") or []
    extra = sorted(k for k in choices if k not in ("precision", "checkpointing", "batch_size"))
    text = f"{precision}, ckpt {len(ckpt)}/{n_blocks}"
    return text + (f", {'+'.join(extra)}" if extra else "")


# -- table -----------------------------------------------------------------------------------


def _fmt_rate(entry: dict | None) -> str:
    if not entry or entry.get("samples_per_s") is None:
        return "OOM" if entry and "oom" in entry else "-"
    return f"{entry['samples_per_s']:.0f}"


def print_table(rows: list[dict]) -> None:
    head = (
        f"{'model':14s} {'GiB':>4s} {'runs':>4s} {'+ver':>4s} {'plan s':>7s}  "
        f"{'pick':30s} {'batch':>7s} {'plan/s':>8s}  "
        f"{'fp32':>12s} {'fp32+ckpt':>12s} {'bf16':>12s} {'bf16+ckpt':>12s}  "
        f"{'plan/best':>9s} {'200 steps':>9s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:14s} {r.get('budget_gib', ''):>4} {r['error']}")
            continue
        pick = r["pick"]
        batch = f"{pick['batch_size']}x{pick['accumulation_steps']}"
        hand_cells, best = [], None
        for label in ("fp32", "fp32+ckpt", "bf16", "bf16+ckpt"):
            h = r["hand"].get(label)
            if h is None:
                hand_cells.append(f"{'-':>12s}")
                continue
            rate = h.get("samples_per_s")
            hand_cells.append(f"{h['batch']:>5d}@{_fmt_rate(h):>6s}")
            if rate is not None:
                best = rate if best is None else max(best, rate)
        plan_rate = r["plan_rate"].get("samples_per_s")
        ratio = f"{plan_rate / best:.2f}" if plan_rate and best else "-"
        long = r.get("long_run")
        long_text = "-" if not long else ("OOM" if long["oom"] else "ok")
        print(
            f"{r['model']:14s} {r['budget_gib']:>4g} {r['probes']:>4d} {r['verify_runs']:>4d} "
            f"{r['plan_s']:>7.1f}  {r['pick_label'][:30]:30s} {batch:>7s} "
            f"{_fmt_rate(r['plan_rate']):>8s}  {' '.join(hand_cells)}  {ratio:>9s} "
            f"{long_text:>9s}"
        )
    print(
        "\nruns: probe and timing runs of the plan (each a fresh process); +ver: verification "
        "runs. Hand cells: largest batch @ samples/s, found and measured like the plan's. "
        "plan/best: the plan's samples/s over the best hand configuration's, all measured "
        "the same way in fresh processes."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"of {sorted(MODELS)}")
    parser.add_argument("--budgets", default="4,8,16", help="GiB, comma separated")
    parser.add_argument("--timing-steps", type=int, default=10)
    parser.add_argument("--long-steps", type=int, default=200)
    parser.add_argument("--rerank-top", type=int, default=3)
    parser.add_argument("--skip-hand", action="store_true", help="only the plan and long run")
    parser.add_argument("--json", type=Path, default=None, help="append JSON lines here")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/planner.py needs a CUDA device.")

    from memadvisor.profiler import profile_workload
    from memadvisor.target import load_target

    print("torch", torch.__version__, torch.cuda.get_device_name(), flush=True)
    rows: list[dict] = []
    budgets = [float(b) for b in args.budgets.split(",")]
    for name in args.models.split(","):
        target = MODELS[name]
        try:
            t0 = time.perf_counter()
            profile = profile_workload(load_target(target), device="cuda")
            profile_s = time.perf_counter() - t0
        except Exception as e:  # noqa: BLE001 - a missing package or model: report, go on
            rows.append({"model": name, "error": f"profile failed: {type(e).__name__}: {e}"})
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
            print(json.dumps(row), flush=True)
            if args.json is not None:
                with args.json.open("a") as f:
                    f.write(json.dumps(row) + "\n")
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
