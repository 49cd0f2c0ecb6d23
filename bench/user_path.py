"""The user's own path on a GPU: memadvisor.plan() with a lambda loss, then their loop.

For each model, at ``--budget-gib`` (default 8), one JSON line as soon as it is done (stdout,
and appended to ``--json``, default ``bench/results/user_path.jsonl``), then the table:

* plan: ``memadvisor.plan(model, sample_batch, loss_fn=lambda out, b: ..., budget_gb=...)``
  in this process, exactly as a user calls it (the loss a lambda, so the probes reach fresh
  processes only through cloudpickle). Reported: wall time, the pick, its verified samples/s,
  where the probes ran (``probe_mode``), and whether compile was weighed.
* user loop: a fresh process builds the model, ``memadvisor.apply_plan(model, plan)``, caps
  the card at the budget and trains ``--steps`` (200) steps at the plan's batch and
  accumulation with its own AdamW and the loss outside the model, as the README shows;
  samples/s over the steps after ``--warmup`` (10), OOMs counted.
* torch.compile: the same loop in a fresh process with ``torch.compile(model)`` under an
  outer autocast of the plan's precision, at the same batch. The two alternate
  ``--repeats`` (2) times; each figure is the median of its runs (OOMs: the sum).
* hand: fp32 / bf16 x no / all-blocks checkpointing, eager and (``--hand all``) compiled,
  each at its own largest batch found as the plan's is (``measure_configuration``); the
  best one's samples/s.
* largest holding: the largest batch of the pick's choices that holds ``verify_steps`` (20)
  steps in a fresh process, found by running out of memory (extrapolated along the measured
  allocated bytes per sample to the budget, then bisected below the lowest failure), and
  batch / that.

    python bench/user_path.py --models cnn,gpt                        # ~5 min each on an H200
    python bench/user_path.py --models vit_b_16 --hand eager          # fewer device runs
    python bench/user_path.py --table bench/results/user_path.jsonl   # the table again
    python bench/user_path.py --device simulated --models cnn --budget-gib 0.25 \\
        --steps 6 --warmup 2 --compile-backend eager --hand eager --json /tmp/u.jsonl  # CPU

Models: gpt, cnn, llama (examples/); resnet18, resnet50, convnext_tiny, vit_b_16
(torchvision); gpt2 (124M), bert, llama_small (transformers). A model whose package is
missing is a row with its error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _targets import TARGETS  # bench/, first on sys.path when run as a script

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
GIB = 2**30
RESULTS = HERE.parent / "results" / "user_path.jsonl"
MODELS = dict(TARGETS)
DEFAULT_MODELS = "gpt,cnn,llama,resnet18,resnet50,convnext_tiny,vit_b_16,gpt2,bert,llama_small"
HAND = ("fp32", "fp32+ckpt", "bf16", "bf16+ckpt")


def _job(name: str) -> dict[str, Any]:
    """The model's factory dict, its loss turned into a lambda as a user writes it."""
    from memadvisor.target import load_factory

    job = dict(load_factory(MODELS[name])())
    loss = job.get("loss_fn")
    if loss is not None:
        job["loss_fn"] = lambda out, batch: loss(out, batch)  # a closure: no name to pickle
    return job


# -- the user's loop, in a fresh process --------------------------------------------------------


def user_loop(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["mode"]``: ``apply`` (apply_plan) or ``torch_compile`` (plain torch.compile
    under an outer autocast); trains ``spec["steps"]`` steps at the plan's batch."""
    import torch

    import memadvisor
    from memadvisor.errors import is_oom
    from memadvisor.workload import Workload

    plan = memadvisor.Plan.model_validate_json(Path(spec["plan"]).read_text())
    job = _job(spec["model"])
    workload = Workload(
        model=job["model"], sample_batch=job["sample_batch"], loss_fn=job.get("loss_fn")
    )
    cuda = spec["device"] == "cuda"
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, spec["budget_bytes"] / total))
    cand = plan.candidate
    precision = cand.choices.get("precision", "fp32")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(str(precision))
    model = workload.model
    if spec["mode"] == "apply":
        model = memadvisor.apply_plan(model, plan).to(device)
        outer = None
    else:
        model = torch.compile(model.to(device), backend=spec["compile_backend"])
        outer = dtype
    optimizer = torch.optim.AdamW(model.parameters())
    scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
    batch = workload.batch(cand.batch_size, device)
    k = cand.accumulation_steps
    times: list[float] = []
    out: dict[str, Any] = {"ooms": 0, "steps": 0}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    try:
        for _ in range(spec["steps"]):
            sync()
            t0 = time.perf_counter()
            for _ in range(k):
                around = (
                    torch.autocast(device.type, dtype=outer)
                    if outer is not None
                    else contextlib.nullcontext()
                )
                with around:
                    output = workload.forward(model, batch)
                    if outer is not None:  # plain torch.compile: the loss under the autocast
                        loss = workload.loss(output, batch) / k
                if outer is None:  # apply_plan: the loss outside, on the logits as they come
                    loss = workload.loss(output, batch) / k
                (scaler.scale(loss) if scaler else loss).backward()
                del output, loss
            if scaler is not None:
                scaler.step(optimizer)
                scaler.update()
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            sync()
            times.append(time.perf_counter() - t0)
            out["steps"] += 1
    except Exception as e:  # noqa: BLE001 - an OOM is the answer; anything else is reported
        if not is_oom(e):
            raise
        out["ooms"] = 1
        out["error"] = str(e).splitlines()[0][:200] if str(e) else "OOM"
    steady = times[spec["warmup"] :]
    if steady:
        out["samples_per_s"] = cand.batch_size * k * len(steady) / sum(steady)
    out["first_step_s"] = times[0] if times else None
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_reserved() / GIB
    return out


