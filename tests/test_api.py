"""memadvisor.plan() and optimize() end to end on the CPU simulated device.

Nothing is faked here: the profiler, the estimate, the registered strategies and the
simulated device all run for real, on small models so the tests take seconds.
"""

from __future__ import annotations

import gc
import random
import sys
import warnings
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memadvisor
from memadvisor.errors import BadInputError, InfeasibleBudgetError
from memadvisor.schema.plan import Plan
from memadvisor.target import load_factory

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
# Few steps: these tests check the pipeline's wiring and the caller's state, not timings.
QUICK = {"probe_steps": 2, "timing_steps": 2, "verify_steps": 3, "rerank_top": 1}
# The hand-configuration rows are tested with fakes (tests/planner); here they would only
# add device runs.


def _example(name: str):
    """The example's build() (loaded as the CLI loads a target)."""
    return load_factory(f"{EXAMPLES / name}.py:build")


def _example_module(name: str):
    """The example module itself (loaded as the CLI loads a target)."""
    return sys.modules[_example(name).__module__]


def _small_gpt() -> dict:
    return _example("gpt")(
        batch_size=2, n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=512
    )


class _Net(nn.Module):
    """Two blocks with dropout and batch norm: RNG use and train/eval flags to disturb."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.Sequential(
            nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1)),
            nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64), nn.ReLU()),
        )
        self.head = nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x))


def _loss(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return F.cross_entropy(out, batch[1])


def _trained_net() -> tuple[nn.Module, tuple, torch.optim.Optimizer]:
    """A model mid-training: optimizer state, gradients present, one submodule in eval."""
    torch.manual_seed(0)
    model = _Net()
    batch = (torch.randn(8, 16), torch.randint(0, 4, (8,)))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _loss(model(batch[0]), batch).backward()
    optimizer.step()
    _loss(model(batch[0]), batch).backward()  # gradients left in place, as mid-accumulation
    model.blocks[1][1].eval()
    return model, batch, optimizer


def _snapshot(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    np_state = None
    try:
        import numpy

        np_state = numpy.random.get_state()
    except ImportError:
        pass
    return {
        "state": {k: v.clone() for k, v in model.state_dict().items()},
        "grads": {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None},
        "optimizer": {
            i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in enumerate(optimizer.state.values())
        },
        "modes": [m.training for m in model.modules()],
        "torch_rng": torch.get_rng_state(),
        "python_rng": random.getstate(),
        "numpy_rng": np_state,
    }


def _assert_same(before: dict, after: dict) -> None:
    assert before["state"].keys() == after["state"].keys()
    for k in before["state"]:
        assert torch.equal(before["state"][k], after["state"][k]), k
    assert before["grads"].keys() == after["grads"].keys()
    for k in before["grads"]:
        assert torch.equal(before["grads"][k], after["grads"][k]), k
    for i, s in before["optimizer"].items():
        for k, v in s.items():
            got = after["optimizer"][i][k]
            assert torch.equal(v, got) if torch.is_tensor(v) else v == got
    assert before["modes"] == after["modes"]
    assert torch.equal(before["torch_rng"], after["torch_rng"])
    assert before["python_rng"] == after["python_rng"]
    if before["numpy_rng"] is not None:
        b, a = before["numpy_rng"], after["numpy_rng"]
        assert b[0] == a[0] and (b[1] == a[1]).all() and b[2:] == a[2:]


def _live_tensors() -> dict[int, weakref.ref]:
    """Every live tensor, by id, as a weak reference (an id alone may be reused)."""
    gc.collect()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # touching deprecated torch attributes while scanning
        return {id(o): weakref.ref(o) for o in gc.get_objects() if isinstance(o, torch.Tensor)}


def _new_since(live: dict[int, weakref.ref]) -> list[tuple[type, tuple]]:
    """The tensors alive now that were not in ``live``: (type, shape) of each. Tensors of
    earlier tests that a plan lets go (a cache evicting) are no leak and not counted (CI saw
    116 fewer live tensors after the second plan than before it)."""
    now = _live_tensors()
    return [
        (type(t), tuple(t.shape))
        for i, ref in now.items()
        if (t := ref()) is not None and (i not in live or live[i]() is not t)
    ]


def test_plan_leaves_the_caller_state_bit_identical_and_leaks_no_tensors() -> None:
    """After plan() the caller's weights, gradients, optimizer state, RNG states (torch,
    Python, NumPy) and every submodule's train/eval flag equal what they were, bit for bit;
    and a second plan() leaves no tensor alive that was not alive before it (the first may
    fill torch's one-time caches): every probe ran on copies that are gone."""
    model, batch, optimizer = _trained_net()
    before = _snapshot(model, optimizer)
    kwargs = dict(
        budget_gb=0.001,
        loss_fn=_loss,
        optimizer=optimizer,
        progress=False,
        measure_comparison=False,
        **QUICK,
    )
    result = memadvisor.plan(model, batch, **kwargs)
    assert isinstance(result, Plan) and result.verified is not None
    _assert_same(before, _snapshot(model, optimizer))
    live = _live_tensors()
    memadvisor.plan(model, batch, **kwargs)
    assert _new_since(live) == []
    _assert_same(before, _snapshot(model, optimizer))


def test_optimize_returns_the_tuned_model_with_its_plan_and_the_state_untouched() -> None:
    """optimize() rewrites the model in place (same object, same state_dict keys and values),
    hangs the plan on it, and changes none of the caller's state."""
    model, batch, optimizer = _trained_net()
    before = _snapshot(model, optimizer)
    keys = list(model.state_dict())
    tuned = memadvisor.optimize(
        model,
        batch,
        budget_gb=0.001,
        loss_fn=_loss,
        optimizer=optimizer,
        progress=False,
        measure_comparison=False,
        **QUICK,
    )
    assert tuned is model and isinstance(tuned.memadvisor_plan, Plan)
    assert list(tuned.state_dict()) == keys
    _assert_same(before, _snapshot(model, optimizer))
    # The tuned model still trains.
    tuned.train()
    _loss(tuned(batch[0]), batch).backward()


@pytest.mark.slow
def test_optimize_runs_end_to_end_on_the_cnn_example() -> None:
    """examples/cnn.py on the simulated device: a verified plan whose measured peak is within
    the budget, probes that ran more than one step, and the rows for the report."""
    built = _example("cnn")(batch_size=1)
    tuned = memadvisor.optimize(
        built["model"],
        built["sample_batch"],
        loss_fn=built["loss_fn"],
        budget_gb=0.02,
        device="simulated",
        progress=False,
        **QUICK,
    )
    plan = tuned.memadvisor_plan
    assert plan.device_kind == "simulated"
    assert plan.verified is not None and plan.verified.peak_bytes <= plan.config.budget_bytes
    assert all(p.steps > 1 for p in plan.probes if p.fits)
    assert [r.label for r in plan.comparison][-1] == "Plan"
    assert any("simulated CPU device" in n for n in plan.notes)


def test_plan_runs_end_to_end_on_a_small_gpt_and_says_it_is_simulated(capfd) -> None:
    """A small GPT config on the simulated device: the pick was verified, stays the measured
    margin's headroom (in measured bytes per sample) below the lowest batch that ran out, and
    one line on stderr says the plan is for the simulated CPU device."""
    from memadvisor.planner._prober import HEADROOM_FRACTION

    built = _small_gpt()
    result = memadvisor.plan(
        built["model"],
        built["sample_batch"],
        loss_fn=built["loss_fn"],
        budget_gb=0.004,
        measure_comparison=False,
        **QUICK,
    )
    cfg = result.config
    assert result.candidate.batch_size >= 1
    assert result.verified.peak_bytes <= cfg.budget_bytes
    assert cfg.measured_margin
    batch = result.candidate.batch_size
    failed = [p.batch_size for p in result.probes if not p.fits]
    fitted = sorted((p.batch_size, p.peak_bytes) for p in result.probes if p.fits)
    if failed:
        (b0, m0), (b1, m1) = fitted[0], fitted[-1]
        slope = (m1 - m0) / (b1 - b0) if b1 > b0 else m1 / b1
        gap = min(failed) - batch
        assert gap >= 1 and (gap == 1 or gap * slope >= HEADROOM_FRACTION * cfg.budget_bytes)
    else:
        assert result.verified.peak_bytes <= cfg.budget_bytes * (1 - HEADROOM_FRACTION)
    _, err = capfd.readouterr()
    assert "simulated CPU device" in err


def test_a_budget_below_the_weights_fails_at_once_naming_the_minimum() -> None:
    """Weights + grads + AdamW state above the budget: InfeasibleBudgetError, with the minimum
    budget in GiB in the message and as minimum_bytes."""
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 512))  # ~2 MiB
    batch = (torch.randn(4, 512), torch.randn(4, 512))
    with pytest.raises(InfeasibleBudgetError) as caught:
        memadvisor.plan(
            model,
            batch,
            budget_gb=0.001,  # ~1 MiB: less than the weights' four copies (8 MiB)
            loss_fn=lambda out, b: F.mse_loss(out, b[1]),
            progress=False,
        )
    error = caught.value
    static = 4 * sum(p.numel() * 4 for p in model.parameters())
    assert error.minimum_bytes is not None and error.minimum_bytes > static
    assert f"{error.minimum_bytes / 2**30:.2f}"[:4] in str(error) and "GiB" in str(error)


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"budget_gb": -1}, "positive"),
        ({"budget_gb": 1, "verify_step": 20}, "verify_step"),
        ({"budget_gb": 1, "margin_fraction": 0.9}, "margin_fraction"),
        ({"budget_gb": 1, "objective": "effective_batch"}, "effective_batch"),
        # An effective batch another objective would ignore: refused, not planned past.
        (
            {"budget_gb": 1, "objective": "largest_batch", "effective_batch": 256},
            "effective_batch 256 is kept only by objective effective_batch",
        ),
    ],
)
def test_bad_options_are_bad_input_naming_the_value(kwargs: dict, words: str) -> None:
    """Unknown or out-of-range options raise BadInputError that names what was wrong."""
    model = nn.Linear(4, 1)
    with pytest.raises(BadInputError, match=words):
        memadvisor.plan(model, torch.randn(2, 4), progress=False, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a card")
def test_asking_for_cuda_without_a_card_is_bad_input_naming_the_way_out() -> None:
    """device='cuda' on a machine without one: BadInputError pointing at 'simulated'."""
    with pytest.raises(BadInputError, match="simulated"):
        memadvisor.plan(nn.Linear(4, 1), torch.randn(2, 4), budget_gb=1, device="cuda")


def test_profile_takes_an_optimizer_instance_as_plan_does() -> None:
    """profile(), like plan(), reuses an optimizer instance's class and the defaults its
    constructor takes (torch 2.13's AdamW keeps 'decoupled_weight_decay' in its defaults,
    which AdamW() refuses): the step is profiled with AdamW's two state tensors per weight,
    and the caller's optimizer keeps no state."""
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.05)
    profile = memadvisor.profile(
        model,
        torch.randn(4, 8),
        loss_fn=lambda out, batch: out.mean(),
        optimizer=optimizer,
        device="cpu",
        progress=None,
    )
    assert profile.optimizer_state_bytes >= 2 * profile.param_bytes
    assert not optimizer.state


