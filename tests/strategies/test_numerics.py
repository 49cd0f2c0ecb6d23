"""The precision numerics check (strategies/_numerics.py): a precision fails only where it is
worse than fp32's own spread, never for converging faster; true failures (inf/nan, a loss
that cannot follow, exploding gradients) fail; the verdict does not hang on a seed; TF32 is
offered only where the device has it, switched on process-wide, and checked the same way."""

from __future__ import annotations

import copy
import pickle
import warnings

import pytest
import torch
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.profiler._device import Target
from memadvisor.profiler._state import clone_module
from memadvisor.schema.config import PlanConfig
from memadvisor.workload import Workload
from strategies._numerics import (
    CPU_PLAN_STEPS,
    Weights,
    _compare,
    _Run,
    _spread_steps_needed,
    check_numerics,
)
from strategies.precision import TF32_OFF, TF32_ON, Precision, TF32Matmuls, precision_of
from tests.fixtures import precision_failures as planted
from tests.fixtures import tiny_hf, zoo
from tests.fixtures.steps import applied

CONFIG = PlanConfig(budget_bytes=2**30)
# The zoo (its torchvision entries skip where torchvision is missing) and transformers' own
# CNN, ConvNeXt and Swin, so that a CNN and a hierarchical vision transformer run everywhere.
ARCHITECTURES = [e.name for e in zoo.entries()] + list(tiny_hf.MODELS)
FAMILIES = {
    **{e.name: e.family for e in zoo.entries()},
    **{name: kind for name, (kind, _) in tiny_hf.MODELS.items()},
}


