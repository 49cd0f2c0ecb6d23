"""Is a fresh process's rate of one pick set by the CPU cores it lands on? The user's loop of a
saved plan, run again and again in fresh processes, each bound to the card's NUMA node, to
another node, or left to the scheduler, in turn.

Why: the same pick (the GPT example: bf16, 2 of 4 blocks checkpointed, compile, batch 307)
ran 23,718 to 33,770 samples/s in fresh processes minutes apart on one host (session 27,
H200: loops and 200-step reruns), and 20,395 and 28,665 in session 24, while each
process's own steps hold steady (its quarters within a few percent). A 12 ms step launches
its kernels from one Python thread: if the core that thread lands on is on the socket far
from the card, or shares a core with another process's work, every step pays for it, and a
plan's verified rate is one such draw (docs/design.md, "The user's loop against its pick
run again"). Inductor's autotuning winners differ from process to process too, but runs
made at once measured as fast as runs alone (``bench/autotune_contention.py``, session 27).

Placements, interleaved (near, far, any, near, ...), ``--repeats`` of each:

* ``near``: the process (and every process it starts) on the cores of the card's NUMA node;
* ``far``: on another node's cores (where the host has one node: its other half of cores);
* ``any``: no binding (a user's default); the line says which core the loop ran on last
  and whose node that is.

``--rounds R`` runs R loops in each process, one after the other, each with a new model,
optimizer and batch: a rate that holds over a process's rounds and moves between processes
is set at the process's start (its hashes, its context, its cores), one that moves between
rounds by what each build allocates or by the time. Each round's line carries the card's
clocks, power and temperature after it (nvidia-smi). ``--env PYTHONHASHSEED=0`` gives every
process the same hashes. (Session 27 call C: bound or not, 25,263-30,154 samples/s.)

Every loop says the host's share of its step (``queue_over_step``: the time until
``loop_step`` returns, before the sync, over the step's), and with ``--profile-steps N`` the
card's kernel time over the step from N more steps under the profiler
(``card_busy_over_step``) and its kernels a step (``kernels_per_step``); the host's time
splits into forward and loss, backward, and the optimizer
(``host_ms_forward_backward_optimizer``, medians). Session 28 call 5: 0.994 and 0.62-0.75,
the card waits on the host, so the host's speed is the rate. The remedies are run as
variants of the same pick, on a copy of the plan: ``--fused-optimizer`` (AdamW's update in a
few fused kernels, the optimizer_habits advice), ``--compile-mode reduce-overhead`` (CUDA
graphs: the step's kernels replayed with one launch), and ``--batch N`` (the pick at another
batch).

One JSON line a run (``--json``), then a table of each placement's median and range.

    python bench/process_spread.py --model gpt --plan bench/results/plans --repeats 4 \\
        --json $OUT/spread.jsonl
    python bench/process_spread.py --device simulated --model cnn --plan /tmp/p \\
        --budget-gib 0.05 --steps 3 --warmup 1 --repeats 1 --json /tmp/s.jsonl   # CPU smoke

Known limitations:
    * Linux only (``os.sched_setaffinity``, ``/sys/devices/system/node``).
    * The card's node is read from ``/sys/bus/pci/devices/<bus id>/numa_node`` (the bus id
      from ``nvidia-smi``); where that says -1 or cannot be read, node 0 is taken as near.
    * Binding moves the process, not its memory: pages the loop touched before it was bound
      do not exist (it is bound from its start), but the card's pinned buffers are the
      driver's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _recorder import Recorder
from user_path import GIB, _fresh, card_query

PLACEMENTS = ("near", "far", "any")


def _cpulist(text: str) -> set[int]:
    """``0-3,8,10-11`` as a set of core numbers."""
    cores: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cores.update(range(int(lo), int(hi or lo) + 1))
    return cores


def nodes(root: Path = Path("/sys/devices/system/node")) -> dict[int, set[int]]:
    """Each NUMA node's cores this process may use ({0: every core} where none is listed)."""
    allowed = os.sched_getaffinity(0)
    out: dict[int, set[int]] = {}
    for path in sorted(root.glob("node[0-9]*")):
        try:
            cores = _cpulist((path / "cpulist").read_text()) & allowed
        except OSError:
            continue
        if cores:
            out[int(path.name.removeprefix("node"))] = cores
    return out or {0: set(allowed)}


