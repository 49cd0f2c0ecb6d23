"""``memadvisor plan``: end to end on the CPU simulated device, and every bad input refused.

The end-to-end runs use the examples shrunk by tests/cli/factories.py. They are marked slow
(10-20 s of CPU each on a 2-core box): even for a tiny model the planner makes 30-45 device
runs (batch probes, verification, and the comparison rows, each row with its own probes).
The bad-input cases fail before any planning, so they are fast.
"""

from __future__ import annotations

import pytest
import torch

import memadvisor
from memadvisor.schema.config import gib_to_bytes
from memadvisor.schema.plan import Plan
from memadvisor.target import load_target
from memadvisor.units import fmt_bytes, fmt_rate

NO_CUDA = not torch.cuda.is_available()


def _one_error_line(result) -> str:
    """The error: one line, the last on stderr (a note on the device may precede it)."""
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], result.stderr
    assert "Traceback" not in result.stderr
    return errors[0]


# -- end to end -------------------------------------------------------------------------------


@pytest.mark.slow
def test_plan_gpt_example_prints_the_answer_and_writes_a_plan_apply_plan_loads(
    cli, factory, tmp_path
) -> None:
    json_path, html_path = tmp_path / "plan.json", tmp_path / "plan.html"
    result = cli(
        "plan", factory("gpt"), "--budget-gb", "0.004", "--json", str(json_path),
        "--html", str(html_path),
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    plan = Plan.model_validate_json(json_path.read_text())
    out = result.stdout
    # The answer first, with the plan's own numbers.
    assert out.index("Budget") < out.index("Configurations compared")
    assert out.index("Configurations compared") < out.index("Where the memory goes")
    assert f"{fmt_bytes(plan.config.budget_bytes)} (" in out
    assert f"verified {fmt_bytes(plan.verified.peak_bytes)}" in out
    # On the simulated device the estimate's rate is the answer's (its CPU times rank nothing).
    rate = plan.verified if plan.device_kind == "cuda" else plan.estimate
    assert fmt_rate(rate.samples_per_s) in out
    assert plan.verified.peak_bytes <= plan.config.budget_bytes
    # The loss over the vocabulary is not a block, and the report names it.
    assert "<loss> *" in out
    for label in ("Baseline", "+Checkpointing", "Plan"):
        assert label in out
    # The JSON is the Plan: apply_plan rewrites a fresh model from the same factory.
    fresh = load_target(factory("gpt")).model
    keys = set(fresh.state_dict())
    tuned = memadvisor.apply_plan(fresh, plan)
    assert set(tuned.state_dict()) == keys
    # The HTML has the same numbers, and nothing to fetch.
    page = html_path.read_text()
    assert fmt_bytes(plan.verified.peak_bytes) in page and "<script src" not in page
    assert "One step of the plan" in page  # its chart is the plan's own recorded step
    if NO_CUDA:
        assert "simulated" in result.stderr  # says where it planned, in one line


@pytest.mark.slow
def test_plan_quiet_prints_only_the_one_line_answer(cli, factory) -> None:
    result = cli("plan", factory("cnn"), "--budget-gb", "0.002", "--quiet")
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    budget = fmt_bytes(gib_to_bytes(0.002))
    assert len(lines) == 1 and "samples/s" in lines[0] and f"of {budget}," in lines[0]
    assert result.stderr == ""  # no progress bars, no notes


@pytest.mark.slow
def test_plan_effective_batch_is_kept_by_accumulation(cli, factory, tmp_path) -> None:
    json_path = tmp_path / "plan.json"
    result = cli(
        "plan", factory("mlp"), "--budget-gb", "0.0006", "--effective-batch", "512",
        "--json", str(json_path), "--quiet",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    plan = Plan.model_validate_json(json_path.read_text())
    assert plan.config.objective == "effective_batch" and plan.config.effective_batch == 512
    assert plan.candidate.batch_size * plan.candidate.accumulation_steps >= 512


def test_plan_budget_below_the_weights_exits_3_and_names_the_minimum(cli, factory) -> None:
    # 32 MiB of weights: with gradients and AdamW state ~128 MiB before any activation.
    result = cli("plan", factory("wide"), "--budget-gb", "0.01")
    assert result.exit_code == 3
    assert "GiB" in _one_error_line(result) or "MiB" in _one_error_line(result)
    assert result.stdout == ""


def test_plan_a_batch_the_model_rejects_is_bad_input(cli, factory) -> None:
    result = cli("plan", factory("rejects_batch"), "--budget-gb", "1")
    assert result.exit_code == 2
    assert "rejected the batch" in _one_error_line(result)


def test_plan_a_model_on_the_meta_device_says_to_estimate_or_materialize_it(cli, factory) -> None:
    """Rule: a model built on meta cannot train on the simulated device: exit 2 naming the
    model and the two ways out, not exit 1 "Cannot copy out of meta tensor ... a bug"."""
    result = cli("plan", factory("on_meta"), "--budget-gb", "0.01", "--device", "simulated")
    assert result.exit_code == 2
    error = _one_error_line(result)
    assert "The model (MLP)" in error and "meta device" in error
    assert "--device estimate" in error and "to_empty" in error


@pytest.mark.parametrize(
    ("name", "raised", "line"),
    [
        ("loss_shapes", "RuntimeError", "return ((logits - batch[1]) ** 2).mean()"),
        ("loss_divides_by_zero", "ZeroDivisionError", "return logits.sum() * (1 / samples)"),
    ],
)
def test_plan_a_loss_fn_that_raises_is_the_users_code_named_with_its_line(
    cli, factory, name: str, raised: str, line: str
) -> None:
    """Rule: an exception from the user's loss_fn exits 2 naming loss_fn, the exception, the
    user's own line and the shapes it was called with; never "a bug in memadvisor" (exit 1)
    nor a raw traceback."""
    result = cli("plan", factory(name), "--budget-gb", "0.01", "--device", "simulated")
    assert result.exit_code == 2, result.stderr
    error = _one_error_line(result)
    assert f"loss_fn raised {raised}" in error and "factories.py:" in error and line in error
    assert "the model (MLP)" in error and "a tensor of shape" in error
    assert "bug in memadvisor" not in error


def test_plan_a_loss_fn_that_is_not_callable_is_refused_at_once(cli, factory) -> None:
    result = cli("plan", factory("loss_not_callable"), "--budget-gb", "0.01")
    assert result.exit_code == 2
    error = _one_error_line(result)
    assert "loss_fn must be a function loss_fn(output, batch)" in error and "loss_fn=3" in error
    assert "profiling" not in result.stderr


def test_plan_writes_the_planners_plan_whole_and_prints_its_one_line(
    cli, factory, gpt_plan, monkeypatch, tmp_path
) -> None:
    """The CLI's own wiring, with the planner replaced by a plan it returns (fast)."""
    import memadvisor.planner
    from memadvisor.report import one_line

    seen = {}

    def fake_plan_workload(workload, config, *, target=None, progress=True):
        seen.update(config=config, target=target, progress=progress)
        return gpt_plan

    monkeypatch.setattr(memadvisor.planner, "plan_workload", fake_plan_workload)
    json_path = tmp_path / "plan.json"
    result = cli(
        "plan", factory("mlp"), "--budget-gb", "8", "--margin", "0.1", "--objective",
        "largest_batch", "--json", str(json_path), "--quiet",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    assert Plan.model_validate_json(json_path.read_text()) == gpt_plan
    assert result.stdout.strip() == one_line(gpt_plan) and result.stderr == ""
    config = seen["config"]
    assert (config.budget_bytes, config.margin_fraction, config.objective) == (
        8 * 2**30,
        0.1,
        "largest_batch",
    )
    assert seen["target"] == factory("mlp") and seen["progress"] is False


def test_plan_html_falls_back_to_phase_peaks_when_the_step_cannot_be_recorded(
    cli, factory, gpt_plan, monkeypatch, tmp_path
) -> None:
    """The plan is made and printed: a chart that cannot be recorded does not lose it."""
    import memadvisor.planner

    monkeypatch.setattr(memadvisor.planner, "plan_workload", lambda *a, **k: gpt_plan)
    html_path = tmp_path / "plan.html"
    # The GPT plan names blocks this MLP lacks: applying it to record its step fails.
    result = cli("plan", factory("mlp"), "--budget-gb", "8", "--html", str(html_path))
    assert result.exit_code == 0, result.stderr
    assert "note: the plan's step could not be recorded for the HTML chart" in result.stderr
    assert "Configurations compared" in result.stdout
    page = html_path.read_text()
    assert "Peak of each phase of the profiled step" in page
    assert fmt_bytes(gpt_plan.verified.peak_bytes) in page


# -- bad input, refused before any work -------------------------------------------------------


@pytest.mark.parametrize("budget", ["0", "-1", "nan", "1e-12", "inf", "-inf", "1e308"])
def test_plan_non_positive_budget_is_bad_input(cli, factory, budget: str) -> None:
    result = cli("plan", factory("mlp"), "--budget-gb", budget)
    assert result.exit_code == 2
    assert "--budget-gb must be a positive number of GiB" in _one_error_line(result)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("examples/gpt.py", "TARGET must be 'path/to/file.py:factory'"),
        ("no/such/file.py:build", "No such file: 'no/such/file.py'"),
        ("no_such_package.module:build", "Cannot import module 'no_such_package.module'"),
    ],
)
def test_plan_bad_target_is_bad_input(cli, target: str, message: str) -> None:
    result = cli("plan", target, "--budget-gb", "1")
    assert result.exit_code == 2
    assert message in _one_error_line(result)


def test_plan_factory_that_raises_is_bad_input_with_its_message(cli, factory) -> None:
    result = cli("plan", factory("raises"), "--budget-gb", "1")
    assert result.exit_code == 2
    line = _one_error_line(result)
    assert "RuntimeError" in line and "the dataset at /data/train is not mounted" in line


def test_plan_factory_that_calls_sys_exit_says_so(cli, factory) -> None:
    """Rule: a factory ending the process is reported, not passed on as a silent exit 7."""
    result = cli("plan", factory("exits"), "--budget-gb", "1")
    assert result.exit_code == 2
    assert "sys.exit(7)" in _one_error_line(result)


def test_plan_a_batch_of_0_rows_is_bad_input(cli, factory) -> None:
    """Rule: an empty sample batch is the user's input to fix, not a ZeroDivisionError bug."""
    result = cli("plan", factory("empty_batch"), "--budget-gb", "1")
    assert result.exit_code == 2
    assert "0 rows" in _one_error_line(result)


def test_plan_infeasible_budget_names_the_cli_option_and_the_budget_as_given(cli, factory) -> None:
    """Rule: the CLI's user is told --budget-gb (not budget_gb=), and the budget shown is the
    one they passed (0.08, not 0.09 by rounding up)."""
    result = cli("plan", factory("wide"), "--budget-gb", "0.08")
    assert result.exit_code == 3
    line = _one_error_line(result)
    assert "of the 0.08 GiB budget" in line
    assert "--budget-gb " in line and "budget_gb=" not in line


def test_plan_simulated_budget_above_host_memory_says_host_ram_is_the_limit(
    cli, factory, monkeypatch
) -> None:
    from memadvisor.device import simulated

    monkeypatch.setattr(simulated, "host_available_bytes", lambda: 2**30)
    result = cli("plan", factory("mlp"), "--budget-gb", "4", "--device", "simulated")
    assert result.exit_code == 2
    line = _one_error_line(result)
    assert "host RAM" in line and "1.00 GiB" in line


def test_plan_factory_returning_no_model_is_bad_input(cli, factory) -> None:
    result = cli("plan", factory("not_a_model"), "--budget-gb", "1")
    assert result.exit_code == 2
    assert "model must be a torch.nn.Module" in _one_error_line(result)


def test_plan_missing_factory_name_is_bad_input(cli, factory) -> None:
    result = cli("plan", factory("no_such_factory"), "--budget-gb", "1")
    assert result.exit_code == 2
    assert "has no callable 'no_such_factory'" in _one_error_line(result)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--margin", "0.7"], "--margin must be at least 0 and below 0.5"),
        (["--objective", "effective_batch"], "needs --effective-batch N"),
        (["--effective-batch", "0"], "--effective-batch must be positive"),
        (["--json", "/no/such/folder/plan.json"], "the folder '/no/such/folder' does not exist"),
    ],
)
def test_plan_bad_option_is_bad_input(cli, factory, args: list[str], message: str) -> None:
    result = cli("plan", factory("mlp"), "--budget-gb", "1", *args)
    assert result.exit_code == 2
    assert message in _one_error_line(result)


