"""The monitor's outputs: a table printed through rich every N iterations, and CSV rows."""

from __future__ import annotations

import csv
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.segment import Segments
from rich.text import Text

from memadvisor.monitor._schema import IterationRecord, LeakReport

__all__ = [
    "CSV_COLUMNS",
    "CsvLog",
    "csv_row",
    "format_bytes",
    "iteration_table",
    "layer_csv_row",
    "layer_table",
    "print_table",
    "step_line",
]

# One long-format file: scope "step" rows at every reading of the counters (every iteration,
# or every few on a card where reads would cost more than the monitor's budget: "iterations"
# says how many a row covers), "layer" rows for measured layers, "epoch" rows at epoch_end();
# empty cells where a column does not apply.
CSV_COLUMNS = [
    "scope",
    "iteration",
    "iterations",
    "epoch",
    "module",
    "type",
    "iteration_ms",
    "allocated_bytes",
    "peak_allocated_bytes",
    "reserved_bytes",
    "peak_reserved_bytes",
    "weight_bytes",
    "grad_bytes",
    "optimizer_state_bytes",
    "saved_tensors",
    "saved_bytes",
    "intermediate_bytes",
    "other_bytes",
    "forward_ms",
    "backward_ms",
    "leak_flagged",
]


def format_bytes(n: int | float | None) -> str:
    """Bytes for a person: B, KiB, MiB or GiB (2^10 steps); '-' for None."""
    if n is None:
        return "-"
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{int(n)} B"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


# -- CSV ------------------------------------------------------------------------------------------


