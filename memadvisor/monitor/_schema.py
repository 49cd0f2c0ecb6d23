"""What the monitor reports: per-layer memory, one row per iteration, and the leak check."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["IterationRecord", "LayerMemory", "LeakReport", "LeakSuspect"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LayerMemory(_Model):
    """One module's memory in one measured iteration; own numbers, children not included."""

    module: str = Field(description="Qualified module name; '' is the model itself.")
    type_name: str = Field(description="The module's class name.")
    weight_bytes: int = Field(
        0, ge=0, description="Its own parameters (a shared one counts to its first owner)."
    )
    grad_bytes: int = Field(0, ge=0, description="Gradients of those parameters.")
    saved_tensors: int = Field(
        0, ge=0, description="Non-parameter tensors its ops saved for backward (feature maps)."
    )
    saved_bytes: int = Field(
        0,
        ge=0,
        description="Bytes of the storages it saved first: a storage saved by several modules "
        "(a ReLU's output, also the next Linear's input) counts once, to the first.",
    )
    intermediate_bytes: int = Field(
        0,
        ge=0,
        description="Other intermediates: the highest rise in forward above what the module "
        "leaves behind (temporaries freed before it returns), children included.",
    )
    forward_ms: float | None = Field(None, description="Wall time of its forward calls.")
    backward_ms: float | None = Field(
        None, description="Wall time of its backward; None where it has no backward exit."
    )
    forward_peak_bytes: int | None = Field(
        None, description="Highest allocated bytes (whole process) while its forward ran."
    )
    allocations: int | None = Field(
        None, description="Allocations during its forward, where the device counts them."
    )


class IterationRecord(_Model):
    """One reading of the counters at ``record()``: the iteration it was made in, and the
    iterations since the previous reading (``iterations``; 1 where every iteration is read)."""

    iteration: int = Field(ge=1, description="1-based, counted across epochs.")
    epoch: int = Field(ge=0)
    iterations: int = Field(
        1,
        ge=1,
        description="Iterations this record covers: those since the previous reading, this "
        "one included (more than 1 where counters are read every few iterations, see "
        "Monitor's counter_period; an epoch summary's: the epoch's).",
    )
    iteration_ms: float | None = Field(
        None,
        description="Mean wall time of those iterations, the monitor's own time left out "
        "(None for the first record()).",
    )
    allocated_bytes: int = Field(ge=0, description="Held by tensors at record().")
    peak_allocated_bytes: int = Field(
        ge=0, description="Highest during the iterations this record covers."
    )
    reserved_bytes: int | None = Field(None, description="CUDA only: the allocator's reserve.")
    peak_reserved_bytes: int | None = Field(
        None, description="CUDA only: the reserve's highest over the same iterations."
    )
    weight_bytes: int | None = Field(None, description="All parameters (latest layer pass).")
    grad_bytes: int | None = Field(None, description="All gradients (latest layer pass).")
    saved_activation_bytes: int | None = Field(
        None, description="Saved for backward by the model's forward (latest layer pass)."
    )
    optimizer_state_bytes: int | None = Field(
        None, description="The optimizer's state, when the monitor was given the optimizer."
    )
    other_bytes: int | None = Field(
        None,
        description="Peak allocated minus weights, gradients, optimizer state and saved "
        "activations (not below 0): inputs, outputs, the loss, temporaries.",
    )
    layers_measured: bool = Field(
        False, description="Per-layer numbers were measured in this iteration."
    )

    @property
    def fragmentation(self) -> float | None:
        """Share of the reserve not held by tensors at record(): ``1 - allocated/reserved``."""
        if not self.reserved_bytes:
            return None
        return max(0.0, 1.0 - self.allocated_bytes / self.reserved_bytes)


class LeakSuspect(_Model):
    """A module whose tensors from an earlier iteration are still alive."""

    module: str
    surviving_bytes: int = Field(ge=0)
    tensors: int = Field(ge=0, description="Surviving storages (outputs or saved tensors).")


class LeakReport(_Model):
    """Whether allocated memory keeps growing across iterations, and where."""

    flagged: bool
    iterations: int = Field(ge=0, description="Consecutive iterations that ended higher.")
    growth_bytes: int = Field(description="Growth over those iterations.")
    suspects: list[LeakSuspect] = Field(
        default_factory=list,
        description="Modules that made tensors in a measured iteration which are still alive "
        "two records later, largest first.",
    )
    message: str = ""