@pytest.mark.skipif(not NO_CUDA, reason="this machine has a CUDA device")
def test_plan_device_cuda_without_a_gpu_is_bad_input(cli, factory) -> None:
    result = cli("plan", factory("mlp"), "--budget-gb", "1", "--device", "cuda")
    assert result.exit_code == 2
    assert "--device cpu" in _one_error_line(result)


@pytest.mark.parametrize("bad", [["--max-batch", "0"], ["--max-batch", "-3"]])
def test_plan_max_batch_below_1_is_bad_input(cli, factory, bad: list[str]) -> None:
    result = cli("plan", factory("mlp"), "--budget-gb", "1", *bad)
    assert result.exit_code == 2
    assert "--max-batch must be a whole number of samples, at least 1" in _one_error_line(result)


def test_plan_help_names_max_batch_and_every_device_name(cli) -> None:
    """--max-batch is offered; --device lists the same names as plan(device=...)."""
    from memadvisor.schema.config import DEVICE_NAMES

    text = cli("plan", "--help").stdout
    assert "--max-batch" in text
    for name in DEVICE_NAMES:
        assert name in text


def test_plan_max_batch_caps_the_pick(cli, factory, tmp_path) -> None:
    """--max-batch 3 on a budget that holds far more: the pick is at most 3, and the plan's
    config records the cap; --device cpu is the simulated device."""
    json_path = tmp_path / "plan.json"
    result = cli(
        "plan", factory("mlp"), "--budget-gb", "1", "--max-batch", "3", "--device", "cpu",
        "--json", str(json_path), "--quiet",
    )  # fmt: skip
    assert result.exit_code == 0, result.stderr
    plan = Plan.load(json_path)
    assert plan.config.max_batch == 3 and plan.candidate.batch_size <= 3
    assert plan.device_kind == "simulated"


