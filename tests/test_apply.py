"""apply_candidate / apply_plan rewrite a model to a pick; a third party's strategy plugs in."""

from __future__ import annotations

import copy
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

import memadvisor
from memadvisor.apply import run_checks
from memadvisor.errors import BadInputError
from memadvisor.estimate import estimate
from memadvisor.schema.candidate import Candidate, Estimate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.plan import ModelFingerprint, Plan
from memadvisor.schema.profile import (
    BlockActivity,
    BlockInfo,
    DeviceInfo,
    LinearBytes,
    Profile,
    StepProfile,
)
from memadvisor.strategy import Strategy, apply_to_model, load_strategies
from memadvisor.workload import Workload
from strategies import _forward

MIB = 2**20


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.1), nn.GELU()) for _ in range(3)
        )
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


def _net() -> Net:
    torch.manual_seed(0)
    return Net()


def _profile() -> Profile:
    act = LinearBytes(per_sample_bytes=MIB)
    step = StepProfile(
        precision="fp32",
        blocks=[BlockActivity(name=f"blocks.{i}", activation=act, input=act) for i in range(3)],
        activation_total=LinearBytes(per_sample_bytes=3 * MIB),
    )
    return Profile(
        model_name="Net",
        device=DeviceInfo(kind="cpu", name="cpu", bf16_supported=True),
        batch_sizes=(1, 2),
        param_bytes=MIB,
        grad_bytes=MIB,
        optimizer_state_bytes=2 * MIB,
        blocks=[BlockInfo(name=f"blocks.{i}", type_name="Sequential") for i in range(3)],
        steps={"fp32": step},
    )


CANDIDATE = Candidate(
    batch_size=4,
    choices={
        "precision": "bf16",
        "checkpointing": ["blocks.0", "blocks.2"],
        "optimizer_habits": "advice",
    },
)


def _rewrites(model: nn.Module) -> dict[str, list[tuple[str, dict]]]:
    """Each module's installed forward wrappers and their options: the rewrite, as data."""
    out = {}
    for name, module in model.named_modules():
        found = [
            (
                type(w).__name__,
                {
                    k: v
                    for k, v in vars(w).items()
                    if k not in ("module", "inner") and not k.startswith("_")
                },
            )
            for w in _forward.wrappers(module)
        ]
        if found:
            out[name] = found
    return out


def _grads(model: nn.Module) -> list[torch.Tensor]:
    torch.manual_seed(5)
    model(torch.randn(4, 8)).float().sum().backward()
    return [p.grad for p in model.parameters()]


def test_apply_plan_from_json_gives_the_same_rewrite_as_apply_candidate() -> None:
    """A plan saved as JSON and loaded back rewrites a model exactly as optimize() would."""
    plan = _plan()
    loaded = Plan.model_validate_json(plan.model_dump_json())
    by_plan = memadvisor.apply_plan(_net(), loaded)
    by_candidate = apply_to_model(_net(), CANDIDATE, profile=_profile()).model
    assert (
        _rewrites(by_plan)
        == _rewrites(by_candidate)
        == {
            "": [("AutocastForward", {"precision": "bf16"})],
            "blocks.0": [("CheckpointedForward", {})],
            "blocks.2": [("CheckpointedForward", {})],
        }
    )
    assert all(
        torch.equal(a, b) for a, b in zip(_grads(by_plan), _grads(by_candidate), strict=True)
    )
    assert by_plan.memadvisor_plan == loaded
    assert list(by_plan.state_dict()) == list(_net().state_dict())


def _plan() -> Plan:
    return Plan(
        model_name="Net",
        config=PlanConfig(budget_bytes=2**30),
        device_kind="simulated",
        device_name="cpu",
        candidate=CANDIDATE,
        estimate=Estimate(
            peak_bytes=1, peak_phase="backward", breakdown={}, step_ms=1.0, samples_per_s=1.0
        ),
        profile=_profile(),
        model_fingerprint=ModelFingerprint.of(_net()),
    )


@pytest.mark.parametrize("as_path", [str, Path])
def test_apply_plan_takes_the_path_of_a_saved_plan(tmp_path: Path, as_path) -> None:
    """apply_plan(model, path) as a str or a Path: the same rewrite as the Plan itself, and
    Plan.load reads back the plan to_json wrote."""
    plan = _plan()
    path = tmp_path / "plan.json"
    plan.to_json(path)
    assert Plan.load(as_path(path)) == plan
    by_path = memadvisor.apply_plan(_net(), as_path(path))
    assert _rewrites(by_path) == _rewrites(memadvisor.apply_plan(_net(), plan))
    assert by_path.memadvisor_plan == plan


