"""plan_options: what every integration changes in memadvisor.plan's options: no bars unless
asked, and the batch capped at the dataset's length where the dataset has one; pick_of: the
compile's form in the words a framework's log line says."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import IterableDataset, TensorDataset

from memadvisor.integrations._pick import pick_of, plan_options
from memadvisor.strategy import load_strategies, registered_names

# Every registered strategy but those that compute the loss another way (the framework's).
KEPT = [s.name for s in load_strategies() if "loss_changed" not in s.states]


class _Stream(IterableDataset):
    def __iter__(self):  # noqa: ANN204
        yield torch.zeros(1)


def test_the_batch_is_capped_at_the_datasets_length_and_bars_are_off() -> None:
    ds = TensorDataset(torch.zeros(100, 2))
    assert plan_options({}, ds) == {"progress": False, "max_batch": 100, "strategies": KEPT}


def test_what_you_passed_wins_where_it_is_tighter() -> None:
    ds = TensorDataset(torch.zeros(100, 2))
    assert plan_options({"progress": True, "max_batch": 16}, ds) == {
        "progress": True,
        "max_batch": 16,
        "strategies": KEPT,
    }
    assert plan_options({"max_batch": 1000}, ds)["max_batch"] == 100


def test_a_dataset_without_a_length_is_not_capped() -> None:
    assert plan_options({}, _Stream()) == {"progress": False, "strategies": KEPT}
    assert plan_options({}, None) == {"progress": False, "strategies": KEPT}


@pytest.mark.skipif(
    "loss_head" not in registered_names(),
    reason="loss_head is not registered in this environment (pip install -e . from here)",
)
def test_strategies_that_change_the_loss_are_left_out() -> None:
    """The framework computes the loss (the Trainer's compute_loss, Lightning's
    training_step): a strategy whose choices change how the loss is computed is not
    planned, whether every strategy or a list including it was asked for."""
    changing = [s.name for s in load_strategies() if "loss_changed" in s.states]
    assert changing  # the chunked loss (loss_head) is one
    asked = ["batch_size", *changing]
    assert plan_options({"strategies": asked}, None)["strategies"] == ["batch_size"]
    assert not set(changing) & set(plan_options({}, None)["strategies"])


@pytest.mark.parametrize(
    ("form", "words", "whole"),
    [
        ("default", "the whole model", True),
        ({"mode": "default", "regional": True}, "each repeated block", False),
        (
            {"mode": "default", "activation_memory_budget": 0.5},
            "the whole model with a partitioner budget",
            False,
        ),
    ],
)
def test_the_compiles_form_is_named_as_the_plan_measured_it(gpt_plan, form, words, whole) -> None:
    """Rule: the Trainer's log line and Lightning's decision name the compile the plan chose:
    a whole-model compile with a partitioner budget (which the search reaches where the
    eager pick checkpoints) is not "each repeated block", nor what a framework switch makes."""
    choices = {**gpt_plan.candidate.choices, "compile": form}
    plan = gpt_plan.model_copy(
        update={"candidate": gpt_plan.candidate.model_copy(update={"choices": choices})}
    )
    pick = pick_of(plan)
    assert pick.compile_mode == "default"
    assert pick.compile_form == words and pick.compiled_whole is whole
