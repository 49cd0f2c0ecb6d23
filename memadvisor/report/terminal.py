"""The report in a terminal (rich): the answer first, then the evidence, then the advice."""

from __future__ import annotations

from typing import Literal

from rich import box
from rich.cells import cell_len
from rich.console import Console, Group
from rich.markup import escape
from rich.panel import Panel
from rich.syntax import Syntax
from rich.table import Table
from rich.text import Text

from memadvisor.profiler import OpAllocation
from memadvisor.report import _facts as facts
from memadvisor.report._adopt import adoption_snippet
from memadvisor.report._words import (
    OPS_NOTE,
    OWNERS_NOTE,
    answer_rows,
    choices_lead,
    comparison_note,
    device_title,
    fragmentation,
    kind_words,
    op_module,
    owner_notes,
)
from memadvisor.schema.loader import LoaderAdvice
from memadvisor.schema.plan import Plan
from memadvisor.schema.profile import Profile
from memadvisor.units import fmt_bytes, fmt_ms, fmt_rate

__all__ = ["one_line", "one_line_profile", "print_code", "print_plan", "print_profile"]

_ESTIMATED = "~"  # marks a number only estimated, never run on a device


_CONSUMERS_NOTE = f"* not a block. {OWNERS_NOTE}"


def print_plan(plan: Plan, console: Console, *, top: int = 8) -> None:
    """The whole plan report: answer, comparison, where the memory goes, recommendations."""
    ans = facts.answer(plan)
    console.print(_answer_panel(ans))
    estimated_only = not plan.capabilities.measures_memory
    _section(console, "Configurations compared", _comparison_table(plan), comparison_note(plan))
    if estimated_only:
        _section(
            console,
            "Predicted peak per phase, each configuration at its batch (estimated)",
            _predicted_phases_table(facts.predicted_phases(plan)),
        )
    if plan.profile is None:
        console.print("[dim]The plan carries no profile: where the memory goes is not shown.[/]")
    else:
        profile = plan.profile
        _section(console, _peak_title(ans), _kinds_table(facts.kinds_at_plan_peak(plan)))
        owners = facts.consumers(
            profile, ans.batch_size, ans.precision, ans.checkpointed, ans.loss_rewrite
        )
        show_kept = bool(ans.checkpointed) or ans.loss_rewrite is not None
        _section(
            console,
            f"Top activation owners at batch {ans.batch_size}, {ans.precision}",
            _consumers_table(owners, top=top, show_kept=show_kept),
            _consumers_note(owners),
        )
        b = max(profile.batch_sizes)
        _section(
            console,
            f"Per-phase peaks of the plain step as profiled (batch {b})",
            _phases_table(profile, b, list(profile.steps)),
            fragmentation(profile),
        )
    _print_advice(plan, console)
    _print_adoption(plan, console)
    if plan.data_loading is not None:
        _print_loading(plan.data_loading, console)
    for check in plan.checks:
        mark, style = ("passed", "green") if check.passed else ("look at this", "yellow")
        console.print(
            Text.assemble(
                ("Check ", "bold"), (f"({check.strategy}, {mark}): ", style), check.summary
            )
        )
    if plan.probes:
        console.print(_probes_line(plan))
    elif estimated_only:
        console.print(f"[dim]No device runs; planning took {fmt_ms(plan.plan_wall_ms)}.[/]")


