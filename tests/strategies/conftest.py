"""Fixtures for the strategy tests: hand-made profiles, an HF-style decoder, the examples."""

from __future__ import annotations

import math
from types import ModuleType

import pytest
import torch
from torch import nn

from memadvisor.schema.profile import (
    BlockActivity,
    BlockInfo,
    DeviceInfo,
    LinearBytes,
    LinearMs,
    ModuleActivity,
    PhasePeak,
    Profile,
    StepProfile,
)
from tests.fixtures.examples import load_example

MIB = 2**20


def make_profile(
    blocks: list[tuple[float, float, float]],
    *,
    kind: str = "cpu",
    bf16: bool = True,
    fp16: bool = True,
    bandwidth: float | None = None,
    loss_per_sample: float = 0.0,
    optimizer_peak_extra: float = 0.0,
) -> Profile:
    """A profile whose blocks keep ``(activation MiB, input MiB, forward ms)`` per sample.

    A bf16 step is added with every activation halved. Batch sizes (1, 2).
    """

    def step(precision: str, scale: float) -> StepProfile:
        acts = [
            BlockActivity(
                name=f"layers.{i}",
                activation=LinearBytes(per_sample_bytes=a * MIB * scale),
                input=LinearBytes(per_sample_bytes=inp * MIB * scale),
                forward_ms=LinearMs(per_sample_ms=ms * scale),
            )
            for i, (a, inp, ms) in enumerate(blocks)
        ]
        total = sum(a for a, _, _ in blocks) * MIB * scale + loss_per_sample * MIB
        static = 4 * MIB
        return StepProfile(
            precision=precision,
            blocks=acts,
            outside=[
                ModuleActivity(
                    name="<loss>", activation=LinearBytes(per_sample_bytes=loss_per_sample * MIB)
                )
            ],
            activation_total=LinearBytes(per_sample_bytes=total),
            phases=[
                PhasePeak(phase="forward", allocated=LinearBytes(per_sample_bytes=total)),
                PhasePeak(
                    phase="optimizer",
                    allocated=LinearBytes(constant_bytes=static + optimizer_peak_extra * MIB),
                ),
            ],
            forward_ms=LinearMs(per_sample_ms=sum(ms for _, _, ms in blocks) * scale),
            backward_ms=LinearMs(per_sample_ms=2 * sum(ms for _, _, ms in blocks) * scale),
            step_ms=LinearMs(per_sample_ms=3 * sum(ms for _, _, ms in blocks) * scale),
            cast_weight_bytes=0 if precision == "fp32" else MIB,
        )

    return Profile(
        model_name="Toy",
        device=DeviceInfo(kind=kind, name=kind, bf16_supported=bf16, fp16_supported=fp16),
        batch_sizes=(1, 2),
        param_bytes=MIB,
        grad_bytes=MIB,
        optimizer_state_bytes=2 * MIB,
        blocks=[BlockInfo(name=f"layers.{i}", type_name="Block") for i in range(len(blocks))],
        steps={"fp32": step("fp32", 1.0), "bf16": step("bf16", 0.5)},
        host_bandwidth_bytes_per_ms=bandwidth,
    )


# -- an HF-style decoder: keyword arguments in, tuples out, an in-place KV cache ---------------


class ToyCache:
    """Like transformers' DynamicCache: ``update`` appends keys/values and returns them all."""

    def __init__(self) -> None:
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys.append(k)
        self.values.append(v)
        return torch.cat(self.keys, dim=1), torch.cat(self.values, dim=1)

    def get_seq_length(self) -> int:
        return sum(k.shape[1] for k in self.keys)


class HFStyleDecoderLayer(nn.Module):
    def __init__(self, d: int = 16, dropout: float = 0.1) -> None:
        super().__init__()
        self.input_layernorm = nn.LayerNorm(d)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(d, d) for _ in range(4))
        self.attn_dropout = nn.Dropout(dropout)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.calls = 0  # forward calls (a recompute counts)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_value: ToyCache | None = None,
        output_attentions: bool = False,
        use_cache: bool = False,
    ) -> tuple:
        self.calls += 1
        h = self.input_layernorm(hidden_states)  # (B, T, C)
        if position_ids is not None:
            h = h + 0.01 * position_ids.unsqueeze(-1)
        q, k, v = self.q_proj(h), self.k_proj(h), self.v_proj(h)
        if past_key_value is not None:
            k, v = past_key_value.update(k, v)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.size(-1))  # (B, T, S)
        if attention_mask is not None:
            scores = scores + attention_mask
        attn = self.attn_dropout(scores.softmax(-1))
        out = hidden_states + self.o_proj(attn @ v)
        out = out + self.mlp(out)
        outputs: tuple = (out,)
        if output_attentions:
            outputs += (attn,)
        if use_cache:
            outputs += (past_key_value,)
        return outputs


class HFStyleModel(nn.Module):
    def __init__(self, vocab: int = 50, d: int = 16, n_layer: int = 3) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(HFStyleDecoderLayer(d) for _ in range(n_layer))
        self.lm_head = nn.Linear(d, vocab)

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, output_attentions: bool = False
    ) -> tuple[torch.Tensor, list]:
        B, T = input_ids.shape  # (B, T)
        causal = torch.full((T, T), float("-inf")).triu(1)
        padding = (1.0 - attention_mask[:, None, :].float()) * -1e4  # (B, 1, T)
        mask = causal + padding  # (B, T, T)
        position_ids = torch.arange(T).expand(B, T).float()
        x = self.embed_tokens(input_ids)
        attentions = []
        for layer in self.layers:
            out = layer(
                x,
                attention_mask=mask,
                position_ids=position_ids,
                output_attentions=output_attentions,
            )
            x = out[0]
            attentions.extend(out[1:])
        return self.lm_head(x), attentions


@pytest.fixture
def hf_batch() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (3, 7))
    mask = torch.ones(3, 7, dtype=torch.long)
    mask[0, 5:] = 0  # one padded row: the mask matters
    return ids, mask


@pytest.fixture
def profile_factory():
    """make_profile(blocks, ...): a hand-made Profile (see its docstring)."""
    return make_profile


@pytest.fixture
def hf_model() -> HFStyleModel:
    torch.manual_seed(0)
    return HFStyleModel()


@pytest.fixture
def toy_cache_class() -> type[ToyCache]:
    return ToyCache


@pytest.fixture
def gpt_example() -> ModuleType:
    return load_example("gpt")


@pytest.fixture
def cnn_example() -> ModuleType:
    return load_example("cnn")
