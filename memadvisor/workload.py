"""The user's inputs made uniform: a batch of any size, the loss, the optimizer, one training step.

Every stage that runs the model (profiler, probes, timing, verification) runs
:func:`train_step` on a :class:`Workload`, so they all measure the same step.

Rules (documented in README.md):
    * ``sample_batch`` is a tensor, a tuple/list, a dict or a HF ``BatchEncoding`` (any
      ``Mapping``), nested as deep as needed. Its batch size is dim 0 of its first tensor.
      A batch of size ``b`` repeats or slices the rows of every tensor whose dim 0 is that
      size; other leaves (0-d tensors, ints, strings) are passed unchanged. Where dim 0 is
      not the batch, pass ``make_batch(b)``.
    * The model is called as ``model(batch)`` for a tensor, ``model(**batch)`` for a
      mapping, and ``model(batch[0])`` for a tuple/list (the ``(inputs, targets)``
      convention); pass ``forward_fn(model, batch)`` for anything else.
    * The loss is ``loss_fn(output, batch)`` if given, else ``output.loss`` (HF models),
      else ``output`` itself when it is a scalar tensor; otherwise :class:`BadInputError`.
    * The optimizer is ``optimizer_factory(params)``, else AdamW (lr 1e-3): its two state
      tensors per parameter are what most users pay for. A user may pass an optimizer
      instead: its class and the defaults its constructor takes are reused over new
      parameters (:class:`SameOptimizer`).

:func:`build_workload` is the one place user input becomes a :class:`Workload`:
``memadvisor.plan()``, ``optimize()``, ``profile()`` and the CLI's factories (through
:mod:`memadvisor.target`, also in the probe processes) all go through it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import nn

from memadvisor.errors import BadInputError, UserCodeError, user_code_frame
from memadvisor.schema.call import CallForm

__all__ = [
    "LossFn",
    "SameOptimizer",
    "build_workload",
    "MakeBatch",
    "OptimizerFactory",
    "Phase",
    "Workload",
    "batch_size_of",
    "compact_batch",
    "resize_batch",
    "tensor_leaves",
    "train_step",
]

LossFn = Callable[[Any, Any], torch.Tensor]
OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]
MakeBatch = Callable[[int], Any]
ForwardFn = Callable[[nn.Module, Any], Any]
Phase = Literal["forward", "loss", "backward", "optimizer", "zero_grad", "end"]
PhaseCallback = Callable[[Phase], None]


def tensor_leaves(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor in a nested batch, output or optimizer state: tensors, tuples, lists,
    mappings (HF ``BatchEncoding`` and ``ModelOutput`` are mappings) and other objects with
    ``items()``. Hand-rolled because ``torch.utils._pytree`` is private."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from tensor_leaves(v)
    elif isinstance(obj, (tuple, list)):
        for v in obj:
            yield from tensor_leaves(v)
    elif hasattr(obj, "items"):
        for _, v in obj.items():
            yield from tensor_leaves(v)


def batch_size_of(batch: Any) -> int:
    """Dim 0 of the first tensor in ``batch``.

    Raises:
        BadInputError: the batch holds no tensor with at least one dimension.
    """
    for t in tensor_leaves(batch):
        if t.dim() >= 1:
            return int(t.shape[0])
    raise BadInputError(
        f"sample_batch holds no tensor with a batch dimension (got {type(batch).__name__}); "
        "pass a tensor, a tuple/list or dict of tensors, or make_batch(b)."
    )


def _owns_its_bytes(t: torch.Tensor) -> bool:
    """Whether ``t``'s storage holds no more than ``t`` itself (a view of a larger one does not)."""
    if t.device.type == "meta" or t.layout is not torch.strided:
        return True  # no storage to count, or not one storage (sparse, nested)
    return t.untyped_storage().nbytes() <= t.numel() * t.element_size()


def compact_batch(batch: Any) -> Any:
    """``batch`` with every tensor that is a view into a larger storage copied to a compact
    tensor of its own (contiguous); every other leaf, and the containers' types, unchanged.

    A batch sliced from a dataset tensor, ``(X[:16], Y[:16])``, keeps all of ``X`` alive
    through its storage: counted by storage, as memory is, it would weigh the whole dataset.
    """
    if isinstance(batch, torch.Tensor):
        if _owns_its_bytes(batch):
            return batch
        return batch.clone(memory_format=torch.contiguous_format)
    if isinstance(batch, Mapping):
        items = {k: compact_batch(v) for k, v in batch.items()}
        if all(items[k] is v for k, v in batch.items()):
            return batch  # nothing copied: keep the caller's own object
        return _rebuild_mapping(batch, items)
    if isinstance(batch, (tuple, list)):
        values = [compact_batch(v) for v in batch]
        if all(a is b for a, b in zip(values, batch, strict=True)):
            return batch
        return type(batch)(*values) if hasattr(batch, "_fields") else type(batch)(values)
    return batch


