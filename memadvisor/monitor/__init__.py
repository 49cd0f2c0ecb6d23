"""Training-loop monitor and tracer: memory per iteration and per layer in the user's own loop.

``Monitor`` is light (counter reads per iteration, per-layer hooks only on the iterations it
prints); ``trace`` records every module's enter/exit for a timeline and speedscope exports,
the same :class:`~memadvisor.timeline.Timeline` the profiler produces.
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
