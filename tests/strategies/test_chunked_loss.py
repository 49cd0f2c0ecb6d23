"""The chunked cross-entropy equals the plain one: loss and every gradient, in fp32."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from memadvisor.losses import token_cross_entropy
from strategies._chunked_loss import chunked_cross_entropy

TOKENS, HIDDEN, VOCAB = (3, 10), 16, 50


def _inputs(bias: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(*TOKENS, HIDDEN, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, HIDDEN, generator=g, requires_grad=True)
    b = torch.randn(VOCAB, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, VOCAB, TOKENS, generator=g)
    targets[0, :4] = -100  # padding, as a collator marks it
    targets[2, 7] = -100
    return hidden, weight, b, targets


def _grads(loss: torch.Tensor, tensors) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, [t for t in tensors if t is not None]))


@pytest.mark.parametrize("chunks", [1, 4, 7, 30, 64])
@pytest.mark.parametrize("shift", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_loss_and_gradients_equal_the_plain_computation(chunks, shift, bias) -> None:
    """Loss and the gradients of hidden, weight and bias equal F.cross_entropy over all the
    logits (ignore_index present), within fp32 tolerance, whatever the chunk count (one,
    uneven, one token a chunk, more chunks than tokens), with and without the shift."""
    hidden, weight, b, targets = _inputs(bias)
    plain = token_cross_entropy(F.linear(hidden, weight, b), targets, shift=shift)
    chunked = chunked_cross_entropy(hidden, weight, b, targets, chunks=chunks, shift=shift)
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    for got, want in zip(
        _grads(chunked, (hidden, weight, b)), _grads(plain, (hidden, weight, b)), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_shift_is_hugging_face_causal_lm_loss() -> None:
    """shift=True is transformers' ForCausalLMLoss: logits[:, :-1] predict labels[:, 1:],
    -100 ignored, the mean over the labels kept."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, weight, _, labels = _inputs(bias=False)
    want = ForCausalLMLoss(F.linear(hidden, weight), labels, vocab_size=VOCAB)
    got = chunked_cross_entropy(hidden, weight, None, labels, chunks=3, shift=True)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_tied_weight_gets_both_gradients() -> None:
    """With the head's weight tied to the input embedding, the weight's gradient is the sum
    of both uses, as in the plain computation."""
    g = torch.Generator().manual_seed(1)
    embedding = torch.randn(VOCAB, HIDDEN, generator=g, requires_grad=True)
    tokens = torch.randint(0, VOCAB, TOKENS, generator=g)
    targets = torch.randint(0, VOCAB, TOKENS, generator=g)
    targets[1, :3] = -100

    def run(loss_of) -> torch.Tensor:
        hidden = torch.tanh(F.embedding(tokens, embedding))  # (B, T, C)
        return loss_of(hidden)

    plain = run(lambda h: token_cross_entropy(F.linear(h, embedding), targets))
    chunked = run(lambda h: chunked_cross_entropy(h, embedding, None, targets, chunks=5))
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-6)
    (want,) = torch.autograd.grad(plain, embedding)
    (got,) = torch.autograd.grad(chunked, embedding)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_every_target_ignored_is_nan_as_plain() -> None:
    """No target kept: NaN, as F.cross_entropy's mean over nothing is."""
    hidden, weight, _, targets = _inputs(bias=False)
    targets.fill_(-100)
    assert torch.isnan(token_cross_entropy(F.linear(hidden, weight), targets))
    assert torch.isnan(chunked_cross_entropy(hidden, weight, None, targets, chunks=2))


def test_only_one_chunks_logits_are_saved_for_backward() -> None:
    """Forward keeps no tensor of a chunk's logits' size (the checkpoint drops them): what
    autograd saves is the inputs and scalars, nothing of shape (chunk, vocab)."""
    hidden, weight, _, targets = _inputs(bias=False)
    saved: list[tuple[int, ...]] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        chunked_cross_entropy(hidden, weight, None, targets, chunks=3)
    assert saved  # the hooks saw the checkpoint's inputs
    assert not [s for s in saved if s and s[-1] == VOCAB and len(s) == 2 and s[0] > 1]
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        token_cross_entropy(F.linear(hidden, weight), targets)
    assert (30, VOCAB) in saved  # the plain loss keeps all the logits' log-softmax


def test_compiles_without_graph_breaks() -> None:
    """torch.compile traces it whole (fullgraph) and gives the eager loss."""
    hidden, weight, _, targets = _inputs(bias=False)
    compiled = torch.compile(
        lambda h, w, t: chunked_cross_entropy(h, w, None, t, chunks=3), fullgraph=True
    )
    got = compiled(hidden, weight, targets)
    want = chunked_cross_entropy(hidden, weight, None, targets, chunks=3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_refuses_bad_arguments() -> None:
    """chunks below 1 and targets of another shape are refused, naming the value."""
    hidden, weight, _, targets = _inputs(bias=False)
    with pytest.raises(ValueError, match="chunks=0"):
        chunked_cross_entropy(hidden, weight, None, targets, chunks=0)
    with pytest.raises(ValueError, match=r"\(3, 9\)"):
        chunked_cross_entropy(hidden, weight, None, targets[:, :-1], chunks=2)
