"""Best eager plan vs best compiled plan under one budget, per model: issue 9's table (GPU).

One plan per model, with compiling weighed (``PlanConfig(options={"compile": "on"})``): the
planner finds the eager pick on the card, then the compile strategy's ``refine``
(``strategies/_compile_stage.py``) measures compiled variants of it and keeps the faster.
Both sides come from that plan:

* eager: the eager pick as the device measured it (batch, samples/s, allocated and reserved
  peak) and its plan wall time: the whole plan's less the compile stage;
* compiled: each compiled variant ("default" keeps the pick's checkpointed blocks, compiled
  with the model; "budget X" replaces them with the partitioner's activation memory budget,
  tried only when the pick checkpoints), the same measurements, the plan wall time with the
  compile stage, and the one-off compile the trial timed. ``*`` marks the plan's pick; its
  verified samples/s (sustained steps) is the last column.

Eager and compiled rates are both the probes' (same steps, the first excluded), as the
planner compared them. All probes are fresh processes sharing inductor's on-disk cache; the
cache's growth is printed.

    python bench/compile_vs_eager.py --list              # models, time guesses, 9-min chunks
    python bench/compile_vs_eager.py --models gpt,cnn,resnet18 --json /tmp/cve.jsonl
    python bench/compile_vs_eager.py --models hf-llama --quick --json /tmp/cve.jsonl
    python bench/compile_vs_eager.py --models resnet18 --cache-test    # cold vs warm cache

``--json`` appends one line per event (model start with its time guess, the result rows, a
failure), flushed as it happens, so a run cut off by a time limit keeps what finished.
``--deadline-s`` (default 540) skips models whose guess would pass it and prints the
``--models`` to run next. ``--quick`` re-ranks one eager candidate, verifies 5 steps and
tries only the plain compiled variant (about half the device time).

Where compiling was not weighed, a plan comes back without a compile stage in
``plan.stages`` and the bench says so. Models, all built from configs
(no downloads), as ``bench/estimate_accuracy.py`` builds them: examples/gpt.py and
examples/cnn.py (their defaults); torchvision resnet18 and convnext_tiny; transformers
BertForMaskedLM (bert-base config, sequence 512) and a small LlamaForCausalLM (8 layers of
1024, sequence 1024); also vit_b_16 (the issue's ViT-B/16) and the llama example on request.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _recorder import Recorder  # bench/, first on sys.path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
MODELS_FILE = HERE.parent / "_models.py"  # the non-example factories, loaded by path
GIB, MIB = 2**30, 2**20

# name -> (target the probe processes rebuild the workload from, guessed seconds for one
# model on an H100/H200). The guesses: profiling 10-30 s; ~6 eager probes and a verify of
# fresh processes at 5-15 s each; then per compiled variant a trial here and two probe
# processes, each compiling for 15-60 s (the issue measured 26 s for ViT-B/16's first
# compiled step); a second variant where the pick checkpoints (the larger models at 8 GiB).
# The JSON records the real wall time: replace these after a first run.
MODELS: dict[str, tuple[str, float]] = {
    "gpt": (f"{ROOT}/examples/gpt.py:build", 150),
    "cnn": (f"{ROOT}/examples/cnn.py:build", 120),
    "resnet18": (f"{MODELS_FILE}:resnet18", 180),
    "convnext_tiny": (f"{MODELS_FILE}:convnext_tiny", 300),
    "bert-base": (f"{MODELS_FILE}:bert_base", 300),
    "hf-llama": (f"{MODELS_FILE}:hf_llama", 360),
    "vit_b_16": (f"{MODELS_FILE}:vit_b_16", 300),
    "llama": (f"{ROOT}/examples/llama.py:build", 240),
}
DEFAULT_MODELS = "gpt,cnn,resnet18,convnext_tiny,bert-base,hf-llama"
QUICK_FACTOR = 0.55  # --quick: one eager candidate, one variant, 5 verify steps


# -- one model ----------------------------------------------------------------------------------


def _strategies(args: argparse.Namespace) -> list:
    """Every registered strategy; with --quick, compile offers its plain mode alone."""
    from memadvisor.strategy import load_strategies
    from strategies.compile import Compile

    chosen = load_strategies()
    if not args.quick:
        return chosen
    return [Compile(choices=["default"]) if s.name == "compile" else s for s in chosen]


def _config(args: argparse.Namespace) -> Any:
    from memadvisor.schema.config import PlanConfig, gib_to_bytes

    return PlanConfig(
        budget_bytes=gib_to_bytes(args.budget_gb),
        device="cuda",
        options={"compile": "on"},
        rerank_top=1 if args.quick else args.rerank_top,
        verify_steps=5 if args.quick else args.verify_steps,
    )


def _what(choices: dict, blocks: int | None) -> str:
    """``'bf16 ckpt 3/12 default'``: precision, checkpointed blocks, compile choice."""
    precision = choices.get("precision") or "fp32"
    ckpt = choices.get("checkpointing") or []
    words = f"{precision} ckpt {len(ckpt)}/{blocks if blocks is not None else '?'}"
    compiled = choices.get("compile")
    if isinstance(compiled, dict):
        words += (
            f" {compiled.get('mode', 'default')} budget {compiled['activation_memory_budget']:g}"
        )
    elif compiled not in (None, "off"):
        words += f" {compiled}"
    return words


def _measured(m: Any) -> dict[str, Any]:
    if m is None:
        return {"samples_per_s": None, "peak_gib": None, "reserved_gib": None}
    return {
        "samples_per_s": m.samples_per_s,
        "peak_gib": m.peak_bytes / GIB,
        "reserved_gib": (m.reserved_peak_bytes or 0) / GIB,
    }


def _compile_stage(plan: Any) -> Any:
    """The compile strategy's measured stage in ``plan.stages``, or None."""
    return next((s for s in plan.stages if s.strategy == "compile"), None)


