"""The monitor's outputs: a rich table every N iterations and one CSV row per record."""

from __future__ import annotations

import csv
import time
from pathlib import Path
from typing import IO, Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from memadvisor.monitor._schema import IterationRecord, LayerMemory, LeakReport

__all__ = ["CSV_COLUMNS", "CsvLog", "format_bytes", "iteration_table"]

# One long-format file: scope "step" rows every iteration, "layer" rows for measured layers,
# "epoch" rows at epoch_end(); empty cells where a column does not apply.
CSV_COLUMNS = [
    "scope",
    "iteration",
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


class CsvLog:
    """Appends rows to a CSV file, writing the header only to a new or empty file.

    Raises:
        OSError: the file cannot be opened for appending.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file: IO[str] | None = self.path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=CSV_COLUMNS, extrasaction="ignore")
        if new:
            self._writer.writeheader()
        self._flushed = time.monotonic()

    def write(self, row: dict[str, Any], *, flush: bool = False) -> None:
        """Append ``row``; flushed when asked, and at least once a second."""
        if self._file is None:
            return
        self._writer.writerow({k: ("" if v is None else v) for k, v in row.items()})
        now = time.monotonic()
        if flush or now - self._flushed > 1.0:  # a crashed run loses at most a second of rows
            self._file.flush()
            self._flushed = now

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def step_row(rec: IterationRecord, leak: LeakReport | None) -> dict[str, Any]:
    # Read attribute by attribute: model_dump() would cost more than the rest of record().
    return {
        "scope": "step",
        "iteration": rec.iteration,
        "epoch": rec.epoch,
        "iteration_ms": rec.iteration_ms,
        "allocated_bytes": rec.allocated_bytes,
        "peak_allocated_bytes": rec.peak_allocated_bytes,
        "reserved_bytes": rec.reserved_bytes,
        "peak_reserved_bytes": rec.peak_reserved_bytes,
        "weight_bytes": rec.weight_bytes,
        "grad_bytes": rec.grad_bytes,
        "optimizer_state_bytes": rec.optimizer_state_bytes,
        "saved_bytes": rec.saved_activation_bytes,
        "other_bytes": rec.other_bytes,
        "leak_flagged": int(bool(leak and leak.flagged)),
    }


def layer_row(iteration: int, epoch: int, layer: LayerMemory) -> dict[str, Any]:
    row = layer.model_dump(exclude={"type_name", "forward_peak_bytes", "allocations"})
    row.update(
        scope="layer",
        iteration=iteration,
        epoch=epoch,
        type=layer.type_name,
        peak_allocated_bytes=layer.forward_peak_bytes,
    )
    return row


def _layer_total(layer: LayerMemory) -> int:
    return layer.weight_bytes + layer.grad_bytes + layer.saved_bytes + layer.intermediate_bytes


def iteration_table(
    rec: IterationRecord,
    layers: list[LayerMemory] | None,
    layers_iteration: int | None,
    leak: LeakReport | None,
    *,
    model_name: str,
    max_rows: int = 20,
) -> Group:
    """The renderable printed every ``print_period`` iterations."""
    summary = Text.assemble(
        (f"memadvisor · {model_name} · iteration {rec.iteration} (epoch {rec.epoch})\n", "bold"),
        f"allocated {format_bytes(rec.allocated_bytes)} "
        f"(peak {format_bytes(rec.peak_allocated_bytes)})",
    )
    if rec.reserved_bytes is not None:
        frag = rec.fragmentation
        summary.append(
            f" · reserved {format_bytes(rec.reserved_bytes)} "
            f"(peak {format_bytes(rec.peak_reserved_bytes)}, "
            f"fragmentation {0.0 if frag is None else frag:.0%})"
        )
    if rec.iteration_ms is not None:
        summary.append(f" · {rec.iteration_ms:.1f} ms/iter")
    parts: list[Any] = [summary]
    if rec.weight_bytes is not None:
        parts.append(
            Text(
                f"weights {format_bytes(rec.weight_bytes)} · grads {format_bytes(rec.grad_bytes)}"
                f" · optimizer {format_bytes(rec.optimizer_state_bytes)}"
                f" · saved activations {format_bytes(rec.saved_activation_bytes)}"
                f" · other at peak {format_bytes(rec.other_bytes)}"
            )
        )
    if layers:
        parts.append(_layer_table(layers, layers_iteration, max_rows))
    if leak is not None and leak.flagged:
        parts.append(Text(f"LEAK? {leak.message}", style="bold red"))
    return Group(*parts)


def _layer_table(layers: list[LayerMemory], iteration: int | None, max_rows: int) -> Table:
    shown = [la for la in layers if _layer_total(la) or la.saved_tensors]
    biggest = sorted(shown, key=_layer_total, reverse=True)[:max_rows]
    keep = {id(la) for la in biggest}
    rows = [la for la in shown if id(la) in keep]  # model order, largest max_rows
    title = f"per layer (measured in iteration {iteration})"
    if len(shown) > len(rows):
        title += f", largest {len(rows)} of {len(shown)}"
    table = Table(title=title, title_justify="left", show_edge=False, pad_edge=False)
    for header in ("layer", "type", "weights", "grads", "saved", "n", "other", "fwd ms", "bwd ms"):
        table.add_column(header, justify="left" if header in ("layer", "type") else "right")
    for la in rows:
        table.add_row(
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
    return table


def default_console() -> Console:
    return Console(stderr=True)
