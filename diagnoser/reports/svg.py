"""Charts as inline SVG strings, drawn in Python: they render without JavaScript, print, and load nothing.

Each function takes numbers already in the capture, evidence or physics spec, and computes only geometry (scales,
ticks, downsampling for drawing). Every piece of text is escaped here, so a label taken from a metric (a pod name, a
kernel name full of `<` and `>`) can never become markup; it comes redacted from the report model, which redacts a
figure's data once (reports/model.py), so nothing here redacts. The result is a `markupsafe.Markup`.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Callable, Sequence

from markupsafe import Markup, escape

from diagnoser.reports.figdata import (
    PALETTE,
    ROOF,
    Band,
    GainPair,
    HLine,
    Lane,
    Line,
    Mark,
    Ratio,
    Roof,
    RoofPoint,
    Segment,
    Span,
    StackedRow,
)
from diagnoser.units import fmt

INK = "#1f2328"
MUTED = "#6e7781"
GRID = "#d8dee4"

_CHAR_W = 0.54  # average glyph width over font size, for laying out labels without a font engine
BOLD = 1.12  # bold glyphs are wider

WIDE = 520.0  # a chart's width in a report's two-column grid and on paper
NARROW = 340.0  # the same chart drawn for a phone (about 330 px of card), so its text stays at its size
NARROW_BELOW = 420.0
FULL = 1080.0  # a chart across a whole page (the fleet's verdicts, a window of the trace)
FULL_FROM = 800.0

Box = tuple[float, float, float, float]  # a label's or a mark's extent: x0, y0, x1, y1


def _num(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".") if abs(x) < 1e6 else f"{x:.0f}"


def _text_width(text: str, size: float) -> float:
    return len(text) * size * _CHAR_W


def wrap_text(text: str, width: float, size: float, max_lines: int = 4) -> list[str]:
    """Break text into lines that fit `width` pixels (at most `max_lines`, the last shortened if need be)."""
    most = max(8, int(width / (size * _CHAR_W)))
    lines = textwrap.wrap(text, most, break_long_words=True, break_on_hyphens=False) or [""]
    if len(lines) > max_lines:
        lines = lines[:max_lines - 1] + [ellipsize(" ".join(lines[max_lines - 1:]), width, size)]
    return lines


def ellipsize(text: str, width: float, size: float) -> str:
    """Shorten text to fit `width` pixels, keeping its start and end (kernel names differ at both)."""
    most = max(4, int(width / (size * _CHAR_W)))
    if len(text) <= most:
        return text
    head = (most - 1) * 2 // 3
    return text[:head] + "\u2026" + text[len(text) - (most - 1 - head):]


class _Svg:
    """A tiny SVG writer: attributes are numbers or escaped strings; text is escaped."""

    def __init__(self, width: float, height: float, label: str, css_class: str = "chart") -> None:
        self.width, self.height = width, height
        self.label = label
        # Drawn at a phone's width the chart carries "narrow", else "wide": the page shows the one that fits.
        variant = "narrow" if width < NARROW_BELOW else "full" if width >= FULL_FROM else "wide"
        self.css_class = f"{css_class} {variant}" if css_class == "chart" else css_class
        self.parts: list[str] = []

    @staticmethod
    def _attrs(attrs: dict[str, object]) -> str:
        out = []
        for key, value in attrs.items():
            if value is None:
                continue
            name = key.rstrip("_").replace("_", "-")
            text = _num(value) if isinstance(value, float) else str(value)
            out.append(f' {name}="{escape(text)}"')
        return "".join(out)

    def el(self, tag: str, **attrs: object) -> None:
        self.parts.append(f"<{tag}{self._attrs(attrs)}/>")

    def text(self, x: float, y: float, text: str, *, tip: str | None = None, **attrs: object) -> None:
        body = escape(text)
        if tip:
            body = Markup(f"<title>{escape(tip)}</title>") + body
        self.parts.append(f"<text{self._attrs({'x': x, 'y': y, **attrs})}>{body}</text>")

    def open_group(self, tip: str | None = None, **attrs: object) -> None:
        self.parts.append(f"<g{self._attrs(attrs)}>")
        if tip:
            self.parts.append(f"<title>{escape(tip)}</title>")

    def close_group(self) -> None:
        self.parts.append("</g>")

    def render(self) -> Markup:
        head = (f'<svg xmlns="http://www.w3.org/2000/svg" class="{self.css_class}" role="img" '
                f'width="{_num(self.width)}" height="{_num(self.height)}" '
                f'viewBox="0 0 {_num(self.width)} {_num(self.height)}" aria-label="{escape(self.label)}">'
                f"<title>{escape(self.label)}</title>")
        return Markup(head + "".join(self.parts) + "</svg>")


# --- scales and ticks ----------------------------------------------------------------------------------------

_OPS = {">=": "\u2265", "<=": "\u2264", "!=": "\u2260"}


def op_symbol(op: str) -> str:
    """>= as the sign a reader expects."""
    return _OPS.get(op, op)


def nice_ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values (1, 2, 2.5, 5 x 10^k steps) covering lo..hi."""
    if not (math.isfinite(lo) and math.isfinite(hi)) or hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, count)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9:
        ticks.append(round(value, 12))
        value += step
    return ticks


def nice_max(value: float) -> float:
    """A round axis maximum at or above value."""
    if value <= 0 or not math.isfinite(value):
        return 1.0
    mag = 10 ** math.floor(math.log10(value))
    return next(m * mag for m in (1, 1.2, 1.5, 2, 2.5, 3, 4, 5, 6, 8, 10) if m * mag >= value * 0.999)


_SI_SHORT = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"))


def short_number(value: float) -> str:
    """1.2k, 3T, 0.5: compact tick labels."""
    for size, suffix in _SI_SHORT:
        if abs(value) >= size:
            v = value / size
            return f"{v:.0f}{suffix}" if v >= 10 or v == int(v) else f"{v:.1f}{suffix}"
    if value == 0:
        return "0"
    if abs(value) < 1:
        return f"{value:.2g}"
    return f"{value:.0f}" if value == int(value) else f"{value:.1f}"


def _binary_base(value: float) -> float:
    """Bytes tick in binary units (GiB, MiB) so they land on round numbers the labels print."""
    for size in (1 << 40, 1 << 30, 1 << 20, 1 << 10):
        if value >= size:
            return float(size)
    return 1.0


def _nice_axis_max(value: float, unit: str) -> float:
    if unit == "bytes":
        base = _binary_base(value)
        return nice_max(value / base) * base
    return nice_max(value)


def _value_ticks(y_hi: float, unit: str) -> list[float]:
    if unit == "bytes":
        base = _binary_base(y_hi)
        return [t * base for t in nice_ticks(0.0, y_hi / base, 4)]
    return nice_ticks(0.0, y_hi, 4)


def axis_label(value: float, unit: str) -> str:
    if unit == "ratio":
        return f"{value * 100:.0f}%"
    if unit in ("bytes", "B/s", "s", "W", "MHz", "C"):
        return fmt(value, unit).replace(".0 ", " ")
    return short_number(value)


