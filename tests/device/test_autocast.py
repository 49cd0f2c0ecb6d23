"""CUDA autocast emulated on the CPU: what each op saves for backward, and in which dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memadvisor._torch_private import autocast_registrations, fake_tensor_mode
from memadvisor.device._autocast import cuda_autocast_policy, unmodelled_cuda_ops


def _saved_dtypes(grad_fn) -> dict[str, torch.dtype]:  # noqa: ANN001 - an autograd node
    return {
        name: getattr(grad_fn, name).dtype
        for name in dir(grad_fn)
        if name.startswith("_saved_") and isinstance(getattr(grad_fn, name), torch.Tensor)
    }


def _layer_norm_after_linear() -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    lin, ln = torch.nn.Linear(16, 16), torch.nn.LayerNorm(16)
    x = torch.randn(4, 16, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = lin(x)
        return h, ln(h)


def test_layer_norm_saves_fp32_and_linear_saves_bf16_under_the_cuda_policy() -> None:
    with cuda_autocast_policy():
        h, y = _layer_norm_after_linear()
    assert h.dtype == torch.bfloat16
    assert _saved_dtypes(h.grad_fn)["_saved_mat2"] == torch.bfloat16  # the cast weight
    assert y.dtype == torch.float32
    assert _saved_dtypes(y.grad_fn)["_saved_input"] == torch.float32


def test_cpu_autocast_alone_keeps_layer_norm_in_bf16() -> None:
    """The difference the emulation exists for (docs/design.md, "Autocast keeps some
    tensors in fp32")."""
    _, y = _layer_norm_after_linear()
    assert y.dtype == torch.bfloat16
    assert _saved_dtypes(y.grad_fn)["_saved_input"] == torch.bfloat16


def test_softmax_sum_and_exp_compute_in_fp32_as_on_cuda() -> None:
    x = torch.randn(4, 8, requires_grad=True)
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        h = x @ torch.randn(8, 8)
        outs = {"softmax": h.softmax(-1), "sum": h.sum(), "exp": h.exp(), "matmul": h}
    assert {k: v.dtype for k, v in outs.items()} == {
        "softmax": torch.float32,
        "sum": torch.float32,
        "exp": torch.float32,
        "matmul": torch.bfloat16,
    }


def test_cross_entropy_decomposes_as_on_cuda_log_softmax_bf16_nll_fp32() -> None:
    """CUDA has no autocast kernel for cross_entropy: its log_softmax gets the input's dtype."""
    logits = torch.randn(6, 10).bfloat16().requires_grad_()
    target = torch.randint(0, 10, (6,))
    with cuda_autocast_policy(), torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.cross_entropy(logits, target)
    nll = loss.grad_fn
    assert loss.dtype == torch.float32 and type(nll).__name__ == "NllLossBackward0"
    to_fp32 = nll.next_functions[0][0]
    assert type(to_fp32).__name__ == "ToCopyBackward0"
    log_softmax = to_fp32.next_functions[0][0]
    assert _saved_dtypes(log_softmax)["_saved_result"] == torch.bfloat16


def test_gradients_flow_through_the_casts() -> None:
    with cuda_autocast_policy():
        _, y = _layer_norm_after_linear()
        y.sum().backward()
    lin_input = y.grad_fn.next_functions[0][0]
    assert type(lin_input).__name__ == "ToCopyBackward0"  # the fp32 cast autograd recorded


def test_without_autocast_nothing_changes() -> None:
    x = torch.randn(4, 8)
    with cuda_autocast_policy():
        assert F.layer_norm(x, (8,)).dtype == torch.float32
        assert (x @ x.T).dtype == torch.float32
        assert x.bfloat16().sum().dtype == torch.bfloat16


def test_kernels_are_removed_when_the_outermost_context_closes() -> None:
    with cuda_autocast_policy():
        with cuda_autocast_policy():
            pass
        assert "aten::layer_norm" in autocast_registrations("cpu")
    assert "aten::layer_norm" not in autocast_registrations("cpu")
    _, y = _layer_norm_after_linear()
    assert y.dtype == torch.bfloat16


def test_every_cuda_autocast_op_of_this_torch_has_a_policy() -> None:
    """binary_cross_entropy is banned under CUDA autocast (it raises there), so it has none."""
    assert unmodelled_cuda_ops() <= {"binary_cross_entropy"}


def test_the_policy_applies_to_fake_tensors() -> None:
    with fake_tensor_mode(), cuda_autocast_policy():
        _, y = _layer_norm_after_linear()
        assert _saved_dtypes(y.grad_fn)["_saved_input"] == torch.float32
