"""bench/_hand_grid.py and bench/user_path.py's lines: issue 27's hand grid, the search for
the largest batch that holds, and a model's lines joined across calls."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


@pytest.fixture
def grid(load_bench):
    return load_bench("_hand_grid")


@pytest.fixture
def user_path(load_bench):
    return load_bench("user_path")


class LinearCard:
    """A card whose allocated peak is ``fixed + per_sample * batch``, out of memory past
    ``budget``: the largest batch that holds is known by construction."""

    def __init__(self, fixed: int, per_sample: int, budget: int) -> None:
        self.fixed, self.per_sample, self.budget = fixed, per_sample, budget
        self.runs: list[int] = []

    def run(self, batch: int) -> SimpleNamespace:
        self.runs.append(batch)
        peak = self.fixed + self.per_sample * batch
        if peak > self.budget:
            raise MemoryError(f"batch {batch}: {peak} > {self.budget}")
        return SimpleNamespace(
            peak_bytes=peak, reserved_peak_bytes=None, samples_per_s=float(batch), step_ms=1.0
        )


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, MemoryError)


@pytest.mark.parametrize(
    ("start", "edge", "tried", "slope"),
    [
        # one run's slope (weights included) falls short; two runs' slope reaches the edge,
        # one sample more runs out.
        (20, 90, [(20, True), (67, True), (90, True), (91, False)], None),
        # the estimate's bytes per sample from the first run on: one run fewer
        (20, 90, [(20, True), (90, True), (91, False)], 10),
        # an estimate above the card's per-sample bytes (eager's, for a compiled cell)
        (20, 90, [(20, True), (55, True), (90, True), (91, False)], 20),
        (90, 90, [(90, True), (91, False)], None),
        (1, 90, [(1, True), (10, True), (90, True), (91, False)], None),
        # far above the edge: halved until a batch holds, then the same climb
        (200, 90, [(200, False), (100, False), (50, True), (84, True), (90, True),
                   (91, False)], None),
        (1, 0, [(1, False)], None),
    ],
)  # fmt: skip
def test_largest_holding_stops_at_the_edge_with_no_headroom(
    grid, start, edge, tried, slope
) -> None:
    """The search ends at the largest batch the card holds (no margin below it), proven by
    a run one sample above that ran out, and measures the cell by the run at that batch."""
    card = LinearCard(fixed=100 if edge else 1001, per_sample=10, budget=1000)
    found = grid.largest_holding(card.run, start, 1000, 65536, _is_oom, slope_bytes=slope)
    assert found.batch == edge
    assert found.tried == tried
    assert card.runs == [b for b, _ in tried]  # no batch runs twice
    assert found.lowest_oom == edge + 1
    if edge:
        assert found.measured.peak_bytes == 100 + 10 * edge
    else:
        assert found.measured is None


def test_largest_holding_reraises_what_is_not_an_oom(grid) -> None:
    """A failure other than running out of memory is not an answer: it propagates."""

    def broken(batch: int):
        raise RuntimeError("inductor failed")

    with pytest.raises(RuntimeError, match="inductor failed"):
        grid.largest_holding(broken, 4, 1000, 64, _is_oom)


def test_a_search_interrupted_keeps_the_largest_batch_that_held_and_said_each_run(grid) -> None:
    """Rule: each run is said as it ends; a Ctrl-C during the third run raises with the
    largest batch that held before it (a lower bound) and the runs made; a record made of
    it is marked interrupted and rated by no ratio."""
    card = LinearCard(fixed=100, per_sample=10, budget=1000)
    said: list[str] = []

    def run(batch: int):
        if len(card.runs) == 2:
            raise KeyboardInterrupt
        return card.run(batch)

    with pytest.raises(grid.CellInterrupted) as stopped:
        grid.largest_holding(run, 20, 1000, 65536, _is_oom, say=said.append)
    holding = stopped.value.holding
    assert holding.batch == 67 and holding.measured.samples_per_s == 67.0
    assert holding.tried == [(20, True), (67, True)]
    assert said[0].startswith("batch 20 held (") and said[1].startswith("batch 67 held (")
    record = grid.cell_record("compile", {"compile": "default"}, holding, 1.0)
    record["interrupted"] = True
    row = grid.derive({"hand_grid": [record], "verified_samples_per_s": 10.0})
    assert row["best_hand"] is None and row["pick_over_best_hand"] is None
    assert row["hand_cells"] == "0/6"


@pytest.mark.parametrize(
    ("static_edge", "runs"),
    [(90, "90 static"), (88, "90 OOM static, 89 OOM static, 88 static")],
)
def test_a_compiled_cell_searched_dynamic_is_measured_static_at_its_edge(
    grid, static_edge, runs
) -> None:
    """Rule: the edge a dynamic-batch search found (90) is measured in the static form;
    where static runs out there, one batch less each time until one holds; the runs say
    which were static, and the measurement is the static run's."""
    dynamic = grid.Holding(batch=90, measured=None, tried=[(20, True), (90, True), (91, False)])
    card = LinearCard(fixed=100 + 10 * (90 - static_edge), per_sample=10, budget=1000)
    found = grid.static_at_edge(card.run, dynamic, _is_oom)
    assert found.batch == static_edge and card.runs[-1] == static_edge
    assert found.measured.peak_bytes == card.fixed + 10 * static_edge
    assert found.runs_text() == f"20, 90, 91 OOM, {runs}"


