"""How the user's step calls the model and finds the loss, as the profile records it."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["CallForm"]


class CallForm(BaseModel):
    """How the user's step calls the model and finds the loss: the advice's code is written
    in this form (``model(**batch).loss`` for a HF model), not a generic one."""

    model_config = ConfigDict(extra="forbid")

    batch: Literal["tensor", "sequence", "mapping", "custom"] = Field(
        description="tensor: model(batch); sequence: model(batch[0]) (inputs, targets); "
        "mapping: model(**batch); custom: forward_fn(model, batch)."
    )
    loss: Literal["loss_fn", "output.loss", "output['loss']", "output"] = Field(
        description="Where the loss comes from: loss_fn(output, batch), the output's own "
        "loss (HF models), or the output itself (a scalar)."
    )