def rows_of(name: str, plan: Any) -> list[dict[str, Any]]:
    """The table's rows for one plan: eager, then each compiled variant."""
    outcome = _compile_stage(plan)
    blocks = len(plan.profile.blocks) if plan.profile is not None else None
    compile_s = (outcome.wall_ms if outcome is not None else 0.0) / 1e3
    plan_s = plan.plan_wall_ms / 1e3
    verified = plan.verified.samples_per_s if plan.verified is not None else None
    picked_compiled = outcome is not None and outcome.picked
    base = {"event": "row", "model": name}
    if outcome is None:
        return [
            {
                **base,
                "plan": "eager",
                "picked": True,
                "batch": plan.candidate.batch_size,
                **_measured(plan.verified),
                "plan_s": plan_s,
                "what": _what(plan.candidate.choices, blocks),
                "verified_samples_per_s": verified,
                "note": "compile was not weighed (see notes): " + " | ".join(plan.notes)[:400],
            }
        ]
    eager = outcome.eager_candidate or plan.candidate
    eager_choices = {k: v for k, v in eager.choices.items() if k != "compile"}
    rows = [
        {
            **base,
            "plan": "eager",
            "picked": not picked_compiled,
            "batch": outcome.eager_batch_size,
            **_measured(outcome.eager_measured),
            "plan_s": plan_s - compile_s,
            "what": _what(eager_choices, blocks),
            "verified_samples_per_s": None if picked_compiled else verified,
            "note": "",
        }
    ]
    picked_choices = plan.candidate.choices
    for variant in outcome.variants:
        choices = variant.choices
        is_pick = picked_compiled and choices.get("compile") == picked_choices.get("compile")
        rows.append(
            {
                **base,
                "plan": "compiled",
                "picked": is_pick,
                "batch": variant.batch_size,
                **_measured(variant.measured),
                "plan_s": plan_s,
                "compile_s": variant.one_off_ms / 1e3 if variant.one_off_ms is not None else None,
                "device_s": variant.device_wall_ms / 1e3,
                "what": _what(choices, blocks),
                "verified_samples_per_s": verified if is_pick else None,
                "note": variant.error or ("" if variant.ok else variant.trial),
            }
        )
    cache = outcome.details.get("cache")
    if isinstance(cache, dict):
        rows[-1]["cache_added_mib"] = cache["added_bytes"] / MIB
    return rows


