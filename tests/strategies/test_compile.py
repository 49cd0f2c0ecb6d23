"""torch.compile strategy: offered on CUDA profiles only, left to the device to measure, applied
with keys unchanged and eager's loss, advice a person can paste, and a failure to compile
reported as an answer (the plan stays eager) rather than raised.

Inductor compiles on this machine's gcc: a cold compile of the tiny MLP takes several seconds,
a warm one (inductor's on-disk cache) about one. Tests that compile share one model class and
input shape so the later ones load what the first compiled; those that need other graphs
are marked slow.
"""

from __future__ import annotations

import copy
import pickle
import warnings
import weakref

import pytest
import torch
from pydantic import JsonValue
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.estimate import estimate
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.strategy import Measured, load_strategies
from memadvisor.workload import Workload
from strategies import _forward
from strategies.compile import (
    Compile,
    CompiledForward,
    CompileResult,
    DeviceGain,
    parse_choice,
    try_compile,
)
from tests.fixtures.examples import load_example
from tests.fixtures.steps import applied

COMPILE = Compile()
CONFIG = PlanConfig(budget_bytes=2**30)
BUDGET_HALF = {"mode": "default", "activation_memory_budget": 0.5}


def _mlp() -> nn.Sequential:
    # A torch container on top: the case model.compile() silently leaves eager.
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _workload(model: nn.Module | None = None) -> Workload:
    torch.manual_seed(1)
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    return Workload(
        model=model if model is not None else _mlp(),
        sample_batch=(x, y),
        loss_fn=lambda out, batch: nn.functional.mse_loss(out, batch[1]),
    )


def _eager_backend(gm, example_inputs):
    """A backend that runs the captured graph as it is: dynamo's tracing without inductor."""
    return gm.forward


# -- choices, effect, registration -----------------------------------------------------------


def test_offered_only_on_cuda_profiles(profile_factory) -> None:
    """CPU and fake profiles get 'off' alone: nothing there can measure a compiled step."""
    assert COMPILE.choices(profile_factory([(10, 2, 1)], kind="cpu"), CONFIG) == ["off"]
    assert COMPILE.choices(profile_factory([(10, 2, 1)], kind="fake"), CONFIG) == ["off"]
    cuda = COMPILE.choices(profile_factory([(10, 2, 1)], kind="cuda"), CONFIG)
    assert cuda == ["off", "default", BUDGET_HALF]
    assert COMPILE.is_neutral(cuda[0]) and not any(COMPILE.is_neutral(c) for c in cuda[1:])


def test_choices_are_normalised_and_malformed_ones_refused() -> None:
    """A budget-free mapping is the mode alone; unknown modes, keys and budgets are refused."""
    assert Compile(choices=[{"mode": "default"}]).offered == ["default"]
    assert parse_choice("off") is None
    assert parse_choice(BUDGET_HALF).activation_memory_budget == 0.5
    for bad in ("turbo", {"mode": "default", "activation_memory_budget": 1.5}, {"fullgraph": 1}, 3):
        with pytest.raises(BadInputError, match="compile choice"):
            parse_choice(bad)


def test_registered_as_measured_and_leaves_the_estimate_as_eager(profile_factory) -> None:
    """The entry point loads it; it is the one measured-only strategy; estimates are eager's."""
    strategies = load_strategies()
    assert [s.name for s in strategies if isinstance(s, Measured)] == ["compile"]
    profile = profile_factory([(10, 2, 1), (20, 4, 2)], kind="cuda")
    eager = estimate(profile, Candidate(batch_size=8), strategies)
    for choice in COMPILE.choices(profile, CONFIG)[1:]:
        compiled = estimate(
            profile, Candidate(batch_size=8, choices={"compile": choice}), strategies
        )
        assert compiled == eager


# -- apply ------------------------------------------------------------------------------------


def test_apply_keeps_keys_pickles_and_off_takes_it_off() -> None:
    """Lazy and in place: same keys, same parameters; a copy or pickle carries the settings."""
    model = _mlp()
    keys = list(model.state_dict())
    assert applied(COMPILE, model, BUDGET_HALF, None) is model
    applied(COMPILE, model, "default", None)  # applying again updates, never stacks
    assert list(model.state_dict()) == keys
    assert [type(w) for w in _forward.wrappers(model)] == [CompiledForward]
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        wrapper = _forward.find_wrapper(clone, CompiledForward)
        assert wrapper is not None and wrapper.choice == parse_choice("default")
    applied(COMPILE, model, "off", None)
    assert "forward" not in model.__dict__