def test_a_factorys_optimizer_instance_is_built_the_same_way(tmp_path: Path) -> None:
    """The CLI's factories go through the same builder: an optimizer instance under the
    'optimizer' key becomes a factory of its class and accepted defaults."""
    from memadvisor.target import load_target
    from memadvisor.workload import SameOptimizer

    (tmp_path / "job.py").write_text(
        "import torch\n"
        "def build():\n"
        "    model = torch.nn.Linear(4, 1)\n"
        "    opt = torch.optim.AdamW(model.parameters(), lr=0.01)\n"
        "    return {'model': model, 'sample_batch': torch.randn(2, 4),\n"
        "            'loss_fn': lambda o, b: o.mean(), 'optimizer': opt}\n"
    )
    workload = load_target(f"{tmp_path / 'job.py'}:build")
    assert isinstance(workload.optimizer_factory, SameOptimizer)
    made = workload.make_optimizer(nn.Linear(4, 1))
    assert isinstance(made, torch.optim.AdamW) and made.defaults["lr"] == 0.01


def test_a_strategys_setting_passes_by_its_name_and_unknown_options_are_named() -> None:
    """plan(..., compile="off") reaches the compile strategy as its option (the config knows
    no strategy by name); a name that is neither a PlanConfig field nor a registered
    strategy is bad input that names it."""
    from memadvisor.api import plan_config

    config = plan_config(1, options={"compile": "off", "verify_steps": 5})
    assert config.options == {"compile": "off"} and config.verify_steps == 5
    with pytest.raises(BadInputError, match="'no_such_option'"):
        plan_config(1, options={"no_such_option": 1})


