"""CudaDevice on a real card: the budget enforced, forked children of the zygote measuring
what fresh processes measure, the fresh-process and in-process fallbacks.

python -m pytest tests/device/test_cuda.py -m gpu -v
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memadvisor
from memadvisor.errors import BadInputError, is_oom
from memadvisor.schema.candidate import Candidate
from memadvisor.target import load_target
from memadvisor.workload import Workload

gpu = pytest.mark.gpu

GIB = 2**30
MIB = 2**20
GPT = f"{Path(__file__).resolve().parents[2] / 'examples' / 'gpt.py'}:build"
QUICK = {"probe_steps": 2, "timing_steps": 2, "verify_steps": 5, "rerank_top": 2}


def _device(budget_bytes: int, **kwargs):
    from memadvisor.device.cuda import CudaDevice

    return CudaDevice(budget_bytes, **kwargs)


def _stub_runner_device(monkeypatch) -> tuple:
    """(a CudaDevice on a fake 80 GiB card whose children run tests/device/zygote_runner.py's
    CPU runner, that file): the fork server's protocol without a card."""
    from types import SimpleNamespace

    helpers = Path(__file__).resolve().parent / "zygote_runner.py"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    card = SimpleNamespace(name="fake card", total_memory=80 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: card)
    device = _device(GIB, target=f"{helpers}:build", runner=f"{helpers}:run", timeout_s=120)
    return device, helpers


def _picklable_workload(batch: int = 8, width: int = 16) -> Workload:
    """Every part importable by name (torch.nn.functional.l1_loss): torch.save can send it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 1024), nn.ReLU(), nn.Linear(1024, 16))
    return Workload(model=model, sample_batch=torch.randn(batch, width), loss_fn=F.l1_loss)


def _settled_allocated() -> int:
    """This process's allocated bytes once garbage (earlier tests' cycles) is collected and
    its cached blocks are given back to the card.

    Without the collection a cycle left by an earlier test may be freed in the middle of a
    test, and an equality of allocated bytes fails only in the full run (order-dependent);
    without emptying the cache, what earlier tests cached here is card memory a probe
    process cannot have.
    """
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


@gpu
@pytest.mark.parametrize("fork_server", [True, False])
def test_a_fresh_process_probe_measures_within_the_budget_and_leaves_this_process_alone(
    fork_server: bool,
) -> None:
    """A run in a forked child of the zygote (or in a fresh process) returns the steps it ran,
    a peak within the budget and the host's time to launch a step (within the step's time,
    which also waits for the card), and this process's allocator holds exactly what it held."""
    torch.cuda.init()
    before = _settled_allocated()
    device = _device(2 * GIB, target=GPT, fork_server=fork_server)
    try:
        measured = device.run(load_target(GPT), Candidate(batch_size=4), steps=3)
        assert device.mode == ("fork_server" if fork_server else "fresh_process"), device.notes
        assert device.notes == []
    finally:
        device.close()
    assert measured.steps == 3 and 0 < measured.peak_bytes <= 2 * GIB
    assert measured.host_ms is not None and 0 < measured.host_ms <= measured.step_ms
    assert measured.reserved_peak_bytes is not None and measured.reserved_peak_bytes <= 2 * GIB
    assert _settled_allocated() == before


@gpu
def test_a_forked_child_measures_what_a_fresh_process_measures() -> None:
    """The fork server's clean state is a fresh process's: the same candidate has the same
    allocated peak in both (measured equal to the byte on an H200), and reserved within 2%."""
    _settled_allocated()
    workload = load_target(GPT)
    candidate = Candidate(batch_size=16)
    measured = {}
    for fork_server in (True, False):
        device = _device(4 * GIB, target=GPT, fork_server=fork_server)
        try:
            measured[fork_server] = device.run(workload, candidate, steps=3)
        finally:
            device.close()
    forked, fresh = measured[True], measured[False]
    assert forked.peak_bytes == fresh.peak_bytes
    assert abs(forked.reserved_peak_bytes - fresh.reserved_peak_bytes) <= 0.02 * (
        fresh.reserved_peak_bytes
    )


