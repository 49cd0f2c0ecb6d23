"""The operations that allocate most, by module; what made the bytes no module owns; the
workload's call form. A tiny language model whose loss is computed in its own forward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from memadvisor.profiler import profile, top_allocations
from memadvisor.workload import Workload

VOCAB, WIDTH, B, T = 256, 16, 4, 8


class TinyLM(nn.Module):
    """Blocks, an LM head, and the loss over the vocabulary in the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.h = nn.ModuleList([nn.Linear(WIDTH, WIDTH) for _ in range(2)])
        self.lm_head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        x = self.emb(input_ids)
        for block in self.h:
            x = x + torch.relu(block(x))
        logits = self.lm_head(x)  # (B, T, VOCAB)
        return {"loss": F.cross_entropy(logits.view(-1, VOCAB), labels.view(-1))}


def _batch() -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, VOCAB, (B, T), generator=g)
    return {"input_ids": ids, "labels": ids}


def test_top_allocations_charge_the_logits_to_lm_head_and_the_softmax_to_the_model() -> None:
    model = TinyLM()
    before = [p.detach().clone() for p in model.parameters()]
    rows = top_allocations(Workload(model=model, sample_batch=_batch()), batch_size=B, device="cpu")
    logits_bytes = B * T * VOCAB * 4
    by_key = {(r.op, r.module, r.phase): r for r in rows}
    assert by_key[("mm", "lm_head", "forward")].allocated_bytes == logits_bytes
    assert by_key[("_log_softmax", "", "forward")].allocated_bytes == logits_bytes
    assert [r.allocated_bytes for r in rows] == sorted((r.allocated_bytes for r in rows),
                                                       reverse=True)  # fmt: skip
    assert any(r.phase == "backward" for r in rows)
    # A private copy ran: the caller's weights are as they were.
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_profile_names_what_made_other_and_the_call_form() -> None:
    p = profile(TinyLM(), _batch(), device="cpu")
    (other,) = [m for m in p.steps["fp32"].outside if m.name == "<other>"]
    assert other.type_name == "TinyLM"
    assert other.made_by[0] == "_log_softmax" and other.after == "lm_head"
    assert p.call_form is not None
    assert (p.call_form.batch, p.call_form.loss) == ("mapping", "output['loss']")


def test_call_form_of_an_inputs_targets_batch_with_a_loss_fn() -> None:
    wl = Workload(
        model=nn.Linear(4, 2),
        sample_batch=(torch.randn(3, 4), torch.tensor([0, 1, 0])),
        loss_fn=lambda out, batch: F.cross_entropy(out, batch[1]),
    )
    form = wl.call_form(torch.randn(3, 2))
    assert (form.batch, form.loss) == ("sequence", "loss_fn")
