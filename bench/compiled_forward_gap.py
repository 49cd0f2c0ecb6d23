"""Where a compiled plan's throughput goes in a user's loop: CompiledForward vs torch.compile.

Each variant trains one model at one batch in a fresh process (the inductor cache shared, so
only the first variant compiles cold) and prints one JSON line:

* ``plain``: ``torch.compile(model)``, the forward and the loss under an outer bf16 autocast.
* ``apply``: ``apply_candidate`` with bf16 + compile (what ``apply_plan`` installs); the loss
  outside, on the model's bf16 logits, as a user's loop after ``apply_plan`` runs it.
* ``apply_loss_fp32``: ``apply`` with the logits upcast before the loss.
* ``compile_only_outer``: ``apply_candidate`` with compile alone and the user's own outer
  autocast (autocast outside the compiled frame).
* ``plain_autocast_inside``: the precision wrapper installed, then ``torch.compile(model)``:
  autocast inside the compiled frame, without CompiledForward.
* ``train_candidate``: the planner's own measurement of bf16 + compile (what it verifies).
* ``apply_after_small``: ``apply``, after one step at batch 8 in the same process (as
  ``plan()``'s compile trial runs at the sample batch before the user's loop).
* ``apply_after_small_static``: the same with dynamo's automatic dynamic shapes off (a new
  batch compiles static kernels of its own).

Per variant: steady samples/s (three windows of ``--steps`` steps, synchronised at their ends;
the median), the median of per-step synchronised times, CUDA-event times of forward, loss +
backward and optimizer, host time of a forward call, dynamo's frame/graph/recompile counts,
and the peak.

    python bench/compiled_forward_gap.py --model resnet50 --batch 150 --json out/gap.jsonl
    python bench/compiled_forward_gap.py --model cnn --batch 512 --variants plain,apply
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
VARIANTS = (
    "plain",
    "apply",
    "train_candidate",
    "compile_only_outer",
    "plain_autocast_inside",
    "apply_loss_fp32",
    "apply_after_small",
    "apply_after_small_static",
)


_COUNTED = ("frames", "stats", "recompiles")


def _model(name: str, batch: int) -> tuple[Any, Any, Any]:
    import torch

    sys.path.insert(0, str(ROOT))
    torch.manual_seed(0)
    if name == "cnn":
        from examples.cnn import SmallResNet

        model, size, classes = SmallResNet(), 32, 10
    else:
        import torchvision

        model, size, classes = getattr(torchvision.models, name)(num_classes=1000), 224, 1000
    x = torch.randn(batch, 3, size, size, device="cuda")
    y = torch.randint(0, classes, (batch,), device="cuda")
    return model.cuda(), x, y


def _strategies() -> list:
    from strategies.compile import Compile
    from strategies.precision import Precision

    return [Precision(), Compile()]


def run_variant(variant: str, model_name: str, batch: int, steps: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch._dynamo.utils import counters

    from memadvisor.apply import apply_candidate
    from memadvisor.estimate import Candidate

    model, x, y = _model(model_name, batch)
    bf16 = {"precision": "bf16", "compile": "default"}
    outer = False
    upcast = False
    if variant == "train_candidate":
        from memadvisor.device.cuda import train_candidate
        from memadvisor.workload import Workload

        workload = Workload(
            model=model.cpu(),
            sample_batch=(x[:8].cpu(), y[:8].cpu()),
            loss_fn=lambda out, b: F.cross_entropy(out, b[1]),
        )
        m = train_candidate(
            workload,
            Candidate(batch_size=batch, choices=bf16),
            3 * steps + 1,
            device=torch.device("cuda"),
            strategies=_strategies(),
            copy_model=False,
        )
        return {"samples_per_s": m.samples_per_s, "peak_gib": m.peak_bytes / 2**30}
    if variant == "plain":
        model, outer = torch.compile(model), True
    elif variant in ("apply", "apply_loss_fp32", "apply_after_small", "apply_after_small_static"):
        if variant == "apply_after_small_static":
            torch._dynamo.config.automatic_dynamic_shapes = False
        model = apply_candidate(model, Candidate(batch_size=batch, choices=bf16), _strategies())
        upcast = variant == "apply_loss_fp32"
    elif variant == "compile_only_outer":
        choices = {"compile": "default"}
        model = apply_candidate(model, Candidate(batch_size=batch, choices=choices), _strategies())
        outer = True
    elif variant == "plain_autocast_inside":
        choices = {"precision": "bf16"}
        model = apply_candidate(model, Candidate(batch_size=batch, choices=choices), _strategies())
        model = torch.compile(model)
    else:
        raise SystemExit(f"unknown variant {variant!r}")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    events = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
    host_forward_ms: list[float] = []

    def step(timed: bool = False) -> None:
        if timed:
            events[0].record()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=outer):
            out = model(x)
            host_forward_ms.append((time.perf_counter() - t0) * 1e3)
            if timed:
                events[1].record()
            loss = F.cross_entropy(out.float() if upcast else out, y)
        loss.backward()
        if timed:
            events[2].record()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if timed:
            events[3].record()

    if variant.startswith("apply_after_small"):
        small = torch.autocast("cuda", enabled=False)
        with small:
            F.cross_entropy(model(x[:8]), y[:8]).backward()
        optimizer.zero_grad(set_to_none=True)
    t_compile = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    compile_s = time.perf_counter() - t_compile
    torch.cuda.reset_peak_memory_stats()
    windows = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
        windows.append(batch * steps / (time.perf_counter() - t0))
    host_forward_ms.clear()
    synced, fwd, bwd, opt = [], [], [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        step(timed=True)
        torch.cuda.synchronize()
        synced.append((time.perf_counter() - t0) * 1e3)
        fwd.append(events[0].elapsed_time(events[1]))
        bwd.append(events[1].elapsed_time(events[2]))
        opt.append(events[2].elapsed_time(events[3]))
    return {
        "samples_per_s": statistics.median(windows),
        "windows": windows,
        "synced_median_samples_per_s": batch / statistics.median(synced) * 1e3,
        "forward_ms": statistics.median(fwd),
        "loss_backward_ms": statistics.median(bwd),
        "optimizer_ms": statistics.median(opt),
        "host_forward_ms": statistics.median(host_forward_ms),
        "warmup_s": compile_s,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "dynamo": {k: dict(v) for k, v in counters.items() if k in _COUNTED},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="resnet50", help="a torchvision model, or cnn")
    parser.add_argument("--batch", type=int, default=150)
    parser.add_argument("--steps", type=int, default=50, help="steps per timed window")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--deadline-s", type=float, default=1e9, help="skip variants after")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # the child's variant
    args = parser.parse_args()
    if args.one:
        row = run_variant(args.one, args.model, args.batch, args.steps)
        print("ROW " + json.dumps(row), flush=True)
        return
    env = dict(os.environ)
    env.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="gap-inductor-"))
    started = time.perf_counter()
    for variant in args.variants.split(","):
        if time.perf_counter() - started > args.deadline_s:
            print(json.dumps({"variant": variant, "skipped": "deadline"}), flush=True)
            continue
        t0 = time.perf_counter()
        cmd = [sys.executable, str(HERE), "--model", args.model, "--batch", str(args.batch)]
        cmd += ["--steps", str(args.steps), "--one", variant]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        row: dict[str, Any] = {"model": args.model, "batch": args.batch, "variant": variant}
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("ROW ")]
        if lines:
            row.update(json.loads(lines[-1][4:]))
        else:
            row["error"] = done.stderr[-1500:]
        row["wall_s"] = time.perf_counter() - t0
        print(json.dumps(row), flush=True)
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            with args.json.open("a") as f:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
