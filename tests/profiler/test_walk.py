"""The backward walk keys storages by the step's own identity (id and serial), not by
``id(storage)`` alone, whose reuse by a later storage made a block's kept outputs depend on
where Python put a wrapper: profiling one model again gave other bytes (issue 29)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from memadvisor.device._autocast import cuda_autocast_policy
from memadvisor.profiler import profile_workload
from memadvisor.target import workload_from_result

FACTORIES = Path(__file__).resolve().parents[1] / "cli" / "factories.py"


def _bytes_only(value: Any) -> Any:
    """A dumped profile without its times (those are the CPU's and jitter)."""
    if isinstance(value, dict):
        return {k: _bytes_only(v) for k, v in value.items() if not k.endswith("_ms")}
    if isinstance(value, list):
        return [_bytes_only(v) for v in value]
    return value


def test_profiling_one_model_six_times_gives_the_same_bytes() -> None:
    """Six profiles of one small MLP in one process, bf16 under CUDA's autocast policy as the
    simulated device profiles it: every byte figure the same (blocks' kept outputs included;
    before, 4 of 5 repeats differed there)."""
    spec = importlib.util.spec_from_file_location("memadvisor_tests_cli_factories", FACTORIES)
    factories = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(factories)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dumps = set()
        for _ in range(6):
            workload = workload_from_result(factories.mlp())
            with cuda_autocast_policy():
                profile = profile_workload(workload, device="cpu")
            dumps.add(json.dumps(_bytes_only(profile.model_dump(mode="json")), sort_keys=True))
    finally:
        torch.set_num_threads(threads)
    assert len(dumps) == 1
