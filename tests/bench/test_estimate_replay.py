"""bench/estimate_replay.py: a saved plan's eager runs scored by today's estimate."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

import memadvisor


def test_a_saved_plans_runs_are_replayed_against_the_estimate(tmp_path: Path, load_bench) -> None:
    """Rule: every eager run of the plan that fitted gets one row, its measured peak (the
    probe's) beside today's estimate of the same candidate and their relative error, and the
    rows are appended as JSON lines. (How close the estimate is, is the estimate's tests'.)"""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
    )
    batch = (torch.randn(16, 64), torch.randint(0, 8, (16,)))
    plan = memadvisor.plan(
        model,
        batch,
        budget_gb=0.01,
        loss_fn=lambda out, b: nn.functional.cross_entropy(out, b[1]),
        device="simulated",
        progress=False,
    )
    path = tmp_path / "plan.json"
    plan.to_json(path)
    replay = load_bench("estimate_replay")
    out = tmp_path / "rows.jsonl"
    assert replay.main([str(path), "--json", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    fitted = [
        p for p in plan.probes if p.fits and p.peak_bytes and "compile" not in p.candidate.choices
    ]
    assert len(rows) == len(fitted) > 0
    assert [r["measured_bytes"] for r in rows] == [p.peak_bytes for p in fitted]
    for r in rows:
        error = (r["estimated_bytes"] - r["measured_bytes"]) / r["measured_bytes"]
        assert r["error"] == round(error, 4) and r["estimated_bytes"] > 0
