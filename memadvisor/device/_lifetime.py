"""Probe processes and their files live no longer than the process that planned.

Three rules, each for a way the user's machine was left worse off:

* **Started isolated from the working directory.** ``python -m pkg.module`` puts the
  working directory first on ``sys.path``, so a ``selectors.py`` someone left in a shared
  folder ran inside the probe server. :func:`python_command` starts a module through a
  bootstrap run with ``-c`` that removes that entry before importing anything (``-P`` does
  the same, but only from Python 3.11). The parent's own ``sys.path`` still reaches the child
  (the device's setup sends it, each entry made absolute, ``''`` as the working directory)
  and is *appended*, after the standard library and site-packages: a module the workload
  pickles by reference (``my_model.Net``, imported by name from the working directory) is
  still found, and nothing there can shadow a module of Python's or of an installed package.
* **They die with their parent.** :func:`die_with_parent` asks Linux for ``SIGKILL`` when the
  parent dies (``prctl(PR_SET_PDEATHSIG)``), and exits at once if the parent is already gone
  (the race before the call). SIGTERM or SIGKILL to the planner, or its crash, then ends the
  probe server, its forked child and the ranks within milliseconds, instead of leaving them
  training for up to the probe timeout (600 s) under PID 1. Elsewhere the probe server also
  polls its parent's pid (:func:`parent_is_gone`).
* **Their files go with them.** :func:`private_dir` makes a folder with ``mkdtemp`` (mode
  0700) and hands its path to a *janitor*: one small process per planning process, started
  with ``python -I -S`` in its own session (a Ctrl-C in the terminal does not reach it),
  whose only job is to read its stdin until end-of-file and then remove every folder still
  registered. The parent holds the only write end of that pipe, so however the parent ends
  (a normal exit, an exception, SIGTERM, SIGKILL, a segfault) the pipe closes and the
  folders go: the saved workload (a pickle of the user's model and code) and the ranks'
  rendezvous store never outlive the plan.

Known limitations:
    * ``PR_SET_PDEATHSIG`` fires when the *thread* that started the child ends: a device
      used from a thread that exits before the device is closed loses its probe server.
      The planner starts and closes its devices in one thread.
    * A process the parent forked without exec (a DataLoader worker, a forked rank) holds
      the janitor's pipe too, so the folders go once those have ended as well (forked ranks
      die with their parent).
    * The parent's ``PYTHONPATH`` still comes first in the child, as it does in the parent.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ctypes.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import IO

__all__ = [
    "PARENT_PID_VARIABLE",
    "absolute_sys_path",
    "die_with_parent",
    "parent_is_gone",
    "private_dir",
    "probe_env",
    "python_command",
    "remove_private_dir",
]

#: The environment variable a probe process reads its parent's pid from.
PARENT_PID_VARIABLE = "MEMADVISOR_PARENT_PID"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h

# Runs as ``python -c``: drops the working directory ('' first on sys.path) before any import,
# then runs the module named by argv[1] as __main__ with the rest of the arguments.
_BOOTSTRAP = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "sys.argv = sys.argv[1:]\n"
    "import runpy\n"
    "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)\n"
)

# The janitor: reads '+path' / '-path' lines (JSON strings) until end-of-file, then removes
# the folders still registered. Signals from the terminal do not reach it (its own session).
_JANITOR = (
    "import json, shutil, sys\n"
    "paths = set()\n"
    "for line in sys.stdin:\n"
    "    op, path = line[:1], json.loads(line[1:])\n"
    "    (paths.add if op == '+' else paths.discard)(path)\n"
    "for path in paths:\n"
    "    shutil.rmtree(path, ignore_errors=True)\n"
)


def python_command(module: str, *args: str) -> list[str]:
    """The command that runs ``module`` as ``python -m`` would, without the working
    directory on ``sys.path`` (the module docstring)."""
    flags = ["-s"] if sys.flags.no_user_site else []
    return [sys.executable, *flags, "-c", _BOOTSTRAP, module, *args]


def probe_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a probe process: this one's, with this process's pid for
    :func:`die_with_parent`, and this very memadvisor's folder last on ``PYTHONPATH`` (the
    working directory no longer supplies it, and a user's own entries stay first)."""
    env = {**os.environ, PARENT_PID_VARIABLE: str(os.getpid()), **(extra or {})}
    root = str(Path(__file__).resolve().parents[2])
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join([*paths, root] if root not in paths else paths)
    return env


