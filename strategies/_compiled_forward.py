"""A module's forward compiled with torch.compile, installed the way every strategy wrapper is.

Why not ``model.compile()``, which also compiles in place and keeps ``state_dict`` keys: it
compiles ``nn.Module._call_impl``, a frame dynamo skips (torch's own files are on its skip
list), so dynamo starts at the next frame, the model's ``forward``. For a model whose top
module is a torch container (``nn.Sequential``) that frame is in torch's files too, and
nothing is compiled, silently: measured here on torch 2.13, ``nn.Sequential(...).compile()``
ran eagerly with no graph captured. ``torch.compile(model)`` adds a frame of its own to get
around this, but returns an ``OptimizedModule`` whose ``state_dict`` keys gain an
``_orig_mod.`` prefix. :class:`CompiledForward` is that extra frame, set as the module's
instance ``forward`` (see ``strategies._forward``), so keys stay the user's and the wrappers
installed before it (autocast, checkpointed blocks) are compiled with the model.

Each model class gets its own compiled function (a fresh code object): dynamo keeps compiled
graphs, and its limit of 8 recompiles, per code object. One shared function would stop
compiling, silently, after the 8th model class in a process; per class, copies of one model
(the planner's probes, ``copy.deepcopy``) reuse one compile, as ``model.compile()`` does.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, JsonValue, ValidationError
from torch import nn

from memadvisor import _torch_private
from memadvisor.errors import BadInputError
from strategies import _forward

__all__ = [
    "MODES",
    "CompileChoice",
    "CompiledForward",
    "compile_targets",
    "compiled_call",
    "mark_batch_dynamic",
    "new_compiled_function",
    "parse_choice",
    "repeated_blocks",
]

Mode = Literal["default", "max-autotune-no-cudagraphs", "reduce-overhead", "max-autotune"]
#: The torch.compile modes a choice may name ("lite" and future modes are not planned for).
MODES: tuple[str, ...] = Mode.__args__  # type: ignore[attr-defined]


class CompileChoice(BaseModel):
    """A compiled choice: the torch.compile mode and the partitioner's memory budget."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    mode: Mode = Field("default", description="torch.compile's mode.")
    activation_memory_budget: float | None = Field(
        None,
        ge=0.0,
        le=1.0,
        description="torch._functorch.config.activation_memory_budget while compiling: the "
        "share of activations the min-cut partitioner may keep for backward (1: as many as "
        "it likes, 0: recompute all it can). None leaves torch's setting alone.",
    )

    regional: bool = Field(
        False,
        description="Compile each instance of the model's repeated block (see "
        "repeated_blocks) instead of the whole model: one compiled code object serves every "
        "instance, so the cold compile is about as many times shorter as there are layers "
        "(docs/design.md, 'What a compile costs, by form'); the rest of the model (embeddings, "
        "head) runs eager. A model with no repeated block is compiled whole.",
    )

    dynamic_batch: bool = Field(
        False,
        description="Compile with the first dimension of each tensor argument of a compiled "
        "module symbolic (dynamo's maybe_mark_dynamic): one graph, cached on disk, serves every "
        "batch, where a static graph compiles again for each new batch in each new process. "
        "The compile search measures in this form; the pick the user runs is static "
        "(docs/design.md, 'A dynamic batch while searching').",
    )

    def to_json(self) -> JsonValue:
        """The plan's JSON for this choice: the mode alone when nothing else is set."""
        if self.activation_memory_budget is None and not self.regional and not self.dynamic_batch:
            return self.mode
        out: dict[str, JsonValue] = {"mode": self.mode}
        if self.activation_memory_budget is not None:
            out["activation_memory_budget"] = self.activation_memory_budget
        if self.regional:
            out["regional"] = True
        if self.dynamic_batch:
            out["dynamic_batch"] = True
        return out

    def static(self) -> CompileChoice:
        """This choice with a static batch (the form a training run compiles)."""
        return self.model_copy(update={"dynamic_batch": False}) if self.dynamic_batch else self

    def words(self) -> str:
        """``'default mode, each repeated block, activation memory budget 0.5'``."""
        text = f"{self.mode} mode"
        if self.regional:
            text += ", each repeated block"
        if self.activation_memory_budget is not None:
            text += f", activation memory budget {self.activation_memory_budget:g}"
        if self.dynamic_batch:
            text += ", dynamic batch"
        return text


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The instances of ``model``'s repeated block, named: the children of its largest
    ``nn.ModuleList`` (or ``nn.Sequential``) of at least two modules that are all of one class
    (a transformer's layers); the first such container in module order wins a tie. Empty when
    there is none (a CNN of differing stages, a single layer).

    Known limitations:
        * Blocks of one class in two containers (an encoder's and a decoder's layers of the
          same class) count per container: only the larger is compiled regionally.
    """
    best: list[tuple[str, nn.Module]] = []
    for prefix, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.Sequential)) or len(container) < 2:
            continue
        children = list(container.named_children())
        if len({type(m) for _, m in children}) != 1 or len(children) <= len(best):
            continue
        best = [(f"{prefix}.{name}" if prefix else name, m) for name, m in children]
    return best


def compile_targets(model: nn.Module, choice: CompileChoice) -> list[nn.Module]:
    """The modules ``choice`` compiles in ``model``: the repeated blocks when regional (and
    the model has them), else the model itself."""
    if choice.regional:
        blocks = repeated_blocks(model)
        if blocks:
            return [m for _, m in blocks]
    return [model]


def parse_choice(choice: JsonValue) -> CompileChoice | None:
    """``choice`` as a :class:`CompileChoice`; None for off.

    Accepted: ``"off"`` (or None, False), a mode (``"default"``), or a mapping
    ``{"mode": "default", "activation_memory_budget": 0.5}``.

    Raises:
        BadInputError: anything else, or a budget outside [0, 1].
    """
    if choice in (None, False, "off"):
        return None
    example = (
        '"default" or {"mode": "default", "activation_memory_budget": 0.5, "regional": true, '
        '"dynamic_batch": true}'
    )
    try:
        if isinstance(choice, str):
            return CompileChoice(mode=choice)
        if isinstance(choice, dict):
            return CompileChoice.model_validate(choice)
    except ValidationError as e:
        first = e.errors()[0]
        raise BadInputError(
            f"A compile choice is 'off', one of the modes {MODES}, or {example}; "
            f"{first['msg']} at {first['loc']}, but got {choice=}."
        ) from e
    raise BadInputError(
        f"A compile choice is 'off', one of the modes {MODES}, or {example}, but got {choice=}."
    )


def _call_through(module: nn.Module, *args: Any, **kwargs: Any) -> Any:
    # The frame dynamo compiles: everything below it (inner wrappers, the class's forward)
    # is traced into the graph. Its root is the module itself, as torch.compile(model)'s
    # frame is: rooted at the wrapper instead, the same graph took about 60% more host time
    # per forward (docs/design.md, "CompiledForward in the user's loop").
    wrapper = module.forward  # the outermost wrapper; CompiledForward is normally it
    while not isinstance(wrapper, CompiledForward):
        wrapper = wrapper.inner
    return wrapper.call_inner(*args, **kwargs)


# Per class, per (mode, activation_memory_budget): a plain tuple, so a call looks its
# function up without building a CompileChoice.
_COMPILED: weakref.WeakKeyDictionary[type, dict[tuple[str, float | None], Callable[..., Any]]] = (
    weakref.WeakKeyDictionary()
)


class _OwnBackend:
    """A backend object of its own that delegates to ``inner``.

    Dynamo reuses a compiled frame only under the backend that compiled it (it tells
    backends apart by identity), so a function compiled with an own backend compiles every
    frame it reaches afresh, the user's nested frames after a graph break included.
    """

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, gm: Any, example_inputs: Any) -> Any:
        return self.inner(gm, example_inputs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def new_compiled_function(
    cls: type, choice: CompileChoice, *, own_backend: bool = False
) -> Callable[..., Any]:
    """A compiled function, new each call, that runs forwards of ``cls`` models for ``choice``.

    Its code object is new and named after the class, so dynamo compiles it from scratch on
    its first call and keeps its graphs apart from any other's. The backend is inductor with
    the choice's mode and budget; with ``own_backend`` it is wrapped in an object of its own,
    so no frame compiled earlier in this process is reused (what a fresh process sees).
    """
    code = _call_through.__code__
    name = f"compiled_forward_{cls.__name__}"
    renamed = {"co_name": name}
    if hasattr(code, "co_qualname"):  # Python 3.11+
        renamed["co_qualname"] = name
    fn = types.FunctionType(code.replace(**renamed), _call_through.__globals__, name)
    backend = _torch_private.inductor_backend(choice.mode, choice.activation_memory_budget)
    return torch.compile(fn, backend=_OwnBackend(backend) if own_backend else backend)


def compiled_call(cls: type, choice: CompileChoice) -> Callable[..., Any]:
    """The compiled function for ``cls`` and ``choice``, made once for the life of the process.

    Copies of one model (the planner's probes, ``copy.deepcopy``) share it and its graphs.
    """
    per_class = _COMPILED.setdefault(cls, {})
    key = (choice.mode, choice.activation_memory_budget)
    if key not in per_class:
        per_class[key] = new_compiled_function(cls, choice)
    return per_class[key]


class CompiledForward(_forward.ForwardWrapper):
    """The module's forward (with the wrappers installed before this one) under torch.compile.

    Holds only its settings, so the model pickles and deep-copies as before; the compiled
    function is looked up per call (a dict lookup) and compiles on the first call of a
    class, mode and budget, and again when dynamo's guards fail (a new input shape, eval()).
    """

    # A class default as well: a wrapper pickled before the field existed loads static.
    dynamic_batch: bool = False

    def __init__(
        self,
        module: nn.Module,
        inner: Any,
        mode: str = "default",
        activation_memory_budget: float | None = None,
        dynamic_batch: bool = False,
    ) -> None:
        super().__init__(module, inner)
        self.mode = mode
        self.activation_memory_budget = activation_memory_budget
        self.dynamic_batch = dynamic_batch

    @property
    def choice(self) -> CompileChoice:
        return CompileChoice(mode=self.mode, activation_memory_budget=self.activation_memory_budget)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        per_class = _COMPILED.get(type(self.module))
        fn = per_class.get((self.mode, self.activation_memory_budget)) if per_class else None
        if fn is None:
            fn = compiled_call(type(self.module), self.choice)
        if self.dynamic_batch:
            mark_batch_dynamic(args, kwargs)
        return fn(self.module, *args, **kwargs)


def mark_batch_dynamic(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Dim 0 of each tensor argument (top level) symbolic where dynamo allows it.

    The batch is dim 0 of a module's inputs by the convention every strategy here assumes
    (``Workload.batch``); other tensors with a dim 0 (a sequence's positions) become
    symbolic too, which costs a more general graph, not a wrong one. A dim of size 1 is
    specialised by dynamo as usual (batch 1 is a graph of its own).
    """
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 1:
            _torch_private.maybe_mark_dynamic(value, 0)
