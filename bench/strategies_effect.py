"""Each strategy's measured effect on memory and time against what its estimate said.

For each example: profile it, then for each candidate (baseline, one strategy at a time, and
bf16 + all blocks checkpointed) estimate the peak and step time, apply the candidate to a
fresh copy of the model with ``apply_candidate`` and train it for a few steps, measuring the
peak (``torch.cuda.max_memory_allocated``; on the CPU the memory meter's tracked bytes) and
the median step time. The table shows the change against the baseline, estimated vs
measured, which is what a strategy's ``effect`` promises. Then the advice-only strategies'
numbers: the optimizer variants measured, the inference saving, precision's numerics.

    python bench/strategies_effect.py                 # CUDA (the lead's GPU run)
    python bench/strategies_effect.py --device cpu    # a smoke run here (small batches)

Known limits: all candidates run in one process one after another (the allocated peak is
robust to that; the reserved peak is not, so it is not compared); timing is the median of
``--steps`` steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import time
from typing import Any

import torch

from memadvisor.estimate import estimate
from memadvisor.memory import MemoryMeter
from memadvisor.profiler import profile_workload
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.profile import Profile
from memadvisor.step import base_step, running
from memadvisor.strategy import apply_candidate, facts_of, load_strategies
from memadvisor.target import load_target
from memadvisor.workload import Workload, tensor_leaves, train_step
from strategies.checkpointing import ranked_blocks
from strategies.inference import measure_inference
from strategies.precision import check_numerics, grad_scaler_for

MIB = 2**20
EXAMPLES = {  # target -> (batch on CUDA, batch on CPU)
    "examples/gpt.py:build": (32, 4),
    "examples/cnn.py:build": (256, 8),
}


def measure(
    workload: Workload,
    candidate: Candidate,
    device: torch.device,
    steps: int,
    optimizer_factory: Any = None,
) -> tuple[int, float]:
    """(peak bytes, median step ms) of ``candidate`` trained on a fresh copy of the model."""
    rewritten = apply_candidate(
        base_step(workload, copy.deepcopy(workload.model).to(device)), candidate
    )
    workload = running(workload, rewritten)  # the step the candidate rewrote
    model = workload.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_factory(params) if optimizer_factory else workload.make_optimizer(model)
    batch = workload.batch(candidate.batch_size, device=device)
    scaler = grad_scaler_for(facts_of(candidate).autocast or "fp32", device.type)

    def step() -> None:
        train_step(
            workload,
            model,
            optimizer,
            batch,
            accumulation_steps=candidate.accumulation_steps,
            scaler=scaler,
        )

    step()  # warm-up: optimizer state is created, kernels are chosen
    cuda = device.type == "cuda"
    meter = None
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    else:
        meter = MemoryMeter()
        meter.adopt([*model.parameters(), *model.buffers(), *tensor_leaves(optimizer.state)])
        meter.adopt(tensor_leaves(batch))
        meter.__enter__()
    times = []
    try:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - start) * 1000.0)
    finally:
        if meter is not None:
            meter.__exit__(None, None, None)
    peak = torch.cuda.max_memory_allocated() if cuda else meter.peak_bytes
    return peak, statistics.median(times)


def _release(device: torch.device) -> None:
    """Free the last run's model and optimizer before the next one is measured."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def candidates(profile: Profile, batch: int) -> dict[str, Candidate]:
    order = ranked_blocks(profile)
    every = sorted(profile.blocks[i].name for i in order)
    half = sorted(profile.blocks[i].name for i in order[: max(1, len(order) // 2)])
    low = "bf16" if profile.device.bf16_supported else "fp16"
    rows = {
        "baseline (fp32)": {},
        f"precision {low}": {"precision": low},
        f"checkpoint {len(half)} blocks": {"checkpointing": half},
        f"checkpoint all {len(every)}": {"checkpointing": every},
        "batch/2 x 2 accumulation": None,
        f"{low} + checkpoint all": {"precision": low, "checkpointing": every},
    }
    if profile.device.kind == "cuda" and profile.host_bandwidth_bytes_per_ms:
        rows["offload activations"] = {"offload": "forward"}
    out = {}
    for label, choices in rows.items():
        if choices is None:
            out[label] = Candidate(batch_size=max(1, batch // 2), accumulation_steps=2)
        else:
            out[label] = Candidate(batch_size=batch, choices=choices)
    return out


def optimizer_variants(device: torch.device) -> dict[str, Any]:
    variants = {
        "AdamW foreach": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=True),
        "AdamW for-loop": lambda p: torch.optim.AdamW(p, lr=1e-3, foreach=False),
    }
    if device.type == "cuda":
        variants["AdamW fused"] = lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True)
    return variants


def run_example(target: str, batch: int, device: torch.device, steps: int) -> None:
    workload = load_target(target)
    profile = profile_workload(workload, device=device.type)
    if device.type == "cuda" and profile.host_bandwidth_bytes_per_ms is None:
        from memadvisor.device.bandwidth import measure_host_bandwidth

        profile = profile.model_copy(
            update={"host_bandwidth_bytes_per_ms": measure_host_bandwidth(device)}
        )
    strategies = load_strategies()
    print(f"\n## {target}  batch {batch}  on {profile.device.name}")
    if profile.host_bandwidth_bytes_per_ms:
        print(f"host bandwidth {profile.host_bandwidth_bytes_per_ms / 1e6:.1f} GB/s")
    header = (
        f"{'candidate':28s} {'est peak':>9s} {'meas peak':>9s} {'err':>6s} | "
        f"{'est dPeak':>9s} {'meas dPeak':>10s} | {'est ms':>8s} {'meas ms':>8s} | "
        f"{'est dMs':>8s} {'meas dMs':>8s}"
    )
    print(header)
    print("-" * len(header))
    base: tuple[int, float, int, float] | None = None
    for label, cand in candidates(profile, batch).items():
        est = estimate(profile, cand, strategies)
        try:
            peak, ms = measure(workload, cand, device, steps)
        except torch.OutOfMemoryError:
            _release(device)
            print(f"{label:28s} {est.peak_bytes / MIB:9.1f}  out of memory")
            continue
        _release(device)
        if base is None:
            base = (est.peak_bytes, est.step_ms, peak, ms)
        err = (est.peak_bytes - peak) / peak * 100 if peak else float("nan")
        print(
            f"{label:28s} {est.peak_bytes / MIB:9.1f} {peak / MIB:9.1f} {err:+5.1f}% | "
            f"{(est.peak_bytes - base[0]) / MIB:+9.1f} {(peak - base[2]) / MIB:+10.1f} | "
            f"{est.step_ms:8.2f} {ms:8.2f} | {est.step_ms - base[1]:+8.2f} {ms - base[3]:+8.2f}"
        )

    print("\noptimizer habits (measured; the estimate does not model them):")
    for label, factory in optimizer_variants(device).items():
        peak, ms = measure(workload, Candidate(batch_size=batch), device, steps, factory)
        _release(device)
        print(f"  {label:16s} peak {peak / MIB:9.1f} MiB   step {ms:8.2f} ms")

    on_device = Workload(
        model=copy.deepcopy(workload.model).to(device),
        sample_batch=workload.batch(batch, device=device),
        loss_fn=workload.loss_fn,
        optimizer_factory=workload.optimizer_factory,
        forward_fn=workload.forward_fn,
    )
    m = measure_inference(on_device)
    grad_mib, whole_mib = (
        m[k] / MIB for k in ("forward_with_grad_peak_bytes", "inference_mode_peak_bytes")
    )
    chunk_mib = m["chunk_peak_bytes"] / MIB
    print(
        f"inference at batch {batch}: forward with grad {grad_mib:.1f} MiB, inference_mode "
        f"{whole_mib:.1f} MiB, chunk of {m['chunk_size']:.0f}: {chunk_mib:.1f} MiB"
    )
    low = "bf16" if profile.device.bf16_supported else "fp16"
    if profile.device.bf16_supported or profile.device.fp16_supported:
        print("numerics:", check_numerics(on_device, low).summary)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--only", help="run only targets containing this text")
    args = parser.parse_args()
    device = torch.device(args.device)
    print("torch", torch.__version__, "device", device)
    for target, (cuda_batch, cpu_batch) in EXAMPLES.items():
        if args.only and args.only not in target:
            continue
        batch = cuda_batch if device.type == "cuda" else cpu_batch
        run_example(target, batch, device, args.steps)


if __name__ == "__main__":
    main()
