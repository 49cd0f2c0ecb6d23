"""The HTML report: one self-contained file that a browser with no network draws.

The Chromium tests render the page in headless Chromium (Debian's ``chromium`` package;
``.ci/run`` installs it) and check that the charts were drawn, in the DOM and in pixels.
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest

from memadvisor.report import render_plan_html, render_profile_html, write_html
from memadvisor.schema.plan import Plan
from memadvisor.schema.profile import Profile
from memadvisor.units import fmt_bytes, fmt_rate

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
# Without the networking flags Chromium stalls on a closed network; --no-sandbox because
# CI runs as root.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-quic",
    "--hide-scrollbars",
    "--proxy-server=127.0.0.1:9",  # any network fetch would fail: the page must not need one
]
ALLOCATED_LINE_RGB = (0x2F, 0x6F, 0xDD)  # the memory chart's allocated curve, _html_assets.py


@pytest.fixture
def chromium() -> str:
    """Chromium's path; skips without one, except in CI (.ci/run), where it must run."""
    if CHROMIUM is None:
        message = "headless Chromium is not installed: apt-get install -y chromium"
        if os.environ.get("MEMADVISOR_REQUIRE_CHROMIUM"):
            pytest.fail(f"{message} (MEMADVISOR_REQUIRE_CHROMIUM is set: CI must run this test)")
        pytest.skip(message)
    return CHROMIUM