@pytest.fixture(autouse=True)
def _restore_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: threads cost more than they give, and on a shared machine many times
    more (a Swin check 0.3 s on one thread, 12 s on all)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _built(name: str) -> Workload:
    """The named architecture's workload; skips a zoo entry whose package is missing."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name in tiny_hf.MODELS:
            return Workload(**tiny_hf.MODELS[name][1]())
        entry = zoo.by_name(name)
        pytest.importorskip(entry.needs)
        model, batch, loss_fn = entry.build()
        return Workload(model=model, sample_batch=batch, loss_fn=loss_fn)


def test_the_architectures_that_run_with_transformers_alone_cover_every_family() -> None:
    """At least 8 architectures run without torchvision, and among them a decoder, an
    encoder-decoder, an encoder, a CNN and a hierarchical vision transformer."""
    here = [
        n for n in ARCHITECTURES if n in tiny_hf.MODELS or zoo.by_name(n).needs == "transformers"
    ]
    assert len(here) >= 8
    families = {FAMILIES[n] for n in here}
    assert {
        "decoder",
        "encoder-decoder",
        "encoder",
        "CNN",
        "hierarchical vision transformer",
    } <= families


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_bf16_trains_every_architecture_and_is_not_refused(name: str) -> None:
    """Rule: no false alarm. bf16 autocast on the CPU, from random weights, against fp32's
    spread: each passes, and the report names the spread it compared with."""
    check = check_numerics(_built(name), "bf16")
    assert check.passed, check.summary
    assert check.metrics["grad_distance_fp32"] > 0
    assert "fp32's own spread" in check.summary


# (factory, precision, GradScaler) -> fails. Each row is a model that does not train there.
PLANTED = [
    ("gradients_past_fp16", "fp16", False),  # fp16 without a scaler, gradients overflow
    ("activations_past_fp16", "fp16", True),  # hidden activations ~1e5
    ("activations_past_fp16", "fp16", False),
    ("log_of_rounded_probability", "bf16", True),  # log(1 - p), p rounded to 1: nan
    ("log_of_rounded_probability", "fp16", True),
    ("offset", "bf16", True),  # features rounded away: gradients point elsewhere
    ("offset", "fp16", True),
    ("cancelling_variance", "bf16", True),  # E[x^2] - E[x]^2 in bf16: gradients explode
    ("cancelling_variance", "fp16", True),
]


@pytest.mark.parametrize(("factory", "precision", "scaler"), PLANTED)
def test_a_planted_failure_fails(factory: str, precision: str, scaler: bool) -> None:
    check = check_numerics(Workload(**getattr(planted, factory)()), precision, scaler=scaler)
    assert not check.passed, check.summary


def test_each_planted_failure_fails_for_its_own_reason() -> None:
    """Rule: inf/nan, a GradScaler that cannot find a scale, exploding gradient norms and
    misdirected gradients are each caught by name, not by one catch-all."""
    nan = check_numerics(Workload(**planted.log_of_rounded_probability()), "bf16")
    assert "reached inf/nan" in nan.summary and "fp32 did not" in nan.summary
    no_scaler = check_numerics(Workload(**planted.gradients_past_fp16()), "fp16", scaler=False)
    assert "fp16 without a GradScaler reached inf/nan" in no_scaler.summary
    exploding = check_numerics(Workload(**planted.cancelling_variance()), "bf16")
    assert "gradient norm grows" in exploding.summary
    assert exploding.metrics["grad_norm_log_ratio"] > exploding.metrics["grad_norm_log_limit"]
    elsewhere = check_numerics(Workload(**planted.offset()), "bf16")
    assert "first gradient is" in elsewhere.summary and "beyond the limit" in elsewhere.summary


def test_what_a_scaler_rescues_and_what_bf16_trains_pass() -> None:
    """Rule: the planted failures are failures of one precision, not of the check: bf16 (fp32's
    range) trains activations past fp16's, and fp16 with its GradScaler trains gradients past
    65504 once the scaler has found its scale (the skipped steps are not counted)."""
    assert check_numerics(Workload(**planted.activations_past_fp16()), "bf16").passed
    rescued = check_numerics(Workload(**planted.gradients_past_fp16()), "fp16")
    assert rescued.passed and rescued.metrics["skipped_steps"] > 0


def test_gradients_no_scale_brings_into_fp16s_range_fail_even_with_a_scaler() -> None:
    """Rule: a GradScaler's skipped steps are its search for a scale, not a failure, up to
    24 halvings (scale 2^-8); gradients that overflow fp16 even there fail."""
    made = planted.gradients_past_fp16()
    loss_fn = made["loss_fn"]
    made["loss_fn"] = lambda out, batch: loss_fn(out, batch) * 1e7  # gradients ~1e12
    check = check_numerics(Workload(**made), "fp16")
    assert not check.passed and "the GradScaler skipped 25 steps" in check.summary


@pytest.mark.parametrize(
    ("factory", "expected"), [(lambda: _built("hf-resnet"), True), (planted.offset, False)]
)
def test_the_verdict_is_the_same_over_ten_runs_with_other_seeds(factory, expected) -> None:
    """Rule: the verdict does not hang on the dropout draw or the perturbation: ten runs with
    seeds 0..9 say the same."""
    made = factory()
    workload = made if isinstance(made, Workload) else Workload(**made)
    verdicts = {check_numerics(workload, "bf16", seed=seed).passed for seed in range(10)}
    assert verdicts == {expected}


class _DropoutDrawsByDtype(nn.Module):
    """An MLP with dropout whose masks depend on the precision, as a card's attention
    kernels do (fp32 and bf16 take different SDPA kernels, each with its own random
    stream): under autocast it draws one number more before its dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 64), nn.Linear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            torch.rand(1)
        return self.down(nn.functional.dropout(torch.relu(self.up(x)), 0.3, self.training))


