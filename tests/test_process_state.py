"""memadvisor/process_state.py: what a block sets in the caller's process is put back."""

from __future__ import annotations

import os

import pytest

from memadvisor.process_state import environ_set


def test_environ_set_puts_back_the_old_value_and_removes_a_new_variable_even_on_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Inside the block both variables hold the new values; after it (left by an exception),
    the one the caller had is back to its value and the one it lacked is gone."""
    monkeypatch.setenv("MEMADVISOR_TEST_HAD", "old")
    monkeypatch.delenv("MEMADVISOR_TEST_NEW", raising=False)
    with (
        pytest.raises(RuntimeError),
        environ_set({"MEMADVISOR_TEST_HAD": "new", "MEMADVISOR_TEST_NEW": "1"}),
    ):
        assert os.environ["MEMADVISOR_TEST_HAD"] == "new"
        assert os.environ["MEMADVISOR_TEST_NEW"] == "1"
        raise RuntimeError("leaving the block")
    assert os.environ["MEMADVISOR_TEST_HAD"] == "old"
    assert "MEMADVISOR_TEST_NEW" not in os.environ
