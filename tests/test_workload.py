"""memadvisor.workload: batches of any size, the loss rules, the optimizer, one step."""

from __future__ import annotations

import weakref
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.workload import Workload, batch_size_of, resize_batch, train_step


class BatchEncodingLike(dict):
    """Stands in for HF's BatchEncoding: a dict subclass built from a dict."""


def test_tensor_batch_repeats_rows_to_grow_and_slices_to_shrink() -> None:
    x = torch.arange(6.0).reshape(3, 2)
    w = Workload(nn.Linear(2, 1), x)
    assert w.sample_batch_size == 3
    grown = w.batch(7)
    assert grown.shape == (7, 2)
    # rows are the sample's rows in order, repeated: row i == sample row i % 3
    assert torch.equal(grown, x[torch.arange(7) % 3])
    assert torch.equal(w.batch(2), x[:2])


def test_tuple_batch_resizes_every_batched_tensor_and_keeps_the_rest() -> None:
    images, labels, scale = torch.randn(4, 3), torch.arange(4), torch.tensor(2.0)
    out = resize_batch((images, labels, scale, "tag"), 6, 4)
    assert isinstance(out, tuple)
    assert out[0].shape == (6, 3) and out[1].tolist() == [0, 1, 2, 3, 0, 1]
    assert out[2] is scale and out[3] == "tag"


def test_list_batch_stays_a_list() -> None:
    out = resize_batch([torch.zeros(2, 5)], 3, 2)
    assert isinstance(out, list) and out[0].shape == (3, 5)


def test_dict_and_mapping_subclasses_keep_their_type() -> None:
    batch = BatchEncodingLike(
        input_ids=torch.ones(2, 8, dtype=torch.long), attention_mask=torch.ones(2, 8)
    )
    out = resize_batch(batch, 5, 2)
    assert type(out) is BatchEncodingLike
    assert out["input_ids"].shape == (5, 8) and out["attention_mask"].shape == (5, 8)
    od = resize_batch(OrderedDict(x=torch.ones(2, 1)), 1, 2)
    assert type(od) is OrderedDict and od["x"].shape == (1, 1)


def test_nested_batches_resize_at_every_depth() -> None:
    batch = {"pair": (torch.ones(2, 3), {"deep": torch.zeros(2)})}
    out = resize_batch(batch, 4, 2)
    assert out["pair"][0].shape == (4, 3) and out["pair"][1]["deep"].shape == (4,)


def test_mixed_dim0_sizes_are_rejected_with_a_hint_to_pass_make_batch() -> None:
    with pytest.raises(BadInputError, match="make_batch"):
        resize_batch((torch.ones(2, 3), torch.ones(5, 3)), 4, 2)


def test_batch_without_tensors_is_rejected() -> None:
    with pytest.raises(BadInputError, match="no tensor"):
        batch_size_of({"a": 1})


def test_make_batch_is_used_when_dim0_is_not_the_batch() -> None:
    seq_first = torch.randn(10, 2, 4)  # (T, B, C): dim 0 is time, not the batch
    w = Workload(nn.Linear(4, 4), seq_first, make_batch=lambda b: torch.randn(10, b, 4))
    assert w.batch(6).shape == (10, 6, 4)


def test_non_positive_batch_size_is_rejected() -> None:
    w = Workload(nn.Linear(2, 1), torch.ones(2, 2))
    with pytest.raises(BadInputError, match="size=0"):
        w.batch(0)


def test_loss_fn_wins_over_everything() -> None:
    w = Workload(nn.Linear(2, 1), torch.ones(2, 2), loss_fn=lambda out, batch: torch.tensor(7.0))
    out = SimpleNamespace(loss=torch.tensor(1.0))
    assert w.loss(out, None).item() == 7


def test_hf_style_output_loss_is_used() -> None:
    w = Workload(nn.Linear(2, 1), torch.ones(2, 2))
    assert w.loss(SimpleNamespace(loss=torch.tensor(3.0)), None).item() == 3.0
    assert w.loss({"loss": torch.tensor(4.0), "logits": torch.ones(2)}, None).item() == 4.0


