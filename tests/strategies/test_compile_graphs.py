"""strategies/_compile_graphs.py: which picks are replayed as CUDA graphs, and the words.

The whole stage (a host-bound pick confirmed as graphs at a batch of its own, a card-bound
one left alone, graphs that do not pay) runs through the planner against LinearDevice in
tests/planner/test_compiled_search.py; these are its parts.
"""

from __future__ import annotations

import re

import pytest

from memadvisor.schema.candidate import Candidate, Measurement
from memadvisor.schema.plan import Probe
from memadvisor.strategy import Confirmed
from strategies._compile_graphs import GRAPHS_MODE, Graphs, graphs_form, graphs_words, host_share


def _measured(step_ms: float, host_ms: float | None, batch: int = 100) -> Measurement:
    return Measurement(
        steps=5,
        peak_bytes=1,
        step_ms=step_ms,
        samples_per_s=batch / step_ms * 1e3,
        host_ms=host_ms,
    )


def _pick(step_ms: float = 10.0, host_ms: float | None = 9.9, batch: int = 100) -> Confirmed:
    candidate = Candidate(batch_size=batch, choices={"compile": "default"})
    return Confirmed(candidate=candidate, found_batch=batch, measured=_measured(step_ms, host_ms))


@pytest.mark.parametrize(
    ("choice", "graphs"),
    [
        ("default", GRAPHS_MODE),
        ({"mode": "default", "regional": True}, {"mode": GRAPHS_MODE, "regional": True}),
        (
            {"mode": "default", "activation_memory_budget": 0.5},
            {"mode": GRAPHS_MODE, "activation_memory_budget": 0.5},
        ),
        ({"mode": "default", "dynamic_batch": True}, None),
        (GRAPHS_MODE, None),
        ("max-autotune-no-cudagraphs", None),
        ("off", None),
        (None, None),
    ],
)
def test_only_a_static_default_mode_compile_has_a_graphs_form(choice, graphs) -> None:
    """Rule: the graphs form is the same choice in reduce-overhead mode, its other settings
    kept; a dynamic batch (the search's form, not what the user runs), another mode, or no
    compile has none."""
    assert graphs_form(choice) == graphs


def test_the_hosts_share_is_its_launch_time_over_the_step_and_unknown_where_unrecorded() -> None:
    """Rule: host_ms / step_ms; None where the run recorded no host time (a plan made before
    probes recorded it, a device that does not time the host)."""
    assert host_share(_measured(12.0, 9.0)) == pytest.approx(0.75)
    assert host_share(_measured(12.0, None)) is None


def test_the_words_say_what_the_host_took_and_what_graphs_ran() -> None:
    """Rule: where graphs ran, the sentence gives the pick's host and step times, the graphs
    form's rate and batch against the pick's, and whether it is the pick; where they did not
    run (the card busy through the step) it says nothing."""
    pick = _pick()
    found = Confirmed(
        candidate=Candidate(batch_size=80, choices={"compile": GRAPHS_MODE}),
        found_batch=80,
        measured=_measured(5.0, 0.5, batch=80),
    )
    won = graphs_words(Graphs(host_share=0.99, tried=True, found=found, wins=True), pick, 2)
    assert "9.9 ms of its 10.0 ms step" in won and "(99%)" in won
    assert "16000.0 samples/s at batch 80" in won and "1.60x" in won
    assert won.endswith("the pick, its run the verification.")
    lost = graphs_words(Graphs(host_share=0.99, tried=True, found=found, wins=False), pick, 2)
    assert lost.endswith("not enough to pay; the pick stays.")
    none = graphs_words(Graphs(host_share=0.99, tried=True), pick, 3)
    assert "no batch held within the budget's margin in 3 device runs" in none
    assert graphs_words(Graphs(host_share=0.5, tried=False), pick, 0) == ""


class _Stage:
    """A PickStage's two calls _largest makes: run (one answer) and confirm (recorded)."""

    limit_bytes = 1000
    concurrent_runs = 1
    probes = ()  # no graphs run made ahead (first_round)

    def __init__(self, first: Measurement | None) -> None:
        self.first, self.confirms, self.said = first, [], []

    def describe(self, text: str) -> None:
        self.said.append(text)

    def run(self, choices, batch):
        self.batch = batch
        return self.first

    def confirm(self, choices, start_batch, **kwargs):
        self.confirms.append((start_batch, kwargs))
        return None


