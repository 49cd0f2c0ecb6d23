"""One plan for the same inputs where the device's own times cannot rank (the simulated CPU).

The simulated device's step times are CPU times, slowed by its byte tracking: the planner
already ranks its candidates by the estimate instead (``best_on_device``). But the estimate's
step times came from the profile, which times the step on the same CPU, and that jitters
from one profile to the next by more than the gap between candidates: one process that
planned one small model 12 times got 6 different picks (issue 29).

So on that device the estimate's step times are modelled from the step's matmul FLOPs at a
card's rates, as ``device="estimate"`` models them (:func:`with_flop_times`): a function of
the model's shapes alone. Bytes, which decide every batch, are the profile's measurement as
before. The same inputs then give the same ranking, the same probes and the same pick; the
fixed tie rule (fewest strategies, then the choices' JSON: ``rank_key``) settles equal rates.

Known limitations:
    * A model that does not run under fake tensors (data-dependent shapes) keeps the CPU
      profile's times, and its picks may vary between runs; the plan says so.
    * The modelled times rank like a card's, not like this CPU's: they are not a prediction
      of the step time on either.
"""

from __future__ import annotations

from memadvisor.schema.profile import Profile, StepTimeModel
from memadvisor.workload import Workload

__all__ = ["STEADY_FALLBACK_NOTE", "with_times_that_rank"]

STEADY_FALLBACK_NOTE = (
    "The estimate's step times are this CPU's, as profiled (the model did not run under fake "
    "tensors to model them from its FLOPs: {why}): the same inputs may give another pick on "
    "another run."
)


def with_times_that_rank(workload: Workload, profile: Profile) -> tuple[Profile, str | None]:
    """``profile`` with step times modelled from its FLOPs, and None; or, when the model
    cannot run under fake tensors, ``profile`` unchanged and a note that says so."""
    from memadvisor.device.fake import fake_workload
    from memadvisor.planner._estimated import with_flop_times

    try:
        fake = fake_workload(workload)
        return with_flop_times(fake, profile, StepTimeModel()), None
    except Exception as e:  # noqa: BLE001 - any failure to model leaves the measured times
        return profile, STEADY_FALLBACK_NOTE.format(why=f"{type(e).__name__}: {e}")
