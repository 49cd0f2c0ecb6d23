"""The "Train with it in your own loop" code runs as printed: for each example in examples/
(tiny sizes) and a Hugging Face GPT-2 (tiny config), the snippet, exec'd with only the
names it says it needs (model, plan, dataset, loss_fn), trains 2 optimizer steps of 2
micro-batches each and changes the model's weights. A CPU plan's code moves nothing to a
card; a card's plan's code moves the model and the batch."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from memadvisor.report._adopt import adoption_snippet
from memadvisor.schema.call import CallForm
from memadvisor.schema.candidate import Candidate
from memadvisor.schema.device import capabilities_of_kind
from memadvisor.schema.plan import ModelFingerprint, Plan
from memadvisor.workload import Workload
from tests.fixtures.examples import load_example

BATCH, ACCUMULATION, STEPS = 2, 2, 2


def _job(name: str) -> dict[str, Any]:
    """The example's factory output at a tiny size (8 rows in the sample batch)."""
    if name == "cnn":
        return load_example("cnn").build(batch_size=8)
    if name == "gpt":
        return load_example("gpt").build(batch_size=8, vocab_size=256, n_layer=2, n_embd=32)
    if name == "llama":
        return load_example("llama").build(batch_size=8, seq_len=16, n_layers=2)
    if name == "llama_lora":
        return load_example("llama_lora").build(batch_size=8, seq_len=16, preset="tiny", n_layers=2)
    if name == "hf_gpt2":
        pytest.importorskip("transformers")
        return load_example("hf_gpt2").build(
            n_layer=2, n_embd=32, n_head=2, vocab_size=128, seq_len=16, batch_size=8
        )
    raise AssertionError(name)


def _rows(batch: Any) -> list[Any]:
    """The sample batch as a map-style dataset of rows, so DataLoader collates it back."""
    if isinstance(batch, torch.Tensor):
        return list(batch)
    if isinstance(batch, dict):
        n = len(next(iter(batch.values())))
        return [{k: v[i] for k, v in batch.items()} for i in range(n)]
    return [tuple(t[i] for t in batch) for i in range(len(batch[0]))]


def _plan_for(plan: Plan, job: dict[str, Any], *, device: str, precision: str) -> Plan:
    """The fixture plan made this job's: its call form as the workload records it, on
    ``device`` ('cpu': the simulated device; 'cuda': a card), at 2 x 2 in ``precision``."""
    wl = Workload(job["model"], job["sample_batch"], loss_fn=job.get("loss_fn"))
    with torch.no_grad():
        form = wl.call_form(wl.forward(job["model"], wl.sample_batch))
    caps = capabilities_of_kind(device, dtypes=("bf16", "fp16"))
    device_info = plan.profile.device.model_copy(
        update={"kind": device, "name": device, "bf16_supported": True, "capabilities": caps}
    )
    profile = plan.profile.model_copy(update={"call_form": form, "device": device_info})
    kind = "simulated" if device == "cpu" else "cuda"
    return plan.model_copy(
        update={
            "device_kind": kind,
            "capabilities": capabilities_of_kind(kind),
            "model_fingerprint": ModelFingerprint.of(job["model"]),
            "profile": profile,
            "candidate": Candidate(
                batch_size=BATCH,
                accumulation_steps=ACCUMULATION,
                choices={"precision": precision},
            ),
        }
    )


def _run(code: str, job: dict[str, Any], plan: Plan) -> dict[str, Any]:
    rows = _rows(job["sample_batch"])[: BATCH * ACCUMULATION * STEPS]
    names = {"model": job["model"], "plan": plan, "dataset": rows}
    if job.get("loss_fn") is not None:
        names["loss_fn"] = job["loss_fn"]
    exec(compile(code, "<adoption snippet>", "exec"), names)
    return names