@gpu
def test_an_out_of_memory_child_leaves_the_next_child_unchanged() -> None:
    """After a child ran out of memory, the next child of the same zygote measures exactly
    the peak the first did: nothing of the failed run reaches it. close() stops the zygote."""
    device = _device(GIB, target=GPT)
    workload = load_target(GPT)
    try:
        first = device.run(workload, Candidate(batch_size=4), steps=3)
        zygote = device._zygote
        assert zygote is not None and zygote.alive
        with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is is_oom's to decide
            device.run(workload, Candidate(batch_size=4096), steps=3)
        assert is_oom(caught.value)
        again = device.run(workload, Candidate(batch_size=4), steps=3)
        assert device._zygote is zygote and device.mode == "fork_server"
        assert again.peak_bytes == first.peak_bytes
    finally:
        device.close()
    assert zygote.process is not None and zygote.process.poll() is not None


@gpu
def test_the_budget_is_enforced_in_the_child() -> None:
    """Past the budget the child runs out of memory and the parent raises an error is_oom
    accepts, saying how many steps finished; below it the same workload fits.

    384 MiB: the GPT example's batch 1 peaked past 256 MiB on a card once its output was kept
    through the next forward as a user's loop keeps it (session 12)."""
    budget = 384 * MIB
    device = _device(budget, target=GPT)
    workload = load_target(GPT)
    with pytest.raises(Exception) as caught:  # noqa: PT011 - the type is is_oom's to decide
        device.run(workload, Candidate(batch_size=512), steps=2)
    assert is_oom(caught.value)
    assert getattr(caught.value, "memadvisor_steps_completed", None) == 0
    assert device.run(workload, Candidate(batch_size=1), steps=2).peak_bytes <= budget


@gpu
def test_a_workload_without_target_is_saved_and_run_fresh() -> None:
    """No target: the workload is torch.save'd once and each child loads it."""
    device = _device(GIB)
    measured = device.run(_picklable_workload(), Candidate(batch_size=64), steps=3)
    assert device.mode == "fork_server" and measured.steps == 3
    device.close()


@gpu
def test_an_unpicklable_workload_falls_back_in_process_from_a_clean_state() -> None:
    """A loss holding a lock pickles by no means (cloudpickle sends lambdas, not locks): runs
    happen in this process, the fallback is noted, and after each run the allocator is back
    to its baseline."""
    import threading

    workload = _picklable_workload()
    lock = threading.Lock()

    def loss_fn(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        with lock:
            return (out - batch).abs().mean()

    workload.loss_fn = loss_fn
    device = _device(GIB)
    # cuBLAS keeps a workspace from this process's first matmul on: not the run's to free.
    warm = torch.nn.Linear(16, 16).cuda()
    warm(torch.ones(4, 16, device="cuda")).sum().backward()
    del warm
    baseline = torch.cuda.memory_allocated()
    for batch in (64, 128):
        measured = device.run(workload, Candidate(batch_size=batch), steps=3)
        assert measured.steps == 3 and measured.peak_bytes <= GIB
        assert torch.cuda.memory_allocated() == baseline
    assert device.mode == "in_process"
    assert any("in this process" in n for n in device.notes)


@gpu
def test_in_process_out_of_memory_leaves_no_leak() -> None:
    """After an in-process run that ran out, the next run starts from the same baseline."""
    workload = _picklable_workload(width=16)
    workload.loss_fn = lambda out, batch: (out - batch).abs().mean()
    device = _device(64 * MIB, fresh_process=False)
    baseline = torch.cuda.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError):
        device.run(workload, Candidate(batch_size=200_000), steps=2)
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_allocated() == baseline
    assert device.run(workload, Candidate(batch_size=8), steps=2).steps == 2
    assert not any("stayed allocated" in n for n in device.notes)


