"""A fork server for device runs: ``python -m memadvisor.device._zygote``.

Why: a fresh process per run pays starting Python, importing torch, memadvisor and their
dependencies and building the model, of which the run itself is a small part. This process,
the zygote, pays the imports and the model build once; each run is then a ``fork()`` of it,
about half the wall time per run, with the same peak and step time as a fresh process
(``docs/design.md``, "A clean state per run", has the numbers).

Clean state: every run is a fresh child of a process that never touched CUDA. The zygote
imports torch and builds the workload on the CPU only: it never initializes CUDA (not even
``torch.cuda.is_available()``, which starts the driver; its environment sets
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` so a library that asks gets NVML's answer instead), and
never runs a backward (autograd's first backward asks the driver for its devices and starts
threads a forked child does not have). The
child creates its own CUDA context and caching allocator, caps them at the budget, trains,
answers and exits; nothing it allocated, fragmented or leaked outlives it, and the zygote's
own objects are the child's copy-on-write pages, untouched by the run.

The zygote builds with one intra-op thread and each child restores the original count: a
child forked after OpenMP started its thread pool waits forever on the parent's threads in
its first parallel CPU op (measured here: a forked ``exp`` of 10^7 floats hung), while one
forked from a process that ran OpenMP single-threaded starts a pool of its own.

Protocol (JSON, one object per line; the zygote's answers are prefixed with
:data:`ANSWER_MARKER` on its own channel, stdout, while anything the model prints goes to
stderr):

* parent -> zygote, stdin: ``{"setup": {...}}`` once (the worker's request fields: target
  or saved workload, target files, sys.path, profile path, strategies, budget, device
  index, and optionally ``runner``), then ``{"run": {"id", "candidate", "steps"}}`` per
  run (optionally with ``retry_at``: a smaller batch to train in the same child where the
  candidate's runs out, :attr:`RunContext.retry_at`), or ``{"runs": [run, run, ...]}`` (each
  such a run) for runs made at once, and
  ``{"exit": true}`` or end-of-file to stop (``exit``: at once, without the interpreter's
  orderly teardown, which nothing needs and a plan's close waited for: :func:`_exit_now`).
  A run may carry ``profile_path``: the zygote
  loads that profile once, for this run and the next (a zygote started before the plan's
  profile existed, :meth:`ForkServer.spawn`).
* zygote -> parent: ``{"status": "ready"}`` (or ``unloadable`` / ``error`` as the worker
  answers) after setup (then, where ``memadvisor.strategy.RUNS_COMPILE_VARIABLE`` is set,
  it imports inductor's compiler before reading the next message), then one answer per run,
  in order, with its ``id``: ``ok``, ``oom`` and ``error`` as
  :mod:`memadvisor.device._worker` answers; ``crashed`` (the child died
  without answering: a signal, or an exit of its own); ``unforkable`` (CUDA could not start
  in a forked child; the parent falls back to fresh processes). A ``runs`` message is
  answered as its runs would be one by one: one line per run, in the order given.

Runs made at once: for a ``runs`` message the zygote forks a child per run, all before
collecting any (their starts, first steps and compiles overlap), makes one lock file for
them and gives each child its path as the run's ``turn_lock``
(:attr:`RunContext.turn_lock`), with its place in the group. The zygote holds the children
at a gate until each has marked itself warming up (:mod:`memadvisor.device._turns`); the
runner takes the turn after its first step and holds it through its timed steps
(:func:`memadvisor.device._turns.taking_turn`), which waits until no sibling is still in its
first step and none holds the turn, so their timed steps come in turn and apart from the
siblings' compiles. A single ``run`` has no lock. The zygote removes the file once every
child of the message is collected. Where the setup names a ``host_lock`` (the planner's:
held while it compiles in its own process beside runs), every run, at once or alone, also
waits for it before its timed steps (:func:`memadvisor.device._turns.host_busy`).

A run's work is a *runner* ``f(workload, candidate, steps, context) -> Measurement``: by
default :func:`cuda_runner`; ``setup["runner"]`` (``"file.py:function"``) names another,
which is how the CPU tests drive the protocol without a card. A runner passes
``context.turn_lock`` on to ``train_candidate`` (or takes the turn itself with
``taking_turn``) before its timed steps; None for a single run.

Known limitations:
    * Needs ``os.fork`` (Linux, macOS); elsewhere CudaDevice starts a fresh process per run.
    * A workload whose factory initializes CUDA (moves the model to the card, or calls
      ``torch.cuda.init()``) or runs a backward cannot be forked: the first child answers
      ``unforkable`` and the device falls back to a fresh process per run.
    * A thread the factory started does not exist in the children.
    * Runs made at once share the card: the parent asks for no more than it has room for
      (``CudaDevice.capabilities.concurrent_runs``), each capped at the budget; another
      child's teardown may overlap a run's timed steps (``_train``'s limitations).
    * A zygote killed while a ``runs`` message is in flight leaves its (empty) lock file in
      the temporary directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NoReturn

from memadvisor.device import _turns
from memadvisor.device._lifetime import (
    PARENT_PID_VARIABLE,
    die_with_parent,
    parent_is_gone,
    probe_env,
    python_command,
)
from memadvisor.strategy import RUNS_COMPILE_VARIABLE

__all__ = [
    "ANSWER_MARKER",
    "ForkServer",
    "RunContext",
    "Unforkable",
    "ZygoteDied",
    "cuda_runner",
]

ANSWER_MARKER = "MEMADVISOR_ZYGOTE "  # prefixes each answer line on the zygote's stdout
_CLOSE_WAIT_S = 10.0  # a zygote told to exit gets this long before it is killed
_EXIT_POLL_S = 1.0  # how often the zygote checks whether a silent child has exited
# torch's error in a child forked after autograd started its device threads (a factory that
# ran a backward): such a zygote cannot serve, fresh processes can.
_FORKED_AUTOGRAD = "autograd's threading in combination with fork"


class Unforkable(RuntimeError):
    """CUDA could not start in a forked child (the zygote touched CUDA, or the platform)."""


class ZygoteDied(RuntimeError):
    """The zygote exited or closed its answers before answering."""


@dataclass
class RunContext:
    """What every run of one zygote shares besides the workload."""

    budget_bytes: int
    device_index: int
    profile: Any = None  # memadvisor.profiler.Profile, loaded once in the zygote
    strategies: Any = None  # loaded strategy instances (None: the runner loads them)
    strategy_names: list[str] | None = None
    intra_op_threads: int = 1  # what the children restore (the zygote runs with one)
    # The lock file of the runs forked with this one (a "runs" message), taken for the timed
    # steps; set in the child only (its private copy), None for a single run.
    turn_lock: str | None = None
    # The run's smaller batch to train in the same process where its own runs out
    # (train_candidate's retry_at); set in the child only, from the run's "retry_at".
    retry_at: int | None = None


# -- the child's work -----------------------------------------------------------------------


def cuda_runner(workload: Any, candidate: Any, steps: int, context: RunContext) -> Any:
    """Cap a new CUDA context at the budget and train ``candidate`` (the default runner).

    Raises:
        Unforkable: CUDA did not start in this forked child.
        torch.OutOfMemoryError: (or another error ``is_oom`` accepts) when it does not fit.
    """
    import torch

    from memadvisor.device._train import train_candidate

    index = context.device_index
    try:
        torch.cuda.set_device(index)
        total = torch.cuda.get_device_properties(index).total_memory
        # Before the first allocation: the cap holds for everything this child reserves.
        torch.cuda.set_per_process_memory_fraction(min(1.0, context.budget_bytes / total), index)
        torch.cuda.init()
    except Exception as e:  # noqa: BLE001 - any failure to start CUDA here means "do not fork"
        raise Unforkable(f"{type(e).__name__}: {e}") from e
    return train_candidate(
        workload,
        candidate,
        steps,
        device=torch.device("cuda", index),
        strategy_names=context.strategy_names,
        strategies=context.strategies,
        profile=context.profile,
        copy_model=False,  # this child owns its copy-on-write copy of the model
        turn_lock=context.turn_lock,
        retry_at=context.retry_at,
    )


def _error_answer(e: BaseException) -> dict[str, Any]:
    from memadvisor.errors import BadInputError, is_oom, retry_ran_out

    if isinstance(e, Unforkable) or _FORKED_AUTOGRAD in str(e):
        return {"status": "unforkable", "message": str(e)}
    if isinstance(e, Exception) and is_oom(e):
        text = str(e).strip()
        answer: dict[str, Any] = {
            "status": "oom",
            "message": text.splitlines()[0] if text else type(e).__name__,
            "steps_completed": int(getattr(e, "memadvisor_steps_completed", 0)),
        }
        retried = retry_ran_out(e)
        if retried is not None:  # the retry ran out too (train_candidate's, in this child)
            answer["retry_ran_out"], answer["retry_same_process"] = retried
        return answer
    return {
        "status": "error",
        "type": type(e).__name__,
        "bad_input": isinstance(e, BadInputError),
        "message": str(e),
        "traceback": traceback.format_exc(),
    }


def _child(
    state: _State,
    run: dict[str, Any],
    answer_fd: int,
    zygote_pid: int,
    siblings: Sequence[int] = (),
) -> None:
    """In the forked child: run, write the answer to ``answer_fd``, and exit without cleanup.

    ``siblings``: the zygote's read ends of the answer pipes of children forked before this
    one (the same ``runs`` message): theirs to read, closed here.
    """
    status = 1
    try:
        die_with_parent(zygote_pid)  # a fork does not inherit the zygote's parent-death signal
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)  # the requests are the zygote's to read
        os.close(state.answers.fileno())  # and the answers its to write
        for fd in siblings:
            os.close(fd)
        state.context.turn_lock = run.get("turn_lock")  # this child's copy of the context
        state.context.retry_at = run.get("retry_at")
        if state.context.turn_lock is not None:
            _turns.start_warming(
                state.context.turn_lock, int(run["turn_index"]), int(run["turn_count"])
            )
        import torch

        from memadvisor.schema.candidate import Candidate

        torch.set_num_threads(state.context.intra_op_threads)
        candidate = Candidate.model_validate(run["candidate"])
        try:
            measured = state.runner(state.workload, candidate, int(run["steps"]), state.context)
            answer = {"status": "ok", "measurement": measured.model_dump(mode="json")}
        except BaseException as e:  # noqa: BLE001 - every outcome goes back as an answer
            answer = _error_answer(e)
        if state.context.turn_lock is not None:
            # Before the answer's write, which may wait on the zygote reading a sibling first.
            _turns.done_warming()
        data = json.dumps(answer).encode()
        while data:
            data = data[os.write(answer_fd, data) :]
        status = 0
    finally:
        # No atexit handlers, no flushing of the zygote's buffers a second time.
        os._exit(status)


# -- the zygote ----------------------------------------------------------------------------


@dataclass
class _State:
    workload: Any
    runner: Any
    context: RunContext
    answers: IO[str]
    parent_pid: int | None = None  # the planner that started this zygote
    profile_path: str | None = None  # the profile the context holds (setup's or a run's)


def _say(out: IO[str], answer: dict[str, Any]) -> None:
    out.write(ANSWER_MARKER + json.dumps(answer) + "\n")
    out.flush()


def _setup(setup: dict[str, Any], answers: IO[str]) -> _State | None:
    """Import, load the workload and strategies without CUDA; None when it cannot serve."""
    for p in setup.get("sys_path", []):
        if p not in sys.path:
            sys.path.append(p)  # the parent's imports (a user's package), never shadowing ours
    import torch

    from memadvisor.device._worker import _load_workload

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # no OpenMP pool before a fork (module docstring)
    try:
        workload = _load_workload(setup)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which falls back
        if setup.get("target"):
            _say(answers, _error_answer(e))
        else:
            _say(answers, {"status": "unloadable", "message": f"{type(e).__name__}: {e}"})
        return None
    _turns.set_host_lock(setup.get("host_lock"))  # the children inherit it
    try:
        context, runner = _context(setup, threads)
    except Exception as e:  # noqa: BLE001 - e.g. a strategy that does not import
        _say(answers, _error_answer(e))
        return None
    parent = os.environ.get(PARENT_PID_VARIABLE)
    return _State(
        workload=workload,
        runner=runner,
        context=context,
        answers=answers,
        parent_pid=int(parent) if parent else None,
        profile_path=setup.get("profile_path"),
    )


def _context(setup: dict[str, Any], threads: int) -> tuple[RunContext, Any]:
    # What every child would otherwise import or parse again, done once here.
    import memadvisor.apply  # noqa: F401 - warm for the children
    from memadvisor.schema.profile import Profile
    from memadvisor.strategy import load_strategies
    from memadvisor.target import load_factory

    names = setup.get("strategies")
    profile = None
    if setup.get("profile_path"):
        profile = Profile.model_validate_json(Path(setup["profile_path"]).read_text())
    runner = load_factory(setup["runner"]) if setup.get("runner") else cuda_runner
    _warm_up()
    context = RunContext(
        budget_bytes=int(setup["budget_bytes"]),
        device_index=int(setup.get("device_index", 0)),
        profile=profile,
        strategies=load_strategies(list(names) if names is not None else None),
        strategy_names=list(names) if names is not None else None,
        intra_op_threads=threads,
    )
    return context, runner


def _warm_up() -> None:
    """Build a throwaway optimizer, for the imports a first step makes.

    Constructing any torch optimizer imports ``torch._dynamo`` (3.5 s here, and in every
    child that has not got it); the zygote pays it once. Nothing more: a backward here would
    start autograd's device threads, which asks the CUDA driver for its devices (CUDA is
    then unusable in the children) and marks every child as forked after those threads
    (its first backward on the card raises).
    """
    import torch

    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def _warm_compiler() -> None:
    """Import what a child's first ``torch.compile`` would import, once, here.

    Why: a compiled run's child imports inductor's compiler (``torch._inductor.compile_fx``:
    about 600 modules) when its first step reaches the backend, on that step's path, in every
    child of every round of compiled runs; a child forked after this finds it imported. Done
    after the ready answer, so the server's start is not longer: a run sent meanwhile waits in
    the pipe until the import ends. Nothing is compiled and no compile worker is started
    (a child starts its own pool; inductor resets pools in a forked child anyway).

    Measured on an H200 (docs/design.md, session 39): the import took 1.1-2.6 s from
    bytecode and 4.1-4.5 s from source, and left CUDA unstarted; with it, the compiled
    children's first steps were up to 2.1 s shorter (five of six), but a round waits for its
    slowest run and the llama and cnn examples' plans took as long (61.5 against 61.8 s,
    67.5 against 67.6 s).

    Known limitations:
        * Where the import asked CUDA to start (no torch seen so far does), every child
          after it answers ``unforkable`` and the device falls back to a fresh process per
          run; this says so on the zygote's stderr.
        * The first run of a plan whose profile is shorter than the server's start plus the
          import waits for the import.
    """
    import torch

    from memadvisor import _torch_private

    started = time.perf_counter()
    imported = _torch_private.import_compiler()
    print(
        f"memadvisor zygote: compiler imported ({imported}) in "
        f"{time.perf_counter() - started:.2f} s",
        file=sys.stderr,
        flush=True,
    )
    if torch.cuda.is_initialized():  # the flag only: asking the driver would start it
        print(
            "memadvisor zygote: importing the compiler started CUDA; runs now fall back to "
            "fresh processes",
            file=sys.stderr,
            flush=True,
        )


def _take_profile(state: _State, path: str | None) -> None:
    """Load the profile at ``path`` for the runs from now on, once per path."""
    if not path or path == state.profile_path:
        return
    from memadvisor.schema.profile import Profile

    state.context.profile = Profile.model_validate_json(Path(path).read_text())
    state.profile_path = path


def _serve(state: _State, run: dict[str, Any]) -> dict[str, Any]:
    """Fork a child for ``run``, wait for it, and return its answer (or why there is none)."""
    forked = _fork(state, run)
    return forked if isinstance(forked, dict) else _answer_of(state, *forked)


def _serve_many(state: _State, runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Fork a child for each of ``runs``, all at once, sharing one turn lock; their answers
    in the order given (each as :func:`_serve` answers it).

    Collected one after another: a child that finished before the one waited for blocks in
    its answer's write (a long one) or has exited, and is read in its turn.
    """
    handle, lock = tempfile.mkstemp(prefix="memadvisor-turn-", suffix=".lock")
    os.close(handle)
    gate = _turns.Gate(lock)  # no child's first step before every sibling is forked
    forked: list[dict[str, Any] | tuple[int, int]] = []
    try:
        for index, run in enumerate(runs):
            _take_profile(state, run.get("profile_path"))
            open_fds = [f[1] for f in forked if isinstance(f, tuple)]
            turn = {"turn_lock": lock, "turn_index": index, "turn_count": len(runs)}
            forked.append(_fork(state, {**run, **turn}, open_fds))
        gate.open([i for i, f in enumerate(forked) if isinstance(f, tuple)])
        return [f if isinstance(f, dict) else _answer_of(state, *f) for f in forked]
    finally:
        gate.close()
        with contextlib.suppress(OSError):
            os.unlink(lock)