def test_the_graphs_search_aims_along_the_first_runs_reserved_bytes_below_the_picks_batch() -> None:
    """Rule: the first graphs run is at START_SHARE of the pick's batch; the search then starts
    where a line through that run's reserved bytes (not its allocated ones: the graphs' pool
    keeps segments nothing else uses) and the pick's fixed bytes meets the limit, probing
    nothing above it; where the first run ran out, it starts at half that run's batch,
    below it. Here: 50 of 100 held 100 fixed + 50 x 12 reserved (8 allocated), so the line
    allows (1000 - 100) / 12 = 75."""
    from strategies._compile_graphs import START_SHARE, _largest
    from strategies._compile_search import CompileSearch

    pick = _pick(batch=100)
    held = Measurement(
        steps=5, peak_bytes=500, reserved_peak_bytes=700, step_ms=1.0, samples_per_s=5e4
    )
    stage = _Stage(held)
    _largest(stage, CompileSearch(), {"compile": GRAPHS_MODE}, 100, pick, 100)
    assert stage.batch == round(START_SHARE * 100) == 50
    [(start, kwargs)] = stage.confirms
    assert start == 75 and kwargs["ceiling"] == 75 and kwargs["max_runs"] == 2
    ran_out = _Stage(None)
    _largest(ran_out, CompileSearch(), {"compile": GRAPHS_MODE}, 100, pick, 100)
    [(start, kwargs)] = ran_out.confirms
    assert start == 25 and kwargs["ceiling"] == 49


class _Found(_Stage):
    """A stage whose graphs search finds ``found``."""

    def __init__(self, found: Confirmed) -> None:
        super().__init__(_measured(5.0, 0.5, batch=50))
        self.found = found

    def describe(self, text: str) -> None:
        pass

    def confirm(self, choices, start_batch, **kwargs):
        return self.found


@pytest.mark.parametrize(
    ("ratio", "against_eager", "wins"),
    [(0.92, False, True), (0.88, False, False), (1.0, True, False), (1.04, True, True)],
)
def test_graphs_match_a_host_bound_compiled_pick_within_the_tie_but_must_pay_against_eager(
    ratio: float, against_eager: bool, wins: bool
) -> None:
    """Rule: against a compiled pick that waited on the host, graphs are the pick at
    HOST_BOUND_TIE (0.90) of its rate or more (the compile is paid either way, and the
    host-bound rate is the host's); against the eager pick they must beat it by MIN_SPEEDUP
    (1.03), as any compile must."""
    from strategies._compile_graphs import HOST_BOUND_TIE, graphs_pick
    from strategies._compile_search import CompileSearch

    assert HOST_BOUND_TIE == 0.90
    pick = _pick(step_ms=10.0, host_ms=9.9, batch=100)  # 10,000 samples/s
    eager = Confirmed(
        candidate=Candidate(batch_size=100, choices={}),
        found_batch=100,
        measured=_measured(10.0, 9.5),
    )
    step_ms = 80 / (ratio * 10_000) * 1e3  # batch 80 at ratio x the pick's rate
    found = Confirmed(
        candidate=Candidate(batch_size=80, choices={"compile": GRAPHS_MODE}),
        found_batch=80,
        measured=_measured(step_ms, 0.5, batch=80),
    )
    got = graphs_pick(
        _Found(found), CompileSearch(), pick, "throughput", 0, eager if against_eager else None
    )
    assert got.tried and got.found is found and got.wins is wins
    assert got.against == ("eager" if against_eager else "compiled")
    words = graphs_words(got, pick, 2, eager if against_eager else None)
    assert ("within 10% of a rate that is the host's" in words) is (wins and ratio < 1)


class _AtOnce(_Stage):
    """A stage of runs at once: run_many answers the start run and the guess's."""

    concurrent_runs = 4

    def __init__(self, first: Measurement | None, at_guess: Measurement | None) -> None:
        super().__init__(first)
        self.at_guess, self.many = at_guess, []

    def run_many(self, runs):
        self.many.append([b for _, b in runs])
        return [self.first, self.at_guess]


def _held(reserved: int) -> Measurement:
    return Measurement(
        steps=5, peak_bytes=reserved, reserved_peak_bytes=reserved, step_ms=1.0, samples_per_s=1.0
    )


