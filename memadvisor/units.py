"""Numbers as a person reads them: bytes in binary units (GiB = 2^30), times in ms."""

from __future__ import annotations

import math

__all__ = ["fmt_bytes", "fmt_ms", "fmt_rate", "fmt_ratio"]

_UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def fmt_bytes(nbytes: float | None) -> str:
    """``1288490189`` -> ``'1.20 GiB'``; the unit is the largest one the value reaches.

    Budgets are GiB because torch's own out-of-memory messages count in GiB; a small CPU
    example's MiB would read as ``0.00 GiB``, hence the adaptive unit.
    """
    if nbytes is None:
        return "—"
    sign = "-" if nbytes < 0 else ""
    n = abs(float(nbytes))
    for unit, size in _UNITS:
        if n >= size:
            value = n / size
            return f"{sign}{value:.2f} {unit}" if value < 100 else f"{sign}{value:.1f} {unit}"
    return f"{sign}{int(n)} B"


def fmt_ms(ms: float | None) -> str:
    """``12.345`` -> ``'12.3 ms'``; seconds past 10 s."""
    if ms is None or not math.isfinite(ms):
        return "—"
    if ms >= 10_000:
        return f"{ms / 1000:.1f} s"
    if ms >= 100:
        return f"{ms:.0f} ms"
    return f"{ms:.1f} ms" if ms >= 1 else f"{ms:.2f} ms"


def fmt_rate(samples_per_s: float | None) -> str:
    """Samples per second with as many digits as they are worth."""
    if samples_per_s is None or not math.isfinite(samples_per_s):
        return "—"
    if samples_per_s >= 100:
        return f"{samples_per_s:,.0f}"
    return f"{samples_per_s:.1f}" if samples_per_s >= 10 else f"{samples_per_s:.2f}"


def fmt_ratio(ratio: float | None) -> str:
    """``2.456`` -> ``'2.46×'``."""
    if ratio is None or not math.isfinite(ratio):
        return "—"
    return f"{ratio:.2f}×"
