"""Issue 27's hand grid, and the largest batch that holds: what a person tuning by hand
would reach, to set a plan's pick against.

The grid is bf16 x {eager, compile} x checkpointing {none, half the blocks, all}: six cells,
each at its own largest batch that holds ``steps`` (20) steps in a fresh process, found by
running out of memory (:func:`largest_holding`: no headroom at all, unlike the planner's
pick). A cell is measured by the run that found its batch: samples/s and peak of those steps.

``merge_rows`` joins the JSON lines a bench wrote for one model in several calls (the plan
and the user's loop in one, the eager cells in another, the compiled cells in a third: each
call must stay within a device's time limit) and derives the ratios issue 27 asks for.

Known limitations:
    * "half the blocks" is the first half of checkpointing's own ranking (most bytes freed
      per ms recomputed first), not every other block: the strongest half a person could
      pick, so the grid is no easier to beat than a person's.
    * A compiled cell compiles the whole model (``{"compile": "default"}``) in every run, as
      a person's ``torch.compile(model)`` does; each new batch compiles again.
    * The search starts at the eager estimate's largest batch for the cell's choices, also
      for compiled cells (compile's memory is measured, not estimated), and extrapolates
      along the estimate's bytes per sample until two runs measured theirs: a cell whose
      runs never ran out (``lowest_oom`` None) found a batch that holds, not the largest.
    * A cell's runs are the planner's (``train_candidate``): a batch whose steps fit only by
      the allocator freeing its cache and retrying in most of them counts as running out
      there too (``AllocatorRetriesError``, session 22), where a person watching for OOMs
      alone would keep it and its slower steps.
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

GIB = 2**30
# A cell's search stops once its largest fit is within this fraction of the lowest batch that
# ran out: the last percent of batch moves a rate by less than the 0.97 the issue asks of the
# pick, and each run of a compiled cell compiles the whole model again (the GPT example's
# eager cells took 9-10 runs each, bisecting to the sample, on an H100).
HOLDING_WITHIN = 0.01

# cell -> (compiled, checkpointed share of the blocks)
GRID: dict[str, tuple[bool, str]] = {
    "eager": (False, "none"),
    "eager+half": (False, "half"),
    "eager+all": (False, "all"),
    "compile": (True, "none"),
    "compile+half": (True, "half"),
    "compile+all": (True, "all"),
}
GROUPS = {
    "grid": list(GRID),
    "eager": [c for c, (compiled, _) in GRID.items() if not compiled],
    "compile": [c for c, (compiled, _) in GRID.items() if compiled],
    "none": [],
}


def cells(spec: str) -> list[str]:
    """The cells ``spec`` names: a group (grid, eager, compile, none) or cells, commas between.
    A lone ``eager`` or ``compile`` is the group; its cell alone is ``eager+none`` or
    ``compile+none`` (session 16 ran ``--hand compile`` for the one cell and got three).

    Raises:
        ValueError: a name that is neither.
    """
    if spec in GROUPS:
        return list(GROUPS[spec])
    names = [c.removesuffix("+none") for c in spec.split(",") if c]
    unknown = [c for c in names if c not in GRID]
    if unknown:
        raise ValueError(
            f"unknown hand cells {unknown}; pass one of {sorted(GROUPS)} or cells of {list(GRID)}"
        )
    return names


def cell_choices(block_names: list[str], ranked: list[int], cell: str) -> dict[str, Any] | None:
    """The cell's strategy choices; None where it has no meaning (no blocks, or half of one).

    Args:
        block_names: the profile's blocks, in model order.
        ranked: their indices as checkpointing ranks them (best first).
    """
    compiled, share = GRID[cell]
    choices: dict[str, Any] = {"precision": "bf16"}
    if share != "none":
        if share == "all":
            picked = list(block_names)
        else:
            picked = [block_names[i] for i in ranked[: len(block_names) // 2]]
        if not picked:
            return None
        choices["checkpointing"] = picked
    if compiled:
        choices["compile"] = "default"
    return choices


@dataclass
class Holding:
    """The largest batch that held, the run that showed it, and every batch tried."""

    batch: int = 0
    measured: Any = None  # the Measurement of the run at ``batch``
    tried: list[tuple[int, bool]] = field(default_factory=list)
    lowest_oom: int | None = None
    static_from: int | None = None  # tried[static_from:] ran static (static_at_edge)

    def runs_text(self) -> str:
        """'20, 67, 91 OOM, 90 static': static marks the static form's runs at the edge."""
        start = len(self.tried) if self.static_from is None else self.static_from
        return ", ".join(
            f"{b}{'' if ok else ' OOM'}{' static' if i >= start else ''}"
            for i, (b, ok) in enumerate(self.tried)
        )


