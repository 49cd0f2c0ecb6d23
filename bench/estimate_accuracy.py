"""The estimate against what a card measures: ``torch.cuda.max_memory_allocated`` per step.

For each model: profile it (fp32 and bf16), then for each precision and checkpointing
(none / every block) pick the batch sizes whose *estimated* peak fills about 4, 8 and 16 GiB,
train each for a few steps on a fresh copy (``apply_candidate``) and compare the estimate
with the allocator's peak over those steps. cuBLAS's workspaces are freed before each run
so that it makes them again inside the measurement, as a fresh process would.

    python bench/estimate_accuracy.py                        # CUDA: the full table
    python bench/estimate_accuracy.py --models gpt cnn       # some models only
    python bench/estimate_accuracy.py --device cpu --targets 0.05 0.1   # a smoke run here

Models, all built from configs (no downloads): examples/gpt.py, examples/cnn.py,
examples/llama.py; torchvision resnet18 and convnext_tiny; transformers BertForMaskedLM
(bert-base config, sequence 512) and a small LlamaForCausalLM (8 layers of 1024, sequence
1024). A model whose package is missing is skipped with a line saying so.

On the CPU (``--device cpu``) the measurement is the simulated device's tracked peak.

Prints one line per run and then the median and worst absolute error (target: median
within 5%, worst within 10%).
"""

from __future__ import annotations

import argparse
import copy
import gc
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from memadvisor._torch_private import clear_cublas_workspaces
from memadvisor.apply import apply_candidate
from memadvisor.device._autocast import cuda_autocast_policy
from memadvisor.device.simulated import SimulatedDevice
from memadvisor.estimate import Candidate, Estimate, estimate
from memadvisor.profiler import Profile, profile_workload
from memadvisor.strategy import load_strategies
from memadvisor.target import load_factory, workload_from_result
from memadvisor.workload import Workload, train_step

MIB, GIB = 2**20, 2**30
ROOT = Path(__file__).resolve().parents[1]


# -- the models -----------------------------------------------------------------------------


def _example(name: str, **kwargs: Any) -> Workload:
    return workload_from_result(load_factory(f"{ROOT}/examples/{name}.py:build")(**kwargs))


def _torchvision(name: str) -> Workload:
    import torchvision

    model = getattr(torchvision.models, name)(weights=None, num_classes=1000)
    images, labels = torch.randn(2, 3, 224, 224), torch.randint(0, 1000, (2,))
    return Workload(
        model=model,
        sample_batch=(images, labels),
        loss_fn=lambda logits, batch: F.cross_entropy(logits, batch[1]),
    )


def _bert() -> Workload:
    from transformers import BertConfig, BertForMaskedLM

    model = BertForMaskedLM(BertConfig())  # bert-base: 12 layers of 768, vocab 30522
    ids = torch.randint(0, 30522, (2, 512))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    return Workload(model=model, sample_batch=batch)


def _hf_llama() -> Workload:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=2048,
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    ids = torch.randint(0, 32000, (2, 1024))
    return Workload(model=model, sample_batch={"input_ids": ids, "labels": ids.clone()})


MODELS: dict[str, Callable[[], Workload]] = {
    "gpt": lambda: _example("gpt", batch_size=2, block_size=256, n_layer=6, n_embd=384),
    "cnn": lambda: _example("cnn", batch_size=2),
    "llama": lambda: _example("llama", batch_size=2, n_layers=8, dim=512, ffn_dim=1376),
    "resnet18": lambda: _torchvision("resnet18"),
    "convnext_tiny": lambda: _torchvision("convnext_tiny"),
    "bert-base": _bert,
    "hf-llama": _hf_llama,
}


# -- measuring --------------------------------------------------------------------------------


def _cuda_peak(workload: Workload, candidate: Candidate, steps: int, strategies: list) -> int:
    """Tensor bytes the allocator held at most over ``steps`` steps of a fresh copy."""
    device = torch.device("cuda")
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    clear_cublas_workspaces()  # made again inside the run, as in a fresh process
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    model = apply_candidate(copy.deepcopy(workload.model).to(device), candidate, strategies)
    optimizer = workload.make_optimizer(model)
    batch = workload.batch(candidate.batch_size, device)
    for _ in range(steps):
        train_step(workload, model, optimizer, batch)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del model, optimizer, batch
    return peak


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


def run_model(name: str, args: argparse.Namespace, strategies: list) -> list[float]:
    try:
        workload = MODELS[name]()
    except ImportError as e:
        print(f"{name:14s} skipped: {e}")
        return []
    started = time.perf_counter()
    cuda = args.device == "cuda"
    precisions = ["fp32", "bf16"]
    if cuda:
        profile = profile_workload(workload, device="cuda", precisions=precisions)
    else:
        with cuda_autocast_policy():  # the simulated card casts as a card does
            profile = profile_workload(workload, device="cpu", precisions=precisions)
    overhead_mib = profile.fixed_overhead_bytes / MIB
    print(
        f"{name:14s} profiled in {time.perf_counter() - started:.1f} s; "
        f"{len(profile.blocks)} blocks; fixed overhead {overhead_mib:.1f} MiB"
    )
    names = [b.name for b in profile.blocks]
    errors = []
    for precision in precisions:
        for label, checkpointed in (("none", []), ("all", names)):
            choices = {"precision": precision, "checkpointing": checkpointed}
            for target_gib in args.targets:
                b = _largest_batch(profile, choices, int(target_gib * GIB), strategies)
                candidate = Candidate(batch_size=b, choices=choices)
                est: Estimate = estimate(profile, candidate, strategies)
                try:
                    if cuda:
                        measured = _cuda_peak(workload, candidate, args.steps, strategies)
                    else:
                        device = SimulatedDevice(2**50)
                        measured = device.run(workload, candidate, args.steps).peak_bytes
                except torch.OutOfMemoryError:
                    print(f"{name:14s} {precision} ckpt={label:4s} b={b:5d}: out of memory")
                    continue
                error = (est.peak_bytes - measured) / measured
                errors.append(error)
                print(
                    f"{name:14s} {precision} ckpt={label:4s} target={target_gib:5.2f} GiB "
                    f"b={b:5d} est={est.peak_bytes / MIB:10.1f} MiB "
                    f"measured={measured / MIB:10.1f} MiB  {error:+7.2%}  at {est.peak_at}"
                )
    return errors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--targets", nargs="+", type=float, default=[4.0, 8.0, 16.0],
                        help="GiB the estimated peak should fill")  # fmt: skip
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("No CUDA device: pass --device cpu for a smoke run on the simulated device.")
    where = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (simulated card)"
    print("torch", torch.__version__, where)
    strategies = load_strategies(["precision", "checkpointing"])
    errors: list[float] = []
    for name in args.models:
        errors += run_model(name, args, strategies)
    if errors:
        absolute = [abs(e) for e in errors]
        print(f"\nruns={len(errors)}  median |error|={statistics.median(absolute):.2%}  "
              f"worst |error|={max(absolute):.2%}  (targets: 5% median, 10% worst)")  # fmt: skip


if __name__ == "__main__":
    main()
