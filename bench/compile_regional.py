"""What a compile costs, by form: whole model vs regional (the repeated block), static vs
automatic-dynamic batch, cold vs warm cache (issue 27's measurements; GPU).

Each row is one fresh process with an inductor cache directory of its own (cold), or the
directory a cold process of the same form just filled (warm). The process builds the model
on the device, trains bf16 autocast + AdamW steps at a few batch sizes in turn, and records
per batch: the first step (compile included), the median of the steady steps after it, and
the allocated peak. Forms:

* ``eager``: no compile (the baseline for steady steps and peaks).
* ``full``: ``torch.compile(model)``, default ``dynamic=None``: the first batch compiles a
  static graph, the second recompiles with the batch dimension dynamic ("automatic dynamic"),
  later batches reuse it.
* ``full-static``: ``torch.compile(model, dynamic=False)``: every batch compiles a graph.
* ``regional`` / ``regional-static``: the same two, compiling only each instance of the
  repeated block (``block.compile()``, the largest ``nn.ModuleList`` of one class); the rest
  of the model (embeddings, head, loss) runs eager. PyTorch documents this as cutting
  cold-start time by about the number of layers, since one compiled code object serves every
  instance.
* ``*-warm``: the same form in a new process over the cache the cold one left.

    python bench/compile_regional.py --models lm350m,vit_b_16 --json /tmp/cr.jsonl
    python bench/compile_regional.py --smoke      # CPU, tiny models: the bench itself works

The table prints as rows finish; ``--json`` appends one JSON line per row (model, form,
batch, first_step_s, steady_ms, samples_per_s, peak_bytes, device). ``--deadline-s``
(default 520) skips forms that would start past it and says which.

Known limitations:
    * Warm rows reuse the cache of the cold row in the same run only (not a user's cache).
    * Regional forms leave the head and the loss eager: their peak differs from ``full``'s
      (inductor fuses the loss there), which the peak column shows.
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

FORMS = [
    "eager",
    "regional",
    "regional-static",
    "regional-warm",
    "full",
    "full-static",
    "full-warm",
]
# model -> (batches tried in turn on a card, batches in --smoke)
MODELS: dict[str, tuple[list[int], list[int]]] = {
    "lm350m": ([4, 6, 8], [2, 3, 4]),
    "vit_b_16": ([64, 96, 128], [2, 3, 4]),
    "gpt2_124m": ([8, 12, 16], [2, 3, 4]),
}


def build(name: str, batch: int, smoke: bool) -> tuple[Any, Any, Any]:
    """(model, make_batch(b), loss(out, batch)) on the CPU."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT))
    torch.manual_seed(0)
    if name in ("lm350m", "gpt2_124m"):
        if name == "lm350m":
            from examples import llama

            # The 0.35B decoder is examples/llama.py's "350m" preset (bench/loss_head.py's too).
            size = (
                dict(dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=128, vocab_size=256)
                if smoke
                else {}
            )
            seq = 32 if smoke else 1024
            job = llama.build(batch_size=1, seq_len=seq, preset="350m", max_seq_len=seq, **size)
            vocab = job["model"].cfg.vocab_size
        else:
            from _models import gpt2_124m

            seq = 32 if smoke else 1024
            tiny = dict(n_layer=3, n_head=4, n_embd=64, vocab_size=256, block_size=seq)
            job = gpt2_124m(batch_size=1, **(tiny if smoke else {}))
            vocab = job["model"].lm_head.out_features

        def make(b: int) -> tuple[Any, Any]:
            tokens = torch.randint(0, vocab, (b, seq + 1))
            return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

        return job["model"], make, job["loss_fn"]
    import torchvision

    side = 32 if smoke else 224
    model = (
        torchvision.models.vit_b_16(weights=None, image_size=side)
        if not smoke
        else (
            torchvision.models.VisionTransformer(
                image_size=32, patch_size=8, num_layers=3, num_heads=2, hidden_dim=32, mlp_dim=64
            )
        )
    )

    def make_images(b: int) -> tuple[Any, Any]:
        return torch.randn(b, 3, side, side), torch.randint(0, 1000, (b,))

    return model, make_images, lambda out, batch: F.cross_entropy(out, batch[1])


