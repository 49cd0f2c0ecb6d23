"""A Llama-style decoder in one file: RMSNorm, rotary positions, grouped-query attention, SwiGLU.

No transformers needed. The default config is small enough to train on a CPU; the ``7b``
preset is Llama-2-7B's shape (6.7B parameters), meant for fake tensors, which plan a card's
memory without using any (``--device estimate``, ``memadvisor.device.fake``); ``build_7b``
builds it at a 2048-token context:

    memadvisor plan examples/llama.py:build --budget-gb 2
    memadvisor plan examples/llama.py:build_7b --budget-gb 160 --device estimate
    memadvisor plan examples/llama.py:build_1b --budget-gb 12 --world-size 2 --parallel fsdp2
    python -c "from examples.llama import build; from memadvisor.device.fake import fake_workload; \
        fake_workload(lambda: build(preset='7b'))"
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from memadvisor import TokenCrossEntropy


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 1024  # small for CPU tests; Llama-2 has 32000
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 8
    n_kv_heads: int = 4  # grouped-query attention: 2 query heads share each key/value head
    ffn_dim: int = 688  # SwiGLU's 2/3 * 4 * dim, rounded up to a multiple of 16
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


PRESETS = {
    "tiny": LlamaConfig(),
    # Llama-2-7B: 32 layers of 4096, 11008-wide SwiGLU, no GQA, 4k context; 6.74B parameters.
    "7b": LlamaConfig(
        vocab_size=32000,
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=32,
        ffn_dim=11008,
        max_seq_len=4096,
    ),
    # A 0.35B decoder (349M parameters) at a 1024-token context: 24 layers of 1024, 16 query
    # heads over 8 key/value heads. At 8 GiB its fp32 weights, gradients and AdamW state
    # (5.2 GiB) leave the logits (1024 x 32000 x 4 bytes = 125 MiB a sample) as the step's
    # largest tensors: the model of the chunked loss head's card bench (bench/loss_head.py)
    # and of the compile forms' (bench/compile_regional.py).
    "350m": LlamaConfig(
        vocab_size=32000,
        dim=1024,
        n_layers=24,
        n_heads=16,
        n_kv_heads=8,
        ffn_dim=2816,
        max_seq_len=1024,
    ),
    # TinyLlama-1.1B's shape: 22 layers of 2048, 32 query heads over 4 key/value heads.
    # 1.10B parameters: 17.6 GB of fp32 weights, gradients and AdamW state (16 bytes each),
    # more than a 12 GiB card holds before any activation: the model FSDP2 is for.
    "1b": LlamaConfig(
        vocab_size=32000,
        dim=2048,
        n_layers=22,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=5632,
        max_seq_len=2048,
    ),
}


class RMSNorm(nn.Module):
    """Root-mean-square norm computed in fp32, as Llama's reference code does."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Rotary(nn.Module):
    """cos/sin of rotary position embeddings, made per call from the inverse frequencies."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(seq_len, device=self.inv_freq.device, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq)  # (T, hd/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, hd)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads = cfg.n_heads, cfg.n_kv_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # (B, T, C)
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=self.n_kv_heads != self.n_heads
        )  # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.rotary = Rotary(cfg.dim // cfg.n_heads, cfg.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)  # untied, as in Llama-2

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _, T = tokens.shape  # (B, T)
        h = self.tok_embeddings(tokens)  # (B, T, C)
        cos, sin = self.rotary(T, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))  # (B, T, vocab)


# F.cross_entropy(logits.float().view(-1, vocab), targets.view(-1)) over batch = (tokens,
# targets), declared as such, so that memadvisor may compute the output head and the loss a
# chunk of tokens at a time (the loss-head strategy); called, it is exactly that loss.
loss_fn = TokenCrossEntropy(targets=1, head="output")


def build(batch_size: int = 2, seq_len: int | None = None, preset: str = "tiny", **overrides):
    """The model, a batch of token ids and next-token targets, and the loss.

    Args:
        batch_size: rows of the sample batch.
        seq_len: tokens per row; default the config's ``max_seq_len``.
        preset: ``"tiny"`` (CPU-sized), ``"350m"`` (a 0.35B decoder), ``"1b"``
            (TinyLlama-1.1B's shape) or ``"7b"`` (Llama-2-7B's shape; for fake tensors).
        overrides: config fields to change, e.g. ``n_layers=2``.
    """
    cfg = replace(PRESETS[preset], **overrides)
    seq_len = seq_len or cfg.max_seq_len
    torch.manual_seed(0)
    model = Llama(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (batch_size, seq_len + 1))
    return {
        "model": model,
        "sample_batch": (tokens[:, :-1], tokens[:, 1:]),
        "loss_fn": loss_fn,
    }


def build_7b(batch_size: int = 1, seq_len: int = 2048):
    """Llama-2-7B's shape at a 2048-token context: for ``--device estimate`` (fake tensors);
    built for real it takes 27 GB of weights."""
    return build(batch_size=batch_size, seq_len=seq_len, preset="7b")


def build_1b(batch_size: int = 2, seq_len: int = 1024):
    """TinyLlama-1.1B's shape at a 1024-token context: the model one 12 GiB card cannot
    train (its weights, gradients and AdamW state take 17.6 GB) and FSDP2 over 2 can.

    Built for real it takes 4.4 GB of weights; ``--device estimate`` plans it as fake
    tensors. The sample batch of 2 has the profile measured at batches 2 and 4, near the
    per-rank picks (5 to 13 at 12 GiB a rank): the estimate extrapolates less."""
    return build(batch_size=batch_size, seq_len=seq_len, preset="1b")