@pytest.mark.parametrize(
    ("first", "at_guess", "start", "ceiling", "max_runs"),
    [
        # 50 held at 100 + 50 x 12 reserved: the line allows 75, below 80 held: 80 stands.
        (_held(700), _held(900), 80, 80, 1),
        # 50 held at 100 + 50 x 8: the line allows 112, capped at the pick's 100: tried.
        (_held(500), _held(900), 100, 100, 1),
        # 80 ran out: from the line's 75, below it.
        (_held(700), None, 75, 75, 1),
        # both ran out: from half the start, below it.
        (None, None, 25, 49, 1),
    ],
)
def test_where_runs_go_at_once_the_graphs_guess_goes_with_the_first_run(
    first, at_guess, start, ceiling, max_runs
) -> None:
    """Rule: where the device makes runs at once, the first graphs run (START_SHARE of the
    pick's batch) and one at GUESS_SHARE of it run together, one compile's wall for both.
    Where the guess held, it is the answer unless the line through the first run allows 5%
    more (then the search tries the line's batch, no higher than the pick's); where it ran
    out, the search starts from the line's batch below it, or from half the first's where
    that ran out too; at most CompileSearch.graphs_runs runs in all (2 at once, 1 left)."""
    from strategies._compile_graphs import GUESS_SHARE, START_SHARE, _largest
    from strategies._compile_search import CompileSearch

    assert (START_SHARE, GUESS_SHARE) == (0.5, 0.8)
    stage = _AtOnce(first, at_guess)
    _largest(stage, CompileSearch(), {"compile": GRAPHS_MODE}, 100, _pick(batch=100), 100)
    assert stage.many == [[50, 80]]
    [(got, kwargs)] = stage.confirms
    assert got == start and kwargs["ceiling"] == ceiling and kwargs["max_runs"] == max_runs


class _Made(_Stage):
    """A stage whose probes hold graphs runs made ahead (first_round): ``made`` by batch,
    whether it held; run answers the one that held (as the prober answers a run made)."""

    def __init__(self, made: dict[int, bool]) -> None:
        super().__init__(_held(100 + 50 * 12))
        self.ran: list[int] = []
        self.probes = tuple(
            Probe(
                batch_size=b,
                fits=ok,
                steps=5,
                candidate=Candidate(batch_size=b, choices={"compile": GRAPHS_MODE}),
            )
            for b, ok in made.items()
        )

    def run(self, choices, batch):
        self.ran.append(batch)
        return self.first


@pytest.mark.parametrize(
    ("made", "ran", "start", "ceiling", "max_runs"),
    [
        # 50 held (line: 100 fixed + 12 a sample reserved, 75 within 1000): from 75.
        ({50: True}, [50], 75, 75, 3),
        # 50 held, 70 ran out: the line's 75 capped below the failure.
        ({50: True, 70: False}, [50], 69, 69, 3),
        # Only a failure at 60: a first run of its own at START_SHARE of it (30 held:
        # 100 fixed + 20 a sample, the line's 45), below the failure; one of the 3 spent.
        ({60: False}, [30], 45, 45, 2),
    ],
)
def test_graphs_runs_made_ahead_are_the_graphs_searchs_first_round(
    made: dict[int, bool], ran: list[int], start: int, ceiling: int, max_runs: int
) -> None:
    """Rule: where the graphs' first round was made ahead, beside a static run at another
    batch than the pick's (the leader's confirmation moved), the graphs search makes no first
    round of its own: the largest of those runs that held is its first run, the search capped
    below the lowest that ran out, and aimed by the line through it. Where none held, the
    search starts as from nothing, at the failure's batch instead of the pick's: its first
    run at START_SHARE of it, then the line through that run, below the failure."""
    from strategies._compile_graphs import _largest
    from strategies._compile_search import CompileSearch

    stage = _Made(made)
    _largest(stage, CompileSearch(), {"compile": GRAPHS_MODE}, 100, _pick(batch=100), 100)
    assert stage.ran == ran
    [(first, kwargs)] = stage.confirms
    assert first == start and kwargs["ceiling"] == ceiling
    assert kwargs["max_runs"] == max_runs


@pytest.mark.parametrize(
    ("reserved", "start", "ceiling"),
    [
        # 80 held at 100 + 80 x 11 = 980 reserved: the line allows 81, within 5% of 80: the
        # run made is the answer (confirmed at 80, nothing above it).
        (980, 80, 80),
        # 80 held at 100 + 80 x 8 = 740: the line allows 112, capped at the pick's 100 (25%
        # more): the search tries it.
        (740, 100, 100),
    ],
)
def test_a_guess_made_ahead_that_held_is_the_answer_unless_its_line_allows_five_percent_more(
    reserved: int, start: int, ceiling: int
) -> None:
    """Rule: a graphs run made ahead that held (pass 1's bet is the guess alone,
    bets_within) is the graphs search's answer where a line through it allows no more than
    LINE_WITHIN (5%) above it, as where the guess held beside the first run: no run at the
    line's aim is made for a few samples."""
    from strategies._compile_graphs import LINE_WITHIN, _largest
    from strategies._compile_search import CompileSearch

    assert LINE_WITHIN == 0.05
    stage = _Made({80: True})
    stage.first = _held(reserved)
    _largest(stage, CompileSearch(), {"compile": GRAPHS_MODE}, 100, _pick(batch=100), 100)
    [(first, kwargs)] = stage.confirms
    assert (first, kwargs["ceiling"]) == (start, ceiling)


class _MadeAtOnce(_Made):
    """Runs made ahead, on a device of runs at once: run_many answers each run made."""

    concurrent_runs = 4

    def run_many(self, runs):
        self.many = [b for _, b in runs]
        return [self.first for _ in runs]


