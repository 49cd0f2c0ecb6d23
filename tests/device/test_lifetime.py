"""Probe processes run no code from the working directory, end with the planner however it
ends, and leave no temp folder behind (memadvisor/device/_lifetime.py).

The CUDA probe path runs on the CPU with the card faked and a CPU runner in the fork server's
children, as in test_cuda.py's CPU test; the simulated ranks are real forked processes. Each
test drives a planner script in a process of its own and signals it as a user (Ctrl-C), a
scheduler (SIGTERM) or the OOM killer (SIGKILL) would.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.fixtures import procs

pytestmark = [
    pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork"),
    pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc"),
]

ROOT = Path(__file__).resolve().parents[2]
RUNNER = Path(__file__).resolve().parent / "zygote_runner.py"
START_TIMEOUT_S = 120.0  # the zygote imports torch: slow on a loaded 2-core machine
GONE_WITHIN_S = 2.0

FAKE_CARD = """
import os, sys, json
from types import SimpleNamespace
import torch
torch.cuda.is_available = lambda: True
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda index: SimpleNamespace(
    name="fake card", total_memory=80 * 2**30
)
from memadvisor.device.cuda import CudaDevice
from memadvisor.schema import Candidate
from memadvisor.workload import Workload
"""


def _env(tmp: Path, **extra: str) -> dict[str, str]:
    # TMPDIR: the planner's temp folders land where this test alone looks.
    return {**os.environ, "PYTHONPATH": str(ROOT), "TMPDIR": str(tmp), **extra}


def _ctrl_c_as_in_a_terminal() -> None:
    """SIGINT's default action in the planner, as a terminal's Ctrl-C finds it. A test run
    started in the background (``cmd &`` in a script) inherits SIGINT ignored, and Python
    then installs no KeyboardInterrupt handler: the signal would do nothing."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _plan_processes(planner: int) -> tuple[list[int], int]:
    """Every process the planner started, its children's children too (read from /proc), and
    among them its janitor: the child run as ``python -I -S`` (memadvisor/device/_lifetime.py)."""
    found = procs.descendants(planner)
    janitors = []
    for pid in procs.children(planner):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1:3] == [b"-I", b"-S"]:
                janitors.append(pid)
    assert len(janitors) == 1, f"not one janitor among the planner's children: {janitors}"
    return found, janitors[0]


def _wait_for(path: Path, process: subprocess.Popen, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and path.read_text():
            return path.read_text()
        if process.poll() is not None:
            raise AssertionError(f"the script ended early: {process.communicate()}")
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"nothing at {path} within {timeout_s} s: {process.communicate()}")


def _gone_within(pids: list[int], folder: Path, timeout_s: float) -> tuple[list[int], list]:
    """The pids still alive and what is left in ``folder`` once both are clear, or at the
    deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = [p for p in pids if procs.alive(p)]
        # Only ours: torch makes its own cache folders (torchinductor_USER) under TMPDIR.
        left = sorted(p.name for p in folder.glob("memadvisor-*"))
        if (not alive and not left) or time.monotonic() > deadline:
            return alive, left
        time.sleep(0.02)


CUDA_SCRIPT = (
    FAKE_CARD
    + """
import torch.nn.functional as F
from torch import nn
torch.manual_seed(0)
workload = Workload(
    model=nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)),
    sample_batch=torch.randn(4, 8),
    loss_fn=F.l1_loss,
)
device = CudaDevice(2**30, runner=sys.argv[1] + ":run", timeout_s=600)
from memadvisor.cli import _exit_now  # imported now: the time after a Ctrl-C is measured
try:
    try:
        device.run(workload, Candidate(batch_size=555), steps=2)  # sleeps until killed
    finally:
        device.close()
except KeyboardInterrupt:
    print("KeyboardInterrupt", file=sys.stderr)
    _exit_now(130)  # as the CLI ends after a Ctrl-C (Python's finalization of torch skipped)
