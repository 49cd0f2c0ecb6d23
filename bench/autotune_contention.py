"""Does a compiled run's rate depend on who shared the card while it autotuned, and does the
shared cache carry that on? One configuration, four ways, in fresh processes.

Why (session 26, 2 x H100): the GPT example's bf16 form with 2 of 4 blocks checkpointed,
compiled static at batch 307, measured 26,255-27,023 samples/s in pass 1 of five plans and
19,174-20,172 in three others; in one plan it ran 20,162 and then, made again in a process
of its own, 20,172: not a disturbance of one process. Alone in a hand cell the same form
ran 25,665 at 314. Inductor autotunes its Triton kernels in the first step (several
launch configurations timed on the card: ``triton.autotune_pointwise``, reductions) and
writes each kernel's winner beside it in the cache (``*.best_config``,
``autotune_local_cache``), which every later process sharing the cache reads instead of
timing again. A plan compiles three or four candidates at once on one card beside its own
trial, all sharing one cache: a winner timed while other processes ran on the card may be
a loser alone, and stays one for every later run of that kernel, the plan's and (where the
plan's cache is the user's) the user's.

Phases, each a fresh device (its own fork server) with the cache directory named:

* ``alone_fresh``: an empty cache, the configuration run alone (it autotunes alone).
* ``at_once_fresh``: another empty cache, ``--at-once`` runs of it made at once (their first
  steps, compiles and autotuning overlap, as a plan's pass 1; their timed steps in turn).
* ``alone_after``: that cache, one run alone: it reads the winners the runs at once chose.
* ``alone_after_no_best``: a copy of that cache without its ``*.best_config`` files, one run
  alone: the same compiled kernels, autotuned again alone.
* ``alone_fresh_again``: a third empty cache, alone (the host's drift over the call).

If ``alone_after`` is as slow as ``at_once_fresh`` and ``alone_after_no_best`` as fast as
``alone_fresh``, the contention's winners are the cause and the cache carries them. Each
line also says how many kernels autotuned in both its cache and ``alone_fresh``'s chose
another launch configuration (``winners_against_alone``: the same kernel, the same file).
One JSON line per phase (``--json``), then a table.

    python bench/autotune_contention.py --model gpt --batch 307 --json $OUT/autotune.jsonl
    python bench/autotune_contention.py --device simulated --model cnn --batch 8 \\
        --budget-gib 0.05 --steps 3 --choices '{"precision": "bf16"}' --json /tmp/a.jsonl

Known limitations:
    * One configuration, one batch; the default choices are the GPT example's (its block
      names); another model needs ``--choices``.
    * On the simulated (CPU) device there is no Triton autotuning: the smoke checks the
      phases and the lines, not the effect.
    * Runs made at once share the card as a plan's do, but without the planner's own trial
      compiling beside them.
    * Session 27's rows (``bench/results/autotune_contention.jsonl``) were made before
      ``--allocator``, under the default allocator.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _cache import cold_cache_env  # bench/, first on sys.path when run as a script
from _recorder import Recorder
from _targets import TARGETS
from user_path import device_for, workload_of

from memadvisor.process_state import environ_set
from strategies.allocator import planned_environment

GIB = 2**30
# The GPT example's bf16 form with blocks h.1 and h.3 checkpointed, compiled static: the
# compile search's candidate 2 in session 26's plans.
GPT_HALF = {
    "optimizer_habits": "advice",
    "precision": "bf16",
    "checkpointing": ["h.1", "h.3"],
    "compile": "default",
}


def best_configs(cache: Path) -> int:
    """How many autotuning winners (``*.best_config``) the cache directory holds."""
    return sum(1 for _ in cache.rglob("*.best_config")) if cache.exists() else 0


# What a best_config file says besides the winner itself: not compared.
_NOT_THE_WINNER = ("time_taken_ms", "triton_cache_hash", "found_by_coordesc")


def _winners(cache: Path) -> dict[str, dict[str, Any]]:
    """Each kernel's autotuning winner in ``cache``, by its file's path under it."""
    out: dict[str, dict[str, Any]] = {}
    for path in cache.rglob("*.best_config") if cache.exists() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[str(path.relative_to(cache))] = {
            k: v for k, v in data.items() if k not in _NOT_THE_WINNER
        }
    return out


def winners_differing(reference: Path, other: Path) -> dict[str, int]:
    """Kernels autotuned in both caches (the same kernel: the same path) and how many of
    them chose another launch configuration in ``other`` than in ``reference``."""
    a, b = _winners(reference), _winners(other)
    common = set(a) & set(b)
    return {"common": len(common), "differing": sum(1 for k in common if a[k] != b[k])}


def _profile(workload: Any) -> Any:
    """The model's blocks (checkpointing reads their names), from fake tensors: no card."""
    from memadvisor.device.fake import fake_workload, profile_fake

    return profile_fake(fake_workload(workload))


