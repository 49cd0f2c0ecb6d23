"""What a device can do, said once: :class:`DeviceCapabilities`; and the names users pass.

Every stage asks a device's capabilities (does it time steps that rank? measure memory or
estimate it? compile? autocast in bf16?) instead of comparing its kind: a third party's
device of a kind this package never heard of plans as a built-in one does, and a new kind
of card is one object here, not a comparison in twenty files.

This is the one module that reads device *names* (``tests/test_device_kinds.py`` keeps it
so): the names a user passes (``device="cpu"``, ``--device estimate``: :data:`DEVICE_NAMES`),
and the kinds of plans and profiles written before capabilities were (their files hold a
kind and no capabilities: :func:`capabilities_of_kind`). Everything else reads fields.

The OOM matcher is not here: it is code (``Device.is_oom``), asked of the device object.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from memadvisor.errors import BadInputError

__all__ = [
    "CPU",
    "CUDA_CARD",
    "DEVICE_NAMES",
    "ESTIMATE",
    "FAKE_TENSORS",
    "SIMULATED",
    "AutocastPolicy",
    "DeviceCapabilities",
    "DeviceKind",
    "LowPrecision",
    "capabilities_of_kind",
    "card_capabilities",
    "device_kind",
    "named_capabilities",
    "profiler_device",
    "resolved_kind",
    "runs_nothing",
]

LowPrecision = Literal["bf16", "fp16"]
MemoryReading = Literal["allocator", "tensors", "estimated"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class AutocastPolicy(_Model):
    """How the device's steps run under autocast, and in which low precisions."""

    device_type: str = Field(
        description="torch.autocast's device_type for the device's tensors ('cuda', 'cpu')."
    )
    dtypes: tuple[LowPrecision, ...] = Field(
        (), description="The low precisions it offers autocast in; empty: none (fp32 only)."
    )
    cuda_cast_lists: bool = Field(
        False,
        description="CPU tensors cast by CUDA autocast's op lists (a card simulated on the "
        "CPU): its runs, and the profile the estimate reads, cast as a card would.",
    )


class DeviceCapabilities(_Model):
    """A device described by what it can do; the planner, the strategies and the report read
    these fields, never the kind.

    Only ``kind`` and ``tensor_device`` are required: the rest default to a device that runs
    real tensors in the planner's stead, meters their bytes, and offers nothing else (no
    ranking times, no autocast, no compile), which a third party widens field by field.
    """

    kind: str = Field(
        description="What reports call the device ('cuda', 'simulated', 'npu'): for display "
        "only, never compared."
    )
    tensor_device: str = Field(
        description="The torch device type its runs put tensors on ('cuda', 'cpu'; 'meta' "
        "where nothing runs). The planner profiles there."
    )
    trains_on: str = Field(
        "",
        description="The torch device type a person trains the plan on (the adoption loop's "
        "model.to, GradScaler's device): tensor_device unless it stands in for another "
        "(fake tensors planned for a card). Empty: tensor_device.",
    )
    fake_tensors: bool = Field(
        False, description="Its tensors hold no values (FakeTensorMode): no numerics to check."
    )
    memory: MemoryReading = Field(
        "tensors",
        description="How a run's peak is had: read from a caching allocator (reserved bytes, "
        "fixed costs included), metered as live tensor bytes, or estimated (nothing runs).",
    )
    step_times_rank: bool = Field(
        False,
        description="Its step times can rank candidates (a card's do; a CPU meter's are "
        "slowed by tracking): else the estimate's times rank the batches it confirmed.",
    )
    steady_memory: bool = Field(
        False,
        description="A run's memory repeats exactly from its second step on (no allocator "
        "cache, no fragmentation): the pick is verified over the probe's steps.",
    )
    runs_cost_more_than_steps: bool = Field(
        False,
        description="A run's fixed cost (a process, a context, kernel loading) dwarfs its "
        "steps: every probe takes the verification's steps, and no extra rows are measured.",
    )
    fresh_processes: bool = Field(
        True,
        description="Every run starts in a process of its own (False: runs share the "
        "planner's, where a compiled variant cannot be measured).",
    )
    can_compile: bool = Field(
        False,
        description="torch.compile runs there and its runs time a compiled step: compiling "
        "is weighed by default.",
    )
    pinned_memory: bool = Field(
        False,
        description="Copies to and from pinned host memory overlap its compute (activation "
        "offload, a DataLoader's pin_memory).",
    )
    autocast: AutocastPolicy = Field(
        None,  # type: ignore[assignment]  # made below from tensor_device
        description="Its autocast. Default: on tensor_device, in no low precision.",
    )
    concurrent_runs: int = Field(
        1,
        ge=1,
        description="Runs it makes at once through Device.run_many: their starts and "
        "compiles overlap, their timed steps are taken in turn. 1: one at a time.",
    )
    retries_in_process: bool = Field(
        False,
        description="Device.run_many_retrying measures a run's retry at a smaller batch in "
        "the run's own process (no second start, no second compile): the compile search "
        "asks for it in its first pass and does not count it as a run.",
    )
    total_bytes: int | None = Field(None, ge=0, description="A card's memory; None: not a card.")
    free_bytes: int | None = Field(
        None, ge=0, description="A card's free bytes when these were read; None: not a card."
    )

    @model_validator(mode="after")
    def _defaults_from_tensor_device(self) -> DeviceCapabilities:
        # After validation (a "before" one would make a JSON plan's arrays lists, which a
        # strict read refuses as tuples); frozen, so set once here.
        if not self.trains_on:
            object.__setattr__(self, "trains_on", self.tensor_device)
        if self.autocast is None:
            object.__setattr__(self, "autocast", AutocastPolicy(device_type=self.tensor_device))
        return self

    @property
    def measures_memory(self) -> bool:
        """Whether its runs measure a peak (False: every figure is estimated)."""
        return self.memory != "estimated"

    def offers_autocast(self, precision: str) -> bool:
        """Whether autocast in ``precision`` ('bf16', 'fp16') runs there."""
        return precision in self.autocast.dtypes