def test_compiled_model_trains_like_eager_with_its_keys() -> None:
    """apply(): dynamo captures a graph (nn.Sequential too) and the step matches eager's."""
    eager, compiled = _mlp(), applied(COMPILE, _mlp(), "default", None)
    keys = list(eager.state_dict())
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    losses = []
    for model in (eager, compiled):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    for pe, pc in zip(eager.parameters(), compiled.parameters(), strict=True):
        torch.testing.assert_close(pc.grad, pe.grad, rtol=1e-4, atol=1e-6)
    assert list(compiled.state_dict()) == keys


# -- trial, check, advice ---------------------------------------------------------------------


def test_check_compiles_reports_compile_time_and_explain_quotes_it() -> None:
    """The trial compiles one graph with no breaks, matches eager, and times the first step."""
    strategy = Compile()
    workload = _workload()
    before = [p.detach().clone() for p in workload.model.parameters()]
    check = strategy.check(workload, "default")
    assert check is not None and check.passed, check.summary
    m = check.metrics
    assert m["graphs"] >= 1 and m["graph_breaks"] == 0
    assert m["loss_rel_diff"] < 1e-5 and m["grad_rel_diff"] < 1e-4
    assert m["first_step_ms"] > m["compiled_step_ms"] and m["compile_ms"] > 0
    # The user's model is untouched.
    assert all(torch.equal(a, b) for a, b in zip(before, workload.model.parameters(), strict=True))
    advice = strategy.explain("default", profile=None)  # the profile is not read
    assert f"{m['first_step_ms'] / 1e3:.1f} s" in advice.effect
    assert strategy.explain("off", profile=None) is None


def test_a_trial_is_kept_for_check_and_advice_quotes_the_device_gain(monkeypatch) -> None:
    """trial() runs try_compile once; check() reuses it; a recorded gain leads the effect."""
    calls = []

    def stand_in(workload, choice, **kwargs) -> CompileResult:
        calls.append(choice)
        return CompileResult(
            choice=choice,
            ok=True,
            batch_size=8,
            steps=3,
            eager_step_ms=10.0,
            first_step_ms=3008.0,
            compiled_step_ms=8.0,
            graphs=1,
            loss_rel_diff=0.0,
        )

    monkeypatch.setattr("strategies.compile.try_compile", stand_in)
    strategy = Compile()
    strategy.trial(_workload(), {"mode": "default"})
    assert strategy.check(_workload(), "default").passed and calls == [{"mode": "default"}]
    strategy.gains[parse_choice("default")] = DeviceGain(
        batch_size=92, samples_per_s=2948.0, eager_batch_size=92, eager_samples_per_s=2041.0
    )
    effect = strategy.explain("default", profile=None).effect
    assert effect.startswith("on the device 2948.0 samples/s at batch 92 vs 2041.0 eager")
    assert "(1.44x, steady state)" in effect and "about 3.0 s of compiling" in effect


def test_advice_snippet_runs_and_keeps_the_models_keys(tmp_path, monkeypatch) -> None:
    """The pasted snippet trains through torch.compile and saves the original's keys."""
    monkeypatch.chdir(tmp_path)
    budgeted = COMPILE.explain(BUDGET_HALF, profile=None)
    assert "torch._functorch.config.activation_memory_budget = 0.5" in budgeted.snippet
    assert "0.5" in budgeted.title and "not estimated" in budgeted.effect
    model = _mlp()
    names = {
        "model": model,
        "loss_fn": nn.functional.mse_loss,
        "inputs": torch.randn(8, 16),
        "targets": torch.randn(8, 4),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
    }
    exec(COMPILE.explain("default", profile=None).snippet, names)
    assert names["compiled"] is not model
    assert not torch.equal(model[0].weight, _mlp()[0].weight)  # the step trained `model`
    assert list(torch.load(tmp_path / "checkpoint.pt")) == list(_mlp().state_dict())


