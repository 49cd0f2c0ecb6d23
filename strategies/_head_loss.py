"""Where memadvisor owns the loss, and the step that computes the head inside it.

The chunked loss (:mod:`strategies._chunked_loss`) replaces two things at once: the
model's last linear layer (the head) and the loss over its logits. That is only possible
where memadvisor knows exactly what the loss is:

* a Hugging Face causal LM computing its own loss from ``labels`` (a
  ``transformers.PreTrainedModel`` whose ``loss_function`` is transformers'
  ``ForCausalLMLoss`` and whose output embeddings are an ``nn.Linear``, called with a
  mapping batch holding ``labels`` and no ``loss_fn``);
* a ``loss_fn`` that is a :class:`memadvisor.losses.TokenCrossEntropy`, which names its
  head and where the targets are.

Anything else is a loss memadvisor cannot see into: it may read any logit, so all of them
must be made. :func:`find_head_loss` says which case a workload is, or why it is neither;
:func:`check_head_loss` then measures, on the sample batch, that the chunked loss equals
the loss the user trains with (a head whose output is changed before the loss, by
softcapping or a scale the recognition did not see, fails there).

The rewritten step: :class:`HeadlessForward` runs the user's forward with the head's
forward returning its input (:class:`SkippedHead`), and with ``labels`` taken out of a
Hugging Face batch so that the model computes no loss of its own;
:class:`ChunkedHeadLoss` computes the head and the loss from what came out, a chunk of
tokens at a time.

Known limitations:
    * The head must be called once, on the states the model returns unchanged (no
      softcapping, scaling or slicing after it): checked on the sample batch.
    * A Hugging Face batch holding ``num_items_in_batch`` or ``shift_labels`` (the
      Trainer's gradient-accumulation normalisation) is not recognised.
    * The Hugging Face model's output carries the last hidden states where its logits
      were (``output.logits``): code that reads the logits of the rewritten step's output
      reads hidden states.
"""

from __future__ import annotations

import contextlib
import math
import sys
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.losses import TokenCrossEntropy
from memadvisor.step import Step
from strategies import _forward
from strategies._chunked_loss import chunked_cross_entropy

__all__ = [
    "ChunkedHeadLoss",
    "HeadLoss",
    "HeadOutput",
    "HeadlessForward",
    "SkippedHead",
    "check_head_loss",
    "find_head_loss",
    "losses_agree",
    "users_parts",
]

#: Hugging Face config fields that change the logits after the head: the chunked loss,
#: computed from the head's own output, would train another objective.
POST_PROCESSING = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale")
#: Batch keys Hugging Face's causal-LM loss reads besides ``labels``.
LOSS_KEYS = ("num_items_in_batch", "shift_labels")


@dataclass(frozen=True)
class HeadLoss:
    """What the chunked loss needs to know of a workload's loss (all of it JSON-able)."""

    head: str  # the head's qualified name in the model ("lm_head")
    targets: int | str  # where the batch holds the targets: a tuple index or a mapping key
    ignore_index: int = -100
    shift: bool = False  # position t predicts targets[..., t+1] (Hugging Face's causal LMs)
    labels_in_batch: bool = False  # Hugging Face: labels leave the batch before the forward
    kind: str = "TokenCrossEntropy"  # what was recognised, for the report

    def targets_of(self, batch: Any) -> torch.Tensor:
        return batch[self.targets]


def _transformers_causal_lm_loss() -> Callable | None:
    """transformers' ForCausalLMLoss where transformers is imported (a model of it exists
    only then), else None."""
    if "transformers" not in sys.modules:
        return None
    try:
        from transformers.loss.loss_utils import ForCausalLMLoss
    except ImportError:  # a transformers without it (before 4.46): not recognised
        return None
    return ForCausalLMLoss