def test_where_every_graphs_run_made_ahead_ran_out_the_next_round_is_a_first_round_below_it() -> (
    None
):
    """Rule: where the runs made ahead all ran out (pass 1's lone guess at 80), on a device
    of runs at once the graphs search's next round is its own first round below them: the
    start and the guess (START_SHARE, GUESS_SHARE) of the failure's batch together, one
    compile's wall for both, not the half of the failure alone; next_round, which sends the
    graphs search's first runs beside a confirmation, sends the same two."""
    from strategies._compile_graphs import _largest, next_round
    from strategies._compile_search import CompileSearch

    stage = _MadeAtOnce({80: False})
    _largest(stage, CompileSearch(), {"compile": GRAPHS_MODE}, 100, _pick(batch=100), 100)
    assert stage.many == [40, 64] and stage.ran == []
    [(_, kwargs)] = stage.confirms
    assert kwargs["ceiling"] <= 79 and kwargs["max_runs"] == CompileSearch().graphs_runs - 2
    host_bound = _measured(10.0, 9.9)
    nxt = next_round(stage, CompileSearch(), {"compile": "default"}, 100, host_bound, 100)
    assert [b for _, b in nxt] == [40, 64]


@pytest.mark.parametrize(("room", "batches"), [(0, []), (1, [80]), (2, [50, 80]), (3, [50, 80])])
def test_bets_within_a_room_of_one_are_the_guess_alone(room: int, batches: list[int]) -> None:
    """Rule: the graphs' bets that go with pass 1 fit the runs its group leaves free: with
    room for one, the guess (GUESS_SHARE of the batch), which where it holds is the answer;
    with two, the whole first round; none without room, or where the run read says the
    host did not wait (its share under CompileSearch.host_bound_share)."""
    from strategies._compile_graphs import bets_within
    from strategies._compile_search import CompileSearch

    stage = _Made({})
    stage.concurrent_runs = 4
    settings, default = CompileSearch(), {"compile": "default"}
    got = bets_within(stage, settings, default, 100, _measured(10.0, 9.9), room)
    assert [b for _, b in got] == batches
    assert all(c == {"compile": GRAPHS_MODE} for c, _ in got)
    assert bets_within(stage, settings, default, 100, _measured(10.0, 1.0), room) == []


def _waiting(reserved: int, host_ms: float = 9.0) -> Measurement:
    """A graphs run that held, its host 0.9 of its 10 ms step (the bar is 0.8)."""
    return Measurement(
        steps=5,
        peak_bytes=reserved,
        reserved_peak_bytes=reserved,
        step_ms=10.0,
        samples_per_s=1.0,
        host_ms=host_ms,
    )


def test_graphs_that_still_wait_on_the_host_end_their_search_at_the_runs_made() -> None:
    """Rule: where the graphs run that held still took the bar's share of its step to launch
    it (CompileSearch.host_bound_share), graphs did not relieve the host, and their search
    makes no device run more: the first run alone, the first round at once, the runs made
    ahead, and the next round sent beside a confirmation (none is sent). A run that held
    under the bar searches as before."""
    from strategies._compile_graphs import _largest, next_round
    from strategies._compile_search import CompileSearch

    settings = CompileSearch()
    assert settings.host_bound_share == 0.8
    graphs, pick = {"compile": GRAPHS_MODE}, _pick(batch=100)
    alone = _Stage(_waiting(700))
    _largest(alone, settings, graphs, 100, pick, 100)
    [(_, kwargs)] = alone.confirms
    assert kwargs["max_runs"] == 0
    assert alone.said == ["compile: CUDA graphs still waited on the host (90% of a step to "
                          "launch it): no graphs run more"]  # fmt: skip
    relieved = _Stage(_waiting(700, host_ms=3.0))
    _largest(relieved, settings, graphs, 100, pick, 100)
    assert relieved.confirms[0][1]["max_runs"] == settings.graphs_runs - 1 and not relieved.said
    for first, at_guess in ((_held(700), _waiting(900)), (_waiting(700), None)):
        at_once = _AtOnce(first, at_guess)
        _largest(at_once, settings, graphs, 100, pick, 100)
        assert at_once.confirms[0][1]["max_runs"] == 0, (first, at_guess)
    made = _Made({50: True})
    made.first = _waiting(700)
    _largest(made, settings, graphs, 100, pick, 100)
    assert made.confirms[0][1]["max_runs"] == 0
    host_bound = _measured(10.0, 9.9)  # the default-mode pick's run: graphs are tried
    assert next_round(made, settings, {"compile": "default"}, 100, host_bound, 100) == []
    made.first = _waiting(700, host_ms=3.0)
    assert next_round(made, settings, {"compile": "default"}, 100, host_bound, 100) == [
        (graphs, 75)
    ]


