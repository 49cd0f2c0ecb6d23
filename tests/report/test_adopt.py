"""adoption_snippet: the loop a person pastes carries the plan's batch, accumulation and
precision, and says what autocast inside the forward means for the loss."""

from __future__ import annotations

import ast

from memadvisor.report._adopt import adoption_snippet
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.plan import Plan


def _with(plan: Plan, candidate: Candidate) -> Plan:
    return plan.model_copy(update={"candidate": candidate})


def test_the_loop_has_the_plans_batch_and_accumulation_and_parses(plan: Plan) -> None:
    """bf16 at 12 x 6: the DataLoader's batch, the loss divided by 6, the optimizer stepping
    every 6th micro-batch, the bf16 logits' note; the code is valid Python."""
    cand = Candidate(batch_size=12, accumulation_steps=6, choices={"precision": "bf16"})
    code = adoption_snippet(_with(plan, cand))
    ast.parse(code)
    assert "batch_size=12" in code and "/ 6" in code and "% 6 == 0" in code
    assert "bf16: autocast runs inside forward" in code and "output.float()" in code
    assert "GradScaler" not in code and "drop_last" not in code


def test_fp16_gets_a_scaler_and_a_compiled_pick_one_shape(plan: Plan) -> None:
    """fp16 needs a GradScaler in the loop; a compiled pick drops the last smaller batch."""
    cand = Candidate(batch_size=32, choices={"precision": "fp16", "compile": "default"})
    code = adoption_snippet(_with(plan, cand))
    ast.parse(code)
    assert "scaler.scale(loss).backward()" in code and "scaler.step(optimizer)" in code
    assert "drop_last=True" in code and "% " not in code
