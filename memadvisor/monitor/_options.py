"""The Monitor's options, checked before anything is hooked or read.

Known limitations:
    * Only ranges are checked; whether a period suits the loop (a print every iteration of a
      millisecond step) is the user's call.
"""

from __future__ import annotations

from torch import nn

from memadvisor.errors import BadInputError

__all__ = ["check_options"]


def check_options(
    model: object,
    print_period: int,
    layer_period: int | None,
    counter_period: int | None,
    layer_budget: float,
    counter_budget: float,
    leak_window: int,
    history: int,
) -> None:
    """Raise BadInputError naming the first option out of range (see :class:`Monitor`)."""
    if not isinstance(model, nn.Module):
        raise BadInputError(f"model must be a torch.nn.Module, but got {type(model)=}.")
    if print_period < 0:
        raise BadInputError(f"print_period must be >= 0 (0: never), but got {print_period=}.")
    if layer_period is not None and layer_period < 0:
        raise BadInputError(f"layer_period must be >= 0 (0: never), but got {layer_period=}.")
    if counter_period is not None and counter_period < 1:
        raise BadInputError(
            f"counter_period must be >= 1 (None: chosen from the cost of a reading), but "
            f"got {counter_period=}."
        )
    for name, budget in (("layer_budget", layer_budget), ("counter_budget", counter_budget)):
        if not 0 < budget <= 1:
            raise BadInputError(
                f"{name} must be a share of the loop's time in (0, 1], but got {budget=}."
            )
    if leak_window < 2:
        raise BadInputError(f"leak_window must be at least 2, but got {leak_window=}.")
    if history < 1:
        raise BadInputError(f"history must keep at least 1 iteration, but got {history=}.")
