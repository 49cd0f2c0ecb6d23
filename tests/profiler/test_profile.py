"""memadvisor.profiler.profile_workload: bytes checked against arithmetic done by hand.

The model: three blocks of Linear(W, W) + ReLU, the middle one also keeping a constant-size
(C x W) tensor, then a Linear head and a Tanh outside the blocks, and a log-softmax loss.
What autograd keeps, per storage (fp32, batch b, one row = W floats = 4W bytes):

    block 0: its ReLU output (saved by the ReLU, and by block 1's Linear)       b rows
    block 1: its ReLU output; the (C, W) tensor it makes; its output
             (= ReLU + a row vector, saved by block 2's Linear)                 2b rows + C rows
    block 2: its ReLU output (also the head's saved input)                      b rows
    tanh:    its output                                                         b rows
    <loss>:  the log-softmax output                                             b rows

Weights and the batch existed before the step: they are not activations.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import memadvisor
from memadvisor.errors import BadInputError
from memadvisor.profiler import profile_workload
from memadvisor.schema.profile import Profile
from memadvisor.workload import Workload, train_step

W = 64  # width
C = 32  # rows of the constant-size tensor block 1 keeps
ROW = 4 * W  # bytes of one fp32 row
SIZES = (2, 4)


class Block(nn.Module):
    def __init__(self, constant_rows: int = 0) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)
        self.act = nn.ReLU()
        self.table = nn.Parameter(torch.randn(constant_rows, W)) if constant_rows else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.lin(x))  # (b, W)
        if self.table is None:
            return h
        s = self.table * 2  # (C, W), made here: kept by the product below (once, not twice)
        return h + (s * s).sum(0)  # (b, W)


class Stack(nn.Module):
    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        self.blocks = nn.Sequential(Block(), Block(constant_rows=C), Block())
        self.head = nn.Linear(W, W)
        self.tanh = nn.Tanh()
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.tanh(self.head(self.blocks(x))))


def stack_loss(out: torch.Tensor, _batch: object) -> torch.Tensor:
    return F.log_softmax(out, dim=-1).mean()


def stack_workload(dropout: float = 0.0) -> Workload:
    torch.manual_seed(0)
    return Workload(Stack(dropout), torch.randn(SIZES[0], W), loss_fn=stack_loss)


@pytest.fixture(scope="module")
def stack_profile() -> Profile:
    return profile_workload(stack_workload(), device="cpu", precisions=["fp32"], batch_sizes=SIZES)


def expected_blocks(b: int) -> list[int]:
    return [b * ROW, 2 * b * ROW + C * ROW, b * ROW]


def close(actual: float, expected: float, rel: float = 0.02) -> bool:
    return abs(actual - expected) <= rel * max(abs(expected), 1)


@pytest.mark.parametrize("b", [2, 4, 16])
def test_block_activations_equal_the_unique_saved_storages_by_hand(stack_profile, b) -> None:
    """Each block's saved bytes (read off the fit, also at a batch not measured) match the
    hand count within 2%."""
    got = [blk.activation.at(b) for blk in stack_profile.steps["fp32"].blocks]
    for g, e in zip(got, expected_blocks(b), strict=True):
        assert close(g, e), (got, expected_blocks(b))


def test_per_sample_and_constant_parts_separate(stack_profile) -> None:
    """Block 1's constant (C, W) tensor is its constant part; every row is per sample."""
    blocks = stack_profile.steps["fp32"].blocks
    assert close(blocks[1].activation.per_sample_bytes, 2 * ROW)
    assert close(blocks[1].activation.constant_bytes, C * ROW)
    for i in (0, 2):
        assert close(blocks[i].activation.per_sample_bytes, ROW)
        assert abs(blocks[i].activation.constant_bytes) <= 0.02 * ROW


