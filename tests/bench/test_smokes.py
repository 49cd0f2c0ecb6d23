"""Every bench/ script runs on the CPU: its smoke, or at least its imports, in a subprocess.

Rule: a bench that rots (an API it calls moved, a config field it sets was renamed) fails
here, not on the GPU machine. Each bench with a CPU path runs its smoke (simulated or
estimate device, tiny sizes) and must exit 0 and write its JSON lines to a temporary folder
(never bench/results/); a bench whose every path needs a card is imported (its module-level
imports resolved, main() not run) until it gains a CPU path, and the table says so.

``test_every_bench_is_listed`` keeps the table whole: a new bench without an entry fails.

Cost: the smokes were written to take about 2 minutes together on an idle 2-core machine;
each has its own time limit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
OUT = "{out}"  # the JSON lines file in the test's temporary folder

# name -> the smoke's arguments (OUT where its JSON lines go; None: prints only), or a list of
# such runs where a bench has several commands (each its own process, in turn); a run whose
# first word is a script (``plan_speed.py``) runs that bench instead, for what the smoke reads.
SMOKES: dict[str, list[str] | list[list[str]]] = {
    "multi_gpu": ["--smoke", "--json", OUT],
    "estimate_speed": ["--blocks", "4", "--seconds", "0.2"],
    "estimate_accuracy": [
        "--device", "cpu", "--models", "cnn", "--precisions", "fp32", "--targets", "0.05",
        "--steps", "1", "--json", OUT,
    ],
    "estimate_device": [
        "--models", "llama_tiny", "--device", "simulated", "--steps", "2", "--budget-gib",
        "0.05", "--json", OUT,
    ],
    "monitor_overhead": [
        "--device", "cpu", "--models", "cnn", "--steps", "2", "--min-steps", "2", "--rounds",
        "1", "--min-rounds", "1", "--warmup", "1", "--json", OUT,
    ],
    "fake_7b": ["--preset", "tiny", "--seq-len", "64"],
    "precision_check": ["--device", "cpu", "--tiny", "--models", "gpt2", "--out", OUT],
    "probe_exit": ["--repeat", "1", "--linger-s", "1"],
    "prober_bound": ["--failures", "35-35"],
    "loss_head": [
        [
            "peaks", "--batches", "2", "--precisions", "fp32", "--chunks", "off", "8",
            "--target", f"{ROOT}/examples/llama.py:build",
        ],
        [
            "cells", "--device", "simulated", "--models", "llama", "--budget-gib", "0.08",
            "--cells", "eager,eager+chunked,compiled,plan", "--json", OUT,
        ],
    ],
    "plan_edges": [
        "--model", "cnn", "--budget-gb", "0.25", "--device", "estimate", "--workdir", "edges",
        "--window", "profiling (fake tensors)", "profiling: metered", "--exit", "hard",
        "--every-s", "0.05", "--save-plan", "edges/plan.json", "--json", OUT,
    ],
    "plan_speed": [
        "--models", "cnn", "--budget-gb", "0.25", "--device", "estimate", "--compile", "off",
        "--save-plans", "plans", "--timeout-s", "100", "--json", OUT,
        "--compile-search", '{"dynamic_batch": false}', "--bytecode-dir", "pyc",
    ],
    "loop_gap": [
        "--models", "cnn", "--budget-gib", "0.05", "--warmup", "1", "--short", "2", "--long",
        "3", "--rounds", "1", "--json", OUT,
    ],
    "autotune_contention": [
        "--device", "simulated", "--model", "cnn", "--batch", "8", "--budget-gib", "0.05",
        "--steps", "3", "--choices", '{"precision": "bf16"}', "--json", OUT,
    ],
    "process_spread": [
        [  # the plan it reads, made first by another bench (a run naming its script)
            "plan_speed.py", "--models", "cnn", "--budget-gb", "0.25", "--device", "estimate",
            "--compile", "off", "--save-plans", "plans", "--timeout-s", "100", "--json", "ps.jsonl",
        ],
        [
            "--device", "simulated", "--model", "cnn", "--plan", "plans", "--budget-gib",
            "0.25", "--steps", "3", "--warmup", "1", "--repeats", "1", "--placements", "far",
            "--rounds", "2", "--env", "PYTHONHASHSEED=0", "--batch", "3", "--fused-optimizer",
            "--json", OUT,
        ],
    ],
    "user_path": [
        "--device", "simulated", "--models", "cnn", "--budget-gib", "0.05", "--steps", "3",
        "--warmup", "1", "--repeats", "1", "--no-plain", "--no-holding", "--hold-steps", "2",
        "--hand", "eager+half,compile+all", "--rerun-pick", "--rerun-repeats", "2", "--label",
        "smoke", "--cell-draws", "2", "--json", OUT,
    ],
}  # fmt: skip
# Fields every JSON line of that smoke carries (issue 27's rows: what "Done when" reads).
FIELDS: dict[str, set[str]] = {
    "plan_speed": {
        "model", "plan_wall_s", "compile_s", "cache", "pick", "plan_saved", "outside_planner_s",
        "host_cpu_busy",
    },
    "user_path": {
        "model", "plan_wall_s", "compile_s", "pick", "verified_samples_per_s", "hand_grid",
        "best_hand_samples_per_s", "pick_over_best_hand", "pick_rerun_over_best_hand",
        "user_loop_samples_per_s",
        "user_loop_ooms", "loop_over_verified", "loop_over_rerun", "largest_batch_holding",
        "device",
        "alloc_conf", "hand_alloc_conf",
    },
}  # fmt: skip
FIELDS["plan_edges"] = {"model", "process_s", "planner_wall_s", "exit", "exit_s", "windows"}
FIELDS["loop_gap"] = {"model", "verified_samples_per_s", "train_step_short", "loop_long"}
FIELDS["autotune_contention"] = {"phase", "runs_at_once", "samples_per_s_each", "best_configs"}
FIELDS["process_spread"] = {"placement", "cores", "cpu", "cpu_node", "samples_per_s"}
# Values every JSON line of that smoke has (a default that must hold).
VALUES: dict[str, dict[str, object]] = {
    "plan_speed": {
        "cache": "cold",
        "compile_search_overrides": {"dynamic_batch": False},
        "fork_server_imports_compiler": True,
    }
}


def _plan_speed_rules(line: dict) -> None:
    """plan_speed: the parts add up, and --bytecode-dir reached the plan's processes."""
    _parts_add_up(line)
    assert line["python_bytecode"].startswith("written to ") and line["python_bytecode"].endswith(
        "/pyc"
    ), line["python_bytecode"]


