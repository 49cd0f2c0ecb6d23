"""The fork server's protocol on the CPU: a zygote serving runs from forked children.

The children run a stub runner (tests/device/zygote_runner.py) instead of the CUDA one:
the protocol, the ordering, the failure answers and the shutdown do not depend on a card.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from memadvisor.device._zygote import ForkServer, ZygoteDied
from memadvisor.schema.candidate import Candidate
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
def server(tmp_path_factory: pytest.TempPathFactory):
    """One zygote for the module's tests (each test also checks it is still serving)."""
    zygote = ForkServer(_setup(), stderr_path=tmp_path_factory.mktemp("zygote") / "stderr")
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
