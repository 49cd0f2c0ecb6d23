"""Numbers as a person reads them: binary units, the unit the value reaches."""

from __future__ import annotations

import pytest

from memadvisor.units import fmt_bytes, fmt_ms, fmt_rate, fmt_ratio


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [
        (8 * 2**30, "8.00 GiB"),  # a budget of 8 means 2^33 bytes, as torch counts
        (int(1.5 * 2**20), "1.50 MiB"),
        (123 * 2**20, "123.0 MiB"),
        (2048, "2.00 KiB"),
        (17, "17 B"),
        (-3 * 2**20, "-3.00 MiB"),
        (None, "—"),
    ],
)
def test_bytes_use_the_largest_binary_unit_reached(nbytes: int | None, text: str) -> None:
    assert fmt_bytes(nbytes) == text


def test_times_rates_and_ratios_keep_the_digits_they_are_worth() -> None:
    assert [fmt_ms(0.123), fmt_ms(12.34), fmt_ms(234.5), fmt_ms(12_345)] == [
        "0.12 ms",
        "12.3 ms",
        "234 ms",
        "12.3 s",
    ]
    assert [fmt_rate(3.456), fmt_rate(45.67), fmt_rate(2033.4)] == ["3.46", "45.7", "2,033"]
    assert fmt_ratio(2.456) == "2.46×" and fmt_ratio(float("inf")) == "—"