def test_a_cell_cut_in_its_static_run_keeps_the_dynamic_edge_as_a_lower_bound(grid) -> None:
    """Rule: a Ctrl-C during the static run at the edge keeps the dynamic search's edge and
    run (what hf_gpt2's compile cell lost on a card), to be marked interrupted."""
    dynamic = grid.Holding(batch=90, measured="dyn", tried=[(90, True), (91, False)])

    def run(batch: int):
        raise KeyboardInterrupt

    with pytest.raises(grid.CellInterrupted) as stopped:
        grid.static_at_edge(run, dynamic, _is_oom)
    assert stopped.value.holding.batch == 90 and stopped.value.holding.measured == "dyn"


def test_a_cells_rate_over_several_draws_is_their_median_and_a_draw_out_of_memory_is_counted(
    grid,
) -> None:
    """Rule: with more draws, a cell's rate is the median of every draw that ran (the edge's
    run among them, kept as the first), a draw that ran out at the batch that held is
    counted and in no median, and an error that is not out of memory is raised."""
    rates = iter([30.0, None, 10.0])

    def run():
        rate = next(rates)
        if rate is None:
            raise MemoryError("out")
        return SimpleNamespace(samples_per_s=rate)

    extra, stopped = grid.more_draws(run, 3, _is_oom)
    assert extra == [30.0, None, 10.0] and not stopped
    record = grid.with_draws({"samples_per_s": 20.0}, extra)
    assert record["samples_per_s"] == 20.0  # the median of 20, 30, 10: not the first alone
    assert record["samples_per_s_each"] == [20.0, 30.0, None, 10.0]
    assert record["samples_per_s_first"] == 20.0 and record["draw_ooms"] == 1
    assert grid.with_draws({"samples_per_s": 20.0}, [40.0])["samples_per_s"] == 30.0

    def broken():
        raise ValueError("not memory")

    with pytest.raises(ValueError):
        grid.more_draws(broken, 1, _is_oom)


def test_draws_cut_by_a_ctrl_c_keep_those_before_it_and_say_so(grid) -> None:
    """Rule: a Ctrl-C (a deadline's SIGINT) in a cell's draws keeps the draws before it and
    says the draws stopped, so the grid starts no further cell."""
    answers = iter([SimpleNamespace(samples_per_s=5.0), KeyboardInterrupt()])

    def run():
        answer = next(answers)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    assert grid.more_draws(run, 3, _is_oom) == ([5.0], True)


