"""The zoo: every architecture of ``tests/fixtures/zoo.py`` plans, applies and trains exactly.

Rule: a model a user brings, with its shipped config (dropout, stochastic depth, KV caches
on) and a batch made the usual way, is planned for real on the simulated device at a budget
that only checkpointing meets; ``apply_plan`` then checkpoints at least one block, and three
AdamW steps of the applied model give the plain model's loss and every gradient at each
step, and its buffers and weights after, bit for bit in fp32.

The budget is derived from the model's own profile (fp32, the one precision these plans may
pick): the planner's estimate for a batch with every block checkpointed, plus its margin, at
the smallest batch of ``BATCHES`` where that is ``SHRINK`` times less than without. Without
checkpointing that batch does not fit, so the largest batch the plan finds needs it.
Planning is a real plan, kept small: no precision strategy (fp32 only, so that exactness is
the question), short probe and verify runs. A checkpointed block must also recompute: a
layer inside it runs twice as often as in the plain model.

Run alone: ``python -m pytest -m zoo``. Where transformers or torchvision is missing an entry
skips, unless ``MEMADVISOR_REQUIRE_ZOO=1`` (CI sets it): then it fails.
"""

from __future__ import annotations

import copy
import importlib.util
import os
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import nn

import memadvisor
from memadvisor.api import plan_config
from memadvisor.estimate import estimate
from memadvisor.planner import plan_workload
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.plan import Plan
from memadvisor.schema.profile import Profile
from memadvisor.strategy import load_strategies
from memadvisor.workload import build_workload
from strategies import checkpointing
from tests.fixtures import zoo

pytestmark = pytest.mark.zoo

BATCHES = (8, 16, 32)  # where the budget holds a batch only with every block checkpointed
SHRINK = 1.15  # ... which shrinks the estimated peak by this factor at least
# fp32 alone, so that exactness is the question; no other strategy changes the model.
STRATEGIES = ["checkpointing", "batch_size"]
MARGIN = 0.08  # the planner's default margin_fraction: the estimate stays this far under
# Few, short device runs: the pick's exactness is checked here, not its timing.
QUICK = {"probe_steps": 2, "timing_steps": 1, "verify_steps": 2, "rerank_top": 1}
STEPS = 3


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """One intra-op thread: these models are too small to share out, and on a loaded 2-core
    machine two threads spin-waited for each other (densenet's plan: 14 CPU-s on two
    threads, 1.1 on one). The comparisons run on one thread both sides."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _require(entry: zoo.ZooEntry) -> None:
    if importlib.util.find_spec(entry.needs) is not None:
        return
    why = f"{entry.name} needs {entry.needs}, which is not installed"
    if os.environ.get("MEMADVISOR_REQUIRE_ZOO") == "1":
        pytest.fail(f"{why} (MEMADVISOR_REQUIRE_ZOO=1: the README's test command installs it)")
    pytest.skip(why)


def _budget_bytes(profile: Profile, strategies: list) -> int:
    """A budget whose usable part holds, by the planner's own estimate, a batch that fits
    only with every block checkpointed: the smallest of BATCHES where checkpointing shrinks
    the estimated peak by at least SHRINK (a weight-bound model needs a larger batch)."""
    every = {"checkpointing": [b.name for b in profile.blocks], "batch_size": None}
    none = {"checkpointing": [], "batch_size": None}

    def peak(choices: dict, batch: int) -> int:
        return estimate(
            profile, Candidate(batch_size=batch, choices=choices), strategies
        ).limit_bytes

    batch = next((b for b in BATCHES if peak(none, b) >= SHRINK * peak(every, b)), BATCHES[-1])
    return int(peak(every, batch) / (1 - MARGIN))


def _plan(built: zoo.Built) -> Plan:
    """The plan at a budget that only checkpointing meets (see _budget_bytes)."""
    profile = memadvisor.profile(
        built.model, built.sample_batch, loss_fn=built.loss_fn, device="cpu",
        precisions=["fp32"],
    )  # fmt: skip
    strategies = load_strategies(STRATEGIES)
    workload = build_workload(built.model, built.sample_batch, loss_fn=built.loss_fn)
    config = plan_config(
        _budget_bytes(profile, strategies) / 2**30,
        objective="largest_batch",
        device="simulated",
        options={"strategies": STRATEGIES, **QUICK},
    )
    return plan_workload(
        workload, config, profile=profile, progress=False, strategies=strategies,
        measure_comparison=False,
    )  # fmt: skip


def _forward_loss(model: nn.Module, batch: Any, loss_fn) -> torch.Tensor:
    """As a training loop calls it: ``model(**batch)`` for a mapping, ``model(batch[0])``
    for a tuple or list; the loss is ``loss_fn(output, batch)`` or the model's own."""
    out = model(batch[0]) if isinstance(batch, (tuple, list)) else model(**batch)
    return loss_fn(out, batch) if loss_fn is not None else out.loss


