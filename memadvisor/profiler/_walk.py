"""The backward walk of a metered step: where memory stands as each block's backward runs.

The estimate needs more than the peak of backward: checkpointing a block frees its
activations for the whole forward and brings them back for its own backward, one block at
a time, while gradients grow. Which moment then holds the step's peak depends on the
candidate. So the metered step (no block checkpointed) records, relative to the live bytes
at the end of forward:

* for each block, the live bytes when its backward begins (its output's gradient is ready,
  seen by a tensor hook on the output) and the most live bytes until the next block's
  backward begins (the first block's window runs to the end of backward);
* the most live bytes before the first block's backward (the loss and the head);
* for each block, the bytes of its outputs that ops outside it saved (a saved-tensors pack
  hook notes which block was running when each storage was saved): what a checkpointed
  block still keeps after forward.

Known limitations:
    * Regions that install their own saved-tensors hooks (a model that checkpoints itself)
      hide what they save from the pack hook: their outputs count as not kept.
    * A block whose outputs need no gradient opens no window; its numbers are None.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator
from contextlib import contextmanager

import torch

from memadvisor.memory import MemoryMeter

__all__ = ["BackwardWalk"]

HEAD = -1  # the window before the first block's backward: the loss and the head


class BackwardWalk:
    """Follows one metered step's backward block by block (see the module docstring).

    Args:
        meter: the step's meter; :meth:`on_live` must be one of its listeners.
        n_blocks: how many blocks the step has.
        current_block: the index of the block whose forward is running, -1 outside blocks.
        storage_key: a tensor's storage identity, the one ``watch_output``'s ``made`` is keyed
            by; None for a storage the step did not make. Not ``id(storage)`` alone: a dead
            storage's id is reused by a later one, and an output then counted as kept or not
            by where Python's allocator put its wrapper (the same step gave another profile
            on each run).
    """

    def __init__(
        self,
        meter: MemoryMeter,
        n_blocks: int,
        current_block: Callable[[], int],
        storage_key: Callable[[torch.Tensor], Hashable | None] | None = None,
    ) -> None:
        self.meter = meter
        self.n_blocks = n_blocks
        self.current_block = current_block
        self.storage_key = storage_key or (lambda t: id(t.untyped_storage()))
        self.forward = True
        self.savers: dict[Hashable, set[int]] = {}  # storage key -> blocks that saved it
        self.outputs: list[dict[Hashable, int]] = [{} for _ in range(n_blocks)]
        self.end_of_forward: int | None = None
        self.window: list[int] | None = None  # [block, start, peak]
        self.start: list[int | None] = [None] * n_blocks
        self.peak: list[int | None] = [None] * n_blocks
        self.head_peak: int | None = None

    # -- forward ----------------------------------------------------------------------------

    @contextmanager
    def saving(self) -> Iterator[None]:
        """Note which block saves each storage while the step runs."""
        with torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack):
            yield

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.forward and tensor.device.type != "meta":
            key = self.storage_key(tensor)
            if key is not None:
                self.savers.setdefault(key, set()).add(self.current_block())
        return tensor  # the same tensor: saving it costs exactly what it costs without us

    def watch_output(self, block: int, outputs: Iterable[torch.Tensor], made: dict) -> None:
        """Open ``block``'s backward window when its outputs' gradient arrives.

        Args:
            block: the block's index.
            outputs: the tensors the block returned.
            made: ``{storage key: bytes}`` of the outputs the block itself made.
        """
        for key, nbytes in made.items():
            self.outputs[block][key] = nbytes
        for t in outputs:
            if t.requires_grad:
                t.register_hook(self._opener(block))

    def _opener(self, block: int) -> Callable[[torch.Tensor], None]:
        def hook(_grad: torch.Tensor) -> None:
            if self.window is None or self.window[0] != block:
                self._open(block)

        return hook

    # -- backward ---------------------------------------------------------------------------

    def begin_backward(self) -> None:
        """Forward (and the loss) are done: the walk's reference level is now."""
        self.forward = False
        self.end_of_forward = self.meter.live_bytes
        self.window = [HEAD, self.end_of_forward, self.end_of_forward]

    def end_backward(self) -> None:
        self._close()

    def on_live(self, live: int) -> None:
        """A meter listener: the running window's peak."""
        if self.window is not None and live > self.window[2]:
            self.window[2] = live

    def _open(self, block: int) -> None:
        self._close()
        live = self.meter.live_bytes
        self.window = [block, live, live]

    def _close(self) -> None:
        if self.window is None or self.end_of_forward is None:
            return
        block, start, peak = self.window
        self.window = None
        eof = self.end_of_forward
        if block == HEAD:
            self.head_peak = max(self.head_peak or 0, peak - eof)
            return
        if self.start[block] is None:
            self.start[block] = start - eof
        previous = self.peak[block]
        self.peak[block] = peak - eof if previous is None else max(previous, peak - eof)

    # -- results ----------------------------------------------------------------------------

    def output_kept(self) -> list[int]:
        """Per block: bytes of its own outputs that an op outside the block saved."""
        kept = []
        for block, outs in enumerate(self.outputs):
            kept.append(sum(n for key, n in outs.items() if self.savers.get(key, set()) - {block}))
        return kept


def _unpack(tensor: torch.Tensor) -> torch.Tensor:
    return tensor
