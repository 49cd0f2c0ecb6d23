"""bench/plan_speed.py's commit label: which code a row's plan ran."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")

_ENV = {
    "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t", "GIT_CONFIG_GLOBAL": os.devnull, "GIT_CONFIG_NOSYSTEM": "1",
}  # fmt: skip


def _git(root: Path, *args: str) -> str:
    env = {**os.environ, **_ENV}
    done = subprocess.run(["git", *args], cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_a_dirty_copy_names_the_tree_its_files_make_and_leaves_the_index_alone(
    load_bench, tmp_path: Path
) -> None:
    """Rule: where the working tree differs from HEAD (the device tool's copy kept an older
    HEAD than its files), the label is git describe's "-dirty" and the hash of the tree the
    files make, which is the tree of the commit that holds them; the repository's own index
    is not changed. A clean tree is git describe's alone."""
    plan_speed = load_bench("plan_speed")
    _git(tmp_path, "init", "-q")
    (tmp_path / "a.py").write_text("x = 1\n")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD").strip()
    assert plan_speed._commit(tmp_path) == head
    (tmp_path / "a.py").write_text("x = 2\n")
    (tmp_path / "b.py").write_text("y = 1\n")  # untracked, not ignored: it ran too
    label = plan_speed._commit(tmp_path)
    assert label.startswith(f"{head}-dirty tree "), label
    # The repository's index still says a.py is changed, not staged, and b.py untracked.
    assert _git(tmp_path, "status", "--porcelain").splitlines() == [" M a.py", "?? b.py"]
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "two")
    assert label.split(" tree ")[1] == _git(tmp_path, "rev-parse", "HEAD^{tree}").strip()


def test_a_runs_words_say_its_reserved_peak_and_host_share_where_its_record_has_them(
    load_bench,
) -> None:
    """Rule: a run that fit is written with its rate, and where its record keeps them (a card's
    plans from session 34 on) its allocated/reserved peaks in GB and the host's share of its
    step; a run that ran out, or a record without them, is written as before."""
    plan_speed = load_bench("plan_speed")
    fit = {
        "stage": "probe",
        "batch_size": 39,
        "fits": True,
        "step_ms": 312.0,
        "wall_ms": 8400.0,
        "peak_bytes": 7_190_000_000,
        "reserved_peak_bytes": 7_900_000_000,
        "host_ms": 260.0,
        "candidate": {"choices": {"precision": "bf16", "checkpointing": ["a", "b"]}},
    }
    assert (
        plan_speed._run_words(fit) == "probe b39 fits 125/s 7.19/7.90GB host 0.83 8.4s bf16+2ckpt"
    )
    older = {k: v for k, v in fit.items() if k not in ("reserved_peak_bytes", "host_ms")}
    assert plan_speed._run_words(older) == "probe b39 fits 125/s 8.4s bf16+2ckpt"
    out = {"stage": "probe", "batch_size": 42, "fits": False, "wall_ms": 6300.0}
    assert plan_speed._run_words(out) == "probe b42 OOM 6.3s "


def test_the_hosts_busy_share_of_a_stage_is_its_busy_jiffies_over_all_in_its_window(
    load_bench,
) -> None:
    """Rule: a stage's ``host_cpu_busy`` share is the busy jiffies over all jiffies between
    the samples inside its window (the stages laid end to end from the planner's start in the
    plan's order); a stage under 2 s, or a window with fewer than two samples, has none."""
    cpu = load_bench("plan_speed").HostCpu()
    # (wall time, busy, total): 1 s apart; busy 50% for 4 s, then all busy for 4 s
    busy = [50 * t if t <= 4 else 200 + 100 * (t - 4) for t in range(9)]
    cpu.samples = [(100.0 + t, busy[t], 100 * t) for t in range(9)]
    shares = cpu.by_stage(100.0, {"probes": 4.0, "search": 1.0, "compile": 3.0})
    assert shares["probes"] == 0.5
    assert "search" not in shares  # under 2 s
    assert shares["compile"] == 1.0  # samples at 105..108
    assert cpu.share(100.2, 100.9) is None  # no sample inside
    assert shares["cores"] == (len(os.sched_getaffinity(0)) or os.cpu_count())
    read = cpu.read()
    assert read is None or 0 <= read[0] <= read[1]


def test_runs_at_once_is_set_for_the_plan_and_the_value_before_is_given_back(load_bench) -> None:
    """Rule: ``--runs-at-once N`` sets the card device's most runs made at once in the plan's
    process (memadvisor.device.cuda's MAX_CONCURRENT_RUNS, read where the device says its
    capabilities) and hands back the value it had."""
    from memadvisor.device import cuda

    before = cuda.MAX_CONCURRENT_RUNS
    try:
        assert load_bench("plan_speed").set_runs_at_once(before + 3) == before
        assert before + 3 == cuda.MAX_CONCURRENT_RUNS
    finally:
        cuda.MAX_CONCURRENT_RUNS = before


def test_the_least_host_memory_sampled_is_kept(load_bench) -> None:
    """Rule: the sampler keeps the least host memory available it read
    (memadvisor.device.simulated.host_available_bytes; a plan's row says it as
    host_min_available_gib); where the host does not say, there is none."""
    cpu = load_bench("plan_speed").HostCpu(every_s=0.01)
    with cpu:
        time.sleep(0.1)
    from memadvisor.device.simulated import host_available_bytes

    free = host_available_bytes()
    if free is None:
        assert cpu.min_available_bytes is None
    else:
        assert 0 < cpu.min_available_bytes <= free * 2


def test_the_busy_share_counts_the_cores_the_plan_may_run_on(load_bench) -> None:
    """Rule: the jiffies read are those of the cores given (a job pinned by
    ``bench/cards.py --split-cores``: its card's share), summed over their ``cpuN`` lines; no
    cores given, the aggregate line (every core); a core not listed adds nothing."""
    jiffies = load_bench("plan_speed").jiffies
    stat = "\n".join(
        [
            "cpu  60 0 40 300 0 0 0 0 0 0",
            "cpu0 10 0 10 80 0 0 0 0 0 0",
            "cpu1 20 0 10 70 0 0 0 0 0 0",
            "cpu2 30 0 20 50 0 0 0 0 0 0",
            "cpu3 0 0 0 100 0 0 0 0 0 0",
            "intr 12345 0 0",
        ]
    )
    assert jiffies(stat, set()) == (100, 400)
    assert jiffies(stat, {0, 1}) == (50, 200)
    assert jiffies(stat, {2, 3}) == (50, 200)
    assert jiffies(stat, {3}) == (0, 100)
    assert jiffies(stat, {7}) is None