class CellInterrupted(KeyboardInterrupt):
    """A Ctrl-C during a cell's batch search, with what it found so far (``holding``): the
    largest batch that held until then, a lower bound of the cell's, and its run."""

    def __init__(self, holding: Holding) -> None:
        super().__init__()
        self.holding = holding


def largest_holding(
    run: Callable[[int], Any],
    start: int,
    budget_bytes: int,
    max_batch: int,
    is_oom: Callable[[BaseException], bool],
    slope_bytes: float | None = None,
    say: Callable[[str], None] | None = None,
) -> Holding:
    """The largest batch ``run(b)`` holds, found by running out of memory: from ``start``
    (halved until a batch holds, where it ran out), extrapolate along the measured allocated
    bytes per sample to where they fill ``budget_bytes`` (up to four times), then step below
    the lowest batch that ran out and bisect: the planner's batch search with no headroom.

    Args:
        run: trains batch ``b`` from a clean state and returns its Measurement, or raises.
        is_oom: whether an exception ``run`` raised is an out-of-memory (an answer); any
            other is re-raised.
        slope_bytes: bytes per sample to extrapolate along until two runs measured theirs
            (the estimate's); None takes the first run's peak over its batch, weights
            included, which falls short of the edge by a run.
        say: told each run as it ends (its batch, held or out, seconds): a compiled cell's
            runs each compile anew (t5_base's three compiled cells printed nothing in 510 s
            on an H100, session 17).

    Raises:
        CellInterrupted: a Ctrl-C, with the largest batch that held so far.
    """
    from memadvisor.planner import find_batch

    measured: dict[int, Any] = {}
    held: dict[int, bool] = {}
    tried: list[tuple[int, bool]] = []

    def fits(batch: int) -> bool:
        if batch in held:  # the search may ask again for the batch it started from
            return held[batch]
        t0 = time.perf_counter()
        try:
            measured[batch] = run(batch)
            held[batch] = True
        except KeyboardInterrupt:
            good = [b for b, ok in tried if ok]
            best = max(good, default=0)
            bad = [b for b, ok in tried if not ok]
            raise CellInterrupted(
                Holding(best, measured.get(best), list(tried), min(bad) if bad else None)
            ) from None
        except Exception as e:
            if not is_oom(e):
                raise
            held[batch] = False
        tried.append((batch, held[batch]))
        if say is not None:
            rate = f", {measured[batch].samples_per_s:.1f}/s" if held[batch] else ""
            words = "held" if held[batch] else "ran out"
            say(f"batch {batch} {words} ({time.perf_counter() - t0:.0f} s{rate})")
        return held[batch]

    def extrapolate(batch: int) -> int | None:
        if batch not in measured:
            return None
        fitted = sorted(measured)
        peak = measured[batch].peak_bytes
        if len(fitted) >= 2:
            high, low = measured[fitted[-1]].peak_bytes, measured[fitted[-2]].peak_bytes
            slope = (high - low) / (fitted[-1] - fitted[-2])
        else:  # weights included in peak / batch: a slope too steep, short of the edge
            slope = slope_bytes if slope_bytes else peak / batch
        if slope <= 0:
            return None
        return batch + max(1, math.ceil((budget_bytes - peak) / slope))

    batch = min(max(1, start), max_batch)
    while not fits(batch):  # far above the edge: halve to a batch that holds, then climb
        if batch == 1:
            return Holding(tried=tried, lowest_oom=1)
        max_batch = batch - 1
        batch = max(1, batch // 2)
    found = find_batch(
        fits,
        batch,
        batch + 1,
        0.0,
        max_batch,
        extrapolate=extrapolate,
        below=lambda failed: failed - 1,
        max_extrapolations=4,
        descend=True,
        within=HOLDING_WITHIN,
    )
    failures = [b for b, ok in tried if not ok]
    return Holding(
        batch=found.batch,
        measured=measured.get(found.batch),
        tried=tried,
        lowest_oom=min(failures) if failures else None,
    )


def cell_record(cell: str, choices: dict[str, Any], holding: Holding, wall_s: float) -> dict:
    """One cell as the JSON line carries it: config, batch, samples/s, peak."""
    shown = dict(choices)
    if "checkpointing" in shown:
        shown["checkpointing"] = f"{len(shown['checkpointing'])} blocks"
    m = holding.measured
    record: dict[str, Any] = {
        "config": cell,
        "choices": shown,
        "batch": holding.batch,
        "samples_per_s": round(m.samples_per_s, 2) if m else None,
        "peak_gib": round(m.peak_bytes / GIB, 3) if m else None,
        "reserved_peak_gib": (
            round(m.reserved_peak_bytes / GIB, 3) if m and m.reserved_peak_bytes else None
        ),
        "step_ms": round(m.step_ms, 2) if m else None,
        "runs": holding.runs_text(),
        "lowest_oom": holding.lowest_oom,
        "wall_s": round(wall_s, 1),
    }
    if holding.batch == 0:
        record["error"] = "not even batch 1 held"
    return record


def measure_cell(
    cell: str,
    *,
    device: Any,
    workload: Any,
    profile: Any,
    config: Any,
    steps: int,
    say: Callable[[str], None] | None = None,
    dynamic_search: bool = True,
    draws: int = 1,
) -> dict[str, Any]:
    """``cell`` at its own largest batch holding ``steps`` steps on ``device``: its record
    (``skipped`` where the cell has no meaning for this model). Interrupted, the record
    keeps the largest batch that held so far, marked ``interrupted`` (a lower bound: it
    counts for no ratio, :func:`derive`). A compiled cell's edge is searched with a dynamic
    batch and measured static there (:func:`static_at_edge`) unless ``dynamic_search`` is
    False. ``draws`` > 1: the cell's form runs ``draws - 1`` more times at its batch, each a
    fresh process, and its rate is the median of all (:func:`more_draws`)."""
    from memadvisor.planner._space import SearchSpace
    from memadvisor.schema.candidate import Candidate
    from memadvisor.strategy import load_strategies
    from strategies.checkpointing import ranked_blocks

    names = [b.name for b in profile.blocks]
    choices = cell_choices(names, ranked_blocks(profile), cell)
    if choices is None:
        return {"config": cell, "skipped": f"no half or all of {len(names)} blocks"}
    space = SearchSpace(profile, load_strategies(config.strategies), config)
    scored = space.score_choices(choices)
    start = scored.largest_batch if scored is not None else 1
    t0 = time.perf_counter()
    searched = choices
    if dynamic_search and "compile" in choices:
        searched = {**choices, "compile": {"mode": "default", "dynamic_batch": True}}
    said = (lambda words: say(f"{cell}: {words}")) if say is not None else None
    try:
        holding = largest_holding(
            lambda b: device.run(workload, Candidate(batch_size=b, choices=searched), steps),
            start,
            config.budget_bytes,
            config.max_batch,
            device.is_oom,
            # eager's, from the start up: a compiled step keeps no more per sample, so its
            # first step falls short; below the start a fixed phase (the optimizer's update)
            # can flatten it (lm350m on a card: 0.05 GB a sample over [9, 18], 0.17 above 18)
            slope_bytes=_slope_above(space, choices, max(1, start)),
            say=said,
        )
        if searched is not choices and holding.batch:
            holding = static_at_edge(
                lambda b: device.run(workload, Candidate(batch_size=b, choices=choices), steps),
                holding,
                device.is_oom,
                say=said,
            )
    except CellInterrupted as stop:
        record = cell_record(cell, choices, stop.holding, time.perf_counter() - t0)
        record["interrupted"] = True
        return record
    extra: list[float | None] = []
    stopped = False
    if draws > 1 and holding.measured is not None:
        at_edge = Candidate(batch_size=holding.batch, choices=choices)
        extra, stopped = more_draws(
            lambda: device.run(workload, at_edge, steps), draws - 1, device.is_oom
        )
    record = cell_record(cell, choices, holding, time.perf_counter() - t0)
    if searched is not choices:
        record["edge_found"] = "dynamic batch, then static at that batch"
    if extra:
        with_draws(record, extra)
    if stopped:  # its batch and the draws so far stand; nothing more starts after it
        record["draws_stopped"] = True
    return record


def more_draws(
    run: Callable[[], Any], count: int, is_oom: Callable[[BaseException], bool]
) -> tuple[list[float | None], bool]:
    """``count`` more runs of a cell's form at its batch: each one's samples/s (None where it
    ran out of memory: the batch held once, not every time), and whether a Ctrl-C (a
    deadline's SIGINT) stopped them (the draws before it stand).

    Why: one form's rate differs between fresh processes on one host by up to 1.4x (the GPT
    example's pick, 23,718-33,770 samples/s in twelve processes, session 27), so one run
    per cell compares draws, not forms; the median of a few compares the forms."""
    rates: list[float | None] = []
    for _ in range(count):
        try:
            rates.append(run().samples_per_s)
        except KeyboardInterrupt:
            return rates, True
        except Exception as e:
            if not is_oom(e):
                raise
            rates.append(None)
    return rates, False


def with_draws(record: dict[str, Any], extra: list[float | None]) -> dict[str, Any]:
    """The cell's record with every draw (``samples_per_s_each``: the edge's run first), its
    rate their median, and ``draw_ooms`` (draws that ran out at the batch that held)."""
    each = [record["samples_per_s"], *(round(r, 2) if r is not None else None for r in extra)]
    measured = [r for r in each if r is not None]
    record["samples_per_s_each"] = each
    record["samples_per_s_first"] = record["samples_per_s"]
    record["samples_per_s"] = round(statistics.median(measured), 2) if measured else None
    record["draw_ooms"] = sum(1 for r in each if r is None)
    return record


def static_at_edge(
    run: Callable[[int], Any],
    dynamic: Holding,
    is_oom: Callable[[BaseException], bool],
    say: Callable[[str], None] | None = None,
) -> Holding:
    """The static form's run at the edge a dynamic-batch search found (``dynamic``), the
    cell's measurement; where it runs out, 2% less each time (at least one) until one holds.

    Why: a compiled cell's static graph compiles again for each batch in each process
    (t5_base's three compiled cells found nothing in 510 s on an H100, session 17); with a
    dynamic batch one graph, cached on disk, serves the search's every run, and the static
    form, which a person's ``torch.compile(model)`` runs, compiles once more here.

    Known limitations: the static form's own edge may lie above the dynamic one's (a
    static graph can plan its buffers tighter): the cell's batch is then a lower bound.
    """
    tried = list(dynamic.tried)
    static_from = len(tried)
    batch = dynamic.batch
    while batch >= 1:
        t0 = time.perf_counter()
        try:
            measured = run(batch)
        except KeyboardInterrupt:
            # The dynamic edge and its run stand, a lower bound of the cell's (hf_gpt2's
            # compile cell was cut in its static run on a card and kept nothing: session 17).
            raise CellInterrupted(
                Holding(dynamic.batch, dynamic.measured, tried, dynamic.lowest_oom, static_from)
            ) from None
        except Exception as e:
            if not is_oom(e):
                raise
            tried.append((batch, False))
            if say is not None:
                say(f"static batch {batch} ran out ({time.perf_counter() - t0:.0f} s)")
            batch -= max(1, batch // 50)  # each static run is a compile of its own
            continue
        tried.append((batch, True))
        if say is not None:
            say(f"static batch {batch} held ({time.perf_counter() - t0:.0f} s, "
                f"{measured.samples_per_s:.1f}/s)")  # fmt: skip
        bad = [b for b, ok in tried[static_from:] if not ok]
        return Holding(batch, measured, tried, min(bad) if bad else None, static_from)
    return Holding(tried=tried, lowest_oom=1, static_from=static_from)


def _slope_above(space: Any, choices: dict[str, Any], batch: int) -> float:
    """The estimate's bytes per sample from ``batch`` to a quarter above it."""
    from memadvisor.planner._space import limit_at

    step = max(1, batch // 4)
    low = limit_at(space.profile, choices, space.strategies, batch)
    high = limit_at(space.profile, choices, space.strategies, batch + step)
    return (high - low) / step


# -- joining a model's lines ---------------------------------------------------------------------


def _measured(value: Any) -> bool:
    return value is not None and not (isinstance(value, (list, dict)) and not value)


def merge_rows(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One model's lines, oldest first, as one: a field takes the latest line that measured
    it (None, [] and {} measure nothing), a hand cell the latest line that ran it; then the
    ratios (:func:`derive`)."""
    out: dict[str, Any] = {}
    grid: dict[str, dict[str, Any]] = {}
    for row in rows:
        for key, value in row.items():
            if key == "hand_grid":
                grid.update({c["config"]: c for c in value})
            elif _measured(value) or key not in out:
                out[key] = value
    out["hand_grid"] = [grid[c] for c in GRID if c in grid]
    out["lines"] = len(rows)
    return derive(out)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a and b else None


class Lockstep:
    """A device shared by several cells' searches, each in a thread of its own: a thread's
    :meth:`run` waits until every thread still searching has asked for a run, then
    :meth:`serve` (in the calling thread, the only one that touches the device) makes them
    together with ``device.run_many``: a card makes them at once, their timed steps in turn
    (``memadvisor.device.cuda``), so each rate is its own run's.

    Why: the cells' searches are independent, and each of their runs is a fresh process of
    a few seconds eager and 20-40 s compiled; one after another, the GPT example's grid took
    a call of its own (session 26) and no other model's was made in sessions 29-40.

    A Ctrl-C (a deadline's SIGINT) in :meth:`serve` answers every run in flight, and every
    run asked for after it, with a ``KeyboardInterrupt``: each cell's search then ends as
    it ends when cut alone (:class:`CellInterrupted`, what held so far kept).

    Known limitations: the cells' compiled runs compile at once and autotune their kernels
    beside each other (a winner timed beside other processes may lose alone: docs/design.md,
    session 26); a cell's runs wait for the slowest of each group.
    """

    def __init__(self, device: Any, workload: Any, threads: int) -> None:
        self._device, self._workload = device, workload
        self._cond = threading.Condition()
        self._live = threads
        self._pending: dict[int, tuple[Any, int]] = {}
        self._answers: dict[int, Any] = {}
        self._tickets = itertools.count()
        self._stopped = False

    def is_oom(self, error: BaseException) -> bool:
        return self._device.is_oom(error)

    def run(self, workload: Any, candidate: Any, steps: int) -> Any:
        """``candidate`` for ``steps`` steps, made with the other threads' runs; its
        measurement, or what its run raised."""
        with self._cond:
            if self._stopped:
                raise KeyboardInterrupt
            ticket = next(self._tickets)
            self._pending[ticket] = (candidate, steps)
            self._cond.notify_all()
            while ticket not in self._answers:
                self._cond.wait()
            answer = self._answers.pop(ticket)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    def ended(self) -> None:
        """A thread's search ended: the others no longer wait for its runs."""
        with self._cond:
            self._live -= 1
            self._cond.notify_all()

    def serve(self) -> None:
        """Make the threads' runs, a group whenever every live thread has asked for one,
        until every thread ended."""
        while True:
            group: list[tuple[int, Any]] = []
            try:
                with self._cond:
                    while self._live and len(self._pending) < self._live:
                        self._cond.wait(0.5)
                    if not self._live and not self._pending:
                        return
                    group = sorted(self._pending.items())
                    self._pending.clear()
                    if self._stopped:
                        self._answer(group, [KeyboardInterrupt() for _ in group])
                        continue
                answers = self._device.run_many(self._workload, [r for _, r in group])
            except KeyboardInterrupt:
                with self._cond:
                    self._stopped = True
                    self._answer(group, [KeyboardInterrupt() for _ in group])
                continue
            with self._cond:
                self._answer(group, answers)

    def _answer(self, group: list[tuple[int, Any]], answers: list[Any]) -> None:
        for (ticket, _), answer in zip(group, answers, strict=True):
            self._answers[ticket] = answer
        self._cond.notify_all()


def measure_at_once(
    cells: list[str],
    measure: Callable[[str, Any], dict[str, Any]],
    device: Any,
    workload: Any,
) -> list[dict[str, Any]]:
    """``measure(cell, device)`` of every cell, each in a thread of its own, their runs made
    together through a :class:`Lockstep` over ``device``; the records in the cells' order.
    A cell that raises is a record of its error; one cut by a Ctrl-C, ``skipped``."""
    lockstep = Lockstep(device, workload, len(cells))
    records: dict[str, dict[str, Any]] = {}

    def search(cell: str) -> None:
        try:
            records[cell] = measure(cell, lockstep)
        except KeyboardInterrupt:
            records[cell] = {"config": cell, "skipped": "interrupted"}
        except Exception as e:  # noqa: BLE001 - one cell failing is a cell, not a crash
            records[cell] = {"config": cell, "error": f"{type(e).__name__}: {str(e)[:300]}"}
        finally:
            lockstep.ended()

    threads = [threading.Thread(target=search, args=(c,), daemon=True) for c in cells]
    for t in threads:
        t.start()
    lockstep.serve()
    for t in threads:
        t.join()
    return [records[c] for c in cells]


def derive(row: dict[str, Any]) -> dict[str, Any]:
    """Issue 27's ratios from a row's measurements: the best hand cell, the pick's verified
    rate over it, the user's loop over the verified rate (and over the pick run again in
    the same call), the batch over what holds."""
    # An interrupted cell's batch is a lower bound of its own: shown, not rated.
    rated = [
        c for c in row.get("hand_grid", []) if c.get("samples_per_s") and not c.get("interrupted")
    ]
    best = max(rated, key=lambda c: c["samples_per_s"], default=None)
    row["best_hand"] = best["config"] if best else None
    row["best_hand_samples_per_s"] = best["samples_per_s"] if best else None
    row["hand_cells"] = f"{len(rated)}/{len(GRID)}"
    verified = row.get("verified_samples_per_s")
    row["pick_over_best_hand"] = _ratio(verified, row["best_hand_samples_per_s"])
    rerun = (row.get("pick_rerun") or {}).get("samples_per_s")
    row["pick_rerun_over_best_hand"] = _ratio(rerun, row["best_hand_samples_per_s"])
    row["loop_over_verified"] = _ratio(row.get("user_loop_samples_per_s"), verified)
    # The loop over the pick run again in the same call: the same host, minutes apart.
    row["loop_over_rerun"] = _ratio(row.get("user_loop_samples_per_s"), rerun)
    holding = row.get("largest_batch_holding")
    row["batch_over_holding"] = _ratio(row.get("batch"), holding)
    return row
