"""The HTML report: one self-contained file (inline CSS and SVG, no network, no fonts to fetch) that opens offline,
reads on a laptop screen and prints.

Everything shown comes redacted from the model (a Report, a FleetView, a comparison's view: reports/model.py and
reports/compare.py redact every string, figures included, once) and is escaped by Jinja's autoescape; this module
only renders (tests/test_report_contract.py holds it to that). A Content-Security-Policy in the page allows only its
own stylesheet and sorting script (by hash): even a string that slipped through could neither run a script nor
fetch anything.
"""

from __future__ import annotations

import base64
import hashlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup, escape

from diagnoser import __version__
from diagnoser.diagnosis import SCHEMA_VERSION
from diagnoser.errors import InputError
from diagnoser.fileio import write_atomic
from diagnoser.reports import svg
from diagnoser.reports.figdata import (
    Bars,
    Bullet,
    FigureSpec,
    GainPairs,
    Histogram,
    Lanes,
    Ratios,
    Roofline,
    StackedBar,
    StackedRows,
    TimeSeries,
)
from diagnoser.reports.figures import source_name
from diagnoser.reports.labels import VERDICT_COLORS
from diagnoser.reports.model import FleetView, Report
from diagnoser.reports.trace_figures import duration_text
from diagnoser.units import fmt, gain

_TEMPLATES = Path(__file__).parent / "templates"


def _breakable(text: str) -> Markup:
    """A long identifier (a kernel name) that may wrap after its separators rather than mid-word: escaped, then a
    <wbr> after each _ , / < and :: ."""
    safe = str(escape(text))
    for sep in ("_", "&lt;", "::", ",", "/"):
        safe = safe.replace(sep, sep + "<wbr>")
    return Markup(safe)


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), autoescape=True,
                             undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)
    env.filters["fmt"] = fmt
    env.filters["gain"] = gain
    env.filters["pct"] = lambda v: "n/a" if v is None else f"{v:.0%}"
    env.filters["source"] = source_name
    env.filters["sentence"] = lambda v: v[:1].upper() + v[1:]  # "VRAM-limited" stays VRAM, unlike capitalize
    env.filters["us"] = duration_text
    env.filters["breakable"] = _breakable
    return env


@lru_cache(maxsize=1)
def _assets() -> tuple[str, str, str]:
    """The stylesheet, the script and the CSP that allows exactly them."""
    # Verdict colours come from VERDICT_COLORS, the same table the SVG charts use.
    css = (_TEMPLATES / "report.css").read_text() + "".join(
        f".v-{key} {{ --vc: {color}; }}\n" for key, color in VERDICT_COLORS.items())
    js = (_TEMPLATES / "report.js").read_text()

    def digest(text: str) -> str:
        return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"

    csp = (f"default-src 'none'; style-src {digest(css)}; script-src {digest(js)}; img-src data:; "
           "base-uri 'none'; form-action 'none'")
    return css, js, csp


def _page(template: str, **context: Any) -> str:
    css, js, csp = _assets()
    return _env().get_template(template).render(css=Markup(css), js=Markup(js), csp=csp, tool_version=__version__,
                                                schema_version=SCHEMA_VERSION, **context)


