"""Facts about the GPU machine the design relies on; prints one table.

python bench/gpu_facts.py
"""

from __future__ import annotations

import time

import torch

from memadvisor.memory import MemoryMeter
from memadvisor.target import load_target
from memadvisor.workload import train_step

MIB = 2**20


def meter_vs_allocator(target: str, batch: int) -> tuple[float, float, float]:
    w = load_target(target)
    model = w.model.cuda()
    opt = w.make_optimizer(model)
    b = w.batch(batch, "cuda")
    train_step(w, model, opt, b)  # optimizer state exists from here on
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    meter = MemoryMeter()
    meter.adopt(
        list(model.parameters())
        + [t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    )
    meter.adopt([t for t in (b if isinstance(b, tuple) else (b,)) if isinstance(t, torch.Tensor)])
    with meter:
        train_step(w, model, opt, b)
    torch.cuda.synchronize()
    return (
        meter.peak_bytes / MIB,
        torch.cuda.max_memory_allocated() / MIB,
        torch.cuda.max_memory_reserved() / MIB - base / MIB,
    )


def main() -> None:
    print(
        "torch",
        torch.__version__,
        torch.cuda.get_device_name(),
        torch.cuda.get_device_properties(0).total_memory / 2**30,
        "GiB",
        "bf16",
        torch.cuda.is_bf16_supported(),
    )
    for target, batch in (("examples/gpt.py:build", 16), ("examples/cnn.py:build", 64)):
        m, a, r = meter_vs_allocator(target, batch)
        print(
            f"{target:28s} b={batch:4d} meter={m:9.2f} MiB  max_allocated={a:9.2f} MiB "
            f"diff={a - m:+.2f} MiB"
        )
    x = torch.empty(512 * MIB, dtype=torch.uint8, pin_memory=True)
    y = torch.empty_like(x, device="cuda")
    for _ in range(2):
        torch.cuda.synchronize()
        t = time.perf_counter()
        y.copy_(x)
        torch.cuda.synchronize()
        h2d = 512 / 1024 / (time.perf_counter() - t)
    print(f"pinned H2D {h2d:.1f} GiB/s")


if __name__ == "__main__":
    main()
