"""Time to plan on a GPU: per model, the plan's wall time, each stage's, and the pick.

Each (model, compile policy) plans in a fresh process, as ``memadvisor plan TARGET
--budget-gb B`` does (the process's start, imports and the model's build counted), with a
cold cache of its own (``--cold-cache``, the default: a new ``TORCHINDUCTOR_CACHE_DIR`` and
``TRITON_CACHE_DIR`` per model, a user's first plan of a model) unless ``--warm-cache``. One
JSON line per plan, appended to ``--json`` (default ``bench/results/plan_speed.jsonl``):
model, budget_gib, compile, label, cache, plan_wall_s (the process, what issue 27's 60 s
counts), planner_wall_s, stage_wall_s, compile_s (the compile stage's wall time), pick,
verified_samples_per_s, compile_variants, device, torch, commit, outside_planner_s (the
process's seconds around the planner: start and imports, the build, plan_workload's call,
the write, the exit, ended as the command ends since session 38: memadvisor.cli's ``_end``,
without Python's teardown of every module), host_cpu_busy (the share of the host's cores
busy in each stage of 2 s or more, from ``/proc/stat``: whether a compile round is the
host's), host_min_available_gib (the least host memory available while it ran) and, with
``--runs-at-once N``, runs_at_once_max (the card's most runs made at once set to N for the
plan, an A/B of ``memadvisor.device.cuda.MAX_CONCURRENT_RUNS``). ``--save-plans DIR`` keeps
each plan as
``DIR/<model>.json`` (``bench/user_path.py --plan`` runs the user's loop and the hand grid from it);
``--timeout-s`` ends a plan that runs longer and records that.

``--label`` names the code that ran (``before``: the planner as it was, ``after``: with the
stage scheduling of issue 16), and ``--table`` prints every model's labels side by side from
the JSON lines, so the before/after table is made from measurements, not copied.

    python bench/plan_speed.py --models gpt,gpt2 --label after       # ~1 min a model
    python bench/plan_speed.py --models cnn,resnet18 --compile off
    python bench/plan_speed.py --models lm350m --label i27 --save-plans /tmp/i27/plans \
        --timeout-s 560                                              # issue 27, one model
    python bench/plan_speed.py --table bench/results/plan_speed.jsonl
    python bench/plan_speed.py --models cnn --budget-gb 0.25 --device estimate --compile off \
        --json /tmp/smoke.jsonl                                      # the CPU smoke (CI)

Models: any of ``bench/_targets.py``'s: gpt, cnn, llama, hf_gpt2 (examples/); gpt2
(examples/gpt.py at GPT-2 small's size, 124M); lm350m (examples/llama.py at 0.35B, seq
1024); resnet18, resnet50, convnext_tiny, vit_b_16, swin_t (torchvision); t5_base, bert,
llama_small (transformers). Issue 27's are ``_targets.ISSUE_27``. A model whose package is
missing is reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _cache import add_cache_flags, cold_cache_env  # bench/, first on sys.path as a script
from _targets import TARGETS, missing

from memadvisor.device.simulated import host_available_bytes
from memadvisor.strategy import RUNS_COMPILE_VARIABLE

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
RESULTS = HERE.parent / "results" / "plan_speed.jsonl"

MODELS = dict(TARGETS)
STAGES = ("profiling", "search", "probes", "compile", "verify", "checks")


# -- the child: one plan, as the CLI makes it -----------------------------------------------


def _child(
    target: str,
    budget_gib: float,
    compile_policy: str,
    out: Path,
    device: str,
    compile_search: dict[str, Any] | None = None,
    runs_at_once: int | None = None,
) -> None:
    import logging

    from memadvisor.planner import plan_workload
    from memadvisor.schema.config import PlanConfig
    from memadvisor.strategy import load_strategies
    from memadvisor.target import load_target

    # Each stage, probe and note as a timed line on stderr as it happens: rich's bars draw
    # nothing outside a terminal until they end, so a plan ended by --timeout-s said nothing
    # of where it was.
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("[%(relativeCreated)7.0f ms] %(message)s"))
    memadvisor_log = logging.getLogger("memadvisor")
    memadvisor_log.addHandler(handler)
    memadvisor_log.setLevel(logging.DEBUG)

    config = PlanConfig(
        budget_bytes=int(budget_gib * 2**30), device=device, options={"compile": compile_policy}
    )
    if runs_at_once is not None:
        set_runs_at_once(runs_at_once)
    loaded_at = time.time()  # this process's imports done
    workload = load_target(target)
    built_at = time.time()
    strategies = None
    if compile_search:
        # The compile stage's search settings (CompileSearch's fields) for this plan only:
        # the search runs in this process, the probes' processes load strategies by name.
        from strategies._compile_search import CompileSearch
        from strategies.compile import Compile

        search = CompileSearch(**compile_search)
        strategies = [
            Compile(search=search) if isinstance(s, Compile) else s
            for s in load_strategies(config.strategies)
        ]
    plan = plan_workload(workload, config, target=target, progress=False, strategies=strategies)
    planned_at = time.time()
    out.write_text(plan.model_dump_json())
    # Where the process's seconds outside the planner went (the parent adds its exit): the
    # imports before the model's build, the build, plan_workload's return after the planner's
    # own clock stopped (its device closing), and the interpreter's exit after the write.
    times = {"loaded_at": loaded_at, "built_at": built_at, "planned_at": planned_at}
    _times_file(out).write_text(json.dumps(times | {"written_at": time.time()}))


def set_runs_at_once(n: int) -> int:
    """The card device's most runs made at once (``memadvisor.device.cuda``'s
    ``MAX_CONCURRENT_RUNS``, 8; the host's cores bound it too) set to ``n`` in this process,
    for an A/B of it; the value it had. Read where the device says its capabilities, so it
    holds for the plan after it."""
    from memadvisor.device import cuda

    before = cuda.MAX_CONCURRENT_RUNS
    cuda.MAX_CONCURRENT_RUNS = n
    return before


def _times_file(out: Path) -> Path:
    return out.with_name(out.stem + ".times.json")


# -- the parent ------------------------------------------------------------------------------


def _commit(root: Path = ROOT) -> str:
    """The commit the files that ran are: ``git describe --always --dirty``, and where dirty
    the tree their content makes (``tree`` and its hash), which names the commit that ran
    wherever one holds that content: ``git log --format='%h %T' | grep HASH``.

    Why: the device tool's copy of a working tree kept a HEAD older than its files, and
    session 32's rows read "22d47ff-dirty" for code two commits later (corrected by hand)."""
    try:
        done = subprocess.run(
            # --dirty: a copy of a working tree (the device tool's) whose HEAD is older than
            # the files that ran says so, instead of naming a commit that did not run.
            ["git", "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            cwd=root,
        )
        described = done.stdout.strip() or "unknown"
    except OSError:
        return "unknown"
    if not described.endswith("-dirty"):
        return described
    tree = _worktree_tree(root)
    return f"{described} tree {tree}" if tree else described


def _worktree_tree(root: Path) -> str | None:
    """The hash of the tree the working tree's files make (what ``git add -A`` then
    ``git write-tree`` would give), through an index of its own: the repository's index and
    HEAD are not touched (its object store gains the files' blobs). None where git fails."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "GIT_INDEX_FILE": str(Path(tmp) / "index")}
        try:
            for cmd in (["git", "add", "-A"], ["git", "write-tree"]):
                done = subprocess.run(cmd, capture_output=True, text=True, cwd=root, env=env)
                if done.returncode != 0:
                    return None
        except OSError:
            return None
    return done.stdout.strip() or None


def _pick(plan: dict[str, Any]) -> dict[str, Any]:
    candidate = plan["candidate"]
    choices = {k: v for k, v in candidate["choices"].items() if k != "batch_size"}
    checkpointed = choices.get("checkpointing")
    if isinstance(checkpointed, list):
        choices["checkpointing"] = f"{len(checkpointed)} blocks"
    return {
        "batch_size": candidate["batch_size"],
        "accumulation_steps": candidate.get("accumulation_steps", 1),
        "choices": choices,
    }


def plan_one(
    model: str,
    budget_gib: float,
    compile_policy: str,
    label: str,
    warm_cache: bool,
    device: str = "cuda",
    save_to: Path | None = None,
    timeout_s: float | None = None,
    compile_search: dict[str, Any] | None = None,
    bytecode_dir: Path | None = None,
    runs_at_once: int | None = None,
) -> dict[str, Any]:
    """Plan ``model`` in a fresh process; its JSON record (``error`` set when it failed).

    ``bytecode_dir``: Python writes its bytecode there and reads it from there in the plan's
    processes (``PYTHONPYCACHEPREFIX``, ``PYTHONDONTWRITEBYTECODE`` unset), as a user's pip
    install has torch's; the record's ``python_bytecode`` says which it was (the card
    machine of session 38 sets ``PYTHONDONTWRITEBYTECODE=1``: every process there compiled
    torch's modules from source, ``import torch._dynamo`` 3.6-4.0 s against 1.4-1.9 s).

    ``save_to``: where the plan's JSON is copied; ``timeout_s``: the plan's process is ended
    after this long (the record then says so, with the wall time it had);
    ``compile_search``: ``CompileSearch`` fields for the compile stage (the record keeps
    them as ``compile_search_overrides``)."""
    # A plan cut by --timeout-s may leave its probe processes writing in it: the row still
    # gets written (session 22: resnet50's row was lost to "Directory not empty").
    with tempfile.TemporaryDirectory(prefix="plan-speed-", ignore_cleanup_errors=True) as tmp:
        out = Path(tmp) / "plan.json"
        env = dict(os.environ)
        if not warm_cache:
            env.update(cold_cache_env(tmp))
        if bytecode_dir is not None:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = str(bytecode_dir.resolve())
        cmd = [
            sys.executable,
            str(HERE),
            "--child",
            MODELS[model],
            "--budget-gb",
            str(budget_gib),
            "--compile",
            compile_policy,
            "--out",
            str(out),
            "--device",
            device,
        ]
        if compile_search:
            cmd += ["--compile-search", json.dumps(compile_search)]
        if runs_at_once is not None:
            cmd += ["--runs-at-once", str(runs_at_once)]
        started, spawned_at = time.perf_counter(), time.time()
        with HostCpu() as cpu:
            try:
                done = subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout_s)
                returncode: int | str = done.returncode
            except subprocess.TimeoutExpired:
                returncode = f"none: ended after the --timeout-s of {timeout_s:g} s"
        wall_s, exited_at = time.perf_counter() - started, time.time()
        times_file = _times_file(out)
        times = json.loads(times_file.read_text()) if times_file.exists() else None
        record: dict[str, Any] = {
            "model": model,
            "budget_gib": budget_gib,
            "compile": compile_policy,
            "label": label,
            "cache": "warm" if warm_cache else "cold",
            "python_bytecode": _bytecode_words(env),
            # Whether the fork server imported inductor's compiler for its children, by its
            # rule: compile's plan scope keeps a set value (else "1"), the server imports on
            # "1" ("0" for an A/B of that import)
            "fork_server_imports_compiler": (env.get(RUNS_COMPILE_VARIABLE) or "1") == "1",
            "plan_wall_s": round(wall_s, 1),
            "commit": _commit(),
        }
        if compile_search:
            record["compile_search_overrides"] = compile_search
        if runs_at_once is not None:
            record["runs_at_once_max"] = runs_at_once
        if times is not None:
            record["outside_planner_s"] = _outside(times, spawned_at, exited_at)
        if returncode != 0 or not out.exists():
            return record | {"error": f"exit code {returncode}"}
        plan = json.loads(out.read_text())
        if save_to is not None:
            save_to.parent.mkdir(parents=True, exist_ok=True)
            save_to.write_text(out.read_text())
            record["plan_saved"] = str(save_to)
    verified = plan.get("verified") or {}
    compiled = next((s for s in plan.get("stages", []) if s.get("strategy") == "compile"), {})
    import torch

    stage_wall_s = {k: round(v / 1e3, 1) for k, v in plan.get("stage_wall_ms", {}).items()}
    if times is not None:
        # The host's cores, busy share by stage: whether a compile round is the host's.
        record["host_cpu_busy"] = cpu.by_stage(times["built_at"], stage_wall_s)
    if cpu.min_available_bytes is not None:
        # The least host memory left while the plan ran: what its processes (each compiling
        # child with its pool of inductor's workers) took, room for more runs at once or not.
        record["host_min_available_gib"] = round(cpu.min_available_bytes / 2**30, 1)
    return record | {
        "planner_wall_s": round(plan["plan_wall_ms"] / 1e3, 1),
        "stage_wall_s": stage_wall_s,
        # Issue 27: what weighing compile cost the plan (None: the stage did not run).
        "compile_s": stage_wall_s.get("compile"),
        "pick": _pick(plan),
        "compiled": bool(compiled.get("picked")),
        # The eager pick's timing run (overlapped with the early compile trial, when one ran).
        "eager_samples_per_s": round(float(compiled.get("eager_samples_per_s") or 0.0), 1),
        "verified_samples_per_s": round(float(verified.get("samples_per_s", 0.0)), 1),
        "device_runs": len(plan.get("probes", [])),
        "runs": [_run_words(p) for p in plan.get("probes", [])],
        "compile_variants": [
            {
                "choices": v.get("choices", {}),
                "trial": v.get("trial", "")[:300],
                "compile_s": round((v.get("one_off_ms") or 0.0) / 1e3, 1),
                "device_s": round(v.get("device_wall_ms", 0.0) / 1e3, 1),
                "batch_size": v.get("batch_size"),
                "confirmed": v.get("confirmed", False),
                "samples_per_s": round((v.get("measured") or {}).get("samples_per_s", 0.0), 1),
                # The compiled step's line (issue 27): what it predicted against what ran.
                "fit": _fit_words(v.get("fit")),
                "error": v.get("error"),
            }
            for v in compiled.get("variants", [])
        ],
        "compile_search": (compiled.get("details") or {}).get("search"),
        "checks": [c.get("summary", "")[:200] for c in plan.get("checks", [])],
        "device": plan["device_name"],
        "torch": torch.__version__,
    }


def _bytecode_words(env: dict[str, str]) -> str:
    """How the plan's processes get Python's bytecode under ``env``: "not written" (every
    process compiles the modules it imports from source), "written to DIR", or "beside the
    sources"."""
    if env.get("PYTHONDONTWRITEBYTECODE"):
        return "not written (PYTHONDONTWRITEBYTECODE)"
    prefix = env.get("PYTHONPYCACHEPREFIX")
    return f"written to {prefix}" if prefix else "beside the sources"


class HostCpu:
    """The host's CPU time on the cores this process may run on (``os.sched_getaffinity``: all
    of them unless a job is pinned, as ``bench/cards.py --split-cores`` pins each card's),
    sampled from ``/proc/stat``'s lines per core every ``every_s`` in a thread while a plan
    runs: what share of those cores were busy in a window (a stage).

    Why: a compile round runs several processes that compile at once, each with its own
    pool of inductor's workers; whether the host's cores are the bound (all busy) or sit
    partly idle (the card, a lock, one process's serial work) decides what shortens a
    round; and the least host memory available
    (``memadvisor.device.simulated.host_available_bytes``), what runs at once leave.
    Known limitations: Linux only (elsewhere every share is None); every process on those
    cores, not the plan's alone; a window shorter than ``every_s`` has no share."""

    def __init__(self, every_s: float = 0.5, cores: set[int] | None = None) -> None:
        self.every_s = every_s
        if cores is None:
            cores = set(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else set()
        self.cores = cores  # empty: all of the host's (the aggregate line)
        self.samples: list[tuple[float, int, int]] = []  # (wall time, busy, total) jiffies
        self.min_available_bytes: int | None = None  # the least MemAvailable sampled
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def read(self) -> tuple[int, int] | None:
        """(busy, total) jiffies of :attr:`cores` so far; None where ``/proc/stat`` is not."""
        try:
            with open("/proc/stat") as f:
                return jiffies(f.read(), self.cores)
        except (OSError, ValueError):
            return None

    def _sample(self) -> None:
        while True:
            now, read, free = time.time(), self.read(), host_available_bytes()
            if read is not None:
                self.samples.append((now, *read))
            if free is not None and (
                self.min_available_bytes is None or free < self.min_available_bytes
            ):
                self.min_available_bytes = free
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> HostCpu:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def share(self, start: float, end: float) -> float | None:
        """The busy share of all cores between wall times ``start`` and ``end`` (0-1), from
        the samples at or just inside the window; None where it holds fewer than two."""
        inside = [s for s in self.samples if start <= s[0] <= end]
        if len(inside) < 2 or inside[-1][2] == inside[0][2]:
            return None
        first, last = inside[0], inside[-1]
        return round((last[1] - first[1]) / (last[2] - first[2]), 3)

    def by_stage(self, planner_start: float, stage_wall_s: dict[str, float]) -> dict[str, Any]:
        """The busy share in each stage's window (the stages in the order the planner ran
        them, from ``planner_start``), with the cores counted; stages of under 2 s left out."""
        shares: dict[str, Any] = {"cores": len(self.cores) or os.cpu_count()}
        at = planner_start
        for stage, wall in stage_wall_s.items():
            if wall >= 2.0:
                shares[stage] = self.share(at, at + wall)
            at += wall
        return shares


def jiffies(stat: str, cores: set[int]) -> tuple[int, int] | None:
    """(busy, total) jiffies in ``/proc/stat``'s text ``stat``: summed over the lines of
    ``cores`` (``cpuN``), or the aggregate ``cpu`` line where ``cores`` is empty; None where
    no such line is there.

    Raises:
        ValueError: a line whose fields are not numbers.
    """
    busy = total = 0
    found = False
    for line in stat.splitlines():
        name, _, rest = line.partition(" ")
        if not name.startswith("cpu"):
            continue
        if cores:
            if name == "cpu" or int(name[3:]) not in cores:
                continue
        elif name != "cpu":
            continue
        fields = [int(x) for x in rest.split()]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        line_total = sum(fields[:8])  # guest time is counted inside user already
        busy, total, found = busy + line_total - idle, total + line_total, True
    return (busy, total) if found else None


def _outside(times: dict[str, float], spawned_at: float, exited_at: float) -> dict[str, float]:
    """The process's seconds around the planner, from the child's clock marks: its start
    and imports (``start_s``), the model's build (``build_s``), ``plan_workload``'s call
    (``plan_call_s``: the planner's wall plus what it does after its clock stops, the
    device's close), the plan's JSON written (``write_s``) and the interpreter's exit after it
    (``exit_s``). Wall clock of one host: parent and child read the same clock."""
    marks = [spawned_at, times["loaded_at"], times["built_at"], times["planned_at"]]
    marks += [times["written_at"], exited_at]
    names = ("start_s", "build_s", "plan_call_s", "write_s", "exit_s")
    return {n: round(b - a, 2) for n, a, b in zip(names, marks[:-1], marks[1:], strict=True)}


def _fit_words(fit: dict[str, Any] | None) -> dict[str, Any] | None:
    """A compiled candidate's memory and time line in GiB and ms, and what it predicted."""
    if not fit:
        return None
    return {
        "basis": fit["basis"],
        "fixed_gib": round(fit["fixed_bytes"] / 2**30, 3),
        "per_sample_mib": round(fit["per_sample_bytes"] / 2**20, 2),
        "bytes_ratio": fit.get("bytes_ratio"),
        "batches": fit["batches"],
        "predicted_batch": fit["largest_batch"],
        "predicted_samples_per_s": round(fit["samples_per_s"], 1),
    }


def _run_words(probe: dict[str, Any]) -> str:
    """``'timing b12 fits 410/s 4.1s bf16+3ckpt+compile'``: one device run in a few words; a
    fit on a card adds its allocated and reserved peaks and the host's share of its step
    (``'7.19/7.90GB host 0.83'``), where its record keeps them (plans from session 34 on)."""
    choices = (probe.get("candidate") or {}).get("choices", {})
    tags = [str(choices["precision"])] if choices.get("precision") not in (None, "fp32") else []
    if isinstance(choices.get("checkpointing"), list) and choices["checkpointing"]:
        tags.append(f"{len(choices['checkpointing'])}ckpt")
    if choices.get("compile") not in (None, "off"):
        tags.append(f"compile={json.dumps(choices['compile'])}")
    fits = "fits" if probe["fits"] else "OOM"
    step_ms = probe.get("step_ms")
    if step_ms:  # a plan of before session 19 has none
        fits += f" {probe['batch_size'] / step_ms * 1e3:.0f}/s"
    if probe.get("reserved_peak_bytes") and probe.get("peak_bytes"):
        fits += f" {probe['peak_bytes'] / 1e9:.2f}/{probe['reserved_peak_bytes'] / 1e9:.2f}GB"
    if probe.get("host_ms") is not None and step_ms:
        fits += f" host {probe['host_ms'] / step_ms:.2f}"
    wall = probe.get("wall_ms", 0.0) / 1e3
    return f"{probe['stage']} b{probe['batch_size']} {fits} {wall:.1f}s {'+'.join(tags)}"


def _pick_words(pick: dict[str, Any]) -> str:
    choices = pick["choices"]
    words = [f"b{pick['batch_size']}"]
    if pick.get("accumulation_steps", 1) > 1:
        words[-1] += f"x{pick['accumulation_steps']}"
    for name, choice in choices.items():
        if choice in (None, False, "off", "fp32", [], "none"):
            continue
        words.append(choice if name == "precision" else f"{name}={json.dumps(choice)}")
    return " ".join(words)


def table(records: list[dict[str, Any]]) -> str:
    """One line per (model, compile, label): total, each stage, the pick and its samples/s."""
    head = ["model", "compile", "label", "total s", *STAGES, "pick", "samples/s"]
    rows = [head]
    key = lambda r: (r["model"], r["compile"], r["label"] != "before", r["label"])  # noqa: E731
    for r in sorted(records, key=key):
        if "error" in r:
            rows.append([r["model"], r["compile"], r["label"], "failed", *[""] * len(STAGES)])
            continue
        stages = r.get("stage_wall_s", {})
        rows.append(
            [
                r["model"],
                r["compile"],
                r["label"],
                f"{r['plan_wall_s']:.0f}",
                *[f"{stages[s]:.0f}" if s in stages else "-" for s in STAGES],
                _pick_words(r["pick"]),
                f"{r['verified_samples_per_s']:.0f}",
            ]
        )
    widths = [max(len(str(row[i])) for row in rows if i < len(row)) for i in range(len(head))]
    return "\n".join(
        "  ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=False)) for row in rows
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="gpt,gpt2")
    parser.add_argument("--budget-gb", type=float, default=8.0)
    parser.add_argument("--compile", default="auto", choices=("auto", "on", "off"))
    parser.add_argument("--label", default="after", help="the code that ran: before or after")
    add_cache_flags(parser)
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--save-plans", type=Path, help="keep each plan as DIR/<model>.json")
    parser.add_argument("--timeout-s", type=float, help="end a plan after this long")
    parser.add_argument(
        "--bytecode-dir",
        type=Path,
        help="Python's bytecode written and read here in the plan's processes, as a user's "
        "install has torch's (PYTHONPYCACHEPREFIX; PYTHONDONTWRITEBYTECODE unset)",
    )
    parser.add_argument("--table", type=Path, help="print the table of these JSON lines; no runs")
    parser.add_argument(
        "--device",
        default="cuda",
        choices=("cuda", "simulated", "estimate"),
        help="cuda: the bench; estimate or simulated: a CPU smoke of its plumbing",
    )
    parser.add_argument(
        "--compile-search",
        type=json.loads,
        default=None,
        help="JSON of CompileSearch's fields for the compile stage, e.g. "
        "'{\"dynamic_batch\": false}' (the search in static forms)",
    )
    parser.add_argument(
        "--runs-at-once",
        type=int,
        help="the card device's most runs made at once in the plan (memadvisor.device.cuda's "
        "MAX_CONCURRENT_RUNS, 8): an A/B of it; the row says runs_at_once_max",
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(
            args.child,
            args.budget_gb,
            args.compile,
            args.out,
            args.device,
            args.compile_search,
            args.runs_at_once,
        )
        # The exit as the command ends (session 38): threads joined, exit handlers run, no
        # teardown of every module.
        from memadvisor.cli import _end

        _end(0)
    if args.compile_search:
        from pydantic import ValidationError

        from strategies._compile_search import CompileSearch

        try:
            CompileSearch(**args.compile_search)
        except (TypeError, ValidationError) as e:
            sys.exit(f"--compile-search {json.dumps(args.compile_search)}: {e}")
    if args.runs_at_once is not None and args.runs_at_once < 1:
        sys.exit(f"--runs-at-once {args.runs_at_once}: give 1 or more runs at once")
    if args.table:
        records = [json.loads(line) for line in args.table.read_text().splitlines() if line]
        print(table(records))
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("plan_speed times plans on a GPU; torch.cuda.is_available() is False here.")
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        sys.exit(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    records = []
    for model in names:
        if reason := missing(model):
            print(reason, file=sys.stderr, flush=True)
            continue
        record = plan_one(
            model,
            args.budget_gb,
            args.compile,
            args.label,
            args.warm_cache,
            args.device,
            save_to=args.save_plans / f"{model}.json" if args.save_plans else None,
            timeout_s=args.timeout_s,
            compile_search=args.compile_search,
            bytecode_dir=args.bytecode_dir,
            runs_at_once=args.runs_at_once,
        )
        print(json.dumps(record), flush=True)
        with args.json.open("a") as f:
            f.write(json.dumps(record) + "\n")
        records.append(record)
    print(table(records))


if __name__ == "__main__":
    main()