def _fork(
    state: _State, run: dict[str, Any], siblings: Sequence[int] = ()
) -> dict[str, Any] | tuple[int, int]:
    """Fork a child for ``run``: (its pid, the read end of its answer pipe), or the answer
    that says why none could be forked. ``siblings``: read ends the child must close."""
    import torch

    if torch.cuda.is_initialized():  # the flag only: asking the driver would start it
        return {
            "status": "unforkable",
            "message": "the workload's factory initialized CUDA in the fork server, and a "
            "forked child cannot use its parent's CUDA context",
        }
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    zygote_pid = os.getpid()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(state, run, write_fd, zygote_pid, siblings)  # never returns
    os.close(write_fd)
    return pid, read_fd


def _answer_of(state: _State, pid: int, read_fd: int) -> dict[str, Any]:
    """Wait for the child ``pid`` and return its answer (or why there is none)."""
    data, status = _collect(pid, read_fd, state.parent_pid)
    os.close(read_fd)
    if data:
        with contextlib.suppress(ValueError):
            return json.loads(data)
    if os.WIFSIGNALED(status):
        number = os.WTERMSIG(status)
        return {
            "status": "crashed",
            "signal": number,
            "message": f"the run's process was killed by signal {number} "
            f"({signal.Signals(number).name}) before it answered",
        }
    return {
        "status": "crashed",
        "exit_code": os.waitstatus_to_exitcode(status),
        "message": f"the run's process exited with code {os.waitstatus_to_exitcode(status)} "
        "before it answered",
    }


