"""How fast a planner mid-probe ends, and what it leaves, after SIGINT, SIGTERM or SIGKILL.

The CUDA probe path on the CPU (the card faked, the fork server's child running
tests/device/zygote_runner.py's sleeping batch), as tests/device/test_lifetime.py drives it.
Prints, per signal: seconds from the signal until the zygote and its child were gone, until
the planner script exited (a plain script: it finalizes torch, which the CLI skips after a
Ctrl-C), and whether the temp folder (the pickled workload) was still there 5 s
later.

    python bench/probe_exit.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "device" / "zygote_runner.py"
SCRIPT = """
import sys
from types import SimpleNamespace
import torch
import torch.nn.functional as F
from torch import nn
torch.cuda.is_available = lambda: True
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda i: SimpleNamespace(name="fake", total_memory=80 * 2**30)
from memadvisor.device.cuda import CudaDevice
from memadvisor.schema import Candidate
from memadvisor.workload import Workload
workload = Workload(model=nn.Linear(8, 4), sample_batch=torch.randn(4, 8), loss_fn=F.l1_loss)
device = CudaDevice(2**30, runner=sys.argv[1] + ":run", timeout_s=600)
try:
    device.run(workload, Candidate(batch_size=555), steps=2)
finally:
    device.close()
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def once(signum: int) -> tuple[float, float, bool]:
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
            # SIGINT's default action, as a terminal's Ctrl-C finds it (a bench started with
            # `cmd &` inherits SIGINT ignored, and Python then installs no handler for it).
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        while not (started.exists() and started.read_text()):
            time.sleep(0.05)
        child = int(started.read_text())
        zygote = int(Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()[1])
        t0 = time.monotonic()
        os.kill(planner.pid, signum)
        while (_alive(child) or _alive(zygote)) and time.monotonic() - t0 < 30:
            time.sleep(0.01)
        gone = time.monotonic() - t0
        planner.wait()
        exited = time.monotonic() - t0
        time.sleep(max(0.0, 5 - gone))
        left = any(tmp.glob("memadvisor-*"))
        for pid in (child, zygote):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        return exited, gone, left


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGKILL):
        for _ in range(args.repeat):
            exited, gone, left = once(signum)
            print(
                f"{signal.Signals(signum).name}: probe processes gone {gone:.2f} s, planner "
                f"exited {exited:.2f} s, temp folder left after 5 s: {left}",
                flush=True,
            )


if __name__ == "__main__":
    main()