def _parts_add_up(line: dict) -> None:
    """plan_speed: the process's seconds around the planner add up to its wall, and the
    plan_workload call holds the planner's own wall."""
    parts = line["outside_planner_s"]
    assert abs(sum(parts.values()) - line["plan_wall_s"]) < 0.5, (parts, line["plan_wall_s"])
    assert parts["plan_call_s"] >= line["planner_wall_s"] - 0.1, (parts, line["planner_wall_s"])


def _one_rate_a_run(line: dict) -> None:
    """autotune_contention: a rate for each run of the phase, all of them measured."""
    assert len(line["samples_per_s_each"]) == line["runs_at_once"], line
    assert all(rate and rate > 0 for rate in line["samples_per_s_each"]), line


def _ran_where_bound(line: dict) -> None:
    """process_spread: a bound run's loop ran on one of the cores it was bound to, and
    each of its rounds measured a rate."""
    assert line["samples_per_s"] and line["samples_per_s"] > 0, line
    if line["cores"] is not None:
        assert line["cpu"] in line["cores"], line
    # Two rounds in the one process (--rounds 2), each its own build and rate.
    assert [r["samples_per_s"] > 0 for r in line["rounds"]] == [True, True], line
    # The variant flags reach the row, and the loop says the host's share of its step.
    assert (line["batch"], line["fused_optimizer"]) == (3, True), line
    assert 0 < line["queue_over_step"] <= 1.0 + 1e-6, line
    # The host's time split into forward and loss, backward, the optimizer: parts of the
    # time loop_step took, each measured (a CPU step is all host).
    parts = line["host_ms_forward_backward_optimizer"]
    assert len(parts) == 3 and all(p > 0 for p in parts), line
    assert sum(parts) <= line["queue_ms_p50"] * 3, line


def _cells_drawn_twice(line: dict) -> None:
    """user_path (--cell-draws 2): each measured cell carries its two draws and their median."""
    for cell in line["hand_grid"]:
        if cell.get("samples_per_s_first") is not None:
            assert len(cell["samples_per_s_each"]) == 2, cell
    assert any("samples_per_s_each" in c for c in line["hand_grid"]), line["hand_grid"]


