"""Where memadvisor owns the loss, and the rewritten step that chunks the head into it."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers
from torch import nn

from memadvisor.losses import TokenCrossEntropy
from memadvisor.workload import build_workload
from strategies._forward import find_wrapper
from strategies._head_loss import (
    ChunkedHeadLoss,
    HeadlessForward,
    HeadLoss,
    SkippedHead,
    check_head_loss,
    find_head_loss,
    losses_agree,
)
from tests.fixtures import zoo

VERSION = f"transformers {transformers.__version__}"


def _gpt(gpt_example, **overrides):
    sizes = dict(block_size=16, n_layer=2, vocab_size=256, dropout=0.1) | overrides
    built = gpt_example.build(batch_size=3, **sizes)
    return build_workload(built["model"], built["sample_batch"], loss_fn=built["loss_fn"])


def _spec(workload) -> HeadLoss:
    spec = find_head_loss(
        workload.model, workload.loss_fn, workload.sample_batch, workload.forward_fn
    )
    assert isinstance(spec, HeadLoss), spec
    return spec


def _step_grads(model, batch, forward, loss) -> tuple[float, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(3)
    value = loss(forward(model, batch), batch)
    value.backward()
    return float(value.detach()), {n: p.grad.clone() for n, p in model.named_parameters()}


def _assert_trains_alike(workload, spec: HeadLoss, chunks: int = 3) -> None:
    model = workload.model
    plain_loss, plain = _step_grads(model, workload.sample_batch, workload.forward, workload.loss)
    chunked = copy.deepcopy(model)
    forward = HeadlessForward.install(workload.forward, spec, chunked)
    loss = ChunkedHeadLoss(spec, chunks)
    got_loss, got = _step_grads(chunked, workload.sample_batch, forward, loss)
    assert got_loss == pytest.approx(plain_loss, rel=1e-5), VERSION
    assert plain.keys() == got.keys()
    for name in plain:
        torch.testing.assert_close(got[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


def test_the_example_gpt_declares_its_loss_and_trains_alike_chunked(gpt_example) -> None:
    """examples/gpt.py's TokenCrossEntropy is recognised (head lm_head, targets batch[1]),
    and the headless forward with the chunked loss gives its loss and every gradient
    (the tied embedding's too), dropout included."""
    workload = _gpt(gpt_example)
    spec = _spec(workload)
    assert (spec.head, spec.targets, spec.shift) == ("lm_head", 1, False)
    _assert_trains_alike(workload, spec)


@pytest.mark.parametrize("build", [zoo.llama, zoo.gpt2], ids=["llama", "gpt2"])
def test_a_hugging_face_causal_lm_trains_alike_chunked(build) -> None:
    """A transformers causal LM computing its own loss from padded labels (-100) is
    recognised, and the chunked step's loss and gradients equal the model's own."""
    built = build()
    workload = build_workload(built.model, built.sample_batch)
    spec = _spec(workload)
    assert (spec.targets, spec.shift, spec.labels_in_batch) == ("labels", True, True), VERSION
    assert built.model.get_submodule(spec.head) is built.model.get_output_embeddings()
    assert (built.sample_batch["labels"] == -100).any()  # the padding is ignored
    _assert_trains_alike(workload, spec)


def test_the_model_called_outside_the_step_still_makes_logits(gpt_example) -> None:
    """The head is skipped only inside the rewritten forward: called directly afterwards,
    the model returns its logits, as before."""
    workload = _gpt(gpt_example, dropout=0.0)
    model, (tokens, _) = workload.model, workload.sample_batch
    before = model(tokens)
    out = HeadlessForward.install(workload.forward, _spec(workload), model)(
        model, workload.sample_batch
    )
    assert out.hidden.shape == (*tokens.shape, model.lm_head.in_features)
    assert find_wrapper(model.lm_head, SkippedHead) is not None
    assert torch.equal(model(tokens), before)
    assert set(model.state_dict()) == set(copy.deepcopy(model).state_dict())


def test_a_function_loss_is_not_owned_and_says_why(gpt_example) -> None:
    """A plain function as loss_fn may read every logit: not recognised, and the reason
    names TokenCrossEntropy as the way to declare the loss."""
    workload = _gpt(gpt_example)
    why = find_head_loss(workload.model, lambda out, b: out.sum(), workload.sample_batch)
    assert isinstance(why, str) and "TokenCrossEntropy" in why


def test_a_wrong_head_is_refused(gpt_example) -> None:
    """TokenCrossEntropy naming a missing module or one that is not nn.Linear: refused."""
    workload = _gpt(gpt_example)
    missing = find_head_loss(workload.model, TokenCrossEntropy(head="head"), None)
    assert isinstance(missing, str) and "'head'" in missing
    norm = find_head_loss(workload.model, TokenCrossEntropy(head="ln_f"), None)
    assert isinstance(norm, str) and "LayerNorm" in norm


@pytest.mark.parametrize(
    ("config", "model", "field"),
    [
        ("Gemma2Config", "Gemma2ForCausalLM", "final_logit_softcapping"),
        ("CohereConfig", "CohereForCausalLM", "logit_scale"),
    ],
)
def test_a_hugging_face_model_that_changes_its_logits_is_refused(config, model, field) -> None:
    """Gemma 2's softcapping and Cohere's logit scale change the logits after the head:
    the chunked loss of the head's output would train another objective, so refused."""
    cfg = getattr(transformers, config)(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8,
    )  # fmt: skip
    lm = getattr(transformers, model)(cfg)
    batch = {"input_ids": torch.zeros(1, 4, dtype=torch.long), "labels": torch.zeros(1, 4)}
    why = find_head_loss(lm, None, batch)
    assert isinstance(why, str) and field in why, (VERSION, why)


def test_a_hugging_face_batch_without_labels_is_not_owned() -> None:
    """Without labels the model computes no loss of its own: nothing to chunk."""
    built = zoo.llama()
    batch = {k: v for k, v in built.sample_batch.items() if k != "labels"}
    why = find_head_loss(built.model, None, batch)
    assert isinstance(why, str) and "labels" in why


class _SoftcappedGPT(nn.Module):
    """A model that softcaps its head's output (Gemma 2 does): what the recognition of a
    TokenCrossEntropy cannot see."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.inner(tokens) / 4.0) * 4.0


def test_the_measured_check_catches_a_changed_head_output(gpt_example) -> None:
    """On the sample batch, the chunked loss equals the user's loss where the model returns
    its head's output, and differs where the model changes it after the head."""
    workload = _gpt(gpt_example)
    want, got = check_head_loss(
        _spec(workload), workload.model, workload.sample_batch, workload.forward, workload.loss
    )
    assert losses_agree(want, got), (want, got)
    scaled = build_workload(
        _SoftcappedGPT(workload.model),
        workload.sample_batch,
        loss_fn=TokenCrossEntropy(targets=1, head="inner.lm_head"),
    )
    want, got = check_head_loss(
        _spec(scaled), scaled.model, scaled.sample_batch, scaled.forward, scaled.loss
    )
    assert not losses_agree(want, got), (want, got)


def test_losses_agree_within_fp32_rounding_only() -> None:
    """Equal within a relative 1e-4; NaN agrees only with NaN."""
    assert losses_agree(2.0, 2.0 * (1 + 1e-6))
    assert not losses_agree(2.0, 2.01)
    assert losses_agree(float("nan"), float("nan"))
    assert not losses_agree(float("nan"), 1.0)
