"""Activation checkpointing: recompute chosen blocks' forward in backward instead of keeping
what they saved.

A choice is the list of block names to checkpoint (``[]`` is off). Choices are offered as
ranked prefixes — the block that frees the most bytes per millisecond of recompute first —
so a model of n blocks gives n + 1 choices, not 2^n subsets: for a given number of blocks
the best prefix frees at least as much per ms as any other set of that size.

Applying it installs :class:`CheckpointedForward` on each block (see ``strategies._forward``):
non-reentrant ``torch.utils.checkpoint.checkpoint`` with the RNG state preserved, so dropout
draws the same mask in the recompute and gradients equal the unwrapped model's exactly.

The recompute runs the block's forward a second time in training mode, and a forward may
update buffers (BatchNorm's running statistics and ``num_batches_tracked``, a step counter):
:class:`_BufferGuard` keeps those updates from landing twice, so the trained model's buffers
equal the unwrapped model's too.

Known limitations:
    * Only the block's own buffers are guarded; a forward that writes a buffer of a module
      outside the block (one shared with another block) updates it again in the recompute.
    * A buffer the block's forward mutated only on a later call than its first (a
      conditional update) is recomputed, in that call, from the value forward left rather
      than the one it read; it is still updated once.
    * Under torch.compile the buffer guard is left out (the checkpoint is traced into the
      graph, and AOTAutograd's recompute replays no buffer write). A dynamo backend that runs
      the captured graph without AOTAutograd (``backend="eager"``) would recompute eagerly and
      write a block's buffers twice; inductor, the default and the one the compile strategy
      uses, does not.
    * A call whose arguments hold a list or dict keeps its recompute wrapper under compile
      too, which dynamo refuses inside a checkpoint: such a block (DenseNet's layers) runs
      eager, a graph break each.
"""

from __future__ import annotations

import functools
import json
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from pydantic import JsonValue
from torch import nn
from torch.utils.checkpoint import checkpoint

from memadvisor._torch_private import is_fake, tensor_version
from memadvisor.errors import BadInputError
from memadvisor.schema.advice import Advice, ReportPart
from memadvisor.schema.facts import Facts
from memadvisor.step import Step
from memadvisor.strategy import Described, EffectOrder, HandTried, Strategy
from strategies import _forward
from strategies._format import mib, names_text

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.plan import Plan
    from memadvisor.schema.profile import Profile

__all__ = [
    "ActivationCheckpointing",
    "CheckpointedForward",
    "checkpointed_blocks",
    "is_mutable_cache",
    "ranked_blocks",
]

_warned: set[str] = set()


def is_mutable_cache(value: object) -> bool:
    """Whether ``value`` is a KV cache that a forward updates in place.

    Recognised by what it is, not by the argument that carries it (transformers has named
    it ``layer_past``, ``past_key_value``, ``past_key_values`` and, since 5.x, ``cache``,
    and passes it by position in some models): an instance of transformers' ``Cache``
    (looked up only when transformers is already imported), or an object with Cache's two
    defining methods, ``update`` and ``get_seq_length``, for caches of other libraries. A
    cache of plain tensors (older models' ``layer_past`` tuples) is never written, so the
    recompute is harmless and it is kept.
    """
    if value is None or isinstance(value, (torch.Tensor, tuple, list, dict)):
        return False
    cache_utils = sys.modules.get("transformers.cache_utils")
    cache_type = getattr(cache_utils, "Cache", None)
    if isinstance(cache_type, type) and isinstance(value, cache_type):
        return True
    return callable(getattr(value, "update", None)) and callable(
        getattr(value, "get_seq_length", None)
    )