def test_backend_failure_is_an_answer_not_an_error(monkeypatch) -> None:
    """An exception while compiling: ok=False with the cause; nothing raised."""

    def exploding_backend(mode, budget=None):
        def backend(gm, example_inputs):
            raise RuntimeError("inductor exploded on purpose")

        return backend

    monkeypatch.setattr("memadvisor._torch_private.inductor_backend", exploding_backend)
    result = try_compile(_workload(), "default")
    assert not result.ok and not result.out_of_memory
    assert "inductor exploded on purpose" in result.error
    assert "Planned eager" in result.summary


class _OpaqueMiddle(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_opaque(self.a(x)))


@torch.compiler.disable
def _opaque(x: torch.Tensor) -> torch.Tensor:
    return torch.relu(x)


class _Opaque(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 4)

    @torch.compiler.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


def test_graph_breaks_past_the_limit_and_no_graph_at_all_are_not_ok(monkeypatch) -> None:
    """A break between the layers counts (limit 0: not ok); a wholly skipped forward: no graph."""
    monkeypatch.setattr(
        "memadvisor._torch_private.inductor_backend", lambda mode, budget=None: _eager_backend
    )
    broken = try_compile(_workload(_OpaqueMiddle()), "default", max_graph_breaks=0)
    assert broken.graph_breaks >= 1 and broken.graphs >= 2
    assert not broken.ok and "graph breaks" in broken.reason
    assert try_compile(_workload(_OpaqueMiddle()), "default").ok  # under the default limit

    skipped = try_compile(_workload(_Opaque()), "default")
    assert skipped.graphs == 0 and not skipped.ok and "no graph" in skipped.reason


