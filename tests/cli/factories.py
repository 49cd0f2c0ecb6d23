"""Tiny training jobs the CLI tests load by path: each one a few milliseconds a step.

``memadvisor plan tests/cli/factories.py:mlp --budget-gb 0.01`` plans a four-block MLP.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from memadvisor.target import load_factory

WIDTH = 64
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _example(name: str) -> ModuleType:
    # load_factory registers the module the way the CLI does (dataclasses need sys.modules).
    return sys.modules[load_factory(f"{EXAMPLES / name}.py:build").__module__]


def gpt() -> dict:
    """examples/gpt.py shrunk to seconds on a CPU: 2 blocks, a 2048-token vocabulary.

    Its LM head and loss still outweigh a block, as in the full example.
    """
    return _example("gpt").build(
        batch_size=2, block_size=16, vocab_size=2048, n_layer=2, n_head=2, n_embd=32
    )


def llama() -> dict:
    """examples/llama.py at 2 layers and 32 tokens: for --device estimate (fake tensors)."""
    return _example("llama").build(batch_size=2, seq_len=32, n_layers=2)


def llama_lora_cast() -> dict:
    """The usual LoRA setup written the usual way: examples/llama.py (2 layers, 32 tokens)
    built in fp32, then cast with ``model.to(torch.bfloat16)``, frozen, and given fp32 rank-4
    adapters (examples/llama_lora.py's add_lora). Under --device estimate the cast runs on
    fake tensors."""
    built = _example("llama").build(batch_size=2, seq_len=32, n_layers=2)
    base = built["model"].to(torch.bfloat16)
    built["model"] = _example("llama_lora").add_lora(base, rank=4)
    return built


def cnn() -> dict:
    """examples/cnn.py's SmallResNet at 8 channels and 2 bottlenecks, 16x16 images."""
    module = _example("cnn")
    built = module.build(batch_size=2)
    torch.manual_seed(0)
    built["model"] = module.SmallResNet(channels=8, width=4, depth=2)
    images, labels = built["sample_batch"]
    built["sample_batch"] = (images[:, :, :16, :16].contiguous(), labels)
    return built


class Block(nn.Module):
    """Linear + ReLU with a residual: what a person would checkpoint."""

    def __init__(self, width: int = WIDTH) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(x))


class MLP(nn.Module):
    def __init__(self, depth: int = 4, width: int = WIDTH, classes: int = 10) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))  # (B, classes)


def _cross_entropy(logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(logits, batch[1])


def mlp() -> dict:
    """Four residual blocks of width 64: ~70 KiB of weights, batch 8."""
    torch.manual_seed(0)
    return {
        "model": MLP(),
        "sample_batch": (torch.randn(8, WIDTH), torch.randint(0, 10, (8,))),
        "loss_fn": _cross_entropy,
    }


def _dataset() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    return torch.randn(4096, WIDTH), torch.randint(0, 10, (4096,))


def mlp_sliced() -> dict:
    """``mlp`` with its sample batch sliced from 4096-row dataset tensors, (X[:16], Y[:16]),
    as a user takes a sample from a dataset (docs/design.md, "A sample batch sliced from a
    dataset")."""
    x, y = _dataset()
    return {"model": MLP(), "sample_batch": (x[:16], y[:16]), "loss_fn": _cross_entropy}


def mlp_strided() -> dict:
    """``mlp_sliced`` with every other row: (X[::2][:16], Y[::2][:16]), a strided view."""
    x, y = _dataset()
    return {"model": MLP(), "sample_batch": (x[::2][:16], y[::2][:16]), "loss_fn": _cross_entropy}


def mlp_fresh16() -> dict:
    """``mlp_sliced``'s 16 rows as tensors of their own: what the sliced batch should plan as."""
    x, y = _dataset()
    return {
        "model": MLP(),
        "sample_batch": (x[:16].clone(), y[:16].clone()),
        "loss_fn": _cross_entropy,
    }


def _slow_cross_entropy(
    logits: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]
) -> torch.Tensor:
    time.sleep(0.2)  # every step takes a while: planning lasts long enough to interrupt
    return F.cross_entropy(logits, batch[1])


def slow_mlp() -> dict:
    """``mlp`` whose loss sleeps 0.2 s a call: a plan of it lasts tens of seconds."""
    return {**mlp(), "loss_fn": _slow_cross_entropy}


def wide() -> dict:
    """32 MiB of weights (Linear 2048 -> 4096): with AdamW ~128 MiB before any activation."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2048, 4096), nn.ReLU(), nn.Linear(4096, 1))
    return {"model": model, "sample_batch": torch.randn(2, 2048), "loss_fn": _sum_loss}


def _sum_loss(output: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return output.sum()


def rejects_batch() -> dict:
    """A model of width 4 given rows of 5 features: its forward fails on the sample."""
    return {"model": nn.Linear(4, 4), "sample_batch": torch.randn(2, 5), "loss_fn": _sum_loss}


def raises() -> dict:
    raise RuntimeError("the dataset at /data/train is not mounted")


def not_a_model() -> tuple:
    return "a string, not an nn.Module", torch.randn(2, 4)


def exits() -> dict:
    """A factory that ends the process itself (a script's argparse, a guard)."""
    import sys

    sys.exit(7)


def on_meta() -> dict:
    """``mlp`` built under ``torch.device("meta")``: shapes, no values (for --device estimate)."""
    with torch.device("meta"):
        model = MLP()
    return {**mlp(), "model": model}


def _mse_against_labels(logits: torch.Tensor, batch: tuple) -> torch.Tensor:
    return ((logits - batch[1]) ** 2).mean()  # (B, 10) against (B, 3): the user's mistake


def loss_shapes() -> dict:
    """``mlp`` whose loss_fn compares its (B, 10) logits with (B, 3) targets."""
    torch.manual_seed(0)
    return {
        "model": MLP(),
        "sample_batch": (torch.randn(8, WIDTH), torch.randn(8, 3)),
        "loss_fn": _mse_against_labels,
    }


def _mean_over_no_samples(logits: torch.Tensor, batch: tuple) -> torch.Tensor:
    samples = 0
    return logits.sum() * (1 / samples)


def loss_divides_by_zero() -> dict:
    """``mlp`` whose loss_fn raises ZeroDivisionError in the user's own Python."""
    return {**mlp(), "loss_fn": _mean_over_no_samples}


def loss_not_callable() -> dict:
    """``mlp`` with ``loss_fn=3``."""
    return {**mlp(), "loss_fn": 3}


def empty_batch() -> dict:
    """A sample batch with 0 rows."""
    return {"model": nn.Linear(4, 4), "sample_batch": torch.randn(0, 4), "loss_fn": _sum_loss}


def nan_batch() -> dict:
    """``mlp`` whose sample batch is all NaN: every loss would be NaN."""
    built = mlp()
    x, y = built["sample_batch"]
    return {**built, "sample_batch": (torch.full_like(x, float("nan")), y)}


def inf_batch() -> dict:
    """``mlp`` whose sample batch is all +inf."""
    built = mlp()
    x, y = built["sample_batch"]
    return {**built, "sample_batch": (torch.full_like(x, float("inf")), y)}