def bench_model(name: str, args: argparse.Namespace, rec: Recorder) -> None:
    from memadvisor.planner import plan_workload
    from memadvisor.target import load_target

    target = MODELS[name][0]
    try:
        workload = load_target(target)
    except ImportError as e:
        rec.write({"event": "skipped", "model": name, "why": str(e)})
        print(f"[{name}] skipped: {e}", flush=True)
        return
    started = time.perf_counter()
    plan = plan_workload(
        workload, _config(args), target=target, progress=False, strategies=_strategies(args)
    )
    wall = time.perf_counter() - started
    for row in rows_of(name, plan):
        rec.write(row)
    stage = _compile_stage(plan)
    summary = stage.summary if stage is not None else "compile not weighed"
    rec.write({"event": "plan", "model": name, "wall_s": wall, "summary": summary})
    print(f"[{name}] {wall:.0f} s: {summary}", flush=True)
    torch.cuda.empty_cache()


# -- cold vs warm cache in fresh processes ------------------------------------------------------


def _child(target: str, choice: str) -> None:
    """A fresh process: the compiled step at the sample batch (bf16), timed, with cache hits."""
    from memadvisor.schema.candidate import Candidate
    from memadvisor.target import load_target
    from strategies.compile import try_compile

    workload = load_target(target)
    candidate = Candidate(batch_size=workload.sample_batch_size, choices={"precision": "bf16"})
    result = try_compile(workload, choice, candidate=candidate, device="cuda")
    print("RESULT " + result.model_dump_json(), flush=True)


def cache_test(name: str, rec: Recorder) -> None:
    """The same compile in two fresh processes sharing an empty cache: cold, then warm."""
    from strategies._compile_cache import shared_compile_cache

    with tempfile.TemporaryDirectory() as tmp, shared_compile_cache(tmp) as cache:
        for run in ("cold", "warm"):
            t0 = time.perf_counter()
            done = subprocess.run(
                [sys.executable, str(HERE), "--child", MODELS[name][0], "default"],
                capture_output=True,
                text=True,
                timeout=600,
            )
            wall = time.perf_counter() - t0
            line = next((s for s in done.stdout.splitlines() if s.startswith("RESULT ")), None)
            if line is None:
                print(f"[{name}] {run}: no result; stderr ends:\n{done.stderr[-2000:]}")
                continue
            r = json.loads(line[len("RESULT ") :])
            rec.write({"event": "cache", "model": name, "run": run, "process_s": wall, **r})
            print(
                f"[{name}] cache {run}: process {wall:.1f} s, first compiled step "
                f"{(r['first_step_ms'] or 0) / 1e3:.1f} s, steady {r['compiled_step_ms']} ms "
                f"(eager {r['eager_step_ms']:.1f} ms), graphs from cache {r['cache_hits']}/"
                f"{r['cache_hits'] + r['cache_misses']}",
                flush=True,
            )
        print(f"[{name}] {cache.report().note}", flush=True)


# -- table and chunks -----------------------------------------------------------------------------


