"""The ``memadvisor`` logger: the planner's notes and stage lines, the Python way.

Library code logs; it does not configure logging. The logger has a ``NullHandler`` only,
so nothing shows until the application says so, as in any library (transformers and
Lightning route theirs the same way)::

    logging.basicConfig(level=logging.INFO)             # everything, to stderr
    logging.getLogger("memadvisor").setLevel(logging.WARNING)   # or: memadvisor quiet

What goes to it, whoever watches:
    * INFO: each note the plan shows a person (that it plans on the simulated device, a
      step-down, a fallback), each stage as it starts and ends with its wall time, and the
      pick in one line when the plan is made.
    * DEBUG: finer progress inside a stage (each profiling step, each probe's words).

The CLI and ``memadvisor.plan(progress=True)`` also draw rich bars on stderr; the integrations
(HF, Lightning) draw none by default and leave the logger to carry the same lines.

Known limitations:
    * Rich markup in a note (``[dim]``) is stripped for the log; a note whose brackets are
      not markup is logged as written.
"""

from __future__ import annotations

import logging

from rich.errors import MarkupError
from rich.text import Text

__all__ = ["logger", "plain"]

logger = logging.getLogger("memadvisor")
logger.addHandler(logging.NullHandler())


def plain(text: str) -> str:
    """``text`` without rich markup, for a log line."""
    try:
        return Text.from_markup(text).plain
    except MarkupError:
        return text