def test_scalar_output_is_the_loss() -> None:
    w = Workload(nn.Linear(2, 1), torch.ones(2, 2))
    assert w.loss(torch.tensor([5.0]), None).item() == 5.0


def test_no_loss_found_says_to_pass_loss_fn() -> None:
    w = Workload(nn.Linear(2, 1), torch.ones(2, 2))
    with pytest.raises(BadInputError, match="pass loss_fn"):
        w.loss(torch.ones(2, 1), None)


def test_non_module_model_is_rejected() -> None:
    with pytest.raises(BadInputError, match="nn.Module"):
        Workload(lambda x: x, torch.ones(2))  # type: ignore[arg-type]


def test_default_optimizer_is_adamw_and_a_factory_is_honoured() -> None:
    model = nn.Linear(2, 1)
    assert isinstance(Workload(model, torch.ones(1, 2)).make_optimizer(model), torch.optim.AdamW)
    w = Workload(model, torch.ones(1, 2), optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.1))
    assert isinstance(w.make_optimizer(model), torch.optim.SGD)


def test_model_is_called_by_batch_form() -> None:
    class Recorder(nn.Module):
        def forward(self, *args, **kwargs):  # noqa: ANN002, ANN003
            self.seen = (args, kwargs)
            return torch.zeros(())

    m, x = Recorder(), torch.ones(2, 1)
    w = Workload(m, x)
    w.forward(m, x)
    assert m.seen[0][0] is x
    w.forward(m, (x, torch.zeros(2)))
    assert m.seen[0] == (x,)  # (inputs, targets): only inputs reach the model
    w.forward(m, {"input_ids": x})
    assert m.seen[1] == {"input_ids": x}


def test_train_step_runs_phases_in_order_updates_weights_and_frees_grads() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    batch = (torch.randn(3, 4), torch.randint(0, 2, (3,)))
    w = Workload(model, batch, loss_fn=lambda out, b: nn.functional.cross_entropy(out, b[1]))
    opt = w.make_optimizer(model)
    before = [p.detach().clone() for p in model.parameters()]
    phases: list[str] = []
    loss = train_step(w, model, opt, w.batch(5), on_phase=phases.append)
    assert phases == ["forward", "loss", "backward", "optimizer", "zero_grad", "end"]
    assert float(loss) > 0
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())


def test_accumulation_runs_forward_per_micro_batch_and_steps_once() -> None:
    model = nn.Linear(2, 1)
    w = Workload(model, torch.ones(2, 2), loss_fn=lambda out, b: out.sum())
    opt = w.make_optimizer(model)
    phases: list[str] = []
    train_step(w, model, opt, w.batch(2), accumulation_steps=3, on_phase=phases.append)
    assert phases.count("forward") == 3 and phases.count("optimizer") == 1


def test_a_batch_the_model_rejects_is_bad_input_naming_the_error() -> None:
    model = nn.Linear(3, 1)
    w = Workload(model, torch.ones(2, 5), loss_fn=lambda out, b: out.sum())
    with pytest.raises(BadInputError, match="rejected the batch"):
        train_step(w, model, w.make_optimizer(model), w.batch(2))


def test_a_batch_of_0_rows_is_rejected_up_front() -> None:
    """Rule: an empty sample batch is bad input said in words, not a ZeroDivisionError later."""
    with pytest.raises(BadInputError, match="0 rows"):
        Workload(model=nn.Linear(4, 4), sample_batch=(torch.randn(0, 4), torch.zeros(0)))