def print_profile(
    profile: Profile,
    console: Console,
    *,
    batch_size: int | None = None,
    top: int = 10,
    ops: list[OpAllocation] | None = None,
) -> None:
    """What the profiler measured: memory by kind, top activation owners, per-phase peaks,
    and the operations that allocate most when ``ops`` is given.

    Args:
        batch_size: the batch to read the linear fits at; the larger measured one by default.
        ops: :func:`memadvisor.profiler.top_allocations` at that batch.
    """
    b = batch_size or max(profile.batch_sizes)
    precisions = list(profile.steps)
    console.print(_profile_header(profile))
    _section(
        console,
        f"Memory by kind at batch {b}, fp32",
        _kinds_table(facts.kinds_of_profile(profile, b)),
    )
    _section(
        console,
        f"Top activation owners at batch {b}",
        _profile_consumers(profile, b, precisions, top),
        _consumers_note(facts.consumers(profile, b)),
    )
    _section(
        console,
        f"Per-phase peaks at batch {b}",
        _phases_table(profile, b, precisions),
        fragmentation(profile),
    )
    if ops:
        _section(
            console, f"Operations that allocate most, one step at batch {b}, fp32",
            ops_table(ops), OPS_NOTE,
        )  # fmt: skip


def _consumers_note(owners: list[facts.Consumer]) -> str:
    """The star's meaning, then who made each large owner that is not a block."""
    return "\n".join([_CONSUMERS_NOTE, *owner_notes(owners)])


def _section(console: Console, title: str, table: Table, note: str | None = None) -> None:
    # Titles and notes printed apart from the table: rich wraps a table's own title and
    # caption to the table's width, which breaks a sentence over three short lines.
    console.print()
    console.print(Text(title, style="bold"))
    console.print(table)
    if note:
        console.print(Text(note, style="dim"))


def one_line(plan: Plan) -> str:
    """The answer in one line, for ``--quiet`` and logs."""
    a = facts.answer(plan)
    peak = a.verified_peak_bytes if a.verified_peak_bytes is not None else a.estimated_peak_bytes
    return (
        f"{a.model_name}: {choices_lead(a)}batch {a.batch_size} x {a.accumulation_steps}, "
        f"peak {fmt_bytes(peak)} {'verified' if a.verified_peak_bytes is not None else 'estimated'}"
        f" of {fmt_bytes(a.budget_bytes)}, {fmt_rate(a.samples_per_s)} samples/s"
    )


def one_line_profile(profile: Profile) -> str:
    """What a step holds in one line, for ``--quiet`` and logs."""
    b = max(profile.batch_sizes)
    step = profile.steps["fp32"]
    peak = max((p.allocated.at(b) for p in step.phases), default=0)
    per_sample = step.activation_total.per_sample_bytes
    static = fmt_bytes(profile.static_bytes)
    return (
        f"{profile.model_name}: weights, grads and optimizer state {static}, activations "
        f"{fmt_bytes(per_sample)} per sample (fp32), peak {fmt_bytes(peak)} at batch {b}, "
        f"{len(profile.blocks)} blocks"
    )


# -- the answer -------------------------------------------------------------------------------


def _answer_panel(a: facts.Answer) -> Panel:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold", no_wrap=True)
    grid.add_column()
    for label, words in answer_rows(a):
        grid.add_row(label, words)
    body: list = [grid]
    body.extend(Text(f"• {note}", style="yellow") for note in a.notes)
    title = f"[bold]memadvisor plan[/] · {escape(a.model_name)} on {escape(device_title(a))}"
    return Panel(Group(*body), title=title, title_align="left", border_style="green")


def _peak_title(a: facts.Answer) -> str:
    how = "verified" if a.verified_peak_bytes is not None else "estimated"
    return (
        f"Where the memory goes at the plan's peak ({a.estimated_peak_phase}; breakdown "
        f"estimated, the total {how})"
    )


# -- tables -----------------------------------------------------------------------------------


Cell = str | Text
ColumnKind = Literal["name", "text", "num"]