def _fresh(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        done = subprocess.run(
            [sys.executable, str(HERE), "--user-loop", f.name],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    finally:
        os.unlink(f.name)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("USER_LOOP ")]
    if not lines:
        return {"error": done.stderr[-800:]}
    return json.loads(lines[-1].removeprefix("USER_LOOP "))


# -- one model ----------------------------------------------------------------------------------


def _device(kind: str, budget_bytes: int, name: str, profile: Any) -> Any:
    if kind == "simulated":
        from memadvisor.device.simulated import SimulatedDevice

        return SimulatedDevice(budget_bytes, profile=profile)
    from memadvisor.device.cuda import CudaDevice

    return CudaDevice(budget_bytes, target=MODELS[name], profile=profile, fork_server=True)


def _hand(plan: Any, name: str, args: argparse.Namespace, device: Any) -> dict[str, Any]:
    """fp32 / bf16 x no / all checkpointing (and compiled, with ``--hand all``), each at its
    own largest batch, measured as the plan's pick is."""
    from memadvisor.planner import measure_configuration
    from memadvisor.schema.config import PlanConfig
    from memadvisor.workload import Workload

    job = _job(name)
    workload = Workload(
        model=job["model"], sample_batch=job["sample_batch"], loss_fn=job.get("loss_fn")
    )
    blocks = [b.name for b in plan.profile.blocks]
    configs = {
        "fp32": {},
        "fp32+ckpt": {"checkpointing": blocks} if blocks else None,
        "bf16": {"precision": "bf16"},
        "bf16+ckpt": {"precision": "bf16", "checkpointing": blocks} if blocks else None,
    }
    if args.hand == "all":
        configs.update(
            {
                f"{k}+compile": {**v, "compile": "default"}
                for k, v in list(configs.items())
                if v is not None
            }
        )
    config = PlanConfig(budget_bytes=plan.config.budget_bytes)
    out: dict[str, Any] = {}
    for label, choices in configs.items():
        if choices is None:
            continue
        try:
            row, _ = measure_configuration(
                workload, config, choices, profile=plan.profile, device=device, label=label
            )
        except Exception as e:  # noqa: BLE001 - one row failing is a cell, not a crash
            out[label] = {"error": f"{type(e).__name__}: {str(e)[:160]}"}
            continue
        out[label] = {
            "batch": row.largest_batch or 0,
            "samples_per_s": row.measured.samples_per_s if row.measured else None,
        }
    return out


def _largest_holding(plan: Any, name: str, args: argparse.Namespace, device: Any) -> int | None:
    """The largest batch of the pick's choices that holds verify_steps steps from a clean
    state, found by running out of memory: from the pick, extrapolate along the measured
    allocated bytes per sample to where they fill the budget, then bisect below the lowest
    batch that ran out (the planner's batch search with no headroom at all)."""
    import math

    from memadvisor.errors import is_oom
    from memadvisor.planner import find_batch
    from memadvisor.schema.candidate import Candidate
    from memadvisor.workload import Workload

    job = _job(name)
    workload = Workload(
        model=job["model"], sample_batch=job["sample_batch"], loss_fn=job.get("loss_fn")
    )
    choices = {k: v for k, v in plan.candidate.choices.items() if k != "batch_size"}
    steps = plan.config.verify_steps
    budget = plan.config.budget_bytes
    peaks: dict[int, int] = {}

    def fits(batch: int) -> bool:
        _say(f"holding: batch {batch}")
        try:
            m = device.run(workload, Candidate(batch_size=batch, choices=choices), steps)
        except Exception as e:
            if not is_oom(e):
                raise
            return False
        peaks[batch] = m.peak_bytes
        return True

    def extrapolate(batch: int) -> int | None:
        if batch not in peaks:
            return None
        fitted = sorted(peaks)
        if len(fitted) >= 2:
            slope = (peaks[fitted[-1]] - peaks[fitted[-2]]) / (fitted[-1] - fitted[-2])
        else:
            slope = peaks[batch] / batch  # weights included: a slope too steep, short of it
        if slope <= 0:
            return None
        return batch + max(1, math.ceil((budget - peaks[batch]) / slope))

    start = plan.candidate.batch_size
    found = find_batch(
        fits,
        start,
        start + 1,
        0.0,
        plan.config.max_batch,
        extrapolate=extrapolate,
        below=lambda failed: failed - 1,
        max_extrapolations=4,
        descend=True,
    )
    row_tried = ", ".join(f"{b}{'' if ok else ' OOM'}" for b, ok in found.tried)
    _say(f"holding search ({name}): {row_tried} -> {found.batch}")
    return found.batch or None


def bench_one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import memadvisor

    budget_bytes = round(args.budget_gib * GIB)
    row: dict[str, Any] = {"model": name, "budget_gib": args.budget_gib}
    row["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "simulated"
    job = _job(name)
    t0 = time.perf_counter()
    if args.plan is not None:
        plan = memadvisor.Plan.model_validate_json(args.plan.read_text())
        row["plan_wall_s"] = sum(plan.stage_wall_ms.values()) / 1e3 if plan.stage_wall_ms else None
        row["plan_from"] = str(args.plan)
    else:
        _say(f"{name}: planning")
        plan = memadvisor.plan(
            job["model"],
            job["sample_batch"],
            loss_fn=job.get("loss_fn"),
            budget_gb=args.budget_gib,
            device=args.device,
            progress=False,
            measure_comparison=False,
        )
        row["plan_wall_s"] = time.perf_counter() - t0
        if args.save_plan is not None:
            args.save_plan.write_text(plan.model_dump_json())
    _say(f"{name}: plan {row['plan_wall_s']} s, batch {plan.candidate.batch_size}")
    cand = plan.candidate
    row["pick"] = {k: v for k, v in cand.choices.items() if k != "batch_size"}
    row["batch"] = cand.batch_size
    row["accumulation_steps"] = cand.accumulation_steps
    row["verified_samples_per_s"] = plan.verified.samples_per_s if plan.verified else None
    row["verified_peak_gib"] = plan.verified.limit_bytes / GIB if plan.verified else None
    row["compile_weighed"] = any(stage.strategy == "compile" for stage in plan.stages)
    in_process = [n for n in plan.notes if n.startswith("Probes ran in this process")]
    row["probe_mode"] = (
        "simulated" if args.device == "simulated" else ("in_process" if in_process else "fresh")
    )
    row["notes"] = plan.notes
    with tempfile.NamedTemporaryFile("w", suffix=".plan.json", delete=False) as f:
        f.write(plan.model_dump_json())
    spec = {
        "model": name,
        "plan": f.name,
        "device": args.device,
        "budget_bytes": budget_bytes,
        "steps": args.steps,
        "warmup": args.warmup,
        "compile_backend": args.compile_backend,
    }
    users: list[dict[str, Any]] = []
    plains: list[dict[str, Any]] = []
    try:
        # Interleaved (apply, compile, apply, compile, ...): the host's noise between fresh
        # processes is as large as the gap being measured (docs/design.md).
        for _ in range(args.repeats if args.loops else 0):
            users.append(_fresh({**spec, "mode": "apply"}, args.timeout_s))
            _say(f"{name}: user loop {users[-1].get('samples_per_s')}")
            plains.append(_fresh({**spec, "mode": "torch_compile"}, args.timeout_s))
            _say(f"{name}: torch.compile {plains[-1].get('samples_per_s')}")
    finally:
        os.unlink(f.name)
    row["user_loop"] = users
    row["user_loop_samples_per_s"] = _median([u.get("samples_per_s") for u in users])
    row["user_loop_ooms"] = sum(int(u.get("ooms") or 0) for u in users) if users else None
    row["torch_compile"] = plains
    row["torch_compile_samples_per_s"] = _median([p.get("samples_per_s") for p in plains])
    device = _device(args.device, budget_bytes, name, plan.profile)
    try:
        _say(f"{name}: hand configurations ({args.hand})")
        row["hand"] = {} if args.hand == "none" else _hand(plan, name, args, device)
        row["largest_batch_holding"] = (
            _largest_holding(plan, name, args, device) if args.holding else None
        )
    finally:
        device.close()
    rates = [h["samples_per_s"] for h in row["hand"].values() if h.get("samples_per_s")]
    row["best_hand_samples_per_s"] = max(rates) if rates else None
    holding = row["largest_batch_holding"]
    row["batch_over_holding"] = cand.batch_size / holding if holding else None
    return row


def _say(text: str) -> None:
    """A timestamped progress line on stderr: a run cut off by a time limit still says where."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _median(values: list[float | None]) -> float | None:
    import statistics

    seen = [v for v in values if v is not None]
    return statistics.median(seen) if seen else None


# -- table ---------------------------------------------------------------------------------------


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _ratio(a: float | None, b: float | None) -> str:
    return "-" if not a or not b else f"{a / b:.2f}"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'model':13s} {'GiB':>4s} {'plan s':>6s} {'pick':26s} {'batch':>7s} {'hold':>5s} "
        f"{'b/hold':>6s} {'verified':>8s} {'loop':>7s} {'OOM':>3s} {'compile':>7s} "
        f"{'loop/cmp':>8s} {'best hand':>9s} {'loop/hand':>9s} {'probes':>8s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:13s} {r.get('budget_gib', '')!s:>4} {r['error'][:150]}")
            continue
        pick = (
            ", ".join(
                f"{k}={v if not isinstance(v, list) else f'{len(v)} blocks'}"
                for k, v in r["pick"].items()
            )
            or "plain"
        )
        batch = f"{r['batch']}x{r['accumulation_steps']}"
        hold = r.get("largest_batch_holding")
        share = r.get("batch_over_holding")
        share_text = f"{share:.2f}" if share else "-"
        print(
            f"{r['model']:13s} {r['budget_gib']:>4g} {r['plan_wall_s']:>6.0f} {pick[:26]:26s} "
            f"{batch:>7s} {hold if hold else '-':>5} "
            f"{share_text:>6s} "
            f"{_rate(r['verified_samples_per_s']):>8s} {_rate(r['user_loop_samples_per_s']):>7s} "
            f"{r['user_loop_ooms'] if r['user_loop_ooms'] is not None else '-'!s:>3} "
            f"{_rate(r['torch_compile_samples_per_s']):>7s} "
            f"{_ratio(r['user_loop_samples_per_s'], r['torch_compile_samples_per_s']):>8s} "
            f"{_rate(r['best_hand_samples_per_s']):>9s} "
            f"{_ratio(r['user_loop_samples_per_s'], r['best_hand_samples_per_s']):>9s} "
            f"{r['probe_mode']:>8s}"
        )
    print(
        "\nloop: the user's loop with apply_plan() in a fresh process, samples/s after warm-up; "
        "compile: plain torch.compile(model) under an outer autocast at the same batch; hold: "
        "the largest batch of the pick's choices holding verify_steps steps from a clean "
        "state; best hand: fp32/bf16 x no/all checkpointing (eager, and compiled with --hand "
        "all), each at its own largest batch; probes: where the plan's probes ran."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=DEFAULT_MODELS, help=f"of {sorted(MODELS)}")
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=200, help="steps of the user's loop")
    parser.add_argument("--warmup", type=int, default=10, help="steps not timed (compile)")
    parser.add_argument("--hand", choices=("all", "eager", "none"), default="all")
    parser.add_argument("--no-holding", dest="holding", action="store_false")
    parser.add_argument("--no-loops", dest="loops", action="store_false")
    parser.add_argument("--save-plan", type=Path, default=None, help="write the plan here")
    parser.add_argument("--plan", type=Path, default=None, help="a saved plan: no planning")
    parser.add_argument(
        "--repeats", type=int, default=2, help="user loop / torch.compile pairs, interleaved"
    )
    parser.add_argument("--compile-backend", default="inductor", help="eager for a CPU smoke")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per fresh process")
    parser.add_argument("--json", type=Path, default=RESULTS, help="append JSON lines here")
    parser.add_argument("--table", type=Path, default=None, help="print a --json file's table")
    parser.add_argument("--device", choices=("cuda", "simulated"), default="cuda")
    parser.add_argument("--user-loop", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.user_loop is not None:
        result = user_loop(json.loads(args.user_loop.read_text()))
        print("USER_LOOP " + json.dumps(result), flush=True)
        return
    if args.table is not None:
        print_table([json.loads(ln) for ln in args.table.read_text().splitlines() if ln])
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/user_path.py needs a CUDA device (or --device simulated for a smoke run).")
    print("torch", torch.__version__, flush=True)
    rows = []
    for name in args.models.split(","):
        t0 = time.perf_counter()
        try:
            row = bench_one(name, args)
        except Exception as e:  # noqa: BLE001 - a missing package or an infeasible budget
            row = {
                "model": name,
                "budget_gib": args.budget_gib,
                "error": f"{type(e).__name__}: {e}",
            }
        row["total_s"] = time.perf_counter() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
