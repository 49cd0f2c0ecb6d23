"""CUDA graphs for a compiled pick whose card waits on the host: measured, kept when faster.

Why: a compiled step launches its kernels from one Python thread. Where that thread needs
about the whole step to launch them, the card idles between kernels and the step's time is
the host's: the GPT example's compiled pick on an H200 (session 28 call 5) took 0.994 of
each step to launch it while its kernels filled 0.62-0.75 of the step, and its rate moved
1.2-1.4x with the host it ran on. Compiled in ``reduce-overhead`` mode (CUDA graphs: the
step's kernels recorded once, then replayed with one launch), the same pick at batch 240
ran 30,485 samples/s against 20,308 in default mode at that batch, its kernels 0.92 of the
step, and at batch 170 27,576 against 12,550 (session 29 call 2, ``docs/design.md``, "CUDA
graphs where the card waits on the host"). But CUDA graphs keep a private memory pool and
static buffers alive between steps: at the pick's own batch, 307, they ran out of 8 GiB
(session 29 call 1). So the graphs form is another configuration, with a batch of its own.

What :func:`graphs_pick` does, after the compile stage has confirmed its pick, or, where
compiling in default mode did not beat the eager pick, on the best compiled configuration
the search ran, against the eager pick (a step that waits on the host is about as slow
compiled as eager: the GPT example on one H200 lease, session 30, compiled 0.95x eager at
0.996 of its step launching, eager 0.92):

1. Reads the pick's own run: the host's share of a step (``Measurement.host_ms`` over
   ``step_ms``, the device's probes time both). Below :attr:`CompileSearch.host_bound_share`
   the card was busy through the step, and graphs, which save launches only, are not tried
   (nothing is run). But where graphs runs of the pick's own choices were made ahead (bets,
   below) and one held within the limit, that run is weighed, as a compile is against eager
   (``beats_eager``, :data:`~strategies._compile_search.MIN_SPEEDUP`), at no run more
   (:func:`_made_under_bar`).
2. Otherwise runs the pick's choices with the compile mode ``reduce-overhead`` at
   :data:`START_SHARE` of the pick's batch (graphs hold more than the form they replay).
   Where it held, a line through that run's reserved bytes (the graphs' pool keeps segments
   nothing else may use: at batch 230 the GPT example allocated 6.17 GB and reserved 7.78)
   and the pick's fixed bytes says the largest batch within the budget's limit. The device's
   batch search (``PickStage.confirm``) starts there, never above it nor the pick's batch,
   and never descends below the run that held; where that run ran out, the search starts at
   half of it. In all at most :attr:`CompileSearch.graphs_runs` runs. Where the device
   makes runs at once, a run at :data:`GUESS_SHARE` of the pick's batch goes with the first
   (one round of compiles, not two, where it holds).
   Where the device makes runs at once, that first round is made ahead, as a bet, beside a
   static run of the leading candidate at its predicted batch, where that candidate's own
   runs waited on the host (:func:`first_round`): with pass 2 (beside its static rider, or
   its own static run), else beside the confirmation's first run, else beside the pick's
   static run. One round of bets per graphs form. The graphs search then starts from what
   they found (the largest that held, below the lowest that ran out), at whatever batch the
   pick ended: the GPT example's plans on an H200 came down from 111.9-121.2 s to 69.5 s
   where the graphs rode pass 2 (session 31). Where the bets rode pass 2 and the
   confirmation then runs on the device, the graphs search's first run after them (its
   line's aim) goes with the confirmation's first run (:func:`next_round`), not after it.
   Where pass 1 leaves the device runs free and the eager pick's runs waited on the host,
   the bets ride pass 1 instead, for its first candidate searched static (the guess alone
   in a room of one, :func:`bets_within`; ``Search._pass_one_bets``): the GPT example's
   plans on an H200 then took one compiled round, 52.0-74.0 s (session 35). A bet that held
   is the answer where its line allows no 5% more (:func:`_settled`); where every bet ran
   out, the search's first round is made below the failure (:func:`_fresh`).
   Where the graphs run that held still waited on the host as much as the bar, graphs did
   not relieve it, and the search makes no run more (:func:`waits_on_host`): t5_base's did
   not, the GPT example's did. Where no graphs run of the pick was made but the bets on
   another checkpointed set of the same form held and all still waited so, no graphs run is
   made at all (:func:`waited_elsewhere`).
3. The graphs form is the pick where it reaches :data:`HOST_BOUND_TIE` of the static
   pick's rate (a host-bound rate is the host's: the user's loop does not keep it), or, where
   it must beat the eager pick, as a compile beats eager (``beats_eager``:
   :data:`~strategies._compile_search.MIN_SPEEDUP` of its rate). For ``largest_batch``, a
   larger batch, which graphs never have. Its run is the pick's verification, as the static
   form's was.

Known limitations:
    * A bet made beside a static run is a device run spent where the candidate is not the
      pick, or where its static run then reads below the host's share: the summary says so.
      Where its batch moved, the bet still bounds the graphs search but may aim it lower
      than a first round at the pick's own batch would.
    * The host's share is read from the probes' steps, which wait for the card after each
      step: a step whose kernels fill the launch queue (about a thousand kernels pending)
      blocks the host on the card and reads as host-bound. Graphs are then tried and kept
      only where faster: the plan is longer by their runs, the pick no worse.
    * Whether a step waits on the host depends on the host the plan runs on: on one H200
      lease the GPT example's pick took 0.87 of its step to launch (graphs not tried, the
      pick 34,534 samples/s), on others 0.99 (24-26k). A plan made on a fast host keeps the
      default mode for a user whose host is slower.
    * The line is a line: the GPT example's graphs held 154 and 230 and ran out at 307 (its
      default-mode pick's batch), so an aimed run can run out, and the search then bisects
      down to the run that held (session 29 call 4).
    * Each graphs run compiles afresh (a static graph per batch, and the mode is in
      inductor's cache key) and records its graphs in its first steps: tens of seconds a
      run on a card.
    * Only a pick in ``default`` mode with a static batch is tried: the budget and regional
      forms keep their settings and take ``reduce-overhead`` as their mode.
    * In the user's loop, CUDA graphs overwrite a step's outputs at the next step: a loss
      kept as a tensor past the next step (``losses.append(loss)``) reads an error, not a
      number; ``loss.item()`` or ``loss.detach().clone()`` before it is safe. The advice
      says so.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import JsonValue

from memadvisor.errors import is_our_bug
from memadvisor.schema.candidate import Measurement
from memadvisor.schema.config import samples_per_s
from memadvisor.schema.plan import Probe
from memadvisor.strategy import Confirmed, PickStage
from memadvisor.units import fmt_ms
from strategies._compile_search import (
    COMPILE,
    MIN_SPEEDUP,
    CompileSearch,
    beats_eager,
    first_line,
    recompute_axis,
    recomputed_count,
)
from strategies._compiled_forward import parse_choice

__all__ = [
    "GRAPHS_MODE",
    "GUESS_SHARE",
    "HOST_BOUND_TIE",
    "SAID_SHARE",
    "START_SHARE",
    "Graphs",
    "Elsewhere",
    "bets_within",
    "first_round",
    "graphs_form",
    "graphs_of",
    "next_round",
    "graphs_pick",
    "held_rates",
    "waited_elsewhere",
    "waits_on_host",
    "host_share",
]

#: torch.compile's mode that replays the step as CUDA graphs and keeps no autotuning.
GRAPHS_MODE = "reduce-overhead"
#: The graphs form's first run is at this share of the pick's batch, low enough to hold where
#: graphs need far more than the form they replay: the GPT example's graphs ran out of 8 GiB
#: at its pick's 307 and held at 154 and 230 (session 29, H200).
START_SHARE = 0.5
#: Where the device makes runs at once, a second graphs run goes with the first, at this
#: share of the pick's batch: what the line through the first run found for the GPT example
#: (b246-248 of a default-mode pick at 307, sessions 29-30 on H200s; its graphs ran out at
#: 307 and held at 230), so where it holds the search needs no second round of compiles
#: (about 25 s each). One model's share: where a line allows 5% more, a run left tries it.
GUESS_SHARE = 0.8
#: Against a compiled pick that waited on the host, graphs are the pick at this share of its
#: rate or more (the compile is paid either way). A host-bound rate is the host's, and the
#: user's loop does not keep it: the GPT example's host-bound default-mode picks ran
#: 0.70-0.99 of their verified rates in the user's 200-step loop, median about 0.85
#: (sessions 29-31, thirteen loops on H200 leases), its graphs picks 0.95-1.02, median 1.00
#: (eight loops, sessions 30-31). So graphs at 0.90 of a host-bound rate are expected to run
#: no slower in the loop. 0.97 (session 30), then 0.95, kept default-mode picks over graphs
#: at 0.967, 0.939 and 0.941 of their rates, and those picks' loops ran 0.90, 0.80 and 0.76
#: of verified (session 31 calls 1 and 3). Against the eager pick a compile must still pay
#: (MIN_SPEEDUP).
HOST_BOUND_TIE = 0.90
#: A graphs run that held is the search's answer where a line through it allows no more than
#: this share above its batch: a run more (a compile of its own, about 20-25 s on a card)
#: for 5% of the batch, which the line may not keep.
LINE_WITHIN = 0.05
#: A pick whose host took this share of its step or more, under
#: :attr:`CompileSearch.host_bound_share`, is said to be partly the host's in the summary
#: (graphs not tried): at half the step or more, the host's speed sets at least that half.
SAID_SHARE = 0.5


@dataclass(frozen=True)
class Graphs:
    """What the graphs step found for a compiled pick."""

    host_share: float | None  # the pick's host time over its step (None: not recorded)
    tried: bool  # whether graphs ran on the device
    found: Confirmed | None = None  # the graphs form at the largest batch its search allows
    wins: bool = False  # the graphs form is the pick
    error: str | None = None  # why its runs failed, where they did
    against: str = "compiled"  # what it had to beat: the compiled pick, or "eager"
    # Not tried for the host's share alone: the share at which graphs are tried (else None).
    bar: float | None = None
    # The host's share of the found graphs run's step, where it still reached the bar (the
    # search makes no run after such a run: :func:`waits_on_host`); else None.
    still_waits: float | None = None
    # Not tried because the graphs of another checkpointed set, made ahead in the same form,
    # still waited on the host (:func:`waited_elsewhere`); else None.
    elsewhere: Elsewhere | None = None
    # Found among runs made ahead, for a pick under the host's bar (:func:`_made_under_bar`):
    # that bar, said in the words (else None).
    made_under: float | None = None


@dataclass(frozen=True)
class Elsewhere:
    """A graphs run of the pick's form with another checkpointed set that held, still took
    the bar's share of its step to launch it and ran under the tie with that set's default
    mode (:func:`waited_elsewhere`)."""

    blocks: int  # how many blocks that run checkpointed
    batch: int
    share: float  # its host time over its step


def host_share(measured: Measurement) -> float | None:
    """The share of ``measured``'s step the host took to hand the step to the device
    (None: the run did not record it)."""
    if measured.host_ms is None or measured.step_ms <= 0:
        return None
    return measured.host_ms / measured.step_ms


def graphs_form(choice: JsonValue) -> JsonValue | None:
    """``choice`` in ``reduce-overhead`` mode; None where it is not a static default-mode
    compile (off, dynamic, or another mode already)."""
    parsed = parse_choice(choice)
    if parsed is None or parsed.mode != "default" or parsed.dynamic_batch:
        return None
    return parsed.model_copy(update={"mode": GRAPHS_MODE}).to_json()


def graphs_pick(
    stage: PickStage,
    settings: CompileSearch,
    pick: Confirmed,
    objective: str,
    fixed_bytes: int | None = None,
    against: Confirmed | None = None,
) -> Graphs:
    """The compiled ``pick`` replayed as CUDA graphs, where its card waited on the host
    (module docstring); ``Graphs.wins`` says whether that is the pick. ``fixed_bytes``: the
    pick's bytes held whatever the batch, from its line (None: none, a line through zero).
    ``against``: the pick the graphs form must beat, where that is not ``pick`` itself: the
    eager pick, where compiling in default mode did not pay (``pick`` is then the best
    compiled configuration the search ran, its run the host's share)."""
    beaten = "eager" if against is not None and against is not pick else "compiled"
    against = against if against is not None else pick
    share = host_share(pick.measured)
    choices = _graphs_choices(settings, pick.candidate.choices, share)
    if choices is None:
        made = _made_under_bar(stage, settings, pick, objective, against, share)
        if made is not None:
            return dataclasses.replace(made, against=beaten)
        # Under the bar alone where the pick has a graphs form: the summary says so of a
        # compiled pick (against eager, the pick is eager's and the share not its own).
        under = (
            beaten == "compiled"
            and share is not None
            and graphs_of(settings, pick.candidate.choices) is not None
        )
        bar = settings.host_bound_share if under else None
        return Graphs(host_share=share, tried=False, against=beaten, bar=bar)
    elsewhere = waited_elsewhere(stage, settings, choices)
    if elsewhere is not None:
        stage.describe(
            f"compile: CUDA graphs not tried: those of {_blocks_words(elsewhere.blocks)} "
            f"still waited on the host ({elsewhere.share:.0%} of a step to launch it)"
        )
        return Graphs(host_share=share, tried=False, against=beaten, elsewhere=elsewhere)
    batch = pick.candidate.batch_size
    stage.describe(
        f"compile: CUDA graphs, the card waited on the host ({share:.0%} of a step to launch it)"
    )
    try:
        found = _largest(stage, settings, choices, batch, against, fixed_bytes or 0)
    except Exception as e:  # noqa: BLE001 - a graphs form that fails keeps the static pick
        if is_our_bug(e):
            raise
        return Graphs(host_share=share, tried=True, error=first_line(e), against=beaten)
    if found is None:
        return Graphs(host_share=share, tried=True, against=beaten)
    still = _waiting_share(settings, found.measured)
    rate = found.measured.samples_per_s
    # The compile is paid where the pick is compiled: graphs need only match its rate, within
    # what a host-bound rate moves by (HOST_BOUND_TIE).
    allowance = HOST_BOUND_TIE / MIN_SPEEDUP if beaten == "compiled" else 1.0
    wins = beats_eager(objective, found.candidate.batch_size, rate, against, allowance)
    return Graphs(
        host_share=share, tried=True, found=found, wins=wins, against=beaten, still_waits=still
    )


def _made_under_bar(
    stage: PickStage,
    settings: CompileSearch,
    pick: Confirmed,
    objective: str,
    against: Confirmed,
    share: float | None,
) -> Graphs | None:
    """The graphs form of ``pick``, whose host took ``share`` of its step, under
    :attr:`CompileSearch.host_bound_share`, where runs of it were made ahead (bets, beside a
    confirmation or a static run) and the largest that held below the lowest that ran out
    (:func:`_from_made_bounds`), within the pick's limit (``PickStage.confirm`` with no run
    left), ran :data:`~strategies._compile_search.MIN_SPEEDUP` faster than ``against`` (a
    compile's bar against eager, not :data:`HOST_BOUND_TIE`: the pick's rate is not the
    host's); None elsewhere, and no device run either way.

    Why: the bets go with a candidate whose own runs waited on the host, and the pick may
    then read under the bar at its own batch, the graphs runs made and left unused. hf_gpt2
    on H200s (session 42 call A, session 43 call C): bf16, 4 blocks checkpointed, 2267, its
    host 0.75-0.79 of a step, 120,487-122,891 samples/s, where its graphs form, made ahead
    beside the confirmation at 2768, held 8.07 GB allocated and ran 123,710-129,716, 1.02-1.08x;
    the hand grid's best was 135,000.

    Known limitations: the runs made ahead are a bet's batches (the confirmation's line), not
    the graphs form's own edge; they were timed beside the group's other runs, in turn."""
    graphs = graphs_of(settings, pick.candidate.choices)
    if graphs is None or share is None or objective == "largest_batch":
        return None
    made = _made(stage, graphs)
    if not made:
        return None
    # The largest that held below the lowest that ran out, as the graphs search's own start.
    _, _, start = _from_made_bounds(made, max(made))
    if start is None:
        return None
    # No run left: answered from the runs made (PickStage.confirm's max_runs).
    found = stage.confirm(graphs, start, like=against, max_runs=0, ceiling=start)
    if found is None:
        return None
    rate = found.measured.samples_per_s
    if not beats_eager(objective, found.candidate.batch_size, rate, against):
        return None
    return Graphs(
        host_share=share,
        tried=True,
        found=found,
        wins=True,
        made_under=settings.host_bound_share,
    )


def _stops(stage: PickStage, settings: CompileSearch, measured: Measurement | None) -> bool:
    """:func:`waits_on_host`, said on the progress line where it stops the graphs search."""
    share = _waiting_share(settings, measured)
    if share is None:
        return False
    stage.describe(
        f"compile: CUDA graphs still waited on the host ({share:.0%} of a step to launch it): "
        "no graphs run more"
    )
    return True


def waited_elsewhere(
    stage: PickStage, settings: CompileSearch, choices: dict[str, JsonValue]
) -> Elsewhere | None:
    """Where no graphs run of ``choices`` (a pick's graphs form) was made, and the graphs
    runs the stage made of the same choices with another checkpointed set (the bets, made
    ahead on the candidate that led before the runs were read) that held all still waited on
    the host as much as the bar (:func:`_waiting_share`) and ran under :data:`HOST_BOUND_TIE`
    of their own set's best default-mode run (graphs would not have been its pick): the one
    that waited least; else None. :func:`graphs_pick` then makes no graphs run.

    Why: under graphs a step whose host still takes that share spends its host time outside
    the kernels' launches (:func:`_waiting_share`), and that is the form's and the model's,
    not the checkpointed set's: t5_base on an H200 (session 37 call 1) had its bet, 24
    blocks checkpointed replayed as graphs at 26, hold at 0.83 of its step on the host and
    124.7 samples/s, against 160.2 for 24 blocks in default mode at 36; its pick, 21 blocks,
    then had its graphs searched in a round of their own (18 held at 0.87, 30 ran out: 31.5
    s of a 225 s plan) for 0.57x the default mode's rate. Every t5_base graphs run on a
    card read 0.78-0.87 of its step on the host, every GPT example's 0.48-0.67 (sessions
    36-37).

    Known limitations: another set's runs stand for the pick's; a set whose graphs would
    pay where the bet's did not (a pick far less checkpointed than the bet) is not tried."""
    if _made(stage, choices) or not stage.probes:
        return None
    axis = recompute_axis(stage)
    if axis is None:  # nothing in this plan recomputes blocks: no other set to read
        return None
    mine = _without(choices, axis[0])
    found: list[Elsewhere] = []
    for p in stage.probes:
        other = p.candidate.choices if p.candidate is not None else None
        if other is None or other == choices or _without(other, axis[0]) != mine:
            continue
        if not p.fits or p.step_ms is None or p.host_ms is None or p.step_ms <= 0:
            continue  # a run that ran out, or unread: it says nothing of the host
        share = p.host_ms / p.step_ms
        if share < settings.host_bound_share:
            return None  # graphs relieved the form's host there
        default = _default_rate(stage, settings, other)
        if default is None or samples_per_s(p.batch_size, p.step_ms) >= HOST_BOUND_TIE * default:
            return None  # graphs could have been that set's pick: the pick's may be too
        blocks = recomputed_count(other, stage.strategies)
        found.append(Elsewhere(blocks=blocks, batch=p.batch_size, share=share))
    return min(found, key=lambda e: e.share) if found else None


def _default_rate(
    stage: PickStage, settings: CompileSearch, graphs: dict[str, JsonValue]
) -> float | None:
    """The best samples/s of the stage's runs that held whose graphs form is ``graphs`` (its
    static default-mode form); None where none was timed."""
    rates = held_rates(stage, lambda p: graphs_of(settings, p.candidate.choices) == graphs)
    return max(rates) if rates else None


def held_rates(stage: PickStage, keep: Callable[[Probe], bool]) -> list[float]:
    """The samples/s of the stage's runs that held and were timed, of those ``keep`` takes
    (a run with a candidate)."""
    return [
        samples_per_s(p.batch_size, p.step_ms)
        for p in stage.probes
        if p.fits and p.step_ms and p.candidate is not None and keep(p)
    ]


def _without(choices: dict[str, JsonValue], axis: str) -> dict[str, JsonValue]:
    """``choices`` but the recompute axis's (``axis``: the strategy that checkpoints)."""
    return {k: v for k, v in choices.items() if k != axis}


def _blocks_words(blocks: int) -> str:
    if not blocks:
        return "no checkpointing"
    return f"{blocks} block{'s' if blocks != 1 else ''} checkpointed"


def waits_on_host(settings: CompileSearch, measured: Measurement | None) -> bool:
    """Whether a run that held (``measured``) waited on the host as much as the bar that
    tries graphs (:func:`_waiting_share`): a default-mode run whose graphs may be tried, or
    a graphs run that still waited, after which the graphs search makes no run more."""
    return _waiting_share(settings, measured) is not None


def _waiting_share(settings: CompileSearch, measured: Measurement | None) -> float | None:
    """The host's share of a graphs run that held (``measured``), where it still waited on
    the host as much as the bar that tried graphs (:attr:`CompileSearch.host_bound_share`);
    else None. After such a run the graphs search makes no run more, and answers from the
    runs made.

    Why: graphs save the kernels' launches, and a step whose host still takes that share
    under them spends its host time elsewhere (Python around the compiled regions, their
    replays' own checks), which a larger graphs batch does not change. t5_base's compiled
    pick on an H200 (session 34 call 3) took 0.83 of its step to launch it in default mode
    and 0.81 under graphs, its card busy 0.68 and 0.56 of the step, about 5,070 kernels a
    step either way, no graph skipped (call 4); its graphs ran 0.72-0.89x the default mode in
    every plan that tried them, a round of their compiles alone after the compile stage in
    one (34 s, then a second cut by the bench's limit: call 2). The GPT example's graphs,
    which pay (1.07x in session 30, 1.14x in session 34 call 5, where this rule let its
    search go on), replay its whole step: the card's kernels filled 0.92 of it (session
    29)."""
    if measured is None:
        return None
    share = host_share(measured)
    return share if share is not None and share >= settings.host_bound_share else None


def first_round(
    stage: PickStage,
    settings: CompileSearch,
    choices: dict[str, JsonValue],
    batch: int,
    measured: Measurement,
) -> list[tuple[dict[str, JsonValue], int]]:
    """The graphs runs :func:`graphs_pick` makes first for a pick of ``choices`` (a static
    default-mode form) at ``batch``, where ``measured`` (a run of that pick, or of its
    dynamic-batch form) waited on the host as :func:`graphs_pick` asks; [] where graphs would
    not be tried on it.

    Why: the pick's static form is run alone to verify it (``Search.confirm_static``), a
    compile of its own, and the graphs' first runs, compiles of their own, waited for it: the
    GPT example on an H200 (session 31 call 1) ran its static form at 251 (18.3 s), then the
    graphs at 126 and 201 (22.4 s). Made beside it, the graphs step finds them made
    (``PickStage.run_many`` answers a run made already)."""
    graphs = _graphs_choices(settings, choices, host_share(measured))
    if graphs is None or _made(stage, graphs):  # one bet per graphs form: the first made
        return []
    if waited_elsewhere(stage, settings, graphs) is not None:  # graphs_pick makes none
        return []
    return [(graphs, b) for b in _first_batches(stage, settings, batch)]


def bets_within(
    stage: PickStage,
    settings: CompileSearch,
    choices: dict[str, JsonValue],
    batch: int,
    measured: Measurement,
    room: int,
) -> list[tuple[dict[str, JsonValue], int]]:
    """:func:`first_round` within ``room`` runs: where it has room for one of its two, the
    guess (:data:`GUESS_SHARE` of ``batch``), which where it holds is the graphs search's
    answer unless a line through it allows 5% more (:func:`_from_made`); the start alone,
    where it holds, leaves the line's aim to a round of its own. ``measured``: a run whose
    host's share says whether graphs are tried (pass 1's bets read the eager pick's)."""
    runs = first_round(stage, settings, choices, batch, measured)
    if room <= 0:
        return []
    return runs[-room:] if room < len(runs) else runs


def _made(stage: PickStage, choices: dict[str, JsonValue]) -> dict[int, bool]:
    """The runs of ``choices`` the stage made: whether each batch held."""
    return {
        p.batch_size: p.fits
        for p in stage.probes
        if p.candidate is not None and p.candidate.choices == choices
    }


def _graphs_choices(
    settings: CompileSearch, choices: dict[str, JsonValue], share: float | None
) -> dict[str, JsonValue] | None:
    """``choices`` in :data:`GRAPHS_MODE`, where graphs are tried on a pick of them whose
    host took ``share`` of its step; None where not (switched off, below the share, not
    recorded, or not a static default-mode form)."""
    if share is None or share < settings.host_bound_share:
        return None
    return graphs_of(settings, choices)


def graphs_of(
    settings: CompileSearch, choices: dict[str, JsonValue]
) -> dict[str, JsonValue] | None:
    """``choices`` in :data:`GRAPHS_MODE` whatever the host's share; None where graphs are
    switched off or ``choices`` are not a static default-mode form."""
    form = graphs_form(choices.get(COMPILE))
    if not settings.graphs_when_host_bound or form is None:
        return None
    return {**choices, COMPILE: form}


def _first_batches(stage: PickStage, settings: CompileSearch, batch: int) -> list[int]:
    """The batches of the graphs' first round for a pick at ``batch``: :data:`START_SHARE`
    of it, and :data:`GUESS_SHARE` of it with it where the device makes runs at once."""
    start = max(1, round(START_SHARE * batch))
    guess = round(GUESS_SHARE * batch)
    if stage.concurrent_runs > 1 and settings.graphs_runs >= 2 and start < guess:
        return [start, guess]
    return [start]


def _largest(
    stage: PickStage,
    settings: CompileSearch,
    choices: dict[str, JsonValue],
    batch: int,
    like: Confirmed,
    fixed_bytes: int,
) -> Confirmed | None:
    """The largest batch of ``choices`` (the graphs form of a pick at ``batch``) that holds,
    in at most ``settings.graphs_runs`` runs: one at :data:`START_SHARE` of ``batch``; where
    it held, a line through its reserved bytes and the pick's ``fixed_bytes`` says the batch
    to confirm from (the graphs' pool grows with the batch), no higher than ``batch`` (graphs
    hold more than the form they replay), and the batch search descends from there no lower
    than that run; where it ran out, the search starts at half of it (where the device makes
    runs at once, a run at :data:`GUESS_SHARE` of ``batch`` goes with the first; where it
    held it is the answer unless the line allows 5% more). Where graphs runs of ``choices``
    were made ahead (:func:`first_round`), they are that first round (:func:`_from_made`).
    ``like``: the confirmed pick whose batch, where the search comes to it, is known to hold
    its bytes (``PickStage.confirm``)."""
    made = _made(stage, choices)
    if made:  # made ahead, beside a static run (first_round), maybe at another pick's batch
        return _from_made(stage, settings, choices, made, batch, like, fixed_bytes)
    return _fresh(stage, settings, choices, batch, batch, like, fixed_bytes, settings.graphs_runs)


def _fresh(
    stage: PickStage,
    settings: CompileSearch,
    choices: dict[str, JsonValue],
    batch: int,
    cap: int,
    like: Confirmed,
    fixed_bytes: int,
    runs: int,
) -> Confirmed | None:
    """:func:`_largest`'s search from no graphs run that held, in at most ``runs`` runs: its
    first round at :data:`START_SHARE` (and :data:`GUESS_SHARE`, where the device makes runs
    at once) of ``batch``, then the line's aim, no higher than ``cap``."""
    first_batches = _fresh_batches(stage, settings, batch, runs)
    start = first_batches[0]
    if len(first_batches) == 2:
        # The guess goes with the first run: one compile's wall for both.
        guess = first_batches[1]
        answers = stage.run_many([(choices, start), (choices, guess)])
        for answer in answers:
            if isinstance(answer, Exception):
                raise answer
        first, at_guess = answers
        assert not isinstance(first, Exception) and not isinstance(at_guess, Exception)
        left = runs - 2
        if at_guess is None:  # from the line below the guess, as from a first run alone
            left = 0 if _stops(stage, settings, first) else left
            return _after_first(stage, choices, like, first, start, fixed_bytes, left, guess - 1)
        left = 0 if _stops(stage, settings, at_guess) else left
        aim = guess  # held: the answer, unless the line allows 5% more and a run is left
        if first is not None and left > 0:
            line = _line_aim(stage, first, start, cap, fixed_bytes)
            aim = line if line > (1 + LINE_WITHIN) * guess else guess
        return stage.confirm(
            choices, aim, like=like, max_runs=left, within=LINE_WITHIN, ceiling=aim
        )
    first = stage.run(choices, start)
    # With no run left, each confirm answers from the runs made (the first, where it held).
    left = 0 if _stops(stage, settings, first) else runs - 1
    return _after_first(stage, choices, like, first, start, fixed_bytes, left, cap)


def _fresh_batches(stage: PickStage, settings: CompileSearch, batch: int, runs: int) -> list[int]:
    """The batches of :func:`_fresh`'s first round for ``batch`` within ``runs`` runs: the
    guess goes with the start only where two runs are left (:func:`_first_batches`)."""
    first = _first_batches(stage, settings, batch)
    return first if runs >= 2 else first[:1]


def _from_made(
    stage: PickStage,
    settings: CompileSearch,
    choices: dict[str, JsonValue],
    made: dict[int, bool],
    batch: int,
    like: Confirmed,
    fixed_bytes: int,
) -> Confirmed | None:
    """:func:`_largest` from the graphs runs ``made`` ahead (``first_round``: by batch,
    whether it held), in at most ``settings.graphs_runs`` runs more (none where the one that
    held still waited on the host: :func:`waits_on_host`): the largest that held
    at or below ``batch`` is the first run, the search capped below the lowest that ran out;
    where none held, a first round as from nothing (:func:`_fresh`), of that one's batch
    (or ``batch``, where lower).

    Why: they went beside the static run of the candidate that led by its line, at its
    predicted batch; where its confirmation moved the batch (the fake device's leader from
    259 to 310), they still bound and aim the graphs' search, and a second round of bets at
    the new batch would be runs spent twice."""
    out, cap, start = _from_made_bounds(made, batch)
    if cap < 1:
        return None
    left = settings.graphs_runs
    if start is None:  # none held: a first round below the lowest that ran out
        base = min(min(out), batch)
        return _fresh(stage, settings, choices, base, cap, like, fixed_bytes, left)
    first = stage.run(choices, start)  # answered: it was made
    left = 0 if _stops(stage, settings, first) else left
    if _settled(stage, first, start, cap, fixed_bytes):
        return stage.confirm(choices, start, like=like, max_runs=left, ceiling=start)
    return _after_first(stage, choices, like, first, start, fixed_bytes, left, cap)


def _settled(
    stage: PickStage, first: Measurement | None, start: int, cap: int, fixed_bytes: int
) -> bool:
    """Whether a graphs run made ahead that held at ``start`` (``first``) is the search's
    answer: at the cap, or where a line through it allows no more than :data:`LINE_WITHIN`
    above it (as where the guess held beside the first run, :func:`_largest`). Why: pass 1's
    bet is the guess alone (:func:`bets_within`), and a run at the line's aim just above it
    would be a round of compiles alone for a few samples."""
    if start == cap:
        return True
    if first is None:
        return False
    return _line_aim(stage, first, start, cap, fixed_bytes) <= (1 + LINE_WITHIN) * start


def _from_made_bounds(made: dict[int, bool], batch: int) -> tuple[list[int], int, int | None]:
    """What :func:`_from_made` starts from: the batches that ran out, the cap (``batch``, and
    below the lowest that ran out) and the largest that held at or below it (None: none)."""
    out = [b for b, held in made.items() if not held]
    cap = min([batch, *(b - 1 for b in out)])
    held = [b for b, ok in made.items() if ok and b <= cap]
    return out, cap, max(held) if held else None


def next_round(
    stage: PickStage,
    settings: CompileSearch,
    choices: dict[str, JsonValue],
    batch: int,
    measured: Measurement,
    fixed_bytes: int | None,
) -> list[tuple[dict[str, JsonValue], int]]:
    """The graphs search's first device run after its bets: for a pick of ``choices`` (a
    static default-mode form) expected at ``batch``, whose run ``measured`` waited on the
    host as :func:`graphs_pick` asks, where the bets (:func:`first_round`) were made, the
    batch :func:`_from_made` would run first (its line's aim, or half the lowest that ran
    out where none held); [] where graphs would not be tried, no bets were made, or that
    search starts at a batch run already.

    Why: the bets ride pass 2, and the graphs search after them waited for the whole
    confirmation: t5_base on an H200 (session 33 call 1) had its bets at 20 (held) and 31
    (ran out) from pass 2, confirmed its pick at 37 and 33 at once (39.8 s), and only then
    ran the graphs at 23 and 21. Sent beside the confirmation's first run, the aim is made
    in that round, and the graphs search finds it made (``PickStage.confirm``'s
    ``beside``).

    Known limitations: ``batch`` is the confirmation's start; where the pick ends below the
    cap it sets, the search aims elsewhere and this run is a graphs run spent for nothing
    (counted, and said where graphs go unused). Where the aim runs out, the search's next
    run waits for its own round. None is sent where the bet that held still waited on the
    host (:func:`waits_on_host`: the search then makes no run more)."""
    graphs = _graphs_choices(settings, choices, host_share(measured))
    if graphs is None:
        return []
    made = _made(stage, graphs)
    if not made:
        return []
    out, cap, start = _from_made_bounds(made, batch)
    if cap < 1 or start == cap:
        return []
    if start is None:  # as _from_made: a first round below the lowest that ran out
        first = _fresh_batches(stage, settings, min(min(out), batch), settings.graphs_runs)
        return [(graphs, b) for b in first if b not in made]
    else:
        first = stage.run(graphs, start)  # answered: it was made
        if first is None or waits_on_host(settings, first):  # graphs_pick's search says so
            return []
        if _settled(stage, first, start, cap, fixed_bytes or 0):  # _from_made runs nothing
            return []
        aim = _first_aim(stage, first, start, cap, fixed_bytes or 0)
    return [] if aim in made else [(graphs, aim)]


def _after_first(
    stage: PickStage,
    choices: dict[str, JsonValue],
    like: Confirmed,
    first: Measurement | None,
    start: int,
    fixed_bytes: int,
    left: int,
    cap: int,
) -> Confirmed | None:
    """The batch search after the first graphs run (at ``start``), in at most ``left`` runs:
    where it held, from the batch a line through it allows, no higher than ``cap``; where it
    ran out, from half of it, below it."""
    aim = _first_aim(stage, first, start, cap, fixed_bytes)
    if first is None:
        return stage.confirm(choices, aim, like=like, max_runs=left, ceiling=start - 1)
    return stage.confirm(choices, aim, like=like, max_runs=left, within=LINE_WITHIN, ceiling=aim)


def _first_aim(
    stage: PickStage, first: Measurement | None, start: int, cap: int, fixed_bytes: int
) -> int:
    """Where :func:`_after_first`'s search starts after a graphs run at ``start``: where it
    held (``first``), the batch a line through it allows, no higher than ``cap``; where it
    ran out, half of it (:func:`next_round` predicts the same run)."""
    if first is None:
        return max(1, start // 2)
    return _line_aim(stage, first, start, cap, fixed_bytes)


def _line_aim(
    stage: PickStage, first: Measurement, start: int, batch: int, fixed_bytes: int
) -> int:
    """The batch a line through ``first`` (a graphs run at ``start`` that held) and
    ``fixed_bytes`` allows within the stage's limit, no higher than ``batch``."""
    # Reserved, not allocated: the graphs' pool keeps segments no other allocation may use
    # (the GPT example's b230 on an H200: 6.17 GB allocated, 7.78 GB reserved).
    per_sample = max(1.0, (first.limit_bytes - fixed_bytes) / start)
    predicted = int((stage.limit_bytes - fixed_bytes) // per_sample)
    return max(1, min(batch, predicted))


def _under_bar_words(share: float, bar: float, measured: Measurement) -> str:
    """The host's share of the pick's step where it was under ``bar`` but at least
    :data:`SAID_SHARE` of it; '' below that. The bar is ``CompileSearch.host_bound_share``,
    which a plan takes as ``compile={"search": {"host_bound_share": ...}}``: the sentence says
    how to try graphs at a lower one.

    Why: such a step is the host's in good part, and a loop on a slower or busier host runs
    below the verified rate. The GPT example's compiled pick on an H200 read 0.78 (session
    32 call 1), under the 0.8 bar, and its loop after the plan ran 0.87 of the verified rate
    (its steps' median 0.93), where the graphs picks of the same call ran 0.98 and 1.01. The
    bar stays: t5_base's pick read 0.79, and its graphs, tried at a 0.7 bar, ran 0.80x the
    default mode's rate, a round of their compiles (29.7 s) alone (session 32 call 2,
    docs/design.md)."""
    if share < SAID_SHARE:
        return ""
    assert measured.host_ms is not None
    return (
        f"The compiled pick took {fmt_ms(measured.host_ms)} of its {fmt_ms(measured.step_ms)} "
        f"step to launch it ({share:.0%}), under the {bar:.0%} at which CUDA graphs "
        f"({GRAPHS_MODE} mode) are tried: the host set part of that rate, and a loop on a "
        "slower or busier host may run below it (compile={'search': {'host_bound_share': "
        f"{max(SAID_SHARE, math.floor(share * 20) / 20):.2f}}}}} tries them on this pick)."
    )


def _elsewhere_words(elsewhere: Elsewhere) -> str:
    """Why graphs were not tried on a host-bound pick (:func:`waited_elsewhere`)."""
    return (
        f"CUDA graphs ({GRAPHS_MODE} mode) were not tried on it: made ahead with "
        f"{_blocks_words(elsewhere.blocks)} at batch {elsewhere.batch}, they still took "
        f"{elsewhere.share:.0%} of a step to launch it and ran slower than that set in default "
        "mode, so this step's host time goes to more than the kernels' launches graphs save."
    )


def graphs_words(
    graphs: Graphs, pick: Confirmed, runs: int, against: Confirmed | None = None
) -> str:
    """The graphs step in a sentence for the compile stage's summary; where graphs were not
    tried for a compiled pick's host share alone, that share (:func:`_under_bar_words`); ''
    where the card was busy through the step (or the host's share was not recorded).
    ``against``: the eager pick, where graphs had to beat it (``graphs.against`` is then
    "eager", :func:`graphs_pick`)."""
    if not graphs.tried and graphs.bar is not None and graphs.host_share is not None:
        return _under_bar_words(graphs.host_share, graphs.bar, pick.measured)
    if (not graphs.tried and graphs.elsewhere is None) or graphs.host_share is None:
        return ""
    m = pick.measured
    assert m.host_ms is not None
    eager = graphs.against == "eager"
    beaten = against if eager and against is not None else pick
    rate_words = (
        f"{beaten.measured.samples_per_s:.1f} samples/s at batch {beaten.candidate.batch_size}"
    )
    static = f"the eager pick's {rate_words}" if eager else f"the default mode's {rate_words}"
    who = (
        f"the best compiled configuration (default mode, batch {pick.candidate.batch_size})"
        if eager
        else "the compiled pick"
    )
    opening = (
        f"The card waited on the host: {who} took {fmt_ms(m.host_ms)} of its "
        f"{fmt_ms(m.step_ms)} step to launch it ({graphs.host_share:.0%})."
    )
    if graphs.elsewhere is not None:
        return f"{opening} {_elsewhere_words(graphs.elsewhere)}"
    if graphs.made_under is not None:
        opening = (
            f"{opening[:-1]}, under the {graphs.made_under:.0%} at which CUDA graphs are tried, "
            "but graphs runs of it were made ahead beside other runs."
        )
    stays = "eager" if eager else "in default mode"
    if graphs.error is not None:
        return f"{opening} Replayed as CUDA graphs ({GRAPHS_MODE} mode) it failed: {graphs.error}."
    if graphs.found is None:
        return (
            f"{opening} Replayed as CUDA graphs ({GRAPHS_MODE} mode) no batch held within the "
            f"budget's margin in {runs} device runs; the pick stays {stays}."
        )
    g = graphs.found
    rate = g.measured.samples_per_s
    measured = (
        f"Replayed as CUDA graphs ({GRAPHS_MODE} mode, which keeps a memory pool of its own) it "
        f"ran {rate:.1f} samples/s at batch {g.candidate.batch_size}, "
        f"{rate / beaten.measured.samples_per_s:.2f}x {static}"
    )
    if graphs.still_waits is not None:
        measured += (
            f"; under them the host still took {graphs.still_waits:.0%} of the step, so its "
            "time goes to more than the kernels' launches graphs save (no graphs run is made "
            "after one that still waits so)"
        )
    verdict = (
        "the pick, its run the verification" if graphs.wins else "not enough to pay; the pick stays"
    )
    if graphs.wins and rate < beaten.measured.samples_per_s:
        verdict = (
            f"within {1 - HOST_BOUND_TIE:.0%} of a rate that is the host's (a loop on another "
            f"host, or beside other work, does not keep it; graphs' does), {verdict}"
        )
    return f"{opening} {measured}: {verdict}."