def _table(columns: list[tuple[str, ColumnKind]], rows: list[list[Cell]]) -> Table:
    """A table that narrows to the console without cutting a header or a value.

    A number column is never narrower than its widest value, so a value never wraps or is
    cut; headers wrap at their spaces ("Largest batch" over two lines). Module names fold
    (break at any character, every character kept) when the console is too narrow even
    then. Rich's own default crops a no-wrap cell with an ellipsis ("Forwa…", "71.6 …").
    """
    table = Table(box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False, collapse_padding=True)
    for i, (header, kind) in enumerate(columns):
        if kind == "num":
            widest = max((cell_len(_plain(row[i])) for row in rows), default=0)
            table.add_column(header, justify="right", min_width=widest)
        elif kind == "name":
            widest = max((cell_len(_plain(row[i])) for row in rows), default=0)
            table.add_column(header, overflow="fold", ratio=None, min_width=min(widest, 12))
        else:
            table.add_column(header, overflow="fold")
    for row in rows:
        table.add_row(*row)
    return table


def _plain(cell: Cell) -> str:
    return cell.plain if isinstance(cell, Text) else cell


def _comparison_table(plan: Plan) -> Table:
    columns: list[tuple[str, ColumnKind]] = [
        ("Config", "name"),
        ("Batch", "num"),
        ("Peak", "num"),
        ("Step", "num"),
        ("Largest batch", "num"),
        ("Samples/s", "num"),
    ]
    rows: list[list[Cell]] = []
    for line in facts.comparison(plan):
        mark = "" if line.measured else _ESTIMATED
        time_mark = "" if line.time_measured else _ESTIMATED
        batch = str(line.batch_size)
        if line.accumulation_steps > 1:
            batch += f"×{line.accumulation_steps}"
        peak = Text(mark + fmt_bytes(line.peak_bytes), style="red" if line.over_budget else "")
        rows.append(
            [
                Text(line.label, style="bold green" if line.is_plan else ""),
                batch,
                peak,
                time_mark + fmt_ms(line.step_ms),
                str(line.largest_batch) if line.largest_batch is not None else "—",
                time_mark + fmt_rate(line.samples_per_s),
            ]
        )
    return _table(columns, rows)


def _predicted_phases_table(lines: list[facts.PredictedPhases]) -> Table:
    table = Table(box=box.SIMPLE)
    for name in ("Config", "Batch", "Forward", "Backward", "Optimizer", "Largest batch"):
        table.add_column(name, justify="left" if name == "Config" else "right", no_wrap=True)
    for line in lines:
        batch = str(line.batch_size)
        if line.accumulation_steps > 1:
            batch += f"×{line.accumulation_steps}"
        cells = []
        for phase, nbytes in (
            ("forward", line.forward_bytes),
            ("backward", line.backward_bytes),
            ("optimizer", line.optimizer_bytes),
        ):
            bold = "bold" if phase == line.peak_phase else ""
            cells.append(Text(_ESTIMATED + fmt_bytes(nbytes), style=bold))
        table.add_row(
            Text(line.label, style="bold green" if line.is_plan else ""),
            batch,
            *cells,
            str(line.largest_batch) if line.largest_batch is not None else "—",
        )
    return table


def _kinds_table(lines: list[facts.KindLine]) -> Table:
    rows: list[list[Cell]] = [
        [kind_words(line.kind), fmt_bytes(line.nbytes), f"{line.share:.0%}"] for line in lines
    ]
    return _table([("Kind", "text"), ("Bytes", "num"), ("Share", "num")], rows)


def _consumers_table(consumers: list[facts.Consumer], *, top: int, show_kept: bool) -> Table:
    columns: list[tuple[str, ColumnKind]] = [
        ("Module", "name"),
        ("Type", "text"),
        ("Saved", "num"),
        ("Share", "num"),
    ]
    if show_kept:
        columns.append(("Kept by plan", "num"))
    columns.append(("Forward", "num"))
    rows: list[list[Cell]] = []
    for c in consumers[:top]:
        row: list[Cell] = [
            _owner_name(c),
            c.type_name,
            fmt_bytes(c.activation_bytes),
            f"{c.share:.0%}",
        ]
        if show_kept:
            row.append(_kept(c))
        row.append(_forward(c))
        rows.append(row)
    if len(consumers) > top:
        rest = consumers[top:]
        rows.append(
            [
                f"… {len(rest)} more",
                "",
                fmt_bytes(sum(c.activation_bytes for c in rest)),
                f"{sum(c.share for c in rest):.0%}",
                *([""] * (2 if show_kept else 1)),
            ]
        )
    return _table(columns, rows)


