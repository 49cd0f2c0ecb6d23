"""Where the profile runs, what that device supports, and how its memory is read."""

from __future__ import annotations

import warnings
from typing import Literal

import torch
from torch import nn

from memadvisor._torch_private import fake_mode_active, is_fake
from memadvisor.errors import BadInputError
from memadvisor.schema.device import CPU, CUDA_CARD, FAKE_TENSORS, DeviceCapabilities
from memadvisor.schema.precision import AUTOCAST_DTYPES
from memadvisor.schema.profile import DeviceInfo

__all__ = ["DeviceChoice", "Target", "resolve_target"]

DeviceChoice = Literal["auto", "cpu", "cuda"]


class Target:
    """The device a profile runs on: a ``torch.device`` and whether its tensors are fake."""

    def __init__(self, device: torch.device, fake: bool) -> None:
        self.device = device
        self.fake = fake

    @property
    def kind(self) -> Literal["cuda", "cpu", "fake"]:
        if self.fake:
            return "fake"
        return "cuda" if self.device.type == "cuda" else "cpu"

    @property
    def is_cuda(self) -> bool:
        """A real card: its allocator's counters and CUDA events are read."""
        return not self.fake and self.device.type == "cuda"

    def supports(self, precision: str) -> bool:
        """Whether autocast on this device runs ``precision`` ('fp32' always)."""
        if precision == "fp32":
            return True
        dtype = AUTOCAST_DTYPES.get(precision)
        if dtype is None:
            return False
        if self.is_cuda:
            if dtype is torch.bfloat16:
                return torch.cuda.is_bf16_supported()
            return True
        if self.fake:
            # Fake tensors plan for a device that may not be here: autocast's own support
            # for the device type is all that can be said.
            return torch.amp.is_autocast_available(self.device.type)
        return _cpu_autocast_runs(dtype)

    def capabilities(self) -> DeviceCapabilities:
        """What this target can do: a card's, fake tensors planned for a card, or the CPU's;
        autocast in the low precisions it runs."""
        dtypes = tuple(p for p in ("bf16", "fp16") if self.supports(p))
        if self.is_cuda:
            caps = CUDA_CARD
            total = int(torch.cuda.get_device_properties(self.device).total_memory)
            caps = caps.model_copy(update={"total_bytes": total})
        else:
            caps = FAKE_TENSORS if self.fake else CPU
        autocast = caps.autocast.model_copy(update={"dtypes": dtypes})
        return caps.model_copy(update={"autocast": autocast})

    def info(self) -> DeviceInfo:
        caps = self.capabilities()
        if self.is_cuda:
            name = torch.cuda.get_device_properties(self.device).name
        else:
            name = f"fake {self.device.type}" if self.fake else "cpu"
        return DeviceInfo(
            kind=self.kind,
            name=name,
            total_bytes=caps.total_bytes,
            bf16_supported=caps.offers_autocast("bf16"),
            fp16_supported=caps.offers_autocast("fp16"),
            tf32_supported=self.is_cuda and torch.cuda.get_device_capability(self.device) >= (8, 0),
            torch_version=torch.__version__,
            capabilities=caps,
        )


def _cpu_autocast_runs(dtype: torch.dtype) -> bool:
    # CPU autocast silently disables itself (with a warning) for a dtype it does not support:
    # run one tiny matmul and look at the result's dtype.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            with torch.autocast("cpu", dtype=dtype):
                out = torch.ones(2, 2) @ torch.ones(2, 2)
        except (RuntimeError, ValueError):
            return False
    return out.dtype == dtype


def _refuse_meta(model: nn.Module) -> None:
    """A model on the meta device has shapes but no values: it cannot run on real tensors.

    Raises:
        BadInputError: a parameter or buffer of ``model`` is on the meta device.
    """
    named = [*model.named_parameters(), *model.named_buffers()]
    meta = [name for name, t in named if t.is_meta]
    if not meta:
        return
    raise BadInputError(
        f"The model ({type(model).__name__}) has {len(meta)} of its {len(named)} parameters "
        f"and buffers on the meta device (the first: {meta[0]!r}): they have shapes but no "
        "values, so it cannot train on a simulated or CUDA device. Plan it with "
        "device='estimate' (--device estimate), which needs only the shapes, or materialize "
        "it first: model.to_empty(device='cpu'), then load or initialize its weights."
    )


def resolve_target(model: nn.Module, device: str) -> Target:
    """The device to profile on.

    ``"auto"``: under ``FakeTensorMode`` (or with fake parameters) the parameters' device,
    fake; else CUDA when it is available (a model on the CPU is copied to the card, as its
    training would run there), else the CPU.

    Raises:
        BadInputError: ``device`` is not auto/cpu/cuda, ``"cuda"`` without a CUDA device, or
            real tensors are asked of a model on the meta device.
    """
    if device not in ("auto", "cpu", "cuda"):
        raise BadInputError(f"device must be 'auto', 'cpu' or 'cuda', but got {device=}.")
    first = next(iter(model.parameters()), None)
    fake = fake_mode_active() or (first is not None and is_fake(first))
    if fake:
        if device == "auto":
            return Target(first.device if first is not None else torch.device("cpu"), True)
        return Target(torch.device(device), True)
    _refuse_meta(model)
    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise BadInputError(
                "device='cuda' was asked for, but this torch sees no CUDA device: pass "
                "device='cpu' (tensor bytes are tracked at allocation there)."
            )
        on_card = first is not None and first.device.type == "cuda"
        return Target(first.device if on_card else torch.device("cuda"), False)
    return Target(torch.device("cpu"), False)
