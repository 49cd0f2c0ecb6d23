"""Are a saved plan's CUDA graphs made at all? The plan run under reduce-overhead (its compile
choice's mode replaced), a few steps, with inductor's cudagraph log captured: each "skipping
cudagraphs due to ..." line it wrote, and how many graphs it skipped.

Why: t5_base's compiled pick waits on the host by its share of a step (0.79-0.89), yet its
CUDA graphs ran 0.72-0.89x the default mode in every plan that tried them, and under them its
step still ran about 5,070 kernels with the host at 0.81 of the step (session 34 call 3). A
graph inductor skipped replays nothing: the mode then costs a memory pool and gains no
launches, and the planner's graphs search is spent for nothing.

    python bench/cudagraph_skips.py --model t5_base --plan P.json --batch 28 --json $OUT/s.jsonl

Known limitations:
    * Needs CUDA; reads the plan's own choices with only the mode (and ``--batch``) changed.
    * The reasons are inductor's log lines (the ``cudagraphs`` logging artifact), whose words
      belong to torch's version.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

import torch
from _recorder import Recorder  # bench/, first on sys.path as a script
from _targets import TARGETS
from process_spread import plan_variant

import memadvisor
from memadvisor.schema.plan import Plan
from memadvisor.target import load_target
from memadvisor.workload import train_step


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, choices=sorted(TARGETS))
    parser.add_argument("--plan", type=Path, required=True)
    parser.add_argument("--batch", type=int, help="run at this batch instead of the plan's")
    parser.add_argument("--mode", default="reduce-overhead")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, args.budget_gib * 2**30 / total))
    try:
        variant = plan_variant(args.plan.read_text(), args.batch, args.mode)
    except ValueError as e:
        sys.exit(f"the plan cannot run in {args.mode} mode: {e}")
    assert variant is not None  # a mode is always given
    plan = Plan.model_validate_json(variant)
    torch._logging.set_logs(cudagraphs=True)  # the artifact that says why a graph is skipped
    lines = _Lines()
    logging.getLogger("torch._inductor.cudagraph_utils").addHandler(lines)
    workload = load_target(TARGETS[args.model])
    model = memadvisor.apply_plan(workload.model, plan).cuda()
    step_workload = dataclasses.replace(workload, model=model)
    optimizer = step_workload.make_optimizer(model)
    batch = step_workload.batch(plan.candidate.batch_size, torch.device("cuda"))
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        train_step(step_workload, model, optimizer, batch)
        torch.cuda.synchronize()
        times.append(round((time.perf_counter() - t0) * 1e3, 1))
    from torch._dynamo.utils import counters  # a bench's diagnostic, not the planner's

    skips = [s for s in lines.lines if "skipping cudagraphs" in s]
    row = {
        "bench": "cudagraph_skips",
        "model": args.model,
        "batch": plan.candidate.batch_size,
        "mode": args.mode,
        "choices": plan.candidate.choices,
        "cudagraph_skips": int(counters["inductor"]["cudagraph_skips"]),
        "skip_reasons": sorted(set(skips))[:20],
        "step_ms": times,
        "torch": torch.__version__,
    }
    print(json.dumps(row), flush=True)
    recorder = Recorder(args.json, lambda _: True, mode="a")
    recorder.write(row)
    recorder.close()


if __name__ == "__main__":
    main()
