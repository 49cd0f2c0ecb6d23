"""Where a user's loop loses to the plan's verified rate: the step's code or the run's length.

Session 17 on an H100: hf_gpt2's loop (``bench/user_path.py``, 200 steps) ran 0.873 of its
verified rate by the mean and 0.887 by the median, with nothing compiling beside it, as the
GPT example's did in sessions 12-15 (0.87-0.93). The plan's rate is the median of a probe's
19 timed steps (``memadvisor.device._train.train_candidate``: ``train_step`` with the
previous output held); the loop is the README's loop, 190 steps after warm-up. This runs
both step codes on one model in one process, the plan applied as a user applies it
(``memadvisor.apply_plan``), in rounds that alternate them, each round ``--short`` steps
(the probe's length) then ``--long`` steps (the loop's), and prints, per step code and
length, the median and mean samples/s over the plan's verified rate:

* ``train_step``: ``memadvisor.workload.train_step`` on ``model.memadvisor_step``, the
  previous output held (the probe's step);
* ``loop``: forward, the loss outside, backward, ``optimizer.step()``, ``zero_grad`` (the
  README's loop, as ``bench/user_path.py`` runs it).

If both codes read alike here, the gap is not the step's code but the process or the run
(a fresh probe process, the GPU's state); if ``train_step`` reads the verified rate and
``loop`` does not, it is the code.

    python bench/loop_gap.py --models hf_gpt2 --plan bench/results/plans   # on a card
    python bench/loop_gap.py --models cnn --budget-gib 0.05 --short 2 --long 3 --rounds 1 \\
        --json /tmp/g.jsonl                                                # CPU smoke

Without ``--plan`` the model is planned here first (on the CPU: the simulated card).
JSON lines (``--json``, default ``bench/results/loop_gap.jsonl``): model, device, batch,
verified_samples_per_s, and per (code, length) ``median_over_verified``,
``mean_over_verified``, ``samples_per_s_median``, ``samples_per_s_mean``, ``steps``.

Known limitations: one process; the probe's own fresh process (the fork server, a clean
allocator) is not reproduced here: that is the comparison's other half (``user_path``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from _targets import TARGETS, missing  # bench/, first on sys.path when run as a script
from user_path import loop_step

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results" / "loop_gap.jsonl"
CODES = ("train_step", "loop")


def _plan_for(name: str, job: dict[str, Any], args: argparse.Namespace) -> Any:
    import memadvisor

    if args.plan is None:
        return memadvisor.plan(
            job["model"], job["sample_batch"], loss_fn=job.get("loss_fn"),
            budget_gb=args.budget_gib, progress=False,
        )  # fmt: skip
    path = Path(args.plan)
    path = path / f"{name}.json" if path.is_dir() else path
    return memadvisor.Plan.load(path)


def measure(name: str, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    import memadvisor
    from memadvisor.target import load_factory
    from memadvisor.workload import Workload, train_step

    job = dict(load_factory(TARGETS[name])())
    plan = _plan_for(name, job, args)
    fresh = dict(load_factory(TARGETS[name])())  # an unplanned copy: the plan's copies ran
    workload = Workload(
        model=fresh["model"], sample_batch=fresh["sample_batch"], loss_fn=fresh.get("loss_fn")
    )
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if cuda:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, plan.config.budget_bytes / total))
    model = memadvisor.apply_plan(workload.model, plan, loss_fn=fresh.get("loss_fn"))
    model = model.to(device)
    step = model.memadvisor_step
    optimizer = torch.optim.AdamW(model.parameters())
    cand = plan.candidate
    batch = workload.batch(cand.batch_size, device)
    k = cand.accumulation_steps

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    held: list[Any] = []

    def probe_step() -> None:
        train_step(step, model, optimizer, batch, accumulation_steps=k, held=held)

    # The user's loop as bench/user_path.py runs it (the plan's step where it changed the
    # loss; fp16's GradScaler).
    precision = cand.choices.get("precision", "fp32")
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    own = step if step.loss_changed_by else None

    def users_step() -> None:
        # The probe's held output is the probe's alone: kept into the loop's steps it ran
        # hf_gpt2's loop out of its budget (1.22 GiB of logits, H100, session 18).
        held.clear()
        loop_step(workload, model, optimizer, batch, k, step=own, scaler=scaler)

    codes = {"train_step": probe_step, "loop": users_step}
    for code in CODES:  # the first steps compile and warm up: in no figure
        for _ in range(args.warmup):
            codes[code]()
        sync()
    times: dict[tuple[str, str], list[float]] = {}
    for _ in range(args.rounds):
        for length, n in (("short", args.short), ("long", args.long)):
            for code in CODES:
                for _ in range(n):
                    sync()
                    t0 = time.perf_counter()
                    codes[code]()
                    sync()
                    times.setdefault((code, length), []).append(time.perf_counter() - t0)
            print(f"  {name}: a round of {length} runs done", flush=True)
    verified = plan.verified.samples_per_s if plan.verified is not None else None
    samples = cand.batch_size * k
    row: dict[str, Any] = {
        "model": name,
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "batch": cand.batch_size,
        "accumulation_steps": k,
        "pick": {n: c for n, c in cand.choices.items() if n != "checkpointing"},
        "verified_samples_per_s": verified,
        "rounds": args.rounds,
    }
    for (code, length), ts in times.items():
        median = samples / statistics.median(ts)
        mean = samples * len(ts) / sum(ts)
        row[f"{code}_{length}"] = {
            "steps": len(ts),
            "samples_per_s_median": round(median, 2),
            "samples_per_s_mean": round(mean, 2),
            "median_over_verified": round(median / verified, 4) if verified else None,
            "mean_over_verified": round(mean / verified, 4) if verified else None,
        }
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="hf_gpt2", help="comma-separated bench targets")
    parser.add_argument("--plan", default=None, help="a plan file, or a folder of <model>.json")
    parser.add_argument("--budget-gib", type=float, default=8.0, help="without --plan")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--short", type=int, default=19, help="the probe's timed steps")
    parser.add_argument("--long", type=int, default=190, help="the loop's timed steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=Path, default=RESULTS)
    args = parser.parse_args()
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        why = missing(name)
        if why is not None:
            print(why)
            continue
        row = measure(name, args)
        rows.append(row)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("a") as f:
            f.write(json.dumps(row) + "\n")
    print(f"\n{'model':10} {'code':11} {'length':6} {'steps':>5} {'median/s':>10} "
          f"{'mean/s':>10} {'med/ver':>7} {'mean/ver':>8}")  # fmt: skip
    for row in rows:
        for code in CODES:
            for length in ("short", "long"):
                r = row[f"{code}_{length}"]
                print(
                    f"{row['model']:10} {code:11} {length:6} {r['steps']:>5} "
                    f"{r['samples_per_s_median']:>10.1f} {r['samples_per_s_mean']:>10.1f} "
                    f"{r['median_over_verified'] or 0:>7.3f} {r['mean_over_verified'] or 0:>8.3f}"
                )
    if not rows:
        sys.exit("no model measured")


if __name__ == "__main__":
    main()