@pytest.mark.parametrize("bad", [{"candidate": {}}, 3, None, b"plan.json"])
def test_apply_plan_refuses_what_is_neither_a_plan_nor_a_path(bad) -> None:
    """A dict, a number, None, bytes: a BadInputError naming the type and what to pass (it
    was a raw AttributeError)."""
    with pytest.raises(BadInputError, match=f"but got {type(bad).__name__}.*memadvisor.plan"):
        memadvisor.apply_plan(_net(), bad)


def test_plan_load_names_a_missing_file_and_a_file_that_is_not_a_plan(tmp_path: Path) -> None:
    """A missing file: BadInputError with the path; a JSON file that is no plan: one that
    says which field is wrong."""
    with pytest.raises(BadInputError, match="Cannot read a plan from .*nope.json"):
        Plan.load(tmp_path / "nope.json")
    (tmp_path / "other.json").write_text('{"model_name": "Net"}')
    with pytest.raises(BadInputError, match="other.json' is not a plan this memadvisor reads"):
        memadvisor.apply_plan(_net(), tmp_path / "other.json")


def test_apply_candidate_is_idempotent_and_skips_neutral_choices() -> None:
    model = apply_to_model(_net(), CANDIDATE).model
    once = _rewrites(model)
    apply_to_model(model, CANDIDATE)
    assert _rewrites(model) == once
    off = Candidate(batch_size=4, choices={"precision": "fp32", "checkpointing": []})
    assert _rewrites(apply_to_model(_net(), off).model) == {}


def test_unknown_strategy_is_bad_input_naming_it() -> None:
    with pytest.raises(BadInputError, match="not_installed"):
        apply_to_model(_net(), Candidate(batch_size=1, choices={"not_installed": 1}))
    with pytest.raises(BadInputError, match="torch.nn.Module"):
        apply_to_model("model", CANDIDATE)  # type: ignore[arg-type]


def test_run_checks_collects_the_precision_numerics_check() -> None:
    x = torch.randn(8, 8)
    workload = Workload(model=_net(), sample_batch=x, loss_fn=lambda out, _b: out.float().mean())
    checks = run_checks(workload, CANDIDATE)
    assert [c.strategy for c in checks] == ["precision"]
    assert checks[0].metrics["grad_distance"] > 0 and checks[0].metrics["loss_spread_fp32"] >= 0


# -- a third-party strategy through the entry-point group ----------------------------------------

TOY_MODULE = """
from memadvisor.strategy import Advice, Strategy


class Toy(Strategy):
    name = "toy_pad"

    def choices(self, profile, config):
        return ["off", "pad"]

    def effect(self, profile, choice, model):
        for phase in ("forward", "backward", "optimizer"):  # held through the whole step
            model.add_bytes(phase, 123 * 2**20)
        model.add_ms(5.0)

    def apply(self, step, choice):
        object.__setattr__(step.model, "toy_applied", choice)
        return step

    def explain(self, choice, profile):
        return Advice(strategy=self.name, title="Pad", sentence="Pad it.")
"""


@pytest.fixture
def toy_entry_point(tmp_path: Path):
    """A package 'toy_memadvisor' installed only as a dist-info directory on sys.path."""
    (tmp_path / "toy_memadvisor.py").write_text(TOY_MODULE)
    info = tmp_path / "toy_memadvisor-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-memadvisor\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(
        textwrap.dedent("""\
            [memadvisor.strategies]
            toy_pad = toy_memadvisor:Toy
            """)
    )
    sys.path.insert(0, str(tmp_path))
    try:
        yield
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("toy_memadvisor", None)


def test_a_third_party_strategy_is_found_estimated_and_applied(toy_entry_point) -> None:
    strategies = load_strategies()
    names = [s.name for s in strategies]
    assert "toy_pad" in names and "checkpointing" in names
    profile = _profile()
    with_toy = Candidate(batch_size=2, choices={"toy_pad": "pad"})
    base = estimate(profile, Candidate(batch_size=2), strategies)
    padded = estimate(profile, with_toy, strategies)
    assert padded.peak_bytes - base.peak_bytes == 123 * MIB
    assert padded.step_ms == pytest.approx(base.step_ms + 5.0)
    assert apply_to_model(_net(), with_toy).model.toy_applied == "pad"