def test_a_dropout_draw_the_low_precision_does_not_share_is_judged_against_another_draw() -> None:
    """Rule: where L's dropout masks differ from fp32's (a card's kernels), L fails against
    fp32's same-draw spread, and a second spread run with another draw judges it: it passes,
    and the report says which spread it was. A model without dropout (offset) gets no
    rescue from that second run."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    workload = Workload(
        model=_DropoutDrawsByDtype(), sample_batch=(x, x[:, :1]), loss_fn=planted._mse
    )
    check = check_numerics(workload, "bf16")
    assert check.passed and check.metrics["spread_runs"] == 2
    assert check.metrics["grad_distance"] > check.metrics["grad_distance_fp32_same_draw"] * 6
    assert "as that failed it, another dropout draw" in check.summary
    offset = check_numerics(Workload(**planted.offset()), "bf16")
    assert not offset.passed and offset.metrics["spread_runs"] == 2
    plain = check_numerics(Workload(**planted.activations_past_fp16()), "bf16")
    assert plain.passed and plain.metrics["spread_runs"] == 1


def test_a_check_computes_each_pair_of_runs_gradient_distance_once(monkeypatch) -> None:
    """Rule: one check asks the distance of L's first gradient to fp32's once, however many
    verdicts it weighs (the floors alone, then against each spread run): on a card each was
    a pass over every parameter, 14 s of lm350m's 33 s screen. Here L fails against the
    first spread and is judged again against another draw: three verdicts, three pairs."""
    from strategies import _numerics

    asked: list[tuple[int, int]] = []
    distance = _numerics._distance

    def counted(a, b, *device):
        asked.append((id(a), id(b)))
        return distance(a, b, *device)

    monkeypatch.setattr(_numerics, "_distance", counted)
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    workload = Workload(
        model=_DropoutDrawsByDtype(), sample_batch=(x, x[:, :1]), loss_fn=planted._mse
    )
    check = check_numerics(workload, "bf16", spread="needed")
    assert check.metrics["spread_runs"] == 2, check.summary
    assert len(asked) == len(set(asked)) == 3, asked


def _run(losses: list[float], norm: float = 1.0, grad: float = 1.0) -> _Run:
    return _Run(losses=losses, grad_norms=[norm] * len(losses), grads=[torch.tensor([grad, 1.0])])


def test_a_lower_loss_never_fails_and_a_higher_one_beyond_the_spread_does() -> None:
    """Rule: converging faster is not a numerics problem; only a higher loss counts, in units
    of fp32's spread (here 0.01 over the last 2 of 8 steps)."""
    fp32 = _run([5, 4, 3, 2, 1.5, 1.2, 1.0, 0.9])
    perturbed = _run([5, 4, 3, 2, 1.5, 1.2, 1.01, 0.91])
    faster = _run([5, 3, 2, 1, 0.5, 0.3, 0.2, 0.1])
    slower = _run([5, 4.5, 4, 3.5, 3, 2.5, 2.0, 1.9])
    assert _compare("bf16", fp32, perturbed, faster).passed
    verdict = _compare("bf16", fp32, perturbed, slower)
    assert not verdict.passed and "loss over the last 2 steps" in verdict.why
    assert verdict.metrics["loss_spread_fp32"] == pytest.approx(0.01)


def test_a_chaotic_fp32_widens_what_passes() -> None:
    """Rule: the limit is measured. The same bf16 curve (0.2 above fp32 at the end) fails
    where fp32 repeats itself and passes where fp32's own perturbed run ends 0.1 away."""
    fp32 = _run([5, 4, 3, 2.0, 1.9, 1.8, 1.7, 1.6])
    low = _run([5, 4, 3, 2.2, 2.1, 2.0, 1.9, 1.8])
    calm = _run([5, 4, 3, 2.0, 1.9, 1.8, 1.7, 1.6])
    chaotic = _run([5, 4, 3, 2.1, 1.8, 1.9, 1.8, 1.5])
    assert not _compare("bf16", fp32, calm, low).passed
    assert _compare("bf16", fp32, chaotic, low).passed


def test_the_loss_floor_is_in_roundoffs_of_the_largest_loss_so_a_lag_on_a_fall_passes() -> None:
    """Rule: the loss rule's floor is 4 roundoffs of the largest loss fp32 trained through.
    A curve that falls from 2.37 to 0.0099 in 4 steps and ends 0.0017 higher in bf16 lags a
    fraction of a step (a ResNet in bf16 on a CPU with AMX); 0.04 higher is past the floor."""
    fp32 = _run([2.37, 0.9, 0.15, 0.0099])
    calm = _run([2.37, 0.9, 0.15, 0.0099])
    assert _compare("bf16", fp32, calm, _run([2.37, 0.9, 0.15, 0.0116])).passed
    verdict = _compare("bf16", fp32, calm, _run([2.37, 0.9, 0.15, 0.05]))
    assert not verdict.passed and verdict.failed == {"loss"}


def test_gradient_norms_that_explode_beyond_fp32s_fail() -> None:
    fp32 = _run([2, 1], norm=1.0)
    perturbed = _run([2, 1], norm=1.01)
    assert _compare("bf16", fp32, perturbed, _run([2, 1], norm=1.5)).passed
    verdict = _compare("bf16", fp32, perturbed, _run([2, 1], norm=10.0))
    assert not verdict.passed and "gradient norm grows to 10x" in verdict.why


