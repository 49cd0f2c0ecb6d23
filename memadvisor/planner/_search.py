"""An Optuna study over the strategies' choices, scored on the estimate.

How the space is walked:

* Up to :data:`ENUMERATE_UP_TO` combinations: every one is scored. Scoring costs well under
  a millisecond (a few estimate calls; the batch is solved for, not sampled), so walking
  them all takes a second or two and finds the true best, where a sampler finds it only
  with luck. Enumeration is done by enqueuing each combination as a fixed trial
  (``study.enqueue_trial``) rather than with ``GridSampler`` or ``BruteForceSampler``,
  which re-read every finished trial at each suggestion and grow far slower with the
  number of trials (``docs/design.md``, "Enumerating the search space").
* A larger space (many strategies, third-party ones with many choices): ``TPESampler``
  for :data:`TPE_TRIALS` trials. Its choices are categorical and it models each strategy
  independently, which suits strategies whose effects mostly add up.

Both are seeded from ``PlanConfig.seed``, and the final ranking is a pure sort of what was
scored (objective, then the simpler plan, then the choices' JSON), so the same profile and
config give the same plan.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import optuna

from memadvisor.planner._budget import SHARD_COUNTS, ShardedFit, check_static_fits, infeasible
from memadvisor.planner._progress import Progress
from memadvisor.planner._space import Scored, SearchSpace

__all__ = ["ENUMERATE_UP_TO", "TPE_TRIALS", "ranked_or_infeasible", "search", "sharded_fit"]

ENUMERATE_UP_TO = 1024  # ~1.2 s of Optuna bookkeeping plus ~0.7 ms of estimates each
TPE_TRIALS = 256

Advance = Callable[[int], None]


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    # Optuna logs a line per trial; the planner shows its own progress. Its warnings are for
    # a failed trial, and the objective's error (or the user's Ctrl-C) is raised to the
    # planner anyway: printed here it would come twice, with a traceback. Put the user's
    # level back.
    level = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.ERROR)
    try:
        yield
    finally:
        optuna.logging.set_verbosity(level)


def _study(space: SearchSpace, seed: int) -> tuple[optuna.Study, int]:
    if space.size <= ENUMERATE_UP_TO:
        # Enqueued trials take their parameters as given; the sampler is never consulted.
        study = optuna.create_study(
            direction="maximize", sampler=optuna.samplers.RandomSampler(seed=seed)
        )
        for indices in space.combinations():
            study.enqueue_trial(dict(zip(space.names, indices, strict=True)))
        return study, space.size
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.TPESampler(seed=seed))
    return study, TPE_TRIALS


def search(space: SearchSpace, seed: int, advance: Advance | None = None) -> list[Scored]:
    """Every scored combination that fits at batch 1, best first, one per distinct choice set.

    Args:
        space: the strategies' choices and how to score them.
        seed: the sampler's seed.
        advance: called with 1 after each trial (progress).

    Returns:
        The ranking; empty when no combination fits even batch 1 under the usable budget.
    """
    names = space.names
    if not names:  # no strategy to choose for: the plain step is the only candidate
        only = space.score(())
        return [only] if only is not None else []

    def objective(trial: optuna.Trial) -> float:
        indices = [
            trial.suggest_categorical(name, list(range(len(space.options[name])))) for name in names
        ]
        scored = space.score(indices)
        if advance is not None:
            advance(1)
        if scored is None:
            return -1.0  # does not fit at batch 1: below every feasible value (all >= 0)
        if space.config.objective == "largest_batch":
            return float(scored.candidate.batch_size)
        return scored.estimate.samples_per_s

    with _quiet_optuna():
        study, n_trials = _study(space, seed)
        study.optimize(objective, n_trials=n_trials, show_progress_bar=False)

    best: dict[str, Scored] = {}
    for trial in study.trials:
        scored = space.score([trial.params[name] for name in names])  # cached: not re-scored
        if scored is not None:
            best.setdefault(scored.choices_json, scored)
    return sorted(best.values(), key=space.key)


def ranked_or_infeasible(space: SearchSpace, ui: Progress) -> list[Scored]:
    """:func:`search` under the plan's "search" progress stage, once the static bytes are
    known to fit: the ranking, never empty.

    Raises:
        InfeasibleBudgetError: the weights, gradients and optimizer state alone exceed the
            budget, or no combination fits even batch 1; the message names the minimum
            budget and what would shrink the static bytes.
    """
    profile, config = space.profile, space.config
    cheapest = space.cheapest_peak_bytes()
    if profile.static_bytes > config.usable_bytes and not config.may_shard:
        check_static_fits(profile, config, cheapest, sharded_fit(space))
    with ui.stage("search", total=None) as bar:
        ranked = search(space, config.seed, bar.advance)
    if not ranked:
        raise infeasible(
            profile,
            config,
            cheapest,
            "By the estimate no configuration fits even batch 1.",
            sharded_fit(space),
        )
    return ranked


def sharded_fit(space: SearchSpace) -> ShardedFit | None:
    """The fewest FSDP2 ranks (of :data:`SHARD_COUNTS`, more than the plan's own) whose
    cheapest per-rank estimate at batch 1 fits the usable budget; None when none does, or
    when no strategy of the space plans ranks (its choices do not change with them).

    The space is asked as it is, with the world size and ``parallel`` changed: the answer is
    the same per-rank estimate a plan at that world size searches.
    """
    profile, config, strategies = space.profile, space.config, space.strategies
    alone = SearchSpace(
        profile, strategies, config.model_copy(update=dict(world_size=1, parallel="none"))
    )
    own = config.world_size if config.may_shard else 1
    for world_size in (n for n in SHARD_COUNTS if n > own):
        # PlanConfig's fields by keyword: the planner spells no strategy's name.
        update = dict(world_size=world_size, parallel="fsdp2")
        sharded = SearchSpace(profile, strategies, config.model_copy(update=update))
        if sharded.options == alone.options:
            return None  # nothing here plans ranks
        peak = sharded.cheapest_peak_bytes()
        if peak <= config.usable_bytes:
            return ShardedFit(world_size, peak)
    return None