def _rebuild_mapping(original: Mapping, items: dict[str, Any]) -> Mapping:
    try:
        return type(original)(items)  # dict, OrderedDict, HF BatchEncoding(data)
    except Exception:  # noqa: BLE001 - a mapping type we can't construct: a plain dict works
        return items


def resize_batch(batch: Any, size: int, sample_size: int) -> Any:
    """``batch`` with ``size`` rows along dim 0, repeating or slicing its ``sample_size`` rows.

    Raises:
        BadInputError: a tensor has a dim 0 other than ``sample_size`` (and more than 0 dims).
    """
    if size <= 0:
        raise BadInputError(f"A batch size must be positive, but got {size=}.")
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0:
            return batch
        if batch.shape[0] != sample_size:
            raise BadInputError(
                f"sample_batch mixes batch sizes: a tensor of shape {tuple(batch.shape)} has dim 0 "
                f"{batch.shape[0]}, the batch is {sample_size}. Pass make_batch(b) when dim 0 is "
                "not the batch dimension."
            )
        if size == sample_size:
            return batch
        if size < sample_size:
            return batch[:size].clone()
        index = torch.arange(size, device=batch.device) % sample_size
        return batch.index_select(0, index)
    if isinstance(batch, Mapping):
        items = {k: resize_batch(v, size, sample_size) for k, v in batch.items()}
        return _rebuild_mapping(batch, items)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(resize_batch(v, size, sample_size) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(resize_batch(v, size, sample_size) for v in batch)
    return batch


def _move(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return _rebuild_mapping(batch, {k: _move(v, device) for k, v in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_move(v, device) for v in batch))
    if isinstance(batch, (tuple, list)):
        return type(batch)(_move(v, device) for v in batch)
    return batch


def _default_optimizer(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass
class Workload:
    """A model and what it takes to train it for one step.

    Not a pydantic model: it holds the user's live objects (module, callables) and never
    crosses a process boundary; a probe process rebuilds it from the user's factory.
    """

    model: nn.Module
    sample_batch: Any
    loss_fn: LossFn | None = None
    optimizer_factory: OptimizerFactory | None = None
    make_batch: MakeBatch | None = None
    forward_fn: ForwardFn | None = None
    sample_batch_size: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.model, nn.Module):
            raise BadInputError(
                f"model must be a torch.nn.Module, but got {type(self.model).__name__}."
            )
        for name in ("loss_fn", "make_batch", "forward_fn"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise BadInputError(
                    f"{name} must be a function {_SIGNATURES[name]} or None, but got "
                    f"{name}={value!r} ({type(value).__name__})."
                )
        self.sample_batch = compact_batch(self.sample_batch)
        if self.make_batch is not None:
            self.sample_batch_size = (
                batch_size_of(self.sample_batch) if _has_tensor(self.sample_batch) else 1
            )
        else:
            self.sample_batch_size = batch_size_of(self.sample_batch)
        if self.sample_batch_size == 0:
            raise BadInputError(
                "sample_batch has 0 rows (dim 0 of its first tensor is 0): pass a batch of at "
                "least one sample, as the model takes it."
            )
        _refuse_non_finite(self.sample_batch)

    # -- inputs -----------------------------------------------------------------------------

    def batch(self, size: int, device: torch.device | str | None = None) -> Any:
        """A batch of ``size`` samples, on ``device`` if given."""
        if self.make_batch is not None:
            if size <= 0:
                raise BadInputError(f"A batch size must be positive, but got {size=}.")
            try:
                made = self.make_batch(size)
            except Exception as e:
                error = _users_error(
                    e,
                    f"make_batch({size})",
                    f"Make it return a batch of {size} samples as the model takes it.",
                )
                if error is None:
                    raise
                raise error from e
            batch = compact_batch(made)
        else:
            batch = resize_batch(self.sample_batch, size, self.sample_batch_size)
        return batch if device is None else _move(batch, torch.device(device))

    def forward(self, model: nn.Module, batch: Any) -> Any:
        """Call ``model`` on ``batch`` by the rules in this module's docstring."""
        if self.forward_fn is not None:
            return self.forward_fn(model, batch)
        if isinstance(batch, Mapping):
            return model(**batch)
        if isinstance(batch, (tuple, list)) and not hasattr(batch, "_fields"):
            return model(batch[0])
        return model(batch)

    def loss(self, output: Any, batch: Any) -> torch.Tensor:
        """The scalar to call ``backward()`` on.

        Raises:
            BadInputError: no ``loss_fn`` and the output carries no scalar loss.
        """
        if self.loss_fn is not None:
            loss = self.loss_fn(output, batch)
        elif isinstance(getattr(output, "loss", None), torch.Tensor):
            loss = output.loss
        elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            loss = output["loss"]
        elif isinstance(output, torch.Tensor) and output.numel() == 1:
            loss = output
        else:
            raise BadInputError(
                f"Cannot find a loss in the model's output ({_describe(output)}): pass "
                "loss_fn(output, batch) returning a scalar tensor, e.g. "
                "loss_fn=lambda out, batch: F.cross_entropy(out, batch[1])."
            )
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise BadInputError(f"The loss must be a scalar tensor, but got {_describe(loss)}.")
        return loss.reshape(())

    def call_form(self, output: Any) -> CallForm:
        """How this workload calls the model and where ``loss`` finds the loss in ``output``
        (by the rules in this module's docstring)."""
        if self.forward_fn is not None:
            batch = "custom"
        elif isinstance(self.sample_batch, Mapping):
            batch = "mapping"
        elif isinstance(self.sample_batch, (tuple, list)) and not hasattr(
            self.sample_batch, "_fields"
        ):
            batch = "sequence"
        else:
            batch = "tensor"
        if self.loss_fn is not None:
            loss = "loss_fn"
        elif isinstance(getattr(output, "loss", None), torch.Tensor):
            loss = "output.loss"
        elif isinstance(output, Mapping) and isinstance(output.get("loss"), torch.Tensor):
            loss = "output['loss']"
        else:
            loss = "output"
        return CallForm(batch=batch, loss=loss)

    def make_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The user's optimizer over ``model``'s trainable parameters, or AdamW."""
        factory = self.optimizer_factory or _default_optimizer
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            raise BadInputError("The model has no trainable parameters: nothing to train.")
        try:
            return factory(params)
        except Exception as e:
            error = _users_error(
                e,
                "The optimizer factory",
                "It is called as optimizer(params) with the trainable parameters, e.g. "
                "optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3).",
            )
            if error is None:
                raise
            raise error from e

    @property
    def device(self) -> torch.device:
        """Where the model's parameters live (CPU for a parameterless model)."""
        p = next(iter(self.model.parameters()), None)
        return p.device if p is not None else torch.device("cpu")


class SameOptimizer:
    """Builds the caller's optimizer class with its defaults over new parameters.

    A module-level class rather than a lambda so that a CUDA probe process can load it
    (``torch.save`` pickles the workload). The caller's optimizer and its state are only read.
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.cls = type(optimizer)
        # ``defaults`` may hold keys the constructor does not take (torch 2.13's AdamW keeps
        # Adam's 'decoupled_weight_decay'): pass only what __init__ accepts.
        accepted = inspect.signature(self.cls.__init__).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
        self.defaults = {k: v for k, v in optimizer.defaults.items() if takes_any or k in accepted}

    def __call__(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        return self.cls(params, **self.defaults)


def _optimizer_factory(optimizer: Any) -> OptimizerFactory | None:
    if optimizer is None:
        return None
    if isinstance(optimizer, torch.optim.Optimizer):
        return SameOptimizer(optimizer)
    if callable(optimizer):
        return optimizer
    raise BadInputError(
        "optimizer must be a factory f(params) -> torch.optim.Optimizer or an optimizer "
        f"(its class and defaults are reused), but got {type(optimizer).__name__}."
    )


def build_workload(
    model: nn.Module,
    sample_batch: Any,
    *,
    loss_fn: LossFn | None = None,
    optimizer: Any = None,
    make_batch: MakeBatch | None = None,
    forward_fn: ForwardFn | None = None,
) -> Workload:
    """The :class:`Workload` of what a user passed (the module docstring's rules).

    Args:
        optimizer: a factory ``f(params)``, or an optimizer whose class and constructor
            defaults are reused (its state is never touched); None: AdamW.

    Raises:
        BadInputError: the model is not a module, the batch has no batch dimension, or the
            optimizer is neither a factory nor an optimizer.
    """
    return Workload(
        model=model,
        sample_batch=sample_batch,
        loss_fn=loss_fn,
        optimizer_factory=_optimizer_factory(optimizer),
        make_batch=make_batch,
        forward_fn=forward_fn,
    )


def _refuse_non_finite(batch: Any) -> None:
    """Refuse a sample batch that cannot train: a floating tensor holding NaN, or holding no
    finite value at all (every element +-inf).

    Such a batch makes every loss NaN; planned anyway, every probe "fits" and the plan reads
    as a success. A few infinities among finite values stay allowed: an additive attention
    mask uses -inf on purpose. Fake and meta tensors (``device='estimate'``) hold no values
    and are not read.

    Raises:
        BadInputError: names the tensor's place in the batch and what to pass instead.
    """
    from memadvisor._torch_private import is_fake

    for index, t in enumerate(tensor_leaves(batch)):
        if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
            continue
        if t.is_meta or is_fake(t):
            continue
        finite = torch.isfinite(t)
        if torch.isnan(t).any():
            what = "NaN"
        elif not finite.any():
            what = "only infinite values"
        else:
            continue
        raise BadInputError(
            f"sample_batch's tensor #{index} (shape {tuple(t.shape)}, {t.dtype}) holds {what}: "
            "every loss would be NaN and every probe would train on garbage; pass a batch of "
            "real (finite) data, as the model trains on."
        )


# What each callable a user may pass is called with (for the message that rejects another).
_SIGNATURES = {
    "loss_fn": "loss_fn(output, batch) returning a scalar tensor",
    "make_batch": "make_batch(b) returning a batch of b samples",
    "forward_fn": "forward_fn(model, batch) returning the output",
}


def _has_tensor(batch: Any) -> bool:
    return any(t.dim() >= 1 for t in tensor_leaves(batch))


def _describe(x: Any) -> str:
    """``a tensor of shape (8, 4)``, ``a tuple of tensors of shapes (8, 8), (8,)``, or the
    type's name."""
    if isinstance(x, torch.Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    shapes = [tuple(t.shape) for t in tensor_leaves(x)] if x is not None else []
    if shapes and isinstance(x, (Mapping, tuple, list)):
        listed = ", ".join(str(s) for s in shapes[:4]) + (", ..." if len(shapes) > 4 else "")
        return f"a {type(x).__name__} of tensors of shapes {listed}"
    return type(x).__name__


def train_step(
    workload: Workload,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Any,
    *,
    accumulation_steps: int = 1,
    scaler: torch.amp.GradScaler | None = None,
    on_phase: PhaseCallback | None = None,
    held: list[Any] | None = None,
) -> torch.Tensor:
    """One optimizer step: forward, loss, backward (x accumulation), step, ``zero_grad``.

    ``batch`` is one micro-batch; with ``accumulation_steps`` > 1 it is used that many times
    before the optimizer steps, as gradient accumulation would. Gradients are freed with
    ``zero_grad(set_to_none=True)`` at the end, so the next step starts without them.

    The model's output stays referenced through backward and the optimizer's step, as a
    user's loop keeps it: ``logits = model(x); loss = f(logits, y); loss.backward()`` (the
    README's loop) and ``out = model(**batch); out.loss.backward()`` (Hugging Face's) hold
    it until the name is bound again. ``held``, a one-slot list the caller's loop keeps
    across steps, models that rebinding too: the previous output is dropped only when the
    next forward has returned, so it is alive through that forward, and the last stays in
    ``held[0]``. A language model's logits are the largest tensor of its step (the GPT
    example at 8 GiB: 1.81 GiB at batch 302, where a plan that freed them before backward
    picked a batch the user's loop ran out of memory at).

    Returns:
        The last micro-batch's loss, detached (a tensor, not a float: reading its value would
        synchronise a CUDA step and is impossible under FakeTensorMode).

    Raises:
        UserCodeError: the user's code raised (the model's forward or backward, ``loss_fn``,
            the optimizer's step), whatever the exception's type: the message names the
            model, the block and the user's line that raised it
            (:func:`~memadvisor.errors.user_code_frame` decides from the traceback). What
            memadvisor's own code raised keeps its type and traceback.
        BadInputError: no loss can be found.
    """
    notify = on_phase or (lambda _phase: None)
    loss_value = torch.zeros(())
    phase: Phase = "forward"
    output: Any = None
    try:
        for _ in range(accumulation_steps):
            phase = "forward"
            notify("forward")
            output = workload.forward(model, batch)
            if held is not None:
                held[:] = [output]  # the previous output, alive through this forward, goes
            phase = "loss"
            notify("loss")
            loss = workload.loss(output, batch)
            if accumulation_steps > 1:
                loss = loss / accumulation_steps
            phase = "backward"
            notify("backward")
            (scaler.scale(loss) if scaler is not None else loss).backward()
            loss_value = loss.detach()
            del loss
        phase = "optimizer"
        notify("optimizer")
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    except Exception as e:
        error = _step_error(e, phase, workload, model, output, batch)
        if error is None:
            raise
        raise error from e
    notify("zero_grad")
    optimizer.zero_grad(set_to_none=True)
    notify("end")
    del output  # the caller's ``held`` keeps it where its loop would
    return loss_value


# The memadvisor lines that call the user's code: an error whose innermost frames are torch's
# up to one of these was raised by torch running the user's model, loss or optimizer factory.
# Not train_step's own backward() and optimizer.step(): a torch-only error there (a
# checkpoint's recompute, the autograd engine) may come from a strategy, so only a frame of
# the user's (a custom autograd Function, a hook) makes it theirs.
_CALLS_USER_CODE = frozenset(
    {
        Workload.forward.__code__,
        Workload.loss.__code__,
        Workload.batch.__code__,
        Workload.make_optimizer.__code__,
    }
)


def _users_error(
    e: BaseException,
    what: str,
    advice: str,
    *,
    model: nn.Module | None = None,
    verb: str = "raised",
) -> UserCodeError | None:
    """The :class:`UserCodeError` saying that ``what`` raised ``e``, or None when ``e`` is not
    the user's code's (memadvisor's bug, an error on purpose, out of memory)."""
    frame = user_code_frame(e, _CALLS_USER_CODE)
    if frame is None:
        return None
    block = _raising_module(e, model) if model is not None else None
    where = f" in {block}" if block else ""
    line = f": {frame.line.strip()}" if frame.line else ""
    return UserCodeError(
        f"{what} {verb} {type(e).__name__}{where}: {e} (at {frame.filename}:{frame.lineno}, "
        f"in {frame.name}{line}). {advice}",
        frame=frame,
    )


def _step_error(
    e: BaseException, phase: Phase, workload: Workload, model: nn.Module, output: Any, batch: Any
) -> UserCodeError | None:
    model_name = f"the model ({type(model).__name__})"
    if phase == "forward":
        advice = (
            "Check forward_fn(model, batch) and the batch it is given."
            if workload.forward_fn is not None
            else "Check that sample_batch is what the model takes (or pass forward_fn / "
            "make_batch)."
        )
        return _users_error(
            e,
            f"The model ({type(model).__name__})",
            advice,
            model=model,
            verb="rejected the batch:",
        )
    if phase == "loss":
        return _users_error(
            e,
            "loss_fn",
            f"It is called as loss_fn(output, batch), here with the output of {model_name}, "
            f"{_describe(output)}, and the batch, {_describe(batch)}: make it return a scalar "
            "tensor for these.",
        )
    if phase == "backward":
        return _users_error(
            e,
            f"The backward pass of {model_name}",
            "Check the model's custom autograd Functions and hooks, and in-place ops on "
            "tensors saved for backward.",
            model=model,
        )
    return _users_error(
        e, "The optimizer step", "Check the optimizer (optimizer=) and its parameter groups."
    )


def _raising_module(e: BaseException, model: nn.Module) -> str | None:
    """``block 'blocks.2.fc' (Linear)``: the innermost module of ``model`` whose code is on
    ``e``'s traceback (the block that raised); None when no frame belongs to one."""
    names = {id(m): n for n, m in model.named_modules()}
    found: nn.Module | None = None
    tb = e.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_locals.get("self")
        if isinstance(module, nn.Module) and id(module) in names:
            found = module
        tb = tb.tb_next
    if found is None:
        return None
    if not names[id(found)]:
        return f"its own forward ({type(found).__name__})"
    return f"block '{names[id(found)]}' ({type(found).__name__})"