def test_the_check_refuses_what_it_cannot_compare() -> None:
    workload = Workload(**planted.offset())
    with pytest.raises(BadInputError, match="tf32"):
        check_numerics(workload, "fp32")
    with pytest.raises(BadInputError, match="steps"):
        check_numerics(workload, "bf16", steps=0)


# -- the plan's check: what it costs, and the same verdicts --------------------------------------
# A CPU plan screens with 4 steps and spread runs only as long as the verdict needs
# (Precision.screen); these rows are the ones above, checked that way.


def _as_a_cpu_plan_checks(workload: Workload, precision: str, **more):
    return check_numerics(workload, precision, steps=CPU_PLAN_STEPS, spread="needed", **more)


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_as_a_cpu_plan_checks_it_bf16_is_not_refused_either(name: str) -> None:
    """Rule: no false alarm in the plan's cheaper check (4 steps, spread runs as needed)."""
    check = _as_a_cpu_plan_checks(_built(name), "bf16")
    assert check.passed, check.summary
    assert check.metrics["steps"] == CPU_PLAN_STEPS


@pytest.mark.parametrize(("factory", "precision", "scaler"), PLANTED)
def test_as_a_cpu_plan_checks_it_a_planted_failure_still_fails(
    factory: str, precision: str, scaler: bool
) -> None:
    check = _as_a_cpu_plan_checks(Workload(**getattr(planted, factory)()), precision, scaler=scaler)
    assert not check.passed, check.summary


@pytest.mark.parametrize(
    ("factory", "expected"), [(lambda: _built("hf-resnet"), True), (planted.offset, False)]
)
def test_as_a_cpu_plan_checks_it_the_verdict_is_the_same_over_ten_seeds(factory, expected) -> None:
    """Rule: the plan's cheaper check does not hang on the dropout draw or the perturbation
    either: ten runs with seeds 0..9 say what the whole check says."""
    made = factory()
    workload = made if isinstance(made, Workload) else Workload(**made)
    verdicts = {_as_a_cpu_plan_checks(workload, "bf16", seed=seed).passed for seed in range(10)}
    assert verdicts == {expected}


def test_a_spread_run_only_as_long_as_the_verdict_needs_gives_the_same_verdict() -> None:
    """Rule: a spread only widens a limit above its floor, so where L is within a rule's
    floor that rule needs no spread: none for a pass within every floor, B's first step
    where only the gradient direction exceeds its floor, all of B where the loss or the norm
    does; each cut B judges exactly as the whole B."""
    fp32 = _run([5, 4, 3, 2.0, 1.9, 1.8, 1.7, 1.6], grad=1.0)
    whole = _run([5, 4, 3, 2.1, 1.8, 1.9, 1.8, 1.5], norm=1.2, grad=1.02)
    cases = {  # L -> the spread steps it needs
        "within every floor": (_run([5, 4, 3, 2.0, 1.9, 1.8, 1.7, 1.6], grad=1.001), 0),
        "gradient elsewhere": (_run([5, 4, 3, 2.0, 1.9, 1.8, 1.7, 1.6], grad=1.1), 1),
        "loss higher": (_run([5, 4, 3, 2.2, 2.1, 2.0, 1.9, 1.8], grad=1.001), 8),
        "norm grows": (_run([5, 4, 3, 2.0, 1.9, 1.8, 1.7, 1.6], norm=3.0, grad=1.001), 8),
    }
    for what, (low, needed) in cases.items():
        assert _spread_steps_needed("bf16", fp32, low) == needed, what
        cut = None if needed == 0 else _run(whole.losses[:needed], norm=1.2, grad=1.02)
        assert (
            _compare("bf16", fp32, cut, low).passed == _compare("bf16", fp32, whole, low).passed
        ), what


def test_as_a_cpu_plan_checks_it_a_dropout_draw_is_still_judged_against_another() -> None:
    """Rule: the second draw (B') is run, as long as the verdict needs, where L fails
    against B: the dtype-dependent draws still pass, and offset still fails."""
    torch.manual_seed(0)
    x = torch.randn(8, 16)
    workload = Workload(
        model=_DropoutDrawsByDtype(), sample_batch=(x, x[:, :1]), loss_fn=planted._mse
    )
    check = _as_a_cpu_plan_checks(workload, "bf16")
    assert check.passed and check.metrics["spread_runs"] == 2, check.summary
    offset = _as_a_cpu_plan_checks(Workload(**planted.offset()), "bf16")
    assert not offset.passed and offset.metrics["spread_runs"] == 2


