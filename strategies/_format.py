"""Small formatting helpers shared by the strategies' explanations."""

from __future__ import annotations

from typing import TYPE_CHECKING

from memadvisor.schema.call import CallForm

if TYPE_CHECKING:
    from memadvisor.schema.profile import Profile

__all__ = ["how_known", "loop_header", "loss_line", "mib", "names_text"]

MIB = 2**20


def mib(nbytes: float) -> str:
    """``3.5 * 2**20`` -> ``'3.5'`` (one decimal below 100 MiB, none above)."""
    value = nbytes / MIB
    return f"{value:.1f}" if abs(value) < 100 else f"{value:.0f}"


def names_text(names: list[str], limit: int = 4) -> str:
    """``['h.0', 'h.1']`` -> ``'h.0, h.1'``; a long list is cut with a count of the rest."""
    if len(names) <= limit:
        return ", ".join(names)
    return f"{', '.join(names[:limit])} and {len(names) - limit} more"


def how_known(profile: Profile) -> str:
    """How a profile's bytes were had: ``'measured'``, or for fake tensors (nothing ran,
    shapes only) ``'metered under fake tensors'``."""
    return "metered under fake tensors" if profile.device.capabilities.fake_tensors else "measured"


def loss_line(form: CallForm | None, model: str = "model") -> str:
    """The line of a training loop that computes the loss, in the workload's own form.

    ``model(**batch).loss`` for a HF model called with a dict batch, ``loss_fn(model(inputs),
    targets)`` for an ``(inputs, targets)`` batch; that generic form too when the profile did
    not record the form.
    """
    if form is None:
        return f"loss = loss_fn({model}(inputs), targets)"
    call = {
        "tensor": f"{model}(batch)",
        "sequence": f"{model}(inputs)",
        "mapping": f"{model}(**batch)",
        "custom": f"forward_fn({model}, batch)",
    }[form.batch]
    if form.loss == "loss_fn":
        target = "targets" if form.batch == "sequence" else "batch"
        return f"loss = loss_fn({call}, {target})"
    if form.loss == "output.loss":
        return f"loss = {call}.loss"
    if form.loss == "output['loss']":
        return f'loss = {call}["loss"]'
    return f"loss = {call}  # the model returns the loss"


def loop_header(form: CallForm | None) -> str:
    """``for i, batch in enumerate(loader):``, unpacking ``(inputs, targets)`` where the
    model is called on the batch's first item."""
    if form is None or form.batch == "sequence":
        return "for i, (inputs, targets) in enumerate(loader):"
    return "for i, batch in enumerate(loader):"
