"""The fork server's protocol on the CPU: a zygote serving runs from forked children.

The children run a stub runner (tests/device/zygote_runner.py) instead of the CUDA one:
the protocol, the ordering, the failure answers and the shutdown do not depend on a card.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from memadvisor.device._zygote import ForkServer, ZygoteDied
from memadvisor.schema.candidate import Candidate
from memadvisor.strategy import RUNS_COMPILE_VARIABLE
from tests.device import zygote_runner as runner
from tests.fixtures.cuda_stubs import stub_cuda
from tests.fixtures.procs import processes

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

HELPERS = Path(__file__).resolve().parent / "zygote_runner.py"
TIMEOUT_S = 120.0  # generous on a loaded 2-core machine; a hang would take forever


def _setup(**overrides) -> dict:
    return {
        "budget_bytes": 2**30,
        "device_index": 0,
        "target": f"{HELPERS}:build",
        "workload_path": None,
        "profile_path": None,
        "strategies": [],
        "sys_path": [],
        "target_files": [],
        "runner": f"{HELPERS}:run",
        **overrides,
    }


def _candidate(batch: int) -> dict:
    return Candidate(batch_size=batch).model_dump(mode="json")


@pytest.fixture(scope="module")
def times_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the stub runner's runs of TURN_BATCHES record their times, one file per pid."""
    return tmp_path_factory.mktemp("times")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, times_dir: Path):
    """One zygote for the module's tests (each test also checks it is still serving)."""
    zygote = ForkServer(
        _setup(),
        stderr_path=tmp_path_factory.mktemp("zygote") / "stderr",
        env={runner.TIMES_VARIABLE: str(times_dir)},
    )
    answer = zygote.start(TIMEOUT_S)
    assert answer["status"] == "ready", (answer, zygote.stderr_tail())
    yield zygote
    zygote.close()


def test_answers_come_back_in_order_each_from_a_fresh_child(server: ForkServer) -> None:
    """Each run answers with its own id, in the order sent, from a different child, and every
    child starts from the zygote's state (a global the previous child changed is back)."""
    answers = [server.run(_candidate(b), steps=2, timeout_s=TIMEOUT_S) for b in (2, 5, 3)]
    assert [a["status"] for a in answers] == ["ok"] * 3, answers
    ids = [a["id"] for a in answers]
    assert ids == sorted(ids) and len(set(ids)) == 3
    measured = [a["measurement"] for a in answers]
    assert [m["samples_per_s"] > 0 for m in measured] == [True] * 3
    pids = {m["peak_bytes"] for m in measured}  # the stub runner reports its pid there
    assert len(pids) == 3 and server.process is not None and server.process.pid not in pids
    assert [m["reserved_peak_bytes"] for m in measured] == [0, 0, 0]


def _runs(*batches: int, steps: int = 2) -> list[dict]:
    return [{"candidate": _candidate(b), "steps": steps} for b in batches]


def test_runs_sent_together_are_made_at_once_each_in_its_own_child(
    server: ForkServer, times_dir: Path
) -> None:
    """Rule: a "runs" message forks a child per run before collecting any: their first steps
    overlap (every child started before any finished its first step, and the group took far
    less than the runs one after another), and the answers come back one per run, in the
    order sent, each with its id, each from a child of its own."""
    t0 = time.perf_counter()
    answers = server.run_many(_runs(40, 41, 42), timeout_s=TIMEOUT_S)
    wall = time.perf_counter() - t0
    assert [a["status"] for a in answers] == ["ok"] * 3, answers
    ids = [a["id"] for a in answers]
    assert ids == list(range(ids[0], ids[0] + 3))
    pids = [a["measurement"]["peak_bytes"] for a in answers]  # the stub reports its pid there
    assert len(set(pids)) == 3 and server.process is not None and server.process.pid not in pids
    recorded = [runner.times(times_dir, pid) for pid in pids]
    assert [r["batch"] for r in recorded] == [40, 41, 42]
    assert max(r["started"] for r in recorded) < min(r["first_done"] for r in recorded)
    one_by_one = 3 * (runner.FIRST_STEP_S + runner.TURN_S)
    assert wall < one_by_one - runner.FIRST_STEP_S / 2, (wall, one_by_one)
    assert server.run(_candidate(2), steps=2, timeout_s=TIMEOUT_S)["status"] == "ok"


