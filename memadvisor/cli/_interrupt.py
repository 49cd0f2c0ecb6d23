"""Ctrl-C in the CLI: wherever Python is when it comes, one line, exit 130, nothing half-done.

Python turns SIGINT into a KeyboardInterrupt raised in whatever the main thread runs at the
next bytecode boundary. Three kinds of place there lose it or mangle it, and a plan passes
through all of them thousands of times:

* **A weakref callback, a** ``__del__``, **a generator closed by the garbage collector.** An
  exception cannot leave one: Python prints "Exception ignored in ..." and carries on. The
  simulated device's :class:`~memadvisor.memory.MemoryMeter` counts every freed tensor in a
  weakref callback; an interrupt landing in one was dropped and the plan ran on to exit 0.
  C code that calls Python and clears its error (``PyObject_HasAttr``, ``PyDict_GetItem``)
  drops it the same way, without a word.
* **Code that** ``exec`` **or** ``eval`` **runs from a string.** ``dataclasses`` builds every
  ``__init__`` that way (hundreds while ``torch._dynamo`` imports, in the first profiled
  step). A KeyboardInterrupt leaving such code sets CPython's "unhandled KeyboardInterrupt"
  flag even when the caller catches it, and ``python -m`` then ends by SIGINT after
  finalizing, whatever its exit code: Popen's ``-2``, not 130. Each ``exec`` of a string
  clears that flag first, so :func:`say_interrupted` runs an empty one.
* **A library that catches it to report it**: optuna logs a failed trial with its traceback
  (the planner's search keeps optuna's log to errors for that reason).

What :func:`interrupts_handled` does about the first kind: the first SIGINT raises
KeyboardInterrupt as usual and starts a watchdog thread. Until :func:`say_interrupted` runs
(the command caught it), the watchdog has the handler run again every
:data:`REDELIVER_S` seconds, at once when the interrupt was reported as unraisable (whose
"Exception ignored" message is not printed). The handler then raises KeyboardInterrupt
again unless the main thread is handling an exception, which is the first interrupt on its
way up through ``finally`` blocks and ``__exit__`` methods: the cleanup that ends the
device's processes is never cut short by the watchdog.

Known limitations:
    * Only while :func:`interrupts_handled` is active (the CLI's ``main``): a Ctrl-C while
      Python imports the CLI itself ends with Python's own traceback.
    * An interrupt lost inside an ``except`` block that then runs for long is raised again
      only once that block ends.
    * A second Ctrl-C of the user's during the cleanup that the first one started
      interrupts that cleanup, as in any Python program.
"""

from __future__ import annotations

import _thread
import contextlib
import queue
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from rich.console import Console

__all__ = [
    "INTERRUPTED_EXIT_CODE",
    "INTERRUPTED_MESSAGE",
    "REDELIVER_S",
    "interrupted",
    "interrupts_handled",
    "raise_if_interrupted",
    "say_interrupted",
]

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, what a shell reports for Ctrl-C
INTERRUPTED_MESSAGE = "interrupted: stopped before finishing; no output file was left half-written."
REDELIVER_S = 0.25  # how often an interrupt that has not ended the command is raised again


class _State:
    active = False  # interrupts_handled is on
    received = False  # a SIGINT came while it was
    said = False  # the command caught it and the one line is out
    redelivering = False  # the next run of the handler is the watchdog's, not a signal's
    watchdog = False  # the watchdog thread is running
    previous_hook: Any = None  # sys.unraisablehook before interrupts_handled


_state = _State()
# Wakes the watchdog: True to redeliver now, False to end. SimpleQueue.put is reentrant,
# safe in a signal handler and in the unraisable hook, where a lock might be held already.
_wake: queue.SimpleQueue[bool] = queue.SimpleQueue()
_lock = threading.Lock()  # the watchdog's "still active?" and its trip, against the block's end


def _on_sigint(signum: int, frame: FrameType | None) -> None:
    redelivery, _state.redelivering = _state.redelivering, False
    if not redelivery:  # the user's Ctrl-C
        _state.received = True
        if not _state.watchdog:
            _state.watchdog = True
            _thread.start_new_thread(_watch, ())
        raise KeyboardInterrupt
    if _state.said or not _state.active:
        return  # the command has it already, or is over
    if sys.exc_info()[1] is not None:
        return  # it is on its way up (finally, __exit__): the cleanup runs undisturbed
    while frame is not None:
        if frame.f_code is _on_unraisable.__code__:
            _wake.put(True)  # raised in the hook it would be lost again: after it returns
            return
        frame = frame.f_back
    raise KeyboardInterrupt  # it was lost: raised again, here


def _on_unraisable(unraisable: Any) -> None:
    if isinstance(unraisable.exc_value, KeyboardInterrupt) and _state.active:
        _wake.put(True)  # lost where exceptions cannot propagate: raised again at once
        return  # and no "Exception ignored" message
    _state.previous_hook(unraisable)


def _watch() -> None:
    while True:
        try:
            if not _wake.get(timeout=REDELIVER_S):
                return
        except queue.Empty:
            pass
        with _lock:
            if not _state.active or _state.said:
                _state.watchdog = False
                return
            _state.redelivering = True
            _thread.interrupt_main(signal.SIGINT)  # _on_sigint runs in the main thread


@contextlib.contextmanager
def interrupts_handled() -> Iterator[None]:
    """Within the block, no Ctrl-C is lost (see the module docstring); restored after it.

    Only from the main thread (signal handlers can be set nowhere else); elsewhere a no-op.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous_handler = signal.signal(signal.SIGINT, _on_sigint)
    _state.previous_hook, sys.unraisablehook = sys.unraisablehook, _on_unraisable
    _state.received = _state.said = _state.redelivering = False
    _state.active = True
    try:
        yield
    finally:
        with _lock:
            _state.active = False
        if _state.watchdog:
            _wake.put(False)
        sys.unraisablehook = _state.previous_hook
        signal.signal(signal.SIGINT, previous_handler)


def interrupted() -> bool:
    """Whether a Ctrl-C came within :func:`interrupts_handled`."""
    return _state.received


def raise_if_interrupted() -> None:
    """Raise KeyboardInterrupt when a Ctrl-C came but the work went on: called before any
    output is written, so that an interrupt that a library swallowed leaves none.

    Raises:
        KeyboardInterrupt: a Ctrl-C came and the command has not caught one yet.
    """
    if _state.received and not _state.said:
        raise KeyboardInterrupt


def say_interrupted(console: Console) -> None:
    """Print the one line that says the command was interrupted: once within
    :func:`interrupts_handled`, however often it is called; each time outside it."""
    # Clears CPython's "unhandled KeyboardInterrupt" flag (module docstring): every exec of a
    # string resets it before running, and this one raises nothing to set it again.
    exec("")
    if _state.active and _state.said:
        return
    _state.said = _state.active
    console.print(INTERRUPTED_MESSAGE, highlight=False, soft_wrap=True)