_BOTH: tuple[LowPrecision, ...] = ("bf16", "fp16")

#: A CUDA card, without its bytes (:func:`card_capabilities` reads those, and bf16).
CUDA_CARD = DeviceCapabilities(
    kind="cuda",
    tensor_device="cuda",
    memory="allocator",
    step_times_rank=True,
    runs_cost_more_than_steps=True,
    can_compile=True,
    pinned_memory=True,
    autocast=AutocastPolicy(device_type="cuda", dtypes=_BOTH),
)
#: The CPU simulated card: CPU tensors metered under the budget, cast by CUDA's lists.
SIMULATED = DeviceCapabilities(
    kind="simulated",
    tensor_device="cpu",
    steady_memory=True,  # tensor bytes, no allocator: step 2 on repeats step 2
    autocast=AutocastPolicy(device_type="cpu", dtypes=_BOTH, cuda_cast_lists=True),
)
#: Fake tensors metered as the simulated card meters real ones, planned for a CUDA card.
FAKE_TENSORS = SIMULATED.model_copy(
    update={"kind": "fake", "trains_on": "cuda", "fake_tensors": True}
)
#: No device: the model as fake tensors, every figure the estimate's, planned for a card.
ESTIMATE = FAKE_TENSORS.model_copy(
    update={"kind": "estimate", "tensor_device": "meta", "memory": "estimated"}
)
#: The CPU a profile measured on, its tensor bytes tracked (``profile(device='cpu')``).
CPU = DeviceCapabilities(
    kind="cpu",
    tensor_device="cpu",
    steady_memory=True,
    autocast=AutocastPolicy(device_type="cpu", dtypes=_BOTH),
)


def card_capabilities(index: int | None = None) -> DeviceCapabilities:
    """:data:`CUDA_CARD` for the card ``index`` (default the current one): its total and free
    bytes, and bf16 where the card runs it."""
    index = torch.cuda.current_device() if index is None else index
    total = int(torch.cuda.get_device_properties(index).total_memory)
    free = int(torch.cuda.mem_get_info(index)[0])
    dtypes: tuple[LowPrecision, ...] = _BOTH if torch.cuda.is_bf16_supported() else ("fp16",)
    autocast = AutocastPolicy(device_type="cuda", dtypes=dtypes)
    return CUDA_CARD.model_copy(
        update={"total_bytes": total, "free_bytes": free, "autocast": autocast}
    )


# -- names: what users pass, and what old files hold -------------------------------------------

DeviceKind = Literal["auto", "cuda", "simulated", "estimate"]

