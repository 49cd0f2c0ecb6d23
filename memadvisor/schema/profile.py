"""What a profiler pass measured: the data every later decision rests on.

Sizes that grow with the batch are stored as :class:`LinearBytes` (``per_sample * b +
constant``), fitted from two measured batch sizes, so any batch can be read off without
measuring it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from memadvisor.schema.call import CallForm
from memadvisor.schema.device import DeviceCapabilities, capabilities_of_kind
from memadvisor.schema.precision import AUTOCAST_DTYPES, Precision

__all__ = [
    "StepTimeModel",
    "BlockActivity",
    "BlockInfo",
    "DeviceInfo",
    "LayerRow",
    "LinearBytes",
    "LinearMs",
    "ModuleActivity",
    "PhasePeak",
    "Profile",
    "StepFlops",
    "StepProfile",
    "UntrackedBytes",
]

ProfilePhase = Literal["forward", "backward", "optimizer", "zero_grad"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LinearBytes(_Model):
    """Bytes that grow linearly with the batch: ``per_sample_bytes * b + constant_bytes``."""

    per_sample_bytes: float = Field(0.0, description="Bytes added by each sample of the batch.")
    constant_bytes: float = Field(
        0.0, description="Bytes at any batch size (may be negative when fitted from two points)."
    )

    def at(self, batch_size: int) -> int:
        """The bytes at ``batch_size``, never below zero."""
        return max(0, int(round(self.per_sample_bytes * batch_size + self.constant_bytes)))

    def signed_at(self, batch_size: int) -> int:
        """The bytes at ``batch_size``, negative where the line is (a difference of levels)."""
        return int(round(self.per_sample_bytes * batch_size + self.constant_bytes))

    @classmethod
    def fit(cls, b1: int, bytes1: int, b2: int, bytes2: int) -> LinearBytes:
        """The line through two measurements ``(b1, bytes1)`` and ``(b2, bytes2)``."""
        if b1 == b2:
            raise ValueError(f"Two distinct batch sizes are needed, but got {b1=} and {b2=}.")
        slope = (bytes2 - bytes1) / (b2 - b1)
        return cls(per_sample_bytes=slope, constant_bytes=bytes1 - slope * b1)


class LinearMs(_Model):
    """Milliseconds that grow linearly with the batch: ``per_sample_ms * b + constant_ms``."""

    per_sample_ms: float = 0.0
    constant_ms: float = 0.0

    def at(self, batch_size: int) -> float:
        return max(0.0, self.per_sample_ms * batch_size + self.constant_ms)

    @classmethod
    def fit(cls, b1: int, ms1: float, b2: int, ms2: float) -> LinearMs:
        if b1 == b2:
            raise ValueError(f"Two distinct batch sizes are needed, but got {b1=} and {b2=}.")
        slope = max(0.0, (ms2 - ms1) / (b2 - b1))
        return cls(per_sample_ms=slope, constant_ms=max(0.0, ms1 - slope * b1))


class DeviceInfo(_Model):
    """The device a profile was measured on (or, for fake tensors, planned for), and the
    capabilities of the device the plan is for, which strategies read.

    ``kind`` and the ``*_supported`` flags say where the profiler measured; ``capabilities``
    what the planning device can do: the planner sets the device's own (a third party's
    device profiled on the CPU keeps its kind, autocast and compile there). A profile written
    before capabilities existed gets its kind's (:func:`capabilities_of_kind`).
    """

    kind: Literal["cuda", "cpu", "fake"] = Field(
        description="cuda: a real card; cpu: real CPU tensors, bytes tracked; fake: FakeTensorMode."
    )
    name: str = Field(description="e.g. 'NVIDIA H200' or 'cpu'.")
    total_bytes: int | None = Field(None, description="The card's memory; None on the CPU.")
    bf16_supported: bool = False
    fp16_supported: bool = False
    tf32_supported: bool = Field(
        False, description="fp32 matmuls can run in TF32 (a card of compute capability 8.0+)."
    )
    torch_version: str = ""
    capabilities: DeviceCapabilities = Field(
        None,  # type: ignore[assignment]  # made below from the kind
        description="What the device the profile is for can do (default: its kind's).",
    )

    @model_validator(mode="after")
    def _capabilities_of_its_kind(self) -> DeviceInfo:
        if self.capabilities is None:
            flags = (("bf16", self.bf16_supported), ("fp16", self.fp16_supported))
            dtypes = tuple(p for p, supported in flags if supported)
            self.capabilities = capabilities_of_kind(
                self.kind, dtypes=dtypes, total_bytes=self.total_bytes
            )
        return self


class BlockInfo(_Model):
    """A module the planner may checkpoint (a transformer layer, a ResNet bottleneck)."""

    name: str = Field(description="Qualified name in the model, e.g. 'transformer.h.3'.")
    type_name: str = Field(description="The module's class name.")
    param_bytes: int = Field(0, ge=0)


class BlockActivity(_Model):
    """One block in one precision: what it keeps for backward and how long it takes."""

    name: str
    activation: LinearBytes = Field(
        description="Saved for backward: unique storages this block "
        "created (its input is counted to whoever made it)."
    )
    input: LinearBytes = Field(description="The block's input: all a checkpointed block keeps.")
    input_low: LinearBytes | None = Field(
        None,
        description="The block's input with each floating-point tensor at 2 bytes an element: "
        "what a checkpointed block keeps when its inputs are cast to bf16/fp16 (FSDP2's "
        "MixedPrecisionPolicy casts every unit's floating inputs to its param_dtype). None: "
        "not measured (older profiles).",
    )
    forward_ms: LinearMs = Field(default_factory=LinearMs)
    backward_ms: LinearMs = Field(default_factory=LinearMs)
    forward_transient: LinearBytes = Field(
        default_factory=LinearBytes,
        description="Peak above the saved bytes while the block's forward runs (temporaries); "
        "the transient a recompute adds during backward.",
    )
    output: LinearBytes = Field(
        default_factory=LinearBytes,
        description="The block's outputs that it made (part of its activation when the next "
        "block saves them): what a checkpointed successor's input shares with this block.",
    )
    # The backward walk, measured in the step without checkpointing; the estimate moves it
    # by what a candidate's checkpointed blocks free. None: not measured (older profiles).
    output_kept: LinearBytes | None = Field(
        None,
        description="Of the block's outputs, the bytes saved for backward by ops outside the "
        "block (its successor, the head): what stays after forward if it is checkpointed.",
    )
    cast_weight_bytes: int = Field(
        0,
        ge=0,
        description="Autocast's weight copies made inside the block (part of "
        "StepProfile.cast_weight_bytes); a checkpointed block frees them after forward.",
    )
    backward_start: LinearBytes | None = Field(
        None,
        description="Live bytes when the block's backward begins (its output's gradient is "
        "ready) minus StepProfile.end_of_forward; may be negative. Read with signed_at().",
    )
    backward_peak: LinearBytes | None = Field(
        None,
        description="Most live bytes while the block's backward runs, minus "
        "StepProfile.end_of_forward; may be negative. Read with signed_at().",
    )


class ModuleActivity(_Model):
    """A consumer of activation memory outside the blocks (embedding, LM head, loss)."""

    name: str = Field(description="Module name, or '<loss>' / '<other>' for what no module owns.")
    type_name: str = Field(
        "", description="The module's class; for '<other>' the model's own class (its forward)."
    )
    activation: LinearBytes
    forward_ms: LinearMs = Field(default_factory=LinearMs)
    made_by: list[str] = Field(
        default_factory=list,
        description="For '<loss>' / '<other>': the ops that made the saved bytes, largest "
        "first (``_log_softmax``): what the bytes are when no module owns them.",
    )
    after: str | None = Field(
        None,
        description="For '<loss>' / '<other>': the submodule whose forward had finished last "
        "when the largest of them was made (``lm_head``): whose output they come from.",
    )


class PhasePeak(_Model):
    """The highest bytes held during one phase of the step."""

    phase: ProfilePhase
    allocated: LinearBytes
    reserved: LinearBytes | None = Field(
        None,
        description="CUDA only: the caching allocator's "
        "reserved bytes, which a memory fraction caps.",
    )


class UntrackedBytes(_Model):
    """Bytes the caching allocator held at one phase's peak beyond every tensor a dispatch
    mode sees (cuDNN's convolution workspaces, cuBLAS's, block rounding): CUDA only.

    Fitted at two batch sizes larger than the profile's (``StepProfile.untracked_batch_sizes``),
    where cuDNN's workspaces have started to grow with the batch; the profile's own sizes are
    too small to show it (``docs/design.md``, "cuDNN's workspaces grow with the batch").
    """

    phase: ProfilePhase
    untracked: LinearBytes = Field(
        description="Allocator phase peak minus tracked phase peak, cuBLAS's workspaces in."
    )
    profiled_bytes: int = Field(
        0,
        ge=0,
        description="The same difference at the profile's larger batch size: what the "
        "phase's measured peak (PhasePeak.allocated) already holds of it.",
    )


class StepProfile(_Model):
    """One training step measured in one precision."""

    precision: Precision
    blocks: list[BlockActivity] = Field(description="In the order of Profile.blocks.")
    outside: list[ModuleActivity] = Field(
        default_factory=list, description="Activation owners that are not blocks."
    )
    activation_total: LinearBytes = Field(
        description="All bytes saved for backward at the end "
        "of forward, blocks and outside together."
    )
    phases: list[PhasePeak] = Field(default_factory=list, description="In step order.")
    cast_weight_bytes: int = Field(
        0,
        ge=0,
        description="Low-precision weight copies autocast keeps during forward (0 in fp32).",
    )
    forward_ms: LinearMs = Field(default_factory=LinearMs)
    backward_ms: LinearMs = Field(default_factory=LinearMs)
    optimizer_ms: float = 0.0
    step_ms: LinearMs = Field(default_factory=LinearMs)
    end_of_forward: LinearBytes | None = Field(
        None,
        description="Live bytes when backward begins (weights, optimizer state, the batch, "
        "everything saved for backward, autocast's weight copies); None: not measured.",
    )
    backward_head_peak: LinearBytes | None = Field(
        None,
        description="Most live bytes in backward before the first block's backward begins "
        "(the loss and the head), minus end_of_forward; None: not measured.",
    )
    untracked_batch_sizes: tuple[int, int] | None = Field(
        None,
        description="The two batch sizes ``untracked`` was fitted at; None: not measured "
        "(CPU, fake tensors, older profiles, or no larger batch fitted on the card).",
    )
    untracked: list[UntrackedBytes] = Field(
        default_factory=list,
        description="CUDA: per phase, the bytes the allocator held beyond tracked tensors, "
        "as a line in the batch size; empty where not measured.",
    )
    largest_allocation: LinearBytes | None = Field(
        None,
        description="CUDA: the step's largest single tensor allocation, fitted at "
        "``untracked_batch_sizes``. Under a memory cap a freed block that size can be split "
        "and stranded, so the allocator reserves about that much beyond its allocated peak "
        "(the estimate's reserved_peak_bytes); None where not measured.",
    )
    largest_block_allocation: LinearBytes | None = Field(
        None,
        description="The largest single tensor the blocks made (autocast's weight copies "
        "aside), as the metered steps saw it: what the step's largest allocation becomes "
        "where a strategy removes a larger one outside the blocks (a chunked loss's whole "
        "logits). None in profiles made before it was measured.",
    )


class StepFlops(_Model):
    """Matmul FLOPs of one plain training step (no autocast), per sample, by dtype."""

    batch_size: int = Field(gt=0, description="The batch the FLOPs were counted at.")
    forward_per_sample: dict[str, float] = Field(
        description="The model's forward and the loss, by dtype name (fp32, bf16, fp16, ...)."
    )
    backward_per_sample: dict[str, float] = Field(description="Backward, by dtype name.")
    module_forward_per_sample: dict[str, dict[str, float]] = Field(
        default_factory=dict,
        description="Per named module (blocks included), its forward by dtype: what a "
        "checkpointed block's recompute costs.",
    )

    @property
    def total_per_sample(self) -> float:
        return sum(self.forward_per_sample.values()) + sum(self.backward_per_sample.values())


class LayerRow(_Model):
    """One named module in the per-layer table (fp32, at the larger measured batch).

    Bytes include the module's submodules (parameters and gradients counted once per
    storage, so tied weights are not doubled); ``self_activation_bytes`` does not.
    """

    name: str
    type_name: str
    param_bytes: int = 0
    grad_bytes: int = 0
    activation_bytes: int = Field(
        0, description="Saved for backward by this module and its submodules (made by them)."
    )
    self_activation_bytes: int = Field(
        0, description="Saved for backward and made by this module itself, not a submodule."
    )


class Profile(_Model):
    """Everything the estimate needs about one model's training step."""

    schema_version: int = 1
    model_name: str
    device: DeviceInfo
    batch_sizes: tuple[int, int] = Field(description="The two batch sizes measured.")
    param_bytes: int = Field(ge=0)
    grad_bytes: int = Field(ge=0, description="Gradients at the end of backward.")
    optimizer_state_bytes: int = Field(ge=0, description="After the first optimizer step.")
    buffer_bytes: int = Field(0, ge=0)
    param_count: int | None = Field(
        None, ge=0, description="Parameters (elements, each shared tensor once); None: not counted."
    )
    trainable_param_count: int | None = Field(
        None,
        ge=0,
        description="Of those, the ones with requires_grad: only they have gradients and "
        "optimizer state. None: not counted.",
    )
    blocks: list[BlockInfo] = Field(default_factory=list)
    steps: dict[str, StepProfile] = Field(description="Keyed by precision; 'fp32' always.")
    layers: list[LayerRow] = Field(default_factory=list)
    fixed_overhead_bytes: int = Field(
        0,
        ge=0,
        description="Memory outside tracked tensors "
        "(cuBLAS workspaces, rounding): measured on CUDA.",
    )
    fragmentation_ratio: float | None = Field(
        None, description="CUDA: peak reserved / peak allocated over the step."
    )
    profiling_ms: float = Field(0.0, description="Wall time of the profiling pass itself.")
    flops: StepFlops | None = Field(
        None,
        description="Fake tensors: the step's matmul FLOPs, counted in the warm-up step where "
        "no time can be measured; None elsewhere.",
    )
    tokens_per_sample: int | None = Field(
        None,
        description="Token ids per sample when the batch's first tensor is integer ids of "
        "shape (batch, tokens), as a language model takes them: the report's tokens/s and "
        "MFU read it; None for other inputs.",
    )
    call_form: CallForm | None = Field(
        None,
        description="How the step calls the model and finds the loss, for advice written in "
        "the user's own form; None: not recorded.",
    )
    host_bandwidth_bytes_per_ms: float | None = Field(
        None,
        description="CUDA: measured pinned host<->device copy bandwidth (the slower "
        "direction), which prices activation offload; None when not measured.",
    )

    @property
    def static_bytes(self) -> int:
        """Weights, gradients, optimizer state and buffers: what no batch size changes."""
        return self.param_bytes + self.grad_bytes + self.optimizer_state_bytes + self.buffer_bytes


