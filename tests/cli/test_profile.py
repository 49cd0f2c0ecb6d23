"""``memadvisor profile``: the report and every export, end to end on the CPU."""

from __future__ import annotations

import json

import pytest

from memadvisor.schema.profile import Profile
from memadvisor.timeline import Timeline
from memadvisor.units import fmt_bytes


def _one_error_line(result) -> str:
    """The error: one line, the last on stderr (a note on the device may precede it)."""
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert "Traceback" not in result.stderr
    return errors[0]


def test_profile_gpt_example_reports_owners_phases_and_writes_every_export(
    cli, factory, tmp_path
) -> None:
    paths = {name: tmp_path / f"{name}.json" for name in ("profile", "timeline", "speedscope")}
    html_path = tmp_path / "profile.html"
    result = cli(
        "profile", factory("gpt"), "--json", str(paths["profile"]),
        "--timeline", str(paths["timeline"]), "--speedscope", str(paths["speedscope"]),
        "--html", str(html_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    profile = Profile.model_validate_json(paths["profile"].read_text())
    out = result.stdout
    b = max(profile.batch_sizes)
    assert f"Memory by kind at batch {b}" in out
    assert fmt_bytes(profile.optimizer_state_bytes) in out
    # The loss over a 2048-token vocabulary outweighs each block, and is listed first.
    owners = out[out.index("Top activation owners") : out.index("Per-phase peaks")]
    assert owners.index("<loss> *") < owners.index("h.0")
    for phase in ("forward", "backward", "optimizer"):
        assert phase in out[out.index("Per-phase peaks") :]
    timeline = Timeline.model_validate_json(paths["timeline"].read_text())
    assert {e.phase for e in timeline.events if e.kind == "phase"} >= {"forward", "backward"}
    flame = json.loads(paths["speedscope"].read_text())
    assert flame["$schema"].endswith("file-format-schema.json") and flame["profiles"]
    page = html_path.read_text()
    assert "recorded module by module" in page and "&lt;loss&gt;" in page
    for name in ("the profile", "the timeline", "the speedscope flame graph", "the HTML report"):
        assert f"Wrote {name} to" in result.stderr


def test_profile_quiet_prints_one_line(cli, factory) -> None:
    result = cli("profile", factory("mlp"), "--quiet")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "per sample" in lines[0] and "4 blocks" in lines[0]
    assert result.stderr == ""


def test_profile_a_batch_the_model_rejects_is_bad_input(cli, factory) -> None:
    result = cli("profile", factory("rejects_batch"))
    assert result.exit_code == 2
    assert "rejected the batch" in _one_error_line(result)


def test_profile_missing_file_is_bad_input(cli) -> None:
    result = cli("profile", "no/such/file.py:build")
    assert result.exit_code == 2
    assert "No such file" in _one_error_line(result)


def test_profile_cuda_snapshot_without_cuda_is_bad_input(cli, factory, tmp_path) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device: the snapshot is possible")
    result = cli("profile", factory("mlp"), "--cuda-snapshot", str(tmp_path / "s.pickle"))
    assert result.exit_code == 2
    assert "--cuda-snapshot records the CUDA caching allocator" in _one_error_line(result)


def test_profile_non_positive_batch_size_is_bad_input(cli, factory) -> None:
    result = cli("profile", factory("mlp"), "--batch-size", "0")
    assert result.exit_code == 2
    assert "--batch-size must be positive" in _one_error_line(result)


def test_profile_blocks_that_match_nothing_is_bad_input(cli, factory) -> None:
    result = cli("profile", factory("mlp"), "--blocks", "no_such_layer.*")
    assert result.exit_code == 2
    assert "no_such_layer" in _one_error_line(result)


def test_profile_help_speaks_of_no_budget(cli) -> None:
    """profile takes no budget: its --device help does not mention one, and lists the same
    device names as plan."""
    from memadvisor.schema.config import DEVICE_NAMES

    text = cli("profile", "--help").stdout
    assert "budget" not in text.lower()
    for name in DEVICE_NAMES:
        assert name in text


def test_profile_help_ends_with_examples(cli) -> None:
    result = cli("profile", "--help")
    assert result.exit_code == 0
    assert result.stdout.index("Examples") > result.stdout.index("--speedscope")
    assert "memadvisor profile examples/gpt.py:build" in result.stdout
