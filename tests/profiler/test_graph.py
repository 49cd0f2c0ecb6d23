"""memadvisor.profiler._graph.saved_storages: what autograd keeps, once per storage."""

from __future__ import annotations

import torch
import torch.utils.checkpoint as cp
from torch import nn

from memadvisor.profiler._graph import saved_storages


def _bytes(found: dict) -> int:
    return sum(st.nbytes() for st in found.values())


def test_a_tensor_two_nodes_keep_counts_once() -> None:
    """ReLU keeps its output and the next Linear keeps it as input: one storage."""
    lin1, lin2 = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8)
    h = torch.relu(lin1(x))
    loss = torch.relu(lin2(h)).sum()
    found = saved_storages([loss])
    assert id(h.untyped_storage()) in found
    # x (the first Linear's input), h, the second ReLU's output, and the second weight
    # (needed for h's gradient): the first weight is not kept, x needs no gradient.
    expected = [x, h, lin2.weight]
    assert _bytes(found) == sum(t.untyped_storage().nbytes() for t in expected) + 4 * 8 * 4


def test_custom_function_saved_tensors_and_ctx_attributes_are_found() -> None:
    """save_for_backward and a tensor stashed on ctx are both kept for backward."""

    class Scale(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):  # noqa: ANN001, ANN205
            ctx.save_for_backward(x)
            ctx.w2 = w * 2  # 40 bytes, made here
            return x * 3

        @staticmethod
        def backward(ctx, g):  # noqa: ANN001, ANN205
            return g * 3, None

    x = torch.randn(16, requires_grad=True)
    w = torch.randn(10)
    y = x.exp()  # 64 bytes, kept by exp's backward and by Scale: counted once
    loss = Scale.apply(y, w).sum()
    assert _bytes(saved_storages([loss])) == 64 + 40


def test_non_reentrant_checkpoint_is_not_recomputed_and_keeps_nothing_inside() -> None:
    """Walking the graph must not call checkpoint's unpack hook (it would rerun forward);
    inside a checkpointed region the graph keeps placeholders, not tensors."""
    calls = [0]
    lin = nn.Linear(8, 8)

    def body(x: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        return torch.relu(lin(x))

    x = torch.randn(4, 8, requires_grad=True)
    loss = cp.checkpoint(body, x, use_reentrant=False).sum()
    assert calls[0] == 1
    found = saved_storages([loss])
    assert calls[0] == 1
    assert found == {}
    loss.backward()  # the graph is still whole: backward recomputes once
    assert calls[0] == 2 and x.grad is not None