@gpu
def test_a_child_error_that_is_not_memory_is_reported_as_such() -> None:
    """A batch the model rejects is BadInputError in the parent too, not an OOM answer."""
    workload = _picklable_workload(width=17)  # Linear(16, ...) cannot take 17 features
    with pytest.raises(BadInputError, match="rejected the batch"):
        _device(GIB).run(workload, Candidate(batch_size=8), steps=2)


@gpu
def test_plan_on_cuda_is_verified_under_the_budget_and_the_allocator_holds_no_more() -> None:
    """plan() on the card: the pick ran its sustained steps under the budget (reserved
    included), and this process's allocator holds no more than before planning."""
    built = load_target(GPT)
    model = built.model.cuda()
    torch.cuda.synchronize()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    result = memadvisor.plan(
        model,
        built.sample_batch,
        loss_fn=built.loss_fn,
        budget_gb=1,
        device="cuda",
        progress=False,
        **QUICK,
    )
    assert result.device_kind == "cuda" and result.verified is not None
    assert result.verified.steps == QUICK["verify_steps"]
    assert result.verified.reserved_peak_bytes <= result.config.budget_bytes
    # Few runs, all children of the fork server: each candidate timed once (2 best by the
    # estimate + the Baseline/+AMP guards + the best of each choice only the device tells
    # apart, TF32 on a card that has it: at most 5), the winner's search continuing from
    # its timing run to the edge (the measured margin: a run that runs out, then the headroom
    # below it and a bisection; at 1 GiB a GPT's fragmentation moved the edge to 0.85 of the
    # allocated bytes' extrapolation), and its verification.
    runs = [p for p in result.probes if p.stage in ("timing", "probe", "verify")]
    picked = {k: v for k, v in result.candidate.choices.items() if k != "batch_size"}
    winner = [p for p in runs if p.candidate.choices == picked]  # batch_size: the pick's record
    # Short enough that a failure prints every run (pytest cut a list of tuples at six):
    # "timing b442 fits; probe b582 OOM; ...", each with its choices.
    tried = "; ".join(_run_words(p) for p in runs)
    print(f"runs: {tried}")  # for the card's log (pytest -s), pass or fail
    timed = [p for p in runs if p.stage == "timing"]
    assert len(timed) <= 5 and len(runs) <= 11 and len(winner) <= 7, tried
    # The edge was measured (a run ran out), and the pick stays below its own choices' edge.
    assert any(not p.fits for p in runs), tried
    failed = [p.batch_size for p in winner if not p.fits]
    assert not failed or result.candidate.batch_size < min(failed), tried
    stepped_down = any("stepped down" in n for n in result.notes)
    # A compiled pick was searched with a dynamic batch and is verified static: a run of its
    # own (the card's run of 2026-11-26: the regional compile at 555 after probes of eager).
    compiled = "compile" in result.candidate.choices
    assert stepped_down or compiled or not [p for p in runs if p.stage == "verify"], tried
    assert not any("fresh process each" in n for n in result.notes), result.notes
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= allocated
    assert torch.cuda.memory_reserved() <= reserved


@gpu
def test_runs_made_at_once_on_the_card_measure_what_runs_alone_measure() -> None:
    """Three runs of the GPT example made at once (children of one fork server, timed steps
    in turn) each measure the allocated peak the same run measures alone, and one past the
    budget runs out without touching the others."""
    device = _device(1024 * MIB, target=GPT)
    workload = load_target(GPT)
    try:
        assert device.capabilities.concurrent_runs >= 3
        alone = [device.run(workload, Candidate(batch_size=b), steps=3) for b in (1, 2)]
        together = device.run_many(
            workload,
            [(Candidate(batch_size=1), 3), (Candidate(batch_size=4096), 3),
             (Candidate(batch_size=2), 3)],
        )  # fmt: skip
    finally:
        device.close()
    assert is_oom(together[1]), together[1]
    for single, joint in zip(alone, (together[0], together[2]), strict=True):
        assert not isinstance(joint, Exception), joint
        print(f"alone {single.peak_bytes} B {single.step_ms:.1f} ms; "
              f"at once {joint.peak_bytes} B {joint.step_ms:.1f} ms")  # fmt: skip
        assert joint.peak_bytes == single.peak_bytes


