"""Tokens/s and MFU for language models: how LM trainers judge a configuration.

MFU (model FLOPs utilisation) is the model's FLOPs per second over the card's datasheet
peak, with the model's FLOPs counted the usual way (Kaplan et al. 2020; PaLM, Chowdhery et
al. 2022, appendix B):

    MFU = 6 x N x tokens/s / peak FLOP/s

where N is the model's parameter count and 6 = 2 (multiply-add) x 3 (forward, and a backward
twice as dear). Recomputation (checkpointing) is not counted: it is work the hardware does,
not the model's (that would be HFU), so a plan that recomputes shows its cost as lower MFU.

The peak is the card's dense (no sparsity) datasheet figure at the pick's matmul precision:
bf16/fp16 tensor cores for autocast, and plain fp32 for fp32 (PyTorch's default,
``torch.backends.cuda.matmul.allow_tf32 = False``).

Known limitations:
    * Attention's own FLOPs (2 x layers x context x width per token, forward) are left out,
      as in the 6N rule: at long contexts MFU reads a little low.
    * Cards are matched by name; a card not in :data:`DATASHEET_TFLOPS` gets tokens/s only.
    * Only where the device's times rank (a card): a CPU has no datasheet peak here, and the
      simulated device's times are slowed by its tracking.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from memadvisor.schema.plan import Plan

__all__ = ["DATASHEET_TFLOPS", "LanguageModelRate", "language_model_rate"]

# Dense TFLOP/s by matmul precision, from NVIDIA's datasheets; matched against the device
# name in this order (the first key the name contains), so "H100 PCIe" comes before "H100".
DATASHEET_TFLOPS: dict[str, dict[str, float]] = {
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM5
    "H200": {"bf16": 989.4, "fp16": 989.4, "fp32": 66.9},  # SXM
    "A100": {"bf16": 312.0, "fp16": 312.0, "fp32": 19.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "fp32": 91.6},
    "L4": {"bf16": 121.0, "fp16": 121.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "fp32": 31.2},
}


class LanguageModelRate(BaseModel):
    """The pick's tokens/s and, on a known card, its MFU."""

    model_config = ConfigDict(extra="forbid")

    tokens_per_sample: int
    tokens_per_s: float
    parameters: int = Field(description="N of the 6N rule: every parameter of the model.")
    peak_tflops: float | None = Field(None, description="The card's datasheet dense peak.")
    peak_name: str = Field("", description="Which card and precision the peak is.")
    mfu: float | None = Field(None, description="6 x N x tokens/s / peak; None: no peak.")


def peak_tflops(device_name: str, precision: str) -> tuple[float, str] | None:
    """The card's dense datasheet TFLOP/s at ``precision`` and its name; None: unknown."""
    for card, peaks in DATASHEET_TFLOPS.items():
        if card.lower() in device_name.lower() and precision in peaks:
            return peaks[precision], f"{card} {precision} dense"
    return None


def language_model_rate(
    plan: Plan, samples_per_s: float, precision: str, times_rank: bool
) -> LanguageModelRate | None:
    """Tokens/s of the pick, and MFU where its device's times rank and the card is known;
    None when the profile saw no token ids (not a language model's input)."""
    profile = plan.profile
    if profile is None or profile.tokens_per_sample is None:
        return None
    tokens_per_s = samples_per_s * profile.tokens_per_sample
    fingerprint = plan.model_fingerprint
    parameters = 0
    if fingerprint is not None:
        for _, shape in fingerprint.parameters:
            count = 1
            for size in shape:
                count *= size
            parameters += count
    peak = peak_tflops(plan.device_name, precision) if times_rank else None
    mfu = None
    if peak is not None and parameters > 0:
        mfu = 6 * parameters * tokens_per_s / (peak[0] * 1e12)
    return LanguageModelRate(
        tokens_per_sample=profile.tokens_per_sample,
        tokens_per_s=tokens_per_s,
        parameters=parameters,
        peak_tflops=peak[0] if peak is not None else None,
        peak_name=peak[1] if peak is not None else "",
        mfu=mfu,
    )