def _window_found(line: dict) -> None:
    """plan_edges: the asked window was found in the plan's log, and the exit was timed."""
    assert [w["from"] for w in line["windows"]] == ["profiling (fake tensors)"], line
    assert line["windows"][0]["s"] >= 0 and line["exit_s"] >= 0, line
    assert line["plan_saved"].endswith("plan.json"), line


# A rule every JSON line of that smoke keeps, beyond its fields.
RULES = {
    "plan_speed": _plan_speed_rules,
    "plan_edges": _window_found,
    "autotune_contention": _one_rate_a_run,
    "process_spread": _ran_where_bound,
    "user_path": _cells_drawn_twice,
}
# Benches whose every path needs a card: imported only, for now (the reason each says).
IMPORT_ONLY = {
    "cards": "runs shell commands over cards (tests/bench/test_cards.py runs it with --cards)",
    "compile_cache": "times inductor's caches on a card",
    "estimate_replay": "reads plans a card saved (tests/bench/test_estimate_replay.py replays "
    "a simulated one)",
    "compile_regional": "its --smoke compiles with inductor on the CPU: minutes here",
    "compile_vs_eager": "plans with compile weighed, which only a card measures",
    "compiled_forward_gap": "CUDA events and compiled loops",
    "cudagraph_skips": "counts the CUDA graphs inductor skipped on a card",
    "gpu_facts": "compares the meter with the CUDA allocator",
    "planner": "plans on a card against hand configurations",
    "profile_check": "compares the profile with the CUDA allocator",
    "strategies_effect": "its CPU path takes minutes (numerics curves)",
    "zoo_picks": "plans every zoo model: tests/test_zoo.py runs the same plans",
}
# A smoke's limit catches a hang, not a speed (a bench's speed is measured on a card). On
# session 36's CI machine, alone and on one thread as here, loss_head's smoke took 206-210 s
# and user_path's over 150, the same on session 35's code and on session 36's.
LIMIT_S = 420


def _benches() -> list[str]:
    return sorted(p.stem for p in BENCH.glob("*.py") if not p.stem.startswith("_"))


def test_every_bench_is_listed() -> None:
    listed = set(SMOKES) | set(IMPORT_ONLY)
    assert set(_benches()) == listed, set(_benches()) ^ listed
    assert not set(SMOKES) & set(IMPORT_ONLY)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path, even on a GPU machine
    return env


def _runs(name: str) -> list[list[str]]:
    spec = SMOKES[name]
    return [run for run in spec if isinstance(run, list)] or [spec]  # type: ignore[list-item]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SMOKES))
def test_the_smoke_runs_and_writes_its_lines(name: str, tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    results = ROOT / "bench" / "results"
    before = {p: p.stat().st_mtime_ns for p in results.glob("*")}
    for run in _runs(name):
        script, run = (run[0], run[1:]) if run[0].endswith(".py") else (f"{name}.py", run)
        args = [a.replace(OUT, str(out)) for a in run]
        done = subprocess.run(
            [sys.executable, str(BENCH / script), *args],
            cwd=tmp_path,
            env=_env(),
            capture_output=True,
            text=True,
            timeout=LIMIT_S,
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        assert done.stdout.strip(), f"the smoke {run[:1]} printed nothing (no table)"
        if OUT in run:
            lines = [json.loads(line) for line in out.read_text().splitlines() if line]
            assert lines, f"{name} wrote no JSON line to {out}"
            for line in lines:
                assert FIELDS.get(name, set()) <= set(line), FIELDS[name] - set(line)
                for key, value in VALUES.get(name, {}).items():
                    assert line[key] == value, (key, line[key])
                if name in RULES:
                    RULES[name](line)
    after = {p: p.stat().st_mtime_ns for p in results.glob("*")}
    assert after == before, "a smoke wrote into bench/results/"


_IMPORT_EACH = """
import json, runpy, sys, traceback
sys.path.insert(0, sys.argv[1])
failed = {}
for path in sys.argv[2:]:
    try:
        runpy.run_path(path, run_name="bench_import_check")
    except BaseException:
        failed[path] = traceback.format_exc()[-2000:]
print(json.dumps(failed))
"""


def test_every_card_only_bench_imports() -> None:
    # One process for all of them: torch is imported once.
    paths = [str(BENCH / f"{name}.py") for name in sorted(IMPORT_ONLY)]
    done = subprocess.run(
        [sys.executable, "-c", _IMPORT_EACH, str(BENCH), *paths],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=LIMIT_S,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert failed == {}, "\n".join(f"{k}:\n{v}" for k, v in failed.items())
