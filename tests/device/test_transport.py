"""What users write reaches fresh probe processes: cloudpickle sends lambdas and ``__main__``
classes by value; only what nothing can send falls back to this process, said first.

The card is faked (its properties, a CPU runner in the fork server's children), as in
``test_cuda.py``'s CPU test of the fork-server path.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from memadvisor.device.cuda import IN_PROCESS_NOTE_START, CudaDevice
from memadvisor.planner._notes import fallbacks_first as _fallbacks_first
from memadvisor.workload import Workload

GIB = 2**30
RUNNER = Path(__file__).resolve().parent / "zygote_runner.py"
ROOT = Path(__file__).resolve().parents[2]

# A user's training script: the model class and the loss live in __main__ (the loss a
# lambda over a closure), and nothing names a target file.
SCRIPT = """
import json, os, sys
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

torch.cuda.is_available = lambda: True
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_properties = lambda index: SimpleNamespace(
    name="fake card", total_memory=80 * 2**30
)

from memadvisor.device.cuda import CudaDevice
from memadvisor.schema import Candidate
from memadvisor.workload import Workload


class ScriptModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))

    def forward(self, x):
        return self.body(x)


scale = 0.5
workload = Workload(
    model=ScriptModel(),
    sample_batch=(torch.randn(4, 8), torch.randint(0, 4, (4,))),
    loss_fn=lambda out, batch: scale * F.cross_entropy(out, batch[1]),
)
device = CudaDevice(2**30, runner=sys.argv[1] + ":run", timeout_s=120)
try:
    measured = device.run(workload, Candidate(batch_size=3), steps=2)
finally:
    device.close()
print("ANSWER " + json.dumps({
    "mode": device.mode,
    "notes": device.notes,
    "child_pid": measured.peak_bytes,  # the CPU runner reports its pid there
    "script_pid": os.getpid(),
    "steps": measured.steps,
}))
"""


def test_a_lambda_loss_and_a_main_class_reach_a_fresh_probe_process(tmp_path: Path) -> None:
    """A script run as __main__ with its own model class and a lambda loss: the run happens
    in a forked child of the fork server (another pid), with no fallback note."""
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(SCRIPT))
    done = subprocess.run(
        [sys.executable, str(script), str(RUNNER)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**_env(), "PYTHONPATH": str(ROOT)},
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("ANSWER ")]
    assert lines, done.stderr[-3000:]
    answer = json.loads(lines[-1].removeprefix("ANSWER "))
    assert answer["mode"] == "fork_server" and answer["notes"] == []
    assert answer["steps"] == 2
    assert answer["child_pid"] != answer["script_pid"]


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def test_only_what_nothing_can_send_runs_here_and_the_note_says_so_first(monkeypatch) -> None:
    """A loss closing over a lock cannot be sent even by cloudpickle: the device falls back to
    this process, its note begins the plan's notes, and nothing else is reordered."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    card = SimpleNamespace(name="fake card", total_memory=80 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    lock = threading.Lock()

    def loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        with lock:
            return out.square().mean()

    workload = Workload(model=nn.Linear(2, 2), sample_batch=torch.randn(2, 2), loss_fn=loss)
    device = CudaDevice(GIB)
    try:
        device._save_workload(workload)
    finally:
        device.close()
    assert device.mode == "in_process"
    assert len(device.notes) == 1 and device.notes[0].startswith(IN_PROCESS_NOTE_START)
    assert "lock" in device.notes[0]
    notes = ["The pick's batch took 2 device runs.", *device.notes, "Compiled: 1.5x."]
    assert _fallbacks_first(notes) == [device.notes[0], notes[0], notes[2]]
