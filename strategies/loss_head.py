"""The loss-head strategy: the LM head and the cross-entropy computed a chunk of tokens at a time.

A language model's logits are its step's largest tensors: at batch 8 x 1024 tokens and a
32000-token vocabulary the fp32 logits are 1.1 GiB, the log-softmax saves as many again for
backward, and the head's backward holds their gradients on top. Chunked
(:mod:`strategies._chunked_loss`), one chunk's logits are alive at a time, in forward and
in backward, for one more head matmul per step (each chunk's head is recomputed in
backward).

It rewrites the step, not the model: the model's forward runs with its head returning its
input, and the loss computes the head from those hidden states (:mod:`strategies._head_loss`).
So it is offered only where memadvisor owns the loss: a Hugging Face causal LM's own loss
from ``labels``, or a ``loss_fn`` that is a :class:`memadvisor.TokenCrossEntropy`; and only
after the chunked loss measured equal to the user's on the sample batch (a model of fake or
meta tensors, as ``device="estimate"`` plans one, on recognition alone: its screen needs no
device, ``screens_fake_tensors``). Otherwise the plan says why it was not offered.

Its choices: ``"off"``, or the number of chunks the tokens are cut into.

Known limitations (the estimate's effect):
    * The forward is assumed to peak at the loss, where the logits and their log-softmax
      are both alive (true wherever the vocabulary makes the logits the step's largest
      tensors); a model whose forward peaks inside a block has its forward peak estimated
      low by what the loss held. The device's probes measure the truth.
    * A chunk's transient is counted as 2 fp32 chunks of logits in forward (2.5 under
      autocast) and 3 in the head's backward, beside the head's weight gradient; or, where
      more, 3 weight gradients (2 under autocast): each chunk's is added to the sum of the
      ones before, out of place in fp32 as the simulated device measured it (the sum, the
      chunk's and their new sum alive at once). Under autocast the
      head's low-precision weight copy is no longer saved from forward to backward: each
      chunk's recompute makes its own, within the chunk's transient.
    * The logits the plain step holds from the end of forward through the optimizer's
      step are taken as the head's output in the step's dtype: 2 bytes an element under
      bf16 or fp16 autocast. A model that casts its logits to fp32 in its forward holds
      twice that; its chunked estimate is then high by the difference (pessimistic).
    * The recomputed head is priced at the forward's time times the head's share of the
      parameters: matmul time follows parameters for a dense LM, not for others.
    * What a memory cap strands beyond the allocated peak (the estimate's reserved bytes:
      the step's largest allocation) becomes the larger of one fp32 chunk of logits and the
      blocks' largest tensor. A tensor outside the blocks larger than both (an embedding's
      output wider than any block's) is not seen; the probes measure the truth. Before this,
      the whole logits stayed in that term and held a 0.35B decoder at 8 GiB to batch 6 by
      the estimate where batch 15 ran (docs/design.md, "The card rows (issue 28)").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import JsonValue

from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Advice, Check, ReportPart
from memadvisor.schema.facts import Facts
from memadvisor.schema.precision import AUTOCAST_DTYPES
from memadvisor.schema.profile import ModuleActivity, Profile, StepProfile
from memadvisor.step import Step
from memadvisor.strategy import Checked, Described, EffectOrder, HandTried, Strategy
from memadvisor.units import fmt_bytes
from strategies._head_loss import (
    ChunkedHeadLoss,
    HeadlessForward,
    HeadLoss,
    check_head_loss,
    find_head_loss,
    losses_agree,
    users_parts,
)
from strategies._numerics import check_device

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.plan import Plan
    from memadvisor.workload import Workload

__all__ = ["CHUNKS", "LossHead", "loss_activity"]

#: The chunk counts offered: torchtune's default (8), and a finer one for long sequences.
CHUNKS: tuple[int, ...] = (8, 32)
#: A chunk's transients in fp32 logit-chunks, as the simulated device measured them on
#: examples/gpt.py (tests/strategies/test_loss_head.py): forward, the logits and their
#: log-softmax (under autocast a low-precision copy of the logits too); the head's backward,
#: the saved log-softmax, its gradient and the logits' gradient.
FORWARD_CHUNKS, FORWARD_CHUNKS_LOW, BACKWARD_CHUNKS = 2.0, 2.5, 3.0
#: Copies of the head's weight gradient alive while a chunk's joins the sum, as measured
#: there too: in fp32 autograd adds out of place (the sum, the chunk's, the new sum);
#: under autocast the chunk's arrives as a fresh fp32 copy and is added in place.
SUM_COPIES, SUM_COPIES_LOW = 3, 2
#: The ops whose saved output is the loss's copy of the logits.
LOG_SOFTMAX = ("_log_softmax", "log_softmax")
#: The share of the step's saved activations the loss's must reach for the plan to say why
#: the strategy was not offered (a classifier's 10-way loss is not worth a line).
WORTH_SAYING = 0.1
#: Rows of the sample batch the equality check runs on (a forward each way, no gradients).
CHECK_ROWS = 2


def loss_activity(step: StepProfile) -> ModuleActivity | None:
    """The activity outside the blocks whose saved bytes the loss's log-softmax made (the
    profiler's ``<loss>``, or ``<other>`` where the model computes its own loss); None
    when the step has no such loss."""
    found = [o for o in step.outside if any(op in LOG_SOFTMAX for op in o.made_by)]
    return max(found, key=lambda o: o.activation.per_sample_bytes) if found else None


def _chunks(choice: JsonValue) -> int:
    """The chunk count of a choice; 0 for off.

    Raises:
        BadInputError: neither 'off' nor a positive chunk count.
    """
    if choice in (None, False, 0, "off"):
        return 0
    if isinstance(choice, bool) or not isinstance(choice, int) or choice < 1:
        raise BadInputError(
            f"A loss_head choice is 'off' or a number of chunks (a positive int), but got "
            f"{choice=}. Example: 8."
        )
    return choice


def _head_bytes(profile: Profile, head: str | None) -> tuple[int, int]:
    """(parameter bytes, gradient bytes) of the module ``head`` (0, 0 when unknown)."""
    row = next((r for r in profile.layers if r.name == head), None)
    return (row.param_bytes, row.grad_bytes) if row is not None else (0, 0)


def _on_check_device(spec: HeadLoss, workload: Workload) -> tuple[float, float]:
    """:func:`check_head_loss` on the sample batch, run where the numerics check runs its
    copies (a card where there is one, on a copy of the model; else in place).

    Why: two forwards of lm350m on 2 rows of 1024 tokens took 2.9 s of a plan's screen on the
    CPU of an H100 host (3.6 s in a fresh process on 16 cores, 18.6 s on 2); on the card,
    copy included, 0.7 s (docs/design.md, "Five things the card showed (session 13)"). The
    user's model is not moved."""
    import copy

    where = check_device()
    model = workload.model
    if where is not None and workload.device.type != where.type:
        model = copy.deepcopy(model).to(where)
    device = where if where is not None else workload.device
    batch = workload.batch(min(CHECK_ROWS, workload.sample_batch_size), device)
    return check_head_loss(spec, model, batch, workload.forward, workload.loss)