def _kept(c: facts.Consumer) -> Text:
    """What an owner keeps under the plan, and why where the plan changed it."""
    if c.checkpointed:
        return Text(f"{fmt_bytes(c.kept_bytes)} ckpt", style="cyan")
    if c.loss_rewrite is not None:
        return Text(f"{fmt_bytes(c.kept_bytes)}, {c.loss_rewrite.brief}", style="cyan")
    return Text(fmt_bytes(c.kept_bytes))


def _forward(c: facts.Consumer) -> str:
    """A block's forward (its recompute cost): the median over identical blocks."""
    return fmt_ms(c.forward_ms) if c.forward_ms else "—"


def _owner_name(c: facts.Consumer) -> Text:
    if c.owner == "outside":
        return Text(f"{c.name} *", style="bold")
    return Text(c.name)


def _profile_consumers(profile: Profile, b: int, precisions: list[str], top: int) -> Table:
    per_precision = {p: {c.name: c for c in facts.consumers(profile, b, p)} for p in precisions}
    ordered = facts.consumers(profile, b, "fp32")
    columns: list[tuple[str, ColumnKind]] = [
        ("Module", "name"),
        ("Type", "text"),
        ("Per sample", "num"),
    ]
    columns += [(p, "num") for p in precisions]
    columns += [("Share", "num"), ("Forward", "num")]
    slopes = _per_sample_bytes(profile)
    rows: list[list[Cell]] = []
    for c in ordered[:top]:
        cells: list[Cell] = [
            _owner_name(c),
            c.type_name,
            fmt_bytes(slopes.get(c.name)) if c.name in slopes else "—",
        ]
        for p in precisions:
            other = per_precision[p].get(c.name)
            cells.append(fmt_bytes(other.activation_bytes) if other is not None else "—")
        cells += [f"{c.share:.0%}", _forward(c)]
        rows.append(cells)
    return _table(columns, rows)


def ops_table(ops: list[OpAllocation]) -> Table:
    """Op, module, phase, calls and bytes allocated: the profiler's self-memory view."""
    rows: list[list[Cell]] = [
        [o.op, op_module(o.module), o.phase, str(o.calls), fmt_bytes(o.allocated_bytes)]
        for o in ops
    ]
    columns: list[tuple[str, ColumnKind]] = [
        ("Op", "name"),
        ("Module", "name"),
        ("Phase", "text"),
        ("Calls", "num"),
        ("Allocated", "num"),
    ]
    return _table(columns, rows)


def _per_sample_bytes(profile: Profile) -> dict[str, float]:
    step = profile.steps["fp32"]
    out = {b.name: b.activation.per_sample_bytes for b in step.blocks}
    out.update({m.name: m.activation.per_sample_bytes for m in step.outside})
    return out


def _phases_table(profile: Profile, b: int, precisions: list[str]) -> Table:
    columns: list[tuple[str, ColumnKind]] = [("Phase", "name")]
    rows: dict[str, list[Cell]] = {}
    for p in precisions:
        lines = facts.phases(profile, b, p)
        reserved = any(line.reserved_bytes is not None for line in lines)
        columns.append((f"{p} allocated" if reserved else p, "num"))
        if reserved:
            columns.append((f"{p} reserved", "num"))
        for line in lines:
            cells = rows.setdefault(line.phase, [line.phase])
            cells.append(fmt_bytes(line.allocated_bytes))
            if reserved:
                cells.append(fmt_bytes(line.reserved_bytes))
    return _table(columns, list(rows.values()))


