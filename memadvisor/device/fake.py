"""Fake tensors: profile and probe a model far larger than this machine, using no memory.

Under ``FakeTensorMode`` every tensor has a shape, a dtype and a storage size but no data, and
every op computes only the shapes of its outputs. The :class:`~memadvisor.memory.MemoryMeter`
counts fake storages exactly as real ones, so a 7B model's training step can be
metered on a laptop: its weights alone would need 27 GB, its AdamW state 54 GB more.

    workload = fake_workload(lambda: build(preset="7b"))       # examples/llama.py
    profile = profile_fake(workload)                           # the profiler, in the mode
    FakeDevice(budget_bytes=80 * GIB).run(workload, candidate, steps=2)

A :class:`FakeWorkload` keeps the ``FakeTensorMode`` its tensors belong to: everything that
touches them (the profiler, the device) runs inside that mode (:meth:`FakeWorkload.fake`).

Planning for CUDA from here: fake tensors are CPU tensors (fake CUDA tensors cannot run
backward without a card), so the CPU's defaults would apply where a card's differ. Two
are fixed here: autocast follows CUDA's policy (:mod:`memadvisor.device._autocast`,
entered by :meth:`FakeWorkload.fake`), and when the workload brings no optimizer, AdamW is
made with ``foreach=True`` as it defaults on CUDA (its temporaries take one copy of all
parameters during the step; the CPU's per-tensor loop takes two of the largest only).

Known limitations:
    * Times mean nothing: fake ops cost microseconds each whatever their size.
    * Ops without a fake (meta) kernel raise; custom CUDA kernels need ``register_fake``.
    * Data-dependent control flow (``if loss > 0``, ``.item()``, ``nonzero``) cannot run.
    * A user-given optimizer keeps its CPU defaults (pass ``foreach=True`` to match a card).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from memadvisor._torch_private import (
    fake_copy,
    fake_module_conversion,
    fake_tensor_mode,
    is_fake,
)
from memadvisor.device._autocast import cuda_autocast_policy
from memadvisor.device.simulated import SimulatedDevice, tensor_leaves
from memadvisor.errors import BadInputError
from memadvisor.schema.device import FAKE_TENSORS
from memadvisor.target import load_factory, workload_from_result
from memadvisor.workload import Workload

if TYPE_CHECKING:
    from memadvisor.schema.profile import Profile

__all__ = [
    "CUDA_FIXED_BYTES",
    "load_fake_target",
    "FakeDevice",
    "FakeWorkload",
    "fake_workload",
    "profile_fake",
]

PlanFor = Literal["cuda", "cpu"]

MIB = 2**20
# What a card holds beyond tensor bytes (docs/design.md, "What a card holds beyond tensors"):
# two 32 MiB cuBLAS workspaces (the main thread's and autograd's), 1 MiB of cuBLASLt's, and
# the allocator's rounding, the middle of its measured range.
CUDA_FIXED_BYTES = 2 * 32 * MIB + 1 * MIB + 8 * MIB


def _foreach_adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    # Workload's default (AdamW, lr 1e-3) with the foreach implementation CUDA picks itself.
    return torch.optim.AdamW(params, lr=1e-3, foreach=True)


@dataclass
class FakeWorkload(Workload):
    """A workload whose model and batch are fake tensors of ``fake_mode``.

    Build one with :func:`fake_workload`. Anything that runs it must do so inside
    :meth:`fake`.
    """

    fake_mode: Any = None
    plan_for: PlanFor = "cuda"

    @contextlib.contextmanager
    def fake(self) -> Iterator[None]:
        """Enter this workload's fake mode (and CUDA's autocast policy when planning CUDA);
        ``Module.to`` converts fake parameters in it (:func:`fake_module_conversion`)."""
        policy = cuda_autocast_policy() if self.plan_for == "cuda" else contextlib.nullcontext()
        with self.fake_mode, fake_module_conversion(), policy:
            yield

    def fresh_model(self) -> nn.Module:
        """A copy of the model on fresh fake storages of the same mode (ties kept)."""
        model = fake_copy(self.model, self.fake_mode)
        for p in model.parameters():
            p.grad = None
        return model

    @property
    def param_bytes(self) -> int:
        """The bytes the model's parameters would take on a card."""
        return sum(p.untyped_storage().nbytes() for p in _unique(self.model.parameters()))