def test_the_words_say_graphs_that_still_waited_on_the_host() -> None:
    """Rule: where graphs were found but their run still waited on the host (graphs_pick
    records its share), the summary says so, and that no graphs run follows such a run."""
    from strategies._compile_graphs import graphs_pick
    from strategies._compile_search import CompileSearch

    pick = _pick(step_ms=10.0, host_ms=9.9, batch=100)
    found = Confirmed(
        candidate=Candidate(batch_size=60, choices={"compile": GRAPHS_MODE}),
        found_batch=60,
        measured=_measured(8.0, 6.6, batch=60),
    )
    got = graphs_pick(_Found(found), CompileSearch(), pick, "throughput")
    assert got.still_waits == pytest.approx(6.6 / 8.0) and not got.wins
    words = graphs_words(got, pick, 2)
    assert "the host still took 82% of the step" in words and "no graphs run is made" in words
    found_free = Confirmed(
        candidate=found.candidate, found_batch=60, measured=_measured(8.0, 2.0, batch=60)
    )
    free = graphs_pick(_Found(found_free), CompileSearch(), pick, "throughput")
    assert free.still_waits is None and "still took" not in graphs_words(free, pick, 2)


@pytest.mark.parametrize(
    ("host_ms", "choice", "said"),
    [
        (7.8, "default", True),  # 78% of the step: under the 0.8 bar, said
        (4.0, "default", False),  # 40%: under SAID_SHARE, the card's step: nothing said
        (7.8, {"mode": "default", "dynamic_batch": True}, False),  # no graphs form: not the bar
    ],
)
def test_a_pick_under_the_host_bar_says_the_hosts_share_and_that_a_slower_host_may_lose_rate(
    host_ms: float, choice, said: bool
) -> None:
    """Rule: where graphs were not tried only because the pick's host share was under
    CompileSearch.host_bound_share, and it was SAID_SHARE (half the step) or more, the summary
    says the share, the bar, and that a slower host's loop may run below the rate; nothing
    where the share was lower, or where the pick has no
    graphs form (the bar did not decide). The GPT example's pick read 0.78 on an H200 and its
    loop ran 0.87 of the verified rate (session 32)."""
    from strategies._compile_graphs import SAID_SHARE, graphs_pick
    from strategies._compile_search import CompileSearch

    settings = CompileSearch()
    assert SAID_SHARE <= host_ms / 10.0 < settings.host_bound_share or not said
    candidate = Candidate(batch_size=100, choices={"compile": choice})
    pick = Confirmed(candidate=candidate, found_batch=100, measured=_measured(10.0, host_ms))
    stage = _Stage(None)
    got = graphs_pick(stage, settings, pick, "throughput", 0, None)
    assert not got.tried and not hasattr(stage, "batch")  # nothing ran
    words = graphs_words(got, pick, 0)
    if said:
        assert "7.8 ms of its 10.0 ms step to launch it (78%), under the 80%" in words
        assert "a loop on a slower or busier host may run below it" in words
        # the setting it names would try graphs on this pick: a bar at or under its share
        offered = float(re.search(r"'host_bound_share': ([0-9.]+)", words).group(1))
        assert SAID_SHARE <= offered <= host_ms / 10.0
        assert CompileSearch(host_bound_share=offered).host_bound_share == offered
    else:
        assert words == ""
    # Against the eager pick (compiling did not pay), the pick is eager's: nothing said.
    eager = Confirmed(candidate=Candidate(batch_size=100, choices={}), found_batch=100,
                      measured=_measured(10.0, 9.0))  # fmt: skip
    got = graphs_pick(_Stage(None), settings, pick, "throughput", 0, eager)
    assert got.against == "eager" and graphs_words(got, pick, 0, eager) == ""


def _record(ckpt: int, batch: int, rate: float):
    """A compile stage's record of a static default-mode candidate that ran at ``batch``."""
    from memadvisor.schema.plan import StageVariant, StepFit

    fit = StepFit(
        fixed_bytes=100,
        per_sample_bytes=10,
        fixed_ms=0.0,
        per_sample_ms=1.0,
        batches=[batch],
        basis="scaled",
        limit_bytes=10_000,
        largest_batch=batch,
        samples_per_s=rate,
    )
    choices = {"checkpointing": [f"h.{i}" for i in range(ckpt)], "compile": "default"}
    return StageVariant(
        choices=choices,
        ok=True,
        trial="",
        batch_size=batch,
        measured=_measured(batch / rate * 1e3, batch / rate * 1e3, batch=batch),
        fit=fit,
    )


