"""Where a plan's seconds around its stages go: the profiling stage's first seconds, before
its first step, and the interpreter's exit after the plan.

Why: on an H200 (session 37) the GPT example's plan spent 5.7 s between "profiling ..." and
its first warm-up step (t5_base's: 0.3 s), and every plan's process took 3.1-3.2 s to exit
after writing its plan (``plan_speed.py``'s ``exit_s``); the issue's goal is 60 s a plan.

How: one plan in a child process, as ``plan_speed.py`` makes it (its log lines timed from
the child's start). A thread samples the main thread's stack every ``--every-s`` seconds
(its innermost frames, with the time); after the plan, ``faulthandler`` dumps every thread's
stack to a file every ``--every-s`` seconds until the process is gone (it runs while the
interpreter finalizes, where a Python thread no longer does). The parent prints the log's
lines, the frames most sampled in each window (``--window`` pairs of log-line prefixes;
default: from "profiling ..." to the first step), the exit's seconds and the stacks seen
while the process exited; ``--json`` writes one line with them.

    python3 bench/plan_edges.py --model gpt --budget-gb 8 --json bench/results/plan_edges.jsonl

Known limitations:
    * A sampling thread needs the GIL: while the main thread holds it in C code the samples
      stop, and the next one shows where it was once it let go. The exit's dumps come from
      faulthandler's own thread and need no GIL.
    * Frames are ``file:line function``, innermost first, the first ``--depth`` of them.
"""

from __future__ import annotations

import argparse
import collections
import faulthandler
import json
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_STARTED = time.perf_counter()  # before torch's import: the child's "imported_s" counts it
HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE.parent))

from _cache import cold_cache  # noqa: E402
from _targets import TARGETS  # noqa: E402


def _frames(frame: Any, depth: int) -> list[str]:
    out = []
    while frame is not None and len(out) < depth:
        code = frame.f_code
        out.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return out


