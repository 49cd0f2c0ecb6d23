"""LoRA fine-tuning of the Llama in ``examples/llama.py``: the usual setup, no peft needed.

The base weights are cast to bf16 and frozen (``requires_grad=False``: no gradients, no
optimizer state); each attention projection (wq, wk, wv, wo) gets a rank-16 adapter in
fp32, the only trainable parameters. With the ``7b`` preset the base is 12.6 GiB and the
adapters 16.8M parameters, so the plan's static bytes are the base plus a few hundred MiB:

    memadvisor plan examples/llama_lora.py:build --budget-gb 24 --device estimate
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from memadvisor.target import load_target_file

# The sibling file under the module name memadvisor gives it, however this file was loaded
# (by path from the CLI, or as examples.llama_lora), so probe processes find the same classes.
_llama = load_target_file(Path(__file__).with_name("llama.py"))

ATTENTION_PROJECTIONS = ("wq", "wk", "wv", "wo")


class LoRALinear(nn.Module):
    """``base(x) + scale * B(A(x))``: a frozen linear plus a trainable low-rank update.

    A starts random and B at zero, so training starts from the base model (as in the LoRA
    paper). The adapter runs in its own dtype (fp32) and its output is cast to the base's,
    as peft does; under autocast both matmuls run low anyway.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.lora_a = nn.Parameter(torch.empty(rank, base.in_features, dtype=torch.float32))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank, dtype=torch.float32))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.scale = alpha / rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        update = (x.to(self.lora_a.dtype) @ self.lora_a.T) @ self.lora_b.T  # (B, T, out)
        return y + (update * self.scale).to(y.dtype)


def add_lora(model: nn.Module, rank: int = 16, alpha: float = 32.0) -> nn.Module:
    """Freeze ``model`` and wrap every attention projection in a :class:`LoRALinear`."""
    for p in model.parameters():
        p.requires_grad_(False)
    for module in list(model.modules()):
        for name in ATTENTION_PROJECTIONS:
            child = getattr(module, name, None)
            if isinstance(child, nn.Linear):
                setattr(module, name, LoRALinear(child, rank, alpha))
    return model


def build(
    batch_size: int = 1,
    seq_len: int | None = 2048,
    preset: str = "7b",
    rank: int = 16,
    base_dtype: torch.dtype = torch.bfloat16,
    **overrides,
):
    """The Llama with a bf16 frozen base and fp32 rank-``rank`` adapters, a batch, the loss.

    Args:
        batch_size: rows of the sample batch.
        seq_len: tokens per row; None takes the config's ``max_seq_len``.
        preset: ``"7b"`` (Llama-2-7B's shape: build it under fake tensors or
            ``--device estimate``) or ``"tiny"``.
        rank: the adapters' rank.
        base_dtype: the frozen base's dtype.
        overrides: config fields to change, e.g. ``n_layers=2``.
    """
    cfg = replace(_llama.PRESETS[preset], **overrides)
    seq_len = seq_len or cfg.max_seq_len
    torch.manual_seed(0)
    # Built in base_dtype rather than cast after (as HF's torch_dtype= does): the weights
    # are never fp32, so a real 7B base never needs its 27 GB fp32 copy. (A factory that
    # casts with model.to(base_dtype) plans too, under --device estimate as well.)
    default = torch.get_default_dtype()
    torch.set_default_dtype(base_dtype)
    try:
        base = _llama.Llama(cfg)
    finally:
        torch.set_default_dtype(default)
    model = add_lora(base, rank=rank)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1))
    return {
        "model": model,
        "sample_batch": (tokens[:, :-1], tokens[:, 1:]),
        "loss_fn": _llama.loss_fn,
    }
