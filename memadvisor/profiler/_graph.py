"""What autograd keeps for backward: the storages saved in the graph behind a loss.

Walked after forward, before backward: every node's ``_raw_saved_*`` slots (what the C++
autograd functions saved), and for custom ``Function`` s their ``saved_tensors`` and any
tensors stashed on ``ctx``. Storages are de-duplicated, so a tensor two nodes keep (block
i's output is block i+1's saved input) counts once.

The *packed* value is read (``SavedTensor.data``), never unpacked: unpacking would call a
``saved_tensors_hooks`` unpack hook, and non-reentrant checkpointing's hook recomputes the
forward. What a pack hook returned is what the graph keeps: a tensor (counted where it
lives), or a checkpoint's placeholder (nothing).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

__all__ = ["saved_storages"]

_RAW_SLOTS: dict[type, tuple[str, ...]] = {}


def saved_storages(roots: Iterable[torch.Tensor]) -> dict[int, torch.UntypedStorage]:
    """The storages autograd saved for the backward of ``roots``, keyed by ``id(storage)``.

    The key is the one :class:`~memadvisor.memory.MemoryMeter` counts a storage under.
    """
    found: dict[int, torch.UntypedStorage] = {}
    seen: set[Any] = set()  # holds the node objects, so their ids cannot be reused meanwhile
    stack = [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for tensor in _saved_by(node):
            if tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            found[id(storage)] = storage
        stack.extend(fn for fn, _ in node.next_functions if fn is not None)
    return found


# What autograd says when a saved tensor was freed by a backward (torch/csrc/autograd).
_FREED = "after they have already been freed"


def _saved_by(node: Any) -> Iterator[torch.Tensor]:
    slots = _RAW_SLOTS.get(type(node))
    if slots is None:
        slots = tuple(a for a in dir(node) if a.startswith("_raw_saved_"))
        _RAW_SLOTS[type(node)] = slots
    for slot in slots:
        try:
            value = getattr(node, slot)
        except RuntimeError as e:
            if _FREED not in str(e):
                raise  # not the freed case: a miscount would pass silently
            continue  # already freed by a backward: nothing is kept
        for saved in value if isinstance(value, (list, tuple)) else (value,):
            yield from _tensors(_packed(saved))
    # A custom Function's ctx may also hold tensors as plain attributes (ctx.mask = mask).
    extra = getattr(node, "__dict__", None)
    if extra:
        for value in extra.values():
            yield from _tensors(value)


def _packed(saved: Any) -> Any:
    """What a ``SavedTensor`` holds, without calling an unpack hook."""
    data = getattr(saved, "data", None)
    if data is not None or not hasattr(saved, "unpack"):
        return data
    # A torch without SavedTensor.data: unpacking is safe only when no hook is installed.
    return saved.unpack() if getattr(saved, "unpack_hook", None) is None else None


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for v in value:
            if isinstance(v, torch.Tensor):
                yield v