def test_runs_made_at_once_take_their_timed_steps_in_turn(
    server: ForkServer, times_dir: Path
) -> None:
    """Rule: the children of one "runs" message share one lock file (the run's turn_lock),
    and the intervals they held it (their timed steps) never overlap, though all of them
    finished their first steps at about the same time; the zygote removes the file after
    the group. A single run gets no lock."""
    answers = server.run_many(_runs(43, 44, 45), timeout_s=TIMEOUT_S)
    assert [a["status"] for a in answers] == ["ok"] * 3, answers
    recorded = [runner.times(times_dir, a["measurement"]["peak_bytes"]) for a in answers]
    locks = {r["lock"] for r in recorded}
    assert len(locks) == 1 and None not in locks
    assert not Path(locks.pop()).exists()
    held = sorted((r["turn_from"], r["turn_to"]) for r in recorded)
    for (_, earlier_to), (later_from, _) in zip(held, held[1:], strict=False):
        assert later_from >= earlier_to, held
    # Without the turn all three would have held it at once, from their first steps' end.
    assert held[-1][0] - held[0][0] >= 2 * runner.TURN_S * 0.9, held
    alone = server.run(_candidate(46), steps=2, timeout_s=TIMEOUT_S)
    assert runner.times(times_dir, alone["measurement"]["peak_bytes"])["lock"] is None


def test_no_run_made_at_once_times_its_steps_while_a_sibling_is_still_in_its_first_step(
    server: ForkServer, times_dir: Path
) -> None:
    """Rule: a run made at once takes its turn (its timed steps) only after every sibling's
    first step (its compile) has ended: a sibling compiling beside timed steps took the CPU
    and the card from them (15-30% slow on the card). Here one sibling's first step takes
    twice the others'; no turn begins before it ends."""
    batches = (43, runner.SLOW_FIRST_BATCH, 44)
    answers = server.run_many(_runs(*batches), timeout_s=TIMEOUT_S)
    assert [a["status"] for a in answers] == ["ok"] * 3, answers
    recorded = [runner.times(times_dir, a["measurement"]["peak_bytes"]) for a in answers]
    last_first_step = max(r["first_done"] for r in recorded)
    slow = next(r for r in recorded if r["batch"] == runner.SLOW_FIRST_BATCH)
    assert slow["first_done"] == last_first_step
    assert min(r["turn_from"] for r in recorded) >= last_first_step, recorded
    held = sorted((r["turn_from"], r["turn_to"]) for r in recorded)
    for (_, earlier_to), (later_from, _) in zip(held, held[1:], strict=False):
        assert later_from >= earlier_to, held


def test_an_out_of_memory_run_among_runs_made_at_once_leaves_the_others_alone(
    server: ForkServer,
) -> None:
    """Rule: each run of a "runs" message is answered as it would be alone: an out-of-memory
    child answers 'oom' with its steps, a child's own error answers 'error', and the runs
    beside them answer 'ok' from children of their own."""
    answers = server.run_many(_runs(40, 1000, 13, 41, steps=3), timeout_s=TIMEOUT_S)
    assert [a["status"] for a in answers] == ["ok", "oom", "error", "ok"], answers
    assert answers[1]["message"] == "fake: batch 1000 does not fit"
    assert answers[1]["steps_completed"] == 1 and answers[2]["type"] == "KeyError"
    pids = {answers[i]["measurement"]["peak_bytes"] for i in (0, 3)}
    assert len(pids) == 2 and [a["measurement"]["steps"] for a in answers[::3]] == [3, 3]