def test_the_grid_is_bf16_by_compile_by_none_half_all(grid) -> None:
    """Six cells, all bf16: half the blocks is the first half of checkpointing's ranking;
    half of one block, or a model without blocks, has no such cell."""
    names, ranked = ["b0", "b1", "b2", "b3"], [2, 0, 3, 1]
    assert {c: grid.cell_choices(names, ranked, c) for c in grid.GRID} == {
        "eager": {"precision": "bf16"},
        "eager+half": {"precision": "bf16", "checkpointing": ["b2", "b0"]},
        "eager+all": {"precision": "bf16", "checkpointing": names},
        "compile": {"precision": "bf16", "compile": "default"},
        "compile+half": {"precision": "bf16", "checkpointing": ["b2", "b0"], "compile": "default"},
        "compile+all": {"precision": "bf16", "checkpointing": names, "compile": "default"},
    }
    assert grid.cell_choices(["b0"], [0], "eager+half") is None
    assert grid.cell_choices([], [], "compile+all") is None
    assert grid.cells("compile") == ["compile", "compile+half", "compile+all"]
    assert grid.cells("eager+all,compile") == ["eager+all", "compile"]
    # The group's name alone is the group; its bare cell alone is named "+none".
    assert grid.cells("compile+none") == ["compile"]
    assert grid.cells("eager+none,compile+all") == ["eager", "compile+all"]
    with pytest.raises(ValueError, match="fp32"):
        grid.cells("fp32")


def _cell(config: str, batch: int, rate: float) -> dict:
    return {"config": config, "batch": batch, "samples_per_s": rate, "peak_gib": 7.9}


def test_a_models_lines_join_into_one_row_with_its_ratios(grid) -> None:
    """The plan and loop from one call, eager and compiled cells from two more: the joined
    row has all six cells in grid order, keeps what a later call did not measure, takes a
    rerun cell's latest line, and derives pick / best cell, loop / verified and loop / the
    pick run again from them."""
    plan = {"model": "m", "verified_samples_per_s": 100.0, "user_loop_samples_per_s": 98.0,
            "user_loop_ooms": 0, "compile_s": 12.0, "hand_grid": [],
            "pick_rerun": {"samples_per_s": 80.0, "samples_per_s_each": [70, 80, 90]}}  # fmt: skip
    eager = {"model": "m", "verified_samples_per_s": None, "user_loop": [],
             "hand_grid": [_cell("eager", 4, 60.0), _cell("eager+half", 6, 70.0),
                           _cell("eager+all", 9, 65.0)]}  # fmt: skip
    compiled = {"model": "m", "hand_grid": [_cell("compile", 5, 90.0),
                _cell("compile+half", 7, 101.0), _cell("compile+all", 11, 96.0),
                _cell("eager", 4, 61.0)]}  # fmt: skip
    row = grid.merge_rows([plan, eager, compiled])
    assert [c["config"] for c in row["hand_grid"]] == list(grid.GRID)
    assert row["hand_grid"][0]["samples_per_s"] == 61.0
    assert row["verified_samples_per_s"] == 100.0 and row["compile_s"] == 12.0
    assert row["best_hand"] == "compile+half"
    assert row["pick_over_best_hand"] == round(100.0 / 101.0, 4)
    assert row["loop_over_verified"] == 0.98
    assert row["loop_over_rerun"] == round(98.0 / 80.0, 4)
    assert row["hand_cells"] == "6/6" and row["lines"] == 3


def test_user_path_joins_only_its_own_label_and_shows_the_last(user_path) -> None:
    """A labelled line joins the earlier good lines of its model, budget and label only (not
    another label's, not a failed line's); the table shows each label's last line and every
    unlabelled or failed one."""
    old = {"model": "m", "budget_gib": 8.0, "label": None, "verified_samples_per_s": 50.0}
    other = {"model": "m", "budget_gib": 8.0, "label": "b", "compile_s": 99.0}
    failed = {"model": "m", "budget_gib": 8.0, "label": "a", "error": "OOM", "compile_s": 1.0}
    first = {"model": "m", "budget_gib": 8.0, "label": "a", "compile_s": 30.0,
             "verified_samples_per_s": 100.0, "hand_grid": []}  # fmt: skip
    second = {"model": "m", "budget_gib": 8.0, "label": "a", "compile_s": None,
              "hand_grid": [_cell("eager", 3, 80.0)]}  # fmt: skip
    lines = [old, other, failed, first]
    joined = user_path.joined(second, lines)
    assert joined["compile_s"] == 30.0
    assert joined["pick_over_best_hand"] == 1.25
    assert user_path.joined(old, lines) is old
    shown = user_path.latest([*lines, joined])
    assert shown == [old, other, failed, joined]