class LossHead(Strategy, Checked, HandTried, Described):
    """Chunked cross-entropy: the LM head and the loss, a chunk of tokens at a time."""

    name = "loss_head"
    # After precision (whose step it reads) and checkpointing; it edits the loss's moments.
    effect_order = EffectOrder.LOSS
    # A training framework that computes the loss itself cannot adopt it.
    states = frozenset({"loss_changed"})
    # Its screen recognises the loss; on fake tensors it measures nothing (device="estimate").
    screens_fake_tensors = True

    def __init__(self) -> None:
        # Set by screen(): whether this plan's workload has a loss memadvisor owns and the
        # chunked loss measured equal to it.
        self.offered = False

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        if not self.offered or loss_activity(profile.steps["fp32"]) is None:
            return ["off"]
        return ["off", *CHUNKS]

    def screen(self, workload: Workload, profile: Profile, config: PlanConfig) -> list[Check]:
        """Offer the chunked loss only where memadvisor owns the loss and, on the sample
        batch, the chunked loss equals the user's. Where not, and the loss's logits are a
        tenth or more of the step's saved activations, a failed check says why (the
        checks='report' setting does not change this: another loss is another objective)."""
        self.offered = False
        if config.world_size > 1:
            return self._not_offered(
                profile, "the ranks' DDP or FSDP2 wrap is not planned with a rewritten loss"
            )
        spec = find_head_loss(
            workload.model, workload.loss_fn, workload.sample_batch, workload.forward_fn
        )
        if isinstance(spec, str):
            return self._not_offered(profile, spec)
        if not _holds_values(workload):
            self.offered = True
            return [
                Check(
                    strategy=self.name,
                    summary=(
                        f"the chunked loss of {spec.head} ({spec.kind}) is offered as "
                        "recognised, not measured equal: the model's tensors hold no values "
                        "(fake or meta)."
                    ),
                    passed=True,
                )
            ]
        try:
            want, got = _on_check_device(spec, workload)
        except Exception as e:  # noqa: BLE001 - any failure of the rewritten step refuses it
            return self._not_offered(
                profile, f"the model did not run with its head skipped ({type(e).__name__}: {e})"
            )
        metrics = {"loss": want, "chunked_loss": got}
        if not losses_agree(want, got):
            return self._not_offered(
                profile,
                f"on the sample batch the chunked loss is {got:.6g} and yours {want:.6g}: the "
                f"model changes {spec.head}'s output before the loss",
                metrics,
            )
        self.offered = True
        return [
            Check(
                strategy=self.name,
                summary=(
                    f"the chunked loss of {spec.head} ({spec.kind}) equals yours on the sample "
                    f"batch: {got:.6g} against {want:.6g}."
                ),
                passed=True,
                metrics=metrics,
            )
        ]

    def _not_offered(
        self, profile: Profile, why: str, metrics: dict[str, float] | None = None
    ) -> list[Check]:
        """A failed check saying why, where the logits matter; else nothing."""
        step = profile.steps["fp32"]
        loss = loss_activity(step)
        b = max(profile.batch_sizes)
        total = step.activation_total.at(b)
        if loss is None or loss.activation.at(b) < WORTH_SAYING * total:
            return []
        share = loss.activation.at(b) / total if total else 1.0
        return [
            Check(
                strategy=self.name,
                summary=(
                    f"the chunked loss (the head and the loss a chunk of tokens at a time) "
                    f"was not offered: {why}. The loss holds {share:.0%} of the step's "
                    "saved activations."
                ),
                passed=False,
                metrics=metrics or {},
            )
        ]

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        """The loss's saved logits leave the end of forward; its peak at the loss and the
        head's in backward become one chunk's transient (the module docstring's counts);
        the head's forward is added once more."""
        chunks = _chunks(choice)
        fp32 = loss_activity(profile.steps["fp32"])
        if not chunks or fp32 is None:
            return
        b = model.batch_size
        logits = fp32.activation.at(b)  # the fp32 log-softmax output: one copy of the logits
        chunk = math.ceil(logits / chunks)
        saved = (loss_activity(model.step) or fp32).activation.at(b)
        param_bytes, grad_bytes = _head_bytes(profile, fp32.after)
        low = model.precision != "fp32"
        nums = model.numbers
        # The profiled step keeps the model's output, the logits, from the end of forward
        # through backward and the optimizer's step, as a user's loop does
        # (memadvisor.workload.train_step); the chunked step returns the hidden states, which
        # the head's chunks save anyway, so the logits' bytes (the log-softmax's saved output
        # is their size) leave those moments too.
        # Those logits are the head's output, in the step's dtype: under autocast the fp32
        # step's scaled to autocast's dtype, whatever the loss saved (a loss that casts them to
        # fp32 first saves fp32: examples/llama.py's at 256 tokens, simulated, where taking
        # the saved size took 15.6 MiB a sample too many off backward and the optimizer's
        # step, and the estimate fell as the batch grew).
        dtype = AUTOCAST_DTYPES.get(model.precision)
        held = logits * dtype.itemsize // 4 if dtype is not None else saved
        eof = nums.end_of_forward - held
        at_loss = nums.phases.get("forward", eof) - eof  # the forward's top above its end
        forward = int((FORWARD_CHUNKS_LOW if low else FORWARD_CHUNKS) * chunk)
        model.add_bytes("forward", min(0, forward - at_loss - saved))
        # A chunk's backward, or the moment its weight gradient joins the sum; beside them
        # the hidden states' gradient, gathered from every chunk (the last block's output's
        # size). Under autocast the head's weight copy no longer waits from forward.
        summing = (SUM_COPIES_LOW if low else SUM_COPIES) * grad_bytes
        head = max(int(BACKWARD_CHUNKS * chunk) + grad_bytes, summing)
        head += nums.outputs[-1] if nums.outputs else 0
        head -= param_bytes // 2 if low else 0
        model.add_backward_bytes([0] * len(model.checkpointed), head=head - nums.head_peak - saved)
        model.add_bytes("backward", -held)
        model.add_bytes("optimizer", -held)
        model.drop_activations(saved)
        # The whole logits were the step's largest allocation, which a memory cap can strand
        # beyond the allocated peak; now a chunk of them is, or the blocks' largest tensor.
        inside = nums.largest_block_allocation
        if inside is not None:
            model.cap_largest_allocation(max(chunk, inside))
        if profile.param_bytes:
            model.add_ms(model.forward_ms * min(1.0, param_bytes / profile.param_bytes))

    def _spec(self, step: Step) -> HeadLoss | None:
        """What the step's loss is, as the chunked loss needs it; None where the plan was
        made with a loss_fn the step was not given (a plan file applied without it).

        Raises:
            BadInputError: the step's loss is not one memadvisor owns.
        """
        parts = users_parts(step)
        if parts is None:
            raise BadInputError(
                "The chunked loss rewrites the user's own loss, but this step's loss was "
                f"already replaced (by {list(step.loss_changed_by)}) or is not the user's. "
                "Plan without one of them."
            )
        loss_fn, forward_fn = parts
        form = step.profile.call_form if step.profile is not None else None
        if loss_fn is None and form is not None and form.loss == "loss_fn":
            return None
        # No batch here: whether a Hugging Face batch holds labels is the batch's to say.
        spec = find_head_loss(step.model, loss_fn, None, forward_fn)
        if isinstance(spec, str):
            raise BadInputError(
                f"The chunked loss (loss_head) cannot be applied: {spec}. Plan again without "
                "it, or apply this plan to the model it was made for."
            )
        return spec

    def validate(self, step: Step, choice: JsonValue) -> None:
        """Raises ``BadInputError``: not a chunk count, or the step's loss is not one
        memadvisor owns (:func:`strategies._head_loss.find_head_loss`)."""
        if _chunks(choice):
            self._spec(step)

    def apply(self, step: Step, choice: JsonValue) -> Step:
        """The step whose forward skips the head and whose loss computes it in chunks; the
        model's parameters and ``state_dict`` keys unchanged (the head gets a forward
        wrapper, active only inside the step's forward).

        A plan file applied without the loss_fn it was made with (``apply_plan(model,
        path)``) leaves the model as it is and gives a step that says to pass it.

        Raises:
            BadInputError: as :meth:`validate`.
        """
        chunks = _chunks(choice)
        if not chunks:
            return step
        spec = self._spec(step)
        changed = (*step.loss_changed_by, self.name)
        if spec is None:
            return step.replace(forward=_needs_loss_fn, loss_changed_by=changed)
        return step.replace(
            forward=HeadlessForward.install(step.forward, spec, step.model),
            loss=ChunkedHeadLoss(spec, chunks),
            loss_changed_by=changed,
        )

    def facts(self, choice: JsonValue) -> Facts:
        """A chunked choice computes the loss another way: train with the step."""
        return Facts(loss_changed=bool(_chunks(choice)))

    def describe(self, choice: JsonValue, plan: Plan) -> ReportPart | None:
        chunks = _chunks(choice)
        if not chunks:
            return None
        return ReportPart(
            label="Loss",
            words=f"chunked cross-entropy: the head and the loss in {chunks} chunks of tokens",
            brief=f"loss in {chunks} chunks",
        )

    def by_hand(self, options: Sequence[JsonValue]) -> tuple[str, JsonValue] | None:
        """ "+Chunked loss": the coarsest chunking offered (what torchtune does by default)."""
        counts = [c for c in options if isinstance(c, int) and not isinstance(c, bool) and c]
        return ("+Chunked loss", min(counts)) if counts else None

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        chunks = _chunks(choice)
        fp32 = loss_activity(profile.steps["fp32"])
        if not chunks:
            return None
        b = max(profile.batch_sizes)
        logits = fp32.activation.at(b) if fp32 is not None else 0
        return Advice(
            strategy=self.name,
            title=f"Compute the head and the loss in {chunks} chunks",
            sentence=(
                "Compute the LM head and the cross-entropy a chunk of tokens at a time, each "
                "chunk checkpointed, so that one chunk's logits are alive at a time instead "
                "of all of them (and their log-softmax, and their gradient). The loss and "
                "the gradients are the same; the head's matmul runs once more, in backward."
            ),
            snippet=_snippet(chunks),
            effect=(
                f"estimated at batch {b}: the {fmt_bytes(logits)} of fp32 logits, their "
                "log-softmax and gradient leave the step; one chunk's "
                f"{fmt_bytes(logits / chunks)} of each is alive at a time"
            ),
        )


