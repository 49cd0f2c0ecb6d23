"""The same inputs give the same plan on the simulated device (memadvisor/planner/_steady.py):
its estimate's step times are modelled from FLOPs, not taken from a CPU profile whose times
jitter from one run to the next by more than the gaps between candidates."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest
import torch

import memadvisor
from memadvisor.planner._search import search
from memadvisor.planner._space import SearchSpace
from memadvisor.planner._steady import with_times_that_rank
from memadvisor.profiler import profile_workload
from memadvisor.schema.config import PlanConfig, gib_to_bytes
from memadvisor.schema.profile import Profile
from memadvisor.strategy import load_strategies
from memadvisor.target import workload_from_result

FACTORIES = Path(__file__).resolve().parents[1] / "cli" / "factories.py"
QUICK = {"probe_steps": 2, "timing_steps": 2, "verify_steps": 3}


def _factories():
    spec = importlib.util.spec_from_file_location("memadvisor_tests_cli_factories", FACTORIES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _scaled_times(value: Any, factor: float) -> Any:
    """Every time in a dumped profile (keys ending in _ms) times ``factor``: CPU jitter."""
    if isinstance(value, dict):
        return {
            k: (
                v * factor
                if k.endswith("_ms") and isinstance(v, float)
                else _scaled_times(v, factor)
            )
            for k, v in value.items()
        }
    if isinstance(value, list):
        return [_scaled_times(v, factor) for v in value]
    return value


def _ranking(profile: Profile) -> list[tuple[str, int, float]]:
    """The search's ranking of every combination: choices, batch, estimated samples/s."""
    config = PlanConfig(budget_bytes=gib_to_bytes(0.002), device="simulated")
    space = SearchSpace(profile, load_strategies(config.strategies), config)
    return [
        (s.choices_json, s.candidate.batch_size, round(s.estimate.samples_per_s, 6))
        for s in search(space, config.seed)
    ]


def test_the_ranking_times_do_not_depend_on_the_profiled_cpu_times() -> None:
    """Two profiles of one model whose CPU times differ (by 1.7x, as a loaded machine's do)
    give the estimate the same step times: the ranking is a function of the model alone."""
    torch.set_num_threads(1)
    workload = workload_from_result(_factories().mlp())
    measured = profile_workload(workload, device="cpu")
    jittered = Profile.model_validate(_scaled_times(measured.model_dump(mode="json"), 1.7))
    assert jittered.steps != measured.steps
    steady, note = with_times_that_rank(workload, measured)
    steady_jittered, _ = with_times_that_rank(workload, jittered)
    assert note is None
    assert _ranking(steady) == _ranking(steady_jittered)
    assert _ranking(measured) != _ranking(jittered)  # what the CPU's times did
    # Bytes decide every batch: they are the profile's measurement, untouched.
    steady = steady.model_copy(update={"flops": None})  # added: what the times came from
    assert _scaled_times(steady.model_dump(mode="json"), 0.0) == _scaled_times(
        measured.model_dump(mode="json"), 0.0
    )


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["throughput", "largest_batch"])
def test_the_same_model_planned_12_times_in_one_process_gives_one_pick(objective: str) -> None:
    """12 plans of one small model on the simulated device, in one process: one pick (by the
    throughput objective they used to be up to 6 different ones)."""
    torch.set_num_threads(1)
    factories = _factories()
    picks = set()
    for _ in range(12):
        built = factories.mlp()
        plan = memadvisor.plan(
            built["model"],
            built["sample_batch"],
            loss_fn=built["loss_fn"],
            budget_gb=0.002,
            device="simulated",
            objective=objective,
            progress=False,
            **QUICK,
        )
        picks.add(json.dumps(plan.candidate.model_dump(mode="json"), sort_keys=True))
    assert len(picks) == 1, picks