def _profile_header(profile: Profile) -> Panel:
    d = profile.device
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    total = f", {fmt_bytes(d.total_bytes)}" if d.total_bytes else ""
    grid.add_row("Device", f"{d.name} ({d.kind}{total}), torch {d.torch_version or '?'}")
    grid.add_row(
        "Measured at", f"batch sizes {profile.batch_sizes[0]} and {profile.batch_sizes[1]}"
    )
    grid.add_row("Precisions", ", ".join(profile.steps))
    grid.add_row(
        "Blocks",
        f"{len(profile.blocks)} ({profile.blocks[0].type_name})"
        if profile.blocks
        else "none found",
    )
    grid.add_row("Profiling took", fmt_ms(profile.profiling_ms))
    return Panel(
        grid,
        title=f"[bold]memadvisor profile[/] · {profile.model_name}",
        title_align="left",
        border_style="blue",
    )


def _print_advice(plan: Plan, console: Console) -> None:
    """Each recommendation: its title, its sentence, its code, its effect.

    The code is printed line by line with soft wrapping and no frame: a panel or a syntax
    block pads and crops each line to the console's width (80 columns when piped), which cut
    a line mid-token, a syntax error once pasted. Here a long line runs past the right edge
    and the terminal wraps it for display; the characters, and so a paste, stay whole. The
    ```python fences mark where the code starts and ends, for the eye and for tools.
    """
    if not plan.advice:
        console.print("[dim]No recommendations: the plain step already fits at its best.[/]")
        return
    console.print()
    console.print(Text("Recommendations", style="bold"))
    for i, advice in enumerate(plan.advice, 1):
        console.print()
        console.print(Text(f"{i}. {advice.title}", style="bold cyan"))
        console.print(Text(advice.sentence))
        if advice.snippet:
            print_code(console, advice.snippet)
        if advice.effect:
            console.print(Text(f"Effect: {advice.effect}", style="green"))


def _print_loading(loading: LoaderAdvice, console: Console) -> None:
    console.print()
    console.print(Text("Data loading", style="bold"))
    console.print(_loader_table(loading))
    for sentence in loading.sentences:
        console.print(Text(sentence, style="yellow" if loading.limits_throughput else ""))
    if loading.snippet:
        print_code(console, loading.snippet)


def _loader_table(loading: LoaderAdvice) -> Table:
    rows: list[list[Cell]] = []
    for label, t in [("yours", loading.current)] + [("", v) for v in loading.variants]:
        rows.append(
            [
                Text(label, style="bold") if label else "",
                str(t.num_workers),
                str(t.pin_memory),
                fmt_ms(t.first_batch_ms),
                fmt_ms(t.batch_ms),
                fmt_rate(t.samples_per_s),
            ]
        )
    columns: list[tuple[str, ColumnKind]] = [
        ("Loader", "name"),
        ("Workers", "num"),
        ("Pinned", "num"),
        ("First batch", "num"),
        ("Per batch", "num"),
        ("Samples/s", "num"),
    ]
    return _table(columns, rows)


def print_code(console: Console, code: str) -> None:
    """``code`` between ```python fences, highlighted on a terminal, never wrapped or cut."""
    console.print(Text("```python", style="dim"), soft_wrap=True)
    syntax = Syntax("", "python", theme="ansi_dark", background_color="default")
    for line in code.rstrip("\n").splitlines():
        text = syntax.highlight(line)
        text.rstrip()  # highlight() ends each piece with a newline of its own
        console.print(text, soft_wrap=True)
    console.print(Text("```", style="dim"), soft_wrap=True)


def _print_adoption(plan: Plan, console: Console) -> None:
    console.print()
    console.print(Text("Train with it in your own loop", style="bold"))
    code = adoption_snippet(plan)
    console.print(Syntax(code, "python", theme="ansi_dark", background_color="default"))


def _probes_line(plan: Plan) -> str:
    took = fmt_ms(plan.plan_wall_ms)
    return f"[dim]{facts.device_runs(plan)}; planning took {took}.[/]"