"""
)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_a_signal_to_the_planner_mid_probe_leaves_no_process_and_no_folder(
    tmp_path: Path, signum: int
) -> None:
    """While a fork-server child is probing, SIGINT (Ctrl-C), SIGTERM or SIGKILL to the
    planner: within 2 s of the signal the zygote, its child and the janitor are gone, and so
    is the temp folder with the pickled workload; after a Ctrl-C the planner has exited too,
    as the CLI ends (memadvisor.cli.main: the device closed on the way up, no finalization of
    torch). After a Ctrl-C the zygote used to be asked to exit and given 10 s, while it
    waited for its child."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    started = tmp_path / "started"
    script = tmp_path / "planner.py"
    script.write_text(CUDA_SCRIPT)
    planner = subprocess.Popen(
        [sys.executable, str(script), str(RUNNER)],
        env=_env(tmp, MEMADVISOR_TEST_STARTED=str(started)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=_ctrl_c_as_in_a_terminal,
    )
    child = int(_wait_for(started, planner, START_TIMEOUT_S))
    zygote = procs.ppid(child)
    assert zygote != planner.pid and procs.ppid(zygote) == planner.pid
    assert [p.name[:16] for p in tmp.glob("memadvisor-*")] == ["memadvisor-cuda-"]
    processes, janitor = _plan_processes(planner.pid)
    assert {child, zygote, janitor} <= set(processes)
    signalled = time.monotonic()
    os.kill(planner.pid, signum)
    alive, left = _gone_within(processes, tmp, GONE_WITHIN_S)
    if signum == signal.SIGINT:
        with contextlib.suppress(subprocess.TimeoutExpired):
            planner.wait(timeout=max(0.0, signalled + GONE_WITHIN_S - time.monotonic()))
        exit_s = time.monotonic() - signalled
    planner.kill()  # a no-op once it has ended
    _, stderr = planner.communicate(timeout=60)
    assert alive == [] and left == []
    if signum == signal.SIGINT:  # the KeyboardInterrupt ended it, through the device's close
        assert exit_s < GONE_WITHIN_S, f"exited {exit_s:.2f} s after the Ctrl-C: {stderr[-3000:]}"
        assert planner.returncode == 130 and b"KeyboardInterrupt" in stderr, stderr[-3000:]


RANKS_SCRIPT = """
import os, sys, time
import torch
from torch import nn
from memadvisor.device.ranks import Ranks
from memadvisor.schema import Candidate
from memadvisor.workload import Workload

def slow_loss(out, batch):
    with open(os.path.join(os.environ["MEMADVISOR_TEST_STARTED"], str(os.getpid())), "w"):
        pass
    time.sleep(600)
    return out.sum()

workload = Workload(model=nn.Linear(4, 4), sample_batch=torch.randn(2, 4), loss_fn=slow_loss)
ddp = {"parallel": {"kind": "ddp", "world_size": 2}}
Ranks(2**30, 2, backend="simulated").run(workload, Candidate(batch_size=2, choices=ddp), steps=2)
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_killing_the_planner_ends_its_simulated_ranks_and_removes_their_folder(
    tmp_path: Path, signum: int
) -> None:
    """Two forked ranks mid-step: SIGTERM or SIGKILL to the planner ends both, and the janitor,
    within 2 s, and the ranks' rendezvous folder is gone (it stayed in /tmp, the ranks ran
    on)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    started = tmp_path / "started"
    started.mkdir()
    script = tmp_path / "planner.py"
    script.write_text(RANKS_SCRIPT)
    planner = subprocess.Popen(
        [sys.executable, str(script)],
        env=_env(tmp, MEMADVISOR_TEST_STARTED=str(started)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + START_TIMEOUT_S
    while len(list(started.iterdir())) < 2 and time.monotonic() < deadline:
        assert planner.poll() is None, planner.communicate()
        time.sleep(0.1)
    ranks = [int(p.name) for p in started.iterdir()]
    assert len(ranks) == 2 and all(procs.ppid(r) == planner.pid for r in ranks)
    assert [p.name[:17] for p in tmp.glob("memadvisor-*")] == ["memadvisor-ranks-"]
    processes, janitor = _plan_processes(planner.pid)
    assert {*ranks, janitor} <= set(processes)
    os.kill(planner.pid, signum)
    alive, left = _gone_within(processes, tmp, GONE_WITHIN_S)
    planner.kill()
    planner.communicate()
    assert alive == [] and left == []


ISOLATION_SCRIPT = (
    FAKE_CARD
    + """
sys.path.append("")  # as a notebook or `python -c` has it: modules are found in the cwd
import user_losses  # a module of the user's, in the working directory

torch.manual_seed(0)
workload = Workload(
    model=torch.nn.Linear(8, 4), sample_batch=torch.randn(4, 8), loss_fn=user_losses.loss
)
device = CudaDevice(2**30, runner=sys.argv[1] + ":run", timeout_s=120)
try:
    measured = device.run(workload, Candidate(batch_size=3), steps=2)
finally:
    device.close()
print("ANSWER " + json.dumps({"mode": device.mode, "notes": device.notes, "steps": measured.steps}))
"""
)

PLANTED = """
# Planted in a shared folder: runs whatever it likes when a probe process imports it, then
# behaves as the real module so nothing looks amiss.
import os, sysconfig
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "PLANTED_CODE_RAN"), "w").close()
exec(open(os.path.join(sysconfig.get_paths()["stdlib"], "selectors.py")).read())
"""


def test_a_module_planted_in_the_working_directory_does_not_run_in_the_probe_server(
    tmp_path: Path,
) -> None:
    """A selectors.py in the working directory is not imported by the probe server (it was:
    the server ran as ``python -m`` there), while the user's own module in that folder, which
    the workload's loss comes from by name, still loads there: the run is served by the fork
    server, not by the in-process fallback."""
    shared = tmp_path / "shared"
    shared.mkdir()
    (shared / "selectors.py").write_text(PLANTED)
    (shared / "user_losses.py").write_text(
        "def loss(out, batch):\n    return out.square().mean()\n"
    )
    script = tmp_path / "planner.py"
    script.write_text(ISOLATION_SCRIPT)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    done = subprocess.run(
        [sys.executable, str(script), str(RUNNER)],
        cwd=shared,
        env=_env(tmp),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not (shared / "PLANTED_CODE_RAN").exists()
    line = next(x for x in done.stdout.splitlines() if x.startswith("ANSWER "))
    assert textwrap.shorten(line, 400).startswith('ANSWER {"mode": "fork_server", "notes": []')
    assert list(tmp.glob("memadvisor-*")) == []
