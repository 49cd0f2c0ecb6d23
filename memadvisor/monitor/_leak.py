"""The leak check: allocated bytes at the end of an iteration that keep rising."""

from __future__ import annotations

from collections import deque

from memadvisor.monitor._output import format_bytes
from memadvisor.monitor._schema import LeakReport, LeakSuspect

__all__ = ["LeakCheck"]


class LeakCheck:
    """Flags ``window`` consecutive iterations that each end with more bytes allocated.

    A clean loop ends every iteration at the same allocated bytes once its optimizer state
    exists (made in the first step, which is why the first ``warmup`` records are skipped);
    a loop that keeps a reference each iteration (a loss with its graph, a cached output)
    ends each one higher.

    Args:
        window: consecutive rises that flag a leak.
        min_growth_bytes: total growth over the window below which nothing is flagged.
        warmup: records ignored at the start.

    Raises:
        ValueError: ``window`` below 2, or a negative threshold or warmup.
    """

    def __init__(self, window: int = 5, *, min_growth_bytes: int = 1, warmup: int = 1) -> None:
        if window < 2:
            raise ValueError(f"window must be at least 2 iterations, but got {window=}.")
        if min_growth_bytes < 0 or warmup < 0:
            raise ValueError(
                f"min_growth_bytes and warmup must be >= 0, but got {min_growth_bytes=}, {warmup=}."
            )
        self.window = window
        self.min_growth_bytes = min_growth_bytes
        self.warmup = warmup
        self._seen = 0
        self._ends: deque[int] = deque(maxlen=window + 1)
        self._rises = 0
        # The latest bytes counted (None during the warmup): adding the same bytes again
        # while nothing rises changes nothing, so a caller may skip that call.
        self.last_bytes: int | None = None

    def add(self, allocated_bytes: int) -> int:
        """Add the allocated bytes at the end of one iteration (O(1)); returns :attr:`rises`."""
        if self._seen < self.warmup:
            self._seen += 1
            return 0
        ends = self._ends
        rising = bool(ends) and allocated_bytes > ends[-1]
        rises = self._rises = min(self._rises + 1, self.window) if rising else 0
        ends.append(allocated_bytes)
        self.last_bytes = allocated_bytes
        return rises

    @property
    def rises(self) -> int:
        """Consecutive rises at the end of the history (at most ``window``)."""
        return self._rises

    @property
    def growth_bytes(self) -> int:
        """Growth over the current run of rises."""
        n = self._rises
        return self._ends[-1] - self._ends[-1 - n] if n else 0

    @property
    def flagged(self) -> bool:
        return self.rises >= self.window and self.growth_bytes >= self.min_growth_bytes

    def report(self, suspects: list[LeakSuspect]) -> LeakReport:
        """The current verdict, naming ``suspects`` (modules whose old tensors survive)."""
        flagged = self.flagged
        rises, growth = self.rises, self.growth_bytes
        if not flagged:
            return LeakReport(flagged=False, iterations=rises, growth_bytes=growth)
        per_iter = format_bytes(growth / max(1, rises))
        if suspects:
            named = [
                f"{s.module or '<model>'} ({format_bytes(s.surviving_bytes)})" for s in suspects
            ]
            where = "in tensors made or saved by " + ", ".join(named[:5])
        else:
            where = (
                "outside the tensors the model's modules made or saved (the loss, the "
                "optimizer or the training loop itself)"
            )
        message = (
            f"Memory grew in each of the last {rises} iterations, {format_bytes(growth)} in all "
            f"({per_iter} per iteration): a reference kept across iterations, {where}. Keep "
            "loss.item() or loss.detach(), not the loss tensor; do not store outputs that "
            "require grad, nor anything per step."
        )
        return LeakReport(
            flagged=True, iterations=rises, growth_bytes=growth, suspects=suspects,
            message=message,
        )  # fmt: skip