_COUNTED: list[tuple[str, int]] = []  # (precision, samples) of each forward, copies' too


class _Counted(nn.Module):
    """The cnn example's model, counting the samples of each forward with the precision it
    ran in (autocast's dtype, else the fp32 matmul setting: 'high' is TF32)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_autocast_enabled(x.device.type):
            precision = str(torch.get_autocast_dtype(x.device.type)).removeprefix("torch.")
        else:
            precision = torch.get_float32_matmul_precision()
        _COUNTED.append((precision, x.shape[0]))
        return self.model(x)


def _counted_cnn(cnn_example) -> Workload:
    built = cnn_example.build()
    _COUNTED.clear()
    return Workload(**{**built, "model": _Counted(built["model"])})


def test_on_the_cpu_the_plans_check_trains_under_half_the_samples_its_profile_does(
    cnn_example,
) -> None:
    """Rule: the check costs at most a tenth of a plan's wall, counted as work, not timed
    (a loaded 2-core box times nothing reliably). On the CPU every stage of a plan is steps
    of the model, so the check's share is its steps' share. On the README's cnn the profile
    trains 14 metered steps at the sample batch and twice it (176 samples, 2.0 s of a 4.5 s
    plan); the screen's check trains 4 steps of fp32 and of bf16 and B's first step at the
    sample batch (72 samples, 0.4 s: ~9% of the plan, docs/design.md). It used to train 8
    steps of each run (192 samples, 1.05 s: 21%)."""
    from memadvisor.profiler import profile_workload

    workload = _counted_cnn(cnn_example)
    profile = profile_workload(workload, device="cpu")
    profiled = sum(n for _, n in _COUNTED)
    _COUNTED.clear()
    checks = Precision().screen(workload, profile, CONFIG)
    assert [c.choice for c in checks] == ["bf16"] and checks[0].passed
    check = checks[0].metrics
    b, steps = int(check["batch_size"]), int(check["steps"])
    spread = int(check["spread_steps"] * check["spread_runs"])
    assert steps == CPU_PLAN_STEPS
    assert sorted(set(_COUNTED)) == [("bfloat16", b), ("highest", b)]
    ran = [p for p, _ in _COUNTED]
    assert ran.count("bfloat16") == steps  # L
    assert ran.count("highest") == steps + spread <= steps + 1  # A, and B's first step
    assert 2 * sum(n for _, n in _COUNTED) < profiled


def test_one_screen_trains_fp32_once_for_every_precision_it_checks(
    cnn_example, profile_factory
) -> None:
    """Rule: the fp32 reference is one run for every precision a screen checks (bf16, then
    TF32 beside it): each precision adds its own run and only the spread steps it needs."""
    workload = _counted_cnn(cnn_example)
    checks = Precision().screen(workload, _with_tf32(profile_factory([(10, 2, 1)])), CONFIG)
    assert [c.choice for c in checks] == ["bf16", "tf32"] and all(c.passed for c in checks)
    steps = int(checks[0].metrics["steps"])
    spread = sum(int(c.metrics["spread_steps"] * c.metrics["spread_runs"]) for c in checks)
    ran = [p for p, _ in _COUNTED]
    assert ran.count("bfloat16") == ran.count("high") == steps  # L of each
    assert ran.count("highest") == steps + spread  # one A


# -- TF32 ------------------------------------------------------------------------------------


def _with_tf32(profile):
    device = profile.device.model_copy(update={"tf32_supported": True})
    return profile.model_copy(update={"device": device})


def test_tf32_is_offered_only_where_the_device_has_it(profile_factory) -> None:
    """Rule: the CPU has no TF32 (its profile says so, and it is not offered); a card that
    has it (faked here) gets it beside fp32 and the autocast precision."""
    assert Target(torch.device("cpu"), fake=False).info().tf32_supported is False
    profile = profile_factory([(10, 2, 1)])
    assert "tf32" not in Precision().choices(profile, CONFIG)
    assert Precision().choices(_with_tf32(profile), CONFIG) == ["fp32", "tf32", "bf16"]
    with pytest.raises(BadInputError, match="tf32 is not supported"):
        applied(Precision(), nn.Linear(2, 2), "tf32", profile)


def test_applying_tf32_switches_it_on_process_wide_and_fp32_switches_it_back() -> None:
    torch.set_float32_matmul_precision("highest")
    model = nn.Linear(4, 4)
    applied(Precision(), model, "tf32", None)
    assert torch.get_float32_matmul_precision() == "high" and precision_of(model) == "tf32"
    assert model(torch.randn(2, 4)).dtype == torch.float32  # no autocast
    applied(Precision(), model, "bf16", None)  # one precision at a time
    assert precision_of(model) == "bf16" and torch.get_float32_matmul_precision() == "highest"
    applied(Precision(), model, "tf32", None)
    applied(Precision(), model, "fp32", None)
    assert precision_of(model) == "fp32" and torch.get_float32_matmul_precision() == "highest"


def test_a_saved_tf32_model_switches_it_on_where_it_is_loaded() -> None:
    model = applied(Precision(), nn.Linear(4, 4), "tf32", None)
    data = pickle.dumps(model)
    torch.set_float32_matmul_precision("highest")  # a fresh process
    loaded = pickle.loads(data)
    assert precision_of(loaded) == "tf32" and torch.get_float32_matmul_precision() == "high"
    assert isinstance(loaded.__dict__["forward"], TF32Matmuls)


_SEEN: list[str] = []  # the matmul precision each forward of the copies ran under


class _RecordsMatmulPrecision(nn.Linear):
    def __init__(self) -> None:
        super().__init__(4, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SEEN.append(torch.get_float32_matmul_precision())
        return super().forward(x)


def test_the_tf32_check_trains_its_run_in_tf32_and_restores_the_setting() -> None:
    """On the CPU TF32 changes nothing (so it passes); what is checked is the plumbing: the
    low run sees 'high', the fp32 runs 'highest' even where the process had TF32 on, and the
    caller's setting is back after."""
    torch.set_float32_matmul_precision("high")
    x = torch.randn(8, 4)
    workload = Workload(
        model=_RecordsMatmulPrecision(),
        sample_batch=(x, x[:, :1]),
        loss_fn=lambda out, batch: ((out - batch[1]) ** 2).mean(),
    )
    _SEEN.clear()
    check = check_numerics(workload, "tf32", steps=2)
    assert check.passed and check.choice == "tf32"
    assert "perturbed by 0.000488" in check.summary  # TF32's rounding, 2^-11
    assert _SEEN == ["highest"] * 2 + ["high"] * 2 + ["highest"] * 2  # A, L, B
    assert torch.get_float32_matmul_precision() == "high"


