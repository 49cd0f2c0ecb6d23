"""The HTML report's stylesheet and chart script, inlined into every file it writes.

No library and no CDN: the file must open on a machine with no network (torch's own
memory viewer loads its script from a CDN and shows nothing offline). The script reads the
facts the page embeds as JSON and draws SVG with the DOM API.
"""

from __future__ import annotations

__all__ = ["CSS", "SCRIPT"]

CSS = """
:root { --ink:#1d2330; --mute:#5d6678; --line:#d9dee8; --bg:#ffffff; --panel:#f5f7fb;
        --accent:#2f6fdd; --good:#1f8a4c; --warn:#c0392b; --ckpt:#17a2b8; --out:#e67e22; }
* { box-sizing: border-box; }
body { margin: 0; font: 14px/1.45 -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif;
       color: var(--ink); background: var(--bg); }
main { max-width: 1040px; margin: 0 auto; padding: 24px 28px 48px; }
h1 { font-size: 22px; margin: 0 0 4px; }
h2 { font-size: 17px; margin: 30px 0 8px; padding-bottom: 4px;
     border-bottom: 1px solid var(--line); }
h3 { font-size: 15px; margin: 0 0 6px; }
.sub, .note, .caption { color: var(--mute); }
.note, .caption { font-size: 12.5px; margin: 6px 0 0; }
dl.answer { display: grid; grid-template-columns: max-content 1fr; gap: 6px 18px;
            background: var(--panel); border-left: 4px solid var(--good); padding: 14px 18px;
            margin: 16px 0 0; border-radius: 4px; }
dl.answer dt { font-weight: 600; }
dl.answer dd { margin: 0; }
ul.notes { margin: 10px 0 0; padding-left: 20px; color: #8a5a00; }
table { border-collapse: collapse; width: 100%; font-variant-numeric: tabular-nums; }
th, td { text-align: right; padding: 5px 10px; border-bottom: 1px solid var(--line); }
th:first-child, td:first-child { text-align: left; }
th { font-weight: 600; color: var(--mute); font-size: 12.5px; }
tr.plan td { font-weight: 700; background: #eef7f0; }
td.over { color: var(--warn); font-weight: 600; }
td.est { color: var(--mute); font-style: italic; }
.tag { display: inline-block; font-size: 11px; padding: 0 6px; border-radius: 8px;
       background: var(--line); color: var(--ink); margin-left: 6px; font-weight: 500; }
.tag.ckpt { background: #d6f1f5; }
.tag.out { background: #fbe3cc; }
.chart { width: 100%; height: auto; display: block; background: var(--panel); border-radius: 4px; }
.charts { display: grid; grid-template-columns: 1fr 1fr; gap: 14px; }
.advice { background: var(--panel); border-radius: 4px; padding: 12px 16px; margin: 10px 0; }
.advice p { margin: 0 0 8px; }
.advice .effect { color: var(--good); font-weight: 600; margin: 8px 0 0; }
pre { background: #1d2330; color: #e8ecf4; padding: 10px 12px; border-radius: 4px; margin: 0;
      overflow-x: auto; font: 12.5px/1.45 "DejaVu Sans Mono", Menlo, Consolas, monospace; }
ul.legend { list-style: none; display: flex; flex-wrap: wrap; gap: 4px 16px; margin: 6px 0 0;
            padding: 0; font-size: 12.5px; }
ul.legend li { display: flex; align-items: center; gap: 6px; }
.swatch { display: inline-block; width: 14px; height: 12px; border: 1px solid var(--line); }
.swatch.line { height: 3px; border: 0; }
.swatch.dashed { height: 0; border-top: 2px dashed; background: none !important; }
.spread { color: var(--mute); font-size: 12px; }
p.limits { color: var(--warn); font-weight: 600; }
footer { margin-top: 36px; color: var(--mute); font-size: 12px; }
"""