class _Ran:
    """A stage whose probes are graphs runs that held: (choices, batch, samples/s)."""

    def __init__(self, runs) -> None:
        self.probes = [
            Probe(
                batch_size=b,
                fits=True,
                steps=20,
                peak_bytes=1,
                step_ms=b / rate * 1e3,
                candidate=Candidate(batch_size=b, choices=choices),
            )
            for choices, b, rate in runs
        ]


@pytest.mark.parametrize(
    ("two_blocks_rate", "graphs_rate", "replayed"),
    [
        # Session 35 call 2's GPT plan: 2 blocks read 22,442 in default mode against 4
        # blocks' 24,541 (0.91: within the tie), its graphs held at 31,267 (> 1.03 x eager's
        # 28,973): its graphs are replayed, and the run made settles them.
        (22_442.0, 31_267.0, 2),
        # Its graphs held below what must be beaten: the base's graphs are searched.
        (22_442.0, 29_000.0, 4),
        # Its default-mode run read far below the base's (0.5): not the host's alone.
        (12_000.0, 31_267.0, 4),
    ],
)
def test_graphs_made_ahead_that_already_win_replace_a_base_whose_default_rate_only_ties(
    two_blocks_rate: float, graphs_rate: float, replayed: int
) -> None:
    """Rule: the graphs step replays another candidate than the best compiled one where that
    candidate's default-mode run read within HOST_BOUND_TIE of the best's (both rates the
    host's) and its CUDA graphs, made ahead as a bet, held at a rate that already beats what
    the graphs step must (here the eager pick by MIN_SPEEDUP); elsewhere the best stays the
    base."""
    four, two = _record(4, 311, 24_541.0), _record(2, 307, two_blocks_rate)
    assert _replayed(four, two, graphs_rate, picked=False, eager_rate=28_973.0) == replayed


def _replayed(four, two, graphs_rate: float, picked: bool, eager_rate: float) -> int:
    """The blocks checkpointed by the base ``_bet_base`` returns, with ``four`` the compiled
    best, ``two`` another candidate whose graphs, made ahead at 246, held at ``graphs_rate``
    (``picked``: the best is the compiled pick; else it must beat eager at ``eager_rate``)."""
    from strategies._compile_search import CompileSearch
    from strategies._compile_stage import _as_base, _bet_base

    base = _as_base(four)
    assert base is not None
    graphs = {**two.choices, "compile": GRAPHS_MODE}
    stage = _Ran([(graphs, 246, graphs_rate)])
    eager = Confirmed(
        candidate=Candidate(batch_size=302, choices={}),
        found_batch=302,
        measured=_measured(302 / eager_rate * 1e3, 8.0, batch=302),
    )
    record, _ = _bet_base(stage, CompileSearch(), [two, four], base, picked, eager)
    return len(record.choices["checkpointing"])


def _with_host_share(record, share: float):
    """``record`` with its run's host time ``share`` of its step."""
    assert record.measured is not None
    host_ms = share * record.measured.step_ms
    return record.model_copy(
        update={"measured": record.measured.model_copy(update={"host_ms": host_ms})}
    )


@pytest.mark.parametrize(
    ("base_host_share", "bet_set_host_share", "graphs_rate", "replayed"),
    [
        # The pick waited on the host (its step all launch, as the GPT example's default-mode
        # runs on an H200): a bet at 0.95 of its rate is what its own graphs would have to
        # reach (0.90), so the bet is replayed and no graphs round of the pick's set is made.
        (1.0, 1.0, 0.95 * 31_000.0, 2),
        # ... but not a bet under 0.90 of its rate: the pick's own graphs are searched.
        (1.0, 1.0, 0.85 * 31_000.0, 4),
        # The pick's card was busy (30% of its step on the host): graphs are no pick of its
        # own, so a bet must beat its rate outright.
        (0.3, 1.0, 0.95 * 31_000.0, 4),
        (0.3, 1.0, 1.05 * 31_000.0, 2),
        # The bet's set did not wait on the host in its own default-mode run: the graphs
        # step would try no graphs of it, so it is not the base (the pick's are searched).
        (1.0, 0.3, 1.05 * 31_000.0, 4),
    ],
)
def test_graphs_made_ahead_replace_a_compiled_pick_where_they_reach_what_its_own_would(
    base_host_share: float, bet_set_host_share: float, graphs_rate: float, replayed: int
) -> None:
    """Rule: against a compiled pick whose run waited on the host, a bet on another
    checkpointed set (its default-mode run within the tie of the pick's, and waiting on the
    host too) replaces the pick as the graphs step's base where its graphs held at
    HOST_BOUND_TIE of the pick's rate, the share the pick's own graphs would have to reach
    (graphs_pick); against a pick whose card was busy, only where they beat its rate."""
    four = _with_host_share(_record(4, 311, 31_000.0), base_host_share)
    two = _with_host_share(_record(2, 307, 30_000.0), bet_set_host_share)
    assert _replayed(four, two, graphs_rate, picked=True, eager_rate=27_000.0) == replayed


