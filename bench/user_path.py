"""The user's own path on a GPU: memadvisor.plan() with a lambda loss, then their loop, set
against issue 27's hand grid.

For each model, at ``--budget-gib`` (default 8), one JSON line as soon as it is done (stdout,
and appended to ``--json``, default ``bench/results/user_path.jsonl``), then the table:

* plan: ``memadvisor.plan(model, sample_batch, loss_fn=lambda out, b: ..., budget_gb=...)``
  in this process, exactly as a user calls it (the loss a lambda, so the probes reach fresh
  processes only through cloudpickle), with a cold cache (``--cold-cache``, the default: a
  fresh ``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` per model, which the model's
  later processes share); or a saved plan (``--plan FILE``, or ``--plan DIR`` holding
  ``<model>.json`` as ``bench/plan_speed.py --save-plans DIR`` writes them). Reported: wall
  time, ``compile_s`` (the plan's compile stage), the pick, its verified samples/s, where the
  probes ran (``probe_mode``), whether compile was weighed.
* user loop: a fresh process builds the model, ``memadvisor.apply_plan(model, plan)``, caps
  the card at the budget and trains ``--steps`` (200) steps at the plan's batch and
  accumulation with its own AdamW and the loss outside the model, as the README shows (a
  plan whose step computes the loss another way, the chunked loss head, trains with
  ``model.memadvisor_step(batch)`` as apply_plan says: ``trained_with``); samples/s over the
  steps after ``--warmup`` (10), OOMs counted; ``loop_over_verified``.
* torch.compile (``--plain``, the default): the same loop in a fresh process with
  ``torch.compile(model)`` under an outer autocast of the plan's precision, at the same
  batch. User loop and plain compile alternate ``--repeats`` (2) times; each figure is the
  median of its runs (OOMs: the sum).
* hand grid (issue 27, ``bench/_hand_grid.py``): bf16 x {eager, compile} x checkpointing
  {none, half the blocks, all}, each cell at its own largest batch that holds
  ``--hold-steps`` (20) steps in a fresh process; ``hand_grid`` lists each cell (config,
  batch, samples/s, peak, the batches tried) and ``pick_over_best_hand`` is the pick's
  verified samples/s over the best cell's. ``--hand`` picks the cells: ``grid`` (all six),
  ``eager``, ``compile``, ``none``, or cell names (``compile+all,compile+half``). A compiled
  cell finds its edge with a dynamic batch (one compile for all its runs) and is measured
  static there (``--hand-search static``: static throughout, a compile per batch); each run
  is printed as it ends; a cell cut by ``--deadline-s`` or a Ctrl-C keeps the largest batch
  that held, marked ``interrupted`` and in no ratio. ``--cell-draws N`` runs each cell's form
  N - 1 more times at its batch, fresh processes: its ``samples_per_s`` is the median of the
  N (``samples_per_s_each``, ``draw_ooms``); with ``--rerun-pick --rerun-repeats N`` the pick
  is set against the cells median to median (``pick_rerun_over_best_hand``).
  ``--cells-at-once``: the cells' searches run side by side, each in a thread, their runs
  made together (``_hand_grid.measure_at_once``: at once on a card, timed steps in turn);
  the row says ``hand_cells_at_once``.
* ``--rerun-pick``: the pick run once more beside the hand cells, for a rate measured in
  the same call as theirs (``pick_rerun``, ``pick_rerun_over_best_hand``);
  ``--rerun-repeats N`` runs it N times, each a fresh process (``pick_rerun``'s
  ``samples_per_s`` their median, ``samples_per_s_each`` every one), and
  ``loop_over_rerun`` is the user's loop over that median: one fresh process's rate of the
  same pick on one host has differed by 1.4x (the GPT example on an H200, session 24:
  20,395 and 28,665 samples/s minutes apart), so a loop set against another process's
  verified rate measures that spread as much as the loop.
* largest holding (``--holding``, the default): the largest batch of the pick's choices that
  holds verify_steps (20) steps in a fresh process, found the same way; batch / that.

A model's measurements may come from several calls, each within a device's time limit:
with ``--label L``, the line written for (model, budget, L) joins the lines written before
it under the same label (the latest measurement of each field, every hand cell run), so the
last line of each model holds everything; ``--table`` shows those last lines.
``--deadline-s`` starts no loop or hand cell after that many seconds of the call.

    python bench/user_path.py --models cnn,gpt                        # ~5 min each on an H200
    python bench/user_path.py --models lm350m --plan /tmp/i27/plans --label i27 \\
        --hand eager --no-loops --no-holding                          # one part of a model
    python bench/user_path.py --table bench/results/user_path.jsonl   # the table again
    python bench/user_path.py --device simulated --models cnn --budget-gib 0.05 --steps 3 \\
        --warmup 1 --repeats 1 --no-plain --no-holding --hold-steps 2 --label smoke \\
        --hand eager+half,compile+all --json /tmp/u.jsonl             # the CPU smoke (CI)

Models: any of ``bench/_targets.py``'s (default: issue 27's, ``_targets.ISSUE_27``). A
model whose package is missing is skipped with a message; one that fails is a row with
its error.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import _hand_grid as grid  # bench/, first on sys.path when run as a script
from _cache import add_cache_flags, cold_cache
from _targets import ISSUE_27, TARGETS, missing

from memadvisor.process_state import environ_set

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
GIB = 2**30
RESULTS = HERE.parent / "results" / "user_path.jsonl"
MODELS = dict(TARGETS)


def _job(name: str) -> dict[str, Any]:
    """The model's factory dict, its loss turned into a lambda as a user writes it."""
    from memadvisor.target import load_factory

    job = dict(load_factory(MODELS[name])())
    loss = job.get("loss_fn")
    job["own_loss_fn"] = loss  # what apply_plan gets where the plan changed the loss
    if loss is not None:
        job["loss_fn"] = lambda out, batch: loss(out, batch)  # a closure: no name to pickle
    return job