# One device vocabulary for plan(), profile() and the CLI's --device: each name a user may
# pass, and the kind it means. "cpu" and "simulated" are one device: real CPU tensors whose
# bytes are tracked as they are allocated (against the budget, when planning).
DEVICE_NAMES: dict[str, DeviceKind] = {
    "auto": "auto",
    "cuda": "cuda",
    "gpu": "cuda",
    "cpu": "simulated",
    "simulated": "simulated",
    "estimate": "estimate",
}


def device_kind(asked: object, said: str = "device") -> DeviceKind:
    """The device kind a user's name means (:data:`DEVICE_NAMES`; case does not matter).

    Args:
        asked: the name as given.
        said: how the caller spells the option in messages (the CLI: ``--device``).

    Raises:
        BadInputError: not one of the names.
    """
    kind = DEVICE_NAMES.get(asked.lower()) if isinstance(asked, str) else None
    if kind is None:
        raise BadInputError(
            f"{said} must be auto, cuda (or gpu), cpu (or simulated: CPU tensors whose bytes "
            f"are tracked), or estimate (fake tensors, no device), but got {asked!r}."
        )
    return kind


def resolved_kind(kind: DeviceKind, *, refusal: str) -> Literal["cuda", "simulated", "estimate"]:
    """``kind`` with "auto" made the card when torch sees one, else the simulated device.

    Args:
        refusal: the message when "cuda" is asked and torch sees no card (callers say what
            to pass in their own option's words).

    Raises:
        BadInputError: "cuda" without a CUDA device (``refusal``).
    """
    if kind == "auto":
        return "cuda" if torch.cuda.is_available() else "simulated"
    if kind == "cuda" and not torch.cuda.is_available():
        raise BadInputError(refusal)
    return kind


NO_CARD = (
    "device='cuda' needs a CUDA device, but torch.cuda.is_available() is False; use "
    "device='simulated' (or 'auto') to plan on the CPU."
)


def named_capabilities(kind: DeviceKind) -> DeviceCapabilities:
    """The capabilities of the device a name makes: the current card (read now), the
    simulated CPU device, or none at all (:data:`ESTIMATE`).

    Raises:
        BadInputError: "cuda" without a CUDA device.
    """
    resolved = resolved_kind(kind, refusal=NO_CARD)
    if resolved == "cuda":
        return card_capabilities()
    return SIMULATED if resolved == "simulated" else ESTIMATE


def runs_nothing(kind: DeviceKind) -> bool:
    """Whether the name plans with no device at all ("estimate": every figure estimated)."""
    return kind == "estimate"


def profiler_device(kind: DeviceKind) -> Literal["auto", "cpu", "cuda"] | None:
    """Where ``profile()`` measures for a device name: the profiler's own device choice, or
    None for "estimate" (the model as fake tensors, profiled by ``profile_fake``)."""
    if runs_nothing(kind):
        return None
    return "cpu" if kind == "simulated" else kind


# What a plan or profile written before capabilities existed means by its kind. A "fake" plan
# came from a test's device or FakeDevice, whose times the report took to rank (it read every
# kind but "simulated" and "estimate" so): the old reading is kept.
_OLD_KINDS: dict[str, DeviceCapabilities] = {
    "cuda": CUDA_CARD,
    "cpu": CPU,
    "simulated": SIMULATED,
    "fake": FAKE_TENSORS.model_copy(update={"step_times_rank": True}),
    "estimate": ESTIMATE,
}


def capabilities_of_kind(
    kind: str, *, dtypes: tuple[LowPrecision, ...] | None = None, total_bytes: int | None = None
) -> DeviceCapabilities:
    """The capabilities a built-in kind stands for, as a file without capabilities means it
    ("cuda", "cpu", "simulated", "fake", "estimate").

    Args:
        dtypes: the low precisions its autocast runs, where the file says (a profile's
            ``bf16_supported``/``fp16_supported``); else the kind's.
        total_bytes: the card's memory, where the file says.

    Raises:
        ValueError: another kind: a file of a third party's device always holds its
            capabilities.
    """
    caps = _OLD_KINDS.get(kind)
    if caps is None:
        raise ValueError(
            f"a device of kind {kind!r} must state its capabilities (built-in kinds: "
            f"{sorted(_OLD_KINDS)}), but none were given"
        )
    update: dict[str, object] = {"total_bytes": total_bytes}
    if dtypes is not None:
        update["autocast"] = caps.autocast.model_copy(update={"dtypes": dtypes})
    return caps.model_copy(update=update)
