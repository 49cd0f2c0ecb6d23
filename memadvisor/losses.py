"""Losses memadvisor knows the shape of, so that a strategy may compute them another way.

A ``loss_fn`` is a black box: it may read any part of the logits, so nothing may change
how they are made. :class:`TokenCrossEntropy` says what it is (token-level cross-entropy of
the output of one linear head against targets in the batch) and is, called, exactly that
loss; the loss-head strategy recognises it by type and may then compute the head and the
loss together, a chunk of tokens at a time, never holding all the logits.

    from memadvisor import TokenCrossEntropy

    loss_fn = TokenCrossEntropy(targets=1, head="lm_head")  # batch = (tokens, targets)
    loss = loss_fn(model(batch[0]), batch)  # F.cross_entropy over every token

Known limitations:
    * The model's output must be the head's output itself (no softcapping, scaling or
      slicing after it): the strategy skips the head and computes it from the head's input.
      The strategy checks this on the sample batch and is not offered where it differs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from memadvisor.errors import BadInputError

__all__ = ["TokenCrossEntropy", "token_cross_entropy", "token_targets"]


def token_targets(targets: torch.Tensor, *, ignore_index: int = -100, shift: bool = False):
    """Each position's target, flat; with ``shift`` the next position's, the last ignored.

    ``shift`` is Hugging Face's causal-LM rule (``ForCausalLMLoss``): the labels are padded
    with ``ignore_index`` at the end and shifted left by one, so position ``t`` predicts
    ``labels[..., t+1]`` and each row's last position predicts nothing. Shifting the targets
    rather than the logits keeps the logits (or hidden states) a view: a slice ``[:, :-1]``
    would be copied by the flattening reshape.
    """
    if shift:
        targets = F.pad(targets, (0, 1), value=ignore_index)[..., 1:]
    return targets.reshape(-1)


def token_cross_entropy(
    logits: torch.Tensor,
    targets: torch.Tensor,
    *,
    ignore_index: int = -100,
    shift: bool = False,
    upcast: bool = True,
) -> torch.Tensor:
    """Mean cross-entropy of (..., vocab) ``logits`` against (...) ``targets`` over the
    targets that are not ``ignore_index`` (NaN when all are, as ``F.cross_entropy``).

    ``upcast`` computes in fp32 (``logits.float()``), as Hugging Face's causal-LM loss does;
    under autocast that copy of the logits is the largest tensor of many LMs' steps.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    if upcast:
        flat = flat.float()
    flat_targets = token_targets(targets, ignore_index=ignore_index, shift=shift)
    return F.cross_entropy(flat, flat_targets, ignore_index=ignore_index)


@dataclass(frozen=True)
class TokenCrossEntropy:
    """``loss_fn(output, batch)``: token-level cross-entropy of a language model's logits.

    Called, it is plain cross-entropy over all the logits (:func:`token_cross_entropy`), so
    a model trained with it trains exactly as with the equivalent hand-written loss. What it
    adds is what it declares, which lets the loss-head strategy compute the head and the
    loss a chunk of tokens at a time.

    Args:
        targets: where the batch holds the targets: an index into a tuple/list batch
            (``1`` for ``(tokens, targets)``) or a key of a mapping batch (``"labels"``).
        head: the name of the model's submodule (an ``nn.Linear``) whose output is the
            model's output (``"lm_head"``).
        ignore_index: a target counted neither in the sum nor the mean.
        shift: Hugging Face causal-LM semantics: position t predicts ``targets[..., t+1]``
            (for batches whose targets are the inputs themselves).
        upcast: compute the loss in fp32 (``logits.float()``); False takes the logits'
            own dtype, as ``F.cross_entropy(logits, ...)`` on them does.
    """

    targets: int | str = 1
    head: str = "lm_head"
    ignore_index: int = -100
    shift: bool = False
    upcast: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.targets, (int, str)) or isinstance(self.targets, bool):
            raise BadInputError(
                "TokenCrossEntropy's targets is an index into a tuple batch or a key of a "
                f"mapping batch, but got targets={self.targets!r}."
            )
        if not isinstance(self.head, str) or not self.head:
            raise BadInputError(
                "TokenCrossEntropy's head is the name of the model's output linear layer "
                f"(e.g. 'lm_head'), but got head={self.head!r}."
            )

    def targets_of(self, batch: Any) -> torch.Tensor:
        """The target tensor in ``batch``.

        Raises:
            BadInputError: ``batch`` has no tensor where ``targets`` points.
        """
        try:
            if isinstance(self.targets, str):
                found = batch[self.targets] if isinstance(batch, Mapping) else None
            else:
                found = batch[self.targets] if isinstance(batch, (tuple, list)) else None
        except (IndexError, KeyError):
            found = None
        if not isinstance(found, torch.Tensor):
            raise BadInputError(
                f"TokenCrossEntropy(targets={self.targets!r}) finds no tensor there in a "
                f"batch of type {type(batch).__name__}: pass the index of the targets in a "
                "tuple batch (1 for (inputs, targets)) or their key in a mapping batch."
            )
        return found

    def __call__(self, output: torch.Tensor, batch: Any) -> torch.Tensor:
        """Cross-entropy of ``output`` (the head's logits) against the batch's targets."""
        if not isinstance(output, torch.Tensor):
            raise BadInputError(
                "TokenCrossEntropy takes the model's logits as its output, a tensor of shape "
                f"(..., vocab), but got a {type(output).__name__}: make the model return "
                f"its head's ({self.head!r}) output."
            )
        return token_cross_entropy(
            output,
            self.targets_of(batch),
            ignore_index=self.ignore_index,
            shift=self.shift,
            upcast=self.upcast,
        )