def _child(
    target: str, budget_gib: float, device: str, out: Path, every_s: float, depth: int, hard: bool
) -> None:
    import logging

    started = _STARTED
    from memadvisor.planner import plan_workload
    from memadvisor.schema.config import PlanConfig
    from memadvisor.target import load_target

    lines: list[tuple[float, str]] = []

    class _Lines(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append((time.perf_counter() - started, record.getMessage()))

    log = logging.getLogger("memadvisor")
    log.addHandler(_Lines())
    log.setLevel(logging.DEBUG)
    samples: list[tuple[float, list[str]]] = []
    main = threading.main_thread().ident
    done = threading.Event()

    def sample() -> None:
        while not done.wait(every_s):
            frame = sys._current_frames().get(main)  # noqa: SLF001 - a sampler's only way
            samples.append((time.perf_counter() - started, _frames(frame, depth)))

    imported_s = time.perf_counter() - started
    workload = load_target(target)
    built_s = time.perf_counter() - started
    sampler = threading.Thread(target=sample, daemon=True, name="plan-edges-sampler")
    sampler.start()
    config = PlanConfig(budget_bytes=int(budget_gib * 2**30), device=device)
    plan = plan_workload(workload, config, target=target, progress=False)
    planned_s = time.perf_counter() - started
    out.with_suffix(".plan.json").write_text(plan.model_dump_json())
    done.set()
    sampler.join()
    out.write_text(
        json.dumps(
            {
                "imported_s": imported_s,
                "built_s": built_s,
                "planned_s": planned_s,
                "planner_wall_s": plan.plan_wall_ms / 1e3,
                "lines": lines,
                "samples": samples,
                "written_at": time.time(),
            }
        )
    )
    if not hard:  # (faulthandler's dump beside os._exit crashed the process on a CPU)
        trace = open(out.with_suffix(".exit.txt"), "w")  # noqa: SIM115 - open until the end
        faulthandler.dump_traceback_later(every_s, repeat=True, file=trace)
        return
    # As the command ends: threads joined, the exit handlers, the streams flushed, os._exit.
    from memadvisor.cli import _end

    _end(0)


def _window(record: dict[str, Any], start: str, end: str) -> tuple[float, float] | None:
    """The seconds from the first log line starting with ``start`` to the first after it
    starting with ``end`` (None: either is missing)."""
    begun = next((t for t, line in record["lines"] if line.startswith(start)), None)
    if begun is None:
        return None
    ended = next((t for t, line in record["lines"] if t >= begun and line.startswith(end)), None)
    return None if ended is None else (begun, ended)


def _top(samples: list[tuple[float, list[str]]], span: tuple[float, float], n: int) -> list:
    inside = [frames for t, frames in samples if span[0] <= t <= span[1]]
    counts = collections.Counter(" < ".join(frames) for frames in inside)
    return [(count, stack) for stack, count in counts.most_common(n)]


def _exit_stacks(text: str, depth: int) -> list[tuple[int, str]]:
    """The main thread's stacks faulthandler dumped during the exit, most seen first."""
    stacks: list[str] = []
    for dump in text.split("Timeout (")[1:]:
        current = [ln.strip() for ln in dump.splitlines() if ln.strip().startswith("File ")]
        stacks.append(" < ".join(current[:depth]) if current else "no Python frame (C code)")
    return [(c, s) for s, c in collections.Counter(stacks).most_common(5)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt", choices=sorted(TARGETS))
    parser.add_argument("--budget-gb", type=float, default=8.0)
    parser.add_argument("--device", default="auto", help="PlanConfig.device (auto: the card)")
    parser.add_argument("--every-s", type=float, default=0.25)
    parser.add_argument("--depth", type=int, default=6)
    parser.add_argument(
        "--window",
        nargs=2,
        action="append",
        metavar=("FROM", "TO"),
        help="log-line prefixes of a window to sample (default: profiling's start)",
    )
    parser.add_argument(
        "--exit",
        choices=("normal", "hard"),
        default="normal",
        help="hard: after the plan, end as the command does (memadvisor.cli's _end)",
    )
    parser.add_argument("--json", type=Path, help="append one JSON line here")
    parser.add_argument(
        "--save-plan",
        type=Path,
        help="copy the plan's JSON here (session 38 call 2: a plan whose graphs round was "
        "not explained, and not kept)",
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/plan-edges"))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = args.workdir / f"{args.model}.json"
    if args.child:
        hard = args.exit == "hard"
        _child(
            TARGETS[args.model], args.budget_gb, args.device, out, args.every_s, args.depth, hard
        )
        return
    args.workdir = args.workdir.resolve()  # the child runs in the repository's root
    out = args.workdir / f"{args.model}.json"
    args.workdir.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".exit.txt").unlink(missing_ok=True)  # an earlier run's
    command = [sys.executable, str(HERE), "--child", "--model", args.model]
    command += ["--budget-gb", str(args.budget_gb), "--device", args.device]
    command += ["--every-s", str(args.every_s), "--depth", str(args.depth)]
    command += ["--workdir", str(args.workdir), "--exit", args.exit]
    with cold_cache(args.model, cold=True):  # a user's first plan: nothing compiled before
        spawned = time.time()
        subprocess.run(command, check=True, cwd=ROOT)
        exited = time.time()
    record = json.loads(out.read_text())
    if args.save_plan:
        args.save_plan.parent.mkdir(parents=True, exist_ok=True)
        args.save_plan.write_text(out.with_suffix(".plan.json").read_text())
    exit_s = exited - record["written_at"]
    windows = args.window or [["profiling ...", "profiling: warm-up step"]]
    print(
        f"{args.model}: process {exited - spawned:.1f} s; imports {record['imported_s']:.1f} s, "
        f"build {record['built_s'] - record['imported_s']:.1f} s, planner "
        f"{record['planner_wall_s']:.1f} s, exit after the plan was written {exit_s:.2f} s"
    )
    for t, line in record["lines"]:
        print(f"  [{t:7.2f} s] {line[:150]}")
    row: dict[str, Any] = {
        "model": args.model,
        "budget_gib": args.budget_gb,
        "device": args.device,
        "process_s": round(exited - spawned, 2),
        "imports_s": round(record["imported_s"], 2),
        "build_s": round(record["built_s"] - record["imported_s"], 2),
        "planner_wall_s": round(record["planner_wall_s"], 2),
        "exit": args.exit,
        "plan_saved": str(args.save_plan) if args.save_plan else None,
        "exit_s": round(exit_s, 2),
        "windows": [],
    }
    for start, end in windows:
        span = _window(record, start, end)
        if span is None:
            print(f"window {start!r} .. {end!r}: not in the log")
            continue
        top = _top(record["samples"], span, 5)
        print(f"window {start!r} .. {end!r}: {span[1] - span[0]:.2f} s; most sampled:")
        for count, stack in top:
            print(f"  {count} x {stack}")
        row["windows"].append(
            {"from": start, "to": end, "s": round(span[1] - span[0], 2), "top": top}
        )
    exit_text = out.with_suffix(".exit.txt")
    stacks = _exit_stacks(exit_text.read_text(), args.depth) if exit_text.exists() else []
    print(f"exit: {exit_s:.2f} s; the main thread's stacks while exiting:")
    for count, stack in stacks:
        print(f"  {count} x {stack}")
    row["exit_stacks"] = stacks
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        with args.json.open("a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