def test_a_third_party_strategy_is_offered_by_the_planner(toy_entry_point) -> None:
    """The planner's search space holds the toy's choices with no change to memadvisor."""
    space_module = pytest.importorskip("memadvisor.planner._space")
    space = space_module.SearchSpace(_profile(), load_strategies(), PlanConfig(budget_bytes=2**30))
    assert space.options["toy_pad"] == ["off", "pad"]


def test_checkpointed_copy_trains_like_the_original() -> None:
    """A model rewritten by apply_candidate keeps training to the same weights (fp32)."""
    candidate = Candidate(batch_size=4, choices={"checkpointing": ["blocks.0", "blocks.1"]})
    a, b = _net(), apply_to_model(_net(), candidate).model
    for model in (a, b):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        torch.manual_seed(9)
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert copy.deepcopy(b).blocks[0].forward.module is not b.blocks[0]


class Wide(nn.Module):
    """Three residual MLP blocks: at 3 MiB batch 256 fits only rewritten (3.2 MiB plain fp32)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64)) for _ in range(3)
        )
        self.head = nn.Linear(64, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)


@pytest.mark.slow
def test_apply_plan_from_saved_json_matches_what_optimize_returned() -> None:
    """optimize() on the simulated device, its plan saved as JSON, applied to a fresh model:
    the same wrappers on the same modules, the same gradients."""
    api = pytest.importorskip("memadvisor.api")
    torch.manual_seed(0)
    fresh = Wide()
    x = torch.randn(8, 64)
    tuned = api.optimize(
        copy.deepcopy(fresh),
        x,
        loss_fn=lambda out, _batch: out.float().mean(),
        budget_gb=0.003,
        # The largest batch, not throughput: CPU step times (bf16 is slow on a CPU, timings
        # are noisy) must not decide whether the plan rewrites anything.
        objective="largest_batch",
        device="simulated",
        progress=False,
        verify_steps=2,
        max_batch=256,
    )
    saved = tuned.memadvisor_plan.model_dump_json()
    applied = memadvisor.apply_plan(fresh, Plan.model_validate_json(saved))
    assert _rewrites(tuned) != {}  # the plan changed something, so the comparison says something
    assert _rewrites(applied) == _rewrites(tuned)
    batch = torch.randn(4, 64)
    grads = []
    for model in (tuned, applied):
        torch.manual_seed(1)
        model(batch).float().sum().backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.mark.parametrize(
    "choices",
    [
        {"checkpointing": ["blocks.0", "blocks.1", "nope"]},
        {"precision": "bf16", "checkpointing": ["blocks.0", "nope"]},
        {"precision": "bf16", "checkpointing": ["blocks.0"], "inference": "advice"},
        {"checkpointing": ["blocks.0", ""]},
    ],
)
def test_a_plan_that_does_not_fit_the_model_rewrites_nothing(choices: dict) -> None:
    """Rule: apply is all-or-nothing: every choice is checked before any is applied, so a bad
    one leaves no block checkpointed, no autocast installed and the train flag as it was."""
    model = _net()
    with pytest.raises(BadInputError):
        apply_to_model(model, Candidate(batch_size=4, choices=choices), profile=_profile())
    assert _rewrites(model) == {}
    assert model.training


def test_a_strategy_failing_while_it_applies_leaves_the_model_as_it_was() -> None:
    """Rule: what strategies applied before one that raised is taken back off."""

    class Breaks(Strategy):
        name = "breaks"
        effect_order = 99

        def choices(self, profile, config):
            return ["off", "pad"]

        def effect(self, profile, choice, model):
            pass

        def apply(self, step, choice):
            raise BadInputError("broken on purpose")

        def explain(self, choice, profile):
            return None

    chosen = [*load_strategies(["precision", "checkpointing"]), Breaks()]
    model = _net()
    candidate = Candidate(
        batch_size=4,
        choices={"precision": "bf16", "checkpointing": ["blocks.0"], "breaks": "pad"},
    )
    with pytest.raises(BadInputError, match="on purpose"):
        apply_to_model(model, candidate, chosen, profile=_profile())
    assert _rewrites(model) == {}
