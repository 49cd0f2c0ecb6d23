"""Strategies state what a choice does (``Strategy.facts``); other layers read the facts.

Rules: a built-in strategy's facts set only the fields its ``states`` declares, a neutral
choice states nothing, and ``facts_of`` merges a candidate's choices.
"""

from __future__ import annotations

import pytest

from memadvisor.schema.candidate import Candidate
from memadvisor.schema.facts import Facts
from memadvisor.strategy import facts_of, load_strategies

EXAMPLES = {
    "precision": ["fp32", "bf16", "fp16", "tf32"],
    "checkpointing": [[], ["h.0", "h.1"]],
    "compile": ["off", "default", {"mode": "default", "regional": True}],
    "parallel": [None, {"kind": "fsdp2", "world_size": 2, "units": ["h.0"]}],
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_facts_set_only_the_fields_the_strategy_states(name: str) -> None:
    """What a strategy declares it may state (``states``) bounds what any choice states, and
    its neutral choice states nothing."""
    (strategy,) = load_strategies([name])
    assert strategy.states, f"{name} states no facts"
    for choice in EXAMPLES[name]:
        facts = strategy.facts(choice)
        assert set(facts.model_dump(exclude_defaults=True)) <= strategy.states, (name, choice)
        if strategy.is_neutral(choice):
            assert facts == Facts(), (name, choice)


def test_facts_of_merges_a_candidates_choices() -> None:
    """bf16 + two checkpointed blocks + compile + FSDP2 on 2 ranks: every fact, one object."""
    candidate = Candidate(
        batch_size=4,
        choices={
            "precision": "bf16",
            "checkpointing": ["h.0", "h.1"],
            "compile": "default",
            "parallel": {"kind": "fsdp2", "world_size": 2, "units": ["h.0"]},
        },
    )
    assert facts_of(candidate) == Facts(
        autocast="bf16",
        recomputed_blocks=["h.0", "h.1"],
        compiled=True,
        compile_mode="default",
        compiled_whole=True,  # "default": the whole model, what a framework's switch makes
        parallel="fsdp2",
        world_size=2,
    )
    assert facts_of(Candidate(batch_size=4)) == Facts()
