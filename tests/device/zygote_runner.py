"""A workload factory and a runner for the fork server's CPU tests (not a test module).

The zygote loads both by path. The runner stands in for the CUDA one: special batches make
the child fail in each way a real run can, or stand for a compiled run made at once with
others (:data:`TURN_BATCHES`), and every other batch runs a real CPU step.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from memadvisor.schema.candidate import Measurement, RanOutFirst
from memadvisor.workload import train_step

BUG_BATCH = 13  # raises a KeyError: an error that is not out-of-memory
KILLED_BATCH = 666  # the child kills itself with SIGKILL before answering
LINGERING_BATCH = 777  # the child leaves a forked process holding its answer pipe open
SLOW_BATCH = 555  # the child says it started (its pid to $MEMADVISOR_TEST_STARTED), then sleeps
OOM_FROM = 1000  # from here on the child runs out of memory after one step
PROFILE_BATCH = (
    321  # answers with the profile the child got: reserved_peak_bytes, its name's length
)
# answers whether inductor's compiler was imported when the child began (reserved_peak_bytes
# 1, else 0), before this run imports anything
COMPILER_BATCH = 323
# A compiled run's shape: a first step (FIRST_STEP_S asleep, outside the turn), then its
# timed steps (TURN_S asleep) in the turn of the runs made with it, taken as train_candidate
# takes it; its times go to $MEMADVISOR_TEST_TIMES/<pid>.json where that is set.
TURN_BATCHES = range(40, 50)
FIRST_STEP_S = 1.0
SLOW_FIRST_BATCH = 49  # a slower compile than its siblings': SLOW_FIRST_STEP_S
SLOW_FIRST_STEP_S = 2.0
TURN_S = 0.25
TIMES_VARIABLE = "MEMADVISOR_TEST_TIMES"
_touched = {"runs": 0}  # a module global each child changes: the next child must not see it


def build() -> dict:
    """A model big enough that building it runs parallel CPU ops (OpenMP) in the zygote."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 2048), nn.ReLU(), nn.Linear(2048, 8))
    return {"model": model, "sample_batch": torch.randn(4, 64), "loss_fn": _loss}


def build_touching_cuda() -> dict:
    """A factory that leaves CUDA initialized (the flag set by hand: there is no card here)."""
    torch.cuda._initialized = True
    return build()


def build_registering_atexit() -> dict:
    """A factory that registers an exit handler (as a logger or tracker may): it writes the
    file ``$MEMADVISOR_TEST_ATEXIT`` names when the interpreter exits in an orderly way."""
    import atexit

    path = os.environ[ATEXIT_VARIABLE]
    atexit.register(lambda: Path(path).write_text(str(os.getpid())))
    return build()


ATEXIT_VARIABLE = "MEMADVISOR_TEST_ATEXIT"


def _loss(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
    return out.square().mean()


def run(workload, candidate, steps, context) -> Measurement:
    """One CPU run. peak_bytes carries this child's pid and reserved_peak_bytes the runs this
    module global had seen before, so a test can tell children apart and see their state."""
    batch_size = candidate.batch_size
    seen = _touched["runs"]
    _touched["runs"] += 1
    if batch_size == BUG_BATCH:
        raise KeyError("the model's own bug")
    if batch_size in TURN_BATCHES:
        return _in_turn(batch_size, steps, context)
    if batch_size == PROFILE_BATCH:
        named = len(context.profile.model_name) if context.profile is not None else 0
        return Measurement(
            steps=steps, peak_bytes=os.getpid(), reserved_peak_bytes=named, step_ms=1.0,
            samples_per_s=1.0,
        )  # fmt: skip
    if batch_size == COMPILER_BATCH:
        imported = int("torch._inductor.compile_fx" in sys.modules)
        return Measurement(
            steps=steps, peak_bytes=os.getpid(), reserved_peak_bytes=imported, step_ms=1.0,
            samples_per_s=1.0,
        )  # fmt: skip
    if batch_size == KILLED_BATCH:
        os.kill(os.getpid(), signal.SIGKILL)
    if batch_size == SLOW_BATCH:
        with open(os.environ["MEMADVISOR_TEST_STARTED"], "w") as f:
            f.write(str(os.getpid()))
        time.sleep(600)  # a run that outlasts any test: only a kill ends it
    if batch_size == LINGERING_BATCH and os.fork() == 0:
        time.sleep(20)  # as a pool process the run left behind: holds every inherited fd
        os._exit(0)
    retry = getattr(context, "retry_at", None)
    if batch_size >= OOM_FROM and retry:
        # Stands for train_candidate's retry: this batch ran out after a step, then the
        # retry's batch was measured in this child (its pid in peak_bytes, the batch as rate).
        first = RanOutFirst(batch_size=batch_size, message="fake: ran out", steps=1)
        return Measurement(
            steps=steps, peak_bytes=os.getpid(), step_ms=1.0, samples_per_s=float(retry),
            ran_out_first=first,
        )  # fmt: skip
    # A parallel CPU op (10^6 floats) after the fork: it hangs in a child forked after
    # OpenMP started its pool (the zygote builds single-threaded to prevent that).
    torch.randn(1_000_000).exp().sum()
    model = workload.model
    optimizer = workload.make_optimizer(model)
    batch = workload.batch(batch_size)
    t0 = time.perf_counter()
    for done in range(steps):
        if batch_size >= OOM_FROM and done == 1:
            error = torch.OutOfMemoryError(f"fake: batch {batch_size} does not fit\nmore text")
            error.memadvisor_steps_completed = done
            raise error
        train_step(workload, model, optimizer, batch)
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    return Measurement(
        steps=steps,
        peak_bytes=os.getpid(),
        reserved_peak_bytes=seen,
        step_ms=step_ms,
        samples_per_s=batch_size / step_ms * 1e3,
    )


def _in_turn(batch_size: int, steps: int, context) -> Measurement:
    """A first step outside the turn, the timed steps in it (:data:`TURN_BATCHES`); records
    when each began and ended (wall-clock seconds, comparable between processes) and the lock
    it was given. peak_bytes carries this child's pid."""
    from memadvisor.device._train import taking_turn

    started = time.time()
    time.sleep(SLOW_FIRST_STEP_S if batch_size == SLOW_FIRST_BATCH else FIRST_STEP_S)
    first_done = time.time()
    with taking_turn(context.turn_lock):
        turn_from = time.time()
        time.sleep(TURN_S)
        turn_to = time.time()
    folder = os.environ.get(TIMES_VARIABLE)
    if folder:
        record = {
            "batch": batch_size,
            "started": started,
            "first_done": first_done,
            "turn_from": turn_from,
            "turn_to": turn_to,
            "lock": context.turn_lock,
        }
        Path(folder, f"{os.getpid()}.json").write_text(json.dumps(record))
    return Measurement(
        steps=steps,
        peak_bytes=os.getpid(),
        step_ms=TURN_S * 1e3,
        samples_per_s=batch_size / TURN_S,
        first_step_ms=FIRST_STEP_S * 1e3,
    )


def times(folder: Path, pid: int) -> dict:
    """What the run of :data:`TURN_BATCHES` in the child ``pid`` recorded in ``folder``."""
    return json.loads((Path(folder) / f"{pid}.json").read_text())
