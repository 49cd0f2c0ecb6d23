"""The estimate against what a card measures: ``torch.cuda.max_memory_allocated`` per step.

For each model: profile it once (fp32 and bf16), then for each precision and checkpointing
(none / every block) pick the batch sizes whose *estimated* peak fills about 4, 8 and 16 GiB,
train each for two steps on a fresh copy (``apply_candidate``; the second step is the steady
state: optimizer state held through forward and backward) and compare the estimate with the
allocator's peak over those steps. cuBLAS's workspaces are freed before each run so that it
makes them again inside the measurement, as a fresh process would; memory is freed between
runs and between models.

    python bench/estimate_accuracy.py --json acc.jsonl       # CUDA: the full table
    python bench/estimate_accuracy.py --models cnn gpt       # some models only
    python bench/estimate_accuracy.py --device cpu --models cnn --precisions fp32 \
        --targets 0.05 0.1 --json smoke.jsonl                 # a smoke run here (~1 min)

Models, all built from configs (no downloads): examples/cnn.py, examples/gpt.py,
examples/llama.py; torchvision resnet18 and convnext_tiny; transformers BertForMaskedLM
(bert-base config, sequence 512) and a small LlamaForCausalLM (8 layers of 1024, sequence
1024). A model whose package is missing is skipped with a line saying so; a model that fails
otherwise is reported and the run goes on.

On the CPU (``--device cpu``) the measurement is the simulated device's tracked peak.

Cost: the full CUDA run (7 models, 84 runs) is meant to finish in under 6 minutes on an
H200. ``--time-budget-s`` (default 330) stops starting new runs past it, so a slow card still
ends with a table; what was skipped is said. ``--json PATH`` gets one JSON line per profile
and per run as it happens (a run cut short still leaves its lines), then a summary line.
``--profiles DIR`` saves each profile there and reuses a saved one on the next call (for
re-measuring with the same profiles; delete the folder after changing the profiler).

Prints one line per run as it goes, then the table (model, precision, checkpointing, target
GiB, batch, estimate MiB, measured MiB, error %) and the median and worst absolute error
(target: median within 5%, worst within 10%).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _models import bert_base, hf_llama, vision  # bench/, first on sys.path
from _recorder import Recorder

from memadvisor._torch_private import clear_cublas_workspaces
from memadvisor.device._autocast import cuda_autocast_policy
from memadvisor.device.simulated import SimulatedDevice
from memadvisor.estimate import estimate
from memadvisor.profiler import profile_workload
from memadvisor.schema.candidate import Candidate, Estimate
from memadvisor.schema.profile import Profile
from memadvisor.strategy import apply_candidate, load_strategies
from memadvisor.target import load_factory, workload_from_result
from memadvisor.workload import Workload, train_step

MIB, GIB = 2**20, 2**30
ROOT = Path(__file__).resolve().parents[1]


# -- the models -----------------------------------------------------------------------------


def _example(name: str, **kwargs: Any) -> Workload:
    return workload_from_result(load_factory(f"{ROOT}/examples/{name}.py:build")(**kwargs))


# The convolutional models first: cuDNN's workspaces made their estimates the worst.
MODELS: dict[str, Callable[[], Workload]] = {
    "cnn": lambda: _example("cnn", batch_size=2),
    "gpt": lambda: _example("gpt", batch_size=2, block_size=256, n_layer=6, n_embd=384),
    "resnet18": lambda: workload_from_result(vision("resnet18")),
    "convnext_tiny": lambda: workload_from_result(vision("convnext_tiny")),
    "llama": lambda: _example("llama", batch_size=2, n_layers=8, dim=512, ffn_dim=1376),
    "bert-base": lambda: workload_from_result(bert_base()),
    "hf-llama": lambda: workload_from_result(hf_llama()),
}


# -- measuring --------------------------------------------------------------------------------


def _free_cuda() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _cuda_peak(workload: Workload, candidate: Candidate, steps: int, strategies: list) -> int:
    """Tensor bytes the allocator held at most over ``steps`` steps of a fresh copy."""
    device = torch.device("cuda")
    _free_cuda()
    clear_cublas_workspaces()  # made again inside the run, as in a fresh process
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = apply_candidate(copy.deepcopy(workload.model).to(device), candidate, strategies)
    optimizer = workload.make_optimizer(model)
    batch = workload.batch(candidate.batch_size, device)
    try:
        for _ in range(steps):
            train_step(workload, model, optimizer, batch)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    finally:
        del model, optimizer, batch
        _free_cuda()


def _largest_batch(profile: Profile, choices: dict, target: int, strategies: list) -> int:
    """The largest batch whose estimated peak is at most ``target`` (at least 1)."""

    def fits(b: int) -> bool:
        candidate = Candidate(batch_size=b, choices=choices)
        return estimate(profile, candidate, strategies).peak_bytes <= target

    lo, hi = 1, 2
    while fits(hi) and hi < 1 << 16:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def _errors(rec: Recorder) -> list[float]:
    return [r["error"] for r in rec.rows if r.get("error") is not None]


def _profile(name: str, workload: Workload, args: argparse.Namespace) -> Profile:
    saved = args.profiles / f"{name}-{args.device}.json" if args.profiles else None
    if saved is not None and saved.exists():
        profile = Profile.model_validate_json(saved.read_text())
        if set(args.precisions) <= set(profile.steps):
            return profile
    if args.device == "cuda":
        profile = profile_workload(workload, device="cuda", precisions=args.precisions)
    else:
        with cuda_autocast_policy():  # the simulated card casts as a card does
            profile = profile_workload(workload, device="cpu", precisions=args.precisions)
    if saved is not None:
        saved.parent.mkdir(parents=True, exist_ok=True)
        saved.write_text(profile.model_dump_json())
    return profile


def _untracked_summary(profile: Profile) -> dict[str, Any]:
    """Per precision: the sizes the untracked bytes were fitted at and backward's line (MiB)."""
    out = {}
    for precision, step in profile.steps.items():
        lines = {u.phase: u for u in step.untracked}
        backward = lines.get("backward")
        out[precision] = {
            "batch_sizes": step.untracked_batch_sizes,
            "backward_mib_per_sample": (
                round(backward.untracked.per_sample_bytes / MIB, 4) if backward else None
            ),
            "backward_constant_mib": (
                round(backward.untracked.constant_bytes / MIB, 1) if backward else None
            ),
        }
    return out


