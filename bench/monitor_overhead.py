"""Overhead of memadvisor.Monitor (light) and memadvisor.trace (full) on real training loops.

Each round runs every variant for the same number of steps on the same model, in a shuffled
order (interleaved, so drift in clocks or thermals hits all variants alike); a variant's
overhead is the median over rounds of its time per step divided by the baseline's in that
round, minus one. Runs on CUDA when available, else on the CPU (where the monitor needs the
MemoryMeter, whose own cost is shown separately as "meter only").

    python bench/monitor_overhead.py                 # examples/gpt.py, examples/cnn.py, resnet50
    python bench/monitor_overhead.py --models gpt --steps 300 --rounds 9

Variants:
    baseline         the plain loop
    light            Monitor(print_period=P, csv=...): counters every step, per-layer hooks
                     on printed steps, a rich table every P steps (rendered to a buffer)
    light-no-layers  the same without per-layer numbers
    trace            memadvisor.trace(model): every module's enter/exit on every step
    meter only       (CPU) the loop inside a MemoryMeter, no monitor
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

import memadvisor
from memadvisor.memory import MemoryMeter
from memadvisor.target import load_factory

ROOT = Path(__file__).resolve().parents[1]


def _load_example(name: str):
    """The build() of examples/<name>.py, loaded the way the CLI loads a target."""
    return load_factory(f"{ROOT / 'examples' / name}.py:build")


def _workloads(names: list[str], device: torch.device) -> dict[str, Callable[[], tuple]]:
    """name -> () -> (model, make_batch, loss_fn, description)."""
    cuda = device.type == "cuda"
    out: dict[str, Callable[[], tuple]] = {}
    if "gpt" in names:

        def gpt():
            # On a card, a model big enough that a step is not pure launch latency.
            kw = (
                dict(batch_size=16, block_size=256, n_layer=6, n_head=6, n_embd=384) if cuda else {}
            )
            built = _load_example("gpt")(**kw)
            x, y = (t.to(device) for t in built["sample_batch"])
            return (
                built["model"].to(device),
                lambda: (x, y),
                built["loss_fn"],
                f"gpt {kw or 'default'}",
            )

        out["gpt"] = gpt
    if "cnn" in names:

        def cnn():
            built = _load_example("cnn")(**({"batch_size": 64} if cuda else {}))
            batch = built["sample_batch"]
            batch = (
                tuple(t.to(device) for t in batch)
                if isinstance(batch, (tuple, list))
                else batch.to(device)
            )
            return built["model"].to(device), lambda: batch, built["loss_fn"], "cnn example"

        out["cnn"] = cnn
    if "resnet50" in names and importlib.util.find_spec("torchvision") is not None:

        def resnet():
            import torchvision

            b, hw = (64, 224) if cuda else (2, 64)
            model = torchvision.models.resnet50().to(device)
            x = torch.randn(b, 3, hw, hw, device=device)
            y = torch.randint(0, 1000, (b,), device=device)
            loss = lambda out, batch: torch.nn.functional.cross_entropy(out, batch[1])  # noqa: E731
            return model, lambda: (x, y), loss, f"torchvision resnet50, batch {b}, {hw}x{hw}"

        out["resnet50"] = resnet
    return out


def _forward(model, batch):
    return model(batch[0]) if isinstance(batch, (tuple, list)) else model(batch)


def _run(
    variant: str, model, opt, make_batch, loss_fn, steps: int, args, device
) -> tuple[float, float]:
    """Milliseconds per step of ``steps`` steps of one variant, and microseconds per record()."""
    tmp = Path(tempfile.mkdtemp())
    monitor = None
    ctx: contextlib.AbstractContextManager = contextlib.nullcontext()
    if variant in ("light", "light-no-layers"):
        monitor = memadvisor.Monitor(
            model,
            print_period=args.print_period,
            csv=tmp / "memory.csv",
            optimizer=opt,
            layers=variant == "light",
            console=Console(file=io.StringIO(), width=160),
        )
        ctx = monitor
    elif variant == "trace":
        ctx = memadvisor.trace(model, max_events=args.max_events)
    elif variant == "meter only":
        meter = MemoryMeter()
        meter.adopt(model.parameters())
        ctx = meter
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    in_record = 0.0
    sync()
    t0 = time.perf_counter()
    with ctx:
        for _ in range(steps):
            batch = make_batch()
            loss = loss_fn(_forward(model, batch), batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if monitor is not None:
                r0 = time.perf_counter()
                monitor.record()
                in_record += time.perf_counter() - r0
        sync()
    return (time.perf_counter() - t0) * 1e3 / steps, in_record * 1e6 / steps


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default="gpt,cnn,resnet50")
    parser.add_argument("--steps", type=int, default=None, help="steps per run (GPU 200, CPU 10)")
    parser.add_argument(
        "--rounds", type=int, default=None, help="interleaved rounds (GPU 7, CPU 3)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps first (GPU 20, CPU 2)"
    )
    parser.add_argument("--print-period", type=int, default=100)
    parser.add_argument("--max-events", type=int, default=200_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    steps = args.steps or (200 if cuda else 10)
    rounds = args.rounds or (7 if cuda else 3)
    warmup = args.warmup if args.warmup is not None else (20 if cuda else 2)
    variants = ["baseline", "light", "light-no-layers", "trace"]
    if not cuda:
        variants.insert(1, "meter only")
    rng = random.Random(args.seed)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    table = Table(
        title=f"Monitor overhead on {name}, torch {torch.__version__}: {steps} steps x "
        f"{rounds} rounds, print_period {args.print_period}"
    )
    for col in (
        "model",
        "variant",
        "median ms/step",
        "overhead (median of paired ratios)",
        "range of ratios",
        "record() us/step",
    ):
        table.add_column(col, justify="left" if col in ("model", "variant") else "right")
    verdicts = []
    for build in _workloads(args.models.split(","), device).values():
        model, make_batch, loss_fn, desc = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        _run("baseline", model, opt, make_batch, loss_fn, warmup, args, device)
        times: dict[str, list[float]] = {v: [] for v in variants}
        record_us: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(rounds):
            order = variants[:]
            rng.shuffle(order)
            for v in order:
                ms, us = _run(v, model, opt, make_batch, loss_fn, steps, args, device)
                times[v].append(ms)
                record_us[v].append(us)
        for v in variants:
            ratios = [t / b - 1 for t, b in zip(times[v], times["baseline"], strict=True)]
            over = statistics.median(ratios)
            table.add_row(
                desc if v == "baseline" else "",
                v,
                f"{statistics.median(times[v]):.3f}",
                "-" if v == "baseline" else f"{over:+.2%}",
                "-" if v == "baseline" else f"{min(ratios):+.2%} .. {max(ratios):+.2%}",
                f"{statistics.median(record_us[v]):.1f}" if v.startswith("light") else "-",
            )
            if v == "light":
                verdicts.append((desc, over))
        table.add_section()
        del model, opt
        if cuda:
            torch.cuda.empty_cache()
    console = Console(width=200)
    console.print(table)
    for desc, over in verdicts:
        ok = over < 0.01
        console.print(
            f"light monitor on {desc}: {over:+.2%} -> {'PASS' if ok else 'FAIL'} "
            "(< 1% required on GPU)"
        )
    if not cuda:
        console.print(
            "CPU run: the < 1% target is for CUDA; on the CPU bytes are tracked by the meter."
        )
    sys.exit(0)


if __name__ == "__main__":
    main()
