"""One moment of a recording, and the stack of modules open after each one.

Backward enter/exit come from gradient hooks, whose order does not always nest: the walk
here (:func:`stacks_after`) repairs the nesting once, for the per-module statistics and the
speedscope export alike.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["EventKind", "Frame", "Pass", "TimelineEvent", "stack_changes", "stacks_after"]

EventKind = Literal["enter", "exit", "phase", "alloc", "sample"]

Pass = Literal["forward", "backward"]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TimelineEvent(_Model):
    """One moment of a recording: a module entered or left, a phase began, memory sampled."""

    t_ms: float = Field(description="Milliseconds since the recording started.")
    kind: EventKind = Field(
        description="enter/exit: a module's forward or backward; phase: a training-step phase "
        "began; alloc: an allocation (CPU meter); sample: a plain memory reading."
    )
    phase: str | None = Field(
        None,
        description="For kind='phase': forward, loss, backward, optimizer, zero_grad, end; "
        "for kind='sample': an optional label (the monitor writes 'iteration N').",
    )
    module: str | None = Field(
        None, description="Qualified module name for enter/exit; '' is the model itself."
    )
    pass_: Pass | None = Field(None, description="For enter/exit: forward or backward.")
    allocated_bytes: int = Field(ge=0, description="Bytes held by tensors at this moment.")
    reserved_bytes: int | None = Field(
        None, description="CUDA caching allocator's reserved bytes; None on the CPU."
    )
    allocations: int | None = Field(
        None,
        description="Cumulative number of allocations so far, where the reader counts them "
        "(the CPU meter and the CUDA reader, when asked).",
    )
    peak_allocated_bytes: int | None = Field(
        None,
        ge=0,
        description="Highest allocated bytes since the previous event, where the reader "
        "tracks it: a peak between two events (inside a leaf module) is then not missed.",
    )

    @property
    def fragmentation(self) -> float | None:
        """Share of reserved bytes not held by tensors: ``1 - allocated / reserved``."""
        if not self.reserved_bytes:
            return None
        return max(0.0, 1.0 - self.allocated_bytes / self.reserved_bytes)


# A speedscope frame: ("phase", phase_name, None) or ("module", qualified_name, pass).
Frame = tuple[str, str, str | None]


def _is_ancestor_or_self(ancestor: str, name: str) -> bool:
    return ancestor == "" or name == ancestor or name.startswith(ancestor + ".")


def _advance(stack: list[Frame], ev: TimelineEvent) -> None:
    """Move ``stack`` past ``ev``, repairing the nesting that backward hooks cannot promise."""
    if ev.kind == "phase":
        stack.clear()  # a new phase closes everything the last one left open
        if ev.phase and ev.phase != "end":
            stack.append(("phase", ev.phase, None))
        return
    if ev.kind not in ("enter", "exit") or ev.module is None:
        return
    me: Frame = ("module", ev.module, ev.pass_)
    if ev.kind == "enter":
        lifted: list[Frame] = []
        if ev.pass_ == "backward":
            while stack and stack[-1][0] == "module" and stack[-1][2] == "backward":
                top = stack[-1][1]
                if _is_ancestor_or_self(top, ev.module):
                    break
                if _is_ancestor_or_self(ev.module, top):
                    # A parent and its last child share an output tensor, and the child's hook
                    # on it was registered (so fires) first: the parent goes beneath it.
                    lifted.append(stack.pop())
                else:
                    # A module with no backward exit (its inputs need no grad) ends where a
                    # module outside its subtree begins.
                    stack.pop()
        stack.append(me)
        stack.extend(reversed(lifted))
        return
    if me in stack:  # an exit whose enter was dropped from the buffer is ignored
        del stack[len(stack) - 1 - stack[::-1].index(me) :]


def stacks_after(events: list[TimelineEvent]) -> Iterator[tuple[Frame, ...]]:
    stack: list[Frame] = []
    for ev in events:
        _advance(stack, ev)
        yield tuple(stack)


def stack_changes(
    events: list[TimelineEvent],
) -> Iterator[tuple[float, list[Frame], list[Frame]]]:
    """``(t_ms, opened, closed)`` per event (closed innermost first); all closed at the end."""
    before: tuple[Frame, ...] = ()
    for ev, after in zip(events, stacks_after(events), strict=True):
        common = 0
        while common < min(len(before), len(after)) and before[common] == after[common]:
            common += 1
        closed = list(reversed(before[common:]))
        opened = list(after[common:])
        if closed or opened:
            yield ev.t_ms, opened, closed
        before = after
    if before:
        yield events[-1].t_ms, [], list(reversed(before))
