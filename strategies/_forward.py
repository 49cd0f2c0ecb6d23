"""Forward wrappers: how strategies change what a module does without changing what it is.

A wrapper is set as the module's *instance* attribute ``forward``; ``nn.Module.__call__``
finds it before the class's method. Nothing is registered as a submodule, parameter or
buffer, so parameter names and ``state_dict`` keys stay exactly the user's, and a state dict
loads back into the original class. Wrappers are plain objects of module-level classes, so
``torch.save(model)``, ``pickle`` and ``copy.deepcopy`` handle them (the module <-> wrapper
reference cycle is one pickle already knows how to rebuild).

Why not a subclass swapped into ``module.__class__``: a class made at run time does not
pickle, and one made per block class at import time cannot exist for a user's classes.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from typing import Any, TypeVar

from torch import nn

__all__ = ["ForwardWrapper", "find_wrapper", "install", "remove", "wrappers"]

W = TypeVar("W", bound="ForwardWrapper")


class ForwardWrapper:
    """Calls the module's own forward (or the wrapper installed before it) around ``run``.

    Subclasses override :meth:`__call__` and call :meth:`call_inner` for the real work.
    """

    def __init__(self, module: nn.Module, inner: Any) -> None:
        self.module = module
        # The instance-level forward found when this one was installed (another wrapper, or
        # a user's or library's hook), or None for the class's own forward.
        self.inner = inner

    @property
    def __signature__(self) -> inspect.Signature:
        """The signature of the forward it stands for, not ``(*args, **kwargs)``: libraries
        read ``inspect.signature(model.forward)`` to decide what to pass (the HF Trainer
        drops every dataset column a forward does not name: a whole-model compile installed
        in place made it drop ``input_ids`` and ``labels``, on a card, session 18)."""
        if self.inner is not None:
            return inspect.signature(self.inner)
        return inspect.signature(type(self.module).forward.__get__(self.module))

    def call_inner(self, *args: Any, **kwargs: Any) -> Any:
        if self.inner is not None:
            return self.inner(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.call_inner(*args, **kwargs)


def wrappers(module: nn.Module) -> Iterator[ForwardWrapper]:
    """The wrappers installed on ``module``, outermost first."""
    current = module.__dict__.get("forward")
    while isinstance(current, ForwardWrapper):
        yield current
        current = current.inner


def find_wrapper(module: nn.Module, kind: type[W]) -> W | None:
    """The wrapper of type ``kind`` installed on ``module``, if any."""
    for w in wrappers(module):
        if isinstance(w, kind):
            return w
    return None


def install(module: nn.Module, kind: type[W], **options: Any) -> W:
    """Install a ``kind`` wrapper on ``module`` once; a second call updates its options.

    Returns:
        The wrapper now installed (the existing one when there was one).
    """
    existing = find_wrapper(module, kind)
    if existing is not None:
        for key, value in options.items():
            setattr(existing, key, value)
        return existing
    wrapper = kind(module, module.__dict__.get("forward"), **options)
    # object.__setattr__: nn.Module.__setattr__ would do the same for a non-tensor value,
    # but saying so keeps a future torch from registering it as anything else.
    object.__setattr__(module, "forward", wrapper)
    return wrapper


def remove(module: nn.Module, kind: type[ForwardWrapper]) -> bool:
    """Take the ``kind`` wrapper off ``module``, keeping any others; True if one was there."""
    outer: ForwardWrapper | None = None
    for w in wrappers(module):
        if isinstance(w, kind):
            if outer is None:
                if w.inner is None:
                    del module.__dict__["forward"]
                else:
                    object.__setattr__(module, "forward", w.inner)
            else:
                outer.inner = w.inner
            return True
        outer = w
    return False