@gpu
def test_a_run_that_runs_out_is_retried_at_the_smaller_batch_in_its_own_child() -> None:
    """Rule: through the fork server, a run given ``retry_at`` that runs out of memory trains
    that smaller batch in the same child (Device.run_many_retrying): its answer is that
    batch's measurement, ``ran_out_first`` saying what ran out, its allocated peak what the
    same batch measures in a fresh child (within 1%: the failed step's memory freed), in a
    group of runs made at once and alone. A run that fits keeps its own batch."""
    device = _device(1024 * MIB, target=GPT)
    workload = load_target(GPT)
    try:
        assert device.capabilities.retries_in_process
        alone = device.run(workload, Candidate(batch_size=2), steps=3)
        together = device.run_many_retrying(
            workload,
            [(Candidate(batch_size=4096), 3, 2), (Candidate(batch_size=1), 3, None)],
        )
        single = device.run_many_retrying(workload, [(Candidate(batch_size=4096), 3, 2)])
    finally:
        device.close()
    for retried in (together[0], single[0]):
        assert not isinstance(retried, Exception), retried
        assert retried.ran_out_first is not None and retried.ran_out_first.batch_size == 4096
        print(f"fresh b2 {alone.peak_bytes} B; retried b2 {retried.peak_bytes} B")
        assert abs(retried.peak_bytes - alone.peak_bytes) <= 0.01 * alone.peak_bytes
    assert not isinstance(together[1], Exception) and together[1].ran_out_first is None


def _run_words(p) -> str:
    """``'probe b582 OOM precision=bf16 checkpointing=4'``: a run in a few words."""
    choices = " ".join(
        f"{k}={len(v) if isinstance(v, list) else v}"
        for k, v in sorted(p.candidate.choices.items())
        if k != "optimizer_habits"
    )
    return f"{p.stage} b{p.batch_size} {'fits' if p.fits else 'OOM'} {choices}"


@gpu
def test_optimize_on_cuda_keeps_the_caller_state() -> None:
    """optimize() on the card: weights and train/eval flags of the caller's model unchanged."""
    built = load_target(GPT)
    model = built.model.cuda()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    modes = [m.training for m in model.modules()]
    tuned = memadvisor.optimize(
        model,
        built.sample_batch,
        loss_fn=built.loss_fn,
        budget_gb=1,
        device="cuda",
        progress=False,
        **QUICK,
    )
    assert tuned is model and tuned.memadvisor_plan.verified is not None
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert [m.training for m in model.modules()] == modes