def test_train_candidate_takes_the_turn_after_its_first_step_and_gives_it_back(
    monkeypatch, tmp_path: Path
) -> None:
    """Rule: train_candidate runs its first step (compile, warm-up) outside the turn, takes
    the turn (taking_turn on the run's lock file) before its second step, holds it through
    its last, and gives it back after the steps, an out-of-memory among them too; without
    a lock it takes none. (On the CPU: the CUDA calls around the steps are stubbed.)"""
    import contextlib

    import torch

    from memadvisor.device import _train
    from memadvisor.workload import Workload

    stub_cuda(monkeypatch)
    events: list[str] = []
    taking_turn = _train.taking_turn

    @contextlib.contextmanager
    def recorded(lock_path):
        try:
            with taking_turn(lock_path):
                events.append(f"turn {lock_path is not None}")
                yield
        finally:
            events.append("back")

    step = _train.train_step
    oom_at: list[int] = []

    def counted(*args, **kwargs):
        if oom_at and events.count("step") == oom_at[0]:
            raise torch.OutOfMemoryError("fake: does not fit")
        events.append("step")
        return step(*args, **kwargs)

    monkeypatch.setattr(_train, "taking_turn", recorded)
    monkeypatch.setattr(_train, "train_step", counted)
    built = runner.build()
    workload = Workload(
        model=built["model"], sample_batch=built["sample_batch"], loss_fn=runner._loss
    )
    lock = str(tmp_path / "turn.lock")

    def train(turn_lock):
        return _train.train_candidate(
            workload, Candidate(batch_size=2), 3, device=torch.device("cpu"), strategies=[],
            turn_lock=turn_lock,
        )  # fmt: skip

    assert train(lock).steps == 3
    assert events == ["step", "turn True", "step", "step", "back"]
    events.clear()
    oom_at.append(2)
    with pytest.raises(torch.OutOfMemoryError) as caught:
        train(lock)
    assert events == ["step", "turn True", "step", "back"]
    assert caught.value.memadvisor_steps_completed == 2
    events.clear()
    oom_at.clear()
    assert train(None).steps == 3
    assert events == ["step", "turn False", "step", "step", "back"]


def test_train_candidate_retries_the_smaller_batch_in_its_process_from_no_gradients(
    monkeypatch, tmp_path: Path
) -> None:
    """Rule: train_candidate given ``retry_at`` trains that batch where its own runs out: the
    answer is the smaller batch's measurement with ``ran_out_first`` (the batch, its message,
    the steps it completed); the retry starts without the failed steps' gradients (a
    backward that ran before the failure left them), takes the turn from its first step,
    and reports the failed batch's first step as the compile's; where the retry runs out
    too, the error is the first batch's, with its steps. (On the CPU: the CUDA calls around
    the steps are stubbed.)"""
    import contextlib

    import torch

    from memadvisor.device import _train
    from memadvisor.workload import Workload

    stub_cuda(monkeypatch)
    events: list[str] = []

    @contextlib.contextmanager
    def recorded(lock_path):
        events.append("turn")
        yield

    step = _train.train_step
    too_big: dict[str, int] = {"from": 8}

    def fails_after_backward(run, model, optimizer, batch, **kwargs):
        size = len(batch)
        events.append(f"step {size} grads {any(p.grad is not None for p in model.parameters())}")
        if (
            size >= too_big["from"]
            and events.count(f"step {size} grads False") + events.count(f"step {size} grads True")
            == 2
        ):
            model(batch).square().mean().backward()  # gradients made, then the step fails
            raise torch.OutOfMemoryError(f"fake: batch {size} does not fit")
        return step(run, model, optimizer, batch, **kwargs)

    monkeypatch.setattr(_train, "taking_turn", recorded)
    monkeypatch.setattr(_train, "train_step", fails_after_backward)
    built = runner.build()
    workload = Workload(
        model=built["model"], sample_batch=built["sample_batch"], loss_fn=runner._loss
    )

    def train(batch: int, retry_at: int | None):
        return _train.train_candidate(
            workload, Candidate(batch_size=batch), 3, device=torch.device("cpu"),
            strategies=[], turn_lock=str(tmp_path / "turn.lock"), retry_at=retry_at,
        )  # fmt: skip

    measured = train(8, 4)
    assert measured.ran_out_first is not None
    assert (measured.ran_out_first.batch_size, measured.ran_out_first.steps) == (8, 1)
    assert measured.ran_out_first.same_process
    assert "batch 8 does not fit" in measured.ran_out_first.message
    assert measured.samples_per_s > 0 and measured.first_step_ms is not None
    retry_steps = [e for e in events if e.startswith("step 4")]
    assert retry_steps[0] == "step 4 grads False", events  # the failed step's grads dropped
    first_retry = events.index("step 4 grads False")
    assert events[first_retry - 1] == "turn", events  # in the turn from its first step
    # Both run out: the first batch's error, its steps.
    events.clear()
    too_big["from"] = 2
    with pytest.raises(torch.OutOfMemoryError) as caught:
        train(8, 4)
    assert "batch 8 does not fit" in str(caught.value)
    assert caught.value.memadvisor_steps_completed == 1
    assert caught.value.memadvisor_retry_ran_out == 4  # and says the retry ran out too,
    assert caught.value.memadvisor_retry_same_process is True  # here