def card_node() -> int | None:
    """The NUMA node of the card ``CUDA_VISIBLE_DEVICES`` names first (its index), by its PCI
    bus id from nvidia-smi; None where that cannot be read."""
    bus = (card_query(("pci.bus_id",)) or {}).get("pci.bus_id", "")
    # nvidia-smi writes 00000000:19:00.0; sysfs names it 0000:19:00.0.
    domain, _, rest = bus.partition(":")
    try:
        path = Path("/sys/bus/pci/devices") / f"{domain[-4:]}:{rest}".lower() / "numa_node"
        node = int(path.read_text())
    except (OSError, ValueError):
        return None
    return node if node >= 0 else None


def placements(found: dict[int, set[int]], near_node: int | None) -> dict[str, Any]:
    """The cores of each placement (``any``: None) and the nodes they are."""
    near_node = near_node if near_node in found else min(found)
    others = [n for n in found if n != near_node]
    if others:
        near, far, far_node = found[near_node], found[others[0]], others[0]
    else:  # one node: its two halves stand for near and far
        ordered = sorted(found[near_node])
        half = max(1, len(ordered) // 2)
        near, far, far_node = set(ordered[:half]), set(ordered[half:]) or set(ordered), None
    return {
        "near": near,
        "far": far,
        "any": None,
        "near_node": near_node,
        "far_node": far_node,
    }


def plan_variant(text: str, batch: int | None, compile_mode: str | None) -> str | None:
    """The saved plan ``text`` at ``batch`` and with ``compile_mode`` as its compile choice's
    mode (each where given); None where neither is. Why: the same pick at another batch (the
    hand grid's edge) or under CUDA graphs, with nothing else of the plan changed. A plan
    that does not compile has no mode to change: ValueError."""
    if batch is None and compile_mode is None:
        return None
    plan = json.loads(text)
    candidate = plan["candidate"]
    if batch is not None:
        candidate["batch_size"] = batch
    if compile_mode is not None:
        choice = candidate["choices"].get("compile")
        if choice in (None, "off", False):
            raise ValueError(f"its compile choice is {choice!r}: no mode to set")
        if isinstance(choice, dict):
            candidate["choices"]["compile"] = {**choice, "mode": compile_mode}
        else:
            candidate["choices"]["compile"] = compile_mode
    return json.dumps(plan)


def node_of(cpu: int | None, found: dict[int, set[int]]) -> int | None:
    return next((n for n, cores in found.items() if cpu in cores), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt")
    parser.add_argument("--plan", type=Path, required=True, help="FILE, or DIR/<model>.json")
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=4, help="runs of each placement")
    parser.add_argument(
        "--placements",
        default=",".join(PLACEMENTS),
        help=f"which, in this order each repeat (of {', '.join(PLACEMENTS)})",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="loops a process, each with a new model, optimizer and batch (rate set at the "
        "process's start, or by each build?)",
    )
    parser.add_argument(
        "--env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="set in every loop's environment (PYTHONHASHSEED=0: the same hashes each process)",
    )
    parser.add_argument(
        "--batch", type=int, help="run the plan at this batch instead of its own (a copy)"
    )
    parser.add_argument(
        "--compile-mode",
        help="run the plan with this torch.compile mode (reduce-overhead: CUDA graphs) in "
        "place of its compile choice's (a copy); the plan must compile",
    )
    parser.add_argument(
        "--fused-optimizer",
        action="store_true",
        help="the loop's AdamW with fused=True (the optimizer_habits advice)",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=0,
        help="after each loop, N more steps under the profiler: the card's kernel time a step "
        "against the step's time (does the card wait on the host?)",
    )
    parser.add_argument("--device", default="cuda", choices=["cuda", "simulated"])
    parser.add_argument("--timeout-s", type=float, default=120.0, help="one run's limit")
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path, help="append one JSON line per run here")
    args = parser.parse_args(argv)

    for item in args.env:
        name, sep, value = item.partition("=")
        if not sep or not name:
            parser.error(f"--env {item!r}: write NAME=VALUE")
        os.environ[name] = value  # the loops' processes inherit it
    chosen = [p for p in args.placements.split(",") if p]
    if not chosen or set(chosen) - set(PLACEMENTS):
        parser.error(f"--placements {args.placements!r}: name some of {', '.join(PLACEMENTS)}")
    plan_path = args.plan / f"{args.model}.json" if args.plan.is_dir() else args.plan
    if not plan_path.is_file():
        parser.error(f"--plan {args.plan}: no plan {plan_path}; save one with plan_speed.py")
    if args.batch is not None and args.batch < 1:
        parser.error(f"--batch {args.batch}: give a batch of at least 1")
    try:
        variant = plan_variant(plan_path.read_text(), args.batch, args.compile_mode)
    except ValueError as e:
        parser.error(f"--plan {plan_path}: {e}")
    found = nodes()
    near_node = card_node() if args.device == "cuda" else None
    where = placements(found, near_node)
    far = "the other half" if where["far_node"] is None else f"node {where['far_node']}"
    listed = ", ".join(f"{n}: {len(c)} cores" for n, c in found.items())
    print(
        f"nodes {{{listed}}}; the card's node {near_node}; near = node {where['near_node']}, "
        f"far = {far}",
        flush=True,
    )
    workdir = tempfile.TemporaryDirectory(prefix="process-spread-")
    if variant is not None:  # the plan as the flags change it, a copy: the file stays
        plan_path = Path(workdir.name) / f"{args.model}.json"
        plan_path.write_text(variant)
    spec = {
        "model": args.model,
        "plan": str(plan_path.resolve()),
        "device": args.device,
        "budget_bytes": round(args.budget_gib * GIB),
        "steps": args.steps,
        "warmup": args.warmup,
        "compile_backend": "inductor",
        "mode": "apply",
        "rounds": args.rounds,
        "profile_steps": args.profile_steps,
        "fused_optimizer": args.fused_optimizer,
    }
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(args.json, lambda _: True, mode="a")  # appends: calls add up
    rows = recorder.rows
    # One cache for every run (the plan's may be gone): the first run compiles, the others
    # read it, as a user's second run does.
    with workdir as cache:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache) / "inductor"))
        os.environ.setdefault("TRITON_CACHE_DIR", str(Path(cache) / "triton"))
        for i in range(args.repeats):
            for placement in chosen:
                cpus = where[placement]
                t0 = time.perf_counter()
                out = _fresh(spec, args.timeout_s, cpus)
                row = {
                    "bench": "process_spread",
                    "model": args.model,
                    "placement": placement,
                    "repeat": i,
                    "cores": sorted(cpus) if cpus is not None else None,
                    "cpu": out.get("cpu"),
                    "cpu_node": node_of(out.get("cpu"), found),
                    "card_node": near_node,
                    "samples_per_s": out.get("samples_per_s"),
                    "samples_per_s_median": out.get("samples_per_s_median"),
                    "step_ms_p10_p50_p90": out.get("step_ms_p10_p50_p90"),
                    "first_step_s": out.get("first_step_s"),
                    "queue_ms_p50": out.get("queue_ms_p50"),
                    "queue_over_step": out.get("queue_over_step"),
                    "card_busy_ms_per_step": out.get("card_busy_ms_per_step"),
                    "card_busy_over_step": out.get("card_busy_over_step"),
                    "kernels_per_step": out.get("kernels_per_step"),
                    "host_ms_forward_backward_optimizer": out.get(
                        "host_ms_forward_backward_optimizer"
                    ),
                    "ooms": out.get("ooms"),
                    "error": out.get("error"),
                    "rounds": out.get("rounds"),
                    "env": args.env,
                    "batch": out.get("batch"),  # the batch the loop ran (--batch's, or the plan's)
                    "compile_mode": args.compile_mode,
                    "fused_optimizer": args.fused_optimizer,
                    "wall_s": round(time.perf_counter() - t0, 1),
                    "label": args.label,
                }
                print(json.dumps(row), flush=True)
                recorder.write(row)
    recorder.close()
    print(f"{'placement':<9} {'runs':>4} {'median samples/s':>17} {'range':<24} nodes ran on")
    for placement in chosen:
        mine = [r for r in rows if r["placement"] == placement]
        rates = [r["samples_per_s"] for r in mine if r["samples_per_s"] is not None]
        span = f"{min(rates):,.0f}-{max(rates):,.0f}" if rates else "-"
        median = f"{statistics.median(rates):,.0f}" if rates else "-"
        ran_on = ",".join(str(r["cpu_node"]) for r in mine)
        print(f"{placement:<9} {len(mine):>4} {median:>17} {span:<24} {ran_on}")
    return 0 if all(r["samples_per_s"] is not None for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