def draw(spec: FigureSpec, width: float | None = None) -> Markup:
    """One figure's data, drawn as inline SVG `width` user units wide (None: the chart's own width)."""
    if isinstance(spec, TimeSeries):
        return svg.time_series(spec.title, spec.lines, unit=spec.unit, x_max=spec.x_max, y_max=spec.y_max,
                               hlines=spec.hlines, bands=spec.bands, width=width or svg.WIDE)
    if isinstance(spec, StackedBar):
        return svg.stacked_bar(spec.title, spec.segments, width=width or spec.width, note=spec.note)
    if isinstance(spec, Bars):
        return svg.bar_chart(spec.title, spec.items, unit=spec.unit, width=width or svg.WIDE)
    if isinstance(spec, Roofline):
        return svg.roofline(spec.title, spec.bandwidth, spec.roofs, spec.points, width=width or svg.WIDE)
    if isinstance(spec, Bullet):
        return svg.throughput_bullet(spec.title, spec.achieved, spec.marks, unit=spec.unit, width=width or svg.WIDE)
    if isinstance(spec, GainPairs):
        return svg.gain_pairs(spec.title, spec.pairs, band=spec.band, width=width or svg.WIDE)
    if isinstance(spec, Ratios):
        return svg.ratio_chart(spec.title, spec.items, width=width or svg.WIDE)
    if isinstance(spec, Lanes):
        return svg.lanes_chart(spec.title, spec.lanes, spec.length_us, spec.legend, width=width or svg.WIDE)
    if isinstance(spec, Histogram):
        return svg.histogram(spec.title, spec.edges_us, spec.counts, spec.times, spec.markers,
                             open_last=spec.open_last, width=width or svg.WIDE)
    if isinstance(spec, StackedRows):
        return svg.stacked_rows(spec.title, spec.rows, spec.legend, width=width or svg.WIDE)
    raise TypeError(f"no drawing for {type(spec).__name__}")


def draw_both(spec: FigureSpec, wide: bool = False) -> Markup:
    """The chart at its own width and at a phone's: the stylesheet shows the one that fits its card, so a chart's
    text keeps its size on any screen instead of shrinking with the drawing. A page-wide chart (`wide`, or a bar
    drawn wide) comes at a page's width too."""
    if wide or (isinstance(spec, StackedBar) and spec.width >= svg.FULL_FROM):
        drawings = [draw(spec, svg.FULL), draw(spec, svg.WIDE)]
    else:
        drawings = [draw(spec)]
    drawings.append(draw(spec, svg.NARROW))
    return Markup("\n").join(drawings)


@dataclass
class _Drawn:
    key: str
    title: str
    svg: Markup
    caption: str
    wide: bool


class HtmlRenderer:
    """Renders a Report (or a FleetView) as one self-contained HTML document."""

    def render(self, report: Report) -> str:
        figures = [_Drawn(f.key, f.title, draw_both(f.spec, f.wide), f.caption, f.wide) for f in report.figures]
        return _page(
            "report.html.j2", report=report, verdict=report.verdict, headline=report.headline,
            secondary=report.secondary, top_fixes=report.top_fixes, all_fixes=report.fixes,
            withheld=report.withheld, findings=report.findings, figures=figures, not_drawn=report.not_drawn,
            skipped=report.skipped, signals=report.signals, ctx=report.ctx, source_names=report.source_names,
            title=report.title, window_text=report.window_text, regime=report.regime, generated=report.generated,
            kernels=report.kernels, meter=svg.meter)

    def render_fleet(self, view: FleetView) -> str:
        chart = draw_both(view.verdict_chart) if view.verdict_chart is not None else None
        return _page("fleet.html.j2", rows=view.rows, details=view.details, groups=view.groups,
                     summary=view.summary, verdict_chart=chart, start=view.start, end=view.end, title=view.title,
                     generated=view.generated, source=view.source, query_seconds=view.query_seconds,
                     errors=view.errors)


def _atomic_write(text: str, path: str | Path) -> Path:
    """A crash mid-write leaves the old file (or none), never half a report."""
    try:
        return write_atomic(path, text.encode("utf-8"))
    except OSError as exc:
        raise InputError(f"cannot write the report to {path}: {exc.strerror or exc}.") from None


def write_html(report: Report, path: str | Path) -> Path:
    """Render and write the report atomically; returns the path written."""
    return _atomic_write(HtmlRenderer().render(report), path)


def write_fleet_html(view: FleetView, path: str | Path) -> Path:
    """Render and write the fleet report atomically; returns the path written."""
    return _atomic_write(HtmlRenderer().render_fleet(view), path)


__all__ = ["HtmlRenderer", "VERDICT_COLORS", "draw", "draw_both", "write_fleet_html", "write_html"]