def _hf_head_loss(model: nn.Module, batch: Any) -> HeadLoss | str:
    """The Hugging Face causal LM's loss as a HeadLoss, or why it is not one."""
    causal_lm_loss = _transformers_causal_lm_loss()
    if causal_lm_loss is None:
        return (
            "the model computes its own loss and is not a Hugging Face causal LM: memadvisor "
            "cannot see what that loss reads"
        )
    from transformers import PreTrainedModel, __version__

    version = f"transformers {__version__}"
    if not isinstance(model, PreTrainedModel):
        return f"the model computes its own loss and is not a {version} PreTrainedModel"
    if getattr(model, "loss_function", None) is not causal_lm_loss:
        return f"{type(model).__name__}'s loss is not {version}'s ForCausalLMLoss"
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        # Its loss_function is the causal default, but its forward computes its own loss
        # (T5: cross-entropy on unshifted labels) and builds its decoder's inputs from the
        # labels: without them it does not run (the check said only "You must specify exactly
        # one of input_ids or inputs_embeds", t5_base on a card and here).
        return (
            f"{type(model).__name__} is an encoder-decoder: its loss is its own, on labels "
            "that also feed its decoder, not the causal-LM loss the chunked head computes"
        )
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        return (
            f"{type(model).__name__}'s output embeddings are {type(head).__name__}, not nn.Linear"
        )
    config = getattr(model, "config", None)
    for field in POST_PROCESSING:
        value = getattr(config, field, None)
        if value not in (None, 0, 0.0, 1, 1.0):
            return (
                f"{type(model).__name__} changes its logits after the head ({field}={value}): "
                "the chunked loss would train another objective"
            )
    if batch is not None:
        if not isinstance(batch, Mapping) or not isinstance(batch.get("labels"), torch.Tensor):
            return "the batch holds no 'labels': the model computes no loss from them"
        extra = [k for k in LOSS_KEYS if k in batch]
        if extra:
            return f"the batch holds {extra}, which Hugging Face's loss reads besides the labels"
    name = next((n for n, m in model.named_modules() if m is head), None)
    if not name:
        return "the output embeddings are not a submodule of the model"
    return HeadLoss(
        head=name,
        targets="labels",
        shift=True,
        labels_in_batch=True,
        kind=f"{type(model).__name__}'s own loss ({version} ForCausalLMLoss)",
    )


def find_head_loss(
    model: nn.Module, loss_fn: Any, sample_batch: Any = None, forward_fn: Any = None
) -> HeadLoss | str:
    """The loss a workload trains with, as a :class:`HeadLoss` when memadvisor owns it, or a
    sentence saying why it does not (for the report: why the chunked loss is not offered).

    ``sample_batch`` None (applying a plan, no batch at hand) skips what only a batch says
    (whether a Hugging Face batch holds ``labels``).
    """
    if isinstance(loss_fn, TokenCrossEntropy):
        try:
            head = model.get_submodule(loss_fn.head)
        except AttributeError:
            return f"TokenCrossEntropy names head={loss_fn.head!r}, which the model does not have"
        if not isinstance(head, nn.Linear):
            return (
                f"TokenCrossEntropy's head {loss_fn.head!r} is a {type(head).__name__}, not an "
                "nn.Linear"
            )
        return HeadLoss(
            head=loss_fn.head,
            targets=loss_fn.targets,
            ignore_index=loss_fn.ignore_index,
            shift=loss_fn.shift,
        )
    if loss_fn is not None:
        return (
            f"loss_fn ({getattr(loss_fn, '__name__', type(loss_fn).__name__)}) is a function "
            "memadvisor cannot see into: it may read every logit, so all of them are made. "
            "For token cross-entropy pass loss_fn=memadvisor.TokenCrossEntropy(targets=..., "
            "head=...), which computes the same loss and lets memadvisor chunk it"
        )
    if forward_fn is not None:
        return "a forward_fn calls the model: memadvisor cannot take the labels out of its call"
    return _hf_head_loss(model, sample_batch)


