"""The estimate: each rule of the walk by hand count, then against the simulated device's peak."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from memadvisor.device._autocast import cuda_autocast_policy
from memadvisor.device.simulated import SimulatedDevice
from memadvisor.estimate import StepModel, estimate
from memadvisor.profiler import profile_workload
from memadvisor.schema.candidate import Candidate, Estimate
from memadvisor.schema.profile import (
    BlockActivity,
    BlockInfo,
    DeviceInfo,
    LinearBytes,
    PhasePeak,
    Profile,
    StepProfile,
    UntrackedBytes,
)
from memadvisor.strategy import load_strategies
from memadvisor.target import load_factory, load_target, workload_from_result
from memadvisor.workload import Workload

MIB = 2**20
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _mib(per_sample: float, constant: float = 0.0) -> LinearBytes:
    return LinearBytes(per_sample_bytes=per_sample * MIB, constant_bytes=constant * MIB)


# -- a hand-built profile whose every number is known ------------------------------------------
#
# Weights 10 MiB, gradients 10, AdamW state 20; the optimizer step peaks at 60 MiB. Three
# blocks, each saving 8 MiB a sample, of which its output is 2 MiB (saved by the next block;
# nothing after the last block saves its output); forward transient 2 MiB a sample. Outside
# the blocks 4 MiB a sample. The walk, relative to the end of forward E = 30 + 28b MiB: the
# head peaks 5b above E; block 2's backward begins 2b above (its output's gradient) and peaks
# 4b above; each block's backward frees its 8b and makes 3 MiB of gradients.


def _walk_profile(
    *,
    transient: float = 2.0,
    cast_mib: float = 0.0,
    kind: str = "cpu",
    walk: bool = True,
    input_low: float | None = None,
) -> Profile:
    starts = [(-14, 6), (-6, 3), (2, 0)]
    blocks = [
        BlockActivity(
            name=f"blocks.{i}",
            activation=_mib(8),
            input=_mib(2),
            input_low=None if input_low is None else _mib(input_low),
            output=_mib(2),
            output_kept=(_mib(2) if i < 2 else _mib(0)) if walk else None,
            forward_transient=_mib(transient),
            cast_weight_bytes=int(cast_mib * MIB),
            backward_start=_mib(*starts[i]) if walk else None,
            backward_peak=_mib(starts[i][0] + 2, starts[i][1]) if walk else None,
        )
        for i in range(3)
    ]
    cast = int(3 * cast_mib * MIB)
    step = StepProfile(
        precision="fp32",
        blocks=blocks,
        activation_total=_mib(28),
        cast_weight_bytes=cast,
        phases=[
            PhasePeak(phase="forward", allocated=_mib(29, 30 + 3 * cast_mib)),
            PhasePeak(phase="backward", allocated=_mib(33, 30 + 3 * cast_mib)),
            PhasePeak(phase="optimizer", allocated=_mib(0, 60)),
        ],
        end_of_forward=_mib(28, 30 + 3 * cast_mib) if walk else None,
        backward_head_peak=_mib(5) if walk else None,
    )
    return Profile(
        model_name="Hand",
        device=DeviceInfo(kind=kind, name="hand"),
        batch_sizes=(1, 2),
        param_bytes=10 * MIB,
        grad_bytes=10 * MIB,
        optimizer_state_bytes=20 * MIB,
        blocks=[
            BlockInfo(name=f"blocks.{i}", type_name="Block", param_bytes=3 * MIB) for i in range(3)
        ],
        steps={"fp32": step},
    )


def _peak(profile: Profile, b: int, checkpointed=(), accumulation: int = 1):  # noqa: ANN001, ANN202
    model = StepModel(profile, b, accumulation)
    model.checkpoint(checkpointed)
    return model.result()


def test_without_checkpointing_the_peak_is_the_measured_walk_s_highest_moment() -> None:
    est = _peak(_walk_profile(), 4)
    # The head: E + 5b = 30 + 28*4 + 5*4 MiB.
    assert (est.peak_bytes, est.peak_at, est.peak_phase) == (
        162 * MIB,
        "backward: head",
        "backward",
    )


def test_activations_grow_linearly_with_the_batch() -> None:
    profile = _walk_profile()
    assert _peak(profile, 8).peak_bytes - _peak(profile, 4).peak_bytes == 4 * 33 * MIB


def test_a_checkpointed_block_keeps_only_what_its_successor_saved() -> None:
    """Block 0 checkpointed frees its 8b less its 2b output (saved by block 1): 6b lower."""
    assert _peak(_walk_profile(), 4, [0]).peak_bytes == (162 - 6 * 4) * MIB


def test_blocks_run_lower_by_what_checkpointed_blocks_below_them_freed() -> None:
    """All checkpointed: block 2 frees 8b (nothing after it saves its output), blocks 1 and 0
    6b each. Block 2's backward runs with blocks 0 and 1's savings still missing:
    E + 4b - 12b = 110 MiB, above the head (162 - 20b = 82 MiB)."""
    est = _peak(_walk_profile(), 4, [0, 1, 2])
    assert (est.peak_bytes, est.peak_at) == (110 * MIB, "backward: blocks.2")


def test_a_recompute_tops_the_level_where_its_block_s_backward_begins_by_its_transient() -> None:
    """With a 6b transient, block 2's recompute (E + 2b - 12b + 6b = 126 MiB) is the peak."""
    est = _peak(_walk_profile(transient=6.0), 4, [0, 1, 2])
    assert (est.peak_bytes, est.peak_at) == (126 * MIB, "backward: blocks.2")


