"""Tokens/s and MFU for language models: MFU = 6 x N x tokens/s / the card's dense datasheet
peak at the pick's precision, shown with its formula; tokens/s without MFU where the device
has no peak or its times rank nothing; nothing for a model whose input is not token ids."""

from __future__ import annotations

import pytest
import torch

from memadvisor.profiler._profile import _tokens_per_sample
from memadvisor.report import render_plan_html
from memadvisor.report._facts import answer
from memadvisor.report._mfu import peak_tflops
from memadvisor.report._words import answer_rows
from memadvisor.schema.device import SIMULATED
from memadvisor.schema.plan import ModelFingerprint, Plan

N = 124_000_000  # GPT-2 small's parameters, as one tensor


def _lm(plan: Plan, device_name: str = "NVIDIA H100 80GB HBM3", **update) -> Plan:
    return plan.model_copy(
        update={
            "profile": plan.profile.model_copy(update={"tokens_per_sample": 1024}),
            "device_name": device_name,
            "model_fingerprint": ModelFingerprint(class_name="GPT", parameters=[("w", [N])]),
            **update,
        }
    )


def test_mfu_is_six_n_tokens_per_s_over_the_datasheet_peak(plan: Plan) -> None:
    """bf16 on an H100 SXM: 989.4 dense TFLOP/s; the measured rate times 1024 tokens."""
    a = answer(_lm(plan))
    tokens_per_s = plan.verified.samples_per_s * 1024
    assert a.lm.tokens_per_s == pytest.approx(tokens_per_s)
    assert a.lm.mfu == pytest.approx(6 * N * tokens_per_s / 989.4e12)
    row = dict(answer_rows(a))["Tokens"]
    assert f"MFU {a.lm.mfu:.1%} = 6 × 124.0M parameters × tokens/s" in row
    assert "H100 bf16 dense datasheet peak, 989 TFLOP/s" in row
    assert "MFU" in render_plan_html(_lm(plan))


def test_the_card_is_matched_by_name_and_precision() -> None:
    assert peak_tflops("NVIDIA H100 PCIe", "bf16") == (756.0, "H100 PCIe bf16 dense")
    assert peak_tflops("NVIDIA H200", "fp32") == (66.9, "H200 fp32 dense")
    assert peak_tflops("NVIDIA GeForce RTX 3050", "bf16") is None


def test_no_mfu_where_times_rank_nothing_or_the_card_is_unknown(plan: Plan) -> None:
    simulated = answer(
        _lm(plan, "simulated card (CPU)", device_kind="simulated", capabilities=SIMULATED)
    )
    assert simulated.lm.mfu is None and simulated.lm.tokens_per_s > 0
    assert "no MFU: this device has no datasheet peak" in dict(answer_rows(simulated))["Tokens"]
    unknown = answer(_lm(plan, "NVIDIA GeForce RTX 3050"))
    assert unknown.lm.mfu is None
    assert "not in memadvisor's datasheet table" in dict(answer_rows(unknown))["Tokens"]


def test_only_token_ids_make_a_language_model(plan: Plan) -> None:
    """(batch, tokens) integer ids count; images, floats and 1-d labels do not."""
    ids = torch.randint(0, 100, (4, 64))
    assert _tokens_per_sample((ids, ids)) == 64
    assert _tokens_per_sample({"input_ids": ids, "labels": ids}) == 64
    assert _tokens_per_sample((torch.randn(4, 3, 32, 32), torch.randint(0, 9, (4,)))) is None
    assert _tokens_per_sample(torch.randn(4, 64)) is None
    assert answer(plan).lm is None  # the fixture's profile recorded no token ids