# -- the user's loop, in a fresh process --------------------------------------------------------


def loop_step(
    workload: Any,
    model: Any,
    optimizer: Any,
    batch: Any,
    k: int,
    *,
    step: Any = None,
    outer: Any = None,
    device_type: str = "cuda",
    scaler: Any = None,
    marks: list[float] | None = None,
) -> None:
    """One optimizer step of the user's loop over ``k`` micro-batches: forward, the loss
    outside the model (``step``: the plan's step where it changed the loss; ``outer``: an
    autocast dtype on ``device_type`` around forward and loss, plain torch.compile's),
    backward, the optimizer's step (``scaler``: fp16's GradScaler), ``zero_grad``.
    ``marks``: the host's clock appended when forward and loss, backward, and the
    optimizer have returned (no sync: where the host's time in a step goes)."""
    import torch

    def mark() -> None:
        if marks is not None:
            marks.append(time.perf_counter())

    for _ in range(k):
        around = (
            torch.autocast(device_type, dtype=outer)
            if outer is not None
            else contextlib.nullcontext()
        )
        with around:
            if step is not None:
                output = None
                loss = step(batch) / k
            else:
                output = workload.forward(model, batch)
            if outer is not None:  # plain torch.compile: the loss under the autocast
                loss = workload.loss(output, batch) / k
        if outer is None and step is None:  # apply_plan: the loss outside, as it comes
            loss = workload.loss(output, batch) / k
        mark()
        (scaler.scale(loss) if scaler else loss).backward()
        del output, loss
        mark()
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark()