def test_checkpointing_also_frees_autocast_s_weight_copies_after_forward() -> None:
    """1 MiB of low-precision weight copies per block: block 0 checkpointed frees 6b + 1 MiB."""
    profile = _walk_profile(cast_mib=1.0)
    assert _peak(profile, 4).peak_bytes - _peak(profile, 4, [0]).peak_bytes == (24 + 1) * MIB


@pytest.mark.parametrize(
    ("checkpointed", "peak_mib", "peak_at"),
    [
        ((), 162, "backward: head"),  # E + 5b, the copies held at the head dropped
        ((0,), 138, "backward: head"),  # block 0 frees its 6b, and no copy of its own
        ((0, 1, 2), 110, "backward: blocks.2"),  # E + 4b - 12b, its own copy not taken twice
    ],
)
def test_without_weight_copies_a_step_is_estimated_as_one_measured_without_them(
    checkpointed: tuple[int, ...], peak_mib: int, peak_at: str
) -> None:
    """Dropping autocast's weight copies (FSDP2 gathers its units in bf16) takes each copy
    away once, wherever the walk held it: the peak is that of the same step profiled without
    copies (1 MiB a block here), checkpointed or not."""
    without = _peak(_walk_profile(), 4, checkpointed)
    model = StepModel(_walk_profile(cast_mib=1.0), 4)
    model.checkpoint(checkpointed)
    model.drop_weight_copies()
    dropped = model.result()
    assert (dropped.peak_bytes, dropped.peak_at) == (without.peak_bytes, without.peak_at)
    assert (dropped.peak_bytes, dropped.peak_at) == (peak_mib * MIB, peak_at)


