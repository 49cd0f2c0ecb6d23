"""Training-loop monitor and tracer: memory per iteration and per layer in the user's own loop.

``Monitor`` is light (one counter read and a few tuple appends per iteration; per-layer hooks
only on printed iterations, as often as a budget of the loop's time allows); ``trace``
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
