"""strategies/_compile_search.py's helpers (the search: tests/planner/test_compiled_search.py)."""

from __future__ import annotations

from memadvisor.errors import PlanningError
from strategies._compile_search import first_line


def test_a_failed_compile_is_recorded_with_the_cause_the_backend_raised() -> None:
    """Rule: dynamo's "backend=... raised:" line only introduces the cause; the record keeps
    the cause's line with it (session 17's card records said only "...raised:")."""
    error = PlanningError(
        "A probe process (batch 869) failed with BackendCompilerFailed: backend='inductor' "
        "raised:\n\nAssertionError: a guard on s0 failed\n\nTraceback (most recent call last):\n"
        '  File "x.py", line 1\n'
    )
    line = first_line(error)
    assert line.startswith("PlanningError: A probe process (batch 869) failed with")
    assert line.endswith("raised: AssertionError: a guard on s0 failed")


def test_an_error_whose_first_line_says_it_all_keeps_only_that_line() -> None:
    """Rule: one line per error; a first line not ending in ':' stands alone."""
    assert first_line(RuntimeError("it broke\nand more")) == "RuntimeError: it broke"
    assert first_line(RuntimeError("")) == "RuntimeError"