def log_ticks(lo: float, hi: float) -> list[float]:
    """Decades within lo..hi; with 2x and 5x steps added when fewer than three decades show."""
    decades = [10.0**k for k in range(math.ceil(math.log10(lo) - 1e-9), math.floor(math.log10(hi) + 1e-9) + 1)]
    if len(decades) >= 3:
        return decades
    ticks = [m * 10.0**k for k in range(math.floor(math.log10(lo)), math.ceil(math.log10(hi)) + 1)
             for m in (1, 2, 5)]
    return [t for t in ticks if lo * (1 - 1e-9) <= t <= hi * (1 + 1e-9)]


def _time_label(seconds: float, span: float) -> str:
    if span >= 1800:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:g} s" if seconds == int(seconds) else f"{seconds:.1f} s"


def downsample(times: Sequence[float], values: Sequence[float], buckets: int = 300) -> list[tuple[float, float]]:
    """At most ~2 x buckets points for drawing: each bucket keeps its min and max in time order, so spikes stay
    visible. NaNs are kept as breaks."""
    pts = list(zip(times, values, strict=True))
    if len(pts) <= 2 * buckets:
        return pts
    t0, t1 = pts[0][0], pts[-1][0]
    width = (t1 - t0) / buckets or 1.0
    out: list[tuple[float, float]] = []
    bucket: list[tuple[float, float]] = []
    index = 0
    for t, v in pts:
        b = min(buckets - 1, int((t - t0) / width))
        if b != index and bucket:
            out.extend(_min_max(bucket))
            bucket = []
        index = b
        bucket.append((t, v))
    if bucket:
        out.extend(_min_max(bucket))
    return out


def _min_max(bucket: list[tuple[float, float]]) -> list[tuple[float, float]]:
    finite = [p for p in bucket if not math.isnan(p[1])]
    if len(finite) < len(bucket):
        return [(bucket[0][0], math.nan)] if not finite else sorted({min(finite, key=lambda p: p[1]),
                                                                    max(finite, key=lambda p: p[1])}) + [
            (bucket[-1][0], math.nan)]
    lo, hi = min(bucket, key=lambda p: p[1]), max(bucket, key=lambda p: p[1])
    return sorted({lo, hi})


# --- time series ---------------------------------------------------------------------------------------------

def time_series(title: str, lines: Sequence[Line], *, unit: str, x_max: float | None = None,
                y_max: float | None = None, hlines: Sequence[HLine] = (), bands: Sequence[Band] = (),
                width: float = 520, height: float = 210) -> Markup:
    """Lines over the window, with thresholds and shaded spans; the y axis starts at zero."""
    lines = [ln for ln in lines if ln.values]
    svg = _Svg(width, height, title)
    colors = [ln.color or PALETTE[i % len(PALETTE)] for i, ln in enumerate(lines)]
    legend_h = _legend(svg, [(ln.label, c, ln.dashed) for ln, c in zip(lines, colors, strict=True)], 8, width - 8)
    left, right, top, bottom = 58.0, width - 14, 10.0 + legend_h, height - 26
    finite = [v for ln in lines for v in ln.values if math.isfinite(v)]
    top_value = max(finite + [h.value for h in hlines if math.isfinite(h.value)] + [0.0])
    y_hi = y_max if y_max is not None else _nice_axis_max(top_value * 1.05, unit)
    if y_max is not None and top_value > y_max:  # a value above the nominal maximum is shown, not clipped
        y_hi = _nice_axis_max(top_value * 1.05, unit)
    t_all = [t for ln in lines for t in ln.times]
    x_hi = x_max if x_max and x_max > 0 else (max(t_all) if t_all else 1.0)
    x_hi = max(x_hi, max(t_all, default=0.0)) or 1.0

    def sx(t: float) -> float:
        return left + (right - left) * t / x_hi

    def sy(v: float) -> float:
        return bottom - (bottom - top) * max(0.0, v) / y_hi

    for band in bands:
        x0, x1 = sx(max(0.0, band.start)), sx(min(x_hi, band.end))
        svg.open_group(tip=f"{band.label}: {band.start:g}-{band.end:g} s")
        svg.el("rect", x=x0, y=top, width=max(1.0, x1 - x0), height=bottom - top, fill="#f6d7a7",
               fill_opacity="0.55")
        svg.close_group()
    for tick in _value_ticks(y_hi, unit):
        y = sy(tick)
        svg.el("line", x1=left, y1=y, x2=right, y2=y, stroke=GRID, stroke_width="1")
        svg.text(left - 6, y + 4, axis_label(tick, unit), class_="tick", text_anchor="end")
    for tick in nice_ticks(0.0, x_hi, max(3, min(6, int((right - left) / 60)))):
        x = sx(tick)
        svg.el("line", x1=x, y1=bottom, x2=x, y2=bottom + 4, stroke=MUTED, stroke_width="1")
        svg.text(x, bottom + 19, _time_label(tick, x_hi), class_="tick", text_anchor="middle")
    svg.el("line", x1=left, y1=bottom, x2=right, y2=bottom, stroke=MUTED, stroke_width="1")
    for ln, color in zip(lines, colors, strict=True):
        pts = downsample(ln.times, ln.values, buckets=300 if width >= NARROW_BELOW else 150)
        _polyline(svg, [(sx(t), sy(v) if math.isfinite(v) else math.nan) for t, v in pts], color, ln.dashed,
                  tip=f"{ln.label}: mean {fmt(_mean(ln.values), unit)}, max {fmt(_max(ln.values), unit)}")
    for h in hlines:
        y = sy(h.value)
        svg.el("line", x1=left, y1=y, x2=right, y2=y, stroke=h.color, stroke_width="1.3", stroke_dasharray="6 4")
    for h, ty in zip(hlines, _ref_baselines([sy(h.value) for h in hlines], top, bottom), strict=True):
        # Bold text is wider: shortened to the bold width, it ends clear of the value axis's labels.
        svg.text(right - 4, ty, ellipsize(h.label, (right - left - 20) / BOLD, 11), tip=h.label, class_="ref",
                 text_anchor="end")
    return svg.render()


