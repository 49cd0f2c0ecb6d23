"""The CLI on a real card: CUDA numbers (reserved bytes, fragmentation, the allocator snapshot).

Run on a GPU machine: ``python -m pytest -q -m gpu tests/cli``.
"""

from __future__ import annotations

import pickle

import pytest

from memadvisor.schema.plan import Plan
from memadvisor.schema.profile import Profile
from memadvisor.units import fmt_bytes

pytestmark = pytest.mark.gpu


def test_profile_on_cuda_reports_reserved_bytes_and_writes_the_allocator_snapshot(
    cli, factory, tmp_path
) -> None:
    snapshot, html, profile_json = tmp_path / "s.pickle", tmp_path / "p.html", tmp_path / "p.json"
    result = cli(
        "profile", factory("gpt"), "--device", "cuda", "--cuda-snapshot", str(snapshot),
        "--html", str(html), "--json", str(profile_json),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    profile = Profile.model_validate_json(profile_json.read_text())
    assert profile.device.kind == "cuda" and profile.fragmentation_ratio is not None
    assert "fp32 reserved" in result.stdout and "Fragmentation" in result.stdout
    with snapshot.open("rb") as f:
        assert "segments" in pickle.load(f)  # torch's memory_viz format
    page = html.read_text()
    assert "on cuda" in page and "reserved" in page


def test_plan_on_cuda_verifies_under_the_budget_and_reports_it(cli, factory, tmp_path) -> None:
    plan_json, html = tmp_path / "plan.json", tmp_path / "plan.html"
    result = cli(
        "plan", factory("gpt"), "--budget-gb", "0.25", "--device", "cuda",
        "--json", str(plan_json), "--html", str(html),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    plan = Plan.model_validate_json(plan_json.read_text())
    assert plan.device_kind == "cuda" and plan.verified is not None
    held = max(plan.verified.peak_bytes, plan.verified.reserved_peak_bytes or 0)
    assert held <= plan.config.budget_bytes
    assert f"verified {fmt_bytes(plan.verified.peak_bytes)} allocated" in result.stdout
    assert "simulated" not in result.stderr
    assert "One step of the plan" in html.read_text()


def test_plan_on_cuda_of_a_model_on_the_meta_device_says_to_estimate_or_materialize_it(
    cli, factory
) -> None:
    """Rule: as on the simulated device, a model built on meta exits 2 on a card, naming the
    model and the two ways out (not "Cannot copy out of meta tensor", exit 1)."""
    result = cli("plan", factory("on_meta"), "--budget-gb", "0.01", "--device", "cuda")
    assert result.exit_code == 2, result.stderr
    assert "The model (MLP)" in result.stderr and "--device estimate" in result.stderr


def test_profile_on_cuda_of_a_sliced_sample_batch_is_the_profile_of_its_rows(factory) -> None:
    """Rule: (X[:16], Y[:16]) of 4096-row tensors profiles on a card as the same 16 rows of
    their own do: every phase's peak within 5% at batch 4096 (a CPU view reaches the card as
    a compact copy, so this holds before and after issue 25's fix: it guards the card's path)."""
    import memadvisor
    from memadvisor.target import load_factory

    peaks = {}
    for name in ("mlp_fresh16", "mlp_sliced"):
        job = load_factory(factory(name))()
        profile = memadvisor.profile(
            job["model"], job["sample_batch"], loss_fn=job["loss_fn"], device="cuda",
            precisions=["fp32"],
        )  # fmt: skip
        peaks[name] = {p.phase: p.allocated.signed_at(4096) for p in profile.steps["fp32"].phases}
    assert peaks["mlp_sliced"].keys() == peaks["mlp_fresh16"].keys()
    for phase, fresh in peaks["mlp_fresh16"].items():
        assert abs(peaks["mlp_sliced"][phase] - fresh) <= 0.05 * fresh, (phase, peaks)
