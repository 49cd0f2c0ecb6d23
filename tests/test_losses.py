"""memadvisor.TokenCrossEntropy is, called, the plain cross-entropy the examples trained with."""

from __future__ import annotations

import pickle

import pytest
import torch
import torch.nn.functional as F

from memadvisor import TokenCrossEntropy
from memadvisor.errors import BadInputError


def _logits_and_batch():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=g)  # (B, T, vocab)
    tokens = torch.randint(0, 11, (2, 5), generator=g)
    targets = torch.randint(0, 11, (2, 5), generator=g)
    return logits, (tokens, targets)


def test_called_it_is_cross_entropy_over_every_token() -> None:
    """TokenCrossEntropy(targets=1) on a (tokens, targets) batch equals the hand-written
    F.cross_entropy the examples used, upcast or not."""
    logits, batch = _logits_and_batch()
    want = F.cross_entropy(logits.view(-1, 11), batch[1].reshape(-1))
    assert torch.equal(TokenCrossEntropy(targets=1, upcast=False)(logits, batch), want)
    assert torch.equal(TokenCrossEntropy(targets=1)(logits, batch), want)  # fp32 already
    low = logits.bfloat16()
    plain_low = F.cross_entropy(low.view(-1, 11), batch[1].reshape(-1))
    assert TokenCrossEntropy(targets=1, upcast=False)(low, batch).dtype == plain_low.dtype
    assert TokenCrossEntropy(targets=1)(low, batch).dtype == torch.float32


def test_a_mapping_batch_with_shift_is_hugging_faces_causal_lm_loss() -> None:
    """targets='labels', shift=True: transformers' ForCausalLMLoss, -100 ignored."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits, (tokens, _) = _logits_and_batch()
    labels = tokens.masked_fill(tokens < 3, -100)
    loss = TokenCrossEntropy(targets="labels", shift=True)
    want = ForCausalLMLoss(logits, labels, vocab_size=11)
    torch.testing.assert_close(loss(logits, {"labels": labels}), want)


def test_pickles_and_refuses_what_it_cannot_use() -> None:
    """It travels to a probe process (pickle by reference), and says what is wrong with a
    bad head, a target that is not in the batch, or an output that is not logits."""
    loss = TokenCrossEntropy(targets="labels", head="lm_head")
    assert pickle.loads(pickle.dumps(loss)) == loss
    with pytest.raises(BadInputError, match="head=''"):
        TokenCrossEntropy(head="")
    with pytest.raises(BadInputError, match="targets=True"):
        TokenCrossEntropy(targets=True)
    logits, batch = _logits_and_batch()
    with pytest.raises(BadInputError, match="targets='labels'.*tuple"):
        loss(logits, batch)
    with pytest.raises(BadInputError, match="targets=2"):
        TokenCrossEntropy(targets=2)(logits, batch)
    with pytest.raises(BadInputError, match="got a dict"):
        TokenCrossEntropy(targets=1)({"logits": logits}, batch)