def test_tf32_is_screened_and_reported_as_process_wide(profile_factory) -> None:
    profile = _with_tf32(profile_factory([(10, 2, 1)]))
    strategy = Precision()
    workload = Workload(**planted.activations_past_fp16())
    checks = strategy.screen(workload, profile, CONFIG)
    assert [c.choice for c in checks] == ["bf16", "tf32"] and all(c.passed for c in checks)
    advice = strategy.explain("tf32", profile)
    assert "process-wide" in advice.sentence and TF32_ON in advice.snippet
    assert TF32_OFF in advice.snippet and TF32_OFF in advice.sentence


def test_the_report_row_says_tf32_is_process_wide_and_how_to_switch_it_off() -> None:
    part = Precision().describe("tf32", None)  # the plan is read only for autocast's words
    assert part.brief == "tf32" and part.step_precision == "fp32"  # fp32's profiled step
    assert "process-wide" in part.words and TF32_ON in part.words and TF32_OFF in part.words
    assert any(TF32_ON in line for line in part.loop.setup)


@pytest.mark.gpu
def test_on_a_card_tf32_is_offered_checked_and_switched_on_process_wide() -> None:
    """On a card of compute capability 8.0+: the profile says TF32, its check trains on the
    card and passes a plain transformer, and the fp32 runs stay full fp32."""
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("TF32 needs compute capability 8.0+")
    info = Target(torch.device("cuda"), fake=False).info()
    assert info.tf32_supported
    torch.set_float32_matmul_precision("highest")
    workload = _built("llama")
    for precision in ("tf32", "bf16"):
        check = check_numerics(workload, precision, device="cuda")
        assert check.passed, check.summary
    assert torch.get_float32_matmul_precision() == "highest"
    model = applied(Precision(), nn.Linear(4, 4).cuda(), "tf32", None)
    assert torch.get_float32_matmul_precision() == "high" and precision_of(model) == "tf32"


