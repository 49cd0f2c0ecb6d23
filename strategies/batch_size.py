"""Batch size and gradient accumulation: the micro-batch that fits, the batch the user trains with.

The planner searches the micro-batch itself (``Candidate.batch_size``) and sets
``Candidate.accumulation_steps``; the StepModel already prices both. So this strategy offers
no search choices of its own (only its neutral one): what it adds is the arithmetic that
keeps a user's effective batch (:func:`accumulation_steps_for`, :func:`choice_for`) and the
training-loop advice. Its non-neutral choice records the pick for the explanation::

    {"batch_size": 12, "accumulation_steps": 6, "effective_batch": 72}

``apply`` changes nothing: a batch size is the training loop's, not the model's.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import JsonValue

from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Advice, ReportPart
from memadvisor.schema.call import CallForm
from memadvisor.step import Step
from memadvisor.strategy import Described, EffectOrder, Recorded, Strategy
from strategies._format import loop_header, loss_line

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.candidate import Candidate
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.plan import Plan
    from memadvisor.schema.profile import Profile

__all__ = ["BatchSize", "accumulation_steps_for", "choice_for"]


def accumulation_steps_for(effective_batch: int, batch_size: int) -> int:
    """Micro-batches of ``batch_size`` that reach at least ``effective_batch`` samples.

    Raises:
        BadInputError: either is not positive.
    """
    if effective_batch <= 0 or batch_size <= 0:
        raise BadInputError(
            f"Batch sizes must be positive, but got {effective_batch=} and {batch_size=}."
        )
    return math.ceil(effective_batch / batch_size)


def choice_for(candidate: Candidate, effective_batch: int | None = None) -> JsonValue:
    """The choice that records ``candidate``'s batch for the advice (None: nothing to say)."""
    if effective_batch is None and candidate.accumulation_steps == 1:
        return None
    return {
        "batch_size": candidate.batch_size,
        "accumulation_steps": candidate.accumulation_steps,
        "effective_batch": effective_batch or candidate.batch_size * candidate.accumulation_steps,
    }


def _parse(choice: JsonValue) -> tuple[int, int, int] | None:
    if choice in (None, "off"):
        return None
    if not isinstance(choice, dict):
        raise BadInputError(
            "A batch_size choice is {'batch_size': b, 'accumulation_steps': k, "
            f"'effective_batch': e}}, but got {choice=}."
        )
    try:
        b = int(choice["batch_size"])
        k = int(choice.get("accumulation_steps", 1))
        e = int(choice.get("effective_batch", b * k))
    except (KeyError, TypeError, ValueError) as err:
        raise BadInputError(
            f"A batch_size choice needs an integer 'batch_size', but got {choice=}."
        ) from err
    if b <= 0 or k <= 0 or e <= 0:
        raise BadInputError(f"Batch sizes and steps must be positive, but got {choice=}.")
    return b, k, e


class BatchSize(Strategy, Described, Recorded):
    """The micro-batch that fits and the accumulation that keeps the effective batch."""

    name = "batch_size"
    effect_order = EffectOrder.BATCH

    def is_neutral(self, choice: JsonValue) -> bool:
        return choice in (None, "off")

    def describe(self, choice: JsonValue, plan: Plan) -> ReportPart | None:
        """Nothing of its own: the answer's Batch row is the planner's batch itself."""
        return None

    def changes_step(self, choice: JsonValue) -> bool:
        """Never: the choice records the pick's batch, which the report compares itself."""
        return False

    def record(self, pick: Candidate, config: PlanConfig) -> JsonValue | None:
        """The pick's batch (and accumulation), so that its advice explains the batch."""
        return choice_for(pick, config.effective_batch)

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        # The planner searches Candidate.batch_size / accumulation_steps directly.
        return [None]

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        """Nothing to add: the StepModel prices the candidate's batch and accumulation.

        Raises:
            BadInputError: the choice disagrees with the candidate being estimated.
        """
        parsed = _parse(choice)
        if parsed is None:
            return
        b, k, _ = parsed
        if (b, k) != (model.batch_size, model.accumulation_steps):
            raise BadInputError(
                f"The batch_size choice {choice} disagrees with the candidate (batch "
                f"{model.batch_size}, {model.accumulation_steps} accumulation steps); "
                "build it with strategies.batch_size.choice_for(candidate)."
            )

    def apply(self, step: Step, choice: JsonValue) -> Step:
        """Returns ``step`` unchanged: the batch is the training loop's (see the advice)."""
        _parse(choice)
        return step

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        parsed = _parse(choice)
        if parsed is None:
            return None
        b, k, e = parsed
        if k == 1:
            return Advice(
                strategy=self.name,
                title=f"Batch size {b}",
                sentence=f"Train with micro-batches of {b} samples.",
                snippet=f"loader = DataLoader(dataset, batch_size={b}, shuffle=True)\n",
                effect="",
            )
        reached = b * k
        over = f" ({reached} samples, {reached - e} above {e})" if reached != e else ""
        form = profile.call_form if profile is not None else None
        return Advice(
            strategy=self.name,
            title=f"Batch {b} x {k} accumulation steps",
            sentence=(
                f"Keep your effective batch of {e} by accumulating the gradients of {k} "
                f"micro-batches of {b}{over} before each optimizer step; divide each loss by "
                f"{k} so the gradient is the mean over the effective batch."
            ),
            snippet=_snippet(b, k, form),
            effect=f"{k} forward/backward passes per optimizer step; the peak is one micro-batch's",
        )


def _snippet(batch_size: int, steps: int, form: CallForm | None) -> str:
    return f"""\
loader = DataLoader(dataset, batch_size={batch_size}, shuffle=True)
accumulation_steps = {steps}
{loop_header(form)}
    {loss_line(form)}
    loss = loss / accumulation_steps
    loss.backward()  # gradients add up over the micro-batches
    if (i + 1) % accumulation_steps == 0:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
"""