def _fmt(value: Any, spec: str) -> str:
    if value is None or (isinstance(value, float) and value != value):  # None or nan
        return "-".rjust(len(format(0.0, spec)))
    return format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    header = (
        f"{'model':14s} {'plan':9s} {'batch':>6s} {'samples/s':>10s} {'vs eager':>8s} "
        f"{'peak GiB':>8s} {'rsv GiB':>7s} {'plan s':>7s} {'compile s':>9s} {'verified':>9s}  what"
    )
    print("\n" + header + "\n" + "-" * len(header))
    eager_rate: dict[str, float] = {}
    for r in rows:
        if r["plan"] == "eager" and r["samples_per_s"]:
            eager_rate[r["model"]] = r["samples_per_s"]
        base = eager_rate.get(r["model"])
        ratio = r["samples_per_s"] / base if base and r["samples_per_s"] else None
        label = r["plan"] + ("*" if r["picked"] else "")
        print(
            f"{r['model']:14s} {label:9s} {_fmt(r['batch'], '6d')} "
            f"{_fmt(r['samples_per_s'], '10.1f')} {_fmt(ratio, '7.2f')}x "
            f"{_fmt(r['peak_gib'], '8.2f')} {_fmt(r['reserved_gib'], '7.2f')} "
            f"{_fmt(r['plan_s'], '7.0f')} {_fmt(r.get('compile_s'), '9.1f')} "
            f"{_fmt(r['verified_samples_per_s'], '9.1f')}  {r['what']}"
            + (f"  [{r['note'][:160]}]" if r.get("note") else "")
            + (f"  cache +{r['cache_added_mib']:.0f} MiB" if "cache_added_mib" in r else "")
        )


def guess_s(name: str, quick: bool) -> float:
    return MODELS[name][1] * (QUICK_FACTOR if quick else 1.0)


def chunks(names: list[str], quick: bool, limit_s: float) -> list[list[str]]:
    """``names`` in order, grouped so each group's guessed time stays under ``limit_s``."""
    out: list[list[str]] = []
    total = limit_s + 1.0
    for name in names:
        s = guess_s(name, quick)
        if total + s > limit_s:
            out.append([])
            total = 0.0
        out[-1].append(name)
        total += s
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"of {', '.join(MODELS)}")
    parser.add_argument("--budget-gb", type=float, default=8.0)
    parser.add_argument("--verify-steps", type=int, default=10)
    parser.add_argument("--rerank-top", type=int, default=3, help="eager candidates timed")
    parser.add_argument("--quick", action="store_true", help="1 candidate, 1 variant, 5 steps")
    parser.add_argument("--json", type=Path, help="append one JSON line per event here")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="start no model past it")
    parser.add_argument("--list", action="store_true", help="time guesses and chunks, no GPU")
    parser.add_argument("--cache-test", action="store_true", help="cold vs warm cache instead")
    parser.add_argument("--child", nargs=2, metavar=("TARGET", "CHOICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return 0
    names = [n.strip() for n in args.models.split(",") if n.strip()]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    if args.list:
        for name in names:
            print(f"{name:14s} ~{guess_s(name, args.quick):.0f} s")
        for group in chunks(names, args.quick, args.deadline_s):
            total = sum(guess_s(n, args.quick) for n in group)
            print(f"--models {','.join(group)}   (~{total / 60:.1f} min)")
        return 0
    if not torch.cuda.is_available():
        print("This benchmark needs a CUDA device (compiled candidates are measured on it).")
        return 1
    rec = Recorder(args.json, lambda r: r.get("event") == "row", mode="a")
    started = time.perf_counter()
    try:
        if args.cache_test:
            cache_test(names[0], rec)
            return 0
        skipped: list[str] = []
        for index, name in enumerate(names):
            elapsed = time.perf_counter() - started
            guess = guess_s(name, args.quick)
            if index > 0 and elapsed + guess > args.deadline_s:  # the first always runs
                skipped.append(name)
                continue
            print(f"[{name}] starting at {elapsed:.0f} s; guessed ~{guess:.0f} s", flush=True)
            rec.write({"event": "start", "model": name, "at_s": elapsed, "guess_s": guess})
            try:
                bench_model(name, args, rec)
            except Exception as e:  # noqa: BLE001 - one model's failure must not lose the others
                text = f"{type(e).__name__}: {str(e)[:600]}"
                rec.write({"event": "error", "model": name, "error": text})
                print(f"[{name}] failed: {text}", flush=True)
        print_table(rec.rows)
        print(
            f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, budget "
            f"{args.budget_gb} GiB{', quick' if args.quick else ''}; total "
            f"{time.perf_counter() - started:.0f} s"
        )
        if skipped:
            print(f"Not started (past --deadline-s): next run --models {','.join(skipped)}")
    finally:
        rec.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