class CsvLog:
    """Appends rows to a CSV file in batches, writing the header only to a new or empty file.

    Rows wait in :attr:`pending` until :meth:`flush` (the monitor flushes on printed
    iterations, at ``epoch_end()``, at ``close()``, at the first record() ``max_wait_s`` after
    the last flush, and through a finalizer when the monitor is collected or the interpreter
    exits), so an iteration costs a list append, not a formatted write. Rows that come after
    :meth:`close` reopen the file.

    Args:
        path: the CSV file.
        max_wait_s: the monitor flushes at the first record() this long after the last flush:
            a process killed without exit handlers (SIGKILL) loses about that much.

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str | Path, *, max_wait_s: float = 5.0) -> None:
        self.path = Path(path)
        self.max_wait_ns = int(max_wait_s * 1e9)
        self.pending: list[tuple] = []  # raw rows, turned into lines by csv_row() at flush
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file: IO[str] | None = self.path.open("a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(CSV_COLUMNS)
            self._file.flush()
        self.flushed_ns = time.perf_counter_ns()

    def flush(self) -> None:
        """Write every queued row and flush the file."""
        self.flushed_ns = time.perf_counter_ns()
        if not self.pending:
            return
        if self._file is None:
            self._file = self.path.open("a", newline="")
            self._writer = csv.writer(self._file)
        write, writerow = self._file.write, self._writer.writerow
        for row in self.pending:
            # Step lines (all numbers) are formatted directly, four times faster than the
            # csv module; layer and epoch lines, rarer and with names, go through it.
            if type(row[0]) is str:
                writerow(csv_row(row))
            else:
                write(step_line(row))
        self.pending.clear()  # in place: the monitor holds this list
        self._file.flush()

    def close(self) -> None:
        """Write what is queued and close the file."""
        self.flush()
        if self._file is not None:
            self._file.close()
            self._file = None


def csv_row(row: tuple) -> tuple:
    """One CSV line, in :data:`CSV_COLUMNS` order, from a raw row the monitor queued.

    A raw iteration row is ``(iteration, epoch, iteration_ms, allocated, peak allocated,
    reserved, peak reserved, totals, layers measured, leak flagged, time ns, iterations)``
    with ``totals`` = ``(weights, grads, saved activations, optimizer state, other)``: a
    ``step`` line. ``("epoch", iteration row)`` is an ``epoch`` line; a row starting with
    ``"layer"`` is a line already (:func:`layer_csv_row`). ``None`` is written as an empty cell.
    """
    scope = "step"
    if type(row[0]) is str:
        if row[0] != "epoch":
            return row
        scope, row = row
    it, epoch, ms, allocated, peak, reserved, peak_reserved, totals, _, flagged, _, span = row
    weights, grads, saved, optimizer, other = totals
    # fmt: off
    return (scope, it, span, epoch, None, None, ms, allocated, peak, reserved, peak_reserved,
            weights, grads, optimizer, None, saved, None, other, None, None, int(flagged))
    # fmt: on


def step_line(row: tuple) -> str:
    """The ``step`` line of a raw iteration row, as the csv module writes :func:`csv_row` of
    it (``\\r\\n`` ended), but with the time rounded to 0.1 us: ``f"{ms:.4f}"``."""
    it, epoch, ms, allocated, peak, reserved, peak_reserved, totals, _, flagged, _, span = row
    weights, grads, saved, optimizer, other = totals
    # fmt: off
    return (f"step,{it},{span},{epoch},,,{'' if ms is None else f'{ms:.4f}'},{allocated},"
            f"{peak},{'' if reserved is None else reserved},"
            f"{'' if peak_reserved is None else peak_reserved},"
            f"{'' if weights is None else weights},{'' if grads is None else grads},"
            f"{'' if optimizer is None else optimizer},,{'' if saved is None else saved},,"
            f"{'' if other is None else other},,,{int(flagged)}\r\n")
    # fmt: on


def layer_csv_row(iteration: int, epoch: int, layer: Any) -> tuple:
    """A ``layer`` line for one :class:`LayerMemory` (or a row with the same fields)."""
    # fmt: off
    return ("layer", iteration, 1, epoch, layer.module, layer.type_name, None, None,
            layer.forward_peak_bytes, None, None, layer.weight_bytes, layer.grad_bytes, None,
            layer.saved_tensors, layer.saved_bytes, layer.intermediate_bytes, None,
            layer.forward_ms, layer.backward_ms, None)
    # fmt: on


# -- the printed table ----------------------------------------------------------------------------


def _layer_total(layer: Any) -> int:
    return layer.weight_bytes + layer.grad_bytes + layer.saved_bytes + layer.intermediate_bytes


def iteration_table(
    rec: IterationRecord,
    layers: Text | None,
    leak: LeakReport | None,
    *,
    model_name: str,
) -> Text:
    """What is printed every ``print_period`` iterations (see :func:`print_table`), with
    ``layers`` from :func:`layer_table` (laid out once per measurement)."""
    out = Text()
    out.append(f"memadvisor · {model_name} · iteration {rec.iteration} (epoch {rec.epoch})\n",
               style="bold")  # fmt: skip
    line = (
        f"allocated {format_bytes(rec.allocated_bytes)} "
        f"(peak {format_bytes(rec.peak_allocated_bytes)})"
    )
    if rec.reserved_bytes is not None:
        frag = rec.fragmentation
        line += (
            f" · reserved {format_bytes(rec.reserved_bytes)} "
            f"(peak {format_bytes(rec.peak_reserved_bytes)}, "
            f"fragmentation {0.0 if frag is None else frag:.0%})"
        )
    if rec.iteration_ms is not None:
        line += f" · {rec.iteration_ms:.1f} ms/iter"
    if rec.iterations > 1:
        line += f" · peaks over the last {rec.iterations} iterations"
    out.append(line)
    if rec.weight_bytes is not None:
        out.append(
            f"\nweights {format_bytes(rec.weight_bytes)} · grads {format_bytes(rec.grad_bytes)}"
            f" · optimizer {format_bytes(rec.optimizer_state_bytes)}"
            f" · saved activations {format_bytes(rec.saved_activation_bytes)}"
            f" · other at peak {format_bytes(rec.other_bytes)}"
        )
    if layers is not None:
        out.append("\n")
        out.append_text(layers)
    if leak is not None and leak.flagged:
        out.append(f"\nLEAK? {leak.message}", style="bold red")
    return out


_HEADERS = ("layer", "type", "weights", "grads", "saved", "n", "other", "fwd ms", "bwd ms")


def layer_table(layers: Sequence[Any], iteration: int | None, max_rows: int = 20) -> Text:
    """The per-layer table of one measured iteration: its ``max_rows`` largest layers, in
    model order. ``layers`` are :class:`LayerMemory` s or rows with the same fields."""
    # Laid out here in fixed-width columns rather than as a rich.table.Table: rendering a
    # 20-row Table costs tens of milliseconds (measuring and wrapping every cell), more than
    # a hundred iterations of a small model's training loop; this costs well under one.
    shown = [la for la in layers if _layer_total(la) or la.saved_tensors]
    biggest = sorted(shown, key=_layer_total, reverse=True)[:max_rows]
    keep = {id(la) for la in biggest}
    rows = [la for la in shown if id(la) in keep]  # model order, largest max_rows
    title = f"per layer (measured in iteration {iteration})"
    if len(shown) > len(rows):
        title += f", largest {len(rows)} of {len(shown)}"
    cells = [
        (
            la.module or "<model>",
            la.type_name,
            format_bytes(la.weight_bytes),
            format_bytes(la.grad_bytes),
            format_bytes(la.saved_bytes),
            str(la.saved_tensors),
            format_bytes(la.intermediate_bytes),
            _ms(la.forward_ms),
            _ms(la.backward_ms),
        )
        for la in rows
    ]
    widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(_HEADERS)]

    def line(row: Sequence[str]) -> str:
        # Names and types left-aligned, numbers right-aligned, two spaces between columns.
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        )

    out = Text()
    out.append(title + "\n", style="italic")
    out.append(line(_HEADERS) + "\n", style="bold")
    out.append("─" * (sum(widths) + 2 * (len(widths) - 1)))
    for row in cells:
        out.append("\n" + line(row))
    return out


def print_table(console: Console, table: Text) -> None:
    """Print ``table`` as laid out, styles included where the console shows them.

    A console without colours (a log file, a pipe, a buffer) gets the plain text written to
    its file, some fifty times faster than through rich, which would render and then drop
    every style. Otherwise the segments go straight to the console: printing the Text itself
    would split, wrap and crop it line by line first, several times the cost of the layout.
    """
    if console.quiet:
        return
    if console.color_system is None and not console.record and not console.is_jupyter:
        console.file.write(table.plain + "\n")
        return
    console.print(Segments(table.render(console, end="\n")), crop=False)


def default_console() -> Console:
    return Console(stderr=True)