def run_phase(
    phase: str, cache: Path, runs: int, args: argparse.Namespace, workload: Any, profile: Any
) -> dict[str, Any]:
    """``runs`` runs of the configuration at once (1: alone) on a fresh device whose
    processes share ``cache``; the phase's line."""
    from memadvisor.schema.candidate import Candidate

    choices = json.loads(args.choices)
    candidate = Candidate(batch_size=args.batch, choices=choices)
    started = time.perf_counter()
    rates: list[float | None] = []
    first_s: list[float | None] = []
    errors: list[str] = []
    # A plan's runs are under expandable segments (strategies/allocator.py): so are these,
    # unless --allocator default (session 27 call A ran them without: 307 ran out of memory
    # alone on the cache the runs at once wrote, and fitted on it without its winners).
    allocator = planned_environment() if args.allocator == "expandable" else {}
    with environ_set(cold_cache_env(cache) | allocator):
        device = device_for(args.device, round(args.budget_gib * GIB), args.model, profile)
        try:
            # A lone run as run() makes it; each failure (an out-of-memory too) its answer.
            answers = device.run_many(workload, [(candidate, args.steps)] * runs)
        finally:
            device.close()
    for answer in answers:
        if isinstance(answer, Exception):
            errors.append(f"{type(answer).__name__}: {str(answer)[:200]}")
            rates.append(None)
            first_s.append(None)
            continue
        rates.append(round(answer.samples_per_s, 1))
        first_s.append(round(answer.first_step_ms / 1e3, 2) if answer.first_step_ms else None)
    measured = [r for r in rates if r is not None]
    return {
        "bench": "autotune_contention",
        "model": args.model,
        "batch": args.batch,
        "choices": choices,
        "phase": phase,
        "runs_at_once": runs,
        "samples_per_s_each": rates,
        "samples_per_s": round(statistics.median(measured), 1) if measured else None,
        "first_step_s_each": first_s,
        "best_configs": best_configs(cache),
        "errors": errors,
        "wall_s": round(time.perf_counter() - started, 1),
        "label": args.label,
        "allocator": args.allocator,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gpt", choices=sorted(TARGETS))
    parser.add_argument("--batch", type=int, default=307)
    parser.add_argument("--choices", default=json.dumps(GPT_HALF), help="the candidate's JSON")
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=20, help="steps a run (a plan's: 20)")
    parser.add_argument("--at-once", type=int, default=3, help="runs made at once (pass 1's)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "simulated"])
    parser.add_argument(
        "--allocator",
        default="expandable",
        choices=["expandable", "default"],
        help="the runs' CUDA allocator: a plan's (expandable segments) or the process's own",
    )
    parser.add_argument("--label", default="")
    parser.add_argument("--json", type=Path, help="append one JSON line per phase here")
    args = parser.parse_args(argv)
    if args.at_once < 2:
        parser.error(f"--at-once {args.at_once}: runs made at once are 2 or more")

    workload = workload_of(args.model)
    profile = _profile(workload)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
    recorder = Recorder(args.json, lambda _: True, mode="a")  # appends: calls add up
    rows = recorder.rows
    with tempfile.TemporaryDirectory(prefix="autotune-contention-") as scratch:
        root = Path(scratch)
        shared = root / "at_once"
        alone = root / "fresh1"
        phases = {  # in the order they run: the cache each phase's processes share, its runs
            "alone_fresh": (alone, 1),
            "at_once_fresh": (shared, args.at_once),
            "alone_after": (shared, 1),
            "alone_after_no_best": (root / "no_best", 1),
            "alone_fresh_again": (root / "fresh2", 1),
        }
        for phase, (cache, runs) in phases.items():
            cache.mkdir(exist_ok=True)
            if phase == "alone_after_no_best":
                shutil.copytree(shared, cache, dirs_exist_ok=True)
                for stale in cache.rglob("*.best_config"):
                    stale.unlink()
            print(f"[{time.strftime('%H:%M:%S')}] {phase}: {runs} run(s)", flush=True)
            row = run_phase(phase, cache, runs, args, workload, profile)
            # Against the winners chosen alone on an empty cache (the first phase's).
            row["winners_against_alone"] = winners_differing(alone, cache)
            print(json.dumps(row), flush=True)
            recorder.write(row)
    recorder.close()
    print(
        f"{'phase':<22} {'at once':>7} {'samples/s':>10} {'each':<30} {'best_config':>11} "
        f"{'differ from alone':>17}"
    )
    for row in rows:
        each = ", ".join("-" if r is None else f"{r:,.0f}" for r in row["samples_per_s_each"])
        rate = row["samples_per_s"]
        against = row["winners_against_alone"]
        print(
            f"{row['phase']:<22} {row['runs_at_once']:>7} "
            f"{'-' if rate is None else f'{rate:,.0f}':>10} {each:<30} {row['best_configs']:>11} "
            f"{against['differing']:>8} of {against['common']:<6}"
        )
    return 0 if all(row["samples_per_s"] is not None for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
