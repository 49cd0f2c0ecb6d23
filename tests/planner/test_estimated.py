"""device="estimate": a plan from fake tensors and the estimate alone, nothing run anywhere."""

from __future__ import annotations

import resource
import textwrap
from pathlib import Path

import pytest
import torch

import memadvisor
from memadvisor.device.fake import fake_workload, load_fake_target
from memadvisor.errors import InfeasibleBudgetError
from memadvisor.estimate import estimate
from memadvisor.planner import plan_estimated, plan_workload
from memadvisor.planner._space import largest_batch
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import GIB, PlanConfig
from memadvisor.strategy import load_strategies
from memadvisor.target import load_factory

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TINY = {"batch_size": 2, "seq_len": 32, "n_layers": 2}


def _llama(**kwargs):  # noqa: ANN003, ANN202
    return load_factory(f"{EXAMPLES}/llama.py:build")(**{**TINY, **kwargs})


def _lora(**kwargs):  # noqa: ANN003, ANN202
    return load_factory(f"{EXAMPLES}/llama_lora.py:build")(preset="tiny", **{**TINY, **kwargs})


def _config(budget_gib: float, **kwargs) -> PlanConfig:  # noqa: ANN003
    return PlanConfig(budget_bytes=int(budget_gib * GIB), device="estimate", **kwargs)


@pytest.fixture(scope="module")
def tiny_plan():
    workload = fake_workload(lambda: _llama())
    return plan_workload(workload, _config(0.25), progress=False)


def test_an_estimate_plan_ran_nothing_and_says_every_figure_is_estimated(tiny_plan) -> None:
    plan = tiny_plan
    assert plan.device_kind == "estimate" and plan.verified is None and plan.probes == []
    assert plan.comparison and all(row.measured is None for row in plan.comparison)
    assert plan.notes[0].startswith("Every figure in this plan is estimated")
    assert plan.basis is not None
    said = " ".join(plan.basis.cannot_know)
    assert "Step times are not measured but modelled" in said and "torch.compile" in said
    assert plan.stages == []
    # The only checks are screens that decide on recognition: none measured anything.
    by_name = {s.name: s for s in load_strategies()}
    assert all(by_name[c.strategy].screens_fake_tensors for c in plan.checks)
    assert all(c.metrics == {} for c in plan.checks)


def test_the_pick_is_the_largest_batch_under_the_usable_budget_by_the_estimate(tiny_plan) -> None:
    plan = tiny_plan
    chosen = load_strategies()
    usable = plan.config.usable_bytes
    pick = plan.candidate
    assert estimate(plan.profile, pick, chosen).limit_bytes <= usable
    one_more = Candidate(batch_size=pick.batch_size + 1, choices=pick.choices)
    assert estimate(plan.profile, one_more, chosen).limit_bytes > usable


def test_each_phase_s_predicted_peak_is_kept_and_the_peak_is_their_maximum(tiny_plan) -> None:
    for row in tiny_plan.comparison:
        phases = row.estimate.phase_peak_bytes
        assert set(phases) == {"forward", "backward", "optimizer"}
        assert max(phases.values()) == row.estimate.peak_bytes
        assert phases[row.estimate.peak_phase] == row.estimate.peak_bytes


def test_step_times_come_from_the_flops_so_recompute_and_precision_cost_time(tiny_plan) -> None:
    """Fake ops take no time; the FLOP model must still charge a checkpointed block's
    forward again and run bf16 matmuls at bf16's rate, or the search could not rank them."""
    profile = tiny_plan.profile
    chosen = load_strategies()
    blocks = [b.name for b in profile.blocks]
    rates = tiny_plan.basis.time_model.matmul_tflops
    optimizer_ms = profile.steps["fp32"].optimizer_ms
    assert optimizer_ms > 0

    def step_ms(**choices) -> float:  # noqa: ANN003
        return estimate(profile, Candidate(batch_size=8, choices=choices), chosen).step_ms

    compute = {p: step_ms(precision=p) - optimizer_ms for p in ("fp32", "bf16")}
    assert compute["fp32"] / compute["bf16"] == pytest.approx(rates["bf16"] / rates["fp32"])
    recompute = sum(b.forward_ms.at(8) for b in profile.steps["bf16"].blocks)
    assert recompute > 0
    assert step_ms(precision="bf16", checkpointing=blocks) == pytest.approx(
        step_ms(precision="bf16") + recompute
    )