def _holds_values(workload: Workload) -> bool:
    """Whether the model's parameters hold values (not fake or meta tensors: a plan for
    ``device='estimate'``), so that its loss can be measured."""
    from memadvisor._torch_private import is_fake

    return not any(p.is_meta or is_fake(p) for p in workload.model.parameters())


def _needs_loss_fn(model: Any, batch: Any) -> Any:
    """The forward of a chunked step whose loss_fn is not known: says to pass it."""
    raise BadInputError(
        "This plan computes the head and the loss in chunks from your loss_fn (a "
        "memadvisor.TokenCrossEntropy), which the plan file does not hold: pass it too, "
        "apply_plan(model, plan, loss_fn=your_loss_fn)."
    )


def _snippet(chunks: int) -> str:
    return f"""\
# With memadvisor: train with the step the plan made (model, head and loss rewritten).
tuned = memadvisor.optimize(model, sample_batch, loss_fn=loss_fn, budget_gb=...)
loss = tuned.memadvisor_step(batch)  # forward, chunked head + loss
loss.backward()

# By hand: run the model without its head, then the head and the loss in chunks.
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

def chunk_loss(h, weight, bias, t):
    logits = F.linear(h, weight, bias).float()  # (chunk, vocab): one chunk alive at a time
    return F.cross_entropy(logits, t, ignore_index=-100, reduction="sum")

def chunked_cross_entropy(hidden, head, targets, chunks={chunks}):
    h, t = hidden.flatten(0, -2), targets.flatten()  # Hugging Face labels: shift them first
    size = -(-h.shape[0] // chunks)
    total = sum(
        checkpoint(chunk_loss, hc, head.weight, head.bias, tc, use_reentrant=False)
        for hc, tc in zip(h.split(size), t.split(size))
    )
    return total / (t != -100).sum()
"""