def _train(model: nn.Module, batch: Any, loss_fn) -> list[tuple[torch.Tensor, dict]]:
    """STEPS AdamW steps from the same RNG state; each step's loss and gradients."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    torch.manual_seed(1)
    seen = []
    for _ in range(STEPS):
        loss = _forward_loss(model, batch, loss_fn)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        seen.append((loss.detach(), grads))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return seen


def _unequal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, float]:
    """The names whose tensors differ, each with its largest difference (inf: missing)."""
    return {
        n: (a[n] - b[n]).abs().max().item() if n in a and n in b else float("inf")
        for n in {**a, **b}
        if n not in a or n not in b or not torch.equal(a[n], b[n])
    }


def _a_layer_inside(block: nn.Module) -> str:
    """The name (within ``block``) of its first module that holds parameters of its own."""
    return next(
        name
        for name, m in block.named_modules()
        if name and any(True for _ in m.parameters(recurse=False))
    )


def _calls(module: nn.Module) -> list[int]:
    """A counter of ``module``'s forward calls from now on (a one-item list). A pre-hook: a
    recompute stops early once backward has what it needs, before later modules return."""
    count = [0]

    def hook(*_: Any) -> None:
        count[0] += 1

    module.register_forward_pre_hook(hook)
    return count


def _without_cache_in(model: nn.Module, blocks: list[str]) -> nn.Module:
    """``model`` whose ``blocks`` run without a KV cache they are given, as memadvisor's
    checkpointed blocks do, but with no recompute: checkpointing alone, compared."""

    def drop(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return checkpointing._without_mutable_cache(module, args, kwargs)

    for name in blocks:
        model.get_submodule(name).register_forward_pre_hook(drop, with_kwargs=True)
    return model


def _assert_equal(name: str, expected: list, got: list) -> None:
    for step, ((loss_a, grads_a), (loss_b, grads_b)) in enumerate(
        zip(expected, got, strict=True), 1
    ):
        assert torch.equal(loss_a, loss_b), f"{name} step {step}: loss {loss_a} != {loss_b}"
        differ = _unequal(grads_a, grads_b)
        assert not differ, f"{name} step {step}: gradients differ (largest |a - b|): {differ}"


@pytest.mark.parametrize("entry", zoo.entries(), ids=lambda e: e.name)
def test_a_zoo_model_plans_checkpoints_and_trains_exactly_as_the_plain_model(
    entry: zoo.ZooEntry,
) -> None:
    """A checkpointed layer given a KV cache runs without it, as HF's own gradient
    checkpointing does (the recompute would append to it twice), and says so. The plain
    model is compared bit for bit with those layers running without the cache too (and no
    recompute): checkpointing alone; and, where a cache was dropped, with its cache
    everywhere within float rounding (a cached key is a copy: its matmuls round otherwise)."""
    _require(entry)
    built = entry.build()
    plain = copy.deepcopy(built.model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # HF's and torch's own notices about tiny configs
        plan = _plan(built)
    assert plan.verified is not None and plan.verified.peak_bytes <= plan.config.budget_bytes
    assert plan.candidate.choices.get("precision", "fp32") == "fp32"
    checkpointed = plan.candidate.choices.get("checkpointing") or []
    assert checkpointed, f"{entry.name}: the plan checkpoints nothing ({plan.candidate})"

    tuned = memadvisor.apply_plan(built.model, plan)
    reference = _without_cache_in(copy.deepcopy(plain), checkpointed)
    inner = f"{checkpointed[0]}.{_a_layer_inside(tuned.get_submodule(checkpointed[0]))}"
    tuned_calls = _calls(tuned.get_submodule(inner))
    plain_calls = _calls(reference.get_submodule(inner))
    checkpointing._warned.clear()  # each entry's layers say it afresh
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        got = _train(tuned, built.sample_batch, built.loss_fn)
        expected = _train(reference, built.sample_batch, built.loss_fn)
    if any("KV cache" in str(w.message) for w in said):
        # The plain model with its cache rounds differently (a cached key is a copy).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cached = _train(plain, built.sample_batch, built.loss_fn)
        for (_, grads_a), (_, grads_b) in zip(cached, got, strict=True):
            for n, g in grads_a.items():
                torch.testing.assert_close(grads_b[n], g, rtol=1e-4, atol=1e-6, msg=n)
    _assert_equal(entry.name, expected, got)
    assert tuned_calls[0] == 2 * plain_calls[0] > 0, (
        f"{entry.name}: {inner} ran {tuned_calls[0]} times, the plain model's "
        f"{plain_calls[0]}: no recompute"
    )
    state_a, state_b = reference.state_dict(), tuned.state_dict()
    assert list(state_a) == list(state_b)
    differ = [k for k in state_a if not torch.equal(state_a[k], state_b[k])]
    assert not differ, f"{entry.name}: after {STEPS} steps, weights or buffers differ: {differ}"
