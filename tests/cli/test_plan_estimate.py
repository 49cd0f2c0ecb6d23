"""``--device estimate``: plans and profiles from fake tensors, every figure marked estimated.

The tiny Llama plans in a few seconds. The Llama-2-7B runs (the issue's acceptance) are
marked slow: 30-90 s each on a loaded 2-core box, about 0.35 GB of RSS.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from memadvisor.schema.config import GIB
from memadvisor.schema.plan import Plan

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LLAMA = f"{EXAMPLES}/llama.py"
LORA = f"{EXAMPLES}/llama_lora.py"


def _error_line(result) -> str:
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in result.stderr, result.stderr
    return errors[0]


def test_plan_estimate_writes_a_plan_whose_every_figure_is_marked_estimated(
    cli, factory, tmp_path
) -> None:
    json_path, html_path = tmp_path / "plan.json", tmp_path / "plan.html"
    result = cli(
        "plan", factory("llama"), "--budget-gb", "0.25", "--device", "estimate",
        "--json", str(json_path), "--html", str(html_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    plan = Plan.model_validate_json(json_path.read_text())
    assert plan.device_kind == "estimate" and plan.verified is None and plan.probes == []
    out = result.stdout
    assert "No device in use" in result.stderr
    assert "not verified on a device" in out and "samples/s (estimated)" in out
    assert "~ estimated: nothing ran on a device" in out
    assert "Predicted peak per phase" in out
    assert "Every figure in this plan is estimated" in out
    assert "Step times are not measured but modelled" in out
    assert "torch.compile was not weighed" in out
    # No figure claims to be measured: the word appears only where a note says what is not.
    claims = out.replace("not measured", "").replace("can only be measured on the card", "")
    assert "measured" not in claims
    page = html_path.read_text()
    assert "Predicted peak per phase" in page


def test_plan_estimate_budget_nothing_fits_exits_3_and_names_the_minimum(cli, factory) -> None:
    result = cli("plan", factory("llama"), "--budget-gb", "0.01", "--device", "estimate")
    assert result.exit_code == 3
    error = _error_line(result)
    assert "The minimum budget that would work is" in error
    assert "16.0 bytes a parameter before activations" in error


def test_profile_estimate_profiles_fake_tensors_and_refuses_a_recorded_timeline(
    cli, factory, tmp_path
) -> None:
    result = cli("profile", factory("llama"), "--device", "estimate", "--quiet")
    assert result.exit_code == 0, result.stderr
    assert "Llama: weights, grads and optimizer state" in result.stdout
    refused = cli(
        "profile", factory("llama"), "--device", "estimate",
        "--timeline", str(tmp_path / "t.json"),
    )  # fmt: skip
    assert refused.exit_code == 2
    assert "--timeline record a step of real tensors" in _error_line(refused)


def test_a_factory_that_casts_its_model_to_bf16_plans_on_the_estimate_device(
    cli, factory, tmp_path
) -> None:
    """Rule: the usual LoRA factory (build, ``model.to(torch.bfloat16)``, freeze, add fp32
    adapters) plans under --device estimate with the weights it would have for real: a bf16
    base, gradients and AdamW state for the adapters alone. It exited 2 with "raised
    RuntimeError under fake tensors: _apply(): Couldn't swap Embedding.weight" (issue 25)."""
    from memadvisor.target import load_factory

    real = load_factory(factory("llama_lora_cast"))()["model"]
    base = [p for p in real.parameters() if not p.requires_grad]
    adapters = [p for p in real.parameters() if p.requires_grad]
    assert {p.dtype for p in base} == {torch.bfloat16} and adapters
    json_path = tmp_path / "plan.json"
    result = cli(
        "plan", factory("llama_lora_cast"), "--budget-gb", "0.25", "--device", "estimate",
        "--json", str(json_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    profile = Plan.model_validate_json(json_path.read_text()).profile
    assert profile.param_bytes == sum(p.numel() * p.element_size() for p in real.parameters())
    assert profile.trainable_param_count == sum(p.numel() for p in adapters)
    assert profile.grad_bytes == sum(p.numel() * p.element_size() for p in adapters)


# -- the acceptance: Llama-2-7B's shape at a 2048-token context ----------------------


@pytest.mark.slow
def test_llama_7b_plans_at_160_gib_and_writes_the_plan(cli, tmp_path) -> None:
    json_path = tmp_path / "plan.json"
    result = cli(
        "plan", f"{LLAMA}:build_7b", "--budget-gb", "160", "--device", "estimate",
        "--json", str(json_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    plan = Plan.model_validate_json(json_path.read_text())
    assert plan.profile.param_count == 6_738_415_616
    assert plan.estimate.limit_bytes <= plan.config.usable_bytes
    assert plan.candidate.batch_size >= 1


@pytest.mark.slow
def test_llama_7b_full_fine_tune_at_24_gib_exits_3_naming_the_minimum(cli) -> None:
    result = cli("plan", f"{LLAMA}:build_7b", "--budget-gb", "24", "--device", "estimate")
    assert result.exit_code == 3
    error = _error_line(result)
    assert "The minimum budget that would work is" in error
    assert "16.0 bytes a parameter before activations" in error
    assert "8-bit optimizer" in error


@pytest.mark.slow
def test_llama_7b_lora_plans_at_24_gib_with_optimizer_state_for_the_adapters_alone(
    cli, tmp_path
) -> None:
    json_path = tmp_path / "plan.json"
    result = cli(
        "plan", f"{LORA}:build", "--budget-gb", "24", "--device", "estimate",
        "--json", str(json_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    plan = Plan.model_validate_json(json_path.read_text())
    profile = plan.profile
    adapters = 32 * 4 * 16 * (4096 + 4096)  # layers x projections x rank x (in + out)
    assert profile.trainable_param_count == adapters
    assert profile.grad_bytes == 4 * adapters
    assert profile.optimizer_state_bytes == 8 * adapters + 4 * 32 * 4 * 2  # + step counters
    assert plan.estimate.limit_bytes <= 24 * GIB


@pytest.mark.slow
def test_llama_1b_on_one_12_gib_card_exits_3_naming_fsdp2_over_2_ranks(cli) -> None:
    result = cli("plan", f"{LLAMA}:build_1b", "--budget-gb", "12", "--device", "estimate")
    assert result.exit_code == 3
    error = _error_line(result)
    assert "Sharded with FSDP2 over 2 ranks it fits" in error
    assert "--world-size 2 --parallel fsdp2" in error


@pytest.mark.slow
def test_llama_1b_over_8_ranks_plans_a_per_rank_peak_under_the_budget(cli, tmp_path) -> None:
    json_path = tmp_path / "plan.json"
    result = cli(
        "plan", f"{LLAMA}:build_1b", "--budget-gb", "12", "--device", "estimate",
        "--world-size", "8", "--parallel", "fsdp2", "--json", str(json_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    plan = Plan.model_validate_json(json_path.read_text())
    assert plan.candidate.choices["parallel"]["world_size"] == 8
    assert plan.estimate.limit_bytes <= plan.config.usable_bytes < plan.profile.static_bytes
    assert "FSDP2 over 8 ranks" in result.stdout and "per rank" in result.stdout