def test_a_line_of_another_plan_gives_its_hand_cells_and_not_its_loop(user_path) -> None:
    """Rule: two lines of one label from different plans (another batch and verified rate):
    the later keeps its own verified rate and no loop from the earlier (that loop ran
    another plan), but gains the earlier's hand cells."""
    base = {"model": "m", "budget_gib": 8.0, "label": "a", "pick": {"precision": "bf16"}}
    first = {
        **base,
        "batch": 110,
        "verified_samples_per_s": 1800.0,
        "user_loop_samples_per_s": 1700.0,
        "hand_grid": [_cell("eager", 111, 1802.0)],
    }
    second = {**base, "batch": 115, "verified_samples_per_s": 1887.0,
              "user_loop_samples_per_s": None, "hand_grid": []}  # fmt: skip
    row = user_path.joined(second, [first])
    assert row["verified_samples_per_s"] == 1887.0 and row["batch"] == 115
    assert row["user_loop_samples_per_s"] is None and row["loop_over_verified"] is None
    assert [c["config"] for c in row["hand_grid"]] == ["eager"]
    same = user_path.joined({**second, "batch": 110, "verified_samples_per_s": 1800.0}, [first])
    assert same["user_loop_samples_per_s"] == 1700.0  # one plan: its loop joins


def test_the_user_loop_of_a_plan_that_changed_the_loss_trains_with_the_plans_step(
    user_path, tmp_path, recwarn
) -> None:
    """A plan whose step computes the loss another way (the chunked loss head) is trained in
    the user's loop as apply_plan says, ``loss = model.memadvisor_step(batch)``, not
    ``loss_fn(model(x), batch)``, which computes the whole logits the plan measured without
    (lm350m's loop ran out of memory so at its first step on a card); and that loop never
    calls the model outside the step (no warning that it did)."""
    import memadvisor
    from memadvisor.target import load_target

    w = load_target(user_path.MODELS["gpt"])
    plan = memadvisor.plan(
        w.model, w.sample_batch, loss_fn=w.loss_fn, budget_gb=0.3, device="estimate",
        progress=False,
    )  # fmt: skip
    assert plan.candidate.choices.get("loss_head"), plan.candidate.choices
    small = plan.model_copy(
        update={"candidate": plan.candidate.model_copy(update={"batch_size": 2})}
    )
    path = tmp_path / "plan.json"
    path.write_text(small.model_dump_json())
    out = user_path.user_loop(
        {"plan": str(path), "model": "gpt", "device": "cpu", "budget_bytes": 2**30,
         "mode": "apply", "compile_backend": "eager", "steps": 2, "warmup": 1}
    )  # fmt: skip
    assert out["ooms"] == 0 and out["steps"] == 2
    assert out["retried_steps"] == out["alloc_retries"] == 0  # no allocator on a CPU
    low, middle, high = out["step_ms_p10_p50_p90"]
    assert 0 < low <= middle <= high and isinstance(out["slow_steps"], list)
    assert "loss_head" in out["trained_with"]
    assert not [w for w in recwarn if "memadvisor_step" in str(w.message)]


def test_the_hand_cells_run_under_the_allocator_the_plan_ran_under(user_path, monkeypatch):
    """Rule: where the pick records expandable segments (and the environment does not name
    the setting), the cells' processes get the same variable; a plan that recorded none,
    or a user's own setting, leaves the environment as it is."""
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)

    def plan(**choices):
        return SimpleNamespace(candidate=SimpleNamespace(choices=choices))

    assert user_path._cells_allocator(plan(allocator="expandable_segments")) == {
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"
    }
    assert user_path._cells_allocator(plan(precision="bf16")) == {}
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    assert user_path._cells_allocator(plan(allocator="expandable_segments")) == {}