_FORM = {"mode": "default", "regional": True}
_GRAPHS_FORM = {"mode": GRAPHS_MODE, "regional": True}


def _probe(blocks: int, form: dict, batch: int, step_ms: float | None, host_ms: float | None):
    """A run the stage made: ``blocks`` checkpointed, in ``form``; ``step_ms`` None: ran out."""
    choices = {"precision": "bf16", "checkpointing": [f"b{i}" for i in range(blocks)]}
    return Probe(
        batch_size=batch,
        fits=step_ms is not None,
        steps=5,
        step_ms=step_ms,
        host_ms=host_ms,
        candidate=Candidate(batch_size=batch, choices={**choices, "compile": form}),
    )


class _Probed(_Stage):
    """A stage whose probes are ``probes``; run and confirm are recorded (none expected).
    Its strategies are the registered ones, checkpointing's options the recompute axis."""

    def __init__(self, probes) -> None:
        from memadvisor.strategy import load_strategies

        super().__init__(_measured(5.0, 0.5, batch=50))
        self.probes, self.ran = tuple(probes), []
        self.strategies = load_strategies(["precision", "checkpointing", "compile"])
        self.options = {"checkpointing": [None, ["b0"]]}

    def run(self, choices, batch):
        self.ran.append(batch)
        return self.first


# The t5_base plan of session 37 call 1 (H200), in its numbers: 24 blocks in default mode at
# 36 (224.7 ms a step), its graphs bet at 26 (208.6 ms, 173.3 ms of it on the host).
_SIBLING_DEFAULT = _probe(24, _FORM, 36, 224.7, 184.7)
_SIBLING_GRAPHS = _probe(24, _GRAPHS_FORM, 26, 208.6, 173.3)


@pytest.mark.parametrize(
    ("probes", "skipped"),
    [
        ([_SIBLING_DEFAULT, _SIBLING_GRAPHS], True),
        # the bet that ran out says nothing; the one that held still speaks
        ([_SIBLING_DEFAULT, _SIBLING_GRAPHS, _probe(24, _GRAPHS_FORM, 30, None, None)], True),
        # the bet's graphs launched in 40% of their step: graphs relieved that host
        ([_SIBLING_DEFAULT, _probe(24, _GRAPHS_FORM, 26, 208.6, 83.4)], False),
        # the bet's graphs ran 0.95x its default mode (within the tie): they might pay here
        ([_SIBLING_DEFAULT, _probe(24, _GRAPHS_FORM, 26, 161.0, 150.0)], False),
        # no default-mode run of the bet's set to weigh it against
        ([_SIBLING_GRAPHS], False),
        # every bet ran out
        ([_SIBLING_DEFAULT, _probe(24, _GRAPHS_FORM, 26, None, None)], False),
        # another form's graphs (whole model, not regional) say nothing of this one
        (
            [_probe(24, "default", 36, 224.7, 184.7), _probe(24, GRAPHS_MODE, 26, 208.6, 173.3)],
            False,
        ),  # fmt: skip
        # the pick's own graphs were made: its search starts from them, as before
        ([_SIBLING_DEFAULT, _SIBLING_GRAPHS, _probe(21, _GRAPHS_FORM, 18, 185.2, 157.2)], False),
    ],
)
def test_graphs_are_not_tried_where_the_bets_on_another_set_still_waited_and_did_not_pay(
    probes, skipped: bool
) -> None:
    """Rule: where no graphs run of the pick's form was made, but the graphs bets made of the
    same choices with another checkpointed set held, still took the bar's share of their
    step on the host (CompileSearch.host_bound_share) and ran under HOST_BOUND_TIE of that
    set's default-mode run, graphs_pick makes no graphs run (no device run, not tried) and
    says why; the graphs' first round is not sent beside other runs either. A bet that
    relieved the host, or that ran within the tie, or only ran out, or of another form, or
    the pick's own graphs runs, leave the graphs search as it was."""
    from strategies._compile_graphs import first_round, graphs_pick, waited_elsewhere
    from strategies._compile_search import CompileSearch

    settings = CompileSearch()
    choices = {"precision": "bf16", "checkpointing": [f"b{i}" for i in range(21)]}
    pick_choices = {**choices, "compile": _FORM}
    # the pick: 21 blocks at 37, 224.5 ms a step, 185 ms of it on the host (82%)
    pick = Confirmed(
        candidate=Candidate(batch_size=37, choices=pick_choices),
        found_batch=37,
        measured=_measured(224.5, 185.0, batch=37),
    )
    stage = _Probed(probes)
    got = graphs_pick(stage, settings, pick, "throughput")
    graphs = {**choices, "compile": _GRAPHS_FORM}
    assert (waited_elsewhere(stage, settings, graphs) is not None) is skipped
    bets = first_round(_Probed(probes), settings, pick_choices, 37, pick.measured)
    if skipped:
        assert not got.tried and stage.ran == [] and stage.confirms == []
        assert got.elsewhere is not None and (got.elsewhere.blocks, got.elsewhere.batch) == (24, 26)
        assert bets == []
        words = graphs_words(got, pick, 1)
        assert "were not tried on it: made ahead with 24 blocks checkpointed at batch 26" in words
        assert "they still took 83% of a step" in words and "(82%)" in words
    else:
        assert got.elsewhere is None
        assert got.tried or stage.ran or stage.confirms