def _without_mutable_cache(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``args`` and ``kwargs`` with in-place KV caches replaced by None, as HF's own gradient
    checkpointing does.

    HF models build a cache whenever ``use_cache`` (True in most configs), in training too;
    ``GradientCheckpointingLayer`` then passes ``use_cache=False`` and no cache to the layer
    unless it sets ``_can_checkpoint_with_cache`` (a layer that only reads the cache).
    """
    if getattr(module, "_can_checkpoint_with_cache", False):
        return args, kwargs
    dropped = [f"argument {i}" for i, a in enumerate(args) if is_mutable_cache(a)]
    dropped += [k for k, v in kwargs.items() if is_mutable_cache(v)]
    if not dropped:
        return args, kwargs
    args = tuple(None if is_mutable_cache(a) else a for a in args)
    kwargs = {k: None if is_mutable_cache(v) else v for k, v in kwargs.items()}
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    name = type(module).__name__
    # Not while dynamo traces: ``warnings.warn`` is a builtin it cannot trace, so the call
    # broke the graph at every checkpointed block of a compiled Hugging Face model and left
    # its checkpointed forwards eager (docs/design.md, session 39); an eager step (the
    # plan's profile, an eager probe, a loop's first uncompiled step) still warns.
    if name not in _warned and not torch.compiler.is_compiling():
        _warned.add(name)
        warnings.warn(
            f"{name} is checkpointed while training with a KV cache: it runs with "
            f"{', '.join(dropped)} = None and use_cache=False (a recompute would update the "
            "cache twice), as Hugging Face's gradient checkpointing does.",
            stacklevel=3,
        )
    return args, kwargs


class CheckpointedForward(_forward.ForwardWrapper):
    """A block's forward that is recomputed in backward when training with grad enabled.

    In ``eval()``, under ``torch.no_grad()`` or ``torch.inference_mode()`` the block runs as
    it always did: nothing is saved for backward there, so there is nothing to recompute.
    """

    def __init__(self, module: nn.Module, inner: Any) -> None:
        super().__init__(module, inner)
        # Names (relative to the block) of the buffers its forward mutates; None until the
        # first checkpointed call has shown which.
        self._mutated_buffers: frozenset[str] | None = None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (self.module.training and torch.is_grad_enabled()):
            return self.call_inner(*args, **kwargs)
        args, kwargs = _without_mutable_cache(self.module, args, kwargs)
        # The arguments themselves, not the kwargs dict every call has: the wrapper below
        # mutates itself, which dynamo refuses inside a compiled checkpoint ("HOP: Unsafe side
        # effect"), so taking it for every call left every compiled checkpointed block eager.
        if _holds_container(args) or any(_holds_container(v) for v in kwargs.values()):
            run: Any = _ArgumentsAsCalled(self.call_inner, args, kwargs)
        else:
            # Keyword arguments (attention masks, position ids) travel in a partial so none
            # of their names can collide with checkpoint()'s own keywords.
            run = functools.partial(self.call_inner, **kwargs) if kwargs else self.call_inner
        if any(True for _ in self.module.buffers()) and not torch.compiler.is_compiling():
            # Under dynamo the checkpoint is traced into the graph, which updates each buffer
            # once (the recompute is the compiled backward's, of the traced forward); the
            # guard, an object that mutates itself, would break the graph at every block.
            run = _BufferGuard(self, run)
        return checkpoint(run, *args, use_reentrant=False, preserve_rng_state=True)


def _holds_container(value: Any) -> bool:
    """Whether ``value`` is or holds (within tuples) a list or dict a caller could change."""
    if type(value) is tuple:
        return any(_holds_container(v) for v in value)
    return type(value) in (list, dict)


def _copied_structure(value: Any) -> Any:
    """``value`` with its lists, dicts and tuples copied; tensors and all else shared."""
    if type(value) in (list, tuple):
        return type(value)(_copied_structure(v) for v in value)
    if type(value) is dict:
        return {k: _copied_structure(v) for k, v in value.items()}
    return value


class _ArgumentsAsCalled:
    """One checkpointed call's forward, whose recompute sees its arguments as forward did.

    A caller may change a list or dict it passed once the block has returned: torchvision's
    DenseNet appends each dense layer's output to the list of features that every layer is
    given, so by backward the list holds more tensors than the layer concatenated, and the
    recompute computed something else (a BatchNorm of the wrong width). The containers'
    structure is copied at the call (the tensors in them are shared, not copied): the forward
    gets the caller's own objects, every recompute a fresh copy of them as they were.
    """

    def __init__(self, call: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.call, self.kwargs = call, kwargs
        self.as_called = _copied_structure((args, kwargs))
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            return self.call(*args, **self.kwargs)
        args, kwargs = _copied_structure(self.as_called)
        return self.call(*args, **kwargs)


class _BufferGuard:
    """One checkpointed call's forward, whose buffer updates the recompute does not repeat.

    Made before the forward runs, it copies the buffers the block's forward mutates (all of
    the block's buffers on the first call, while that is not known yet). Its first call is
    the forward: afterwards it notes which buffers changed (reassigned, written in place as
    the version counter or, on the first call, the values show) and keeps only their
    copies. Every later call is a recompute in backward: copies of the values forward read
    are swapped in for those buffers, so the recompute computes exactly what forward did
    and its writes land on throwaway tensors; the forward's results are put back afterwards
    (also when the recompute stops early). Swapping tensors rather than copying values in
    place leaves the real buffers' version counters alone, so autograd still accepts any of
    them it saved.
    """

    def __init__(self, wrapper: CheckpointedForward, run: Any) -> None:
        self.wrapper, self.run = wrapper, run
        self.slots = {
            f"{prefix}.{name}" if prefix else name: (owner, name)
            for prefix, owner in wrapper.module.named_modules()
            for name, t in owner._buffers.items()
            if t is not None
        }
        known = wrapper._mutated_buffers
        self.before = {key: owner._buffers[name] for key, (owner, name) in self.slots.items()}
        self.versions = {key: tensor_version(t) for key, t in self.before.items()}
        with torch.no_grad():
            self.read = {
                key: t.detach().clone()
                for key, t in self.before.items()
                if known is None or key in known
            }
        self.mutated: list[str] = []
        self.calls = 0

    def __call__(self, *args: Any) -> Any:
        self.calls += 1
        if self.calls == 1:
            try:
                return self.run(*args)
            finally:
                self._note_mutated()
        return self._recompute(*args)

    def _note_mutated(self) -> None:
        for key, (owner, name) in self.slots.items():
            now = owner._buffers.get(name)
            if now is not self.before[key] or (
                now is not None and tensor_version(now) != self.versions[key]
            ):
                self.mutated.append(key)
            elif key in self.read and not is_fake(now) and not torch.equal(now, self.read[key]):
                # Kernels that update a buffer in place (batch_norm's running statistics)
                # do not bump its version counter: on the first call the values tell (fake
                # tensors have none, and nothing to get wrong).
                self.mutated.append(key)
        known = self.wrapper._mutated_buffers or frozenset()
        self.wrapper._mutated_buffers = known | frozenset(self.mutated)
        self.read = {key: self.read[key] for key in self.mutated if key in self.read}
        del self.before, self.versions

    def _recompute(self, *args: Any) -> Any:
        current = {key: self.slots[key][0]._buffers.get(self.slots[key][1]) for key in self.mutated}
        with torch.no_grad():
            scratch = {
                key: (self.read.get(key, current[key])).detach().clone()
                for key in self.mutated
                if self.read.get(key, current[key]) is not None
            }
        try:
            for key, t in scratch.items():
                owner, name = self.slots[key]
                owner._buffers[name] = t
            return self.run(*args)
        finally:
            for key, t in current.items():
                owner, name = self.slots[key]
                owner._buffers[name] = t


def ranked_blocks(profile: Profile) -> list[int]:
    """Indices of blocks worth checkpointing, most bytes freed per ms recomputed first.

    A block frees what it saves for backward less its input, which a checkpointed block
    keeps; one that frees nothing is left out. Read at the larger profiled batch, fp32.
    """
    step = profile.steps["fp32"]
    b = max(profile.batch_sizes)
    scored: list[tuple[float, int]] = []
    for i, blk in enumerate(step.blocks):
        freed = blk.activation.at(b) - blk.input.at(b)
        if freed <= 0:
            continue
        # A block too fast to time still costs something: 1 µs keeps the ratio finite.
        scored.append((freed / max(blk.forward_ms.at(b), 1e-3), i))
    scored.sort(key=lambda s: (-s[0], s[1]))
    return [i for _, i in scored]


def _block_indices(profile: Profile, names: list[str]) -> list[int]:
    index = {blk.name: i for i, blk in enumerate(profile.blocks)}
    unknown = [n for n in names if n not in index]
    if unknown:
        raise BadInputError(
            f"Checkpointing names blocks the profile does not have: {unknown}; its blocks are "
            f"{sorted(index)}. Use a plan made for this model."
        )
    return [index[n] for n in names]


def checkpointed_blocks(choice: JsonValue, profile: Profile | None) -> list[str]:
    """Block names a checkpointing choice names, as a plan may hold it: a list of names or
    of block indices (a choice of any other shape, as its JSON)."""
    if not isinstance(choice, list):
        return [] if choice in (None, False, 0, "off", {}) else [json.dumps(choice)]
    names = [b.name for b in profile.blocks] if profile is not None else []
    out: list[str] = []
    for item in choice:
        if isinstance(item, int) and 0 <= item < len(names):
            out.append(names[item])
        else:
            out.append(str(item))
    return out


def _names(choice: JsonValue) -> list[str]:
    if choice in (None, False):
        return []
    # "" names the root module: checkpointing the whole model is never a plan's choice.
    if not (isinstance(choice, list) and all(isinstance(n, str) and n for n in choice)):
        raise BadInputError(
            f"A checkpointing choice is a list of block names (non-empty), but got {choice=}. "
            "Example: ['h.0', 'h.1']."
        )
    return list(choice)


class ActivationCheckpointing(Strategy, Described, HandTried):
    """Recompute blocks in backward instead of keeping their activations."""

    name = "checkpointing"
    effect_order = EffectOrder.RECOMPUTE
    installs = "checkpointing"

    def describe(self, choice: JsonValue, plan: Plan) -> ReportPart:
        """The answer's Checkpointed row ("none" too) and the blocks the pick recomputes."""
        names = checkpointed_blocks(choice, plan.profile)
        if not names:
            return ReportPart(label="Checkpointed", words="none", brief="no checkpointing")
        of = f" of {len(plan.profile.blocks)}" if plan.profile is not None else ""
        return ReportPart(
            label="Checkpointed",
            words=f"{len(names)}{of} blocks: {', '.join(names)}",
            brief=f"{len(names)} blocks checkpointed",
            recomputed_blocks=names,
        )

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        order = ranked_blocks(profile)
        names = [profile.blocks[i].name for i in order]
        position = {blk.name: i for i, blk in enumerate(profile.blocks)}
        # Each prefix is listed in model order: it reads like the model, and the same set
        # is always the same JSON value.
        prefixes: list[JsonValue] = [
            sorted(names[:k], key=position.__getitem__) for k in range(1, len(names) + 1)
        ]
        return [[], *prefixes]

    def by_hand(self, options: Sequence[JsonValue]) -> tuple[str, JsonValue] | None:
        """ "+Checkpointing": every block this strategy offers to checkpoint."""
        lists = [c for c in options if isinstance(c, list) and c]
        return ("+Checkpointing", max(lists, key=len)) if lists else None

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        model.checkpoint(_block_indices(profile, _names(choice)))

    def validate(self, step: Step, choice: JsonValue) -> None:
        """Raises ``BadInputError`` when a name is empty or not a submodule of ``model``."""
        model = step.model
        _blocks(model, _names(choice))

    def apply(self, step: Step, choice: JsonValue) -> Step:
        """Wrap each named block; applying the same choice twice wraps nothing twice.

        Raises:
            BadInputError: a name is not a submodule of ``model``.
        """
        model = step.model
        for block in _blocks(model, _names(choice)):
            _forward.install(block, CheckpointedForward)
        return step

    states = frozenset({"recomputed_blocks"})

    def facts(self, choice: JsonValue) -> Facts:
        return Facts(recomputed_blocks=_names(choice))

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        names = _names(choice)
        if not names:
            return None
        step = profile.steps["fp32"]
        b = max(profile.batch_sizes)
        freed = recompute_ms = 0.0
        for i in _block_indices(profile, names):
            blk = step.blocks[i]
            freed += blk.activation.at(b) - blk.input.at(b)
            recompute_ms += blk.forward_ms.at(b)
        return Advice(
            strategy=self.name,
            title=f"Checkpoint {len(names)} of {len(profile.blocks)} blocks",
            sentence=(
                f"Recompute the forward of {names_text(names)} during backward instead of "
                "keeping their activations: only each block's input is kept. Non-reentrant "
                "checkpointing; dropout draws the same mask in the recompute."
            ),
            snippet=_snippet(names),
            effect=(
                f"estimated at batch {b}, fp32: about {mib(freed)} MiB of activations freed, "
                f"+{recompute_ms:.1f} ms of recompute per micro-batch"
            ),
        )


def _blocks(model: nn.Module, names: list[str]) -> list[nn.Module]:
    """The submodules ``names`` name, all of them found before any is used."""
    missing = []
    found = []
    for name in names:
        try:
            found.append(model.get_submodule(name))
        except AttributeError:
            missing.append(name)
    if missing:
        raise BadInputError(
            f"Cannot checkpoint {missing}: {model.__class__.__name__} has no such submodule. "
            "Use a plan made for this model."
        )
    return found


def _snippet(names: list[str]) -> str:
    return f"""\
import functools
import torch
from torch.utils.checkpoint import checkpoint

def checkpointed(block):
    forward = block.forward
    def run(*args, **kwargs):
        if block.training and torch.is_grad_enabled():
            return checkpoint(functools.partial(forward, **kwargs), *args, use_reentrant=False)
        return forward(*args, **kwargs)  # eval / no_grad: nothing to recompute
    block.forward = run

for name in {names!r}:
    checkpointed(model.get_submodule(name))
# A Hugging Face model can checkpoint every layer instead:
# model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})
"""
