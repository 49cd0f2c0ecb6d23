"""Precision: offered only where the device has it, autocast (or TF32) applied with keys
unchanged, and a numerics check that decides whether it is offered (the check's own rules:
tests/strategies/test_numerics.py)."""

from __future__ import annotations

import copy
import io
import math
import pickle

import pytest
import torch
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.estimate import StepModel, estimate
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.strategy import load_strategies
from memadvisor.workload import Workload
from strategies import _forward
from strategies.precision import (
    NUMERICS_MAX_BATCH,
    Precision,
    check_numerics,
    precision_of,
)
from tests.fixtures.steps import applied

PRECISION = Precision()
CONFIG = PlanConfig(budget_bytes=2**30)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))


@pytest.mark.parametrize(
    ("bf16", "fp16", "expected"),
    [(True, True, ["fp32", "bf16"]), (False, True, ["fp32", "fp16"]), (False, False, ["fp32"])],
)
def test_offers_bf16_else_fp16_and_never_what_the_device_lacks(
    profile_factory, bf16: bool, fp16: bool, expected: list[str]
) -> None:
    profile = profile_factory([(10, 2, 1)], bf16=bf16, fp16=fp16)
    assert PRECISION.choices(profile, CONFIG) == expected


def test_apply_runs_the_forward_under_autocast_with_keys_unchanged() -> None:
    model = _mlp()
    keys = list(model.state_dict())
    x = torch.randn(4, 8)
    assert model(x).dtype == torch.float32
    applied(PRECISION, model, "bf16", None)
    assert model(x).dtype == torch.bfloat16
    assert list(model.state_dict()) == keys
    assert all(p.dtype == torch.float32 for p in model.parameters())  # weights stay fp32
    assert precision_of(model) == "bf16"


def test_apply_twice_updates_and_fp32_takes_it_off() -> None:
    model = _mlp()
    applied(PRECISION, model, "bf16", None)
    applied(PRECISION, model, "fp16", None)
    assert len(list(_forward.wrappers(model))) == 1 and precision_of(model) == "fp16"
    applied(PRECISION, model, "fp32", None)
    assert "forward" not in model.__dict__ and model(torch.randn(2, 8)).dtype == torch.float32


def test_apply_refuses_a_precision_the_profiled_device_lacks(profile_factory) -> None:
    profile = profile_factory([(10, 2, 1)], bf16=False, fp16=True)
    with pytest.raises(BadInputError, match="not supported"):
        applied(PRECISION, _mlp(), "bf16", profile)
    with pytest.raises(BadInputError, match="one of"):
        applied(PRECISION, _mlp(), "int8", None)


def test_autocast_model_pickles_and_keeps_its_precision() -> None:
    model = applied(PRECISION, _mlp(), "bf16", None)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert loaded(torch.randn(2, 8)).dtype == torch.bfloat16
    assert pickle.loads(pickle.dumps(model)).forward.module is not model


def test_effect_reads_the_bf16_step_and_runs_before_other_strategies(profile_factory) -> None:
    """Precision's effect resets activation numbers, so it must run first (effect_order)."""
    profile = profile_factory([(10, 2, 1), (10, 2, 1)])
    model = StepModel(profile, batch_size=4)
    PRECISION.effect(profile, "bf16", model)
    assert model.precision == "bf16"
    assert model.block_activation_bytes == [20 * 2**20, 20 * 2**20]  # halved from 40 MiB
    strategies = load_strategies()
    assert min(strategies, key=lambda s: s.effect_order).name == "precision"
    # With checkpointing too, the estimate is the same whichever order the list has.
    cand = Candidate(batch_size=4, choices={"precision": "bf16", "checkpointing": ["layers.0"]})
    assert estimate(profile, cand, strategies) == estimate(profile, cand, strategies[::-1])


def test_explain_bf16_has_no_scaler_and_fp16_shows_the_grad_scaler(profile_factory) -> None:
    profile = profile_factory([(10, 2, 1)])
    assert PRECISION.explain("fp32", profile) is None
    bf16 = PRECISION.explain("bf16", profile)
    fp16 = PRECISION.explain("fp16", profile)
    assert "torch.bfloat16" in bf16.snippet and "GradScaler" not in bf16.snippet
    assert "GradScaler" in fp16.snippet and "scaler.scale(loss).backward()" in fp16.snippet
    assert "measured" in bf16.effect


def _workload() -> Workload:
    torch.manual_seed(1)
    x, y = torch.randn(16, 8), torch.randint(0, 4, (16,))
    return Workload(
        model=_mlp(),
        sample_batch=(x, y),
        loss_fn=lambda out, batch: nn.functional.cross_entropy(out.float(), batch[1]),
    )