class _MadeUnderBar(_Stage):
    """A stage whose probes hold graphs runs of the pick's own choices made ahead (``made``:
    by batch, the rate it ran, None: ran out); confirm answers from them, as PickStage.confirm
    with no run left does (the largest that held at or below ``ceiling``), and records its
    arguments."""

    def __init__(self, made: dict[int, float | None]) -> None:
        super().__init__(None)
        self.rates = made
        self.probes = tuple(
            Probe(
                batch_size=b,
                fits=rate is not None,
                steps=5,
                candidate=Candidate(batch_size=b, choices={"compile": GRAPHS_MODE}),
            )
            for b, rate in made.items()
        )

    def run(self, choices, batch):
        raise AssertionError(f"no graphs run is made under the bar (asked for {batch})")

    def confirm(self, choices, start_batch, **kwargs):
        self.confirms.append((start_batch, kwargs))
        held = [b for b, r in self.rates.items() if r is not None and b <= kwargs["ceiling"]]
        b = max(held)
        return Confirmed(
            candidate=Candidate(batch_size=b, choices=choices),
            found_batch=b,
            measured=_measured(b / self.rates[b] * 1e3, 0.3 * b / self.rates[b] * 1e3, batch=b),
        )


# hf_gpt2 on an H200 (session 43 call C's first plan): its pick bf16, 4 blocks, default
# mode, 2267 at 120,487 samples/s, its host 0.75 of a step (the bar is 0.80); its graphs
# form made ahead beside the confirmation held 844, 1350 and 2768 (129,716 samples/s).
_HF_PICK = Confirmed(
    candidate=Candidate(batch_size=2267, choices={"compile": "default"}),
    found_batch=2267,
    measured=_measured(2267 / 120_487 * 1e3, 0.75 * 2267 / 120_487 * 1e3, batch=2267),
)


@pytest.mark.parametrize(
    ("made", "wins"),
    [
        ({844: 103_523.0, 1350: 114_273.0, 2768: 129_716.0}, True),  # 1.077x: it pays
        ({844: 103_455.0, 1350: 115_309.0, 2768: 123_710.0}, False),  # 1.027x: under 3%
        ({2846: None}, False),  # none held
        # a failure below the fastest: the search's start is the largest held under it
        ({1350: 114_273.0, 2000: None, 2768: 129_716.0}, False),
        ({}, False),  # none made
    ],
)
def test_graphs_made_ahead_for_a_pick_under_the_host_bar_are_weighed_at_no_run_more(
    made: dict[int, float | None], wins: bool
) -> None:
    """Rule: where the pick's host took less than CompileSearch.host_bound_share of its step,
    graphs are not searched; but where runs of its own graphs form were made ahead (bets)
    and the largest that held within the limit (PickStage.confirm with no run left) ran
    MIN_SPEEDUP (3%) faster than the pick, that run is the pick, its run the verification,
    and the words say the share was under the bar. No graphs run is made either way; where
    they do not pay, the step reads as before (not tried, the bar said)."""
    from strategies._compile_graphs import graphs_pick
    from strategies._compile_search import MIN_SPEEDUP, CompileSearch

    settings = CompileSearch()
    assert settings.host_bound_share == 0.8 and MIN_SPEEDUP == 1.03
    stage = _MadeUnderBar(made)
    got = graphs_pick(stage, settings, _HF_PICK, "throughput", 0)
    assert all(kwargs["max_runs"] == 0 for _, kwargs in stage.confirms)
    assert got.wins is wins and got.tried is wins
    words = graphs_words(got, _HF_PICK, 5)
    if wins:
        assert got.found is not None and got.found.candidate.batch_size == 2768
        assert got.found.candidate.choices == {"compile": GRAPHS_MODE}
        assert "(75%), under the 80% at which CUDA graphs are tried, but graphs runs" in words
        assert words.endswith("the pick, its run the verification.")
    else:
        assert got.found is None and got.bar == 0.8
        assert "under the 80% at which CUDA graphs" in words
        assert "graphs runs of it were made ahead" not in words