def _ref_baselines(ys: Sequence[float], top: float, bottom: float, gap: float = 14.0) -> list[float]:
    """Baselines for the threshold labels, each just over its line (under it near the top), moved apart so no two
    overlap when thresholds lie close (three of one rule at 60, 70 and 80 %, or two at the same value)."""
    wanted = [y + 13 if y - top < 16 else y - 4 for y in ys]
    order = sorted(range(len(ys)), key=lambda i: wanted[i])
    placed = [0.0] * len(ys)
    last = -math.inf
    for i in order:  # top down: each at least a line under the one above
        last = placed[i] = max(wanted[i], top + 11, last + gap)
    limit = bottom - 3
    for i in reversed(order):  # bottom up: back inside the plot, pushing the ones above up
        limit = placed[i] = min(placed[i], limit)
        limit -= gap
    return placed


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def _max(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def _polyline(svg: _Svg, pts: list[tuple[float, float]], color: str, dashed: bool, tip: str) -> None:
    """A path broken at NaNs and at time gaps; a lone sample is drawn as a dot."""
    xs = [x for x, _ in pts]
    steps = sorted(b - a for a, b in zip(xs, xs[1:], strict=False) if b > a)
    gap = steps[len(steps) // 2] * 5 if steps else math.inf
    runs: list[list[tuple[float, float]]] = [[]]
    prev_x = None
    for x, y in pts:
        if math.isnan(y) or (prev_x is not None and x - prev_x > gap):
            if runs[-1]:
                runs.append([])
            if math.isnan(y):
                prev_x = None
                continue
        runs[-1].append((x, y))
        prev_x = x
    svg.open_group(tip=tip)
    for run in runs:
        if len(run) == 1:
            svg.el("circle", cx=run[0][0], cy=run[0][1], r="2.5", fill=color)
        elif run:
            d = "M" + " L".join(f"{_num(x)} {_num(y)}" for x, y in run)
            svg.el("path", d=d, fill="none", stroke=color, stroke_width="1.8", stroke_linejoin="round",
                   stroke_dasharray="5 3" if dashed else None)
    svg.close_group()


def _legend(svg: _Svg, items: Sequence[tuple[str, str, bool]], x0: float, x_max: float, y0: float = 14,
            size: float = 11.5) -> float:
    """Swatches and labels in rows from (x0, y0); returns the height used."""
    if not items:
        return 0.0
    x, y = x0, y0
    for label, color, dashed in items:
        w = 22 + _text_width(label, size) + 14
        if x + w > x_max and x > x0:
            x, y = x0, y + 17
        svg.el("line", x1=x, y1=y - 4, x2=x + 16, y2=y - 4, stroke=color, stroke_width="3",
               stroke_dasharray="5 3" if dashed else None)
        svg.text(x + 21, y, ellipsize(label, x_max - x0 - 21, size), class_="legend", tip=label)
        x += w
    return y - y0 + 20


# --- roofline ------------------------------------------------------------------------------------------------

def _roof_detail(p: RoofPoint, attainable: float) -> str:
    why_not = "" if p.trusted else f"; not representative: {p.note}"
    if p.flops and p.flops > 0:
        return (f"{p.label}: {p.intensity:,.1f} FLOP/B, {fmt(p.flops, 'FLOP/s')}, {p.flops / attainable:.0%} "
                f"of its roof{why_not}")
    return f"{p.label}: {p.intensity:,.1f} FLOP/B (achieved FLOP/s not measured, so a line){why_not}"


def roofline(title: str, bandwidth: float, roofs: Sequence[Roof], points: Sequence[RoofPoint],
             *, width: float = WIDE, height: float = 300) -> Markup:
    """Log-log roofline: the memory roof (bandwidth x intensity) up to each compute roof, and the workload."""
    shown = [p for p in points if p.intensity > 0]
    primary = max((r for r in roofs if r.primary), key=lambda r: r.flops, default=roofs[0])
    # Each point is marked by its short name on the plot; its numbers go in a legend under the axis, wrapped to the
    # width (on a phone nothing can be hovered to read a shortened line).
    legend_size, line_h = 11.5, 15.0
    details = [_roof_detail(p, min(primary.flops, bandwidth * p.intensity)) for p in shown]
    legend_lines = [wrap_text(d, width - 40, legend_size, max_lines=8) for d in details]
    legend_h = sum(line_h * len(lines) + 5 for lines in legend_lines)
    if width < NARROW_BELOW:
        height -= 40
    height += legend_h
    svg = _Svg(width, height, title)
    left, right, top, bottom = (64.0 if width >= NARROW_BELOW else 54.0), width - 16, 16.0, height - 42 - legend_h
    peak = max(r.flops for r in roofs)
    ridges = [r.flops / bandwidth for r in roofs]
    xs = ridges + [p.intensity for p in points if p.intensity > 0]
    x_lo, x_hi = min(xs) / 6, max(xs) * 6
    y_hi = peak * 2.5
    ys = [bandwidth * x_lo] + [p.flops / 2 for p in points if p.flops and p.flops > 0]
    y_lo = max(y_hi / 1e6, min(ys))

    def sx(x: float) -> float:
        return left + (right - left) * (math.log10(x) - math.log10(x_lo)) / (math.log10(x_hi) - math.log10(x_lo))

    def sy(y: float) -> float:
        y = min(max(y, y_lo), y_hi)
        return bottom - (bottom - top) * (math.log10(y) - math.log10(y_lo)) / (math.log10(y_hi) - math.log10(y_lo))

    for tick in log_ticks(x_lo, x_hi):
        x = sx(tick)
        svg.el("line", x1=x, y1=top, x2=x, y2=bottom, stroke=GRID, stroke_width="1")
        svg.text(x, bottom + 16, short_number(tick), class_="tick", text_anchor="middle")
    for tick in log_ticks(y_lo, y_hi):
        y = sy(tick)
        svg.el("line", x1=left, y1=y, x2=right, y2=y, stroke=GRID, stroke_width="1")
        svg.text(left - 6, y + 4, short_number(tick), class_="tick", text_anchor="end")
    axis = "arithmetic intensity (FLOP per byte of DRAM traffic)"
    svg.text((left + right) / 2, bottom + 34, axis if width >= NARROW_BELOW else "FLOP per DRAM byte",
             class_="axis", text_anchor="middle")
    svg.text(14, (top + bottom) / 2, "FLOP/s", class_="axis", text_anchor="middle",
             transform=f"rotate(-90 14 {_num((top + bottom) / 2)})")
    # The attainable region under the primary roof, lightly shaded.
    ridge = primary.flops / bandwidth
    x_start = max(x_lo, y_lo / bandwidth)
    area = (f"M{_num(sx(x_start))} {_num(sy(bandwidth * x_start))} L{_num(sx(ridge))} {_num(sy(primary.flops))} "
            f"L{_num(right)} {_num(sy(primary.flops))} L{_num(right)} {_num(bottom)} L{_num(sx(x_start))} "
            f"{_num(bottom)} Z")
    svg.el("path", d=area, fill="#0072B2", fill_opacity="0.06", stroke="none")
    roof_boxes: list[Box] = []
    for roof in sorted(roofs, key=lambda r: r.flops):
        r_ridge = roof.flops / bandwidth
        dash = None if roof.primary else "6 4"
        svg.el("path", d=f"M{_num(sx(x_start))} {_num(sy(bandwidth * x_start))} L{_num(sx(r_ridge))} "
               f"{_num(sy(roof.flops))} L{_num(right)} {_num(sy(roof.flops))}", fill="none", stroke=ROOF,
               stroke_width="2.2" if roof.primary else "1.4", stroke_dasharray=dash)
        # The primary roof's label sits under it (inside the attainable region), others above theirs.
        text, ty = f"{roof.label} {fmt(roof.flops, 'FLOP/s')}", sy(roof.flops) + (15 if roof.primary else -6)
        svg.text(right - 4, ty, text, class_="ref", text_anchor="end")
        roof_boxes.append((right - 4 - _text_width(text, 11) * BOLD, ty - 11, right - 4, ty + 3))
    # Label the memory roof along its slope, left of the ridge.
    lx = 10 ** ((math.log10(x_start) + math.log10(ridge)) / 2)
    angle = -math.degrees(math.atan2(sy(bandwidth * x_start) - sy(primary.flops), sx(ridge) - sx(x_start)))
    svg.text(sx(lx), sy(bandwidth * lx) - 7, f"memory {fmt(bandwidth, 'B/s')}", class_="ref",
             text_anchor="middle", transform=f"rotate({_num(angle)} {_num(sx(lx))} {_num(sy(bandwidth * lx) - 7)})")
    svg.el("line", x1=sx(ridge), y1=sy(primary.flops), x2=sx(ridge), y2=bottom, stroke=MUTED, stroke_width="1",
           stroke_dasharray="2 3")
    # Every mark first, then the names: a name never covers another point, a roof's label or another name.
    marks = [_roof_mark(svg, p, detail, sx(p.intensity), sy(p.flops) if p.flops and p.flops > 0 else None, top,
                        bottom) for p, detail in zip(shown, details, strict=True)]
    boxes = roof_boxes + [m for m in marks if m is not None]
    frame = (left, right, top, bottom)
    for p in shown:
        boxes.append(_roof_point_name(svg, p, sx(p.intensity), sy(p.flops) if p.flops and p.flops > 0 else None,
                                      frame, boxes))
    legend_y = bottom + 56
    for p, detail, lines in zip(shown, details, legend_lines, strict=True):
        # A point that does not describe the workload is hollow, and the legend says why.
        svg.el("circle", cx=22.0, cy=legend_y - 4, r="5", fill=p.color if p.trusted else "#ffffff", stroke=p.color,
               stroke_width="1.5")
        for i, line in enumerate(lines):
            svg.text(32, legend_y + line_h * i, line, class_="legend", tip=detail if i == 0 else None)
        legend_y += line_h * len(lines) + 5
    ys = [bottom - 6, bottom - 22, sy(primary.flops) + 32, (sy(primary.flops) + bottom) / 2]
    boxes += [(sx(p.intensity) - 2, top, sx(p.intensity) + 2, bottom) for p in shown if not (p.flops and p.flops > 0)]
    _ridge_label(svg, sx(ridge), ys, f"ridge {fmt(ridge, 'FLOP/B')}", left, right, boxes)
    return svg.render()


def _roof_mark(svg: _Svg, p: RoofPoint, detail: str, x: float, y: float | None, top: float,
               bottom: float) -> Box | None:
    """A point on the roofline (a line across the plot when its FLOP/s is unknown); returns a dot's box."""
    svg.open_group(tip=detail)
    if y is None:
        svg.el("line", x1=x, y1=top, x2=x, y2=bottom, stroke=p.color, stroke_width="2" if p.trusted else "1",
               stroke_dasharray="4 3" if p.trusted else "1 4")
        svg.close_group()
        return None
    svg.el("circle", cx=x, cy=y, r="6", fill=p.color if p.trusted else "#ffffff",
           stroke="#ffffff" if p.trusted else p.color, stroke_width="1.5" if p.trusted else "2")
    svg.close_group()
    return x - 7, y - 7, x + 7, y + 7


def _roof_point_name(svg: _Svg, p: RoofPoint, x: float, y: float | None, frame: Box, taken: Sequence[Box]) -> Box:
    """A point's name beside it, inside the plot and clear of what is drawn already; returns its box."""
    left, right, top, bottom = frame
    w = _text_width(p.label, 12) * BOLD
    if y is None:  # a line: the name near the top, on the side with more room
        x0, ty = _inside(x - 6 - w if x > (left + right) / 2 else x + 6, w, left, right), top + 28
    else:
        x0, ty = _point_label_at(x, y, w, left, right, top, bottom)
    ty = _clear_baseline(x0, w, ty, taken, top + 12, bottom - 4)
    svg.text(x0, ty, p.label, class_="pt", text_anchor="start", fill=p.color)
    return x0, ty - 12, x0 + w, ty + 3


def _clear_baseline(x0: float, w: float, ty: float, taken: Sequence[Box], lo: float, hi: float,
                    step: float = 15) -> float:
    """The baseline nearest `ty` (between lo and hi) at which a label from x0, w wide, overlaps nothing taken."""
    ty = min(max(ty, lo), hi)
    tries = sorted((ty + step * k for k in range(-40, 41)), key=lambda t: (abs(t - ty), t < ty))
    for t in tries:
        if lo <= t <= hi and not any(x0 < b[2] and b[0] < x0 + w and t - 12 < b[3] and b[1] < t + 3 for b in taken):
            return t
    return ty


def _inside(x0: float, w: float, left: float, right: float) -> float:
    """The left edge of a label `w` wide moved as little as it takes to lie between the axes."""
    return max(left + 2, min(x0, right - 2 - w))


def _point_label_at(x: float, y: float, w: float, left: float, right: float, top: float,
                    bottom: float) -> tuple[float, float]:
    """Where a point's label starts (left edge, baseline): beside the point where it fits between the axes, else
    under (or over) it, moved along so it stays inside the plot at any drawing width. Under first: the memory roof
    and its label run above the points."""
    if x + 9 + w <= right:
        return x + 9, y - 8
    if x - 9 - w >= left + 2:
        return x - 9 - w, y - 8
    return _inside(x - w / 2, w, left, right), (y + 20 if y + 20 <= bottom - 4 else y - 11)


def _ridge_label(svg: _Svg, x: float, ys: Sequence[float], text: str, left: float, right: float,
                 boxes: Sequence[Box]) -> None:
    """The ridge's label beside its line, on whichever side and at whichever height clears the points' labels."""
    w = _text_width(text, 11)
    candidates = [(x + 4, y, "start") for y in ys] + [(x - 4, y, "end") for y in ys]
    for tx, ty, anchor in candidates:
        x0, x1 = (tx, tx + w) if anchor == "start" else (tx - w, tx)
        if x0 < left or x1 > right:
            continue
        if not any(x0 < b[2] and b[0] < x1 and ty - 11 < b[3] and b[1] < ty + 3 for b in boxes):
            svg.text(tx, ty, text, class_="tick", text_anchor=anchor)
            return
    tx, ty, anchor = next(((tx, ty, a) for tx, ty, a in candidates if (tx + w if a == "start" else tx) <= right),
                          candidates[-1])
    svg.text(tx, ty, text, class_="tick", text_anchor=anchor)


# --- shares --------------------------------------------------------------------------------------------------

def stacked_bar(title: str, segments: Sequence[Segment], *, width: float = 520, note: str = "") -> Markup:
    """One bar of the whole (a window, a fleet) split into parts, with a legend of each part's share."""
    segments = [s for s in segments if s.value > 0]
    columns = 1 if width < NARROW_BELOW else 2 if width < 800 else 3
    rows = math.ceil(len(segments) / columns)
    height = 58 + 20 * rows + (18 if note else 0)
    svg = _Svg(width, height, title)
    left, right, y, bar_h = 8.0, width - 8, 8.0, 30.0
    total = sum(s.value for s in segments) or 1.0
    scale = (right - left) / max(1.0, total)
    x = left
    for s in segments:
        w = s.value * scale
        svg.open_group(tip=f"{s.label}: {fmt(s.value, 'ratio')}" + (f" ({s.detail})" if s.detail else ""))
        svg.el("rect", x=x, y=y, width=max(0.5, w), height=bar_h, fill=s.color, stroke="#ffffff",
               stroke_width="1")
        svg.close_group()
        share = fmt(s.value, "ratio")
        if w > _text_width(share, 12) + 8:
            svg.text(x + w / 2, y + 20, share, class_="onbar", text_anchor="middle")
        x += w
    col_w = (right - left) / columns
    for i, s in enumerate(segments):
        lx = left + (i % columns) * col_w
        ly = y + bar_h + 22 + 20 * (i // columns)
        svg.el("rect", x=lx, y=ly - 10, width="12", height="12", fill=s.color)
        text = f"{s.label}  {fmt(s.value, 'ratio')}"  # as the tables and the text write a share
        svg.text(lx + 18, ly, ellipsize(text, col_w - 22, 11.5), class_="legend",
                 tip=text + (f" ({s.detail})" if s.detail else ""))
    if note:
        svg.text(left, height - 6, ellipsize(note, right - left, 11), class_="note", tip=note)
    return svg.render()


def bar_chart(title: str, items: Sequence[tuple[str, float]], *, unit: str = "ratio", width: float = WIDE,
              color: str = PALETTE[0]) -> Markup:
    """Horizontal bars, largest first; values in `unit` (ratios drawn against 100 %). Narrow, each label goes above
    its bar, so the bars keep the width."""
    items = sorted(items, key=lambda kv: -kv[1])
    stacked = width < NARROW_BELOW
    row = 40 if stacked else 26
    height = 16 + row * len(items)
    svg = _Svg(width, height, title)
    if stacked:
        label_w = width - 16
        left, right = 8.0, width - 70
    else:
        label_w = min(220.0, max(_text_width(k, 12) for k, _ in items) + 14) if items else 100.0
        left, right = 8 + label_w, width - 70
    top_value = 1.0 if unit == "ratio" else nice_max(max((v for _, v in items), default=1.0))
    for i, (label, value) in enumerate(items):
        y = 8 + row * i + (14 if stacked else 0)
        if stacked:
            svg.text(left, y - 2, ellipsize(label, label_w, 12), class_="label", tip=label)
        else:
            svg.text(left - 8, y + 14, ellipsize(label, label_w - 10, 12), class_="label", text_anchor="end",
                     tip=label)
        svg.el("rect", x=left, y=y + 2, width=right - left, height="17", fill="#f0f3f6")
        svg.el("rect", x=left, y=y + 2, width=max(0.5, (right - left) * min(1.0, value / top_value)), height="17",
               fill=color)
        svg.text(right + 6, y + 15, fmt(value, unit), class_="value")
    return svg.render()


# --- throughput against the physics ---------------------------------------------------------------------------

def _label_rows(spans: Sequence[tuple[float, float]], gap: float = 8) -> list[int]:
    """For labels spanning these x ranges (in drawing order), the lowest row each fits in without touching another."""
    rows: list[list[tuple[float, float]]] = []
    out = []
    for a, b in spans:
        row = next((i for i, used in enumerate(rows) if all(b + gap <= u0 or u1 + gap <= a for u0, u1 in used)),
                   len(rows))
        if row == len(rows):
            rows.append([])
        rows[row].append((a, b))
        out.append(row)
    return out


def throughput_bullet(title: str, achieved: float | None, marks: Sequence[Mark], *, unit: str = "tokens/s",
                      width: float = WIDE) -> Markup:
    """A log-scale bar of achieved throughput with the physical limits marked on the same axis. Each mark is named
    on the chart by its short label, in the lowest row above the bar where it overlaps no other label, with a
    leader line down to its mark; its colour and name come with it from the data, the same in every report."""
    values = [m.value for m in marks if m.value > 0] + ([achieved] if achieved and achieved > 0 else [])
    marks = sorted((m for m in marks if m.value > 0), key=lambda m: m.value)
    size, row_h = 11.5, 15.0
    left, right = 16.0, width - 24
    lo = 10 ** math.floor(math.log10(min(values) / 2)) if values else 1.0
    hi = 10 ** math.ceil(math.log10(max(values) * 1.2)) if values else 10.0

    def sx(v: float) -> float:
        return left + (right - left) * (math.log10(max(v, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    names = [ellipsize(m.short or m.label, right - left, size) for m in marks]
    spans = []
    for m, name in zip(marks, names, strict=True):
        w = _text_width(name, size) * BOLD
        x0 = min(max(sx(m.value) - w / 2, left - 8), right + 16 - w)
        spans.append((x0, x0 + w))
    rows = _label_rows(spans)
    n_rows = max(rows, default=-1) + 1
    bar_y, bar_h = 12 + row_h * n_rows, 26.0
    legend_lines = [wrap_text(f"{m.label}: {m.value:,.0f} {unit}", width - 50, size, max_lines=2) for m in marks]
    legend_h = sum(16.0 * len(lines) + 2 for lines in legend_lines) + (18 if achieved and achieved > 0 else 0)
    height = bar_y + bar_h + 40 + legend_h
    svg = _Svg(width, height, title)
    svg.el("rect", x=left, y=bar_y, width=right - left, height=bar_h, fill="#f0f3f6")
    for tick in log_ticks(lo, hi):
        x = sx(tick)
        svg.el("line", x1=x, y1=bar_y + bar_h, x2=x, y2=bar_y + bar_h + 5, stroke=MUTED, stroke_width="1")
        svg.text(x, bar_y + bar_h + 18, short_number(tick), class_="tick", text_anchor="middle")
    if achieved and achieved > 0:
        svg.open_group(tip=f"achieved {achieved:,.0f} {unit}")
        svg.el("rect", x=left, y=bar_y + 5, width=max(1.0, sx(achieved) - left), height=bar_h - 10, fill=PALETTE[0])
        svg.close_group()
    for m, name, (x0, _), row in zip(marks, names, spans, rows, strict=True):
        x = sx(m.value)
        color = m.color or PALETTE[6]
        text_y = bar_y - 6 - row_h * row
        svg.open_group(tip=f"{m.label}: {m.value:,.0f} {unit}" + (f" ({m.detail})" if m.detail else ""),
                       data_mark=m.key or None)
        svg.el("line", x1=x, y1=text_y + 3, x2=x, y2=bar_y, stroke=color, stroke_width="1",
               stroke_dasharray="2 2")
        svg.el("line", x1=x, y1=bar_y - 3, x2=x, y2=bar_y + bar_h + 2, stroke=color, stroke_width="3")
        svg.text(x0, text_y, name, class_="marknum", fill=color)
        svg.close_group()
    y = bar_y + bar_h + 40
    for m, lines in zip(marks, legend_lines, strict=True):
        svg.el("rect", x=left, y=y - 10, width="12", height="12", fill=m.color or PALETTE[6])
        for i, line in enumerate(lines):
            svg.text(left + 18, y + 16 * i, line, class_="legend", tip=(m.detail or None) if i == 0 else None)
        y += 16 * len(lines) + 2
    if achieved and achieved > 0:
        svg.el("rect", x=left, y=y - 10, width="12", height="12", fill=PALETTE[0])
        svg.text(left + 18, y, f"achieved: {achieved:,.0f} {unit}", class_="legend strong")
    return svg.render()


# --- before and after ----------------------------------------------------------------------------------------

GOOD, BAD, NEUTRAL = "#1a7f37", "#cf222e", "#6e7781"


def _log_axis(values: Sequence[float], pad: float = 1.3) -> tuple[float, float]:
    """A multiplier axis around x1: from under the smallest value (and 1) to over the largest."""
    finite = [v for v in values if v and v > 0 and math.isfinite(v)] + [1.0]
    return min(finite) / pad, max(finite) * pad


def _multiplier_ticks(lo: float, hi: float) -> list[float]:
    """Ticks for a multiplier axis: decades and 2x/5x steps, or round linear steps over a narrow range."""
    if hi / lo < 4:
        return [t for t in nice_ticks(lo, hi, 4) if t > 0]
    return log_ticks(lo, hi)


def _multiplier_frame(title: str, width: float, height: float, left: float, right: float, lo: float, hi: float,
                      top: float, bottom: float,
                      label: Callable[[float], str]) -> tuple[_Svg, Callable[[float], float]]:
    """A chart on a log multiplier axis from `lo` to `hi` between x = left and right: the drawing with its vertical
    grid and tick labels under `bottom`, and the x of a value."""

    def sx(v: float) -> float:
        return left + (right - left) * (math.log10(max(v, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    svg = _Svg(width, height, title)
    for tick in _multiplier_ticks(lo, hi):
        x = sx(tick)
        svg.el("line", x1=x, y1=top, x2=x, y2=bottom, stroke=GRID, stroke_width="1")
        svg.text(x, bottom + 16, label(tick), class_="tick", text_anchor="middle")
    return svg, sx


def _x_label(value: float) -> str:
    return f"x{value:.2f}" if value < 10 else f"x{value:.1f}"


def _pair_texts(p: GainPair) -> tuple[str, str]:
    """The predicted and realised values as written beside their bars."""
    def one(value: float | None, what: str) -> str:
        if value is None or value <= 0:
            return f"{what}: none"
        return f"{what} {_x_label(value)}" + (" (bound)" if what == "predicted" and p.upper_bound else "")
    return one(p.predicted, "predicted"), one(p.realised, "realised")


def gain_pairs(title: str, pairs: Sequence[GainPair], *, band: float = 0.25, width: float = WIDE) -> Markup:
    """Per fix, the predicted gain (outlined) and the realised one (filled) from x1, on one log axis, over the band in
    which the prediction counts as holding (shaded): +-`band` around an estimate, under an upper bound."""
    size, row = 11.5, 62.0
    # Each value is written right of its bar's end: the axis stops short of the widest, so none runs out.
    left, right = 12.0, width - 12 - 6 - max((_text_width(t, 11) for p in pairs for t in _pair_texts(p)), default=0)
    lo, hi = _log_axis([v for p in pairs for v in (p.predicted, p.realised) if v is not None]
                       + [p.predicted * (1 + band) for p in pairs if p.predicted])
    top = 20.0
    height = top + row * len(pairs) + 34

    bottom = top + row * len(pairs)
    svg, sx = _multiplier_frame(title, width, height, left, right, lo, hi, top, bottom,
                                lambda tick: _x_label(tick) if tick < 1e3 else short_number(tick))
    one = sx(1.0)
    svg.el("line", x1=one, y1=top - 6, x2=one, y2=bottom, stroke=INK, stroke_width="1.2")
    svg.text(one + 4 if one < (left + right) / 2 else one - 4, top - 8, "x1: no change", class_="tick",
             text_anchor="start" if one < (left + right) / 2 else "end")
    for i, p in enumerate(pairs):
        y = top + row * i
        held = p.verdict in ("held", "within the bound")
        color = GOOD if held else (BAD if p.verdict in ("over-predicted", "under-predicted", "beyond the bound")
                                   else NEUTRAL)
        svg.text(left, y + 15, ellipsize(f"{p.label}: {p.verdict}" if p.verdict else p.label, right - left, size),
                 class_="label halo", tip=p.label)
        bar_y = y + 22
        if p.predicted:
            lo_band = sx(p.predicted * (1 - band)) if not p.upper_bound else left
            hi_band = sx(p.predicted * (1 + band))
            svg.open_group(tip=("realised under this bound holds" if p.upper_bound else
                                f"within {band:.0%} of the prediction holds"))
            svg.el("rect", x=lo_band, y=bar_y - 3, width=max(1.0, hi_band - lo_band), height="34", fill=GOOD,
                   fill_opacity="0.10")
            svg.close_group()
        for j, ((value, what), text) in enumerate(zip(((p.predicted, "predicted"), (p.realised, "realised")),
                                                      _pair_texts(p), strict=True)):
            if value is None or value <= 0:
                svg.text(one + 4, bar_y + 10 + 15 * j, text, class_="note")
                continue
            x0, x1 = sorted((one, sx(value)))
            by = bar_y + 15 * j
            svg.open_group(tip=text)
            if what == "predicted":
                svg.el("rect", x=x0, y=by, width=max(1.0, x1 - x0), height="12", fill="#ffffff", stroke=INK,
                       stroke_width="1.2", stroke_dasharray="3 2" if p.upper_bound else None)
            else:
                svg.el("rect", x=x0, y=by, width=max(1.0, x1 - x0), height="12", fill=color)
            svg.close_group()
            # Right of the bar: past its end, or past x1 for a bar that shrinks (its end is left of x1).
            svg.text(x1 + 6, by + 10, text, class_="value")
    svg.text(left, height - 4, "outlined: predicted for the change made; filled: realised; shaded: where the "
             "prediction holds" if width >= NARROW_BELOW else "outlined predicted, filled realised, shaded holds",
             class_="note")
    return svg.render()


def ratio_chart(title: str, items: Sequence[Ratio], *, width: float = WIDE) -> Markup:
    """After over before for each measure, on a log axis around x1, with +-1 standard error whiskers; green where it
    moved the better way beyond its error, red the worse way, grey where neither or within the noise."""
    narrow = width < NARROW_BELOW
    size = 11.5
    row = 38.0 if narrow else 24.0
    label_w = 0.0 if narrow else min(190.0, max((_text_width(it.label, size) for it in items), default=60) + 10)
    values = [f"{_x_label(it.ratio)}" + (f" ± {it.ratio * it.error:.2f}" if it.error is not None else "")
              for it in items]
    left = 24.0 if narrow else 10.0 + label_w
    right = width - 14 - max((_text_width(v, 12) for v in values), default=40)
    spans = [(it.ratio * (1 - (it.error or 0)), it.ratio * (1 + (it.error or 0))) for it in items]
    lo, hi = _log_axis([v for span in spans for v in span], pad=1.15)
    top = 18.0
    height = top + row * len(items) + 24

    bottom = top + row * len(items)
    svg, sx = _multiplier_frame(title, width, height, left, right, lo, hi, top, bottom, _x_label)
    one = sx(1.0)
    svg.el("line", x1=one, y1=top - 4, x2=one, y2=bottom, stroke=INK, stroke_width="1.2")
    for i, (it, (a, b)) in enumerate(zip(items, spans, strict=True)):
        y = top + row * i + (row - 8 if narrow else row / 2 + 1)
        if narrow:
            svg.text(10, top + row * i + 12, ellipsize(it.label, width - 20, size), class_="label halo", tip=it.label)
        else:
            svg.text(left - 8, y + 4, ellipsize(it.label, label_w - 10, size), class_="label", text_anchor="end",
                     tip=it.label)
        # Without a spread, a move under 5 % is not called either way.
        up = a > 1.0 if it.error is not None else it.ratio > 1.05
        down = b < 1.0 if it.error is not None else it.ratio < 1 / 1.05
        if it.better == "higher":
            color = GOOD if up else BAD if down else NEUTRAL
        elif it.better == "lower":
            color = GOOD if down else BAD if up else NEUTRAL
        else:
            color = NEUTRAL
        error = f" ± {it.ratio * it.error:.2f}" if it.error is not None else ""
        svg.open_group(tip=f"{it.label}: {_x_label(it.ratio)}{error}" + (f" ({it.detail})" if it.detail else ""))
        if it.error is not None:
            svg.el("line", x1=sx(a), y1=y, x2=sx(b), y2=y, stroke=color, stroke_width="2")
            for x in (sx(a), sx(b)):
                svg.el("line", x1=x, y1=y - 5, x2=x, y2=y + 5, stroke=color, stroke_width="1.5")
        svg.el("circle", cx=sx(it.ratio), cy=y, r="5", fill=color)
        svg.close_group()
        svg.text(right + 8, y + 4, f"{_x_label(it.ratio)}{error}", class_="value")
    return svg.render()


# --- trace views ----------------------------------------------------------------------------------------------

def _duration(us: float) -> str:
    if us >= 1e6:
        return f"{us / 1e6:.3g} s"
    if us >= 1e3:
        return f"{us / 1e3:.3g} ms"
    return f"{us:.3g} µs"


def _swatch_legend(svg: _Svg, items: Sequence[tuple[str, str]], x0: float, x_max: float, y0: float,
                   size: float = 11.5) -> float:
    """Square swatches and labels in rows from (x0, y0); returns the height used."""
    if not items:
        return 0.0
    x, y = x0, y0
    for label, color in items:
        text = ellipsize(label, x_max - x0 - 18, size)
        w = 18 + _text_width(text, size) + 14
        if x + w > x_max and x > x0:
            x, y = x0, y + 17
        svg.el("rect", x=x, y=y - 10, width="12", height="12", fill=color)
        svg.text(x + 17, y, text, class_="legend", tip=label if text != label else None)
        x += w
    return y - y0 + 20


def _merged(spans: Sequence[Span], us_per_px: float, cap_px: float = 4.0) -> list[list[Span]]:
    """Ops closer than a pixel drawn as one span of at most `cap_px` pixels (a 5 ms window holds thousands of 2 µs
    kernels, far more than the pixels that show them); a lone op stays itself, however long."""
    groups: list[list[Span]] = []
    start = end = -math.inf
    for sp in sorted(spans, key=lambda sp: sp.start_us):
        if groups and sp.start_us - end < us_per_px and end - start < cap_px * us_per_px:
            groups[-1].append(sp)
            end = max(end, sp.start_us + sp.dur_us)
        else:
            groups.append([sp])
            start, end = sp.start_us, sp.start_us + sp.dur_us
    return groups


def _dominant(group: Sequence[Span]) -> str:
    """The colour holding most of a merged span's time."""
    by_color: dict[str, float] = {}
    for sp in group:
        by_color[sp.color] = by_color.get(sp.color, 0.0) + sp.dur_us
    return max(by_color.items(), key=lambda kv: kv[1])[0]


def _group_tip(group: Sequence[Span]) -> str:
    first = group[0]
    if len(group) == 1:
        kind = f" ({first.kind})" if first.kind and first.kind != first.name else ""
        return f"{first.name}{kind}: {_duration(first.dur_us)} at {_duration(first.start_us)}"
    by_name: dict[str, float] = {}
    for sp in group:
        by_name[sp.name] = by_name.get(sp.name, 0.0) + sp.dur_us
    total = sum(by_name.values()) or 1.0
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:2]
    span = max(sp.start_us + sp.dur_us for sp in group) - first.start_us
    return (f"{len(group)} ops in {_duration(span)} from {_duration(first.start_us)}: "
            + ", ".join(f"{n} {t / total:.0%}" for n, t in top) + (", ..." if len(by_name) > 2 else ""))


def lanes_chart(title: str, lanes: Sequence[Lane], length_us: float, legend: Sequence[tuple[str, str]], *,
                width: float = WIDE) -> Markup:
    """A window of the timeline: one lane per host thread, GPU stream and the GPU's idle gaps; spans coloured by
    kernel class or idle cause, ops closer than a pixel merged (their tooltip says what they hold)."""
    narrow = width < NARROW_BELOW
    lane_h, gap = 14.0, 5.0
    label_w = max((_text_width(ln.label, 11) for ln in lanes), default=40) + 8
    left, right = min(label_w, 84.0) + 4, width - 10
    probe = _Svg(width, 10, title)
    legend_h = _swatch_legend(probe, legend, 8, width - 8, 14)
    top = 4.0
    height = top + (lane_h + gap) * len(lanes) + 26 + legend_h
    svg = _Svg(width, height, title)
    length = max(length_us, 1e-9)
    us_per_px = length / (right - left)

    def sx(us: float) -> float:
        return left + (right - left) * min(max(us, 0.0), length) / length

    bottom = top + (lane_h + gap) * len(lanes)
    for tick in nice_ticks(0.0, length, 3 if narrow else 6):
        x = sx(tick)
        svg.el("line", x1=x, y1=top, x2=x, y2=bottom, stroke=GRID, stroke_width="1")
        svg.text(x, bottom + 13, _duration(tick) if tick else "0", class_="tick",
                 text_anchor="end" if x > right - 20 else "middle")
    for i, lane in enumerate(lanes):
        y = top + (lane_h + gap) * i
        svg.text(left - 6, y + lane_h - 3, ellipsize(lane.label, left - 10, 11), class_="lane", text_anchor="end",
                 tip=lane.tip or lane.label)
        svg.el("rect", x=left, y=y, width=right - left, height=lane_h, fill="#f6f8fa")
        for group in _merged(lane.spans, us_per_px):
            start = group[0].start_us
            end = max(sp.start_us + sp.dur_us for sp in group)
            svg.open_group(tip=_group_tip(group))
            svg.el("rect", x=sx(start), y=y, width=max(0.6, sx(end) - sx(start)), height=lane_h,
                   fill=_dominant(group))
            svg.close_group()
    _swatch_legend(svg, legend, 8, width - 8, bottom + 36)
    return svg.render()


def histogram(title: str, edges_us: Sequence[float], counts: Sequence[float], times: Sequence[float],
              markers: Sequence[tuple[str, float]], *, open_last: bool = False, width: float = WIDE) -> Markup:
    """Duration bins as columns (equal widths: the bins are 1-2-5 steps), each with the share of kernels (light)
    and of kernel time (dark); percentiles marked above at their place within their bin, in rows that keep their
    labels apart."""
    n = len(counts)
    size = 11.0
    left, right = 40.0, width - 10
    col = (right - left) / max(1, n)

    def place(v: float) -> float:
        for i in range(n):
            lo, hi = edges_us[i], edges_us[i + 1]
            if v <= hi or i == n - 1:
                if v < lo:
                    return left + col * i
                frac = (math.log(v / lo) / math.log(hi / lo)) if lo > 0 and hi > lo else (v / hi if hi else 0.0)
                return left + col * (i + min(1.0, max(0.0, frac)))
        return left

    shown = [(f"{name} {_duration(v)}", place(v)) for name, v in markers if v > 0 and n]
    spans = []
    for text, x in shown:
        w = _text_width(text, size) * BOLD
        a = min(max(x - w / 2, 2.0), width - 2 - w)
        spans.append((a, a + w))
    rows = _label_rows(spans, gap=6)
    top = 12 + 14 * (max(rows, default=0) + 1)
    plot_h = 150.0
    bottom = top + plot_h
    height = bottom + 60
    svg = _Svg(width, height, title)
    top_value = nice_max(max([*counts, *times, 0.01]))

    def sy(v: float) -> float:
        return bottom - plot_h * v / top_value

    for tick in nice_ticks(0.0, top_value, 4):
        y = sy(tick)
        svg.el("line", x1=left, y1=y, x2=right, y2=y, stroke=GRID, stroke_width="1")
        svg.text(left - 5, y + 4, f"{tick * 100:.0f}%", class_="tick", text_anchor="end")
    bar = max(1.0, col / 2 - 2)
    for i in range(n):
        x = left + col * i
        lo, hi = edges_us[i], edges_us[i + 1]
        what = f"{_duration(lo)}-{_duration(hi)}" if not (open_last and i == n - 1) else f"over {_duration(lo)}"
        svg.open_group(tip=f"{what}: {counts[i]:.1%} of kernels, {times[i]:.1%} of kernel time")
        svg.el("rect", x=x + 1, y=sy(counts[i]), width=bar, height=max(0.0, bottom - sy(counts[i])), fill="#9ecae1")
        svg.el("rect", x=x + 1 + bar, y=sy(times[i]), width=bar, height=max(0.0, bottom - sy(times[i])),
               fill=PALETTE[0])
        svg.close_group()
    svg.el("line", x1=left, y1=bottom, x2=right, y2=bottom, stroke=MUTED, stroke_width="1")
    every = max(1, math.ceil(n / max(1.0, (right - left) / 44)))
    for i, edge in enumerate(edges_us):
        if (i % every and i != n) or (i != n and n - i < every):  # the last edge is always labelled
            continue
        x = left + col * i
        text = (_duration(edge) if edge else "0") if not (open_last and i == n) else f"{_duration(edge)} (max)"
        anchor = "start" if i == 0 else "end" if x > right - 24 else "middle"
        svg.text(x, bottom + 14, text, class_="tick", text_anchor=anchor)
    for (text, x), (a, _), row in zip(shown, spans, rows, strict=True):
        y = top - 6 - 14 * row
        svg.el("line", x1=x, y1=y + 3, x2=x, y2=bottom, stroke=INK, stroke_width="1", stroke_dasharray="3 3")
        svg.text(a, y, text, class_="marknum")
    legend_y = bottom + 38
    svg.el("rect", x=left, y=legend_y - 10, width="12", height="12", fill="#9ecae1")
    svg.text(left + 17, legend_y, "share of kernels", class_="legend")
    x2 = left + 17 + _text_width("share of kernels", 11.5) + 18
    svg.el("rect", x=x2, y=legend_y - 10, width="12", height="12", fill=PALETTE[0])
    svg.text(x2 + 17, legend_y, "share of GPU time", class_="legend")
    return svg.render()


def stacked_rows(title: str, rows: Sequence[StackedRow], legend: Sequence[Segment], *,
                 width: float = WIDE) -> Markup:
    """One bar per row (a rank), each split the same way on a 0-100 % scale, with one legend under them."""
    narrow = width < NARROW_BELOW
    size = 11.5
    label_w = 0.0 if narrow else min(150.0, max((_text_width(r.label + (" ◆ " + r.flag if r.flag else ""), size)
                                                  for r in rows), default=40) + 10)
    left, right = 8 + label_w, width - 8
    row_h = 40.0 if narrow else 28.0
    bar_h = 18.0
    probe = _Svg(width, 10, title)
    legend_h = _swatch_legend(probe, [(s.label, s.color) for s in legend], 8, width - 8, 14)
    top = 6.0
    height = top + row_h * len(rows) + 22 + legend_h
    svg = _Svg(width, height, title)
    for i, r in enumerate(rows):
        y = top + row_h * i + (row_h - bar_h - 4 if narrow else (row_h - bar_h) / 2)
        label = r.label + (f" ◆ {r.flag}" if r.flag else "")
        if narrow:
            svg.text(8, y - 4, label, class_="label strong" if r.flag else "label")
        else:
            svg.text(left - 8, y + 13, ellipsize(label, label_w - 8, size), class_="label strong" if r.flag
                     else "label", text_anchor="end", tip=label)
        x = left
        for sgm in r.segments:
            w = (right - left) * max(0.0, sgm.value)
            svg.open_group(tip=f"{r.label}: {sgm.label} {sgm.value:.1%}" + (f" ({sgm.detail})" if sgm.detail else ""))
            svg.el("rect", x=x, y=y, width=max(0.0, w), height=bar_h, fill=sgm.color, stroke="#ffffff",
                   stroke_width="0.5")
            svg.close_group()
            if w > _text_width(f"{sgm.value:.0%}", 11) + 6:
                svg.text(x + w / 2, y + 13, f"{sgm.value:.0%}", class_="onbar", text_anchor="middle")
            x += w
        if r.flag:
            svg.el("rect", x=left - 1, y=y - 1, width=right - left + 2, height=bar_h + 2, fill="none", stroke=INK,
                   stroke_width="1.5")
    bottom = top + row_h * len(rows)
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        x = left + (right - left) * tick
        svg.text(x, bottom + 12, f"{tick:.0%}", class_="tick",
                 text_anchor="start" if tick == 0 else "end" if tick == 1 else "middle")
    _swatch_legend(svg, [(s.label, s.color) for s in legend], 8, width - 8, bottom + 34)
    return svg.render()


def meter(value: float | None, *, color: str = INK, label: str = "", mark: float | None = None,
          width: float = 84) -> Markup:
    """A small inline bar (0..1) for a table cell, with an optional reference tick (the 60 % speed-of-light line)."""
    svg = _Svg(width, 10, label or "share", css_class="bar")
    svg.el("rect", width=width, height="10", rx="2", fill="#eaeef2")
    if value is not None:
        svg.el("rect", width=max(0.8, width * min(1.0, max(0.0, value))), height="10", rx="2", fill=color)
    if mark is not None:
        svg.el("line", x1=width * mark, y1="0", x2=width * mark, y2="10", stroke=INK, stroke_width="1")
    return svg.render()


__all__ = ["Band", "HLine", "Line", "Mark", "PALETTE", "Roof", "RoofPoint", "Segment", "bar_chart", "downsample",
           "gain_pairs", "histogram", "lanes_chart", "meter", "nice_ticks", "ratio_chart", "roofline", "stacked_bar",
           "stacked_rows", "throughput_bullet", "time_series"]