def repeated_blocks(model: Any) -> list[Any]:
    """The instances of the repeated block: the largest ModuleList whose children share a
    class."""
    import torch.nn as nn

    best: list[Any] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > len(best):
            kinds = {type(m) for m in module}
            if len(kinds) == 1:
                best = list(module)
    if not best:  # torchvision's ViT keeps its layers in a Sequential
        for module in model.modules():
            if (
                isinstance(module, nn.Sequential)
                and len(module) > max(len(best), 2)
                and len({type(m) for m in module}) == 1
            ):
                best = list(module)
    return best


def child(args: argparse.Namespace) -> None:
    """One form of one model in this process: a JSON line per batch on stdout."""
    import torch

    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    model, make, loss_fn = build(args.model, 1, args.smoke)
    model = model.to(device).train()
    form = args.form.removesuffix("-warm")
    static = form.endswith("-static")
    if form.startswith("full"):
        step_model = torch.compile(model, dynamic=False if static else None)
    elif form.startswith("regional"):
        blocks = repeated_blocks(model)
        for block in blocks:
            block.compile(dynamic=False if static else None)
        step_model = model
        print(json.dumps({"note": f"regional: {len(blocks)} x {type(blocks[0]).__name__}"}))
    else:
        step_model = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    amp = torch.autocast(device, dtype=torch.bfloat16)

    def step(batch: Any) -> None:
        with amp:
            out = step_model(batch[0])
        loss_fn(out, batch).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    for b in args.batches:
        batch = tuple(t.to(device) for t in make(b))
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        sync()
        t0 = time.perf_counter()
        step(batch)
        sync()
        first_s = time.perf_counter() - t0
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(batch)
            sync()
            times.append((time.perf_counter() - t0) * 1e3)
        steady_ms = statistics.median(times)
        peak = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        print(
            json.dumps(
                {
                    "batch": b,
                    "first_step_s": round(first_s, 2),
                    "steady_ms": round(steady_ms, 2),
                    "samples_per_s": round(b / steady_ms * 1e3, 1),
                    "peak_bytes": peak,
                }
            ),
            flush=True,
        )


def run_form(
    model: str, form: str, batches: list[int], cache: Path, smoke: bool, steps: int
) -> list[dict]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, str(HERE), "--child", "--model", model, "--form", form]
    cmd += ["--batches", ",".join(map(str, batches)), "--steps", str(steps)]
    cmd += ["--smoke"] if smoke else []
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=590)
    rows = []
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rows.append(json.loads(line))
    if proc.returncode != 0:
        rows.append({"error": proc.stderr.strip().splitlines()[-1:] or ["?"]})
    for r in rows:
        r["process_s"] = round(time.perf_counter() - t0, 1)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="lm350m,vit_b_16")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny models")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--deadline-s", type=float, default=520)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--form", help=argparse.SUPPRESS)
    parser.add_argument("--batches", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        args.batches = [int(b) for b in args.batches.split(",")]
        child(args)
        return
    import torch

    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if args.smoke:
        device = "cpu"
    out = args.json.open("a") if args.json else None
    start = time.perf_counter()
    print(
        f"{'model':10} {'form':16} {'batch':>5} {'first s':>8} {'ms/step':>8} "
        f"{'samples/s':>10} {'peak GiB':>8}",
        flush=True,
    )
    for model in args.models.split(","):
        batches = MODELS[model][1 if args.smoke else 0]
        with tempfile.TemporaryDirectory() as scratch:
            for form in args.forms.split(","):
                if time.perf_counter() - start > args.deadline_s:
                    print(f"# deadline: skipped {model} {form}", flush=True)
                    continue
                cache = Path(scratch) / form.removesuffix("-warm")
                rows = run_form(model, form, batches, cache, args.smoke, args.steps)
                for r in rows:
                    if "note" in r:
                        print(f"# {model} {form}: {r['note']}", flush=True)
                        continue
                    if "error" in r:
                        print(f"{model:10} {form:16} failed: {r['error']}", flush=True)
                        continue
                    r.update(model=model, form=form, device=device, steps=args.steps)
                    print(
                        f"{model:10} {form:16} {r['batch']:>5} {r['first_step_s']:>8.1f} "
                        f"{r['steady_ms']:>8.1f} {r['samples_per_s']:>10.1f} "
                        f"{r['peak_bytes'] / 2**30:>8.2f}",
                        flush=True,
                    )
                    if out:
                        out.write(json.dumps(r) + "\n")
                        out.flush()
    print(f"# total {time.perf_counter() - start:.0f} s on {device}", flush=True)


if __name__ == "__main__":
    main()
