"""bench/monitor_overhead.py: interleaved runs, paired ratios, median and MAD, JSON lines."""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
from pathlib import Path

import pytest
import torch
from torch import nn

BENCH = Path(__file__).parents[2] / "bench" / "monitor_overhead.py"
NO_DEADLINE = float("inf")


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("monitor_overhead_bench", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tiny():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    batch = (torch.randn(2, 4), torch.randint(0, 2, (2,)))
    loss = lambda out, b: nn.functional.cross_entropy(out, b[1])  # noqa: E731
    return model, batch, loss, "tiny mlp"


def _args(**overrides) -> argparse.Namespace:
    args = dict(steps=4, min_steps=2, run_s=0.5, rounds=3, min_rounds=1, budget_s=60.0,
                warmup=1, max_events=10_000)  # fmt: skip
    args.update(overrides)
    return argparse.Namespace(**args)


def test_mad_and_the_medians_standard_error(bench):
    """MAD of [1, 2, 3, 4, 100] is 1 (deviations 2, 1, 0, 1, 97); the standard error scales
    it by 1.2533 * 1.4826 / sqrt(n)."""
    values = [1.0, 2.0, 3.0, 4.0, 100.0]
    assert bench._mad(values) == 1.0
    assert bench._stderr_of_median(values) == pytest.approx(1.2533 * 1.4826 / 5**0.5)


def test_rounds_pair_each_monitored_run_with_the_plain_runs_around_it(bench, tmp_path):
    """Three light rounds, then max(min_rounds, 3 // 4) = 1 trace round, on the CPU: one JSON
    line per round, written as measured, then the summary; each ratio is the run's time
    over its paired plain time, minus one; the summary's overheads are the medians of those;
    the light monitor printed once per run (print_period = steps) and covered every step it
    was given."""
    path = tmp_path / "out.jsonl"
    out = bench._JsonLines(str(path))
    summary = bench._bench_model("tiny", _tiny, torch.device("cpu"), _args(), out, NO_DEADLINE)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    rounds = [line for line in lines if line["kind"] == "round"]
    assert [(r["arm"], r["round"]) for r in rounds] == [
        ("light", 0), ("light", 1), ("light", 2), ("trace", 0)
    ]  # fmt: skip
    assert lines[-1] == json.loads(json.dumps(summary))
    for arm in ("light", "trace"):
        arm_rounds = [r for r in rounds if r["arm"] == arm]
        ratios = [r[f"{arm}_ms"] / r[f"{arm}_plain_ms"] - 1 for r in arm_rounds]
        assert [r[f"{arm}_overhead"] for r in arm_rounds] == pytest.approx(ratios)
        assert summary[f"{arm}_overhead_median"] == pytest.approx(statistics.median(ratios))
        assert summary[f"{arm}_overhead_mad"] == pytest.approx(bench._mad(ratios))
    assert summary["rounds"] == 3 and summary["trace_rounds"] == 1
    assert summary["steps_per_run"] == summary["print_period"] == 4
    # The light monitor saw the warm-up run and one run per round, 4 steps each.
    assert summary["light_iterations"] == 4 * (1 + 3)
    assert summary["light_layers_measured"] >= 1  # its first printed iteration
    assert summary["plain_ms_per_step"] > 0


def test_a_model_stops_at_its_time_budget_after_the_minimum_rounds(bench, tmp_path):
    """budget_s=0: only min_rounds rounds are run, however many were asked for."""
    out = bench._JsonLines(None)
    args = _args(rounds=10, min_rounds=2, budget_s=0.0)
    summary = bench._bench_model("tiny", _tiny, torch.device("cpu"), args, out, NO_DEADLINE)
    assert summary["rounds"] == 2
