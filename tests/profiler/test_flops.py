"""FLOPs of a step, counted by phase, dtype and module, and the times modelled from them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memadvisor.api import profile
from memadvisor.device.fake import fake_workload, profile_fake
from memadvisor.profiler import count_step_flops, with_modelled_times
from memadvisor.schema.profile import StepTimeModel
from memadvisor.workload import Workload

B, IN, HIDDEN, OUT = 4, 8, 16, 2


def _two_layers(first_frozen: bool = False, dtype: torch.dtype = torch.float32) -> Workload:
    model = nn.Sequential(
        nn.Linear(IN, HIDDEN, bias=False, dtype=dtype), nn.Linear(HIDDEN, OUT, bias=False)
    )
    if first_frozen:
        model[0].weight.requires_grad_(False)

    def loss_fn(out: torch.Tensor, batch: torch.Tensor) -> torch.Tensor:
        return out.float().square().mean()

    def forward_fn(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return model[1](model[0](x.to(dtype)).float())

    return Workload(model=model, sample_batch=torch.randn(B, IN), loss_fn=loss_fn,
                    forward_fn=forward_fn)  # fmt: skip


def test_a_linear_costs_2_b_in_out_forward_and_twice_that_backward_when_trainable() -> None:
    wl = _two_layers()
    flops = count_step_flops(wl, wl.model, B)
    first, second = 2 * IN * HIDDEN, 2 * HIDDEN * OUT  # per sample
    assert flops.forward_per_sample == {"fp32": first + second}
    # Backward: the second layer's weight and input gradients; the first layer's weight
    # gradient only (its input, the batch, needs none).
    assert flops.backward_per_sample == {"fp32": 2 * second + first}
    assert flops.module_forward_per_sample == {"0": {"fp32": first}, "1": {"fp32": second}}
    assert all(p.grad is None for p in wl.model.parameters())


def test_a_frozen_layer_makes_no_weight_gradient_flops() -> None:
    """requires_grad=False: no gradient to compute, so its backward costs nothing here."""
    wl = _two_layers(first_frozen=True)
    flops = count_step_flops(wl, wl.model, B)
    assert flops.backward_per_sample == {"fp32": 2 * HIDDEN * OUT}  # the second layer's dW only


def test_flops_are_split_by_the_dtype_each_op_ran_in() -> None:
    """A bf16 layer (a frozen LoRA base, say) is charged bf16's rate without autocast."""
    wl = _two_layers(dtype=torch.bfloat16)
    flops = count_step_flops(wl, wl.model, B)
    assert flops.forward_per_sample == {"bf16": 2 * IN * HIDDEN, "fp32": 2 * HIDDEN * OUT}


def test_a_fake_profile_counts_the_flops_in_its_warm_up_and_a_real_one_times_instead() -> None:
    wl = _two_layers()
    fake = profile_fake(fake_workload(wl), precisions=["fp32"])
    assert fake.flops == count_step_flops(wl, wl.model, max(fake.batch_sizes)).model_copy(
        update={"batch_size": max(fake.batch_sizes)}
    )
    real = profile(wl.model, wl.sample_batch, loss_fn=wl.loss_fn, forward_fn=wl.forward_fn,
                   device="cpu", precisions=["fp32"])  # fmt: skip
    assert real.flops is None


def test_modelled_times_are_flops_at_the_model_s_rates() -> None:
    """fp32 FLOPs at fp32's rate; under bf16 autocast every counted FLOP at bf16's; the
    optimizer step its bytes at the bandwidth."""
    wl = fake_workload(_two_layers())
    prof = profile_fake(wl, precisions=["fp32", "bf16"])
    rates = StepTimeModel(matmul_tflops={"fp32": 1.0, "bf16": 4.0}, memory_tb_per_s=2.0)
    timed = with_modelled_times(prof, prof.flops, rates)
    forward = 2 * IN * HIDDEN + 2 * HIDDEN * OUT
    fp32, bf16 = timed.steps["fp32"], timed.steps["bf16"]
    assert fp32.forward_ms.per_sample_ms == pytest.approx(forward / 1e9)
    assert bf16.forward_ms.per_sample_ms == pytest.approx(forward / 4e9)
    block_ms = [b.forward_ms.per_sample_ms for b in fp32.blocks]
    assert block_ms == pytest.approx([2 * IN * HIDDEN / 1e9, 2 * HIDDEN * OUT / 1e9])
    moved = 3 * prof.grad_bytes + 2 * prof.optimizer_state_bytes
    assert fp32.optimizer_ms == pytest.approx(moved / 2e9)
    assert fp32.step_ms.at(3) == pytest.approx(
        3 * (fp32.forward_ms.per_sample_ms + fp32.backward_ms.per_sample_ms) + fp32.optimizer_ms
    )


def test_grouped_query_attention_is_counted_where_torchs_formula_asserts_equal_heads() -> None:
    """torch 2.11's sdpa formula asserts equal query and key/value heads, which failed the
    profile of a GQA model (examples/llama.py at n_kv_heads < n_heads) on the card's torch:
    the count retries with the key/value heads repeated, as the attention computes."""
    from memadvisor.profiler import _flops

    def strict(query, key, value, *args, out_val=None, **kwargs) -> int:
        assert query.shape[1] == key.shape[1] == value.shape[1], "shapes are incompatible"
        b, h, s_q, d = query.shape
        return 4 * b * h * s_q * key.shape[2] * d

    q, kv = torch.randn(2, 8, 5, 4), torch.randn(2, 2, 7, 4)
    assert _flops._count(strict, None, (q, kv, kv), {}, None) == 4 * 2 * 8 * 5 * 7 * 4
    with pytest.raises(AssertionError):  # heads that do not divide: not attention's shape
        _flops._count(strict, None, (q, torch.randn(2, 3, 7, 4), kv), {}, None)
