"""What inductor's on-disk caches save a probe process: compile time cold, warm, another batch.

The planner measures compiled candidates in fresh processes, each compiling the model again.
This bench runs such processes one after another on one ``TORCHINDUCTOR_CACHE_DIR`` (new,
so the first is cold), each a ``train_candidate`` run as the planner's device makes it
(the model built, rewritten and trained in it), and prints, per process, the imports and
the workload's load (``import_load_s``), the first step (the compile in it), the steady
step, the peak, dynamo's graphs, and what inductor's
FX-graph cache and AOTAutograd's cache did together (hits, misses). A run is
``BATCH:static`` (shapes as training compiles them) or ``BATCH:dynamic`` (the compile
choice's ``dynamic_batch``, so one graph serves every batch). Run one at a time on a host:
a compile in another process slows a small model's timed steps (docs/design.md, session
21).

    python bench/compile_cache.py --model gpt2 --runs 8:static,8:static,12:static,8:dynamic
    python bench/compile_cache.py --model gpt --runs 8:dynamic,12:dynamic --choices \
        '{"checkpointing": ["h.0", "h.1"], "compile": {"mode": "default", "regional": true}}'

One JSON line per process on stdout (and appended to ``--json`` when given).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent))

from plan_speed import MODELS  # noqa: E402


def _child(
    target: str,
    batch: int,
    dynamic: bool,
    choices: dict[str, Any],
    steps: int,
    budget_gib: float | None = None,
) -> None:
    """One run as the planner's device makes it (``train_candidate``), the compile choice
    made dynamic in its batch (the compile search's form) or static (the user's); with
    ``budget_gib``, capped as a probe process is (the card's memory fraction)."""
    started = time.perf_counter()
    import torch

    if budget_gib is not None:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(budget_gib * 2**30 / total)

    from memadvisor import _torch_private
    from memadvisor.device._train import train_candidate
    from memadvisor.schema.candidate import Candidate
    from memadvisor.target import load_target

    reasons = _BypassReasons()

    compile_choice = choices.get("compile", "default")
    if not isinstance(compile_choice, dict):
        compile_choice = {"mode": compile_choice}
    compile_choice = {**compile_choice, "dynamic_batch": dynamic}
    workload = load_target(target)
    candidate = Candidate(batch_size=batch, choices={**choices, "compile": compile_choice})
    ready_s = time.perf_counter() - started
    measured = train_candidate(
        workload, candidate, steps, device=torch.device("cuda"), copy_model=False
    )
    counters = _torch_private.dynamo_counters()
    print(
        "RESULT "
        + json.dumps(
            {
                "batch": batch,
                "dynamic": dynamic,
                "import_load_s": round(ready_s, 2),
                "first_step_s": round(measured.first_step_ms / 1e3, 2),
                "steady_ms": round(measured.step_ms, 2),
                "samples_per_s": round(measured.samples_per_s, 1),
                "peak_gib": round(measured.peak_bytes / 2**30, 3),
                "graphs": counters.get("stats", {}).get("unique_graphs", 0),
                "cache_hits": measured.compile_cache_hits,
                "cache_misses": measured.compile_cache_misses,
                "cache_bypasses": measured.compile_cache_bypasses,
                "bypass_reasons": reasons.seen(),
                # The allocator's own count of cudaMalloc failures it answered by freeing its
                # cache and retrying: many a step is a step slowed near the cap.
                "alloc_retries": torch.cuda.memory_stats().get("num_alloc_retries"),
                "reserved_peak_gib": round(torch.cuda.max_memory_reserved() / 2**30, 3),
                "budget_gib": budget_gib,
            }
        ),
        flush=True,
    )


class _BypassReasons(logging.Handler):
    """Why inductor's FX graph cache and AOTAutograd's cache would not take a graph: the
    reasons their loggers give at INFO ("Bypassing FX Graph Cache because ...", "Bypassing
    autograd cache due to: ..."), each once, its first line, in the order they came.
    Attached to those two loggers only, at INFO, so nothing else of torch's logging moves."""

    LOGGERS = ("torch._inductor.codecache", "torch._functorch._aot_autograd.autograd_cache")

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.reasons: list[str] = []
        for name in self.LOGGERS:
            logger = logging.getLogger(name)
            logger.setLevel(logging.INFO)
            logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if "ypass" in text:
            first = text.strip().splitlines()[0][:300]
            if first not in self.reasons:
                self.reasons.append(first)

    def seen(self) -> list[str]:
        return list(self.reasons)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gpt2")
    parser.add_argument("--runs", default="8:static,8:static,12:static,8:dynamic,12:dynamic")
    parser.add_argument("--choices", default='{"precision": "bf16", "compile": "default"}')
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--cache-dir", help="default: a new temporary directory")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--budget-gib", type=float, help="cap each run's process as a probe's (default: none)"
    )
    parser.add_argument(
        "--expandable",
        action="store_true",
        help="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, as a plan's runs have",
    )
    parser.add_argument(
        "--graphsafe-rng",
        choices=["on", "off"],
        default="on",
        help="AOTAutograd's CUDA-graph-safe RNG functionalization for checkpointed random "
        "ops (torch._functorch.config.graphsafe_rng_functionalization; default on, torch's); "
        "off: the runs' processes get MEMADVISOR_CACHED_RNG=1, which the planner's compile "
        "backend reads (memadvisor/_torch_private.py::backend_patches)",
    )
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    choices = json.loads(args.choices)
    if args.child:
        target, batch, mode = args.child
        _child(target, int(batch), mode == "dynamic", choices, args.steps, args.budget_gib)
        return
    cache = Path(args.cache_dir or tempfile.mkdtemp(prefix="compile-cache-"))
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache)}
    env["TORCH_DYNAMO_AUTOMATIC_DYNAMIC_LOCAL_PGO"] = "0"
    if args.expandable:
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if args.graphsafe_rng == "off":
        from memadvisor._torch_private import CACHED_RNG_ENV

        env[CACHED_RNG_ENV] = "1"
    for run in args.runs.split(","):
        batch, mode = run.split(":")
        cmd = [sys.executable, str(HERE), "--child", MODELS[args.model], batch, mode]
        cmd += ["--choices", args.choices, "--steps", str(args.steps)]
        if args.budget_gib is not None:
            cmd += ["--budget-gib", str(args.budget_gib)]
        started = time.perf_counter()
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - started
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("RESULT ")]
        record = {"model": args.model, "run": run, "choices": choices, "wall_s": round(wall, 1)}
        record["expandable"] = args.expandable
        record["graphsafe_rng"] = args.graphsafe_rng
        if lines:
            record |= json.loads(lines[-1][len("RESULT ") :])
        else:
            record["error"] = done.stderr[-1500:]
        print(json.dumps(record), flush=True)
        if args.json:
            with args.json.open("a") as f:
                f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