def users_parts(step: Step) -> tuple[Any, Any] | None:
    """``(loss_fn, forward_fn)`` the user's own step was built from (either None where the
    workload's rule applies: the output's own loss, ``model(...)`` by the batch's type), or
    None where ``step`` is not the user's step as built (another strategy replaced its loss,
    or it was made some other way): :attr:`memadvisor.step.Step.user`.
    """
    if step.loss_changed_by or step.user is None:
        return None
    return step.user.loss_fn, step.user.forward_fn


class SkippedHead(_forward.ForwardWrapper):
    """The head's forward, returning its input instead while ``skip`` is set.

    Installed once on the head (parameter names and ``state_dict`` keys unchanged); only
    :class:`HeadlessForward` sets ``skip``, for the duration of the step's forward, so the
    model called any other way (evaluation, generation) computes its logits as before.
    A skipped call notes the autocast the head would have run under (``autocast``), so
    that the chunked loss runs the head's matmul in the precision the model's forward gave
    it (bf16 on a card, not fp32: the loss itself runs outside the model's autocast).
    """

    def __init__(self, module: nn.Module, inner: Any) -> None:
        super().__init__(module, inner)
        self.skip = False
        self.autocast: tuple[str, torch.dtype] | None = None
        self.warned = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.skip:
            if not self.warned and torch.is_grad_enabled() and self.module.training:
                # The README's loop (loss_fn(model(x), batch)) on a plan with the chunked
                # loss: the whole logits, which the plan measured without, in a training
                # step. A user's loop ran out of memory so on a card (lm350m at 8 GiB,
                # batch 16: "Tried to allocate 1.95 GiB", the fp32 logits).
                self.warned = True
                warnings.warn(
                    "This model's plan computes its head and the loss in chunks inside "
                    "model.memadvisor_step(batch); called as model(...) while training, "
                    "the head computes all of its logits, which the plan's measured peak "
                    "does not hold and may run out of memory. Train with "
                    "loss = model.memadvisor_step(batch); loss.backward() "
                    "(apply_plan(model, plan, loss_fn=your_loss_fn)).",
                    stacklevel=2,
                )
            return self.call_inner(*args, **kwargs)
        hidden = args[0] if args else next(iter(kwargs.values()))
        device = hidden.device.type
        on = torch.is_autocast_enabled(device)
        self.autocast = (device, torch.get_autocast_dtype(device)) if on else None
        return hidden


@dataclass
class HeadOutput:
    """What the rewritten forward returns: the states the head would read, the head itself
    (so the loss uses the weights of the model that ran), and the model's own output."""

    hidden: torch.Tensor  # (..., hidden)
    head: nn.Linear
    output: Any
    autocast: tuple[str, torch.dtype] | None = None  # (device type, dtype) the head ran under


