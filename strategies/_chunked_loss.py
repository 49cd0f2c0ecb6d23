"""Cross-entropy of a linear head, computed a chunk of tokens at a time.

A language model's last linear layer (the LM head) turns every token's hidden state into
one logit per vocabulary entry: at batch 8 x 1024 tokens and 32000 entries its fp32 logits
are 1.1 GiB, and the loss's log-softmax saves as many again for backward. Chunked, each
chunk's head and loss run inside a non-reentrant checkpoint: forward keeps only the chunk's
summed loss, backward recomputes the chunk's logits, takes their gradient, and frees both
before the next chunk. One chunk's logits are alive at a time, in forward and backward.

Plain torch (``F.linear``, ``cross_entropy``, ``checkpoint``), no custom autograd
Function, and a loop of a fixed count over equal slices: ``torch.compile`` traces it as it
is (each checkpoint becomes a recomputed region).

Known limitations:
    * The head runs twice (forward, and again in backward): one extra head matmul per step.
    * The head's weight gradient is made once per chunk and added up by autograd: two of
      its size are alive at once while a chunk's backward adds to the sum.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memadvisor.losses import token_targets

__all__ = ["chunked_cross_entropy"]


def _chunk_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    ignore_index: int,
) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias).float()  # (chunk, vocab)
    return F.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def chunked_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    chunks: int,
    ignore_index: int = -100,
    shift: bool = False,
) -> torch.Tensor:
    """Mean cross-entropy of ``F.linear(hidden, weight, bias)`` against ``targets``, over
    the targets that are not ``ignore_index``, with one chunk's logits alive at a time.

    Equal, within fp32 rounding of the sum's order, to
    :func:`memadvisor.losses.token_cross_entropy` of the logits (``F.cross_entropy`` of
    the fp32 logits, mean over the targets kept): NaN when every target is ignored, as that is.

    Args:
        hidden: (..., hidden) states the head reads (the last norm's output).
        weight: (vocab, hidden) the head's weight (a tied embedding's is fine).
        bias: (vocab,) or None.
        targets: (...) class indices, the leading shape of ``hidden``.
        chunks: how many slices the tokens are cut into (the last may be shorter).
        ignore_index: a target that counts neither in the sum nor in the mean.
        shift: Hugging Face causal-LM semantics: position ``t`` predicts ``targets[..., t+1]``
            and the last position of each row predicts nothing.

    Raises:
        ValueError: ``chunks`` < 1, or ``targets`` does not match ``hidden``'s leading shape.
    """
    if chunks < 1:
        raise ValueError(f"chunks must be at least 1, but got {chunks=}.")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets must have hidden's leading shape {tuple(hidden.shape[:-1])}, but got "
            f"{tuple(targets.shape)}."
        )
    flat_targets = token_targets(targets, ignore_index=ignore_index, shift=shift)
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])  # (tokens, hidden)
    size = -(-flat_hidden.shape[0] // chunks)  # ceil: `chunks` slices, the last shorter
    total = flat_hidden.new_zeros((), dtype=torch.float32)
    for h, t in zip(flat_hidden.split(size), flat_targets.split(size), strict=True):
        total = total + checkpoint(
            _chunk_loss, h, weight, bias, t, ignore_index, use_reentrant=False
        )
    count = (flat_targets != ignore_index).sum()
    return total / count