@pytest.mark.parametrize("name", ["cnn", "gpt", "llama", "llama_lora", "hf_gpt2"])
def test_the_printed_loop_trains_two_steps_on_the_cpu(name: str, plan: Plan) -> None:
    """Each example's CPU plan (bf16, 2 micro-batches of 2): the code names no card, runs
    as printed, ends after 2 optimizer steps, and the weights it trains have changed."""
    job = _job(name)
    cpu_plan = _plan_for(plan, job, device="cpu", precision="bf16")
    code = adoption_snippet(cpu_plan)
    assert "cuda" not in code
    before = {n: p.detach().clone() for n, p in job["model"].named_parameters() if p.requires_grad}
    names = _run(code, job, cpu_plan)
    assert names["i"] == ACCUMULATION * STEPS - 1  # every micro-batch of the 2 steps ran
    after = dict(job["model"].named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before), "no weight changed"


def test_a_hf_model_is_fed_its_dict_and_its_own_loss(plan: Plan) -> None:
    """A Hugging Face model fed a dict whose output carries the loss: model(**batch).loss, no
    loss_fn, and the bf16 note speaks of the model's own loss, not of logits."""
    job = _job("hf_gpt2")
    code = adoption_snippet(_plan_for(plan, job, device="cpu", precision="bf16"))
    assert "loss = model(**batch).loss / 2" in code
    assert "loss_fn" not in code and "The model's own loss runs inside forward" in code


def test_a_card_plan_moves_the_model_and_each_batch(plan: Plan) -> None:
    """A card's plan, in each batch form: the model goes to the card once, the batch every
    step, in the batch's own shape."""
    forms = {
        "sequence": 'batch = [t.to("cuda") for t in batch]',
        "mapping": 'batch = {key: value.to("cuda") for key, value in batch.items()}',
        "tensor": 'batch = batch.to("cuda")',
    }
    for batch_form, move in forms.items():
        form = CallForm(batch=batch_form, loss="loss_fn")
        card = plan.model_copy(
            update={"profile": plan.profile.model_copy(update={"call_form": form})}
        )
        code = adoption_snippet(card)
        assert 'memadvisor.apply_plan(model.to("cuda"), plan)' in code
        assert move in code, batch_form


def test_a_scalar_output_and_a_forward_fn_are_written_as_the_workload_ran_them(
    plan: Plan,
) -> None:
    """A model that returns its loss: loss = model(batch), said so; a forward_fn workload:
    output = forward_fn(model, batch), then loss_fn(output, batch)."""
    scalar = CallForm(batch="tensor", loss="output")
    code = adoption_snippet(
        plan.model_copy(update={"profile": plan.profile.model_copy(update={"call_form": scalar})})
    )
    assert re.search(r"\n    loss = model\(batch\)( / \d+)?  # the model returns the loss", code)
    custom = CallForm(batch="custom", loss="loss_fn")
    code = adoption_snippet(
        plan.model_copy(update={"profile": plan.profile.model_copy(update={"call_form": custom})})
    )
    assert "output = forward_fn(model, batch)" in code and "loss_fn(output, batch)" in code


def test_a_scalar_loss_model_trains_as_printed(plan: Plan) -> None:
    """A tensor batch and a model that returns a scalar loss run as printed on the CPU."""

    class Scalar(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.lin(x).pow(2).mean()

    job = {"model": Scalar(), "sample_batch": torch.randn(8, 4)}
    cpu_plan = _plan_for(plan, job, device="cpu", precision="fp32")
    names = _run(adoption_snippet(cpu_plan), job, cpu_plan)
    assert names["i"] == ACCUMULATION * STEPS - 1


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["cnn", "hf_gpt2"])
def test_the_printed_card_loop_trains_two_steps_on_cuda(name: str, plan: Plan) -> None:
    """A card's plan: the printed loop moves the model and each batch to the card itself
    (the dataset stays on the CPU) and trains 2 steps there in bf16."""
    job = _job(name)
    card_plan = _plan_for(plan, job, device="cuda", precision="bf16")
    names = _run(adoption_snippet(card_plan), job, card_plan)
    assert names["i"] == ACCUMULATION * STEPS - 1
    assert next(names["model"].parameters()).device.type == "cuda"