@pytest.mark.parametrize(
    "view",
    [
        lambda x: x[:16],
        lambda x: x[::2][:16],
        lambda x: x[:, :3][:16],
        lambda x: x.t().contiguous().t()[:16],
    ],
    ids=["rows", "strided rows", "columns", "column-major"],
)
def test_a_batch_sliced_from_a_dataset_tensor_owns_compact_copies_of_its_rows(view) -> None:
    """Rule: the workload's sample batch holds no more bytes than its rows. A view into a
    4096-row dataset tensor keeps the whole dataset's storage alive; counted by storage (as
    the meter and a card do) it would weigh as the dataset, at the sample size only."""
    data, labels = torch.randn(4096, 8), torch.arange(4096)
    x, y = view(data), labels[:16]
    w = Workload(nn.Linear(x.shape[1], 1), (x, y))
    for batch in (w.sample_batch, w.batch(16)):
        for t in batch:
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()
    assert torch.equal(w.sample_batch[0], x) and torch.equal(w.sample_batch[1], y)
    assert w.sample_batch[0].is_contiguous()


def test_a_batch_that_owns_its_bytes_is_kept_as_the_same_object() -> None:
    """Rule: only views into larger storages are copied; a batch of its own tensors (and its
    container) is the caller's object, unchanged."""
    batch = {"x": torch.randn(4, 3), "y": torch.arange(4)}
    w = Workload(nn.Linear(3, 1), batch)
    assert w.sample_batch is batch


def test_make_batch_slices_of_a_dataset_are_compacted_too() -> None:
    """Rule: a batch make_batch returns as a view of a dataset tensor is counted as its own
    rows, not as the dataset's storage."""
    data = torch.randn(1000, 4)
    w = Workload(nn.Linear(4, 1), data[:2], make_batch=lambda b: data[:b])
    out = w.batch(5)
    assert torch.equal(out, data[:5])
    assert out.untyped_storage().nbytes() == 5 * 4 * 4


@pytest.mark.parametrize("name", ["loss_fn", "make_batch", "forward_fn"])
def test_a_callable_option_that_is_not_callable_is_refused_naming_the_value(name: str) -> None:
    """Rule: loss_fn=3 is refused when the workload is built, naming the option, the value
    and the call it must support; not a TypeError once profiling runs."""
    with pytest.raises(
        BadInputError, match=rf"{name} must be a function {name}\(.*{name}=3 \(int\)"
    ):
        Workload(nn.Linear(2, 1), torch.randn(2, 2), **{name: 3})


def test_the_output_is_alive_through_backward_and_with_held_through_the_next_forward() -> None:
    """Rule: a measured step keeps the model's output as a user's loop keeps it
    (``logits = model(x); loss = f(logits); loss.backward()``): alive through backward and
    the optimizer's step, and with ``held`` (a loop's variable across steps) until the next
    forward has returned. A plan whose step freed it before backward picked a batch the
    README's loop ran out of memory at (the GPT example's 1.81 GiB of logits at batch 302)."""
    seen: dict[str, list[bool]] = {"backward": [], "optimizer": [], "forward": []}
    outputs: list[weakref.ref] = []

    class Probe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            seen["forward"].append(bool(outputs) and outputs[-1]() is not None)
            out = self.fc(x)
            out.register_hook(lambda g: seen["backward"].append(outputs[-1]() is not None))
            outputs.append(weakref.ref(out))
            return out

    model = Probe()
    workload = Workload(model=model, sample_batch=torch.randn(2, 4), loss_fn=lambda o, b: o.sum())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    step = optimizer.step

    def step_and_look(*args, **kwargs):
        seen["optimizer"].append(outputs[-1]() is not None)
        return step(*args, **kwargs)

    optimizer.step = step_and_look  # type: ignore[method-assign]
    batch = workload.batch(2)
    train_step(workload, model, optimizer, batch)
    assert seen["backward"] == [True] and seen["optimizer"] == [True]
    assert outputs[-1]() is None  # no holder: the step drops it at its end
    held: list = []
    for _ in range(2):
        train_step(workload, model, optimizer, batch, held=held)
    assert seen["forward"] == [False, False, True]  # the second held step saw the first's
    assert held and held[0] is outputs[-1]()