@pytest.mark.gpu
def test_on_a_card_the_planted_failures_fail() -> None:
    for factory, precision, scaler in PLANTED:
        workload = Workload(**getattr(planted, factory)())
        check = check_numerics(workload, precision, device="cuda", scaler=scaler)
        assert not check.passed, (factory, precision, check.summary)


def test_tf32_is_put_back_exactly_as_a_fresh_process_has_it() -> None:
    """After TF32 on and off again, the process's matmul precision is what it was, the newer
    API's per-backend fields included: torch.set_float32_matmul_precision("highest") alone
    leaves torch.backends.cuda.matmul.fp32_precision at "ieee" where a fresh process has
    "none", and inductor keys its on-disk FX graph cache on it (a card's plan trialled its
    compile after the TF32 check, and no probe process found the trial's graphs)."""
    from memadvisor import _torch_private
    from strategies._numerics import tf32_matmuls

    before = _torch_private.matmul_precision_state()
    with tf32_matmuls():
        assert torch.get_float32_matmul_precision() == "high"
    assert _torch_private.matmul_precision_state() == before


class _Tied(nn.Module):
    """An embedding tied to the output head, a buffer, and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.full((8,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.frozen(self.embed(x)) * self.scale)


def test_a_copy_made_from_given_tensors_keeps_ties_and_flags_and_shares_nothing():
    """clone_module's make (the staged copies' structure): each parameter and buffer is the tensor
    made for it, made once per tensor (a tied weight stays one tensor), a parameter stays a
    parameter with its requires_grad, and nothing is shared with the model."""
    model = _Tied()
    made: list[int] = []

    def make(t: torch.Tensor) -> torch.Tensor:
        made.append(id(t))
        return t.detach().clone()

    copied = clone_module(model, make=make)
    assert len(made) == len(set(made)) == 4  # embed (= head), frozen's two, the buffer
    assert copied.head.weight is copied.embed.weight
    assert isinstance(copied.frozen.weight, nn.Parameter)
    assert not copied.frozen.weight.requires_grad and copied.embed.weight.requires_grad
    for (name, a), (_, b) in zip(
        model.state_dict(keep_vars=True).items(),
        copied.state_dict(keep_vars=True).items(),
        strict=True,
    ):
        assert torch.equal(a, b), name
        assert a.data_ptr() != b.data_ptr(), name
    x = torch.tensor([[1, 2, 3]])
    assert torch.equal(model(x), copied(x))


@pytest.mark.gpu
def test_staged_copies_on_a_card_train_as_deep_copies_do_and_stage_once():
    """Weights on a card: a model on the CPU is staged in pinned memory once, and each copy
    from it trains exactly as a deep copy moved to the card does."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    torch.manual_seed(0)
    model = _Tied()
    weights = Weights(model)
    x = torch.tensor([[1, 2, 3, 4]], device="cuda")

    def step(copied: nn.Module) -> tuple[float, torch.Tensor]:
        loss = copied(x).float().pow(2).mean()
        loss.backward()
        return float(loss), copied.embed.weight.grad.cpu()

    first = weights.copy_to(torch.device("cuda"))
    pinned = weights._pinned
    assert pinned is not None and all(t.is_pinned() for t in pinned.values())
    second = weights.copy_to(torch.device("cuda"))
    assert weights._pinned is pinned  # staged once
    assert first.embed.weight.data_ptr() != second.embed.weight.data_ptr()
    assert second.head.weight is second.embed.weight
    reference = step(copy.deepcopy(model).to("cuda"))
    for copied in (first, second):
        loss, grad = step(copied)
        assert loss == reference[0]
        assert torch.allclose(grad, reference[1], rtol=0.0, atol=1e-6)
    assert model.embed.weight.grad is None  # the model itself untouched