def _gpt_example() -> dict:
    """examples/gpt.py at 64 tokens and GPT-2's 50304-token vocabulary: its fp32 logits
    (12.9 MB a sample) dwarf its 2 blocks' activations."""
    return load_factory(f"{EXAMPLES}/gpt.py:build")(batch_size=2, n_layer=2)


def test_the_chunked_loss_is_offered_on_recognition_and_picked_where_the_logits_decide() -> None:
    """loss_head screens without a device (Checked.screens_fake_tensors): an estimate plan
    offers it where memadvisor owns the loss (examples/gpt.py's TokenCrossEntropy), its
    check says nothing was measured, and at the largest batch the pick chunks the loss and
    affords more than the best plan without it."""
    job = _gpt_example()
    plan = memadvisor.plan(
        job["model"],
        job["sample_batch"],
        loss_fn=job["loss_fn"],
        budget_gb=1.0,
        objective="largest_batch",
        device="estimate",
        progress=False,
    )
    (check,) = [c for c in plan.checks if c.strategy == "loss_head"]
    assert check.passed and "not measured" in check.summary
    assert "+Chunked loss" in [row.label for row in plan.comparison]
    assert plan.candidate.choice("loss_head", "off") != "off"
    chosen = load_strategies()
    without = {**plan.candidate.choices, "loss_head": "off"}
    usable = plan.config.usable_bytes
    assert largest_batch(plan.profile, without, chosen, usable, 4096) < plan.candidate.batch_size


