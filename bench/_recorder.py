"""JSON lines written as a bench goes, flushed at once (a run cut short keeps its data),
and the rows its final table is made from."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any


class Recorder:
    """One JSON line per event; the records ``is_row`` accepts kept in :attr:`rows`.

    Args:
        path: where the lines go (None: rows only).
        is_row: which records the final table is made from.
        mode: ``"w"`` starts the file anew, ``"a"`` appends (a bench run in chunks).
    """

    def __init__(
        self, path: Path | None, is_row: Callable[[dict[str, Any]], bool], mode: str = "w"
    ) -> None:
        self.rows: list[dict[str, Any]] = []
        self.is_row = is_row
        self.out: IO[str] | None = path.open(mode) if path is not None else None

    def write(self, record: dict[str, Any]) -> None:
        if self.is_row(record):
            self.rows.append(record)
        if self.out is not None:
            self.out.write(json.dumps(record) + "\n")
            self.out.flush()

    def close(self) -> None:
        if self.out is not None:
            self.out.close()
