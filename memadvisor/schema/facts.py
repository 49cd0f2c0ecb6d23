"""What a strategy's choice does to the training step, stated by the strategy once.

Layers that must not know a strategy (the devices, the integrations, other strategies) read
these facts instead of a strategy's name and choice: "the step runs under bf16 autocast",
"these blocks are recomputed", "the forward is compiled", "the ranks wrap the model in FSDP2",
"the loss is computed another way". A third party's strategy that states the same facts is
treated as the built-in one is.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Facts"]


class Facts(BaseModel):
    """The facts of one choice, or of a whole candidate (:meth:`merged`)."""

    model_config = ConfigDict(extra="forbid")

    autocast: Literal["bf16", "fp16"] | None = Field(
        default=None, description="The low precision the forward (and loss) runs under."
    )
    tf32: bool = Field(default=False, description="fp32 matmuls run as TF32 (process-wide).")
    recomputed_blocks: list[str] = Field(
        default_factory=list, description="Modules whose forward is recomputed in backward."
    )
    compiled: bool = Field(default=False, description="Some of the forward is torch.compile'd.")
    compile_mode: str | None = Field(
        default=None, description="torch.compile's mode where compiled ('default', ...)."
    )
    compiled_whole: bool = Field(
        default=False,
        description="The compile is what a framework's own switch makes (the Trainer's "
        "torch_compile): the whole model in that mode, no per-block form, no partitioner "
        "budget. False where compiled otherwise: only installing the plan's form runs what "
        "it measured.",
    )
    compiled_regional: bool = Field(
        default=False,
        description="Each repeated block is compiled on its own (one graph for all), the rest "
        "of the model eager; False where compiled whole (with or without a partitioner budget).",
    )
    parallel: Literal["ddp", "fsdp2"] | None = Field(
        default=None, description="How each rank wraps the model; None: one process."
    )
    world_size: int = Field(default=1, ge=1, description="Ranks the step runs on.")
    loss_changed: bool = Field(
        default=False,
        description="The step computes the loss another way than model(...) + the user's "
        "loss: the user trains with the step (model.memadvisor_step).",
    )

    def merged(self, other: Facts) -> Facts:
        """Both choices' facts: a set value of ``other`` wins, lists add up, flags or."""
        return Facts(
            autocast=other.autocast or self.autocast,
            tf32=self.tf32 or other.tf32,
            recomputed_blocks=[*self.recomputed_blocks, *other.recomputed_blocks],
            compiled=self.compiled or other.compiled,
            compile_mode=other.compile_mode or self.compile_mode,
            compiled_whole=other.compiled_whole or self.compiled_whole,
            compiled_regional=other.compiled_regional or self.compiled_regional,
            parallel=other.parallel or self.parallel,
            world_size=max(self.world_size, other.world_size),
            loss_changed=self.loss_changed or other.loss_changed,
        )
