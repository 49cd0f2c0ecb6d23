"""Which modules are the model's blocks: the repeated units a person would checkpoint.

By default, the repeated units in ``ModuleList``/``Sequential``/``ModuleDict`` containers
(torchvision's DenseNet keeps its dense layers in a ``ModuleDict``): runs of two or more
adjacent children of one type that hold parameters (transformer layers, ResNet
bottlenecks). A run need not fill its container, so ``nn.Sequential(stem, *blocks, head)``
gives its blocks as a container of blocks alone does. Runs of the same member type count
together, so a ResNet's ``layer1`` ... ``layer4`` give all its bottlenecks, not only the
longest stage's; the type with the most members wins (more parameters per member breaks a
tie: the transformer layers, not a list of two small heads).

Known limitations:
    * Repeated units that are attributes of a plain module (``self.block1``,
      ``self.block2``) rather than children of a container are not found; name them with
      ``blocks=``.
    * Parameterless modules (activations, dropout) are never blocks.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

from memadvisor.errors import BadInputError

__all__ = ["BlockSpec", "find_blocks"]

# A name ("transformer.h.3"), a glob ("transformer.h.*"), a class name ("GPT2Block"), a
# module type (GPT2Block), or a sequence of these.
BlockSpec = str | type | Sequence[str | type]


def find_blocks(model: nn.Module, blocks: BlockSpec | None = None) -> list[str]:
    """Qualified names of the blocks, in the model's module order.

    Args:
        model: the model.
        blocks: ``None`` to detect them; otherwise names, globs (``*`` matches within one
            dotted component, ``**`` across any number), class names or module types. A
            string that matches no qualified name is tried as a class name. An empty
            sequence means no blocks.

    Raises:
        BadInputError: a pattern matches nothing, or one chosen block contains another.
    """
    if blocks is None:
        return _detect(model)
    specs: list[str | type] = [blocks] if isinstance(blocks, (str, type)) else list(blocks)
    names = [n for n, _ in model.named_modules() if n]
    chosen: set[str] = set()
    for spec in specs:
        matched = _match(model, names, spec)
        if not matched:
            raise BadInputError(
                f"No module of the model matches the block pattern {spec!r}: pass qualified "
                "names ('transformer.h.0'), globs ('transformer.h.*'), class names or types; "
                f"the model's top-level modules are {[n for n in names if '.' not in n]}."
            )
        chosen.update(matched)
    ordered = [n for n in names if n in chosen]
    _check_disjoint(ordered)
    return ordered


def _match(model: nn.Module, names: list[str], spec: str | type) -> list[str]:
    if isinstance(spec, type):
        return [n for n, m in model.named_modules() if n and isinstance(m, spec)]
    if not isinstance(spec, str):
        raise BadInputError(
            f"A block pattern is a module name, glob, class name or type, but got {spec!r}."
        )
    by_name = [n for n in names if _glob(n, spec)]
    if by_name:
        return by_name
    return [n for n, m in model.named_modules() if n and type(m).__name__ == spec]


def _glob(name: str, pattern: str) -> bool:
    """Dotted glob: ``*`` stays inside one component, ``**`` spans any number of them."""
    return _glob_parts(name.split("."), pattern.split("."))


def _glob_parts(parts: list[str], pats: list[str]) -> bool:
    if not pats:
        return not parts
    if pats[0] == "**":
        return any(_glob_parts(parts[i:], pats[1:]) for i in range(len(parts) + 1))
    if not parts or not fnmatch.fnmatchcase(parts[0], pats[0]):
        return False
    return _glob_parts(parts[1:], pats[1:])


def _check_disjoint(names: list[str]) -> None:
    for outer in names:
        for inner in names:
            if inner != outer and inner.startswith(outer + "."):
                raise BadInputError(
                    f"Block {outer!r} contains block {inner!r}: blocks must not nest "
                    "(checkpointing both makes no sense); choose one level."
                )


def _runs(children: list[tuple[str, nn.Module]]) -> list[list[tuple[str, nn.Module]]]:
    """Maximal runs of adjacent children of one type, two or more long, holding parameters."""
    runs: list[list[tuple[str, nn.Module]]] = []
    for name, child in children:
        if runs and type(runs[-1][-1][1]) is type(child):
            runs[-1].append((name, child))
        else:
            runs.append([(name, child)])
    return [run for run in runs if len(run) >= 2 and any(True for _ in run[0][1].parameters())]


def _detect(model: nn.Module) -> list[str]:
    # Runs of same-type children inside containers (the whole container, or part of one
    # beside a stem and a head): candidates for blocks.
    members_by_type: dict[type, list[str]] = {}
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            continue
        prefix = f"{name}." if name else ""
        for run in _runs(list(module.named_children())):
            member_type = type(run[0][1])
            members_by_type.setdefault(member_type, []).extend(prefix + c for c, _ in run)
    if not members_by_type:
        return []

    def score(item: tuple[type, list[str]]) -> tuple[int, int]:
        member_type, members = item
        # Most members wins; among equals, the type whose members hold more parameters (the
        # transformer layers, not a list of two small heads).
        params = sum(p.numel() for n in members[:1] for p in model.get_submodule(n).parameters())
        return len(_outermost(members)), params

    _, members = max(members_by_type.items(), key=score)
    members = _outermost(members)
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    return sorted(set(members), key=order.__getitem__)


def _outermost(names: list[str]) -> list[str]:
    """Drop names nested inside another of ``names`` (blocks must not nest)."""
    unique = sorted(set(names))
    return [n for n in unique if not any(n != o and n.startswith(o + ".") for o in unique)]