@pytest.mark.parametrize(
    ("setting", "words"),
    [
        ("of", "'of'"),
        ({"policy": "sometimes"}, "'sometimes'"),
        ({"search": {"host_bound_sahre": 0.7}}, "host_bound_sahre"),
        ({"search": {"host_bound_share": "high"}}, "host_bound_share"),
        ({"search": 0.7}, "0.7"),
    ],
)
def test_a_strategys_setting_is_checked_when_the_config_is_made(setting, words: str) -> None:
    """Rule: a strategy's setting that it refuses (Configured.check_setting) is bad input
    when the plan's config is made, naming the value, not minutes later at its stage."""
    from memadvisor.api import plan_config

    with pytest.raises(BadInputError, match=words):
        plan_config(1, options={"compile": setting})


def test_the_allocator_setting_is_checked_when_the_config_is_made() -> None:
    """Rule: allocator= takes auto, on, off or None; anything else (which its stage would
    have read as on) is bad input that names it."""
    from memadvisor.api import plan_config

    for ok in ("auto", "on", "off", None):
        assert plan_config(1, options={"allocator": ok}).options == {"allocator": ok}
    with pytest.raises(BadInputError, match="'of'"):
        plan_config(1, options={"allocator": "of"})


def test_the_compile_setting_reaches_the_compile_searchs_fields() -> None:
    """Rule: compile={"search": {...}} sets CompileSearch's fields for that plan over the
    strategy's own; the policy defaults to auto."""
    from memadvisor.api import plan_config
    from strategies._compile_search import CompileSearch
    from strategies._compile_stage import policy_of, search_of
    from strategies.compile import Compile

    setting = {"search": {"host_bound_share": 0.7}}
    config = plan_config(1, options={"compile": setting})
    assert config.options == {"compile": setting}
    strategy = Compile(search=CompileSearch(graphs_runs=2))
    settings = search_of(config, strategy)
    assert settings.host_bound_share == 0.7 and settings.graphs_runs == 2
    assert policy_of(config) == "auto"
    plain = plan_config(1, options={"compile": "on"})
    assert search_of(plain, strategy) is strategy.search and policy_of(plain) == "on"