def test_the_turn_is_one_process_at_a_time_and_is_free_again_after_it(tmp_path: Path) -> None:
    """Rule: taking_turn excludes other processes while held (a process asking for it waits)
    and leaves the file free once the block ends."""
    import subprocess
    import sys

    from memadvisor.device._train import taking_turn

    lock = str(tmp_path / "turn.lock")
    probe = (
        "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
        "fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)"
    )

    def free() -> bool:
        done = subprocess.run([sys.executable, "-c", probe, lock], capture_output=True)
        return done.returncode == 0

    with taking_turn(lock):
        assert not free()
    assert free()
    with taking_turn(None):  # no lock: nothing taken, nothing made
        pass


def test_an_exception_in_a_child_is_an_error_answer_and_the_next_run_works(
    server: ForkServer,
) -> None:
    """A child's exception (not out-of-memory) comes back as an error answer with its type,
    message and traceback; the zygote keeps serving."""
    answer = server.run(_candidate(13), steps=2, timeout_s=TIMEOUT_S)
    assert answer["status"] == "error" and answer["type"] == "KeyError"
    assert "the model's own bug" in answer["message"] and "Traceback" in answer["traceback"]
    assert server.run(_candidate(2), steps=2, timeout_s=TIMEOUT_S)["status"] == "ok"


def test_out_of_memory_is_an_oom_answer_with_the_steps_that_finished(server: ForkServer) -> None:
    """An error is_oom accepts comes back as 'oom' with its first line and completed steps."""
    answer = server.run(_candidate(1000), steps=3, timeout_s=TIMEOUT_S)
    assert answer["status"] == "oom", answer
    assert answer["message"] == "fake: batch 1000 does not fit"
    assert answer["steps_completed"] == 1


def test_a_child_killed_by_a_signal_is_reported_and_the_zygote_survives(
    server: ForkServer,
) -> None:
    """A child that dies without answering (SIGKILL) is a 'crashed' answer naming the signal;
    the zygote is alive and the next run is served."""
    answer = server.run(_candidate(666), steps=2, timeout_s=TIMEOUT_S)
    assert answer["status"] == "crashed" and answer["signal"] == signal.SIGKILL
    assert "SIGKILL" in answer["message"]
    assert server.alive
    assert server.run(_candidate(2), steps=2, timeout_s=TIMEOUT_S)["status"] == "ok"


def test_a_process_the_child_left_behind_does_not_hold_up_the_answer(
    server: ForkServer,
) -> None:
    """A child that forked a process which outlives it (and so holds the answer pipe open)
    is answered when the child exits, not when that process does (20 s later)."""
    t0 = time.perf_counter()
    answer = server.run(_candidate(777), steps=2, timeout_s=TIMEOUT_S)
    assert answer["status"] == "ok"
    assert time.perf_counter() - t0 < 15