def _collect(pid: int, read_fd: int, parent_pid: int | None = None) -> tuple[bytes, int]:
    """The child's answer and its wait status.

    The zygote's own parent (the planner) is looked for on every poll: where no parent-death
    signal exists (macOS), a zygote whose planner died kills its child and exits here.

    Read while waiting: a long answer (a traceback) would fill the pipe and stall a child
    that is waited for first. Read until end-of-file or the child's exit, whichever is
    first: a process the child forked without exec (a multiprocessing pool it left behind)
    keeps the pipe open after the child is gone.
    """
    chunks: list[bytes] = []
    with selectors.DefaultSelector() as selector:
        selector.register(read_fd, selectors.EVENT_READ)
        while True:
            if selector.select(_EXIT_POLL_S):
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
                continue
            if parent_is_gone(parent_pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                os._exit(1)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                os.set_blocking(read_fd, False)
                with contextlib.suppress(BlockingIOError):
                    while chunk := os.read(read_fd, 1 << 16):
                        chunks.append(chunk)
                return b"".join(chunks), status
    _, status = os.waitpid(pid, 0)
    return b"".join(chunks), status


def _exit_now(answers: IO[str]) -> NoReturn:
    """Exit at once when the parent says so: the zygote keeps nothing to save (every child
    has answered and ended; the parent removes the folders), and an interpreter's orderly exit
    after torch and the user's model were imported tore them down for 0.9-1.1 s on a CPU with
    the tests' small model, which the plan's close waited for (docs/design.md, session 25)."""
    with contextlib.suppress(OSError, ValueError):
        answers.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> int:
    die_with_parent()  # SIGTERM or SIGKILL to the planner ends this zygote and its child
    # The answers get stdout to themselves: whatever the model or a library prints (here or
    # in a child) goes to stderr instead.
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    state: _State | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        message = json.loads(line)
        if "setup" in message:
            state = _setup(message["setup"], answers)
            if state is None:
                return 1
            _say(answers, {"status": "ready", "pid": os.getpid()})
            if os.environ.get(RUNS_COMPILE_VARIABLE) == "1":
                _warm_compiler()
        elif "run" in message:
            if state is None:
                _say(answers, {"status": "error", "type": "ZygoteDied", "message": "no setup"})
                return 1
            _take_profile(state, message["run"].get("profile_path"))
            answer = _serve(state, message["run"])
            _say(answers, {**answer, "id": message["run"].get("id")})
        elif "runs" in message:
            if state is None:
                _say(answers, {"status": "error", "type": "ZygoteDied", "message": "no setup"})
                return 1
            runs = message["runs"]
            for run, answer in zip(runs, _serve_many(state, runs), strict=True):
                _say(answers, {**answer, "id": run.get("id")})
        elif message.get("exit"):
            _exit_now(answers)
    return 0


# -- the parent's side ---------------------------------------------------------------------


class ForkServer:
    """The parent's handle on one zygote: start it, send runs, read answers, close it.

    Args:
        setup: the setup message (see the module docstring).
        stderr_path: where the zygote's and its children's stderr go (its tail explains a
            crash).
        env: extra environment variables for the zygote.
    """

    def __init__(
        self, setup: dict[str, Any], *, stderr_path: Path, env: dict[str, str] | None = None
    ) -> None:
        self.setup = setup
        self.stderr_path = stderr_path
        # A fresh process inherits the environment at the moment it starts; a forked child
        # inherits the zygote's. The owner compares this snapshot with os.environ to know
        # when the zygote is stale (e.g. a compile cache directory set after it started).
        self.parent_env = dict(os.environ)
        # This very memadvisor, whatever the working directory, and this process's pid for
        # the zygote to die with (memadvisor.device._lifetime).
        self.env = probe_env({"PYTORCH_NVML_BASED_CUDA_CHECK": "1", **(env or {})})
        self.process: subprocess.Popen[bytes] | None = None
        self._in_flight = False  # a run was sent and its answer has not come back
        self._buffer = b""
        self._next_id = 0

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self, timeout_s: float) -> dict[str, Any]:
        """Start the zygote and send the setup; its answer (``ready``, ``unloadable``, ...).

        Raises:
            ZygoteDied: it exited before answering.
            TimeoutError: it did not answer within ``timeout_s`` (it is killed).
        """
        self.spawn()
        return self.ready(timeout_s)

    def spawn(self) -> None:
        """Start the zygote and send the setup without waiting: its imports and the model's
        build go on beside whatever this process does next (the plan's profile), and
        :meth:`ready` collects the answer. A run's ``profile_path`` gives it the profile
        that did not exist yet.

        Raises:
            ZygoteDied: it stopped reading before the setup was sent.
        """
        with self.stderr_path.open("ab") as stderr:
            self.process = subprocess.Popen(
                # Not ``-m``: the working directory must not be first on its sys.path.
                python_command("memadvisor.device._zygote"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=stderr,
                env=self.env,
                cwd=os.getcwd(),
                start_new_session=True,  # its own process group: a kill takes its children too
            )
        self._send({"setup": self.setup})

    def ready(self, timeout_s: float) -> dict[str, Any]:
        """The setup's answer (``ready``, ``unloadable``, ...); a zygote not ready is closed.

        Raises:
            ZygoteDied: it exited before answering.
            TimeoutError: it did not answer within ``timeout_s`` (it is killed).
        """
        answer = self._answer(timeout_s)
        if answer.get("status") != "ready":
            self.close()
        return answer

    def run(
        self,
        candidate: dict[str, Any],
        steps: int,
        timeout_s: float,
        profile_path: str | None = None,
    ) -> dict[str, Any]:
        """One run in a fresh child; its answer (``profile_path``: the profile the zygote
        takes from this run on, where its setup had none or another).

        Raises:
            ZygoteDied: the zygote is gone, or died before answering.
            TimeoutError: no answer within ``timeout_s``; the zygote and the child are killed.
        """
        run = self._numbered({"candidate": candidate, "steps": steps, "profile_path": profile_path})
        self._in_flight = True
        self._send({"run": run})
        answer = self._answer(timeout_s)
        self._in_flight = False
        self._check_id(answer, run)
        return answer

    def run_many(self, runs: Sequence[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
        """``runs`` at once, each in a fresh child, their timed steps in turn (the module
        docstring); their answers in the order given, each as :meth:`run` answers it.

        Args:
            runs: each ``{"candidate": {...}, "steps": n}``, optionally with
                ``profile_path`` (as :meth:`run`'s) and ``retry_at``.
            timeout_s: for the whole group: every answer must be in by then.

        Raises:
            ZygoteDied: the zygote is gone, or died before answering every run.
            TimeoutError: not every answer came within ``timeout_s``; the zygote and its
                children are killed (the answers already read are lost with them).
        """
        if not runs:
            return []
        sent = [self._numbered(run) for run in runs]
        deadline = time.monotonic() + timeout_s
        self._in_flight = True
        self._send({"runs": sent})
        answers: list[dict[str, Any]] = []
        for run in sent:
            try:
                answer = self._answer(max(0.0, deadline - time.monotonic()))
            except TimeoutError as e:
                raise TimeoutError(
                    f"{len(sent) - len(answers)} of {len(sent)} runs made at once had not "
                    f"answered within {timeout_s:.0f} s"
                ) from e
            self._check_id(answer, run)
            answers.append(answer)
        self._in_flight = False
        return answers

    def close(self) -> None:
        """Ask the zygote to exit; kill it (and any child) if it does not within a few seconds.

        A run still in flight (the answer was never read: a Ctrl-C, an error in the parent)
        is killed at once: the zygote reads no request until its child ends, so asking it to
        exit would wait the whole grace period.
        """
        process = self.process
        if process is None:
            return
        if self._in_flight:
            self.kill()
            return
        if process.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self._send({"exit": True})
                process.stdin.close()  # type: ignore[union-attr]
            try:
                process.wait(timeout=_CLOSE_WAIT_S)
            except subprocess.TimeoutExpired:
                self.kill()
        self._close_pipes()

    def kill(self) -> None:
        """Kill the zygote and its children at once."""
        process = self.process
        if process is None:
            return
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        self._in_flight = False
        self._close_pipes()

    def _numbered(self, run: dict[str, Any]) -> dict[str, Any]:
        """``run`` (candidate, steps, profile_path, retry_at) with the next id, as the zygote
        reads it.

        Raises:
            ZygoteDied: the zygote is not running (checked before an id is spent).
        """
        if not self.alive:
            raise ZygoteDied("the zygote is not running")
        self._next_id += 1
        numbered: dict[str, Any] = {
            "id": self._next_id,
            "candidate": run["candidate"],
            "steps": run["steps"],
        }
        for optional in ("profile_path", "retry_at"):
            if run.get(optional) is not None:
                numbered[optional] = run[optional]
        return numbered

    def _check_id(self, answer: dict[str, Any], run: dict[str, Any]) -> None:
        """Kill the zygote and raise ZygoteDied where ``answer`` is not ``run``'s."""
        if answer.get("id") != run["id"]:
            self.kill()
            raise ZygoteDied(f"answer for run {answer.get('id')} arrived for run {run['id']}")

    def stderr_tail(self, chars: int = 2000) -> str:
        try:
            return self.stderr_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # -- pipes ---------------------------------------------------------------------------------

    def _close_pipes(self) -> None:
        process = self.process
        if process is None:
            return
        for pipe in (process.stdin, process.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError, ValueError):
                    pipe.close()

    def _pipes(self) -> tuple[IO[bytes], IO[bytes]]:
        process = self.process
        if process is None or process.stdin is None or process.stdout is None:
            raise ZygoteDied("the zygote was never started")
        return process.stdin, process.stdout

    def _send(self, message: dict[str, Any]) -> None:
        stdin, _ = self._pipes()
        try:
            stdin.write((json.dumps(message) + "\n").encode())
            stdin.flush()
        except (BrokenPipeError, ValueError) as e:
            raise ZygoteDied(f"the zygote stopped reading ({type(e).__name__})") from e

    def _answer(self, timeout_s: float) -> dict[str, Any]:
        _, stdout = self._pipes()
        deadline = time.monotonic() + timeout_s
        fd = stdout.fileno()
        with selectors.DefaultSelector() as selector:
            selector.register(fd, selectors.EVENT_READ)
            while True:
                line, sep, rest = self._buffer.partition(b"\n")
                if sep:
                    self._buffer = rest
                    text = line.decode(errors="replace")
                    if text.startswith(ANSWER_MARKER):
                        return json.loads(text[len(ANSWER_MARKER) :])
                    continue
                left = deadline - time.monotonic()
                if left <= 0 or not selector.select(left):
                    self.kill()
                    raise TimeoutError(f"no answer within {timeout_s:.0f} s")
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    code = self.process.wait() if self.process is not None else None
                    self._close_pipes()
                    raise ZygoteDied(f"the zygote exited with code {code}")
                self._buffer += chunk


if __name__ == "__main__":
    sys.exit(main())