@pytest.mark.parametrize(
    ("checkpointed", "less_mib", "backward_mib", "backward_at"),
    [
        # No block keeps its input as such: what their ops saved is the profile's.
        ((), 0, 162, "backward: head"),
        # 1b less, off what block 1 frees (block 0, its input's maker, keeps it whole).
        ((1,), 4, 134, "backward: head"),
        # 1b less each: block 0's input off itself, 1's and 2's off what 0 and 1 keep. Block 2
        # runs at E + 4b - 15b = 98; block 0's own backward, where the walk still counts its
        # input whole (1b high: 96 by hand), is the top: E - 12b + 6 = 100.
        ((0, 1, 2), 12, 100, "backward: blocks.0"),
    ],
)
def test_a_checkpointed_block_whose_input_arrives_cast_keeps_it_at_two_bytes(
    checkpointed: tuple[int, ...], less_mib: int, backward_mib: int, backward_at: str
) -> None:
    """FSDP2 with a bf16 param_dtype casts each unit's floating inputs to bf16 (and its
    bf16 weights keep the residual stream there): a checkpointed block keeps its input at
    ``input_low`` (1 MiB a sample here, its 2 MiB fp32 input at half), so the moments
    before its backward, the end of forward among them, hold 1b MiB less per checkpointed
    block, and the activations as much less. A profile that did not measure ``input_low``
    (older ones) is estimated as before."""

    def cast(profile: Profile) -> Estimate:
        model = StepModel(profile, 4)
        model.checkpoint(checkpointed)
        model.cast_block_inputs(range(3))
        return model.result()

    plain, low = _peak(_walk_profile(), 4, checkpointed), cast(_walk_profile(input_low=1.0))
    forward_less = plain.phase_peak_bytes["forward"] - low.phase_peak_bytes["forward"]
    assert forward_less == less_mib * MIB
    assert plain.breakdown["activations"] - low.breakdown["activations"] == less_mib * MIB
    assert (low.phase_peak_bytes["backward"], low.peak_at) == (backward_mib * MIB, backward_at)
    assert cast(_walk_profile()).phase_peak_bytes == plain.phase_peak_bytes


def test_accumulation_holds_the_gradients_through_the_next_micro_batch() -> None:
    profile = _walk_profile()
    assert _peak(profile, 4, accumulation=2).peak_bytes == _peak(profile, 4).peak_bytes + 10 * MIB


def test_the_optimizer_step_is_the_peak_when_activations_are_small() -> None:
    est = _peak(_walk_profile(), 1, [0, 1, 2])
    assert (est.peak_bytes, est.peak_phase) == (60 * MIB, "optimizer")
    assert est.breakdown["grads"] == 10 * MIB and est.breakdown["activations"] == 0


def test_each_phase_keeps_its_own_highest_moment_and_the_peak_is_the_highest() -> None:
    """Batch 4: forward's measured peak 29b + 30 = 146 MiB, backward the head's 162, the
    optimizer step 60. Every block checkpointed frees 20b = 80 MiB until its backward:
    forward 66, backward block 2's 110 (see above)."""
    plain = _peak(_walk_profile(), 4)
    assert plain.phase_peak_bytes == {"forward": 146 * MIB, "backward": 162 * MIB,
                                      "optimizer": 60 * MIB}  # fmt: skip
    assert plain.peak_bytes == max(plain.phase_peak_bytes.values())
    checkpointed = _peak(_walk_profile(), 4, [0, 1, 2])
    assert checkpointed.phase_peak_bytes == {"forward": 66 * MIB, "backward": 110 * MIB,
                                             "optimizer": 60 * MIB}  # fmt: skip


def test_cuda_fixed_costs_are_added_once_and_reserved_scales_by_the_measured_ratio() -> None:
    """On CUDA the phase peaks came from the allocator with the fixed costs in; the walk's
    levels are tensor bytes, so the 70 MiB is added to those alone."""
    profile = _walk_profile(kind="cuda").model_copy(
        update={"fixed_overhead_bytes": 70 * MIB, "fragmentation_ratio": 1.25}
    )
    est = _peak(profile, 4)
    assert est.peak_bytes == (162 + 70) * MIB
    assert est.reserved_peak_bytes == int(est.peak_bytes * 1.25)
    model = StepModel(profile, 4)
    model.add_bytes("optimizer", 200 * MIB)
    assert model.result().peak_bytes == (60 + 200) * MIB  # the optimizer phase, as read