class _Locked(nn.Module):
    """A model holding a threading.Lock: copy.deepcopy cannot copy it."""

    def __init__(self) -> None:
        super().__init__()
        import threading

        self.lin = nn.Linear(4, 4)
        self.lock = threading.Lock()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.lin(x)


def test_a_model_deepcopy_cannot_copy_is_refused_before_it_is_run() -> None:
    """Rule: planning never runs the caller's own model: one that cannot be copied is refused
    up front, saying why and what to do, with its forward never called."""
    model = _Locked()
    with pytest.raises(BadInputError, match="deepcopy.*lock"):
        memadvisor.plan(model, torch.randn(2, 4), budget_gb=1, device="simulated", progress=False)
    assert model.calls == 0


class _Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.relu(self.fc(x))


@pytest.mark.slow
@pytest.mark.parametrize(
    "rows", [lambda t: t[:16], lambda t: t[::2][:16]], ids=["sliced", "strided slice"]
)
def test_a_sample_batch_sliced_from_a_dataset_tensor_is_estimated_as_its_rows(rows) -> None:
    """Rule: a sample batch sliced from 4096-row dataset tensors, (X[:16], Y[:16]), plans as
    a fresh batch does: the estimate within 5% of the verified peak, and the pick's batch
    found in at most 4 device runs. Before, the sample size counted the dataset's whole
    storage, the fitted bytes per sample came out negative, the estimate was below zero and
    the search began at max_batch (issue 25: 10 or more runs from batch 65536)."""
    torch.manual_seed(0)
    data, labels = torch.randn(4096, 64), torch.randint(0, 10, (4096,))
    model = nn.Sequential(*(_Residual(64) for _ in range(4)), nn.Linear(64, 10))
    result = memadvisor.plan(
        model,
        (rows(data), rows(labels)),
        loss_fn=lambda out, batch: F.cross_entropy(out, batch[1]),
        budget_gb=0.01,
        device="simulated",
        progress=False,
        measure_comparison=False,
        **QUICK,
    )
    estimated, verified = result.estimate.peak_bytes, result.verified.peak_bytes
    assert abs(estimated - verified) <= 0.05 * verified, (estimated, verified)
    searched = [
        p
        for p in result.probes
        if p.stage != "verify"
        and p.candidate is not None
        and p.candidate.choices == result.candidate.choices
    ]
    assert 1 <= len(searched) <= 4, [(p.batch_size, p.fits, p.stage) for p in searched]


@pytest.mark.slow
def test_a_bf16_cast_lora_model_plans_on_the_estimate_device_from_python() -> None:
    """Rule: memadvisor.plan(device="estimate") plans the usual LoRA model, built on the meta
    device (as the README says for a large one), cast with ``.to(torch.bfloat16)`` and given
    fp32 adapters: the base counted in bf16, gradients for the adapters alone."""
    from dataclasses import replace

    llama, lora = _example_module("llama"), _example_module("llama_lora")
    built = llama.build(batch_size=2, seq_len=32, n_layers=2)
    with torch.device("meta"):
        model = llama.Llama(replace(llama.PRESETS["tiny"], n_layers=2))
    model = lora.add_lora(model.to(torch.bfloat16), rank=4)
    adapters = [p for p in model.parameters() if p.requires_grad]
    result = memadvisor.plan(
        model,
        built["sample_batch"],
        loss_fn=built["loss_fn"],
        budget_gb=0.25,
        device="estimate",
        progress=False,
    )
    assert result.device_kind == "estimate" and result.candidate.batch_size >= 1
    profile = result.profile
    assert profile.param_bytes == sum(p.numel() * p.element_size() for p in model.parameters())
    assert profile.grad_bytes == sum(p.numel() * p.element_size() for p in adapters)
