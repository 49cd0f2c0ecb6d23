"""How fast a planner ends, and what it leaves, after SIGINT, SIGTERM or SIGKILL.

Two planners:

* the CUDA probe path on the CPU (the card faked, the fork server's child running
  tests/device/zygote_runner.py's sleeping batch), as tests/device/test_lifetime.py drives
  it; after a Ctrl-C the script ends as the CLI does (``memadvisor.cli._exit_now``: the
  device closed on the way up, exit handlers run, no finalization of torch);
* ``memadvisor plan`` itself on the simulated device (tests/cli/factories.py:slow_mlp),
  Ctrl-C at a random moment 0.2 to 3 s into planning, as tests/cli/test_interrupt.py does.

Prints, per run: seconds from the signal until the plan's processes (the zygote, its child
and the janitor) were gone, until the planner exited, and whether the temp folder (the
pickled workload) was still there 5 s later (``--linger-s``); then each row's median and
largest time.
``--busy N`` runs N processes spinning on the CPU meanwhile: a loaded CI machine.

    python bench/probe_exit.py [--repeat 3] [--busy 0]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "device" / "zygote_runner.py"
FACTORIES = ROOT / "tests" / "cli" / "factories.py"
sys.path.insert(0, str(ROOT))  # tests.fixtures

from tests.fixtures.procs import alive, children  # noqa: E402

SCRIPT = """
import sys
from types import SimpleNamespace
import torch
import torch.nn.functional as F
from torch import nn
torch.cuda.is_available = lambda: True
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda i: SimpleNamespace(name="fake", total_memory=80 * 2**30)
from memadvisor.cli import _exit_now
from memadvisor.device.cuda import CudaDevice
from memadvisor.schema import Candidate
from memadvisor.workload import Workload
workload = Workload(model=nn.Linear(8, 4), sample_batch=torch.randn(4, 8), loss_fn=F.l1_loss)
device = CudaDevice(2**30, runner=sys.argv[1] + ":run", timeout_s=600)
try:
    try:
        device.run(workload, Candidate(batch_size=555), steps=2)
    finally:
        device.close()
except KeyboardInterrupt:
    _exit_now(130)
"""


def _sigint_default() -> None:
    # SIGINT's default action, as a terminal's Ctrl-C finds it (a bench started with `cmd &`
    # inherits SIGINT ignored, and Python then installs no handler for it).
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def probe(signum: int, linger_s: float) -> tuple[float, float, bool]:
    """The faked-card planner mid-probe: (exited, processes gone, folder left after
    ``linger_s``)."""
    with tempfile.TemporaryDirectory() as work:
        tmp, started = Path(work, "tmp"), Path(work, "started")
        tmp.mkdir()
        script = Path(work, "planner.py")
        script.write_text(SCRIPT)
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "TMPDIR": str(tmp),
            "MEMADVISOR_TEST_STARTED": str(started),
        }
        planner = subprocess.Popen(
            [sys.executable, str(script), str(RUNNER)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_sigint_default,
        )
        while not (started.exists() and started.read_text()):
            time.sleep(0.05)
        child = int(started.read_text())
        processes = [child, *children(planner.pid)]  # the zygote and the janitor
        t0 = time.monotonic()
        os.kill(planner.pid, signum)
        exited = None
        while time.monotonic() - t0 < 30:
            if exited is None and planner.poll() is not None:
                exited = time.monotonic() - t0
            if not any(alive(p) for p in processes) and exited is not None:
                break
            time.sleep(0.01)
        gone = time.monotonic() - t0
        if exited is None:
            planner.kill()
            planner.wait()
            exited = time.monotonic() - t0
        time.sleep(max(0.0, linger_s - gone))
        left = any(tmp.glob("memadvisor-*"))
        for pid in processes:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        return exited, gone, left


def cli() -> float:
    """``memadvisor plan`` on the simulated device, Ctrl-C mid-plan: seconds to its exit."""
    with tempfile.TemporaryDirectory() as work:
        stderr_path = Path(work, "stderr.txt")
        with stderr_path.open("w") as stderr:
            planner = subprocess.Popen(
                [sys.executable, "-m", "memadvisor", "plan", f"{FACTORIES}:slow_mlp",
                 "--budget-gb", "0.05", "--json", str(Path(work, "plan.json"))],
                stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True,
                env={**os.environ, "PYTHONPATH": str(ROOT), "COLUMNS": "200"},
                preexec_fn=_sigint_default,
            )  # fmt: skip
        while "simulated" not in stderr_path.read_text() and planner.poll() is None:
            time.sleep(0.05)
        time.sleep(random.uniform(0.2, 3.0))
        t0 = time.monotonic()
        os.kill(planner.pid, signal.SIGINT)
        planner.wait()
        return time.monotonic() - t0


@contextmanager
def busy(count: int) -> Iterator[None]:
    """``count`` processes spinning on the CPU while the block runs."""
    spin = "while True: pass"
    spinners = [subprocess.Popen([sys.executable, "-c", spin]) for _ in range(count)]
    try:
        yield
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="CPU-spinning processes meanwhile")
    parser.add_argument(
        "--linger-s", type=float, default=5.0, help="when to look for the temp folder after"
    )
    args = parser.parse_args()
    exits: dict[str, list[float]] = {}
    print(f"load average {os.getloadavg()[0]:.1f}, {args.busy} spinning", flush=True)
    with busy(args.busy):
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
            name = signal.Signals(signum).name
            for _ in range(args.repeat):
                exited, gone, left = probe(signum, args.linger_s)
                exits.setdefault(f"fake card, {name}", []).append(exited)
                print(
                    f"fake card, {name}: probe processes and janitor gone {gone:.2f} s, "
                    f"planner exited {exited:.2f} s, "
                    f"temp folder left after {args.linger_s:g} s: {left}",
                    flush=True,
                )
        for _ in range(args.repeat):
            exited = cli()
            exits.setdefault("memadvisor plan (simulated), SIGINT", []).append(exited)
            print(f"memadvisor plan (simulated), SIGINT: exited {exited:.2f} s", flush=True)
    for row, times in exits.items():
        print(f"{row}: exit median {statistics.median(times):.2f} s, max {max(times):.2f} s")
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()
