"""Jobs spread over a machine's cards, one job a card at a time, within one device call.

A lent machine of several cards costs its device time per machine, not per card, and one
command may run 600 s: the benches of issue 27 (a plan, the user's loop, a hand cell) are
one card each, so four cards make four at once. This runs a file of jobs, one shell command
a line (``#`` comments; a job of several commands joins them with ``&&`` or ``;``), each
with ``CUDA_VISIBLE_DEVICES`` set to a free card, in the file's order, as cards free up,
and starts none after ``--start-by`` seconds (a job that starts late would be cut); at
``--deadline-s`` every job still running gets SIGINT (a bench writes what it has), then
SIGKILL 15 s later. Every ``--every`` seconds one line says what each card runs and its
job's last output line (a killed call returns only what it printed). Each job's output goes
to ``OUT/jobs.log``, each line prefixed by the job's number, so a call returns one file of
logs beside the benches' own JSON lines and plans (a call returns at most 8 files).

A line ``wait`` is a barrier: the jobs after it start once every job before it has ended. A
user's loop or a hand cell timed beside plans that compile shares the host's cores with
their compile workers (session 17: hf_gpt2's loop ran 0.87 of its verified rate beside three
plans, its quarters' medians 46.6k to 52.3k samples/s); put such timings after a ``wait``.

    python3 bench/cards.py --jobs bench/jobs/issue27.txt --out $OUT --deadline-s 560
    python3 bench/cards.py --jobs J --cards 2                  # CPU smoke: no card needed

In a job, ``$OUT`` is the output folder and ``{card}`` the card's number.

``--split-cores`` gives each card's jobs their own share of this process's cores (card c of
k takes the c-th of k equal slices of the affinity list), so two plans side by side on a
machine of two cards each see the cores one card's machine has (a plan sizes its runs at
once by its usable cores, 2 each) and their compile workers do not take each other's.

    python3 bench/cards.py --jobs J --out $OUT --split-cores     # nvidia-h200-x2: 16 each

Known limitations:
    * A job is one card; a job of two cards (ranks) is not scheduled.
    * Jobs side by side share the host's cores: a plan's compile stage is CPU-bound, so a
      plan's wall beside others is not its wall alone (docs/design.md, session 16's calls).
      ``--split-cores`` splits the cores; memory bandwidth, disk and the inductor cache's
      folder (a job's own unless it sets one) stay shared.
    * The order is the file's: the longest jobs first keep the call short.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Job:
    number: int
    command: str
    card: int | None = None
    process: subprocess.Popen | None = None
    started: float | None = None
    ended: float | None = None
    returncode: int | None = None
    last_line: str = ""
    after_wait: bool = False  # a ``wait`` line stands before it: it starts on an idle machine


BARRIER = "wait"


def _default_sigint() -> None:
    """In a job's process before it runs bash: SIGINT back to its default action."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def core_share(card: int, cards: int, cores: list[int]) -> list[int]:
    """Card ``card``'s slice of ``cores`` when ``cards`` cards split them equally, in order.

    Raises:
        ValueError: fewer cores than cards.
    """
    if len(cores) < cards:
        raise ValueError(
            f"--split-cores: {len(cores)} cores for {cards} cards; run without --split-cores"
        )
    ordered = sorted(cores)
    size = len(ordered) // cards
    return ordered[card * size : (card + 1) * size]


def read_jobs(text: str) -> list[Job]:
    """The jobs of a file's text: one command a line; blank lines and ``#`` comments out; a
    line ``wait`` marks the next job to start only once every job before it has ended."""
    commands = [line.strip() for line in text.splitlines()]
    commands = [c for c in commands if c and not c.startswith("#")]
    jobs: list[Job] = []
    barrier = False
    for command in commands:
        if command == BARRIER:
            barrier = True
            continue
        jobs.append(Job(number=len(jobs) + 1, command=command, after_wait=barrier))
        barrier = False
    return jobs


