"""Training-loop monitor and tracer: memory per iteration and per layer in the user's own loop.

``Monitor`` is light (a reading of the allocator's counters and a tuple append per iteration,
or every few iterations on a card where a reading would cost more than 0.05% of the loop;
per-layer hooks only on printed iterations, as often as a budget of the loop's time allows;
rows, tables and CSV lines made in batches); ``trace``
records every module's enter/exit for a timeline and speedscope exports, the same
:class:`~memadvisor.timeline.Timeline` the profiler produces.
"""

from memadvisor.monitor._leak import LeakCheck
from memadvisor.monitor._monitor import Monitor
from memadvisor.monitor._schema import IterationRecord, LayerMemory, LeakReport, LeakSuspect
from memadvisor.monitor._trace import Tracer, trace

__all__ = [
    "IterationRecord",
    "LayerMemory",
    "LeakCheck",
    "LeakReport",
    "LeakSuspect",
    "Monitor",
    "Tracer",
    "trace",
]
