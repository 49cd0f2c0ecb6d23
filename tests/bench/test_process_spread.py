"""bench/process_spread.py's plan variant: the saved pick at another batch or compile mode,
with nothing else of the plan changed."""

from __future__ import annotations

import json

import pytest


@pytest.fixture
def spread(load_bench):
    return load_bench("process_spread")


def _plan(compile_choice: object) -> str:
    choices = {"precision": "bf16", "checkpointing": ["h.2", "h.3"]}
    if compile_choice is not None:
        choices["compile"] = compile_choice
    return json.dumps({"candidate": {"batch_size": 307, "choices": choices}, "notes": ["kept"]})


def test_no_flag_no_copy(spread) -> None:
    """Without --batch or --compile-mode the plan runs as saved: no copy is made."""
    assert spread.plan_variant(_plan("default"), None, None) is None


def test_batch_and_mode_change_only_themselves(spread) -> None:
    """--batch sets the candidate's batch, --compile-mode its compile mode; the rest of the
    plan (its other choices, its notes) is the saved one's."""
    before = json.loads(_plan("default"))
    after = json.loads(spread.plan_variant(_plan("default"), 314, "reduce-overhead"))
    assert after["candidate"]["batch_size"] == 314
    assert after["candidate"]["choices"]["compile"] == "reduce-overhead"
    for plan in (before, after):
        del plan["candidate"]["batch_size"], plan["candidate"]["choices"]["compile"]
    assert after == before


def test_mode_kept_beside_a_compile_choices_other_fields(spread) -> None:
    """A compile choice written as a mapping (regional, a memory budget) keeps its fields and
    takes the mode."""
    choice = {"mode": "default", "regional": True, "activation_memory_budget": 0.5}
    after = json.loads(spread.plan_variant(_plan(choice), None, "reduce-overhead"))
    assert after["candidate"]["choices"]["compile"] == {**choice, "mode": "reduce-overhead"}
    assert after["candidate"]["batch_size"] == 307


@pytest.mark.parametrize("choice", [None, "off"])
def test_mode_of_a_plan_that_does_not_compile_is_refused(spread, choice) -> None:
    """A plan that does not compile has no mode to set: the error names its choice."""
    with pytest.raises(ValueError, match="no mode to set"):
        spread.plan_variant(_plan(choice), None, "reduce-overhead")