def test_plan_unknown_objective_is_a_usage_error(cli, factory) -> None:
    result = cli("plan", factory("mlp"), "--budget-gb", "1", "--objective", "fastest")
    assert result.exit_code == 2
    assert "fastest" in result.stderr


def test_plan_help_ends_with_examples_and_exit_codes(cli) -> None:
    result = cli("plan", "--help")
    assert result.exit_code == 0
    text = result.stdout
    assert text.index("Examples") > text.index("--budget-gb")
    assert "memadvisor plan examples/gpt.py:build --budget-gb 0.25" in text
    assert "3 nothing fits the budget" in text


@pytest.mark.slow
def test_plan_piped_at_80_columns_prints_every_advice_code_line_whole(factory, tmp_path) -> None:
    """Through a pipe rich sees no terminal and lays out at 80 columns: the code to paste must
    still parse, line by line as printed, and the tables must cut nothing."""
    import ast
    import os
    import re
    import subprocess
    import sys

    json_path, html_path = tmp_path / "plan.json", tmp_path / "plan.html"
    env = {**os.environ, "COLUMNS": "80"}
    env.pop("FORCE_COLOR", None)
    result = subprocess.run(
        [sys.executable, "-m", "memadvisor.cli", "plan", factory("gpt"), "--budget-gb", "0.004",
         "--json", str(json_path), "--html", str(html_path)],
        capture_output=True, text=True, env=env, timeout=600,  # stdout is a pipe
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    plan = Plan.model_validate_json(json_path.read_text())
    out = result.stdout
    blocks = re.findall(r"^```python\n(.*?)^```$", out, re.S | re.M)
    assert len(blocks) == sum(1 for a in plan.advice if a.snippet) > 0
    for block, advice in zip(blocks, [a for a in plan.advice if a.snippet], strict=True):
        ast.parse(block)
        assert block.rstrip("\n") == advice.snippet.rstrip("\n")
    cut = [line for line in out.splitlines() if "…" in line and "more" not in line]
    assert cut == []
    # The HTML has the loss band's legend entry and the op table of the plan's own step.
    page = html_path.read_text()
    assert 'data-phase="loss"' in page and 'id="ops"' in page


def test_plan_world_size_without_a_way_to_share_is_bad_input(cli, factory) -> None:
    result = cli("plan", factory("mlp"), "--budget-gb", "1", "--world-size", "2")
    assert result.exit_code == 2
    assert "--parallel ddp or --parallel fsdp2" in _one_error_line(result)


def test_plan_parallel_must_be_a_known_way(cli, factory) -> None:
    result = cli("plan", factory("mlp"), "--budget-gb", "1", "--parallel", "zero3")
    assert result.exit_code == 2
