"""``memadvisor plan`` refuses what cannot work before planning, with exit 2: an output path
that cannot be written (a read-only file system, a folder the user cannot write, a device),
a budget past any machine's, and a sample batch of NaN or infinities (under --quiet too)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.fixtures.other_user import as_nobody, folder_nobody_can_read_only

ROOT = Path(__file__).resolve().parents[2]
FACTORIES = Path(__file__).resolve().parent / "factories.py"


def _error(result) -> str:
    lines = [line for line in result.stderr.strip().splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr and "bug in memadvisor" not in result.stderr
    return lines[-1]


@pytest.mark.parametrize("name", ["nan_batch", "inf_batch"])
@pytest.mark.parametrize("quiet", [False, True])
def test_a_batch_of_nan_or_inf_is_refused_before_planning(
    cli, factory, name: str, quiet: bool
) -> None:
    """A batch that makes every loss NaN exits 2 naming the problem, even under --quiet
    (it used to plan, exit 0, and show only a "passed" numerics check)."""
    args = ["plan", factory(name), "--budget-gb", "0.01", *(["--quiet"] if quiet else [])]
    result = cli(*args)
    assert result.exit_code == 2, (result.stdout, result.stderr)
    line = _error(result)
    assert "sample_batch's tensor #0" in line and ("NaN" in line or "infinite" in line)
    assert result.stdout == ""


def test_a_device_node_as_output_is_written_through(cli, factory, tmp_path) -> None:
    """A private character device, never the machine's /dev/null: memadvisor before this fix
    replaced the node it was given with a regular file (as root, /dev/null itself); now the
    report goes through it and the node stays."""
    node = tmp_path / "null"
    try:
        os.mknod(node, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, AttributeError):
        pytest.skip("making a device node needs root")
    result = cli("plan", factory("mlp"), "--budget-gb", "0.01", "--html", str(node))
    assert result.exit_code == 0, result.stderr
    assert stat.S_ISCHR(os.lstat(node).st_mode)


def _run_cli(prefix: list[str], args: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"}
    t0 = time.perf_counter()
    done = subprocess.run(
        [*prefix, sys.executable, "-m", "memadvisor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    return done, time.perf_counter() - t0


def _cli_args(json_path: str) -> list[str]:
    # slow_mlp: planning it takes tens of seconds, so an exit before planning is plain.
    return ["plan", f"{FACTORIES}:slow_mlp", "--budget-gb", "0.01", "--json", json_path]


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("unshare") is None,
    reason="a read-only bind mount needs root and unshare",
)
def test_json_on_a_read_only_file_system_exits_2_before_planning() -> None:
    """--json into a read-only mount: exit 2 at once with the reason (it used to plan in full
    and then exit 1 as 'a bug in memadvisor')."""
    folder = tempfile.mkdtemp(prefix="memadvisor-ro-")
    try:
        mount = f'mount --bind -o ro {folder} {folder} && exec "$@"'
        probe = subprocess.run(["unshare", "-m", "sh", "-c", mount, "sh", "true"])
        if probe.returncode != 0:
            pytest.skip("this machine does not allow a private read-only bind mount")
        prefix = ["unshare", "-m", "sh", "-c", mount, "sh"]
        done, seconds = _run_cli(prefix, _cli_args(f"{folder}/plan.json"))
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    assert done.returncode == 2, done.stderr[-3000:]
    assert "--json" in done.stderr and "Read-only file system" in done.stderr
    assert "bug in memadvisor" not in done.stderr and "Profiling" not in done.stderr
    assert seconds < 30


def test_json_into_a_folder_the_user_cannot_write_exits_2_before_planning() -> None:
    """As an unprivileged user (nobody, through setpriv), --json into a 0555 folder: exit 2 at
    once, not after the plan."""
    prefix = as_nobody()
    with folder_nobody_can_read_only() as folder:
        done, seconds = _run_cli(prefix, _cli_args(f"{folder}/plan.json"))
    assert done.returncode == 2, done.stderr[-3000:]
    assert "not writable" in done.stderr and "Permission denied" in done.stderr
    assert "Profiling" not in done.stderr
    assert seconds < 30