class HeadlessForward:
    """``forward(model, batch)``: ``inner`` with the head skipped (and, for Hugging Face,
    without ``labels``); returns a :class:`HeadOutput`.

    Finds the head by name in the model it is given, else uses the head module found when
    the step was rewritten (a wrapper the ranks put around the model, DDP's ``module.``,
    renames it). The head gets its :class:`SkippedHead` when the step is rewritten
    (:meth:`install`), or on the first call.
    """

    def __init__(self, inner: Callable[[nn.Module, Any], Any], spec: HeadLoss, head: nn.Linear):
        self.inner, self.spec, self.head = inner, spec, head

    @classmethod
    def install(
        cls, inner: Callable[[nn.Module, Any], Any], spec: HeadLoss, model: nn.Module
    ) -> HeadlessForward:
        """The headless forward of ``model``, its head's :class:`SkippedHead` installed."""
        head = model.get_submodule(spec.head)
        _forward.install(head, SkippedHead)
        return cls(inner, spec, head)

    def _head_of(self, model: nn.Module) -> nn.Linear:
        """The head of the model being run: found by name (a deep copy of the model run
        with this forward has its own), else the module held (the ranks' wrappers rename)."""
        try:
            head = model.get_submodule(self.spec.head)
        except AttributeError:
            return self.head
        return head if isinstance(head, nn.Linear) else self.head

    def __call__(self, model: nn.Module, batch: Any) -> HeadOutput:
        head = self._head_of(model)
        wrapper = _forward.find_wrapper(head, SkippedHead) or _forward.install(head, SkippedHead)
        if self.spec.labels_in_batch:
            if not isinstance(batch, Mapping) or "labels" not in batch:
                raise BadInputError(
                    "This step computes the causal-LM loss from the batch's 'labels' (the plan "
                    f"chose the chunked loss), but got a {type(batch).__name__} without them: "
                    "pass labels, as the batch the plan was made with did."
                )
            batch = {k: v for k, v in batch.items() if k != "labels"}
        wrapper.skip, wrapper.autocast = True, None
        try:
            output = self.inner(model, batch)
        finally:
            wrapper.skip = False
        hidden = output if isinstance(output, torch.Tensor) else getattr(output, "logits", None)
        if not isinstance(hidden, torch.Tensor) or hidden.shape[-1] != head.in_features:
            raise ValueError(
                f"With its head {self.spec.head!r} skipped the model returned "
                f"{type(output).__name__}, not the head's input (..., {head.in_features}): the "
                "model's output is not the head's output, so the loss cannot be chunked."
            )
        return HeadOutput(hidden=hidden, head=head, output=output, autocast=wrapper.autocast)


class ChunkedHeadLoss:
    """``loss(output, batch)``: the head and the cross-entropy of a :class:`HeadOutput`, a
    chunk of tokens at a time (:func:`~strategies._chunked_loss.chunked_cross_entropy`)."""

    def __init__(self, spec: HeadLoss, chunks: int) -> None:
        self.spec, self.chunks = spec, chunks

    def __call__(self, output: HeadOutput, batch: Any) -> torch.Tensor:
        head = output.head
        if output.autocast is None:
            precision: Any = contextlib.nullcontext()
        else:
            device, dtype = output.autocast
            precision = torch.autocast(device, dtype=dtype)
        with precision:
            return self._loss(output, head, batch)

    def _loss(self, output: HeadOutput, head: nn.Linear, batch: Any) -> torch.Tensor:
        return chunked_cross_entropy(
            output.hidden,
            head.weight,
            head.bias,
            self.spec.targets_of(batch),
            chunks=self.chunks,
            ignore_index=self.spec.ignore_index,
            shift=self.spec.shift,
        )


def check_head_loss(
    spec: HeadLoss,
    model: nn.Module,
    batch: Any,
    forward: Callable[[nn.Module, Any], Any],
    loss: Callable[[Any, Any], torch.Tensor],
    chunks: int = 2,
) -> tuple[float, float]:
    """``(loss as the user trains it, the chunked loss)`` on ``batch``, without gradients,
    each from the same seed (dropout draws the same masks); the RNG and the model's head
    left as they were.

    ``forward`` and ``loss`` are the user's step (the model's own loss for Hugging Face).
    """
    devices = [p.device for p in model.parameters() if p.device.type == "cuda"][:1]
    head = model.get_submodule(spec.head)
    had_wrapper = _forward.find_wrapper(head, SkippedHead) is not None
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            torch.manual_seed(0)
            want = loss(forward(model, batch), batch)
            torch.manual_seed(0)
            output = HeadlessForward.install(forward, spec, model)(model, batch)
            got = ChunkedHeadLoss(spec, chunks)(output, batch)
    finally:
        if not had_wrapper:
            _forward.remove(head, SkippedHead)
    return float(want), float(got)


def losses_agree(want: float, got: float) -> bool:
    """Whether two losses are the same objective: equal within fp32 rounding of a sum of
    chunks (relative 1e-4), NaN only where both are."""
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    return math.isclose(want, got, rel_tol=1e-4, abs_tol=1e-6)