def count_cards() -> int:
    """The cards this process may use: ``CUDA_VISIBLE_DEVICES`` where set, else nvidia-smi's
    list; 0 where neither says."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([c for c in visible.split(",") if c.strip()])
    try:
        listed = subprocess.run(
            ["nvidia-smi", "--list-gpus"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.SubprocessError):
        return 0
    return len([line for line in listed.stdout.splitlines() if line.startswith("GPU ")])


def run_jobs(
    jobs: list[Job],
    cards: int,
    out: Path,
    *,
    deadline_s: float,
    start_by_s: float,
    every_s: float = 15.0,
    split_cores: bool = False,
    say=print,
) -> list[Job]:
    """Run ``jobs`` over ``cards`` cards (module docstring); returns them, each with its
    card, times and return code (None: never started, or killed without one).

    Raises:
        ValueError: no card to run on, or fewer cores than cards with ``split_cores``.
    """
    if cards < 1:
        raise ValueError(
            f"no card to run jobs on (cards={cards}): set CUDA_VISIBLE_DEVICES or pass --cards"
        )
    shares: dict[int, list[int]] = {}
    if split_cores:
        cores = list(os.sched_getaffinity(0))  # core_share orders them
        shares = {card: core_share(card, cards, cores) for card in range(cards)}
        for card, share in shares.items():
            say(f"card {card}: cores {share[0]}-{share[-1]} ({len(share)})")
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "jobs.log").open("a", buffering=1)
    t0 = time.monotonic()
    waiting = list(jobs)
    running: dict[int, Job] = {}
    last_said = t0
    interrupted = killed = False
    try:
        while waiting or running:
            now = time.monotonic() - t0
            for card in range(cards):
                if card in running or not waiting or now > start_by_s or interrupted:
                    continue
                if waiting[0].after_wait and running:
                    break  # a barrier: the jobs before it end first
                job = waiting.pop(0)
                _start(job, card, out, log, shares.get(card))
                job.started = now
                running[card] = job
                say(f"[{now:5.0f} s] job {job.number} on card {card}: {job.command[:150]}")
            for card, job in list(running.items()):
                _drain(job, log)
                if job.process is not None and job.process.poll() is not None:
                    _drain(job, log)
                    job.returncode, job.ended = job.process.returncode, time.monotonic() - t0
                    del running[card]
                    say(f"[{job.ended:5.0f} s] job {job.number} ended, rc {job.returncode}")
            if now > deadline_s and running and not interrupted:
                interrupted = True
                numbers = sorted(j.number for j in running.values())
                say(f"[{now:5.0f} s] deadline: SIGINT to jobs {numbers}")
                for job in running.values():
                    _signal(job, signal.SIGINT)
            if interrupted and not killed and now > deadline_s + 15 and running:
                killed = True
                for job in running.values():
                    _signal(job, signal.SIGKILL)
            if not running and (not waiting or now > start_by_s or interrupted):
                break
            if time.monotonic() - last_said >= every_s:
                last_said = time.monotonic()
                say(
                    f"[{now:5.0f} s] "
                    + " | ".join(
                        f"card {c}: job {j.number}: {j.last_line[:110]}"
                        for c, j in sorted(running.items())
                    )
                )
            time.sleep(0.2)
    finally:
        for job in running.values():
            _signal(job, signal.SIGKILL)
        log.close()
    for job in waiting:
        say(f"job {job.number} not started (past --start-by {start_by_s:g} s): {job.command[:150]}")
    return jobs


def _start(job: Job, card: int, out: Path, log, cores: list[int] | None = None) -> None:
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(card), "OUT": str(out)}
    command = job.command.replace("{card}", str(card))
    log.write(f"[job {job.number}] card {card}: {command}\n")
    job.card = card
    # A session of its own: a signal reaches the job's whole process group (bash and its
    # children), as a Ctrl-C in a terminal would. SIGINT as by default in it: started from a
    # shell's background (`... &`) this process ignores SIGINT, its children would inherit
    # that, and a bash that starts with SIGINT ignored cannot trap it, so the deadline's
    # SIGINT would reach no job and each would be killed 15 s later with nothing written.
    job.process = subprocess.Popen(
        ["bash", "-c", command],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
        preexec_fn=_default_sigint if cores is None else _pinned(cores),
    )
    os.set_blocking(job.process.stdout.fileno(), False)


def _pinned(cores: list[int]):
    """A ``preexec_fn``: SIGINT to its default, then the job's process (and what it starts)
    on ``cores`` only."""

    def pin() -> None:
        _default_sigint()
        os.sched_setaffinity(0, cores)

    return pin


def _drain(job: Job, log) -> None:
    """The job's output so far into the log, its last line kept."""
    if job.process is None or job.process.stdout is None:
        return
    while True:
        try:
            line = job.process.stdout.readline()
        except (BlockingIOError, ValueError):
            return
        if not line:
            return
        line = line.rstrip("\n")
        log.write(f"[job {job.number}] {line}\n")
        if line.strip():
            job.last_line = line.strip()


def _signal(job: Job, sig: int) -> None:
    if job.process is None or job.process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(job.process.pid, sig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", required=True, help="a file of jobs, one command a line")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results/cards"))
    parser.add_argument("--cards", type=int, help="default: the visible cards")
    parser.add_argument("--deadline-s", type=float, default=560.0)
    parser.add_argument(
        "--start-by",
        type=float,
        help="start no job after this (default: the deadline less 120 s, at least half of it)",
    )
    parser.add_argument("--every", type=float, default=15.0, help="seconds between progress lines")
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="each card's jobs on their own equal share of the cores",
    )
    args = parser.parse_args(argv)
    cards = args.cards if args.cards is not None else count_cards()
    jobs = read_jobs(Path(args.jobs).read_text())
    if not jobs:
        print(f"{args.jobs} has no job (one command a line)", file=sys.stderr)
        return 2
    default = max(args.deadline_s / 2, args.deadline_s - 120)
    start_by = args.start_by if args.start_by is not None else default
    try:
        done = run_jobs(
            jobs,
            cards,
            Path(args.out),
            deadline_s=args.deadline_s,
            start_by_s=start_by,
            every_s=args.every,
            split_cores=args.split_cores,
        )
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    failed = [j for j in done if j.returncode != 0]
    for j in done:
        took = (
            f"{j.ended - j.started:.0f} s" if j.started is not None and j.ended is not None else "-"
        )
        print(f"job {j.number}: card {j.card}, rc {j.returncode}, {took}: {j.command[:100]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