def test_a_saved_workload_using_a_target_file_loads_in_a_fresh_process(tmp_path: Path) -> None:
    """A workload whose model comes from a file loaded by path (the GPT example's class)
    pickles by that module's name; the probe process loads the file under the same name
    first, so it unpickles the workload (no CUDA needed for this part)."""
    import json
    import subprocess
    import sys

    from memadvisor.device.cuda import _target_files

    workload = load_target(GPT)
    path = tmp_path / "workload.pt"
    torch.save(
        {
            "model": workload.model,
            "sample_batch": workload.sample_batch,
            "loss_fn": workload.loss_fn,
            "optimizer": None,
            "make_batch": None,
            "forward_fn": None,
        },
        path,
    )
    request = {"target": None, "workload_path": str(path), "target_files": _target_files()}
    assert any(f.endswith("gpt.py") for f in request["target_files"])
    code = (
        "import json, sys; from memadvisor.device._worker import _load_workload; "
        f"w = _load_workload(json.loads({json.dumps(json.dumps(request))})); "
        "print(type(w).__name__, type(w.model).__name__, w.sample_batch_size)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["Workload", "GPT", str(workload.sample_batch_size)]


def test_the_answer_line_is_found_among_whatever_the_model_printed() -> None:
    """The child's answer is the last line with the marker, whatever else it printed."""
    from memadvisor.device._train import RESULT_MARKER
    from memadvisor.device.cuda import _parse_answer

    out = (
        f'loss 1.0\n{RESULT_MARKER}{{"status": "old"}}\nstep 2\n{RESULT_MARKER}{{"status": "ok"}}\n'
    )
    assert _parse_answer(out) == {"status": "ok"}
    assert _parse_answer("the model printed only this\n") is None


def test_the_fork_server_path_of_cuda_device_on_the_cpu(monkeypatch, tmp_path: Path) -> None:
    """CudaDevice's fork-server path without a card (the card's properties faked here, a CPU
    runner in the children): a fit is a Measurement, an out-of-memory answer is an error
    is_oom accepts with the steps that finished, a child's own error and a child killed by a
    signal are PlanningErrors, the same zygote serves every run until the environment
    changes, and close() ends it."""
    from memadvisor.errors import PlanningError

    device, helpers = _stub_runner_device(monkeypatch)
    workload = load_target(f"{helpers}:build")
    try:
        measured = device.run(workload, Candidate(batch_size=3), steps=2)
        assert device.mode == "fork_server" and measured.steps == 2
        zygote = device._zygote
        with pytest.raises(torch.OutOfMemoryError) as caught:
            device.run(workload, Candidate(batch_size=1000), steps=3)
        assert is_oom(caught.value) and caught.value.memadvisor_steps_completed == 1
        with pytest.raises(PlanningError, match="KeyError"):
            device.run(workload, Candidate(batch_size=13), steps=2)
        with pytest.raises(PlanningError, match="SIGKILL"):
            device.run(workload, Candidate(batch_size=666), steps=2)
        again = device.run(workload, Candidate(batch_size=3), steps=2)
        assert device._zygote is zygote and again.peak_bytes != measured.peak_bytes  # pids
        # The environment changed (as the compile stage points inductor's cache elsewhere):
        # the stale zygote is closed and a new one, started with it, serves the next run.
        monkeypatch.setenv("MEMADVISOR_TEST_MARK", "changed")
        assert device.run(workload, Candidate(batch_size=3), steps=2).steps == 2
        assert device._zygote is not zygote and zygote.process.poll() == 0
        assert device.notes == []
    finally:
        device.close()


def test_a_prestarted_fork_server_serves_the_first_run_and_gets_the_profile_then(
    monkeypatch, tmp_path: Path
) -> None:
    """Rule: prestart() starts the fork server without waiting (its imports and the model's
    build overlap the plan's profiling); the first run waits for it, uses that same server
    (no second start) and hands it the profile set on the device after it started."""
    from memadvisor.profiler import profile_workload

    device, helpers = _stub_runner_device(monkeypatch)
    workload = load_target(f"{helpers}:build")
    try:
        device.prestart(workload)
        zygote = device._zygote
        assert zygote is not None and zygote.alive and device._pending
        profile = profile_workload(workload, device="cpu", precisions=["fp32"])
        device.profile = profile
        # The stub runner answers batch 321 with its profile's name length.
        first = device.run(workload, Candidate(batch_size=321), steps=1)
        assert device._zygote is zygote and not device._pending
        assert first.reserved_peak_bytes == len(profile.model_name) > 0
        assert device.run(workload, Candidate(batch_size=3), steps=2).steps == 2
        assert device._zygote is zygote and device.notes == []
    finally:
        device.close()
    assert zygote.process is not None and zygote.process.poll() is not None


def test_closing_a_device_whose_fork_server_is_still_starting_kills_it_at_once(
    monkeypatch,
) -> None:
    """A plan that fails during profiling closes a server still in its setup: killed, not
    asked to exit (it reads no request until its setup ends)."""
    device, helpers = _stub_runner_device(monkeypatch)
    device.prestart(load_target(f"{helpers}:build"))
    zygote = device._zygote
    assert zygote is not None
    t0 = time.perf_counter()
    device.close()
    assert zygote.process is not None and zygote.process.poll() is not None
    assert time.perf_counter() - t0 < 2.0


def _concurrent_stub_device(
    monkeypatch, tmp_path: Path, free_bytes: int = 70 * GIB, cores: int = 64
) -> tuple:
    """_stub_runner_device with the fake card's free bytes and the host's ``cores`` (for
    concurrent_runs) and the stub's TURN_BATCHES runs recording their times under
    ``tmp_path``."""
    from tests.device import zygote_runner

    monkeypatch.setattr("memadvisor.device.cuda.usable_cores", lambda: cores)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (free_bytes, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setenv(zygote_runner.TIMES_VARIABLE, str(tmp_path))
    device, helpers = _stub_runner_device(monkeypatch)
    return device, helpers, zygote_runner


def test_run_many_makes_runs_at_once_through_the_fork_server(monkeypatch, tmp_path: Path) -> None:
    """Rule: CudaDevice.run_many sends up to concurrent_runs runs to the fork server at once:
    the answers come back in order, each its run's (a Measurement, an out-of-memory error
    is_oom accepts with its steps, a PlanningError for a child killed by a signal), the
    fitted runs from children of their own that started before either finished its first
    step, all from the one zygote, and the device stays on it."""
    from memadvisor.errors import PlanningError
    from memadvisor.schema.candidate import Measurement

    device, helpers, stub = _concurrent_stub_device(monkeypatch, tmp_path, cores=8)
    workload = load_target(f"{helpers}:build")
    try:
        assert device.capabilities.concurrent_runs == 4  # 8 cores, 2 a run
        runs = [(Candidate(batch_size=b), 2) for b in (40, 1000, 666, 41)]
        answers = device.run_many(workload, runs)
        assert len(answers) == 4
        first, ran_out, killed, last = answers
        assert isinstance(first, Measurement) and isinstance(last, Measurement), answers
        assert isinstance(ran_out, torch.OutOfMemoryError) and is_oom(ran_out)
        assert ran_out.memadvisor_steps_completed == 1
        assert isinstance(killed, PlanningError) and "SIGKILL" in str(killed)
        assert first.peak_bytes != last.peak_bytes  # the stub's pids
        recorded = [stub.times(tmp_path, m.peak_bytes) for m in (first, last)]
        assert [r["batch"] for r in recorded] == [40, 41]
        assert max(r["started"] for r in recorded) < min(r["first_done"] for r in recorded)
        assert len({r["lock"] for r in recorded}) == 1 and recorded[0]["lock"] is not None
        zygote = device._zygote
        assert zygote is not None and zygote.alive and device.mode == "fork_server"
        assert device.run(workload, Candidate(batch_size=3), steps=2).steps == 2
        assert device._zygote is zygote and device.notes == []
    finally:
        device.close()


def test_a_retry_goes_to_the_fork_servers_child_and_its_answer_comes_back(
    monkeypatch, tmp_path: Path
) -> None:
    """Rule: CudaDevice.run_many_retrying sends each run's ``retry_at`` to its child (the
    stub runner stands for train_candidate's retry there), at once and alone, and the
    answer comes back as the retry's Measurement with ``ran_out_first``; a run given no
    retry that runs out is an out-of-memory error, as run_many answers it. The device says
    it retries in the run's process."""
    from memadvisor.schema.candidate import Measurement

    device, helpers, _ = _concurrent_stub_device(monkeypatch, tmp_path)
    workload = load_target(f"{helpers}:build")
    try:
        assert device.capabilities.retries_in_process
        answers = device.run_many_retrying(
            workload,
            [(Candidate(batch_size=1000), 2, 500), (Candidate(batch_size=1001), 2, None)],
        )
        alone = device.run_many_retrying(workload, [(Candidate(batch_size=1002), 2, 7)])
    finally:
        device.close()
    retried, ran_out = answers
    for answer, batch, retry in ((retried, 1000, 500), (alone[0], 1002, 7)):
        assert isinstance(answer, Measurement), answer
        assert answer.ran_out_first is not None and answer.ran_out_first.batch_size == batch
        assert answer.samples_per_s == retry  # the stub's word for the batch it was given
    assert is_oom(ran_out), ran_out


def test_run_many_makes_no_more_at_once_than_the_card_has_room_for(
    monkeypatch, tmp_path: Path
) -> None:
    """Rule: concurrent_runs is what the card's free bytes hold beyond a reserve, at the budget
    and a CUDA context each (at most MAX_CONCURRENT_RUNS; at least 1), and run_many makes
    its runs in groups of that many: with room for 2 (1 GiB runs, 6 GiB free), the third of
    three runs starts only after the first two ended."""
    from memadvisor.device.cuda import MAX_CONCURRENT_RUNS, PER_PROCESS_BYTES, RESERVE_BYTES

    free = RESERVE_BYTES + 2 * (GIB + PER_PROCESS_BYTES)
    device, helpers, stub = _concurrent_stub_device(monkeypatch, tmp_path, free_bytes=free)
    workload = load_target(f"{helpers}:build")
    try:
        assert device.capabilities.concurrent_runs == 2 < MAX_CONCURRENT_RUNS
        answers = device.run_many(workload, [(Candidate(batch_size=b), 2) for b in (40, 41, 42)])
        recorded = [stub.times(tmp_path, m.peak_bytes) for m in answers]
        assert [r["batch"] for r in recorded] == [40, 41, 42]
        assert recorded[1]["started"] < recorded[0]["first_done"]
        assert recorded[2]["started"] > max(r["turn_to"] for r in recorded[:2])
        assert recorded[2]["lock"] is None  # a group of one is a single run
    finally:
        device.close()


def test_runs_at_once_take_two_of_the_hosts_cores_each(monkeypatch, tmp_path: Path) -> None:
    """Rule: a fork server makes no more runs at once than the host's cores hold at
    CORES_PER_RUN each (each child's compile runs on the CPU), however much the card holds,
    and at least one: 3 on 6 cores, 1 on 1 core, MAX_CONCURRENT_RUNS on 64."""
    from memadvisor.device.cuda import CORES_PER_RUN, MAX_CONCURRENT_RUNS, CudaDevice

    _concurrent_stub_device(monkeypatch, tmp_path)[0].close()  # the fake card's patches
    device = CudaDevice(GIB)
    try:
        for cores, runs in ((6, 3), (1, 1), (64, MAX_CONCURRENT_RUNS)):
            monkeypatch.setattr("memadvisor.device.cuda.usable_cores", lambda c=cores: c)
            assert device.capabilities.concurrent_runs == runs, (cores, CORES_PER_RUN)
    finally:
        device.close()


def test_concurrent_runs_are_a_fork_servers_only(monkeypatch, tmp_path: Path) -> None:
    """Rule: runs are made at once only by a fork server's children, and only as many as the
    free bytes hold: 1 for a device of fresh processes or of this process, 1 on a card
    without room for two, MAX_CONCURRENT_RUNS on an 80 GiB card at a 1 GiB budget. So are a
    run's retries in its own process (a fresh process per run retries in another)."""
    from memadvisor.device.cuda import MAX_CONCURRENT_RUNS, CudaDevice

    _concurrent_stub_device(monkeypatch, tmp_path)[0].close()  # the fake card's patches
    for kwargs in ({"fork_server": False}, {"fresh_process": False}):
        device = CudaDevice(GIB, **kwargs)
        try:
            assert device.capabilities.concurrent_runs == 1, kwargs
            assert not device.capabilities.retries_in_process, kwargs
        finally:
            device.close()
    device = CudaDevice(GIB)
    try:
        assert device.capabilities.concurrent_runs == MAX_CONCURRENT_RUNS
        assert device.capabilities.retries_in_process
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (3 * GIB, 80 * GIB))
        assert device.capabilities.concurrent_runs == 1
    finally:
        device.close()


def test_a_group_the_fork_server_cannot_fork_is_made_one_by_one_in_fresh_processes(
    monkeypatch, tmp_path: Path
) -> None:
    """Rule: run_many sends the group to the fork server at once; where it answers
    'unforkable' (its factory initialized CUDA), the device falls back to fresh processes,
    as a single run does, with a note, and makes each run of the group again, one by one,
    the answers in order."""
    from memadvisor.device._zygote import ForkServer
    from memadvisor.device.cuda import CudaDevice
    from memadvisor.schema.candidate import Measurement

    sent: list[int] = []
    run_many = ForkServer.run_many

    def spied(self, runs, timeout_s):
        sent.append(len(runs))
        return run_many(self, runs, timeout_s)

    monkeypatch.setattr(ForkServer, "run_many", spied)

    device, helpers, _ = _concurrent_stub_device(monkeypatch, tmp_path)
    device.close()
    device = CudaDevice(
        GIB,
        target=f"{helpers}:build_touching_cuda",
        runner=f"{helpers}:run",
        timeout_s=120,
    )
    made: list[int] = []

    def fresh(candidate: Candidate, steps: int) -> Measurement:
        made.append(candidate.batch_size)
        return Measurement(steps=steps, peak_bytes=candidate.batch_size, step_ms=1.0,
                           samples_per_s=1.0)  # fmt: skip

    monkeypatch.setattr(device, "_run_child", fresh)
    try:
        answers = device.run_many(
            load_target(f"{helpers}:build"), [(Candidate(batch_size=b), 2) for b in (4, 5, 6)]
        )
        assert sent == [3]
        assert [a.peak_bytes for a in answers] == [4, 5, 6] and made == [4, 5, 6]
        assert device.mode == "fresh_process" and device._zygote is None
        assert any("CUDA did not start in a forked child" in n for n in device.notes)
        assert device.capabilities.concurrent_runs == 1
    finally:
        device.close()


def test_a_retry_that_ran_out_too_in_the_child_says_so_in_the_parents_error() -> None:
    """Rule: where a run's retry in its own child ran out too (train_candidate raises the
    first batch's error with ``memadvisor_retry_ran_out``), the child's answer carries the
    retry's batch and the parent's out-of-memory error has it again; an error without it
    carries none."""
    from memadvisor.device._zygote import _error_answer
    from memadvisor.device.cuda import _measurement

    def fall_back(reason: str) -> None:
        raise AssertionError(reason)

    answers = []
    for retried in (500, None):
        error = torch.OutOfMemoryError("fake: batch 1000 does not fit")
        error.memadvisor_steps_completed = 1
        if retried is not None:
            error.memadvisor_retry_ran_out = retried
            error.memadvisor_retry_same_process = True
        try:
            raise error
        except torch.OutOfMemoryError as e:
            answers.append(_error_answer(e))
    assert answers[0]["retry_ran_out"] == 500 and "retry_ran_out" not in answers[1], answers
    for answer, retried in zip(answers, (500, None), strict=True):
        with pytest.raises(torch.OutOfMemoryError) as caught:
            _measurement(answer, Candidate(batch_size=1000), fall_back)
        assert getattr(caught.value, "memadvisor_retry_ran_out", None) == retried
        same = getattr(caught.value, "memadvisor_retry_same_process", None)
        assert same is (True if retried else None)
        assert caught.value.memadvisor_steps_completed == 1


def test_a_childs_user_code_error_is_bad_input_in_the_parent_whatever_its_subclass() -> None:
    """The child says whether its error was bad input (a UserCodeError is one): the parent
    raises BadInputError (exit 2), not PlanningError, for every subclass; other errors stay
    PlanningError. (Matching the type's name missed UserCodeError.)"""
    from memadvisor.device._zygote import _error_answer
    from memadvisor.device.cuda import _measurement
    from memadvisor.errors import PlanningError, UserCodeError

    def fall_back(reason: str) -> None:
        raise AssertionError(reason)

    candidate = Candidate(batch_size=8)
    try:
        raise UserCodeError("The model (Net) rejected the batch: shapes (8x17 and 16x4)")
    except UserCodeError as e:
        answer = _error_answer(e)
    with pytest.raises(BadInputError, match="rejected the batch"):
        _measurement(answer, candidate, fall_back)
    try:
        raise KeyError("ours")
    except KeyError as e:
        answer = _error_answer(e)
    with pytest.raises(PlanningError, match="KeyError"):
        _measurement(answer, candidate, fall_back)
