"""One micro-batch step of the plan, recorded module by module, for the HTML memory chart.

Shared by ``memadvisor plan --html`` and :meth:`memadvisor.planner.Plan.to_html`, so the two
write the same page.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING

from memadvisor.profiler import OpAllocation
from memadvisor.report._facts import MemorySeries, answer, series_from_timeline
from memadvisor.report._words import choices_lead

if TYPE_CHECKING:
    from memadvisor.schema.plan import Plan
    from memadvisor.workload import Workload

__all__ = ["PlannedStep", "planned_step"]


@dataclasses.dataclass
class PlannedStep:
    """What the HTML shows of the plan's own step."""

    series: MemorySeries
    ops: list[OpAllocation]


def planned_step(workload: Workload, plan: Plan, *, in_place: bool) -> PlannedStep:
    """The plan's step at its micro-batch, recorded on the device kind it was planned on:
    memory over the step, and the operations that allocate most.

    Args:
        workload: the model and its step, as planned.
        plan: the plan to apply before recording (applying twice changes nothing more).
        in_place: apply the plan to ``workload.model`` itself (the CLI built that model for
            this command alone); otherwise a deep copy is rewritten and the caller's model is
            left as it was.

    Raises:
        Whatever applying the plan or running the step raises; the caller decides whether a
        chart is worth failing over.
    """
    from memadvisor.apply import apply_plan
    from memadvisor.profiler import record_timeline, top_allocations

    a = answer(plan)
    if not in_place:
        workload = dataclasses.replace(workload, model=copy.deepcopy(workload.model))
    # Recorded where the device ran its tensors (a card, the CPU); else wherever torch can.
    ran_on = plan.capabilities.tensor_device
    device = ran_on if ran_on in ("cuda", "cpu") else "auto"
    apply_plan(workload.model, plan)
    # fp32 here: the applied plan's own autocast wraps the forward already.
    timeline = record_timeline(workload, batch_size=a.batch_size, device=device)
    series = series_from_timeline(
        timeline,
        caption=f"One step of the plan ({choices_lead(a)}micro-batch {a.batch_size}) "
        f"recorded module by module on {timeline.device}.",
    )
    ops = top_allocations(workload, batch_size=a.batch_size, device=device)
    return PlannedStep(series=series, ops=ops)