def test_a_cells_first_extrapolation_takes_the_estimates_slope_above_its_start(grid) -> None:
    """Rule: a hand cell extrapolates from its first run along the estimate's bytes per
    sample from its start up, not averaged over [start/2, start], where a fixed phase (the
    optimizer's update) flattens it: here 100 MiB up to batch 15, then 2.7 MiB a sample,
    and a start at 20 (lm350m on a card: 0.05 GB a sample below 18, 0.17 above)."""
    from memadvisor.planner._space import SearchSpace
    from memadvisor.schema.config import PlanConfig
    from tests.planner.conftest import MIB, FakeCheckpointing, FakePrecision, make_profile

    profile = make_profile(param_mib=20)
    space = SearchSpace(
        profile, [FakePrecision(), FakeCheckpointing()], PlanConfig(budget_bytes=160 * MIB)
    )
    choices = {"precision": "bf16"}
    above = grid._slope_above(space, choices, 20)
    assert above == pytest.approx(2.7 * MIB, rel=0.02)
    assert space.bytes_per_sample(choices, 20) < 0.6 * above


def test_an_interrupted_grid_keeps_the_cells_before_it_and_starts_nothing_more(
    user_path, monkeypatch, capsys
) -> None:
    """Rule: a Ctrl-C during a hand cell (a call's ``timeout -s INT``) ends the grid: the
    cells measured before it are kept (and were printed as they ended), the cell cut and
    those after it are marked, and nothing more starts (the clock says passed), so the
    model's row is still written. Session 16 lost a finished cell's rate this way."""
    answers = iter([{"config": "eager", "batch": 3, "samples_per_s": 9.0, "runs": "3"}])

    def measure_cell(cell, **_):
        try:
            return next(answers)
        except StopIteration:
            raise KeyboardInterrupt from None

    monkeypatch.setattr(user_path.grid, "measure_cell", measure_cell)
    monkeypatch.setattr(user_path, "workload_of", lambda name: None)
    clock = user_path.Clock(None)
    args = SimpleNamespace(
        hand="eager", hold_steps=20, hand_search="dynamic", cell_draws=1, cells_at_once=False
    )
    plan = SimpleNamespace(profile=None, config=None)
    cells = user_path._grid(plan, "gpt", args, None, clock)
    assert [c["config"] for c in cells] == ["eager", "eager+half", "eager+all"]
    assert cells[0]["samples_per_s"] == 9.0
    assert cells[1]["skipped"] == cells[2]["skipped"] == "interrupted"
    assert clock.passed()
    printed = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("HAND_CELL")
    ]
    assert '"samples_per_s": 9.0' in printed[0]


class GroupCard:
    """A card of :class:`LinearCard` lines by choice set (``edges``: the largest batch of
    each that holds), whose ``run_many`` notes each group's batches, as a card's device
    makes a group at once. ``stop_at``: the group (counted from 1) whose run_many a Ctrl-C
    cuts."""

    def __init__(self, edges: dict[str, int], stop_at: int | None = None) -> None:
        self.cards = {
            c: LinearCard(fixed=100, per_sample=10, budget=100 + 10 * e) for c, e in edges.items()
        }
        self.groups: list[list[tuple[str, int]]] = []
        self.stop_at = stop_at

    def is_oom(self, error: BaseException) -> bool:
        return _is_oom(error)

    def run(self, workload, candidate, steps: int):
        return self.cards[candidate.choices].run(candidate.batch_size)

    def run_many(self, workload, runs):
        self.groups.append([(c.choices, c.batch_size) for c, _ in runs])
        if self.stop_at is not None and len(self.groups) == self.stop_at:
            raise KeyboardInterrupt
        answers = []
        for candidate, steps in runs:
            try:
                answers.append(self.run(workload, candidate, steps))
            except MemoryError as e:
                answers.append(e)
        return answers