def absolute_sys_path() -> list[str]:
    """This process's ``sys.path`` for a child to append: every entry absolute (``''`` is the
    working directory, where this process finds a module imported by name from it)."""
    out: list[str] = []
    for entry in sys.path:
        path = os.path.abspath(entry or os.curdir)
        if path not in out:
            out.append(path)
    return out


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux), and exit now if it
    has died already. ``parent_pid``: the parent's pid as the parent knew it (default:
    :data:`PARENT_PID_VARIABLE`); without one only the signal is asked for."""
    if parent_pid is None:
        with contextlib.suppress(KeyError, ValueError):
            parent_pid = int(os.environ[PARENT_PID_VARIABLE])
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the signal was asked for


def parent_is_gone(parent_pid: int | None) -> bool:
    """Whether the process that started this one has ended (this one was re-parented)."""
    return parent_pid is not None and os.getppid() != parent_pid


# -- private folders and their janitor ---------------------------------------------------------


class _Janitor:
    """The parent's handle on the janitor process (one per process, started on first use)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.process: subprocess.Popen[str] | None = None
        self.pid = 0  # the process that started it (a forked child starts its own)

    def tell(self, op: str, path: Path) -> None:
        with self.lock:
            # A folder removed with no janitor running (at exit, after it stopped) needs none.
            pipe = self._pipe(start=op == "+")
            if pipe is None:
                return
            with contextlib.suppress(OSError, ValueError):
                pipe.write(op + json.dumps(str(path)) + "\n")
                pipe.flush()

    def _pipe(self, start: bool) -> IO[str] | None:
        if self.process is None or self.pid != os.getpid() or self.process.poll() is not None:
            if not start:
                return None
            try:
                self.process = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _JANITOR],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    text=True,
                    start_new_session=True,  # a Ctrl-C in the terminal is not its to get
                    cwd="/",
                )
            except OSError:
                self.process = None  # the folders are then removed by the parent alone
                return None
            self.pid = os.getpid()
        return self.process.stdin

    def stop(self) -> None:
        """At this process's exit: end the janitor (it removes what is still registered)."""
        process = self.process
        if process is None or self.pid != os.getpid():
            return
        with contextlib.suppress(OSError, ValueError):
            process.stdin.close()  # type: ignore[union-attr]
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=5)


_janitor = _Janitor()
atexit.register(_janitor.stop)


def _forget_janitor_in_child() -> None:
    # A forked child writes nothing to its parent's janitor: it starts its own if it makes a
    # folder. The inherited handle is kept (not closed, not collected) so that its file
    # descriptor is never closed twice; the child holds that pipe until it exits.
    if _janitor.process is not None:
        _inherited.append(_janitor.process)
    _janitor.lock = threading.Lock()
    _janitor.process = None


_inherited: list[subprocess.Popen[str]] = []
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_janitor_in_child)


def private_dir(prefix: str) -> Path:
    """A new folder (mode 0700) that is removed however this process ends.

    Remove it with :func:`remove_private_dir` when done; if this process dies first, the
    janitor removes it.
    """
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _janitor.tell("+", path)
    return path


def remove_private_dir(path: Path) -> None:
    """Remove a :func:`private_dir` folder now, and tell the janitor it is gone."""
    shutil.rmtree(path, ignore_errors=True)
    _janitor.tell("-", path)