def _chromium(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    profile_dir = tmp_path / f"chromium-profile-{len(list(tmp_path.iterdir()))}"
    return subprocess.run(
        [str(CHROMIUM), *FLAGS, f"--user-data-dir={profile_dir}", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def _dom(tmp_path: Path, page: Path) -> str:
    return _chromium(tmp_path, "--dump-dom", page.as_uri()).stdout


def _screenshot(tmp_path: Path, page: Path, size: str = "1100,1200") -> Path:
    shot = tmp_path / "shot.png"
    _chromium(tmp_path, f"--screenshot={shot}", f"--window-size={size}", page.as_uri())
    return shot


def _read_png(data: bytes) -> tuple[int, int, int, list[bytes]]:
    """Width, height, channels and rows of an 8-bit PNG: a stdlib-only decoder for tests."""
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat = 8, []
    width = height = channels = 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        pos += 12 + length
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", body[:10])
            if depth != 8 or color not in (2, 6):
                raise ValueError(f"only 8-bit RGB/RGBA, but got {depth=} {color=}")
            channels = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat.append(body)
    raw = zlib.decompress(b"".join(idat))
    stride, c = width * channels, channels
    prev, rows = bytearray(stride), []
    for y in range(height):
        start = y * (stride + 1)
        kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
        if kind == 1:
            for i in range(c, stride):
                line[i] = (line[i] + line[i - c]) & 255
        elif kind == 2:
            line = bytearray((a + b) & 255 for a, b in zip(line, prev, strict=True))
        elif kind == 3:
            for i in range(stride):
                left = line[i - c] if i >= c else 0
                line[i] = (line[i] + (left + prev[i]) // 2) & 255
        elif kind == 4:
            for i in range(stride):
                a = line[i - c] if i >= c else 0
                b, cc = prev[i], (prev[i - c] if i >= c else 0)
                p = a + b - cc
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - cc)
                pred = a if pa <= pb and pa <= pc else (b if pb <= pc else cc)
                line[i] = (line[i] + pred) & 255
        rows.append(bytes(line))
        prev = line
    return width, height, channels, rows


def _sampled_pixels(rows: list[bytes], channels: int, every: int = 7) -> list[bytes]:
    """Every ``every``-th pixel's RGB: enough for statistics, fast in pure Python."""
    return [row[i : i + 3] for row in rows for i in range(0, len(row), channels * every)]


# -- the file itself --------------------------------------------------------------------------


def test_page_is_self_contained_no_url_is_loaded(plan: Plan) -> None:
    page = render_plan_html(plan)
    assert page.count("<script") == 2  # the data and the drawing code, both inline
    assert not re.search(r"<script[^>]+src=|<link\b|<img\b|<iframe\b|@import|url\(", page)
    # The only URL is the SVG namespace the script names, which is never fetched.
    assert set(re.findall(r"https?://[^\s\"'<>)]+", page)) == {"http://www.w3.org/2000/svg"}


def test_page_holds_the_plans_numbers_as_text(plan: Plan) -> None:
    page = render_plan_html(plan)
    for text in (
        "8.00 GiB",
        "bf16 autocast",
        "12 × 2 accumulation steps = effective batch 24",
        fmt_bytes(plan.estimate.peak_bytes),
        fmt_bytes(plan.verified.peak_bytes),
        fmt_rate(plan.verified.samples_per_s),
        "+Checkpointing",
        "lm_head",
        "&lt;loss&gt;",
        "from torch.utils.checkpoint import checkpoint",
    ):
        assert text in page, text


def test_page_has_the_adoption_code_the_terminal_prints(plan: Plan) -> None:
    """The "Train with it in your own loop" section is in the page, the same code as the
    terminal's, escaped."""
    import html

    from memadvisor.report._adopt import adoption_snippet

    page = render_plan_html(plan)
    assert 'id="adopt"' in page and "Train with it in your own loop" in page
    assert html.escape(adoption_snippet(plan), quote=True) in page


def test_embedded_data_cannot_close_its_script_tag(plan: Plan) -> None:
    evil = "</script><script>alert(1)</script>"
    page = render_plan_html(plan.model_copy(update={"model_name": evil, "notes": [evil]}))
    assert evil not in page
    assert page.count("</script>") == 2


def test_write_html_refuses_a_missing_folder_with_bad_input(tmp_path: Path) -> None:
    from memadvisor.errors import BadInputError

    with pytest.raises(BadInputError, match="Cannot write the HTML report"):
        write_html("<p>x</p>", tmp_path / "no" / "such" / "dir.html")


# -- drawn by a browser -----------------------------------------------------------------------


@pytest.mark.usefixtures("chromium")
def test_chromium_draws_the_plan_page_with_its_numbers(plan: Plan, tmp_path: Path) -> None:
    page = write_html(render_plan_html(plan), tmp_path / "plan.html")
    dom = _dom(tmp_path, page)
    assert 'data-drawn="yes"' in dom  # the script ran to its end without an error
    assert 'class="allocated"' in dom and 'class="budget"' in dom
    owners = len(plan.profile.steps["bf16"].blocks) + len(plan.profile.steps["bf16"].outside)
    blocks = len(plan.profile.blocks)
    assert dom.count('class="bar"') == owners + blocks  # activation bars + recompute bars
    for text in (
        fmt_bytes(plan.verified.peak_bytes),
        fmt_rate(plan.verified.samples_per_s),
        "budget 8.00 GiB",  # drawn by the script on the chart
        "transformer.h.3",
    ):
        assert text in dom, text


# Run after the page's own script: each SVG text drawn past its chart's viewBox (a title cut
# off at the panel's edge) is listed in the body's data-clipped attribute.
_CLIPPED_PROBE = """<script>
(function () {
  var out = [];
  document.querySelectorAll("svg.chart").forEach(function (svg) {
    var box = svg.viewBox.baseVal;
    svg.querySelectorAll("text").forEach(function (t) {
      var b = t.getBBox();
      if (b.x < box.x - 0.5 || b.x + b.width > box.x + box.width + 0.5) {
        out.push(svg.id + ": " + t.textContent);
      }
    });
  });
  document.body.setAttribute("data-clipped", out.join(" | ") || "none");
})();
</script></body>"""


@pytest.mark.usefixtures("chromium")
def test_chromium_draws_every_chart_and_no_text_runs_off_one(plan: Plan, tmp_path: Path) -> None:
    """The comparison chart has a peak bar and a samples/s bar per configuration (the Plan
    row included), the other charts are drawn, and no text of any chart (titles, labels)
    runs past its chart's edge: the recompute chart's title was cut off in every report."""
    page_text = render_plan_html(plan).replace("</body>", _CLIPPED_PROBE)
    page = tmp_path / "plan.html"
    page.write_text(page_text, encoding="utf-8")
    dom = _dom(tmp_path, page)
    rows = len(plan.comparison) + (0 if any(r.label == "Plan" for r in plan.comparison) else 1)
    assert dom.count('class="bar peak"') == rows and dom.count('class="bar rate"') == rows
    for chart in ("comparison-chart", "memory-chart", "activation-bars", "recompute-bars"):
        drawn = re.search(rf'<svg id="{chart}"[^>]*viewBox="0 0 \d+', dom)
        assert drawn, f"{chart} was not drawn"
    clipped = re.search(r'data-clipped="([^"]*)"', dom)
    assert clipped and clipped.group(1) == "none", clipped.group(1) if clipped else dom[:200]


@pytest.mark.usefixtures("chromium")
def test_chromium_screenshot_of_the_plan_is_not_blank(plan: Plan, tmp_path: Path) -> None:
    page = write_html(render_plan_html(plan), tmp_path / "plan.html")
    _, _, channels, rows = _read_png(_screenshot(tmp_path, page).read_bytes())
    pixels = _sampled_pixels(rows, channels)
    luma = [(p[0] * 299 + p[1] * 587 + p[2] * 114) // 1000 for p in pixels]
    mean = sum(luma) / len(luma)
    variance = sum((v - mean) ** 2 for v in luma) / len(luma)
    assert variance > 100, f"a nearly uniform screenshot: luminance variance {variance:.1f}"
    assert len(set(pixels)) > 200  # text, tables, bands and curves, not one flat colour
    # The memory curve itself was painted, not only the text around it: its colour, exactly,
    # along the middle of a 2.5 px line hundreds of pixels long.
    line = bytes(ALLOCATED_LINE_RGB)
    assert sum(row.count(line) for row in rows) > 300


@pytest.mark.usefixtures("chromium")
def test_chromium_draws_the_profile_page(profile: Profile, tmp_path: Path) -> None:
    page = write_html(render_profile_html(profile), tmp_path / "profile.html")
    dom = _dom(tmp_path, page)
    assert 'data-drawn="yes"' in dom and 'class="allocated"' in dom
    assert 'class="budget"' not in dom  # a profile has no budget to draw
    assert "lm_head" in dom and fmt_bytes(profile.optimizer_state_bytes) in dom


@pytest.mark.usefixtures("chromium")
def test_chromium_draws_a_recorded_timeline_with_reserved_bytes(
    profile: Profile, tmp_path: Path
) -> None:
    """A CUDA-like timeline: allocated and reserved curves, one band per phase mark."""
    from memadvisor.report import series_from_timeline
    from memadvisor.timeline import Timeline, TimelineEvent

    mib = 2**20
    events = []
    for i, phase in enumerate(("forward", "loss", "backward", "optimizer", "zero_grad", "end")):
        events.append(
            TimelineEvent(
                t_ms=10.0 * i,
                kind="phase",
                phase=phase,
                allocated_bytes=100 * mib,
                reserved_bytes=128 * mib,
            )  # fmt: skip
        )
        events += [
            TimelineEvent(
                t_ms=10.0 * i + k,
                kind="sample",
                allocated_bytes=(100 + 9 * k) * mib,
                reserved_bytes=(128 + 9 * k) * mib,
            )  # fmt: skip
            for k in range(1, 10)
        ]
    timeline = Timeline(events=events, device="cuda:0", model_name="GPT")
    series = series_from_timeline(timeline)
    assert [s[0] for s in series.spans] == ["forward", "loss", "backward", "optimizer", "zero_grad"]
    page = write_html(render_profile_html(profile, series=series), tmp_path / "profile.html")
    dom = _dom(tmp_path, page)
    assert 'data-drawn="yes"' in dom
    assert 'class="allocated"' in dom and 'class="reserved"' in dom
    assert dom.count('class="phase"') == 5
    assert "One training step of GPT recorded on cuda:0." in dom
