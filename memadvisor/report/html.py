"""The report as one self-contained HTML file: charts, tables and advice, no network needed.

Tables and text are written here, so every number is in the page even before its script
runs; the charts are SVG that the inline script draws from the facts embedded as JSON.
"""

from __future__ import annotations

import html
import json
from collections.abc import Iterable
from pathlib import Path

from memadvisor.files import write_text_atomic
from memadvisor.profiler import OpAllocation
from memadvisor.report import _facts as facts
from memadvisor.report._adopt import adoption_snippet
from memadvisor.report._html_assets import CSS, SCRIPT
from memadvisor.report._planned_step import PlannedStep
from memadvisor.report._words import (
    OPS_NOTE,
    OWNERS_NOTE,
    answer_rows,
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

__all__ = ["render_plan_html", "render_profile_html", "write_html"]

_BAR_COLORS = (
    "Blue: a block; orange: not a block, which checkpointing cannot reach. Recompute bars: the "
    "median forward of the blocks identical to each one, the whisker from the fastest to the "
    "slowest of them (one timing alone is noise on a busy machine)."
)


def render_plan_html(
    plan: Plan,
    *,
    series: facts.MemorySeries | None = None,
    step: PlannedStep | None = None,
    ops: list[OpAllocation] | None = None,
) -> str:
    """The plan's report page.

    Args:
        plan: the planner's answer; its profile (when it carries one) feeds the charts.
        series: memory over time from a recorded timeline; without one the chart shows the
            profile's per-phase peaks and says so.
        step: the plan's own step, recorded (its series and op table); overrides the two.
        ops: the operations that allocate most, for their table; none: no table.
    """
    if step is not None:
        series, ops = step.series, step.ops
    a = facts.answer(plan)
    profile = plan.profile
    parts = [
        f"<h1>memadvisor plan · {_e(a.model_name)}</h1>",
        f'<p class="sub">on {_e(device_title(a))} · budget '
        f"{fmt_bytes(a.budget_bytes)} · objective {_e(a.objective)}</p>",
        _answer(a),
        _section("comparison", "Configurations compared", _comparison(plan)),
    ]
    if not plan.capabilities.measures_memory:
        parts.append(
            _section(
                "predicted-phases",
                "Predicted peak per phase, each configuration at its batch (estimated: "
                "nothing ran on a device)",
                _predicted_phases(facts.predicted_phases(plan)),
            )
        )
    data: dict = {
        "budget_bytes": a.budget_bytes,
        "phase_colors": PHASE_COLORS,
        "comparison": [
            line.model_dump(
                include={
                    "label",
                    "peak_bytes",
                    "samples_per_s",
                    "measured",
                    "time_measured",
                    "is_plan",
                    "over_budget",
                }
            )
            for line in facts.comparison(plan)
        ],
    }
    if profile is not None:
        b = max(profile.batch_sizes)
        series = series or facts.series_from_phases(profile, b, a.precision)
        owners = facts.consumers(profile, a.batch_size, a.precision, a.checkpointed, a.loss_rewrite)
        data.update(series=series.model_dump(), consumers=[c.model_dump() for c in owners])
        parts += [
            _memory_chart(series),
            _owners_charts(
                f"Activations by owner at batch {a.batch_size}, {a.precision}. {_BAR_COLORS} "
                "Light teal: freed by the plan (checkpointing, a rewritten loss); dark teal: the "
                "input a checkpointed block still keeps."
            ),
            _section(
                "kinds",
                f"Where the memory goes at the plan's peak ({a.estimated_peak_phase}, estimated)",
                _kinds(facts.kinds_at_plan_peak(plan)),
            ),
            _section(
                "consumers",
                f"Top activation owners at batch {a.batch_size}, {a.precision}",
                _consumers(owners, show_kept=bool(a.checkpointed) or a.loss_rewrite is not None),
                "\n".join([OWNERS_NOTE, *owner_notes(owners)]),
            ),
            _section(
                "phases",
                f"Per-phase peaks of the plain step as profiled (batch {b})",
                _phases(profile, b, list(profile.steps)),
                fragmentation(profile),
            ),
        ]
    if ops:
        parts.append(_ops_section(ops, f"at batch {a.batch_size}, {a.precision}"))
    parts.append(_section("advice", "Recommendations", _advice(plan)))
    parts.append(
        _section(
            "adopt",
            "Train with it in your own loop",
            f"<pre><code>{_e(adoption_snippet(plan))}</code></pre>",
            "Runs as printed once model, plan and dataset (and loss_fn or forward_fn where "
            "you planned with one) are defined.",
        )
    )
    if plan.data_loading is not None:
        parts.append(_loading(plan.data_loading))
    if plan.checks:
        items = "".join(
            f"<li><b>{_e(c.strategy)}</b> ({'passed' if c.passed else 'look at this'}): "
            f"{_e(c.summary)}</li>"
            for c in plan.checks
        )
        parts.append(_section("checks", "Checks on your workload", f"<ul>{items}</ul>"))
    if plan.probes:
        parts.append(f'<p class="note" id="probes">{_e(facts.device_runs(plan))}.</p>')
    return _page(f"memadvisor plan · {a.model_name}", parts, data)


def render_profile_html(
    profile: Profile,
    *,
    batch_size: int | None = None,
    series: facts.MemorySeries | None = None,
    ops: list[OpAllocation] | None = None,
) -> str:
    """The profile's report page: memory over the step, activation owners, phases."""
    b = batch_size or max(profile.batch_sizes)
    series = series or facts.series_from_phases(profile, b)
    owners = facts.consumers(profile, b)
    d = profile.device
    parts = [
        f"<h1>memadvisor profile · {_e(profile.model_name)}</h1>",
        f'<p class="sub">on {_e(d.name)} ({_e(d.kind)}) · measured at batch sizes '
        f"{profile.batch_sizes[0]} and {profile.batch_sizes[1]} · precisions "
        f"{_e(', '.join(profile.steps))} · profiling took {fmt_ms(profile.profiling_ms)}</p>",
        _memory_chart(series),
        _owners_charts(f"Activations by owner at batch {b}, fp32. {_BAR_COLORS}"),
        _section(
            "kinds",
            f"Memory by kind at batch {b}, fp32",
            _kinds(facts.kinds_of_profile(profile, b)),
        ),
        _section(
            "consumers",
            f"Top activation owners at batch {b}, fp32",
            _consumers(owners, show_kept=False),
            "\n".join([OWNERS_NOTE, *owner_notes(owners)]),
        ),
        _section(
            "phases",
            f"Per-phase peaks at batch {b}",
            _phases(profile, b, list(profile.steps)),
            fragmentation(profile),
        ),
    ]
    if ops:
        parts.append(_ops_section(ops, f"at batch {b}, fp32"))
    data = {
        "budget_bytes": None,
        "phase_colors": PHASE_COLORS,
        "series": series.model_dump(),
        "consumers": [c.model_dump() for c in owners],
    }
    return _page(f"memadvisor profile · {profile.model_name}", parts, data)


def write_html(page: str, path: str | Path) -> Path:
    """Write a rendered page to ``path``, whole or not at all (:mod:`memadvisor.files`).

    Raises:
        BadInputError: the file cannot be written (no such folder, no permission, a
            non-regular target); a file there before is left whole.
    """
    return write_text_atomic(path, page, "the HTML report")


# -- pieces -----------------------------------------------------------------------------------


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def _page(title: str, parts: Iterable[str], data: dict) -> str:
    # "<" escaped so no string in the data (a module name, a note) can close the script tag.
    payload = json.dumps(data, separators=(",", ":")).replace("<", "\\u003c")
    from memadvisor._version import __version__

    return (
        '<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{CSS}</style></head>\n<body><main>\n"
        + "\n".join(parts)
        + f"\n<footer>memadvisor {_e(__version__)} · one self-contained file: it needs no "
        "network to open.</footer>\n</main>\n"
        f'<script type="application/json" id="memadvisor-data">{payload}</script>\n'
        f"<script>{SCRIPT}</script>\n</body></html>\n"
    )


def _section(anchor: str, title: str, body: str, note: str | None = None) -> str:
    note_html = "".join(f'<p class="note">{_e(line)}</p>' for line in (note or "").splitlines())
    return f'<section id="{anchor}"><h2>{_e(title)}</h2>{body}{note_html}</section>'


def _table(head: list[str], rows: Iterable[str]) -> str:
    th = "".join(f"<th>{_e(h)}</th>" for h in head)
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def _answer(a: facts.Answer) -> str:
    dl = "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in answer_rows(a))
    notes = "".join(f"<li>{_e(n)}</li>" for n in a.notes)
    return f'<section id="answer"><dl class="answer">{dl}</dl>' + (
        f'<ul class="notes">{notes}</ul></section>' if notes else "</section>"
    )


def _comparison(plan: Plan) -> str:
    rows = []
    for line in facts.comparison(plan):
        est = "" if line.measured else ' class="est"'
        mark = "" if line.measured else "~"
        time_est = "" if line.time_measured else ' class="est"'
        time_mark = "" if line.time_measured else "~"
        batch = str(line.batch_size) + (
            f"×{line.accumulation_steps}" if line.accumulation_steps > 1 else ""
        )
        peak_cls = ' class="over"' if line.over_budget else est
        rows.append(
            f"<tr{' class=plan' if line.is_plan else ''}><td>{_e(line.label)}</td><td>{batch}</td>"
            f"<td{peak_cls}>{mark}{fmt_bytes(line.peak_bytes)}</td>"
            f"<td{time_est}>{time_mark}{fmt_ms(line.step_ms)}</td>"
            f"<td>{line.largest_batch if line.largest_batch is not None else '—'}</td>"
            f"<td{time_est}>{time_mark}{fmt_rate(line.samples_per_s)}</td>"
            f"<td>{'measured' if line.measured else 'estimated'}</td></tr>"
        )
    table = _table(
        ["Config", "Batch", "Peak", "Step", "Largest batch", "Samples/s", "Source"], rows
    )
    chart = (
        '<svg id="comparison-chart" class="chart" role="img" aria-label="peak and samples/s '
        'of each configuration"></svg>'
    )
    return (
        chart + table + f'<p class="note">{_e(comparison_note(plan, "~ (grey italics)"))} '
        "In the chart, pale bars are estimated.</p>"
    )


def _predicted_phases(lines: list[facts.PredictedPhases]) -> str:
    rows = []
    for line in lines:
        batch = str(line.batch_size) + (
            f"×{line.accumulation_steps}" if line.accumulation_steps > 1 else ""
        )
        cells = "".join(
            f'<td class="est">{"<b>" if phase == line.peak_phase else ""}~{fmt_bytes(nbytes)}'
            f"{'</b>' if phase == line.peak_phase else ''}</td>"
            for phase, nbytes in (
                ("forward", line.forward_bytes),
                ("backward", line.backward_bytes),
                ("optimizer", line.optimizer_bytes),
            )
        )
        largest = line.largest_batch if line.largest_batch is not None else "—"
        rows.append(
            f"<tr{' class=plan' if line.is_plan else ''}><td>{_e(line.label)}</td>"
            f"<td>{batch}</td>{cells}<td>{largest}</td></tr>"
        )
    return _table(["Config", "Batch", "Forward", "Backward", "Optimizer", "Largest batch"], rows)


def _kinds(lines: list[facts.KindLine]) -> str:
    rows = (
        f"<tr><td>{_e(kind_words(k.kind))}</td><td>{fmt_bytes(k.nbytes)}</td>"
        f"<td>{k.share:.0%}</td></tr>"
        for k in lines
    )
    return _table(["Kind", "Bytes", "Share"], rows)


def _consumers(owners: list[facts.Consumer], *, show_kept: bool) -> str:
    head = ["Module", "Type", "Saved for backward", "Share"]
    head += ["Kept under the plan"] if show_kept else []
    head += ["Forward"]
    rows = []
    for c in owners:
        tag = '<span class="tag out">not a block</span>' if c.owner == "outside" else ""
        kept = ""
        if show_kept:
            ckpt = '<span class="tag ckpt">checkpointed</span>' if c.checkpointed else ""
            if c.loss_rewrite is not None:
                ckpt = f'<span class="tag ckpt">{_e(c.loss_rewrite.brief)}</span>'
            kept = f"<td>{fmt_bytes(c.kept_bytes)}{ckpt}</td>"
        rows.append(
            f"<tr><td>{_e(c.name)}{tag}</td><td>{_e(c.type_name)}</td>"
            f"<td>{fmt_bytes(c.activation_bytes)}</td><td>{c.share:.0%}</td>{kept}"
            f"<td>{_forward(c)}</td></tr>"
        )
    return _table(head, rows)


def _loading(loading: LoaderAdvice) -> str:
    rows = (
        f"<tr><td>{label}</td><td>{t.num_workers}</td><td>{t.pin_memory}</td>"
        f"<td>{fmt_ms(t.first_batch_ms)}</td><td>{fmt_ms(t.batch_ms)}</td>"
        f"<td>{fmt_rate(t.samples_per_s)}</td></tr>"
        for label, t in [("yours", loading.current)] + [("", v) for v in loading.variants]
    )
    table = _table(["Loader", "Workers", "Pinned", "First batch", "Per batch", "Samples/s"], rows)
    cls = ' class="limits"' if loading.limits_throughput else ""
    words = "".join(f"<p{cls}>{_e(s)}</p>" for s in loading.sentences)
    code = f"<pre><code>{_e(loading.snippet)}</code></pre>" if loading.snippet else ""
    return _section("loading", "Data loading", table + words + code)


def _ops_section(ops: list[OpAllocation], where: str) -> str:
    rows = (
        f"<tr><td><code>{_e(o.op)}</code></td><td>{_e(op_module(o.module))}</td>"
        f"<td>{_e(o.phase)}</td><td>{o.calls}</td><td>{fmt_bytes(o.allocated_bytes)}</td></tr>"
        for o in ops
    )
    return _section(
        "ops",
        f"Operations that allocate most, one step {where}",
        _table(["Op", "Module", "Phase", "Calls", "Allocated"], rows),
        OPS_NOTE,
    )


def _forward(c: facts.Consumer) -> str:
    """The forward time; for identical blocks their median and, when they differ, the spread."""
    if not c.forward_ms:
        return "—"
    if c.repeats > 1 and c.forward_ms_high > c.forward_ms_low:
        return (
            f'{fmt_ms(c.forward_ms)} <span class="spread">(median of {c.repeats} identical '
            f"blocks; {fmt_ms(c.forward_ms_low)} to {fmt_ms(c.forward_ms_high)})</span>"
        )
    return fmt_ms(c.forward_ms)


def _phases(profile: Profile, b: int, precisions: list[str]) -> str:
    head = ["Phase"]
    cells: dict[str, list[str]] = {}
    for p in precisions:
        lines = facts.phases(profile, b, p)
        reserved = any(line.reserved_bytes is not None for line in lines)
        head += [f"{p} allocated", f"{p} reserved"] if reserved else [p]
        for line in lines:
            row = cells.setdefault(line.phase, [])
            row.append(fmt_bytes(line.allocated_bytes))
            if reserved:
                row.append(fmt_bytes(line.reserved_bytes))
    rows = (
        f"<tr><td>{_e(phase)}</td>{''.join(f'<td>{v}</td>' for v in values)}</tr>"
        for phase, values in cells.items()
    )
    return _table(head, rows)


# The background band of each phase in the memory chart; the script reads them from the data.
PHASE_COLORS = {
    "forward": "#dbe8ff",
    "loss": "#efe0ff",
    "backward": "#ffe6d5",
    "optimizer": "#dcf5e3",
    "zero_grad": "#eeeeee",
    "end": "#f4f4f4",
}


def _memory_chart(series: facts.MemorySeries) -> str:
    """The chart's frame and its legend: every phase band drawn has an entry.

    The legend is HTML, not drawn by the script, so it is there before any script runs; a
    narrow band (the loss takes a few percent of the step) has no room for a label inside.
    """
    phases = list(dict.fromkeys(span[0] for span in series.spans))
    entries = "".join(
        f'<li data-phase="{_e(p)}"><span class="swatch" '
        f'style="background:{PHASE_COLORS.get(p, "#eeeeee")}"></span>{_e(p)}</li>'
        for p in phases
    )
    lines = '<li><span class="swatch line" style="background:#2f6fdd"></span>allocated</li>' + (
        '<li><span class="swatch line dashed" style="border-color:#8e44ad"></span>reserved</li>'
        if any(p[2] is not None for p in series.points)
        else ""
    )
    return (
        '<section id="memory"><h2>Memory over the step</h2>'
        '<svg id="memory-chart" class="chart" role="img" aria-label="memory over time"></svg>'
        f'<ul class="legend" id="memory-legend">{lines}{entries}</ul>'
        f'<p class="caption">{_e(series.caption)}</p></section>'
    )


def _owners_charts(caption: str) -> str:
    return (
        '<section id="blocks"><h2>Activation owners and recompute cost</h2><div class="charts">'
        '<svg id="activation-bars" class="chart" role="img" aria-label="activation bytes"></svg>'
        '<svg id="recompute-bars" class="chart" role="img" aria-label="recompute ms"></svg>'
        f'</div><p class="caption">{_e(caption)}</p></section>'
    )


def _advice(plan: Plan) -> str:
    if not plan.advice:
        return "<p>No recommendations: the plain step already fits at its best.</p>"
    out = []
    for i, adv in enumerate(plan.advice, 1):
        snippet = f"<pre><code>{_e(adv.snippet)}</code></pre>" if adv.snippet else ""
        effect = f'<p class="effect">Effect: {_e(adv.effect)}</p>' if adv.effect else ""
        out.append(
            f'<div class="advice"><h3>{i}. {_e(adv.title)}</h3><p>{_e(adv.sentence)}</p>'
            f"{snippet}{effect}</div>"
        )
    return "".join(out)