def _search(grid, cell: str, device) -> dict:
    """A cell's search as measure_cell makes it: largest_holding from batch 20 over
    ``device.run``; cut, the batch that held so far, marked interrupted."""
    run = lambda b: device.run(None, SimpleNamespace(batch_size=b, choices=cell), 20)  # noqa: E731
    try:
        found = grid.largest_holding(run, 20, 10**9, 65536, device.is_oom, slope_bytes=10)
    except grid.CellInterrupted as stop:
        return {"config": cell, "batch": stop.holding.batch, "interrupted": True}
    return {"config": cell, "batch": found.batch, "tried": found.tried}


def test_cells_searched_side_by_side_find_what_they_find_alone_in_fewer_waits(grid) -> None:
    """Rule: cells searched side by side (``measure_at_once``, ``--cells-at-once``) each find
    the batch and make the runs they make alone, in the cells' order; their runs go to the
    device in groups of at most one run a cell, each group made when every cell still
    searching has asked for its next run, so the device is waited on fewer times than there
    are runs. A cell that raises is its error's record."""
    edges = {"eager": 90, "eager+half": 140, "compile": 35}
    alone = {c: _search(grid, c, GroupCard(edges)) for c in edges}
    card = GroupCard(edges)
    cells = [*edges, "broken"]

    def measure(cell: str, device) -> dict:
        if cell == "broken":
            raise RuntimeError("inductor failed")
        return _search(grid, cell, device)

    records = grid.measure_at_once(cells, measure, card, None)
    assert [r["config"] for r in records] == cells
    assert records[:3] == [alone[c] for c in edges], records
    assert records[3]["error"] == "RuntimeError: inductor failed"
    runs = sum(len(g) for g in card.groups)
    assert runs == sum(len(alone[c]["tried"]) for c in edges)
    assert all(len({c for c, _ in g}) == len(g) for g in card.groups), card.groups
    assert len(card.groups) < runs, card.groups
    assert len(card.groups[0]) == 3, card.groups  # every cell's first run in the first group


def test_a_ctrl_c_during_cells_side_by_side_ends_each_with_what_held_so_far(grid) -> None:
    """Rule: a Ctrl-C (a deadline's SIGINT) while a group of the cells' runs is made ends
    every cell's search as a Ctrl-C ends one alone: each keeps the largest batch that held
    before it, marked interrupted, and no run starts after it."""
    edges = {"eager": 90, "compile": 35}
    card = GroupCard(edges, stop_at=2)
    records = grid.measure_at_once(list(edges), lambda c, d: _search(grid, c, d), card, None)
    assert len(card.groups) == 2
    assert [r.get("interrupted") for r in records] == [True, True], records
    assert [r["batch"] for r in records] == [20, 20], records  # batch 20 held in group 1


def test_user_paths_cells_at_once_make_their_first_runs_in_one_group_and_print_each(
    user_path, monkeypatch, capsys
) -> None:
    """Rule: with ``--cells-at-once`` the grid's cells search side by side through the shared
    device (their first runs in one group), and each cell's record is printed as a
    HAND_CELL line, in the cells' order, as one at a time prints them."""
    card = GroupCard({"eager": 90, "eager+half": 140, "eager+all": 200})

    def measure_cell(cell, *, device, steps, **_):
        m = device.run(None, SimpleNamespace(batch_size=20, choices=cell), steps)
        return {"config": cell, "batch": 20, "samples_per_s": m.samples_per_s, "runs": "20"}

    monkeypatch.setattr(user_path.grid, "measure_cell", measure_cell)
    monkeypatch.setattr(user_path, "workload_of", lambda name: None)
    args = SimpleNamespace(
        hand="eager", hold_steps=20, hand_search="dynamic", cell_draws=1, cells_at_once=True
    )
    plan = SimpleNamespace(profile=None, config=None)
    cells = user_path._grid(plan, "gpt", args, card, user_path.Clock(None))
    assert [c["config"] for c in cells] == ["eager", "eager+half", "eager+all"]
    assert card.groups == [[("eager", 20), ("eager+half", 20), ("eager+all", 20)]]
    printed = [
        line for line in capsys.readouterr().out.splitlines() if line.startswith("HAND_CELL")
    ]
    assert len(printed) == 3, printed
    assert '"config": "eager"' in printed[0] and '"config": "eager+all"' in printed[2]