def _live_members(group: int) -> list[int]:
    """Pids of the process group's members that are not zombies (Linux /proc)."""
    return [pid for pid, fields in processes() if int(fields[2]) == group and fields[0] != "Z"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_run_past_its_timeout_kills_the_zygote_and_its_child(tmp_path: Path) -> None:
    """No answer within the timeout: TimeoutError, and no process of the zygote's group (the
    zygote, the child still training) is left running; a later run raises ZygoteDied."""
    zygote = ForkServer(_setup(), stderr_path=tmp_path / "stderr")
    assert zygote.start(TIMEOUT_S)["status"] == "ready"
    assert zygote.process is not None
    group = zygote.process.pid
    with pytest.raises(TimeoutError):
        zygote.run(_candidate(4), steps=100_000, timeout_s=3.0)
    assert not zygote.alive
    deadline = time.monotonic() + 10
    while _live_members(group) and time.monotonic() < deadline:
        time.sleep(0.1)  # SIGKILL is delivered asynchronously
    assert _live_members(group) == []
    # A zygote that is gone says so at once (the device then falls back to fresh processes)
    # instead of waiting for an answer that never comes.
    t0 = time.perf_counter()
    with pytest.raises(ZygoteDied):
        zygote.run(_candidate(2), steps=2, timeout_s=TIMEOUT_S)
    assert time.perf_counter() - t0 < 10


def test_a_workload_that_does_not_load_is_an_answer_not_a_hang(tmp_path: Path) -> None:
    """A saved workload the zygote cannot load answers 'unloadable' (the device then runs in
    its own process, as it does for the fresh-process worker's same answer); the zygote exits."""
    missing = _setup(target=None, workload_path=str(tmp_path / "missing.pt"))
    zygote = ForkServer(missing, stderr_path=tmp_path / "stderr")
    answer = zygote.start(TIMEOUT_S)
    assert answer["status"] == "unloadable" and "missing.pt" in answer["message"]
    assert not zygote.alive


def test_a_zygote_whose_factory_initialized_cuda_forks_nothing_and_exits_on_close(
    tmp_path: Path,
) -> None:
    """A factory that initialized CUDA makes every fork useless: the zygote answers
    'unforkable' without forking (the device then starts a fresh process per run). close()
    then ends the zygote cleanly (exit code 0)."""
    zygote = ForkServer(
        _setup(target=f"{HELPERS}:build_touching_cuda"), stderr_path=tmp_path / "stderr"
    )
    try:
        assert zygote.start(TIMEOUT_S)["status"] == "ready"
        answer = zygote.run(_candidate(2), steps=2, timeout_s=TIMEOUT_S)
        assert answer["status"] == "unforkable" and "initialized CUDA" in answer["message"]
    finally:
        zygote.close()
    assert zygote.process is not None and zygote.process.poll() == 0 and not zygote.alive


def test_a_zygote_told_to_exit_exits_at_once_without_the_interpreters_teardown(
    tmp_path: Path,
) -> None:
    """Rule: the zygote keeps nothing to save once every run has answered, so on close() it
    exits at once (exit code 0) without an orderly interpreter exit: the teardown of torch
    and the user's model took about 1.1 s on this CPU, which a plan's close waited for; a
    handler the user's factory registered does not run in the planner's helper process."""
    ran = tmp_path / "atexit-ran"
    zygote = ForkServer(
        _setup(target=f"{HELPERS}:build_registering_atexit"),
        stderr_path=tmp_path / "stderr",
        env={runner.ATEXIT_VARIABLE: str(ran)},
    )
    try:
        assert zygote.start(TIMEOUT_S)["status"] == "ready", zygote.stderr_tail()
        assert zygote.run(_candidate(3), steps=2, timeout_s=TIMEOUT_S)["status"] == "ok"
    finally:
        zygote.close()
    assert zygote.process is not None and zygote.process.poll() == 0 and not zygote.alive
    assert not ran.exists(), "the zygote ran its interpreter's exit handlers"


def test_a_child_forked_after_autograd_started_its_threads_is_unforkable() -> None:
    """torch's error for a backward in a child forked after autograd's device threads started
    (a factory that ran a backward on a CUDA machine) means 'do not fork': the device then
    runs fresh processes. Any other error stays an error."""
    from memadvisor.device._zygote import _error_answer

    message = (
        "Unable to handle autograd's threading in combination with fork-based "
        "multiprocessing. See https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork"
    )
    assert _error_answer(RuntimeError(message))["status"] == "unforkable"
    assert _error_answer(RuntimeError("shape mismatch"))["status"] == "error"


def test_the_fork_server_restarts_for_the_users_environment_not_for_what_compile_set() -> None:
    """A variable torch's compile writes into this process as it compiles (triton's cache
    directory, inductor's pool switch) is no reason to start a new fork server: a child
    derives the same value. A changed inductor cache, or any variable the server started
    with that changed, is (its children would run with the old one)."""
    from memadvisor.device.cuda import environment_changed

    started = {"PATH": "/bin", "TORCHINDUCTOR_CACHE_DIR": "/tmp/a", "TRITON_CACHE_DIR": "/t"}
    compiled = {**started, "TORCH_WARM_POOL": "0", "TRITON_PTXAS_PATH": "/p"}
    assert environment_changed(started, compiled) == []
    assert environment_changed(started, {**compiled, "TORCHINDUCTOR_CACHE_DIR": "/tmp/b"}) == [
        "TORCHINDUCTOR_CACHE_DIR"
    ]
    assert environment_changed(started, {**started, "TRITON_CACHE_DIR": "/u"}) == [
        "TRITON_CACHE_DIR"
    ]
    assert environment_changed(started, {**started, "MY_FLAG": "1"}) == ["MY_FLAG"]
    without = {k: v for k, v in started.items() if k != "PATH"}
    assert environment_changed(started, without) == ["PATH"]
    # Inductor writes its default cache directory into the variable when first asked (the
    # profiler asks): a child derives the same; another directory is a change.
    from memadvisor import _torch_private

    unset = {"PATH": "/bin"}
    default = _torch_private.inductor_default_cache_dir()
    assert environment_changed(unset, {**unset, "TORCHINDUCTOR_CACHE_DIR": default}) == []
    assert environment_changed(unset, {**unset, "TORCHINDUCTOR_CACHE_DIR": "/tmp/x"}) == [
        "TORCHINDUCTOR_CACHE_DIR"
    ]


def _hold(lock: str, released: dict[str, float]) -> None:
    """Hold the host lock for two of the stub's first steps; note when it was let go."""
    from memadvisor.device import _turns

    with _turns.host_busy(lock):
        time.sleep(2 * runner.FIRST_STEP_S)
        released["at"] = time.time()


def test_no_run_times_its_steps_while_the_planner_holds_the_host_lock(
    tmp_path_factory: pytest.TempPathFactory, times_dir: Path
) -> None:
    """Rule: where the setup names a host lock, a run of the fork server, made at once with
    others or alone, takes its timed steps only once the planner (here the test's process,
    through host_busy) no longer holds it: the compile trial in the planner's process takes
    the host's cores as a sibling's compile does, which the turn keeps away from timed steps.
    Without the lock held, the same runs go on at once."""
    lock = str(tmp_path_factory.mktemp("host") / "host.lock")
    zygote = ForkServer(
        _setup(host_lock=lock),
        stderr_path=tmp_path_factory.mktemp("zygote-host") / "stderr",
        env={runner.TIMES_VARIABLE: str(times_dir)},
    )
    assert zygote.start(TIMEOUT_S)["status"] == "ready", zygote.stderr_tail()
    try:
        for batches in ((43, 44), (45,)):
            released: dict[str, float] = {}
            holder = threading.Thread(target=_hold, args=(lock, released))
            holder.start()
            time.sleep(0.2)  # the lock is held before the runs start
            if len(batches) > 1:
                answers = zygote.run_many(_runs(*batches), timeout_s=TIMEOUT_S)
            else:
                answers = [zygote.run(_candidate(batches[0]), steps=2, timeout_s=TIMEOUT_S)]
            holder.join()
            assert [a["status"] for a in answers] == ["ok"] * len(batches), answers
            recorded = [runner.times(times_dir, a["measurement"]["peak_bytes"]) for a in answers]
            assert max(r["first_done"] for r in recorded) < released["at"], recorded
            assert min(r["turn_from"] for r in recorded) >= released["at"], (recorded, released)
        free = zygote.run_many(_runs(46, 47), timeout_s=TIMEOUT_S)
        recorded = [runner.times(times_dir, a["measurement"]["peak_bytes"]) for a in free]
        assert min(r["turn_from"] for r in recorded) - max(r["first_done"] for r in recorded) < 1.0
    finally:
        zygote.close()


def test_a_zygote_whose_runs_compile_imports_the_compiler_once_for_its_children(
    tmp_path: Path, server: ForkServer
) -> None:
    """Rule: where the plan's runs may compile (RUNS_COMPILE_VARIABLE, set by compile's plan
    scope), the zygote imports inductor's compiler after its ready answer, so each forked
    child starts with it imported instead of importing it in its first compiled step (about
    600 modules, 1.4-1.7 s on this project's CPU machine); a zygote without the variable does
    not (its runs never compile, and the import would only cost)."""
    zygote = ForkServer(_setup(), stderr_path=tmp_path / "stderr", env={RUNS_COMPILE_VARIABLE: "1"})
    try:
        assert zygote.start(TIMEOUT_S)["status"] == "ready", zygote.stderr_tail()
        warm = zygote.run(_candidate(runner.COMPILER_BATCH), steps=1, timeout_s=TIMEOUT_S)
    finally:
        zygote.close()
    assert warm["status"] == "ok", warm
    assert warm["measurement"]["reserved_peak_bytes"] == 1, zygote.stderr_tail()
    assert "compiler imported (True)" in (tmp_path / "stderr").read_text()
    cold = server.run(_candidate(runner.COMPILER_BATCH), steps=1, timeout_s=TIMEOUT_S)
    assert cold["status"] == "ok" and cold["measurement"]["reserved_peak_bytes"] == 0, cold