class _Warns(_OpaqueMiddle):
    """A forward that warns between its layers, as a library's forward may."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        warnings.warn("a library's note", stacklevel=1)
        return self.b(h)


def test_the_trial_names_the_call_that_broke_the_graph(monkeypatch) -> None:
    """Rule: the trial's sentence says where its first graph break came from, with the call
    dynamo names ("module: _warnings, qualname: warn"), not only its first line ("Attempted
    to call function marked as skipped"): the call is what a person can change."""
    monkeypatch.setattr(
        "memadvisor._torch_private.inductor_backend", lambda mode, budget=None: _eager_backend
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = try_compile(_workload(_Warns()), "default")
    assert result.ok and result.graph_breaks >= 1, result.summary
    first = result.break_reasons[0]
    assert "_warnings" in first and "warn" in first, first
    assert f"graph break(s) (the first: {first})" in result.summary


def test_try_compile_refuses_off_and_a_single_step() -> None:
    with pytest.raises(BadInputError, match="compiled choice"):
        try_compile(_workload(), "off")
    with pytest.raises(BadInputError, match="at least 2 steps"):
        try_compile(_workload(), "default", steps=1)


# -- the partitioner's budget ------------------------------------------------------------------


class _Deep(nn.Module):
    """Pointwise ops between the matmuls: what the partitioner may recompute."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(32, 256), nn.Linear(256, 256), nn.Linear(256, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gelu = nn.functional.gelu
        return self.c(gelu(self.b(gelu(self.a(x)))))


def _saved_bytes(model: nn.Module, x: torch.Tensor) -> tuple[int, float]:
    sizes: list[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(x).square().mean()
    loss.backward()
    return sum(sizes), loss.item()


@pytest.mark.slow
def test_activation_memory_budget_makes_the_compiled_graph_keep_less() -> None:
    """Budget 0 keeps fewer activation bytes than the default; the loss is the same.

    The budget is scoped to the choice's backend: compiling with it first does not change
    what the default choice keeps afterwards (both run in this one process).
    """
    x = torch.randn(64, 32)
    low_bytes, low_loss = _saved_bytes(
        applied(COMPILE, _Deep(), {"activation_memory_budget": 0.0}, None), x
    )
    default_bytes, default_loss = _saved_bytes(applied(COMPILE, _Deep(), "default", None), x)
    assert low_bytes < 0.8 * default_bytes
    assert low_loss == pytest.approx(default_loss, rel=1e-5)


# -- on a card ----------------------------------------------------------------------------------


def _gpt_workload(**overrides: int) -> Workload:
    # The example loaded here, not by the folder's fixture: on the card (pytest 9.0.3, the
    # project installed editable) the folder's conftest fixtures were not found.
    built = load_example("gpt").build(batch_size=8, **overrides)
    return Workload(built["model"], built["sample_batch"], loss_fn=built["loss_fn"])


@pytest.mark.gpu
def test_cuda_trial_compiles_the_gpt_example_with_checkpointed_blocks() -> None:
    """On CUDA: block checkpointing and bf16 autocast compile with the model, few breaks."""
    workload = _gpt_workload()
    blocks = [f"h.{i}" for i in range(len(workload.model.h))]
    candidate = Candidate(batch_size=8, choices={"precision": "bf16", "checkpointing": blocks})
    result = try_compile(workload, "default", candidate=candidate, device="cuda")
    assert result.ok, result.summary
    assert result.graphs >= 1 and result.compiled_step_ms > 0
    assert result.loss_rel_diff < 0.02


def _cuda_peak_bytes(model: nn.Module, workload: Workload, batch: int) -> int:
    """Allocated peak of the second step (the first compiles) of ``model`` on CUDA."""
    from memadvisor.workload import train_step

    model = model.cuda()
    optimizer = workload.make_optimizer(model)
    data = workload.batch(batch, device="cuda")
    train_step(workload, model, optimizer, data)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    train_step(workload, model, optimizer, data)
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.gpu
def test_cuda_partitioner_budget_lowers_the_compiled_peak() -> None:
    """Budget 0 recomputes what it can: the compiled step's peak is below the default's.

    A small vocabulary, so the blocks' activations (what the partitioner decides about)
    dominate the peak rather than the logits.
    """
    workload = _gpt_workload(vocab_size=256, n_embd=256, block_size=128)
    peaks = {}
    for choice in ("default", {"activation_memory_budget": 0.0}):
        model = applied(COMPILE, copy.deepcopy(workload.model), choice, None)
        peaks[str(choice)] = _cuda_peak_bytes(model, workload, 64)
    assert peaks[str({"activation_memory_budget": 0.0})] < peaks["default"]


def test_the_plan_scope_tells_the_fork_server_its_runs_compile_where_compile_is_weighed(
    tmp_path, monkeypatch
) -> None:
    """Rule: on a device that compiles, compile's plan scope sets RUNS_COMPILE_VARIABLE for
    the processes the plan starts (the fork server then imports inductor's compiler once for
    its children) and removes it when the plan ends; a user's "0" is kept; with compile off
    it sets nothing."""
    import os

    from memadvisor.schema.device import DeviceCapabilities
    from memadvisor.strategy import RUNS_COMPILE_VARIABLE

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(RUNS_COMPILE_VARIABLE, raising=False)
    card = DeviceCapabilities(kind="cuda", tensor_device="cuda", can_compile=True)
    scope = Compile().plan_scope(CONFIG, card)
    assert scope is not None
    with scope:
        assert os.environ.get(RUNS_COMPILE_VARIABLE) == "1"
    assert RUNS_COMPILE_VARIABLE not in os.environ
    monkeypatch.setenv(RUNS_COMPILE_VARIABLE, "0")  # the user's own: kept
    with Compile().plan_scope(CONFIG, card):
        assert os.environ.get(RUNS_COMPILE_VARIABLE) == "0"
    off = PlanConfig(budget_bytes=2**30, options={"compile": "off"})
    assert Compile().plan_scope(off, card) is None


@pytest.mark.gpu
def test_cuda_probe_process_applies_compile_by_entry_point(examples_dir) -> None:
    """A fresh-process probe rebuilds the workload and compiles the candidate (shared cache)."""
    from memadvisor.device.cuda import CudaDevice
    from strategies._compile_cache import shared_compile_cache

    target = f"{examples_dir / 'gpt.py'}:build"
    device = CudaDevice(4 * 2**30, target=target)
    try:
        with shared_compile_cache():
            measured = device.run(
                _gpt_workload(),
                Candidate(batch_size=8, choices={"compile": "default"}),
                3,
            )
    finally:
        device.close()
    assert measured.steps == 3 and measured.samples_per_s > 0 and measured.peak_bytes > 0


@pytest.mark.gpu
def test_a_fork_server_told_its_runs_compile_still_forks_compiled_runs_on_a_card(
    examples_dir, tmp_path, monkeypatch
) -> None:
    """Rule: the fork server's import of inductor's compiler (compile's plan scope asks for
    it) leaves CUDA unstarted there, so a compiled run is still a forked child (the device
    stays a fork server, with no note of a fall-back to fresh processes)."""
    from memadvisor.device.cuda import CudaDevice
    from memadvisor.schema.device import DeviceCapabilities

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    card = DeviceCapabilities(kind="cuda", tensor_device="cuda", can_compile=True)
    scope = COMPILE.plan_scope(CONFIG, card)
    assert scope is not None
    with scope:
        device = CudaDevice(4 * 2**30, target=f"{examples_dir / 'gpt.py'}:build")
        try:
            measured = device.run(
                _gpt_workload(), Candidate(batch_size=8, choices={"compile": "default"}), 3
            )
            mode, notes = device.mode, list(device.notes)
        finally:
            device.close()
    assert measured.steps == 3 and measured.samples_per_s > 0
    assert mode == "fork_server" and not notes, (mode, notes)


# -- regional: each repeated block compiled, one graph for all ---------------------------------

REGIONAL = {"mode": "default", "regional": True}


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class _Stack(nn.Module):
    """An embedding, five identical layers in a ModuleList, a head: a transformer's shape."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.head = nn.Linear(16, 8), nn.Linear(8, 4)
        self.layers = nn.ModuleList(_Layer() for _ in range(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _counting_backend(monkeypatch, measure=lambda gm, example_inputs: len(gm.graph.nodes)):
    """Every graph compiled is recorded, ``measure(gm, example_inputs)`` of it (its node
    count by default), then run as captured; returns the list of records."""
    graphs: list = []

    def backend(gm, example_inputs):
        graphs.append(measure(gm, example_inputs))
        return gm.forward

    monkeypatch.setattr(
        "memadvisor._torch_private.inductor_backend", lambda mode, budget=None: backend
    )
    # Functions compiled before (under another backend) are made again, through this one.
    monkeypatch.setattr("strategies._compiled_forward._COMPILED", weakref.WeakKeyDictionary())
    torch._dynamo.reset()
    return graphs


def test_regional_choice_round_trips_and_finds_the_repeated_block() -> None:
    """The JSON keeps "regional"; the repeated block is the largest one-class container."""
    parsed = parse_choice(REGIONAL)
    assert parsed is not None and parsed.regional and parsed.to_json() == REGIONAL
    assert parse_choice("default").to_json() == "default"  # plans of before stay as they were
    assert Compile(choices=[REGIONAL]).offered == [REGIONAL]
    from strategies._compiled_forward import repeated_blocks

    assert [name for name, _ in repeated_blocks(_Stack())] == [f"layers.{i}" for i in range(5)]
    assert repeated_blocks(_mlp()) == []  # three modules of different classes


def test_regional_compiles_one_graph_for_every_layer_and_trains_like_eager(monkeypatch) -> None:
    """Five layers, one compiled graph (no compile per instance); the root is not compiled;
    gradients equal eager's; state_dict keys unchanged; a model without repeated blocks is
    compiled whole."""
    graphs = _counting_backend(monkeypatch)
    torch.manual_seed(0)
    model = _Stack()
    eager = copy.deepcopy(model)
    keys = list(model.state_dict())
    applied(Compile(choices=[REGIONAL]), model, REGIONAL, None)
    assert _forward.find_wrapper(model, CompiledForward) is None
    assert all(_forward.find_wrapper(layer, CompiledForward) for layer in model.layers)
    x = torch.randn(3, 16)
    model(x).sum().backward()
    eager(x).sum().backward()
    assert len(graphs) == 1, graphs
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
    assert list(model.state_dict()) == keys
    # Switching form moves the wrapper; off takes every one off.
    applied(COMPILE, model, "default", None)
    assert _forward.find_wrapper(model, CompiledForward) is not None
    assert not any(_forward.find_wrapper(layer, CompiledForward) for layer in model.layers)
    applied(COMPILE, model, "off", None)
    assert not any(_forward.find_wrapper(m, CompiledForward) for m in model.modules())
    whole = _mlp()
    applied(COMPILE, whole, REGIONAL, None)
    assert _forward.find_wrapper(whole, CompiledForward) is not None


def test_a_dynamic_batch_compiles_one_graph_for_every_batch(monkeypatch) -> None:
    """The search form (a dynamic batch) compiles one graph, symbolic in the batch, for
    batches 3, 5 and 7; the static form compiles batch 3's graph and another when the batch
    changes. (Across processes the one graph is what inductor's cache serves every probe:
    docs/design.md, 'A dynamic batch while searching'.) The JSON keeps the flag, and its
    static form drops it."""
    dynamic = {**REGIONAL, "dynamic_batch": True}
    parsed = parse_choice(dynamic)
    assert parsed is not None and parsed.to_json() == dynamic
    assert parsed.static().to_json() == REGIONAL and "dynamic batch" in parsed.words()
    counts = {}
    for name, choice in (("static", REGIONAL), ("dynamic", dynamic)):
        graphs = _counting_backend(monkeypatch)
        torch.manual_seed(0)
        model = _Stack()
        applied(Compile(choices=[choice]), model, choice, None)
        for batch in (3, 5, 7):
            model(torch.randn(batch, 16)).sum().backward()
        counts[name] = len(graphs)
    assert counts == {"static": 2, "dynamic": 1}, counts
    # A wrapper pickled before the field existed (no dynamic_batch in its state) is static.
    old = CompiledForward.__new__(CompiledForward)
    old.__dict__.update({"module": None, "inner": None, "mode": "default"})
    old.__dict__["activation_memory_budget"] = None
    assert old.dynamic_batch is False


def test_a_trial_of_the_dynamic_form_compiles_the_graph_the_probes_compile(monkeypatch) -> None:
    """The plan's trial fills the on-disk cache for the probes: a trial of the dynamic-batch
    form compiles the graph symbolic in the batch, as the probes' CompiledForward does (a
    static trial graph is another cache entry, and every probe compiled again)."""
    # A symbolic batch reaches the backend as a SymInt input beside the tensors.
    symbolic = _counting_backend(
        monkeypatch, lambda gm, inputs: any(isinstance(t, torch.SymInt) for t in inputs)
    )
    result = try_compile(_workload(_Stack()), {**REGIONAL, "dynamic_batch": True}, steps=2)
    assert result.ok, result.summary
    assert symbolic == [True], symbolic
    symbolic.clear()
    torch._dynamo.reset()
    assert try_compile(_workload(_Stack()), REGIONAL, steps=2).ok and symbolic == [False]


def test_a_regional_trial_compiles_one_graph_for_the_layers(monkeypatch) -> None:
    """The trial compiles as the user's model will: the layers share one fresh function, so
    one graph (a function per instance would compile five)."""
    graphs = _counting_backend(monkeypatch)
    result = try_compile(_workload(_Stack()), REGIONAL, steps=2)
    assert result.ok, result.summary
    assert len(graphs) == 1, graphs
    assert "each repeated block" in result.summary


def test_regional_advice_names_the_models_container(profile_factory) -> None:
    """The pasted snippet compiles the blocks of the container the profile's blocks sit in."""
    profile = profile_factory([(10, 2, 1)] * 3)
    advice = Compile(choices=[REGIONAL]).explain(REGIONAL, profile)
    assert "each repeated block" in advice.title
    assert "model.get_submodule('layers')" in advice.snippet and "block.compile(" in advice.snippet


@pytest.mark.gpu
def test_cuda_regional_trial_of_the_gpt_example_with_checkpointed_blocks() -> None:
    """On CUDA with inductor: each GPT block compiled (checkpointed inside, bf16 autocast
    outside) compiles and matches eager's loss."""
    workload = _gpt_workload()
    blocks = [f"h.{i}" for i in range(len(workload.model.h))]
    candidate = Candidate(batch_size=8, choices={"precision": "bf16", "checkpointing": blocks})
    result = try_compile(workload, REGIONAL, candidate=candidate, device="cuda")
    assert result.ok, result.summary
    assert result.loss_rel_diff < 0.02


@pytest.mark.parametrize("choice", ["default", REGIONAL], ids=["whole", "regional"])
def test_checkpointed_blocks_compile_without_a_graph_break(monkeypatch, choice) -> None:
    """Rule: a checkpointed block called with tensors (the Llama example's layer(h, cos, sin))
    is traced by dynamo, whole model or each block: no graph break, and gradients equal
    eager's. Its checkpoint wrapper once took a self-mutating path for every call (it tested
    the kwargs dict itself for containers), which dynamo refuses inside the checkpoint
    ("HOP: Unsafe side effect"): each checkpointed block then ran eager, regional compile
    captured no graph at all, and a card plan measured eager runs as compiled ones."""
    graphs = _counting_backend(monkeypatch)
    torch.manual_seed(0)
    built = load_example("llama").build(batch_size=2, seq_len=16)
    _checkpointed_compiled_like_eager(built["model"], choice, built["sample_batch"][0])
    assert len(graphs) >= 1


def _checkpointed_compiled_like_eager(
    model: nn.Module, choice: JsonValue, inputs: torch.Tensor
) -> tuple[nn.Module, nn.Module]:
    """``model`` with every layer of ``model.layers`` checkpointed and ``choice`` compiled,
    and an eager copy, each after one backward of ``inputs``: asserts no graph break and
    eager's gradients; returns (model, eager)."""
    from strategies.checkpointing import ActivationCheckpointing

    counters = torch._dynamo.utils.counters
    counters.clear()
    eager = copy.deepcopy(model)
    names = [f"layers.{i}" for i in range(len(model.layers))]
    applied(ActivationCheckpointing(), model, names, None)
    applied(Compile(choices=[choice]), model, choice, None)
    model(inputs).float().sum().backward()
    eager(inputs).float().sum().backward()
    assert sum(counters["graph_break"].values()) == 0, dict(counters["graph_break"])
    for (name, p), q in zip(model.named_parameters(), eager.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)
    return model, eager


class _NormBlock(nn.Module):
    """A block with buffers (BatchNorm's running statistics), as a ResNet's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.norm = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.norm(self.conv(x)))


class _NormStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_NormBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.mark.parametrize("choice", ["default", REGIONAL], ids=["whole", "regional"])
def test_checkpointed_blocks_with_buffers_compile_and_update_them_once(monkeypatch, choice) -> None:
    """Rule: checkpointed blocks that update buffers (BatchNorm) compile without a graph
    break, and one training step updates each running statistic once, as eager does, with
    eager's gradients. Eager checkpointing needs a guard so the recompute does not update them
    twice; under dynamo the checkpoint is traced (AOTAutograd's recompute replays no buffer
    write), and the guard, an object that mutates itself, broke the graph at every block."""
    from torch._dynamo.backends.debugging import aot_eager

    monkeypatch.setattr(
        "memadvisor._torch_private.inductor_backend", lambda mode, budget=None: aot_eager
    )
    torch._dynamo.reset()
    torch.manual_seed(0)
    model, eager = _checkpointed_compiled_like_eager(_NormStack(), choice, torch.randn(2, 8, 6, 6))
    for mine, theirs in zip(model.layers, eager.layers, strict=True):
        assert mine.norm.num_batches_tracked.item() == theirs.norm.num_batches_tracked.item() == 1
        torch.testing.assert_close(mine.norm.running_mean, theirs.norm.running_mean)
        torch.testing.assert_close(mine.norm.running_var, theirs.norm.running_var)


def test_a_trial_counts_the_compile_caches_as_a_compiled_run_does() -> None:
    """A trial's 'graphs from the on-disk cache' and a compiled run's are one number: inductor's
    FX graph cache and AOTAutograd's together (the trial counted the FX cache alone, so one
    plan's output said 2 for the trial where its runs said 3 of the same graphs)."""
    from memadvisor import _torch_private
    from strategies._compile_trial import _what_dynamo_did

    before = {"inductor": {"fxgraph_cache_hit": 1}, "aot_autograd": {"autograd_cache_bypass": 1}}
    after = {
        "inductor": {"fxgraph_cache_hit": 3, "fxgraph_cache_miss": 1},
        "aot_autograd": {"autograd_cache_hit": 1, "autograd_cache_bypass": 2},
    }
    did = _what_dynamo_did(before, after)
    counts = _torch_private.compile_cache_counts
    run = [a - b for a, b in zip(counts(after), counts(before), strict=True)]
    assert [did["cache_hits"], did["cache_misses"], did["cache_bypasses"]] == run == [3, 1, 1]