def test_reserved_adds_the_largest_allocation_where_the_profile_has_its_line() -> None:
    """Under a memory cap a freed block of the step's largest tensor can be stranded: the
    reserved peak is the allocated peak plus that tensor at the batch (the line wins over the
    small-batch ratio), and limit_bytes, what the planner fits, is the larger of the two."""
    base = _walk_profile(kind="cuda").model_copy(update={"fragmentation_ratio": 1.25})
    step = base.steps["fp32"].model_copy(
        update={"largest_allocation": LinearBytes(per_sample_bytes=3 * MIB, constant_bytes=MIB)}
    )
    profile = base.model_copy(update={"steps": {**base.steps, "fp32": step}})
    for b in (4, 8):
        est = _peak(profile, b)
        assert est.reserved_peak_bytes == est.peak_bytes + (3 * b + 1) * MIB
        assert est.limit_bytes == est.reserved_peak_bytes
    cpu = _peak(_walk_profile(), 4)
    assert cpu.reserved_peak_bytes is None and cpu.limit_bytes == cpu.peak_bytes


def _with_untracked(profile: Profile, *lines: UntrackedBytes) -> Profile:
    step = profile.steps["fp32"].model_copy(
        update={"untracked": list(lines), "untracked_batch_sizes": (64, 128)}
    )
    return profile.model_copy(update={"steps": {"fp32": step}})


def _cuda_walk_profile() -> Profile:
    return _walk_profile(kind="cuda").model_copy(update={"fixed_overhead_bytes": 70 * MIB})


def test_cuda_backward_adds_the_untracked_line_beyond_the_fixed_overhead() -> None:
    """cuDNN's workspaces measured at larger sizes: 65 MiB + 10 MiB a sample in backward.
    At b=4 that is 105 MiB, of which the walk holds the 70 MiB fixed overhead: +35 MiB, at
    every moment of backward, checkpointed blocks' included."""
    plain, profile = (
        _cuda_walk_profile(),
        _with_untracked(
            _cuda_walk_profile(),
            UntrackedBytes(phase="backward", untracked=_mib(10, 65), profiled_bytes=70 * MIB),
        ),
    )
    for b, checkpointed in ((4, []), (4, [0, 1, 2]), (8, [0])):
        before, after = _peak(plain, b, checkpointed), _peak(profile, b, checkpointed)
        assert after.peak_bytes - before.peak_bytes == (65 + 10 * b - 70) * MIB
        assert (after.peak_at, after.peak_phase) == (before.peak_at, before.peak_phase)
    assert _peak(profile, 4).peak_bytes == (162 + 70 + 35) * MIB


def test_an_untracked_line_below_what_the_peaks_hold_takes_nothing_away() -> None:
    """At b=0.5 MiB a sample from 60 MiB the line stays under the 70 MiB fixed overhead up to
    b=20: no change there; from there on it adds."""
    profile = _with_untracked(
        _cuda_walk_profile(),
        UntrackedBytes(phase="backward", untracked=_mib(0.5, 60), profiled_bytes=70 * MIB),
    )
    plain = _cuda_walk_profile()
    assert _peak(profile, 4).peak_bytes == _peak(plain, 4).peak_bytes
    assert _peak(profile, 40).peak_bytes == _peak(plain, 40).peak_bytes + 10 * MIB


def test_forward_and_optimizer_add_beyond_what_their_measured_peaks_held() -> None:
    """The optimizer's peak (60 MiB, read from the allocator) held 20 MiB untracked at the
    profile's size; the line says 50: +30 MiB where the optimizer step is the peak (no fixed
    overhead here, so that backward stays below it)."""
    optimizer = UntrackedBytes(phase="optimizer", untracked=_mib(0, 50), profiled_bytes=20 * MIB)
    profile = _with_untracked(_walk_profile(kind="cuda"), optimizer)
    est = _peak(profile, 1, [0, 1, 2])
    assert (est.peak_bytes, est.peak_phase) == ((60 + 30) * MIB, "optimizer")
    forward = UntrackedBytes(phase="forward", untracked=_mib(4, 30), profiled_bytes=30 * MIB)
    model = StepModel(_with_untracked(_cuda_walk_profile(), forward), 4)
    grown = model._untracked_growth(70 * MIB)
    # The forward phase peak held 30 MiB of it; the end of the model's forward, 70.
    assert grown == {"forward": 16 * MIB, "end_of_forward": 0, "backward": 0, "optimizer": 0}