def test_numerics_check_measures_fp32s_spread_and_leaves_the_model_alone() -> None:
    """Rule: the check reports what it compared (the low precision and fp32's own spread,
    both nonzero: bf16 rounds, the perturbed fp32 run differs) and leaves the user's model,
    its forward and the RNG as they were."""
    workload = _workload()
    before = copy.deepcopy(workload.model.state_dict())
    rng = torch.get_rng_state()
    check = check_numerics(workload, "bf16", steps=3)
    assert check.strategy == "precision" and check.choice == "bf16"
    assert check.metrics["grad_distance_fp32"] > 0 and check.metrics["grad_distance"] > 0
    assert check.metrics["loss_spread_fp32"] > 0
    assert check.metrics["batch_size"] == NUMERICS_MAX_BATCH  # of the 16 sample rows
    assert check.passed and "bf16 vs fp32 over 3 training steps" in check.summary
    assert "fp32 vs fp32 with weights perturbed by 0.00391" in check.summary
    after = workload.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert "forward" not in workload.model.__dict__  # the user's model was not wrapped
    assert torch.equal(torch.get_rng_state(), rng)


def test_numerics_check_is_zero_for_identical_runs_so_the_difference_is_real() -> None:
    """The fp32 reference is deterministic: bf16's difference is not run-to-run noise."""
    from strategies._numerics import _train

    workload = _workload()
    runs = [
        _train(workload, "fp32", 2, seed=0, batch=workload.batch(8), device=torch.device("cpu"))
        for _ in range(2)
    ]
    assert runs[0].losses == runs[1].losses and runs[0].grad_norms == runs[1].grad_norms


def _offset():
    from memadvisor.target import load_target

    return load_target("tests.fixtures.factories:offset")


def test_a_model_bf16_cannot_follow_fails_the_check() -> None:
    """Rule: the check fails when bf16's gradients point elsewhere by more than fp32's own
    spread allows (features on a large offset: bf16 rounds most of them away)."""
    check = check_numerics(_offset(), "bf16")
    assert not check.passed
    assert check.metrics["grad_distance"] > check.metrics["grad_distance_limit"]
    assert "fp32's own distance" in check.summary


class _Overflows(nn.Module):
    """Outputs around 4e5: finite in fp32, past fp16's largest value (65504)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        nn.init.constant_(self.lin.weight, 1e4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def test_inf_or_nan_in_the_low_precision_fails_the_check() -> None:
    workload = Workload(
        model=_Overflows(),
        sample_batch=torch.full((4, 4), 10.0),
        loss_fn=lambda out, batch: out.float().mean(),
    )
    check = check_numerics(workload, "fp16", steps=2)
    assert not check.passed and "inf/nan" in check.summary
    assert all(math.isfinite(v) for v in check.metrics.values())


def test_screen_leaves_a_failed_precision_out_of_the_choices_unless_told_to_report(
    profile_factory,
) -> None:
    """Rule: a low precision whose check fails is not offered; the next one the device runs
    is checked in its place; with checks='report' the first is checked and still offered."""
    profile = profile_factory([(10, 2, 1)], bf16=True, fp16=True)
    workload = _offset()
    strategy = Precision()
    checks = strategy.screen(workload, profile, CONFIG)
    assert [c.choice for c in checks] == ["bf16", "fp16"]
    assert not checks[0].passed
    offered = strategy.choices(profile, CONFIG)
    assert "bf16" not in offered and offered[0] == "fp32"
    assert offered[1:] == ([] if not checks[1].passed else ["fp16"])

    report = CONFIG.model_copy(update={"checks": "report"})
    checks = strategy.screen(workload, profile, report)
    assert [c.choice for c in checks] == ["bf16"]
    assert strategy.choices(profile, report) == ["fp32", "bf16"]


def test_check_method_runs_the_numerics_check_only_for_low_precision() -> None:
    workload = _workload()
    assert PRECISION.check(workload, "fp32") is None
    assert PRECISION.check(workload, "fp16").choice == "fp16"


def test_numerics_check_rejects_bad_input() -> None:
    with pytest.raises(BadInputError, match="bf16"):
        check_numerics(_workload(), "fp32")
    with pytest.raises(BadInputError, match="steps"):
        check_numerics(_workload(), "bf16", steps=0)


def test_numerics_check_on_a_named_device_trains_copies_there_and_answers_alike() -> None:
    """``device`` moves only the copies: on the model's own device the check is the default
    one, and the user's model stays where it was (Precision.check names CUDA when there is
    one, so a plan on a card does not train on the CPU)."""
    workload = _workload()
    default = check_numerics(workload, "bf16", steps=2)
    named = check_numerics(workload, "bf16", steps=2, device="cpu")
    timeless = lambda check: {k: v for k, v in check.metrics.items() if k != "wall_ms"}  # noqa: E731
    assert timeless(named) == timeless(default)
    assert all(p.device.type == "cpu" for p in workload.model.parameters())