class StepTimeModel(BaseModel):
    """Times from FLOPs and bytes at nominal rates: a stated model, not a measurement.

    The default is an H100 SXM's dense datasheet peaks at half utilisation: fp32 matmuls
    without TF32 (torch's default for ``matmul``) at 67 TFLOP/s, bf16 and fp16 on tensor
    cores at 989, HBM at 3.35 TB/s. Only the ratios rank configurations: bf16 matmuls about
    15x fp32's, and what recompute adds against what a larger batch saves of the optimizer
    step.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = "H100 SXM datasheet peaks at 50% utilisation"
    matmul_tflops: dict[str, float] = Field(
        default_factory=lambda: {"fp32": 33.5, "bf16": 494.5, "fp16": 494.5},
        description="Matmul TFLOP/s by dtype name; a dtype not named runs at fp32's.",
    )
    memory_tb_per_s: float = Field(1.675, gt=0, description="Bytes moved by the optimizer step.")

    def matmul_ms(self, flops_by_dtype: dict[str, float], autocast: str = "fp32") -> float:
        """Milliseconds for these FLOPs; under a low-precision ``autocast`` all run at its rate."""
        if autocast in AUTOCAST_DTYPES:
            flops_by_dtype = {autocast: sum(flops_by_dtype.values())}
        fp32 = self.matmul_tflops["fp32"]
        # TFLOP/s = 1e9 FLOP/ms
        return sum(f / (self.matmul_tflops.get(d, fp32) * 1e9) for d, f in flops_by_dtype.items())

    def memory_ms(self, nbytes: float) -> float:
        return nbytes / (self.memory_tb_per_s * 1e9)  # TB/s = 1e9 B/ms

    def describe(self) -> str:
        rates = ", ".join(f"{p} {r:g}" for p, r in self.matmul_tflops.items())
        return f"{self.name}: matmuls at {rates} TFLOP/s, memory at {self.memory_tb_per_s:g} TB/s"