def test_an_estimate_plan_runs_no_numerics_check(monkeypatch) -> None:
    """Precision's screen trains copies of the model, which fake tensors cannot: an estimate
    plan does not screen it (it does not state screens_fake_tensors), offers bf16 unchecked,
    and says no numerics check ran."""
    import strategies.precision as precision

    def no_numerics(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("an estimate plan ran a numerics check")

    monkeypatch.setattr(precision, "check_numerics", no_numerics)
    assert not precision.Precision.screens_fake_tensors
    plan = plan_workload(fake_workload(lambda: _llama()), _config(0.25), progress=False)
    assert plan.candidate.choice("precision", "fp32") == "bf16"
    assert all(c.strategy != "precision" for c in plan.checks)
    assert "No numerics check ran for reduced precision" in " ".join(plan.notes)


def test_a_budget_nothing_fits_names_the_minimum_the_bytes_a_parameter_and_advice() -> None:
    """Full fine-tuning with AdamW in fp32: 4 + 4 + 8 = 16 bytes a parameter before
    activations; the minimum named is a budget that then plans."""
    workload = fake_workload(lambda: _llama())
    with pytest.raises(InfeasibleBudgetError) as caught:
        plan_estimated(workload, _config(0.01), progress=False)
    error = caught.value
    message = str(error)
    assert "16.0 bytes a parameter before activations" in message
    assert "Not planned here" in message and "8-bit optimizer" in message
    assert f"{error.minimum_bytes / GIB:.2f}" in message
    plan = plan_estimated(workload, _config(error.minimum_bytes / GIB), progress=False)
    assert plan.candidate.batch_size >= 1


def test_a_frozen_base_has_no_gradients_or_optimizer_state_only_its_adapters_do() -> None:
    """LoRA: bf16 base frozen (requires_grad=False), fp32 adapters trainable."""
    job = _lora()
    adapters = [p for p in job["model"].parameters() if p.requires_grad]
    adapter_bytes = sum(p.numel() * 4 for p in adapters)
    plan = plan_workload(fake_workload(lambda: _lora()), _config(0.25), progress=False)
    profile = plan.profile
    assert profile.grad_bytes == adapter_bytes
    # AdamW: two fp32 moments per adapter, plus its 4-byte step counter per tensor.
    assert profile.optimizer_state_bytes == 2 * adapter_bytes + 4 * len(adapters)
    assert profile.trainable_param_count == sum(p.numel() for p in adapters)
    assert profile.param_count == sum(p.numel() for p in job["model"].parameters())
    assert plan.estimate.breakdown["optimizer_state"] == profile.optimizer_state_bytes


def test_the_effective_batch_is_reached_by_accumulation() -> None:
    workload = fake_workload(lambda: _llama())
    plan = plan_estimated(
        workload,
        _config(0.25, objective="effective_batch", effective_batch=512),
        progress=False,
    )
    pick = plan.candidate
    assert pick.accumulation_steps > 1
    assert pick.batch_size * pick.accumulation_steps == 512


def test_a_model_built_on_the_meta_device_plans_as_its_real_twin() -> None:
    """Python users build big models under torch.device("meta"); a real batch goes with it."""
    real = _llama()
    with torch.device("meta"):
        meta = _llama()["model"]
    assert next(meta.parameters()).is_meta
    plans = [
        memadvisor.plan(
            model,
            real["sample_batch"],
            loss_fn=real["loss_fn"],
            budget_gb=0.25,
            device="estimate",
            progress=False,
        )  # fmt: skip
        for model in (real["model"], meta)
    ]
    assert plans[0].candidate == plans[1].candidate
    assert plans[0].estimate.peak_bytes == plans[1].estimate.peak_bytes
    assert next(meta.parameters()).is_meta  # the caller's model is left as it was
    # The plan applies to the real model (its fingerprint is the fake twin's names and shapes).
    assert plans[1].model_fingerprint == plans[0].model_fingerprint
    memadvisor.apply_plan(real["model"], plans[1])


def test_a_model_far_larger_than_this_machine_is_planned_without_its_memory(tmp_path) -> None:
    """A 64 GiB weight (one 131072 x 131072 fp32 linear) costs no memory here."""
    factory = tmp_path / "huge.py"
    factory.write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def build():
                model = nn.Sequential(nn.Linear(131072, 131072, bias=False))
                return {
                    "model": model,
                    "sample_batch": torch.randn(2, 131072),
                    "loss_fn": lambda out, batch: out.square().mean(),
                }
            """
        )
    )
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    workload = load_fake_target(f"{factory}:build")
    plan = plan_workload(workload, _config(4096), progress=False)
    grown_gib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 2**20
    assert plan.profile.param_bytes == 131072 * 131072 * 4
    assert grown_gib < 1.0


def test_a_card_s_cap_strands_the_largest_tensor_so_the_plan_fits_peak_plus_logits(
    tiny_plan,
) -> None:
    """Under a memory fraction the allocator reserves about one largest tensor beyond its
    allocated peak; for an LM that is the fp32 logits (batch x 32 tokens x 1024 x 4 bytes),
    or, where the pick computes the loss in chunks, a chunk of them or the blocks' largest
    tensor (well under the whole logits)."""
    profile, pick = tiny_plan.profile, tiny_plan.candidate
    logits = 32 * 1024 * 4
    assert profile.steps["fp32"].largest_allocation.at(16) == 16 * logits
    est = tiny_plan.estimate
    stranded = est.reserved_peak_bytes - est.peak_bytes
    if pick.choices.get("loss_head", "off") == "off":
        assert stranded == pick.batch_size * logits
    else:
        inside = profile.steps[pick.choices["precision"]].largest_block_allocation
        assert inside.at(pick.batch_size) <= stranded < pick.batch_size * logits, (stranded, pick)
    assert est.limit_bytes <= tiny_plan.config.usable_bytes


def test_fsdp2_over_more_cards_than_this_machine_has_plans_what_one_card_cannot_hold() -> None:
    """Weights, gradients and AdamW state too large for one card's budget are sharded 1/N
    by FSDP2: the per-rank estimate plans 8 ranks here, with no card and no process group."""
    # 13.7M parameters, 8 tokens: 0.2 GiB of weights, gradients and state, few activations.
    workload = fake_workload(lambda: _llama(seq_len=8, n_layers=4, dim=512, ffn_dim=1376))
    with pytest.raises(InfeasibleBudgetError) as caught:
        plan_estimated(workload, _config(0.25), progress=False)
    assert caught.value.minimum_bytes > 0.25 * GIB
    plan = plan_estimated(workload, _config(0.25, world_size=8, parallel="fsdp2"), progress=False)
    choice = plan.candidate.choices["parallel"]
    assert choice["kind"] == "fsdp2" and choice["world_size"] == 8
    assert plan.estimate.limit_bytes <= plan.config.usable_bytes