SCRIPT = r"""
(function () {
  "use strict";
  var NS = "http://www.w3.org/2000/svg";
  var data = JSON.parse(document.getElementById("memadvisor-data").textContent);
  var PHASE_COLORS = data.phase_colors || {};

  function fmtBytes(n) {
    var units = [["GiB", 1073741824], ["MiB", 1048576], ["KiB", 1024]];
    for (var i = 0; i < units.length; i++) {
      if (Math.abs(n) >= units[i][1]) {
        var v = n / units[i][1];
        return (Math.abs(v) < 100 ? v.toFixed(2) : v.toFixed(1)) + " " + units[i][0];
      }
    }
    return Math.round(n) + " B";
  }
  function fmtMs(ms) { return ms >= 100 ? ms.toFixed(0) + " ms" : ms.toFixed(1) + " ms"; }
  function el(tag, attrs, parent, text) {
    var node = document.createElementNS(NS, tag);
    for (var k in attrs) { node.setAttribute(k, attrs[k]); }
    if (text !== undefined) { node.textContent = text; }
    if (parent) { parent.appendChild(node); }
    return node;
  }
  // Round axis steps: 1, 2 or 5 times a power of two's neighbourhood in bytes reads badly,
  // so ticks are chosen in the unit the top value is shown in.
  function niceStep(range, count) {
    var raw = range / count, mag = Math.pow(10, Math.floor(Math.log10(raw)));
    var steps = [1, 2, 2.5, 5, 10];
    for (var i = 0; i < steps.length; i++) { if (steps[i] * mag >= raw) { return steps[i] * mag; } }
    return 10 * mag;
  }
  function byteUnit(max) {
    return max >= 1073741824 ? ["GiB", 1073741824] : max >= 1048576 ? ["MiB", 1048576]
         : ["KiB", 1024];
  }

  function drawMemory(svg, series, budget) {
    var W = 960, H = 340, L = 78, R = 20, T = 22, B = 46;
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    var pts = series.points;
    if (!pts.length) { el("text", { x: W / 2, y: H / 2, "text-anchor": "middle" }, svg,
                          "No memory samples recorded."); return; }
    var t0 = pts[0][0], t1 = pts[pts.length - 1][0];
    if (t1 <= t0) { t1 = t0 + 1; }
    var ymax = 0;
    pts.forEach(function (p) { ymax = Math.max(ymax, p[1], p[2] || 0); });
    // The budget line is drawn when it is near enough to the data to compare with.
    var showBudget = budget && budget < 2.5 * ymax;
    if (showBudget) { ymax = Math.max(ymax, budget); }
    var unit = byteUnit(ymax), step = niceStep(ymax / unit[1] * 1.08, 5) * unit[1];
    var top = Math.ceil(ymax * 1.08 / step) * step;
    function x(t) { return L + (t - t0) / (t1 - t0) * (W - L - R); }
    function y(v) { return T + (1 - v / top) * (H - T - B); }
    series.spans.forEach(function (s) {
      var x0 = x(s[1]), x1 = x(s[2]);
      el("rect", { x: x0, y: T, width: Math.max(1, x1 - x0), height: H - T - B,
                   fill: PHASE_COLORS[s[0]] || "#eeeeee", "class": "phase" }, svg);
      if (x1 - x0 > 44) {
        el("text", { x: (x0 + x1) / 2, y: T + 14, "text-anchor": "middle", "font-size": 12,
                     fill: "#5d6678" }, svg, s[0]);
      }
    });
    for (var v = 0; v <= top + 1; v += step) {
      el("line", { x1: L, x2: W - R, y1: y(v), y2: y(v), stroke: "#d9dee8" }, svg);
      el("text", { x: L - 8, y: y(v) + 4, "text-anchor": "end", "font-size": 11, fill: "#5d6678" },
         svg, (v / unit[1]).toFixed(step / unit[1] < 1 ? 1 : 0) + " " + unit[0]);
    }
    function path(index) {
      var d = "";
      pts.forEach(function (p, i) {
        if (p[index] === null || p[index] === undefined) { return; }
        d += (d ? " L" : "M") + x(p[0]).toFixed(1) + "," + y(p[index]).toFixed(1);
      });
      return d;
    }
    var hasReserved = pts.some(function (p) { return p[2] !== null && p[2] !== undefined; });
    if (hasReserved) {
      el("path", { d: path(2), fill: "none", stroke: "#8e44ad", "stroke-width": 2,
                   "stroke-dasharray": "6 4", "class": "reserved" }, svg);
    }
    el("path", { d: path(1), fill: "none", stroke: "#2f6fdd", "stroke-width": 2.5,
                 "class": "allocated" }, svg);
    if (showBudget) {
      el("line", { x1: L, x2: W - R, y1: y(budget), y2: y(budget), stroke: "#c0392b",
                   "stroke-width": 1.5, "stroke-dasharray": "8 5", "class": "budget" }, svg);
      el("text", { x: W - R - 4, y: y(budget) - 6, "text-anchor": "end", "font-size": 12,
                   fill: "#c0392b" }, svg, "budget " + fmtBytes(budget));
    }
    var unitLabel = series.time_unit === "ms" ? "time in the step (ms)" : "phases of the step";
    el("text", { x: (L + W - R) / 2, y: H - 10, "text-anchor": "middle", "font-size": 12,
                 fill: "#5d6678" }, svg, unitLabel);
    if (series.time_unit === "ms") {
      var ts = niceStep(t1 - t0, 8);
      for (var t = Math.ceil(t0 / ts) * ts; t <= t1; t += ts) {
        el("text", { x: x(t), y: H - B + 16, "text-anchor": "middle", "font-size": 11,
                     fill: "#5d6678" }, svg, String(Math.round(t * 10) / 10));
      }
    }
    // The legend (lines and every phase band) is the HTML list under the chart.
  }

  function drawBars(svg, items, value, label, color, title, spread) {
    var W = 470, row = 22, T = 30, L = 150, R = 90;
    var H = T + items.length * row + 12;
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    el("text", { x: 8, y: 18, "font-size": 13, "font-weight": 600 }, svg, title);
    var max = 0;
    items.forEach(function (it) {
      var range = spread ? spread(it) : null;
      max = Math.max(max, value(it), range ? range[1] : 0);
    });
    if (max <= 0) { max = 1; }
    items.forEach(function (it, i) {
      var yy = T + i * row, w = value(it) / max * (W - L - R);
      var name = it.name.length > 22 ? "…" + it.name.slice(-21) : it.name;
      el("text", { x: L - 6, y: yy + 14, "text-anchor": "end", "font-size": 11.5 }, svg, name);
      var parts = color(it);
      el("rect", { x: L, y: yy + 3, width: Math.max(1, w), height: row - 7, fill: parts[0],
                   "class": "bar" }, svg);
      if (parts[1] !== undefined) {
        el("rect", { x: L, y: yy + 3, width: Math.max(1, parts[1] / max * (W - L - R)),
                     height: row - 7, fill: parts[2] }, svg);
      }
      var end = L + Math.max(1, w);
      if (spread) {  // a whisker from the fastest to the slowest of identical blocks
        var lo = spread(it);
        if (lo) {
          var x0 = L + lo[0] / max * (W - L - R), x1 = L + lo[1] / max * (W - L - R);
          el("line", { x1: x0, x2: x1, y1: yy + 11, y2: yy + 11, stroke: "#1d2330",
                       "stroke-width": 1.2, "class": "spread" }, svg);
          el("line", { x1: x0, x2: x0, y1: yy + 6, y2: yy + 16, stroke: "#1d2330" }, svg);
          el("line", { x1: x1, x2: x1, y1: yy + 6, y2: yy + 16, stroke: "#1d2330" }, svg);
          end = Math.max(end, x1);
        }
      }
      el("text", { x: end + 5, y: yy + 14, "font-size": 11, fill: "#5d6678" },
         svg, label(it));
    });
  }

  // The comparison: each configuration's peak against the budget, and its samples/s.
  // Estimated values are drawn pale (and their numbers marked ~), as in the table.
  function drawComparison(svg, rows, budget) {
    var W = 960, row = 26, T = 34, L = 130, gap = 40, R = 86;
    var panel = (W - L - gap - 2 * R) / 2;
    var H = T + rows.length * row + 10;
    svg.setAttribute("viewBox", "0 0 " + W + " " + H);
    var x1 = L, x2 = L + panel + R + gap;
    el("text", { x: x1, y: 18, "font-size": 13, "font-weight": 600 }, svg, "Peak memory");
    el("text", { x: x2, y: 18, "font-size": 13, "font-weight": 600 }, svg, "Samples/s");
    var maxPeak = budget || 0, maxRate = 0;
    rows.forEach(function (r) {
      maxPeak = Math.max(maxPeak, r.peak_bytes); maxRate = Math.max(maxRate, r.samples_per_s);
    });
    if (maxPeak <= 0) { maxPeak = 1; }
    if (maxRate <= 0) { maxRate = 1; }
    rows.forEach(function (r, i) {
      var yy = T + i * row;
      el("text", { x: L - 8, y: yy + 15, "text-anchor": "end", "font-size": 12,
                   "font-weight": r.is_plan ? 700 : 400 }, svg, r.label);
      var wp = Math.max(1, r.peak_bytes / maxPeak * panel);
      el("rect", { x: x1, y: yy + 4, width: wp, height: row - 9, "class": "bar peak",
                   fill: r.over_budget ? "#c0392b" : (r.is_plan ? "#1f8a4c" : "#2f6fdd"),
                   "fill-opacity": r.measured ? 1 : 0.45 }, svg);
      el("text", { x: x1 + wp + 5, y: yy + 15, "font-size": 11, fill: "#5d6678" }, svg,
         (r.measured ? "" : "~") + fmtBytes(r.peak_bytes));
      var wr = Math.max(1, r.samples_per_s / maxRate * panel);
      el("rect", { x: x2, y: yy + 4, width: wr, height: row - 9, "class": "bar rate",
                   fill: r.is_plan ? "#1f8a4c" : "#2f6fdd",
                   "fill-opacity": r.time_measured ? 1 : 0.45 }, svg);
      el("text", { x: x2 + wr + 5, y: yy + 15, "font-size": 11, fill: "#5d6678" }, svg,
         (r.time_measured ? "" : "~") + r.samples_per_s.toFixed(r.samples_per_s < 100 ? 1 : 0));
    });
    if (budget) {
      var xb = x1 + budget / maxPeak * panel;
      el("line", { x1: xb, x2: xb, y1: T - 6, y2: H - 6, stroke: "#c0392b",
                   "stroke-width": 1.5, "stroke-dasharray": "6 4", "class": "budget" }, svg);
      el("text", { x: xb, y: T - 9, "text-anchor": "end", "font-size": 11, fill: "#c0392b" },
         svg, "budget");
    }
  }
  var cmp = document.getElementById("comparison-chart");
  if (cmp && data.comparison) { drawComparison(cmp, data.comparison, data.budget_bytes); }

  var memory = document.getElementById("memory-chart");
  if (memory && data.series) { drawMemory(memory, data.series, data.budget_bytes); }

  var owners = data.consumers || [];
  var act = document.getElementById("activation-bars");
  if (act && owners.length) {
    drawBars(act, owners, function (c) { return c.activation_bytes; },
      function (c) { return fmtBytes(c.activation_bytes); },
      function (c) {
        if (c.checkpointed || c.loss_rewrite) { return ["#b9e6ee", c.kept_bytes, "#17a2b8"]; }
        return [c.owner === "block" ? "#2f6fdd" : "#e67e22"];
      },
      "Saved for backward (bytes)");
  }
  var rec = document.getElementById("recompute-bars");
  var blocks = owners.filter(function (c) { return c.owner === "block"; });
  if (rec && blocks.length) {
    var hasSpread = function (c) { return c.repeats > 1 && c.forward_ms_high > c.forward_ms_low; };
    drawBars(rec, blocks, function (c) { return c.forward_ms; },
      function (c) { return fmtMs(c.forward_ms) + (hasSpread(c) ? " median" : ""); },
      function (c) { return [c.checkpointed ? "#17a2b8" : "#9aa7bd"]; },
      "Recompute cost per block (ms)",
      function (c) { return hasSpread(c) ? [c.forward_ms_low, c.forward_ms_high] : null; });
  }
  document.body.setAttribute("data-drawn", "yes");
})();
"""