def test_outside_owners_and_total_account_for_every_saved_byte(stack_profile) -> None:
    """The Tanh and the loss own their outputs; the total is blocks plus outside."""
    step = stack_profile.steps["fp32"]
    b = 4
    outside = {m.name: m.activation.at(b) for m in step.outside}
    assert outside == {"tanh": b * ROW, "<loss>": b * ROW}
    assert {m.name: m.type_name for m in step.outside} == {"tanh": "Tanh", "<loss>": ""}
    expected_total = sum(expected_blocks(b)) + 2 * b * ROW
    assert close(step.activation_total.at(b), expected_total)
    assert step.activation_total.at(b) == sum(blk.activation.at(b) for blk in step.blocks) + sum(
        outside.values()
    )


def test_block_inputs_skip_the_batch_and_transients_are_the_dropped_linear_output(
    stack_profile,
) -> None:
    """Block 0's input is the batch (it existed before the step: 0); the others keep one
    row per sample, half a row cast to 2 bytes (``input_low``: what a unit whose inputs
    FSDP2 casts to bf16 keeps). A Linear+ReLU block briefly holds its Linear output: b rows
    above what it saves."""
    blocks = stack_profile.steps["fp32"].blocks
    b = 4
    assert [blk.input.at(b) for blk in blocks] == [0, b * ROW, b * ROW]
    assert [blk.input_low.at(b) for blk in blocks] == [0, b * ROW // 2, b * ROW // 2]
    assert [blk.output.at(b) for blk in blocks] == [b * ROW, b * ROW, b * ROW]
    assert blocks[0].forward_transient.at(b) == b * ROW
    assert blocks[2].forward_transient.at(b) == b * ROW


def test_static_bytes_are_weights_grads_and_two_adamw_states(stack_profile) -> None:
    """Weights, gradients at the end of backward, and AdamW's two moments per weight (plus
    its small step counters)."""
    model = Stack()
    params = sum(p.numel() * 4 for p in model.parameters())
    assert stack_profile.param_bytes == params
    assert stack_profile.grad_bytes == params
    n_params = len(list(model.parameters()))
    assert 2 * params <= stack_profile.optimizer_state_bytes <= 2 * params + 8 * n_params
    assert stack_profile.buffer_bytes == 0
    assert [b.name for b in stack_profile.blocks] == ["blocks.0", "blocks.1", "blocks.2"]
    assert stack_profile.blocks[1].param_bytes == (W * W + W + C * W) * 4


def test_phases_come_in_step_order_and_hold_what_each_phase_must(stack_profile) -> None:
    """forward, backward, optimizer, zero_grad; forward holds weights + state + activations;
    backward and the optimizer step also hold the gradients."""
    p = stack_profile
    step = p.steps["fp32"]
    assert [ph.phase for ph in step.phases] == ["forward", "backward", "optimizer", "zero_grad"]
    b = 4
    peak = {ph.phase: ph.allocated.at(b) for ph in step.phases}
    static = p.param_bytes + p.optimizer_state_bytes
    assert peak["forward"] >= static + step.activation_total.at(b)
    assert peak["backward"] >= static + p.grad_bytes
    assert peak["optimizer"] >= static + p.grad_bytes
    # After zero_grad only weights, state, the batch and the output (a (b, W) tensor the
    # loop still holds, as a user's does) remain: at most what it started with and the output.
    assert static <= peak["zero_grad"] <= static + p.grad_bytes + b * ROW + b * ROW + 64
    assert all(ph.reserved is None for ph in step.phases)  # CPU: no caching allocator


def test_layer_table_names_every_module_and_sums_its_subtree(stack_profile) -> None:
    """One row per named module; a block's row includes its Linear's and ReLU's bytes."""
    rows = {r.name: r for r in stack_profile.layers}
    model = Stack()
    assert set(rows) == {n for n, _ in model.named_modules() if n}
    b = 4
    assert rows["blocks.0.act"].self_activation_bytes == b * ROW
    assert rows["blocks.0"].activation_bytes == b * ROW
    assert rows["blocks"].activation_bytes == sum(expected_blocks(b))
    assert rows["blocks.0.lin"].param_bytes == (W * W + W) * 4
    assert rows["blocks.0.lin"].grad_bytes == (W * W + W) * 4


def test_cpu_profile_has_no_cuda_only_numbers(stack_profile) -> None:
    """Fixed overhead and fragmentation are CUDA measurements: 0 and None on the CPU."""
    assert stack_profile.device.kind == "cpu"
    assert stack_profile.fixed_overhead_bytes == 0
    assert stack_profile.fragmentation_ratio is None
    assert stack_profile.profiling_ms > 0
    assert Profile.model_validate_json(stack_profile.model_dump_json()) == stack_profile


def test_times_are_measured_for_each_block_on_the_cpu(stack_profile) -> None:
    """Forward and backward wall time per block, and the step's phases, are positive."""
    step = stack_profile.steps["fp32"]
    b = 4
    assert all(blk.forward_ms.at(b) > 0 for blk in step.blocks)
    assert all(blk.backward_ms.at(b) > 0 for blk in step.blocks)
    assert step.forward_ms.at(b) > 0 and step.backward_ms.at(b) > 0 and step.optimizer_ms > 0
    assert step.step_ms.at(b) >= step.forward_ms.at(b)


# -- precision ----------------------------------------------------------------------------------


def test_bf16_keeps_cast_weights_apart_from_activations() -> None:
    """Under autocast the bf16 weight copies the backward needs are cast_weight_bytes: the
    Linears whose input needs a gradient (blocks 1, 2 and the head; block 0's input is the
    batch, so its weight copy is not kept)."""
    p = profile_workload(stack_workload(), device="cpu", precisions=["bf16"], batch_sizes=SIZES)
    assert list(p.steps) == ["fp32", "bf16"]
    assert p.steps["bf16"].cast_weight_bytes == 3 * W * W * 2
    assert p.steps["fp32"].cast_weight_bytes == 0
    # Blocks 0 and 2 get fp32 inputs (the batch; block 1's output, promoted to fp32 by its
    # fp32 row vector): each keeps autocast's bf16 copy of its input and its bf16 ReLU output,
    # 2 + 2 bytes per value, where fp32 kept one 4-byte ReLU output.
    for i in (0, 2):
        assert p.steps["bf16"].blocks[i].activation.per_sample_bytes == 2 * W + 2 * W
        assert p.steps["bf16"].blocks[i].activation.constant_bytes == 0
    assert p.device.bf16_supported


def test_unknown_precision_and_bad_batch_sizes_are_refused() -> None:
    """Bad inputs raise BadInputError naming the value."""
    with pytest.raises(BadInputError, match="fp8"):
        profile_workload(stack_workload(), device="cpu", precisions=["fp8"])
    with pytest.raises(BadInputError, match="batch_sizes"):
        profile_workload(stack_workload(), device="cpu", batch_sizes=(3, 3))
    with pytest.raises(BadInputError, match="device"):
        profile_workload(stack_workload(), device="tpu")


# -- the caller's state -------------------------------------------------------------------------


def test_profiling_leaves_model_grads_modes_optimizer_and_rng_exactly_as_they_were() -> None:
    """Weights, gradients, train/eval flags, the caller's optimizer and every RNG are equal
    (and the same objects) after profiling a model with dropout."""
    wl = stack_workload(dropout=0.5)
    model = wl.model
    user_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    stack_loss(model(torch.randn(3, W)), None).backward()
    user_opt.step()  # momentum buffers exist
    model.blocks[1].eval()
    params = {n: (p, p.detach().clone(), p.grad.clone()) for n, p in model.named_parameters()}
    modes = {n: m.training for n, m in model.named_modules()}
    opt_state = {k: v["momentum_buffer"].clone() for k, v in user_opt.state.items()}
    random.seed(1)
    np.random.seed(2)
    torch.manual_seed(3)
    rng = (torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy())

    profile = memadvisor.profile(
        model,
        wl.sample_batch,
        loss_fn=stack_loss,
        optimizer=user_opt,
        device="cpu",
        precisions=["fp32"],
        batch_sizes=SIZES,
    )

    # The caller's optimizer class was profiled (SGD: one momentum buffer per weight), not
    # AdamW, and not the caller's optimizer itself.
    assert profile.optimizer_state_bytes == sum(p.numel() * 4 for p in model.parameters())
    for n, p in model.named_parameters():
        same, value, grad = params[n]
        assert p is same and torch.equal(p, value) and torch.equal(p.grad, grad), n
    assert {n: m.training for n, m in model.named_modules()} == modes
    assert all(torch.equal(user_opt.state[k]["momentum_buffer"], v) for k, v in opt_state.items())
    assert torch.equal(torch.get_rng_state(), rng[0])
    assert random.getstate() == rng[1]
    assert np.array_equal(np.random.get_state()[1], rng[2])


# -- fake tensors -------------------------------------------------------------------------------


def test_under_fake_tensors_the_bytes_equal_the_real_ones_and_no_memory_is_used(
    stack_profile,
) -> None:
    """Profiled inside FakeTensorMode the activation, phase and static bytes are exactly the
    real run's; the device is 'fake', times are 0, and progress counts the (untimed) steps."""
    seen: list[tuple[int, int]] = []
    with FakeTensorMode():
        torch.manual_seed(0)
        wl = Workload(Stack(), torch.randn(SIZES[0], W), loss_fn=stack_loss)
        fake = profile_workload(
            wl,
            precisions=["fp32"],
            batch_sizes=SIZES,
            progress=lambda _what, done, total: seen.append((done, total)),
        )
    real = stack_profile
    assert fake.device.kind == "fake"
    fs, rs = fake.steps["fp32"], real.steps["fp32"]
    assert [b.activation for b in fs.blocks] == [b.activation for b in rs.blocks]
    assert fs.activation_total == rs.activation_total
    assert [p.allocated for p in fs.phases] == [p.allocated for p in rs.phases]
    assert (fake.param_bytes, fake.grad_bytes, fake.optimizer_state_bytes) == (
        real.param_bytes,
        real.grad_bytes,
        real.optimizer_state_bytes,
    )
    assert fs.step_ms.at(4) == 0.0
    dones = [d for d, _ in seen]
    assert dones[0] == 0 and dones == sorted(dones)
    assert seen[-1] == (3, 3)  # warm-up + one metered step per batch size, none timed


# -- the GPT example ---------------------------------------------------------------------------


def test_gpt_lm_head_and_loss_outweigh_every_block(examples_dir: Path) -> None:
    """With a large vocabulary the loss's saved log-probabilities are larger than any block,
    and the profile names them as an owner outside the blocks. (8k words rather than the
    example's 50k keep the test fast: the loss grows with the vocabulary, the blocks do not.)"""
    sys.path.insert(0, str(examples_dir))
    try:
        from gpt import build
    finally:
        sys.path.remove(str(examples_dir))
    parts = build(batch_size=1, n_layer=2, block_size=16, vocab_size=8192, n_embd=64, n_head=2)
    p = memadvisor.profile(
        parts["model"], parts["sample_batch"], loss_fn=parts["loss_fn"], device="cpu",
        precisions=["fp32"], batch_sizes=(1, 2),
    )  # fmt: skip
    step = p.steps["fp32"]
    assert [b.name for b in p.blocks] == ["h.0", "h.1"]
    b = 2
    head = {m.name: m.activation.at(b) for m in step.outside}
    head_and_loss = head.get("lm_head", 0) + head["<loss>"]
    assert head_and_loss > max(blk.activation.at(b) for blk in step.blocks)
    assert step.outside[0].name == "<loss>"  # the largest owner comes first
    # log_softmax keeps (b * T, vocab) fp32 values
    assert head["<loss>"] >= b * 16 * 8192 * 4


class MaskedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x)) * mask


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(MaskedBlock() for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.full_like(x, 0.5)  # made in the step, shared by every block
        for layer in self.layers:
            x = layer(x, mask=mask)
        return x.sum()


def test_an_input_every_block_shares_is_no_blocks_own_input() -> None:
    """A mask passed to every block is kept for all of them anyway: a block's input is its
    own hidden state only (and block 0's is the batch, which existed before the step)."""
    torch.manual_seed(0)
    p = profile_workload(
        Workload(Masked(), torch.randn(2, W)), device="cpu", precisions=["fp32"],
        batch_sizes=SIZES,
    )  # fmt: skip
    b = 4
    step = p.steps["fp32"]
    assert [blk.input.at(b) for blk in step.blocks] == [0, b * ROW, b * ROW]
    # The mask is the model's own (made outside every named module), saved by every product.
    assert {m.name: m.activation.at(b) for m in step.outside} == {"<other>": b * ROW}


def test_cuda_is_refused_where_there_is_none() -> None:
    """device='cuda' on a machine without CUDA says so and what to pass instead."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(BadInputError, match="device='cpu'"):
        profile_workload(stack_workload(), device="cuda")


# -- CUDA (skipped without a card) --------------------------------------------------------------


def _plain_cuda_step(wl: Workload, b: int) -> tuple[int, int]:
    """(peak, forward growth) of one steady-state step, read from the allocator itself."""
    import copy

    from memadvisor._torch_private import clear_cublas_workspaces

    # As in a fresh process: cuBLAS's workspaces (made by earlier tests) are made in the
    # step, so they count in its peak as the profile counts them.
    clear_cublas_workspaces()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    model = copy.deepcopy(wl.model).cuda()
    opt = wl.make_optimizer(model)
    batch = wl.batch(b, "cuda")
    for _ in range(3):  # optimizer state and cuBLAS workspaces exist from here on
        train_step(wl, model, opt, batch)
    marks: dict[str, int] = {}

    def on_phase(phase: str) -> None:
        marks[phase] = torch.cuda.memory_allocated()

    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    train_step(wl, model, opt, batch, on_phase=on_phase)
    return torch.cuda.max_memory_allocated() - base, marks["backward"] - marks["forward"]


@pytest.mark.gpu
def test_cuda_profile_matches_the_allocator_for_the_same_step() -> None:
    """On a card the profile's peak equals max_memory_allocated of the same step (2%), and
    its saved activations equal the allocator's growth over forward (5%)."""
    torch.manual_seed(0)
    wide = Workload(Stack(), torch.randn(256, W), loss_fn=stack_loss)
    p = profile_workload(wide, device="cuda", precisions=["fp32"])
    assert p.device.kind == "cuda" and p.fragmentation_ratio >= 1.0
    step = p.steps["fp32"]
    assert all(ph.reserved is not None for ph in step.phases)
    b = p.batch_sizes[1]
    peak, growth = _plain_cuda_step(wide, b)
    assert abs(max(ph.allocated.at(b) for ph in step.phases) - peak) <= 0.02 * peak
    assert abs(step.activation_total.at(b) - growth) <= 0.05 * growth


class FitsUpTo(nn.Module):
    """Raises the allocator's out-of-memory error above a batch size, as a small card would."""

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit
        self.blocks = nn.Sequential(Block(), Block())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return self.blocks(x).sum()


def test_sizes_that_run_out_of_memory_are_halved_until_they_fit() -> None:
    """A sample of 4 tries (4, 8); 8 does not fit, so (2, 4) is measured."""
    p = profile_workload(
        Workload(FitsUpTo(limit=5), torch.randn(4, W)), device="cpu", precisions=["fp32"]
    )
    assert p.batch_sizes == (2, 4)


def test_explicit_sizes_that_do_not_fit_raise_the_out_of_memory_error() -> None:
    """Sizes the caller chose are not changed behind their back."""
    with pytest.raises(torch.OutOfMemoryError):
        profile_workload(
            Workload(FitsUpTo(limit=5), torch.randn(4, W)),
            device="cpu",
            precisions=["fp32"],
            batch_sizes=(4, 8),
        )