def run_model(
    name: str, args: argparse.Namespace, strategies: list, rec: Recorder, deadline: float
) -> None:
    try:
        workload = MODELS[name]()
    except ImportError as e:
        print(f"{name:14s} skipped: {e}")
        rec.write({"kind": "skipped", "model": name, "why": str(e)})
        return
    started = time.perf_counter()
    profile = _profile(name, workload, args)
    seconds = time.perf_counter() - started
    untracked = _untracked_summary(profile)
    print(
        f"{name:14s} profiled in {seconds:.1f} s; {len(profile.blocks)} blocks; fixed overhead "
        f"{profile.fixed_overhead_bytes / MIB:.1f} MiB; untracked (backward) {untracked}"
    )
    rec.write({
        "kind": "profile", "model": name, "seconds": round(seconds, 2),
        "fixed_overhead_bytes": profile.fixed_overhead_bytes, "untracked": untracked,
    })  # fmt: skip
    _free_cuda()
    names = [b.name for b in profile.blocks]
    cuda = args.device == "cuda"
    for precision in args.precisions:
        for label, checkpointed in (("none", []), ("all", names)):
            choices = {"precision": precision, "checkpointing": checkpointed}
            for target_gib in args.targets:
                row = {"kind": "run", "model": name, "precision": precision,
                       "checkpointing": label, "target_gib": target_gib}  # fmt: skip
                if time.perf_counter() > deadline:
                    rec.write({**row, "error": None, "note": "time budget spent"})
                    continue
                b = _largest_batch(profile, choices, int(target_gib * GIB), strategies)
                candidate = Candidate(batch_size=b, choices=choices)
                est: Estimate = estimate(profile, candidate, strategies)
                row.update(batch=b, estimate_bytes=est.peak_bytes, peak_at=est.peak_at)
                run_started = time.perf_counter()
                try:
                    if cuda:
                        measured = _cuda_peak(workload, candidate, args.steps, strategies)
                    else:
                        device = SimulatedDevice(2**50)
                        measured = device.run(workload, candidate, args.steps).peak_bytes
                except torch.OutOfMemoryError:
                    _free_cuda()
                    print(f"{name:14s} {precision} ckpt={label:4s} b={b:5d}: out of memory")
                    rec.write({**row, "error": None, "note": "out of memory"})
                    continue
                error = (est.peak_bytes - measured) / measured
                row.update(measured_bytes=measured, error=error,
                           seconds=round(time.perf_counter() - run_started, 2))  # fmt: skip
                rec.write(row)
                print(
                    f"{name:14s} {precision} ckpt={label:4s} target={target_gib:5.2f} GiB "
                    f"b={b:5d} est={est.peak_bytes / MIB:10.1f} MiB "
                    f"measured={measured / MIB:10.1f} MiB  {error:+7.2%}  at {est.peak_at}"
                )
    del workload, profile
    _free_cuda()


