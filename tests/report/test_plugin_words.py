"""A third party's strategy speaks in the report in its own words, as a built-in does: its
row in the answer, its phrase in the one-line answer, the blocks it recomputes in the
activation table, its lines in the training loop a person pastes, and what apply_plan
installs. The report names no strategy (tests/test_imports.py checks its sources); these
words reach it only through the Strategy contract and the entry point.
"""

from __future__ import annotations

import ast
import io
import textwrap

import pytest
from rich.console import Console

from memadvisor.report import _facts as facts
from memadvisor.report import one_line, print_plan
from memadvisor.report._adopt import adoption_snippet
from memadvisor.report._words import answer_rows
from memadvisor.schema.plan import Plan

PLUGIN = textwrap.dedent(
    '''
    from memadvisor.schema.advice import LoopLines, ReportPart
    from memadvisor.strategy import Described, Strategy


    class Quiet(Strategy):
        """No words of its own: the contract's default lists its choice under Also."""

        name = "quiet"

        def choices(self, profile, config):
            return ["off", "on"]

        def effect(self, profile, choice, model):
            return None

        def apply(self, step, choice):
            return step

        def explain(self, choice, profile):
            return None


    class Sparse(Quiet, Described):
        """2:4 sparse weights; recomputes the last block to fit its masks."""

        name = "sparse"
        effect_order = 70
        installs = "sparsity masks"

        def choices(self, profile, config):
            return ["off", "2:4"]

        def describe(self, choice, plan):
            if self.is_neutral(choice):
                return ReportPart(label="Sparsity", words="dense", brief="dense")
            return ReportPart(
                label="Sparsity",
                words=f"{choice} sparse weights",
                brief=f"{choice} sparse",
                recomputed_blocks=["transformer.h.3"],
                loop=LoopLines(
                    setup=["masks = sparse.masks(model)  # from the plan"],
                    step="sparse.step(optimizer, masks)",
                    loader_comment="any shape",
                ),
            )
    '''
)


@pytest.fixture
def plugin(install_plugin) -> None:
    install_plugin(
        "sparse_plugin", PLUGIN, {"sparse": "sparse_plugin:Sparse", "quiet": "sparse_plugin:Quiet"}
    )


def _with(plan: Plan, **choices) -> Plan:
    cand = plan.candidate.model_copy(update={"choices": {**plan.candidate.choices, **choices}})
    return plan.model_copy(update={"candidate": cand})


def test_a_plugins_choice_has_its_row_phrase_blocks_and_loop_lines(plugin, plan: Plan) -> None:
    """The sparse plug-in's row follows the built-ins' rows (effect order) before the batch;
    its phrase is in the one-line answer; the block it recomputes shows what it keeps; its
    setup and optimizer-step lines replace the plain loop's; its word joins apply_plan's."""
    sparse = _with(plan, sparse="2:4", quiet="on")
    rows = answer_rows(facts.answer(sparse))
    labels = [label for label, _ in rows]
    assert labels.index("Precision") < labels.index("Checkpointed") < labels.index("Sparsity")
    assert labels.index("Sparsity") < labels.index("Batch")
    assert ("Sparsity", "2:4 sparse weights") in rows and ("Also", "quiet: on") in rows
    assert ", 2:4 sparse, batch 12 x 2" in one_line(sparse)
    assert facts.answer(sparse).checkpointed[-1] == "transformer.h.3"

    code = adoption_snippet(sparse)
    ast.parse(code)
    # What apply_plan installs for this pick: no compile (the pick does not compile).
    assert "plan)  # autocast, checkpointing, sparsity masks\n" in code
    assert "masks = sparse.masks(model)  # from the plan" in code
    assert "sparse.step(optimizer, masks)" in code and "optimizer.step()" not in code
    assert "shuffle=True)  # any shape" in code

    buf = io.StringIO()
    print_plan(sparse, Console(file=buf, width=200, color_system=None))
    text = buf.getvalue()
    assert "2:4 sparse weights" in text and "quiet: on" in text
    assert "sparse.step(optimizer, masks)" in text


def test_a_plugins_neutral_choice_still_speaks_when_it_says_so(plugin, plan: Plan) -> None:
    """A plug-in decides whether its neutral choice has a row (sparse: "dense"); one
    without words of its own says nothing of a neutral choice (quiet: "off")."""
    rows = dict(answer_rows(facts.answer(_with(plan, quiet="off"))))
    assert rows["Sparsity"] == "dense" and "Also" not in rows


def test_a_plugins_choice_that_changes_the_step_is_not_the_baseline(plugin, plan: Plan) -> None:
    """The baseline's own configuration plus a plug-in's non-neutral choice runs something
    else: no longer reported as the baseline itself."""
    base = plan.comparison[0].candidate
    same = plan.model_copy(update={"candidate": base})
    assert facts.answer(same).same_as_baseline
    assert not facts.answer(_with(same, quiet="on")).same_as_baseline