def test_profiles_without_untracked_lines_estimate_as_before() -> None:
    """CPU and older profiles have none: the estimate is unchanged (and a profile saved
    before the field existed still loads)."""
    profile = _cuda_walk_profile()
    data = profile.model_dump(mode="json")
    for step in data["steps"].values():
        del step["untracked"], step["untracked_batch_sizes"]
    old = Profile.model_validate(data)
    assert old.steps["fp32"].untracked == [] and old.steps["fp32"].untracked_batch_sizes is None
    assert _peak(old, 4).peak_bytes == (162 + 70) * MIB


def test_without_the_walk_the_estimate_falls_back_to_the_measured_backward_peak() -> None:
    profile = _walk_profile(walk=False)
    plain = _peak(profile, 4)
    assert plain.peak_bytes == 162 * MIB  # the measured backward phase at b=4: 33*4 + 30
    assert _peak(profile, 4, [0, 1, 2]).peak_bytes < plain.peak_bytes


def test_strategies_edit_it_through_the_verbs() -> None:
    profile = _walk_profile()
    strategies = load_strategies(["checkpointing"])
    est = estimate(
        profile, Candidate(batch_size=4, choices={"checkpointing": ["blocks.0"]}), strategies
    )
    assert est.peak_bytes == (162 - 24) * MIB
    model = StepModel(profile, 4)
    model.add_bytes("backward", 5 * MIB)
    model.add_ms(2.0)
    assert model.result().peak_bytes == 167 * MIB
    assert model.result().step_ms == _peak(profile, 4).step_ms + 2.0