def print_table(rec: Recorder) -> None:
    head = ("model", "prec", "ckpt", "GiB", "batch", "estimate MiB", "measured MiB", "error")
    print("\n{:14s} {:4s} {:4s} {:>5s} {:>6s} {:>12s} {:>12s} {:>8s}".format(*head))
    for r in rec.rows:
        where = f"{r['model']:14s} {r['precision']:4s} {r['checkpointing']:4s} "
        where += f"{r['target_gib']:5.2f}"
        if r.get("error") is None:
            print(f"{where} {r.get('batch', '-'):>6} {r.get('note', '')}")
            continue
        est, measured = r["estimate_bytes"] / MIB, r["measured_bytes"] / MIB
        print(f"{where} {r['batch']:6d} {est:12.1f} {measured:12.1f} {r['error']:+8.2%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--targets", nargs="+", type=float, default=[4.0, 8.0, 16.0],
                        help="GiB the estimated peak should fill")  # fmt: skip
    parser.add_argument("--steps", type=int, default=2,
                        help="steps per run; the second is the steady state")  # fmt: skip
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"],
                        choices=["fp32", "bf16"], help="bf16 on a CPU is slow")  # fmt: skip
    parser.add_argument("--json", type=Path, default=None, help="JSON lines, written as it goes")
    parser.add_argument("--profiles", type=Path, default=None,
                        help="folder to save profiles in and reuse them from")  # fmt: skip
    parser.add_argument("--time-budget-s", type=float, default=330.0,
                        help="start no new run after this many seconds")  # fmt: skip
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("No CUDA device: pass --device cpu for a smoke run on the simulated device.")
    started = time.perf_counter()
    deadline = started + args.time_budget_s
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (simulated card)"
    print("torch", torch.__version__, where)
    strategies = load_strategies(["precision", "checkpointing"])
    rec = Recorder(args.json, lambda r: r.get("kind") == "run")
    rec.write({"kind": "start", "torch": torch.__version__, "device": where,
               "models": args.models, "targets": args.targets, "steps": args.steps,
               "precisions": args.precisions})  # fmt: skip
    try:
        for name in args.models:
            if time.perf_counter() > deadline:
                print(f"{name:14s} skipped: time budget spent")
                rec.write({"kind": "skipped", "model": name, "why": "time budget spent"})
                continue
            try:
                run_model(name, args, strategies, rec, deadline)
            except Exception as e:  # one model's failure must not cost the others' numbers
                traceback.print_exc()
                rec.write({"kind": "failed", "model": name, "why": f"{type(e).__name__}: {e}"})
                _free_cuda()
        print_table(rec)
        errors = _errors(rec)
        summary: dict[str, Any] = {"kind": "summary", "runs": len(errors),
                                   "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
        if errors:
            absolute = [abs(e) for e in errors]
            summary.update(median=statistics.median(absolute), worst=max(absolute))
            print(f"\nruns={len(errors)}  median |error|={summary['median']:.2%}  "
                  f"worst |error|={summary['worst']:.2%}  (targets: 5% median, 10% worst)  "
                  f"in {summary['seconds']:.0f} s")  # fmt: skip
        rec.write(summary)
    finally:
        rec.close()


if __name__ == "__main__":
    main()
