"""The turns of runs made at once on one card: no run's timed steps beside another's, and
none beside another's first step (its compile and warm-up).

Why: on the card, a compiled run timed while its siblings compiled measured 7-30% slow
(docs/design.md, "Five things the card showed (session 13)"): the siblings' compiles
take the CPU that launches its kernels, and their warm-up steps share the card. A turn lock
alone kept timed steps apart from each other but not from a sibling still compiling.

One lock file per group of runs (a ``runs`` message), with POSIX record locks
(``fcntl.lockf``) on single bytes of it:

* byte 0, the **turn**: held exclusively through a run's timed steps;
* byte 1, the **gate**: held by the zygote while it forks the group, so no child starts its
  first step before every sibling holds its warming byte;
* byte 2 + i, child i's **warming** byte: held from its fork until its first step ends
  (or its run ends first, by an out-of-memory error or any other).

Before its timed steps a run gives up its warming byte, waits until no sibling holds one,
and then takes the turn (:func:`taking_turn`). Record locks belong to the process: a process
a run forks (a compile worker) holds none of them, and the kernel releases them when the
run's process dies, so a crashed sibling blocks no one.

A second lock file, the **host lock** (its path in the fork server's setup, ``host_lock``),
is the planner's: while the planner compiles in its own process beside runs (the compile
trial beside pass 1), it holds byte 0 of it (:func:`host_busy`), and a run waits until it is
free before its timed steps, made at once or alone (:func:`taking_turn`). Why: the turn
kept timed steps apart from the siblings' compiles (timed beside them, compiled runs measured
7-30% slow on a card, docs/design.md, session 13), but not from the trial compiling in the
planner's process, whose inductor workers take the same cores. (It was built when hf_gpt2's
bf16 candidate measured half its rate in pass 1; with the lock it still did, H200, session
20: that gap has another cause, not found.)

Known limitations:
    * POSIX only (``fcntl``); runs at once exist only where the fork server does; a run in a
      fresh worker process (no fork server) does not wait for the host lock.
    * Record locks are released when the process closes *any* descriptor of the file: a
      child keeps one descriptor for all of them (:data:`_held`), opened once.
    * A run waits for the slowest sibling's compile before its timed steps: the group takes
      as long as its slowest compile plus every run's timed steps.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Gate", "done_warming", "host_busy", "set_host_lock", "start_warming", "taking_turn"]

_TURN = 0
_GATE = 1
_WARMING = 2
_REGISTER_WAIT_S = 10.0  # how long the zygote waits for a child to take its warming byte


@dataclass
class _Held:
    """This process's one descriptor of a group's lock file and its place in the group."""

    path: str
    fd: int
    index: int
    count: int
    warming: bool = True


_held: _Held | None = None  # set in a forked child by start_warming; one group per process
# The planner's host lock (set_host_lock, in the fork server: its children inherit it).
_host_lock: str | None = None


def _lock(fd: int, cmd: int, byte: int) -> None:
    import fcntl

    fcntl.lockf(fd, cmd, 1, byte)


def _is_locked(fd: int, byte: int) -> bool:
    """Whether another process holds ``byte`` exclusively (a shared try fails)."""
    import fcntl

    try:
        _lock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB, byte)
    except OSError:
        return True
    _lock(fd, fcntl.LOCK_UN, byte)
    return False


class Gate:
    """The zygote's side: hold the gate while the group is forked, then open it once every
    child holds its warming byte (or :data:`_REGISTER_WAIT_S` passed: a child that died
    before taking it blocks no one)."""

    def __init__(self, path: str) -> None:
        import fcntl

        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        _lock(self.fd, fcntl.LOCK_EX, _GATE)

    def open(self, indices: Sequence[int]) -> None:
        """Wait until each child of ``indices`` holds its warming byte, then open the gate."""
        deadline = time.monotonic() + _REGISTER_WAIT_S
        for index in indices:
            while not _is_locked(self.fd, _WARMING + index) and time.monotonic() < deadline:
                time.sleep(0.001)
        os.close(self.fd)  # releases the gate (and nothing else: the zygote holds no more)
        self.fd = -1

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def start_warming(path: str, index: int, count: int) -> None:
    """In child ``index`` of ``count``, first thing after the fork: hold its warming byte,
    then wait for the gate (every sibling forked and holding its own)."""
    import fcntl

    global _held
    fd = os.open(path, os.O_RDWR)
    _lock(fd, fcntl.LOCK_EX, _WARMING + index)
    _lock(fd, fcntl.LOCK_SH, _GATE)  # waits until the zygote opens the gate
    _lock(fd, fcntl.LOCK_UN, _GATE)
    _held = _Held(path=path, fd=fd, index=index, count=count)


def done_warming() -> None:
    """Give up this child's warming byte (its first step, or its whole run, is over); a no-op
    where it holds none."""
    import fcntl

    if _held is not None and _held.warming:
        _lock(_held.fd, fcntl.LOCK_UN, _WARMING + _held.index)
        _held.warming = False


def set_host_lock(path: str | None) -> None:
    """In the fork server, from its setup: the planner's host lock, which every run it forks
    waits for before its timed steps (None: none)."""
    global _host_lock
    _host_lock = path


@contextlib.contextmanager
def host_busy(path: str) -> Iterator[None]:
    """The planner's side: hold the host lock ``path`` while the block runs (a compile in the
    planner's own process beside runs), so that no run takes its timed steps meanwhile.
    Released when the block ends, by an error too, and by the kernel if the process dies."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _lock(fd, fcntl.LOCK_EX, 0)
        yield
    finally:
        os.close(fd)  # releases the lock


def _wait_for_host() -> None:
    """Wait until the planner holds no host lock (a no-op where none was set)."""
    if _host_lock is None:
        return
    import fcntl

    try:
        fd = os.open(_host_lock, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return  # its folder is gone (the planner closed the device): nothing to wait for
    try:
        _lock(fd, fcntl.LOCK_SH, 0)
    finally:
        os.close(fd)  # a shared lock taken and given back: the planner's was free


@contextlib.contextmanager
def taking_turn(lock_path: str | None) -> Iterator[None]:
    """Hold the turn of the runs sharing ``lock_path`` while the block runs: after every
    sibling's first step has ended, and with no other run's timed steps beside it. None: no
    turn to take, the block runs at once.

    Waits while a sibling warms up or holds the turn, and while the planner holds the host
    lock (:func:`host_busy`; also for a lone run, ``lock_path`` None). Released when the
    block ends, by an error too, and by the kernel when the process dies holding it. A
    process that did not :func:`start_warming` on this file (a runner called outside a fork
    of the zygote) waits for the turn only.
    """
    if lock_path is None:
        _wait_for_host()
        yield
        return
    import fcntl

    if _held is not None and _held.path == lock_path:
        done_warming()
        for index in range(_held.count):
            if index != _held.index:  # a shared lock waits for the sibling's first step
                _lock(_held.fd, fcntl.LOCK_SH, _WARMING + index)
                _lock(_held.fd, fcntl.LOCK_UN, _WARMING + index)
        _wait_for_host()
        _lock(_held.fd, fcntl.LOCK_EX, _TURN)
        try:
            yield
        finally:
            _lock(_held.fd, fcntl.LOCK_UN, _TURN)
        return
    _wait_for_host()
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        _lock(fd, fcntl.LOCK_EX, _TURN)
        yield
    finally:
        os.close(fd)  # releases the turn