class _NoTorch(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        raise AssertionError(f"the estimate called {func}")


def test_the_estimate_runs_no_torch_op() -> None:
    profile = _walk_profile()
    with _NoTorch():
        estimate(profile, Candidate(batch_size=3, choices={"checkpointing": ["blocks.1"]}),
                 load_strategies(["checkpointing"]))  # fmt: skip


# -- against the simulated device ----------------------------------------------------------------


def _profiled(workload: Workload) -> Profile:
    # The simulated device casts under autocast as a card does; so must the profile.
    with cuda_autocast_policy():
        return profile_workload(workload, device="cpu", precisions=["fp32", "bf16"])


def _grid_errors(workload: Workload, profile: Profile, batches: tuple[int, ...]) -> list[str]:
    """The grid (checkpointed: none / half / all) x (fp32, bf16) x batches; lines over 5%."""
    strategies = load_strategies(["precision", "checkpointing"])
    names = [b.name for b in profile.blocks]
    device = SimulatedDevice(2**40)
    table, worst = [], 0.0
    for precision in ("fp32", "bf16"):
        for checkpointed in ([], names[: len(names) // 2], names):
            for b in batches:
                choices = {"precision": precision, "checkpointing": checkpointed}
                candidate = Candidate(batch_size=b, choices=choices)
                est = estimate(profile, candidate, strategies).peak_bytes
                measured = device.run(workload, candidate, 2).peak_bytes
                error = (est - measured) / measured
                worst = max(worst, abs(error))
                table.append(
                    f"{precision} ckpt={len(checkpointed)} b={b}: est {est} measured {measured} "
                    f"({error:+.2%})"
                )
    return table if worst > 0.05 else []


@pytest.fixture(scope="module")
def cnn() -> Workload:
    """examples/cnn.py's ResNet, narrowed and on 16x16 images so the grid runs in seconds."""
    example = load_target(f"{EXAMPLES}/cnn.py:build")
    torch.manual_seed(0)
    model = type(example.model)(channels=16, width=8, depth=4)
    batch = (torch.randn(2, 3, 16, 16), torch.randint(0, 10, (2,)))
    return Workload(model=model, sample_batch=batch, loss_fn=example.loss_fn)


def test_cnn_estimate_is_within_5_percent_of_the_simulated_device(cnn: Workload) -> None:
    profile = _profiled(cnn)
    assert _grid_errors(cnn, profile, (1, 3, 8)) == []


def test_gpt_estimate_is_within_5_percent_of_the_simulated_device() -> None:
    """Two narrow layers and a 512-token vocabulary: the head and the blocks both matter, so
    the peak moves between them across the grid."""
    build = load_factory(f"{EXAMPLES}/gpt.py:build")
    workload = workload_from_result(
        build(batch_size=2, n_layer=2, n_embd=64, block_size=32, vocab_size=512)
    )
    profile = _profiled(workload)
    assert _grid_errors(workload, profile, (1, 4)) == []


@pytest.mark.gpu
def test_on_cuda_the_estimate_is_within_5_percent_of_max_memory_allocated(cnn: Workload) -> None:
    """On a card the truth is the caching allocator's own counter; cuBLAS's workspaces are
    freed first so the run makes them again, as a fresh process does.

    At a batch whose peak is about a GiB (the scale a budget is planned at) the estimate is
    within 5%. At a small batch it may only err high: the cuDNN workspace line, fitted at
    large batches, is partly hidden in free memory there (tens of MiB; estimate.py's
    Known limitations), and an estimate that errs high costs a probe, never an OOM.
    """
    from memadvisor._torch_private import clear_cublas_workspaces
    from memadvisor.device._train import train_candidate

    profile = profile_workload(cnn, device="cuda", precisions=["fp32", "bf16"])
    strategies = load_strategies(["precision", "checkpointing"])
    names = [b.name for b in profile.blocks]
    for precision in ("fp32", "bf16"):
        for checkpointed in ([], names):
            choices = {"precision": precision, "checkpointing": checkpointed}
            for batch in (64, _batch_filling(profile, choices, strategies, 2**30)):
                candidate = Candidate(batch_size=batch, choices=choices)
                torch.cuda.empty_cache()
                clear_cublas_workspaces()
                measured = train_candidate(cnn, candidate, 3, device=torch.device("cuda"))
                est = estimate(profile, candidate, strategies).peak_bytes
                where = (precision, bool(checkpointed), batch, est, measured.peak_bytes)
                if batch == 64:
                    assert est >= 0.95 * measured.peak_bytes, where
                else:
                    assert est == pytest.approx(measured.peak_bytes, rel=0.05), where


def _batch_filling(profile: Profile, choices: dict, strategies: list, target_bytes: int) -> int:
    """The largest batch whose estimated peak is at most ``target_bytes``."""
    lo, hi = 1, 2
    while (
        estimate(profile, Candidate(batch_size=hi, choices=choices), strategies).peak_bytes
        <= target_bytes
    ):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        fits = estimate(profile, Candidate(batch_size=mid, choices=choices), strategies).peak_bytes
        lo, hi = (mid, hi) if fits <= target_bytes else (lo, mid)
    return lo


@pytest.mark.gpu
def test_on_cuda_full_cnn_fp32_at_4_gib_is_within_10_percent_of_max_memory_allocated() -> None:
    """examples/cnn.py in fp32 at the batch whose estimate fills 4 GiB (~580, ~1250 with every
    block checkpointed): cuDNN's workspaces grow 1.44 MiB a sample there, which the estimate
    missed (-17%, -30%) before the profile fitted them at larger sizes."""
    from memadvisor._torch_private import clear_cublas_workspaces
    from memadvisor.device._train import train_candidate

    workload = load_target(f"{EXAMPLES}/cnn.py:build")
    profile = profile_workload(workload, device="cuda", precisions=["fp32"])
    strategies = load_strategies(["precision", "checkpointing"])
    names = [b.name for b in profile.blocks]
    errors = {}
    for label, checkpointed in (("none", []), ("all", names)):
        choices = {"precision": "fp32", "checkpointing": checkpointed}
        b = 1
        while (
            estimate(profile, Candidate(batch_size=2 * b, choices=choices), strategies).peak_bytes
            <= 4 * 2**30
        ):
            b *= 2
        candidate = Candidate(batch_size=b, choices=choices)
        torch.cuda.empty_cache()
        clear_cublas_workspaces()
        measured = train_candidate(workload, candidate, 2, device=torch.device("cuda")).peak_bytes
        est = estimate(profile, candidate, strategies).peak_bytes
        errors[label, b] = (est - measured) / measured
    assert all(abs(e) <= 0.10 for e in errors.values()), errors