def user_loop(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["mode"]``: ``apply`` (apply_plan) or ``torch_compile`` (plain torch.compile
    under an outer autocast); trains ``spec["steps"]`` steps at the plan's batch."""
    import torch

    import memadvisor
    from memadvisor import _torch_private
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
    step = None
    if spec["mode"] == "apply":
        model = memadvisor.apply_plan(model, plan, loss_fn=job.get("own_loss_fn")).to(device)
        outer = None
        if model.memadvisor_step.loss_changed_by:
            # The plan computes the loss another way (the head and the loss in chunks):
            # apply_plan's documented loop trains with the step, not loss_fn(model(x)).
            step = model.memadvisor_step
            out_words = f"the plan's step ({', '.join(step.loss_changed_by)} changed the loss)"
    else:
        model = torch.compile(model.to(device), backend=spec["compile_backend"])
        outer = dtype
    # fused=True: the update in a few fused kernels, the optimizer_habits advice (fewer
    # launches for a step the host bounds: bench/process_spread.py --fused-optimizer).
    fused = {"fused": True} if spec.get("fused_optimizer") else {}
    optimizer = torch.optim.AdamW(model.parameters(), **fused)
    scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
    batch = workload.batch(cand.batch_size, device)
    k = cand.accumulation_steps
    times: list[float] = []
    out: dict[str, Any] = {"ooms": 0, "steps": 0, "batch": cand.batch_size}
    if step is not None:
        out["trained_with"] = out_words

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def retries() -> int:
        """The caching allocator's retries so far: a retry frees the cache and allocates
        again, a step's worth of time near the cap (docs/design.md, session 22)."""
        return _torch_private.cuda_memory_counters(device)["alloc_retries"] if cuda else 0

    retried: list[int] = []  # by step, the allocator's retries in it
    # By step, the host's time to hand the step to the card (loop_step's return, before the
    # sync): near the step's time, the card waits on the host and the host's speed is the
    # rate; far below it, the card's work is (bench/process_spread.py's question).
    queued: list[float] = []
    # By step, the host's time in forward and loss, backward, and the optimizer (the last
    # micro-batch's for the first two), from loop_step's marks.
    phases: list[tuple[float, float, float]] = []

    def one_step(marks: list[float] | None = None) -> None:
        loop_step(
            workload, model, optimizer, batch, k,
            step=step, outer=outer, device_type=device.type, scaler=scaler, marks=marks,
        )  # fmt: skip

    try:
        for _ in range(spec["steps"]):
            sync()
            before = retries()
            marks: list[float] = []
            t0 = time.perf_counter()
            one_step(marks)
            loss_at, backward_at, optimizer_at = marks[-3:]
            queued.append(optimizer_at - t0)  # loop_step's last mark is its return
            forward_from = marks[-4] if len(marks) > 3 else t0  # the last micro-batch's
            phases.append(
                (loss_at - forward_from, backward_at - loss_at, optimizer_at - backward_at)
            )
            sync()
            times.append(time.perf_counter() - t0)
            retried.append(retries() - before)
            out["steps"] += 1
    except Exception as e:  # noqa: BLE001 - an OOM is the answer; anything else is reported
        if not is_oom(e):
            raise
        out["ooms"] = 1
        out["error"] = str(e).splitlines()[0][:200] if str(e) else "OOM"
    steady = times[spec["warmup"] :]
    if steady:
        out["samples_per_s"] = cand.batch_size * k * len(steady) / sum(steady)
        # The plan's rate is a median of its steps; the mean above is what the user gets. A
        # gap between the two is slow steps (an allocator freeing its cache at the cap).
        middle = statistics.median(steady)
        out["samples_per_s_median"] = cand.batch_size * k / middle
        out["slowest_step_s"] = max(steady)
        # Where the slow steps fall (indices after the warm-up, over 1.5x the median): every
        # n-th (a collector, a periodic host task), together (a clock, a neighbour), or few.
        out["slow_steps"] = [i for i, t in enumerate(steady) if t > 1.5 * middle]
        ordered = sorted(steady)
        out["step_ms_p10_p50_p90"] = [
            1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))] for q in (0.1, 0.5, 0.9)
        ]
        # Every step's time (ms, the warm-up's too): whether the first steps after the
        # compile, which a plan's 20-step run times, run faster than the loop's later ones.
        out["step_ms"] = [round(1e3 * t, 2) for t in times]
        # The median rate of each quarter of the steps: a loop that slows as it goes (a card
        # that lowers its clocks under sustained load) against the plan's 20-step run.
        quarter = max(1, len(steady) // 4)
        out["samples_per_s_by_quarter"] = [
            cand.batch_size * k / statistics.median(steady[i : i + quarter])
            for i in range(0, quarter * 4 if len(steady) >= 4 else len(steady), quarter)
        ]
        out["queue_ms_p50"] = 1e3 * statistics.median(queued[spec["warmup"] : len(times)])
        out["queue_over_step"] = out["queue_ms_p50"] / (1e3 * middle)
        timed = phases[spec["warmup"] : len(times)]
        out["host_ms_forward_backward_optimizer"] = [
            1e3 * statistics.median(p[i] for p in timed) for i in range(3)
        ]
        if cuda and spec.get("profile_steps") and not out["ooms"]:
            busy_ms, kernels = _card_busy(one_step, int(spec["profile_steps"]))
            out["card_busy_ms_per_step"] = busy_ms
            out["card_busy_over_step"] = busy_ms / (1e3 * middle)
            out["kernels_per_step"] = kernels
    out["first_step_s"] = times[0] if times else None
    out["cpu"] = _last_cpu()  # where the loop's thread ran last (process_spread.py's question)
    # Steps after the warm-up in which the allocator retried, and its retries in them: where
    # the loop's mean falls below its median, whether the cap's retries are why.
    out["retried_steps"] = sum(1 for r in retried[spec["warmup"] :] if r > 0)
    out["alloc_retries"] = sum(retried[spec["warmup"] :])
    if cuda:
        out["peak_gib"] = torch.cuda.max_memory_reserved() / GIB
    return out


def _card_busy(one_step: Any, steps: int) -> tuple[float, float]:
    """The card's kernel time a step (ms) and its kernels (and copies) a step, from the
    profiler over ``steps`` more steps: the sum of the kernels' own device times, gaps
    between them left out. Against the step's wall time, the share of it the card computes;
    the rest it waits (on the host, or on copies). Known limitation: kernels on several
    streams at once count twice."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            one_step()
        torch.cuda.synchronize()
    on_card = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    busy_us = sum(e.self_device_time_total for e in on_card)
    return busy_us / 1e3 / max(1, steps), sum(e.count for e in on_card) / max(1, steps)


def loop_rounds(spec: dict[str, Any]) -> dict[str, Any]:
    """``spec["rounds"]`` (1) user loops one after the other in this process, each with a new
    model, optimizer and batch (the last one's memory released first); the last loop's
    record, with every round's mean and median rate and the card's clocks after it
    (``rounds``). Why: whether a rate is set when a process starts (it holds over rounds)
    or by what each build allocates (it moves between rounds: bench/process_spread.py)."""
    import gc

    count = max(1, int(spec.get("rounds", 1)))
    rounds: list[dict[str, Any]] = []
    out: dict[str, Any] = {}
    for i in range(count):
        if i:
            gc.collect()
            if spec["device"] == "cuda":
                import torch

                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
        out = user_loop(spec)
        rounds.append(
            {
                "samples_per_s": out.get("samples_per_s"),
                "samples_per_s_median": out.get("samples_per_s_median"),
                "first_step_s": out.get("first_step_s"),
                "queue_over_step": out.get("queue_over_step"),
                "card_busy_over_step": out.get("card_busy_over_step"),
                "card": card_state() if spec["device"] == "cuda" else None,
            }
        )
        if out.get("ooms"):
            break
    if count > 1:
        out["rounds"] = rounds
    return out


def card_state() -> dict[str, str] | None:
    """The first visible card's SM and memory clocks, power and temperature now, as
    nvidia-smi reports them (None where it cannot be run)."""
    return card_query(("clocks.sm", "clocks.mem", "power.draw", "temperature.gpu"))


def card_query(fields: Sequence[str]) -> dict[str, str] | None:
    """nvidia-smi's ``--query-gpu`` of ``fields`` for the first card ``CUDA_VISIBLE_DEVICES``
    names (its index; card 0 where unset), each as nvidia-smi writes it; None where
    nvidia-smi cannot be run or answers otherwise."""
    card = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    try:
        done = subprocess.run(
            ["nvidia-smi", "-i", card, f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    values = [v.strip() for v in done.stdout.strip().split(",")]
    return dict(zip(fields, values, strict=True)) if len(values) == len(fields) else None


def _last_cpu() -> int | None:
    """The core this process's main thread last ran on (Linux: /proc/self/stat's field 39);
    None elsewhere."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[36])  # field 39 counted from 1, after pid and (comm)
    except (OSError, IndexError, ValueError):
        return None


def _fresh(spec: dict[str, Any], timeout_s: float, cpus: set[int] | None = None) -> dict[str, Any]:
    """The loop of ``spec`` in a fresh process (``cpus``: the cores it and everything it
    starts may run on; None: the scheduler's choice), its USER_LOOP line's record."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        done = subprocess.run(
            [sys.executable, str(HERE), "--user-loop", f.name],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=ROOT,
            preexec_fn=None if cpus is None else (lambda: os.sched_setaffinity(0, cpus)),
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


class Clock:
    """The call's start, and whether ``--deadline-s`` has passed (no new loop or cell then)."""

    def __init__(self, deadline_s: float | None) -> None:
        self.start = time.perf_counter()
        self.deadline_s = deadline_s
        self.stopped = False  # interrupted: nothing more starts

    def passed(self) -> bool:
        if self.stopped:
            return True
        return self.deadline_s is not None and time.perf_counter() - self.start > self.deadline_s


def device_for(kind: str, budget_bytes: int, name: str, profile: Any) -> Any:
    """The device the bench measures on: the CPU's simulated card, or the card through a fork
    server (the model built from its target in the probe processes)."""
    if kind == "simulated":
        from memadvisor.device.simulated import SimulatedDevice

        return SimulatedDevice(budget_bytes, profile=profile)
    from memadvisor.device.cuda import CudaDevice

    return CudaDevice(budget_bytes, target=MODELS[name], profile=profile, fork_server=True)


def workload_of(name: str) -> Any:
    """The model's workload, its loss a lambda as a user writes it (:func:`_job`)."""
    from memadvisor.workload import Workload

    job = _job(name)
    return Workload(
        model=job["model"], sample_batch=job["sample_batch"], loss_fn=job.get("loss_fn")
    )


def _plan(name: str, args: argparse.Namespace, row: dict[str, Any]) -> Any:
    """The plan (made here, as a user makes it, or read from ``--plan``); its wall time and
    compile stage go into ``row``."""
    import memadvisor

    if args.plan is not None:
        path = args.plan / f"{name}.json" if args.plan.is_dir() else args.plan
        plan = memadvisor.Plan.model_validate_json(path.read_text())
        row["plan_wall_s"] = round(plan.plan_wall_ms / 1e3, 1)
        row["plan_from"] = str(path)
    else:
        job = _job(name)
        _say(f"{name}: planning")
        t0 = time.perf_counter()
        plan = memadvisor.plan(
            job["model"],
            job["sample_batch"],
            loss_fn=job.get("loss_fn"),
            budget_gb=args.budget_gib,
            device=args.device,
            progress=False,
            measure_comparison=False,
        )
        row["plan_wall_s"] = round(time.perf_counter() - t0, 1)
        if args.save_plans is not None:
            args.save_plans.mkdir(parents=True, exist_ok=True)
            (args.save_plans / f"{name}.json").write_text(plan.model_dump_json())
    row["stage_wall_s"] = {k: round(v / 1e3, 1) for k, v in plan.stage_wall_ms.items()}
    row["compile_s"] = row["stage_wall_s"].get("compile")
    _say(f"{name}: plan {row['plan_wall_s']} s, batch {plan.candidate.batch_size}")
    return plan


def _pick_fields(plan: Any, args: argparse.Namespace) -> dict[str, Any]:
    cand = plan.candidate
    in_process = [n for n in plan.notes if n.startswith("Probes ran in this process")]
    return {
        "pick": {k: v for k, v in cand.choices.items() if k != "batch_size"},
        "batch": cand.batch_size,
        "accumulation_steps": cand.accumulation_steps,
        "verified_samples_per_s": plan.verified.samples_per_s if plan.verified else None,
        "verified_peak_gib": plan.verified.limit_bytes / GIB if plan.verified else None,
        "compile_weighed": any(stage.strategy == "compile" for stage in plan.stages),
        "probe_mode": (
            "simulated" if args.device == "simulated" else ("in_process" if in_process else "fresh")
        ),
        "notes": plan.notes,
    }


def _loops(name: str, plan: Any, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    """The user's loop after apply_plan, and plain torch.compile, in fresh processes."""
    with tempfile.NamedTemporaryFile("w", suffix=".plan.json", delete=False) as f:
        f.write(plan.model_dump_json())
    spec = {
        "model": name,
        "plan": f.name,
        "device": args.device,
        "budget_bytes": round(args.budget_gib * GIB),
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
            if clock.passed():
                _say(f"{name}: deadline passed, no more loops")
                break
            users.append(_fresh({**spec, "mode": "apply"}, args.timeout_s))
            _say(f"{name}: user loop {users[-1].get('samples_per_s')}")
            if args.plain:
                plains.append(_fresh({**spec, "mode": "torch_compile"}, args.timeout_s))
                _say(f"{name}: torch.compile {plains[-1].get('samples_per_s')}")
    finally:
        os.unlink(f.name)
    return {
        "user_loop": users,
        "user_loop_samples_per_s": _median([u.get("samples_per_s") for u in users]),
        "user_loop_ooms": sum(int(u.get("ooms") or 0) for u in users) if users else None,
        "user_loop_steps": sum(int(u.get("steps") or 0) for u in users) if users else None,
        "torch_compile": plains,
        "torch_compile_samples_per_s": _median([p.get("samples_per_s") for p in plains]),
    }


def _grid(
    plan: Any, name: str, args: argparse.Namespace, device: Any, clock: Clock
) -> list[dict[str, Any]]:
    """The hand cells ``--hand`` names, each at its own largest batch that holds.

    Each cell's record is printed as it ends (a ``HAND_CELL`` JSON line), and a Ctrl-C (a
    call's ``timeout -s INT``) during a cell ends the grid with the cells before it kept,
    the row still written: session 16 lost a finished cell's rate to a deadline that cut
    the next cell."""
    if args.cells_at_once:
        return _grid_at_once(plan, name, args, device, clock)
    measure = _cell_measure(plan, name, args)
    out = []
    for cell in grid.cells(args.hand):
        if clock.passed():
            why = "interrupted" if clock.stopped else "deadline"
            out.append({"config": cell, "skipped": why})
            _say(f"{name}: {why}, {cell} not run")
            continue
        _say(f"{name}: hand cell {cell}")
        try:
            record = measure(cell, device)
        except KeyboardInterrupt:
            clock.stopped = True
            record = {"config": cell, "skipped": "interrupted"}
        except Exception as e:  # noqa: BLE001 - one cell failing is a cell, not a crash
            record = {"config": cell, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        _cell_done(name, record, clock)
        out.append(record)
    return out


def _cell_done(name: str, record: dict[str, Any], clock: Clock) -> None:
    """A cell's record said and printed (a ``HAND_CELL`` line); where it was cut (interrupted,
    or its draws stopped), the clock stops: nothing more starts."""
    clock.stopped = clock.stopped or bool(record.get("interrupted") or record.get("draws_stopped"))
    outcome = record.get("runs", record.get("error", record.get("skipped")))
    _say(f"{name}: {record['config']}: {outcome}")
    print("HAND_CELL " + json.dumps(record), flush=True)


def _cell_measure(
    plan: Any, name: str, args: argparse.Namespace
) -> Callable[[str, Any], dict[str, Any]]:
    """``measure(cell, device)``: the cell's record (``_hand_grid.measure_cell``) as the
    arguments ask for it."""
    workload = workload_of(name)

    def measure(cell: str, device: Any) -> dict[str, Any]:
        return grid.measure_cell(
            cell,
            device=device,
            workload=workload,
            profile=plan.profile,
            config=plan.config,
            steps=args.hold_steps,
            say=lambda words: _say(f"{name}: {words}"),
            dynamic_search=args.hand_search == "dynamic",
            draws=args.cell_draws,
        )

    return measure


def _grid_at_once(
    plan: Any, name: str, args: argparse.Namespace, device: Any, clock: Clock
) -> list[dict[str, Any]]:
    """:func:`_grid` with the cells' searches side by side (``--cells-at-once``), their runs
    made together; each record is printed once every cell has ended."""
    cells = grid.cells(args.hand)
    if clock.passed():
        why = "interrupted" if clock.stopped else "deadline"
        _say(f"{name}: {why}, no hand cell run")
        return [{"config": cell, "skipped": why} for cell in cells]
    _say(f"{name}: hand cells {', '.join(cells)}, side by side")
    out = grid.measure_at_once(cells, _cell_measure(plan, name, args), device, workload_of(name))
    for record in out:
        _cell_done(name, record, clock)
    return out


def _rerun_pick(plan: Any, name: str, args: argparse.Namespace, device: Any) -> dict | None:
    """The pick again, ``--rerun-repeats`` times, each at its batch for ``--hold-steps``
    steps in a fresh process, beside the hand cells: its rate measured in the same call as
    theirs (the verified rate came from the plan's process, maybe another hour, and the
    host's noise is of the order of the 3% compared); ``samples_per_s`` is the median."""
    rates: list[float] = []
    peak_gib = None
    repeats = max(1, args.rerun_repeats)
    for i in range(repeats):
        _say(f"{name}: the pick again ({i + 1} of {repeats})")
        try:
            m = device.run(workload_of(name), plan.candidate, args.hold_steps)
        except Exception as e:  # noqa: BLE001 - an OOM here is a finding, not a crash
            return {"error": f"{type(e).__name__}: {str(e)[:300]}", "samples_per_s_each": rates}
        rates.append(round(m.samples_per_s, 2))
        peak_gib = round(m.peak_bytes / GIB, 3)
    return {
        "batch": plan.candidate.batch_size,
        "samples_per_s": _median(rates),
        "samples_per_s_each": rates,
        "peak_gib": peak_gib,
    }


def _largest_holding(plan: Any, name: str, device: Any) -> int | None:
    """The largest batch of the pick's choices that holds verify_steps steps from a clean
    state, searched from the pick's batch (``_hand_grid.largest_holding``)."""
    from memadvisor.schema.candidate import Candidate

    workload = workload_of(name)
    choices = {k: v for k, v in plan.candidate.choices.items() if k != "batch_size"}
    steps = plan.config.verify_steps

    def run(batch: int) -> Any:
        _say(f"holding: batch {batch}")
        return device.run(workload, Candidate(batch_size=batch, choices=choices), steps)

    found = grid.largest_holding(
        run, plan.candidate.batch_size, plan.config.budget_bytes, plan.config.max_batch,
        device.is_oom,
    )  # fmt: skip
    _say(f"holding search ({name}): {found.runs_text()} -> {found.batch}")
    return found.batch or None


def bench_one(name: str, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    import torch

    row: dict[str, Any] = {"model": name, "budget_gib": args.budget_gib, "label": args.label}
    row["device"] = torch.cuda.get_device_name() if args.device == "cuda" else "simulated"
    plan = _plan(name, args, row)
    row |= _pick_fields(plan, args)
    row |= _loops(name, plan, args, clock)
    # The cells run under the allocator the plan ran under: a pick measured under expandable
    # segments against cells under the default allocator would compare allocators, not
    # configurations (docs/design.md, "The allocator is part of the plan").
    with environ_set(_cells_allocator(plan)):
        row["hand_alloc_conf"] = _alloc_conf()
        _cells(row, plan, name, args, clock)
    return grid.derive(row)


def _alloc_conf() -> str | None:
    """The allocator settings this process's environment gives processes it starts."""
    from strategies.allocator import VARIABLES

    return next((os.environ[n] for n in VARIABLES if os.environ.get(n)), None)


def _cells_allocator(plan: Any) -> dict[str, str]:
    """The variable that puts the hand cells under the plan's allocator ({}: as they are)."""
    from strategies.allocator import EXPANDABLE, planned_environment, users_setting

    if plan.candidate.choices.get("allocator") != EXPANDABLE or users_setting() is not None:
        return {}
    return planned_environment()


def _cells(row: dict[str, Any], plan: Any, name: str, args: Any, clock: Clock) -> None:
    """The hand grid, the pick again and its largest holding batch, in ``row``."""
    device = device_for(args.device, round(args.budget_gib * GIB), name, plan.profile)
    try:
        row["hand_grid"] = _grid(plan, name, args, device, clock)
        row["hand_cells_at_once"] = bool(args.cells_at_once)
        row["pick_rerun"] = (
            _rerun_pick(plan, name, args, device)
            if args.rerun_pick and not clock.passed()
            else None
        )
        row["largest_batch_holding"] = (
            _largest_holding(plan, name, device) if args.holding and not clock.passed() else None
        )
    finally:
        device.close()


def _say(text: str) -> None:
    """A timestamped progress line on stderr: a run cut off by a time limit still says where."""
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def _median(values: list[float | None]) -> float | None:
    import statistics

    seen = [v for v in values if v is not None]
    return statistics.median(seen) if seen else None


# -- lines and table ----------------------------------------------------------------------------


def _key(row: dict[str, Any]) -> tuple:
    return (row.get("model"), row.get("budget_gib"), row.get("label"))


def _read(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


# What tells one plan's line from another's: where both lines have a field and it differs,
# the earlier line measured another plan.
_PLAN_FIELDS = ("pick", "batch", "accumulation_steps", "verified_samples_per_s")
# What a line of another plan still gives the row: its hand cells (they are the model's at
# the budget, whatever the plan).
_ANY_PLAN_FIELDS = ("model", "budget_gib", "label", "hand_grid")


def _same_plan(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(a.get(k) is None or b.get(k) is None or a.get(k) == b.get(k) for k in _PLAN_FIELDS)


def joined(row: dict[str, Any], earlier: list[dict[str, Any]]) -> dict[str, Any]:
    """``row`` joined with the earlier good lines of its (model, budget, label), where it
    has a label and is good itself (no ``error``). An earlier line of another plan (another
    pick, batch or verified rate) gives its hand cells only: its loop is not this plan's
    (session 17 joined swin_t's eager cells, measured against one plan, with the loop of
    another and read 0.89 where each plan's own was 0.94 and 1.00)."""
    if row.get("label") is None or "error" in row:
        return row
    same = [
        r if _same_plan(r, row) else {k: r[k] for k in _ANY_PLAN_FIELDS if k in r}
        for r in earlier
        if _key(r) == _key(row) and "error" not in r
    ]
    return grid.merge_rows([*same, row]) if same else row


def latest(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lines a table shows: each labelled (model, budget, label)'s last good line, and
    every unlabelled or failed line, in file order."""
    last = {
        _key(r): i for i, r in enumerate(rows) if r.get("label") is not None and "error" not in r
    }
    return [
        r
        for i, r in enumerate(rows)
        if r.get("label") is None or "error" in r or last.get(_key(r)) == i
    ]


def _rate(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f}"


def _num(x: float | None, digits: int = 2) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _pick_text(pick: dict[str, Any]) -> str:
    words = []
    for k, v in pick.items():
        if v in (None, False, "off", "fp32", [], "none", "advice"):
            continue
        words.append(f"{len(v)} ckpt" if isinstance(v, list) else (v if k == "precision" else k))
    return "+".join(words) or "plain"


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'model':13s} {'GiB':>4s} {'plan s':>6s} {'cmp s':>5s} {'pick':22s} {'batch':>7s} "
        f"{'verified':>8s} {'loop':>7s} {'OOM':>3s} {'loop/ver':>8s} {'best hand':>13s} "
        f"{'hand/s':>7s} {'pick/hand':>9s} {'rerun/hand':>10s} {'cells':>5s} {'b/hold':>6s}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        if "error" in r:
            print(f"{r['model']:13s} {r.get('budget_gib', '')!s:>4} {r['error'][:150]}")
            continue
        loop = r.get("user_loop_samples_per_s")
        verified = r.get("verified_samples_per_s")
        best = r.get("best_hand_samples_per_s")
        ooms = r.get("user_loop_ooms")
        print(
            f"{r['model']:13s} {r['budget_gib']:>4g} {_num(r.get('plan_wall_s'), 0):>6s} "
            f"{_num(r.get('compile_s'), 0):>5s} {_pick_text(r.get('pick', {}))[:22]:22s} "
            f"{r['batch']}x{r.get('accumulation_steps', 1):<3} {_rate(verified):>8s} "
            f"{_rate(loop):>7s} {'-' if ooms is None else ooms!s:>3} "
            f"{_num(loop / verified if loop and verified else None):>8s} "
            f"{r.get('best_hand') or '-':>13s} {_rate(best):>7s} "
            f"{_num(verified / best if verified and best else None):>9s} "
            f"{_num(r.get('pick_rerun_over_best_hand')):>10s} "
            f"{r.get('hand_cells', '-'):>5s} {_num(r.get('batch_over_holding')):>6s}"
        )
    print(
        "\nplan s: the plan's wall time (cold cache); cmp s: its compile stage; loop: the "
        "user's loop with apply_plan() in a fresh process, samples/s after warm-up; best "
        "hand: the best cell of the grid below; pick/hand: the pick's verified samples/s "
        "over it (issue 27: at least 0.97); rerun/hand: the same for the pick run again "
        "beside the cells (--rerun-pick); loop/ver: the loop over the verified rate (at "
        "least 0.97, 0 OOMs); b/hold: the batch over the largest of the pick's choices that "
        "holds."
    )
    gridded = [r for r in rows if r.get("hand_grid")]
    if not gridded:
        return
    print(f"\n{'model':13s} " + " ".join(f"{c:>14s}" for c in grid.GRID))
    for r in gridded:
        cells = {c["config"]: c for c in r["hand_grid"]}
        texts = []
        for c in grid.GRID:
            cell = cells.get(c)
            if cell is None:
                texts.append("-")
            elif cell.get("samples_per_s") is None:
                texts.append("skipped" if "skipped" in cell else "failed")
            else:
                texts.append(f"{cell['batch']}@{cell['samples_per_s']:.0f}")
        print(f"{r['model']:13s} " + " ".join(f"{t:>14s}" for t in texts))
    print("\nhand cells: bf16; the largest batch that held --hold-steps steps @ its samples/s.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(ISSUE_27), help=f"of {sorted(MODELS)}")
    parser.add_argument("--budget-gib", type=float, default=8.0)
    parser.add_argument("--steps", type=int, default=200, help="steps of the user's loop")
    parser.add_argument("--warmup", type=int, default=10, help="steps not timed (compile)")
    parser.add_argument(
        "--hand",
        default="grid",
        help=f"hand cells: grid, eager, compile (three cells each), none, or some of "
        f"{','.join(grid.GRID)} (eager+none, compile+none: the bare cell alone)",
    )
    parser.add_argument(
        "--cell-draws",
        type=int,
        default=1,
        help="runs of each hand cell's form at its batch, fresh processes; its rate their median",
    )
    parser.add_argument(
        "--hand-search",
        choices=("dynamic", "static"),
        default="dynamic",
        help="how a compiled hand cell finds its edge: with a dynamic batch (one compile "
        "serves every run), then one static run there (default); or static runs throughout "
        "(a compile per batch)",
    )
    parser.add_argument("--hold-steps", type=int, default=20, help="steps a hand cell holds")
    parser.add_argument(
        "--cells-at-once",
        action="store_true",
        help="search the hand cells side by side, their runs made together (at once on a card)",
    )
    parser.add_argument(
        "--rerun-pick", action="store_true", help="run the pick again beside the hand cells"
    )
    parser.add_argument(
        "--rerun-repeats", type=int, default=1, help="fresh runs of the pick (their median)"
    )
    parser.add_argument("--no-holding", dest="holding", action="store_false")
    parser.add_argument("--no-loops", dest="loops", action="store_false")
    parser.add_argument(
        "--no-plain", dest="plain", action="store_false", help="no plain torch.compile loop"
    )
    parser.add_argument("--save-plans", type=Path, default=None, help="keep DIR/<model>.json")
    parser.add_argument(
        "--plan",
        type=Path,
        default=None,
        help="a saved plan or a DIR of <model>.json",
    )
    parser.add_argument(
        "--repeats", type=int, default=2, help="user loop / torch.compile pairs, interleaved"
    )
    parser.add_argument("--compile-backend", default="inductor", help="eager for a CPU smoke")
    parser.add_argument("--timeout-s", type=float, default=900.0, help="per fresh process")
    parser.add_argument("--deadline-s", type=float, default=None, help="no loop or cell after")
    add_cache_flags(parser)
    parser.add_argument("--label", default=None, help="join this model's lines of that label")
    parser.add_argument("--json", type=Path, default=RESULTS, help="append JSON lines here")
    parser.add_argument("--table", type=Path, default=None, help="print a --json file's table")
    parser.add_argument("--device", choices=("cuda", "simulated"), default="cuda")
    parser.add_argument("--user-loop", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.user_loop is not None:
        result = loop_rounds(json.loads(args.user_loop.read_text()))
        print("USER_LOOP " + json.dumps(result), flush=True)
        return
    if args.table is not None:
        print_table(latest(_read(args.table)))
        return
    try:
        grid.cells(args.hand)
    except ValueError as e:
        sys.exit(str(e))
    names = [m for m in args.models.split(",") if m]
    unknown = [m for m in names if m not in MODELS]
    if unknown:
        sys.exit(f"unknown models {unknown}; choose from {sorted(MODELS)}")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/user_path.py needs a CUDA device (or --device simulated for a smoke run).")
    print("torch", torch.__version__, flush=True)
    clock = Clock(args.deadline_s)
    rows = []
    for name in names:
        if reason := missing(name):
            print(reason, file=sys.stderr, flush=True)
            continue
        t0 = time.perf_counter()
        try:
            with cold_cache(name, not args.warm_cache):
                row = bench_one(name, args, clock)
        except Exception as e:  # noqa: BLE001 - a missing package or an infeasible budget
            row = {
                "model": name,
                "budget_gib": args.budget_gib,
                "label": args.label,
                "error": f"{type(e).__name__}: {e}",
            }
        row["total_s"] = round(time.perf_counter() - t0, 1)
        # The loop's allocator: expandable segments moved the GPT example's loop from 0.76 to
        # 0.94 of its verified rate in one run each (docs/design.md, session 13).
        row["alloc_conf"] = _alloc_conf()
        if args.json is not None:
            row = joined(row, _read(args.json))
            args.json.parent.mkdir(parents=True, exist_ok=True)
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")
        rows.append(row)
        print(json.dumps(row), flush=True)
    print()
    print_table(rows)


if __name__ == "__main__":
    main()
