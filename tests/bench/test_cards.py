"""bench/cards.py: jobs spread over a machine's cards, one job a card at a time, each told
its card, within a deadline; what each printed in one log."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
import cards  # noqa: E402


def _run(tmp_path: Path, text: str, n: int, **kw):
    jobs = cards.read_jobs(text)
    said: list[str] = []
    done = cards.run_jobs(jobs, n, tmp_path, every_s=0.5, say=said.append, **kw)
    return done, (tmp_path / "jobs.log").read_text(), said


def test_jobs_run_one_a_card_at_a_time_in_order_each_told_its_card(tmp_path: Path) -> None:
    """Rule: with 2 cards, 4 jobs run two at a time, in the file's order, each with
    CUDA_VISIBLE_DEVICES its own card and $OUT the output folder; no card runs two at once;
    every job's output is in jobs.log under its number."""
    text = "\n".join(
        f'echo "job{i} card=$CUDA_VISIBLE_DEVICES out=$OUT brace={{card}}"; sleep 0.6'
        for i in range(1, 5)
    )
    done, log, _ = _run(tmp_path, "# four jobs\n\n" + text, 2, deadline_s=60, start_by_s=50)
    assert [j.returncode for j in done] == [0, 0, 0, 0]
    assert [j.number for j in sorted(done, key=lambda j: j.started)] == [1, 2, 3, 4]
    for j in done:
        assert f"[job {j.number}] job{j.number} card={j.card} out={tmp_path} brace={j.card}" in log
    for card in (0, 1):
        spans = sorted((j.started, j.ended) for j in done if j.card == card)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False)), spans
    assert {j.card for j in done} == {0, 1}


@pytest.mark.parametrize("launched_ignoring_sigint", [False, True])
def test_past_the_deadline_a_job_is_interrupted_and_past_start_by_none_starts(
    tmp_path: Path, launched_ignoring_sigint: bool
) -> None:
    """Rule: at the deadline a running job gets SIGINT (a bench writes what it has, here a
    trap's line); a job that would start after --start-by does not start. Also where
    cards.py itself was started ignoring SIGINT (from a shell's background, `... &`): its
    jobs take SIGINT as by default."""
    if not launched_ignoring_sigint:
        _deadline_case(tmp_path)
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # what its jobs would inherit
    try:
        _deadline_case(tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)


def _deadline_case(tmp_path: Path) -> None:
    loop = "trap 'echo interrupted; exit 3' INT; echo started; while true; do sleep 0.1; done"
    text = loop + "\necho never"
    done, log, said = _run(tmp_path, text, 1, deadline_s=1.5, start_by_s=1.0)
    first, second = done
    assert first.returncode == 3 and "[job 1] interrupted" in log
    assert second.started is None and second.returncode is None and "never" not in log
    assert any("not started" in line for line in said)


def test_no_card_is_an_error_that_says_how_to_give_one(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES or pass --cards"):
        cards.run_jobs(cards.read_jobs("echo x"), 0, tmp_path, deadline_s=1, start_by_s=1)


def test_jobs_after_a_wait_line_start_only_once_every_job_before_it_has_ended(
    tmp_path: Path,
) -> None:
    """Rule: ``wait`` is a barrier: with 3 cards free, the job after it starts only after
    both jobs before it ended (the slow one too), and the jobs after it run side by side."""
    text = "sleep 1.2; echo a\necho b\nwait\necho c; sleep 0.6\necho d; sleep 0.6\n"
    done, log, _ = _run(tmp_path, text, 3, deadline_s=60, start_by_s=50)
    assert [j.command for j in done] == ["sleep 1.2; echo a", "echo b", "echo c; sleep 0.6",
                                         "echo d; sleep 0.6"]  # fmt: skip
    assert [j.returncode for j in done] == [0, 0, 0, 0]
    before, after = done[:2], done[2:]
    assert min(j.started for j in after) >= max(j.ended for j in before)
    assert after[1].started < after[0].ended  # side by side after the barrier


def test_with_split_cores_each_cards_jobs_run_on_their_own_share_of_the_cores(
    tmp_path: Path,
) -> None:
    """Rule: with split_cores, a job on card c of k sees only the c-th of k equal slices of
    the cores (os.sched_getaffinity in the job's own process), slices that do not overlap."""
    import os

    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 cores")
    show = f"{sys.executable} -c 'import os; print(\"cores\", sorted(os.sched_getaffinity(0)))'"
    done, log, said = _run(
        tmp_path,
        f"{show}; sleep 0.3\n{show}; sleep 0.3",
        2,
        deadline_s=60,
        start_by_s=50,
        split_cores=True,
    )
    assert [j.returncode for j in done] == [0, 0]
    cores = sorted(os.sched_getaffinity(0))
    for j in done:
        share = cards.core_share(j.card, 2, cores)
        assert f"[job {j.number}] cores {share}" in log, log
    assert not set(cards.core_share(0, 2, cores)) & set(cards.core_share(1, 2, cores))


def test_core_share_splits_in_order_and_refuses_fewer_cores_than_cards() -> None:
    """Rule: 32 cores over 2 cards are 0-15 and 16-31; 1 core for 2 cards is an error that
    says to run without the flag."""
    assert cards.core_share(1, 2, list(range(32))) == list(range(16, 32))
    assert cards.core_share(0, 2, list(range(31, -1, -1))) == list(range(16))
    with pytest.raises(ValueError, match="without --split-cores"):
        cards.core_share(0, 2, [5])
