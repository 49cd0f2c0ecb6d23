"""What a plan decides, read once for every integration: precision, blocks, batch, compile."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from torch import nn

from memadvisor.schema.candidate import Candidate
from memadvisor.schema.config import PlanConfig
from memadvisor.schema.plan import Plan
from memadvisor.strategy import facts_of

__all__ = ["Pick", "apply_blocks", "pick_of", "plan_options", "without_states"]

logger = logging.getLogger(__name__)


def plan_options(options: dict[str, Any], dataset: Any) -> dict[str, Any]:
    """An integration's :func:`memadvisor.plan` options: no progress bars unless asked
    (the ``memadvisor`` logger carries the lines; the framework owns the terminal), and the
    batch capped at the dataset's length, as Lightning's batch-size finder caps it: a batch
    larger than the data is one step an epoch, or none with ``drop_last``.

    A dataset without ``len()`` (an iterable one) is not capped; a ``max_batch`` you passed
    below its length is kept. Strategies that change how the loss is computed are left out:
    the framework computes it.
    """
    out = dict(options)
    out.setdefault("progress", False)
    # The framework computes the loss (the Trainer's compute_loss, Lightning's
    # training_step): a strategy that computes it another way cannot be adopted there.
    out["strategies"] = without_states(out.get("strategies"), {"loss_changed"})
    try:
        length = len(dataset)
    except TypeError:  # an IterableDataset, or no dataset at all
        return out
    limit = out.get("max_batch", PlanConfig.model_fields["max_batch"].default)
    if 0 < length < limit:
        out["max_batch"] = length
        logger.info("batch capped at the dataset's length, %d samples", length)
    return out


def without_states(names: list[str] | None, states: set[str]) -> list[str]:
    """``names`` (default: every registered strategy) less those whose choices may set one
    of ``states`` (:attr:`memadvisor.strategy.Strategy.states`, fields of the Facts)."""
    from memadvisor.strategy import load_strategies

    return [s.name for s in load_strategies(names) if not s.states & states]


@dataclasses.dataclass(frozen=True)
class Pick:
    """The plan's choices in the words a training framework's settings use."""

    batch_size: int
    accumulation_steps: int
    precision: str  # fp32, bf16 or fp16
    tf32: bool  # fp32 with TF32 matmuls (a process-wide setting the framework switches)
    checkpointed: list[str]  # block names
    block_count: int | None  # blocks the profile found; None unknown
    compile_mode: str | None  # None: eager
    compiled_whole: bool = False  # the whole model in compile_mode: a framework's switch does it
    compiled_regional: bool = False  # each repeated block compiled, the rest eager

    @property
    def compile_form(self) -> str:
        """The compile's form in words: ``'the whole model'``, ``'each repeated block'`` or
        ``'the whole model with a partitioner budget'`` (what no framework switch makes)."""
        if self.compiled_whole:
            return "the whole model"
        if self.compiled_regional:
            return "each repeated block"
        return "the whole model with a partitioner budget"

    @property
    def all_blocks(self) -> bool:
        """Every block the profile found is checkpointed (a framework's own switch does that)."""
        return bool(self.checkpointed) and self.block_count == len(self.checkpointed)


def pick_of(plan: Plan) -> Pick:
    from memadvisor.report._facts import answer

    said = answer(plan)  # the pick's precision and recomputed blocks, in its strategies' words
    cand = plan.candidate
    facts = facts_of(cand)  # what the pick's strategies say it does, not their names
    mode = (facts.compile_mode or "default") if facts.compiled else None
    return Pick(
        batch_size=cand.batch_size,
        accumulation_steps=cand.accumulation_steps,
        precision=said.precision,
        tf32="tf32" in said.briefs,
        checkpointed=said.checkpointed,
        block_count=len(plan.profile.blocks) if plan.profile is not None else None,
        compile_mode=mode,
        compiled_whole=facts.compiled_whole,
        compiled_regional=facts.compiled_regional,
    )


def apply_blocks(model: nn.Module, plan: Plan, *, compiled: bool = False) -> nn.Module:
    """Checkpoint the plan's blocks of ``model`` in place, and with ``compiled`` install its
    compile too, in the form it measured (the whole model, each repeated block, a
    partitioner budget), around those blocks; nothing else of the plan.

    Precision and batch are the framework's to set (its autocast, its loader); the rest of
    :func:`memadvisor.apply_plan` would do them a second time. A caller that installs the
    compile here leaves the framework's own compile switch off: that switch compiles the
    whole model, another step in memory and time where the plan measured each block.
    """
    from memadvisor.strategy import apply_to_model, chosen_strategies

    chosen = {
        s.name: c
        for s, c in chosen_strategies(plan.candidate)
        if s.facts(c).recomputed_blocks or (compiled and s.facts(c).compiled)
    }
    if not chosen:
        return model
    only = Candidate(batch_size=plan.candidate.batch_size, choices=chosen)
    return apply_to_model(model, only, profile=plan.profile).model