def _unique(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for t in tensors:
        seen.setdefault(id(t), t)
    return list(seen.values())


def fake_workload(
    source: Callable[[], Any] | Workload, *, plan_for: PlanFor = "cuda"
) -> FakeWorkload:
    """A workload of fake tensors, from a factory or from a (small, real) workload.

    Args:
        source: a zero-argument factory returning what a target factory returns
            (``(model, batch)`` or a dict with ``model``, ``sample_batch``, ``loss_fn``...),
            called inside a new ``FakeTensorMode`` so that even a 7B model costs no memory;
            or a real :class:`Workload`, whose model and batch are copied to fake tensors.
        plan_for: ``"cuda"`` (default) plans a card's step: CUDA's autocast policy, and a
            foreach AdamW when the workload brings no optimizer. ``"cpu"`` keeps the CPU's.

    Raises:
        BadInputError: the factory's result is not a workload, or ``plan_for`` is unknown.
    """
    if plan_for not in ("cuda", "cpu"):
        raise BadInputError(f"plan_for is 'cuda' or 'cpu', but got {plan_for=}.")
    mode = fake_tensor_mode()
    if isinstance(source, Workload):
        real = source
        if any(t.is_meta for t in tensor_leaves(real.sample_batch)):
            raise BadInputError(
                "The sample batch is on the meta device; give a real one (a batch of token "
                "ids costs little) or make_batch(b): only the model may be built on meta."
            )
        model = _fake_cpu(fake_copy(real.model, mode), mode)
        sample_batch = fake_copy(real.sample_batch, mode)
    else:
        # A factory may cast its model (model.to(torch.bfloat16), a LoRA base).
        with mode, fake_module_conversion():
            built = source()
        # Outside the mode: the workload copies a sliced batch (its fake tensors copy in
        # their own mode), and a tensor the factory made for real is refused below, by name.
        real = workload_from_result(built, origin="the fake workload's factory")
        model, sample_batch = _fake_cpu(real.model, mode), real.sample_batch
    if not all(is_fake(t) for t in [*model.parameters(), *tensor_leaves(sample_batch)]):
        raise BadInputError(
            "The factory made some tensors outside the fake mode (e.g. a model built once and "
            "cached at import time); build the model and the batch inside the factory."
        )
    optimizer = real.optimizer_factory
    if optimizer is None and plan_for == "cuda":
        optimizer = _foreach_adamw
    fields = {f.name: getattr(real, f.name) for f in dataclasses.fields(Workload) if f.init}
    fields.update(model=model, sample_batch=sample_batch, optimizer_factory=optimizer)
    return FakeWorkload(**fields, fake_mode=mode, plan_for=plan_for)


def _fake_cpu(model: nn.Module, mode: Any) -> nn.Module:
    """``model`` (a fake copy) with parameters and buffers on the meta device made fake CPU
    tensors of ``mode``: a model built under ``torch.device("meta")`` costs no memory
    either, but its tensors cannot meet the batch's device. Shared tensors stay shared;
    ``requires_grad`` is kept. Values are lost, which fake tensors never read."""
    made: dict[int, torch.Tensor] = {}

    def on_cpu(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            with mode:
                data = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            if isinstance(t, nn.Parameter):
                data = nn.Parameter(data, requires_grad=t.requires_grad)
            made[id(t)] = data
        return made[id(t)]

    for module in model.modules():
        for slots in (module._parameters, module._buffers):
            for name, t in list(slots.items()):
                if t is not None and t.is_meta:
                    slots[name] = on_cpu(t)
    return model


def profile_fake(workload: FakeWorkload, **kwargs: Any) -> Profile:
    """The profiler's pass over a fake workload, run inside its fake mode.

    ``kwargs`` go to :func:`memadvisor.profiler.profile_workload`. Planned for CUDA, the
    profile's ``fixed_overhead_bytes`` is what a card holds beyond tensors
    (:data:`CUDA_FIXED_BYTES`), which the estimate adds to every peak, and each step's
    ``largest_allocation`` (what a memory cap strands beyond the allocated peak: the
    estimate's ``reserved_peak_bytes``) is the one the metered steps saw.

    Raises:
        BadInputError: ``workload`` is not a :class:`FakeWorkload`.
    """
    if not isinstance(workload, FakeWorkload):
        raise BadInputError(
            f"profile_fake needs a FakeWorkload (see fake_workload), but got "
            f"{type(workload).__name__}."
        )
    from memadvisor.profiler import profile_workload  # the profiler imports the device layer

    kwargs.setdefault("device", "cpu")
    with workload.fake():
        profile = profile_workload(workload, **kwargs)
    # Fake tensors are on the CPU; the plan is for the device they stand in for.
    caps = profile.device.capabilities.model_copy(update={"trains_on": workload.plan_for})
    profile = profile.model_copy(
        update={"device": profile.device.model_copy(update={"capabilities": caps})}
    )
    if workload.plan_for == "cuda":
        profile = profile.model_copy(update={"fixed_overhead_bytes": CUDA_FIXED_BYTES})
    else:  # no memory cap strands the largest allocation on the CPU
        steps = {
            p: s.model_copy(update={"largest_allocation": None}) for p, s in profile.steps.items()
        }
        profile = profile.model_copy(update={"steps": steps})
    return profile


class FakeDevice(SimulatedDevice):
    """A simulated card of any size for fake workloads: the budget enforced, no memory used.

    Peaks are exact tensor bytes, as on :class:`SimulatedDevice`; step times are not
    meaningful (see the module's limitations).
    """

    capabilities = FAKE_TENSORS

    def __init__(self, budget_bytes: int, **kwargs: Any) -> None:
        kwargs.setdefault("name", "simulated card (fake tensors)")
        super().__init__(budget_bytes, **kwargs)

    def _context(self, workload: Workload) -> contextlib.AbstractContextManager:
        if not isinstance(workload, FakeWorkload):
            raise BadInputError(
                f"FakeDevice runs FakeWorkloads (see fake_workload), but got "
                f"{type(workload).__name__}; use SimulatedDevice for real tensors."
            )
        stack = contextlib.ExitStack()
        stack.enter_context(workload.fake_mode)
        stack.enter_context(fake_module_conversion())  # a strategy may cast the model
        return stack

    def _fresh_model(self, workload: Workload) -> nn.Module:
        return workload.fresh_model()  # a FakeWorkload: _context, which runs first, checked


def load_fake_target(target: str) -> FakeWorkload:
    """Import ``target`` and call its factory inside a fresh ``FakeTensorMode``: every tensor
    it makes is fake, so a model of any size costs no memory. Planned for a CUDA card.

    Raises:
        BadInputError: as :func:`load_target`, or the factory made tensors outside the fake
            mode (a model cached at import time).
    """
    factory = load_factory(target)

    def build() -> Any:
        try:
            return factory()
        except BadInputError:
            raise
        except ImportError as e:
            raise BadInputError(f"{target} raised {type(e).__name__}: {e}") from e
        except Exception as e:
            raise BadInputError(
                f"{target} raised {type(e).__name__} under fake tensors: {e}. Build the model "
                "and batch inside the factory, with no op that reads tensor values (.item(), "
                "data-dependent shapes)."
            ) from e

    return fake_workload(build)
