"""Charts as inline SVG strings, drawn in Python: they render without JavaScript, print, and load nothing.

Each function takes numbers already in the capture, evidence or physics spec, and computes only geometry (scales,
ticks, downsampling for drawing). Every piece of text is redacted and escaped here, so a label taken from a metric
(a pod name, a kernel name full of `<` and `>`) can never become markup. The result is a `markupsafe.Markup`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from markupsafe import Markup, escape

from diagnoser.reports.figdata import PALETTE, ROOF, Band, HLine, Line, Mark, Roof, RoofPoint, Segment
from diagnoser.reports.redact import redact
from diagnoser.units import fmt

INK = "#1f2328"
MUTED = "#6e7781"
GRID = "#d8dee4"

_CHAR_W = 0.54  # average glyph width over font size, for laying out labels without a font engine


def _num(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".") if abs(x) < 1e6 else f"{x:.0f}"


def _text_width(text: str, size: float) -> float:
    return len(text) * size * _CHAR_W


def ellipsize(text: str, width: float, size: float) -> str:
    """Shorten text to fit `width` pixels, keeping its start and end (kernel names differ at both)."""
    most = max(4, int(width / (size * _CHAR_W)))
    if len(text) <= most:
        return text
    head = (most - 1) * 2 // 3
    return text[:head] + "\u2026" + text[len(text) - (most - 1 - head):]


class _Svg:
    """A tiny SVG writer: attributes are numbers or escaped strings; text is redacted, then escaped."""

    def __init__(self, width: float, height: float, label: str, css_class: str = "chart") -> None:
        self.width, self.height = width, height
        self.label = redact(label)
        self.css_class = css_class
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
        body = escape(redact(text))
        if tip:
            body = Markup(f"<title>{escape(redact(tip))}</title>") + body
        self.parts.append(f"<text{self._attrs({'x': x, 'y': y, **attrs})}>{body}</text>")

    def open_group(self, tip: str | None = None, **attrs: object) -> None:
        self.parts.append(f"<g{self._attrs(attrs)}>")
        if tip:
            self.parts.append(f"<title>{escape(redact(tip))}</title>")

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
    pts = list(zip(times, values))
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
    legend_h = _legend(svg, [(ln.label, c, ln.dashed) for ln, c in zip(lines, colors)], 8, width - 8)
    left, right, top, bottom = 58.0, width - 14, 10.0 + legend_h, height - 24
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
    for tick in nice_ticks(0.0, x_hi, 6):
        x = sx(tick)
        svg.el("line", x1=x, y1=bottom, x2=x, y2=bottom + 4, stroke=MUTED, stroke_width="1")
        svg.text(x, bottom + 17, _time_label(tick, x_hi), class_="tick", text_anchor="middle")
    svg.el("line", x1=left, y1=bottom, x2=right, y2=bottom, stroke=MUTED, stroke_width="1")
    for ln, color in zip(lines, colors):
        pts = downsample(ln.times, ln.values)
        _polyline(svg, [(sx(t), sy(v) if math.isfinite(v) else math.nan) for t, v in pts], color, ln.dashed,
                  tip=f"{ln.label}: mean {fmt(_mean(ln.values), unit)}, max {fmt(_max(ln.values), unit)}")
    for h in hlines:
        y = sy(h.value)
        svg.el("line", x1=left, y1=y, x2=right, y2=y, stroke=h.color, stroke_width="1.3", stroke_dasharray="6 4")
        # Near the top the label goes under its line, so it stays inside the plot.
        svg.text(right - 4, y + 13 if y - top < 16 else y - 4, h.label, class_="ref", text_anchor="end")
    return svg.render()


def _mean(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return math.fsum(finite) / len(finite) if finite else math.nan


def _max(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return max(finite) if finite else math.nan


def _polyline(svg: _Svg, pts: list[tuple[float, float]], color: str, dashed: bool, tip: str) -> None:
    """A path broken at NaNs and at time gaps; a lone sample is drawn as a dot."""
    xs = [x for x, _ in pts]
    steps = sorted(b - a for a, b in zip(xs, xs[1:]) if b > a)
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

def roofline(title: str, bandwidth: float, roofs: Sequence[Roof], points: Sequence[RoofPoint],
             *, width: float = 520, height: float = 300) -> Markup:
    """Log-log roofline: the memory roof (bandwidth x intensity) up to each compute roof, and the workload."""
    shown = [p for p in points if p.intensity > 0]
    legend_h = 20.0 * len(shown)
    height += legend_h
    svg = _Svg(width, height, title)
    left, right, top, bottom = 64.0, width - 16, 16.0, height - 42 - legend_h
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
    svg.text((left + right) / 2, bottom + 34, "arithmetic intensity (FLOP per byte of DRAM traffic)",
             class_="axis", text_anchor="middle")
    svg.text(14, (top + bottom) / 2, "FLOP/s", class_="axis", text_anchor="middle",
             transform=f"rotate(-90 14 {_num((top + bottom) / 2)})")
    # The attainable region under the primary roof, lightly shaded.
    primary = max((r for r in roofs if r.primary), key=lambda r: r.flops, default=roofs[0])
    ridge = primary.flops / bandwidth
    x_start = max(x_lo, y_lo / bandwidth)
    area = (f"M{_num(sx(x_start))} {_num(sy(bandwidth * x_start))} L{_num(sx(ridge))} {_num(sy(primary.flops))} "
            f"L{_num(right)} {_num(sy(primary.flops))} L{_num(right)} {_num(bottom)} L{_num(sx(x_start))} "
            f"{_num(bottom)} Z")
    svg.el("path", d=area, fill="#0072B2", fill_opacity="0.06", stroke="none")
    for roof in sorted(roofs, key=lambda r: r.flops):
        r_ridge = roof.flops / bandwidth
        dash = None if roof.primary else "6 4"
        svg.el("path", d=f"M{_num(sx(x_start))} {_num(sy(bandwidth * x_start))} L{_num(sx(r_ridge))} "
               f"{_num(sy(roof.flops))} L{_num(right)} {_num(sy(roof.flops))}", fill="none", stroke=ROOF,
               stroke_width="2.2" if roof.primary else "1.4", stroke_dasharray=dash)
        # The primary roof's label sits under it (inside the attainable region), others above theirs.
        svg.text(right - 4, sy(roof.flops) + (15 if roof.primary else -6), f"{roof.label} {fmt(roof.flops, 'FLOP/s')}",
                 class_="ref", text_anchor="end")
    # Label the memory roof along its slope, left of the ridge.
    lx = 10 ** ((math.log10(x_start) + math.log10(ridge)) / 2)
    angle = -math.degrees(math.atan2(sy(bandwidth * x_start) - sy(primary.flops), sx(ridge) - sx(x_start)))
    svg.text(sx(lx), sy(bandwidth * lx) - 7, f"memory {fmt(bandwidth, 'B/s')}", class_="ref",
             text_anchor="middle", transform=f"rotate({_num(angle)} {_num(sx(lx))} {_num(sy(bandwidth * lx) - 7)})")
    svg.el("line", x1=sx(ridge), y1=sy(primary.flops), x2=sx(ridge), y2=bottom, stroke=MUTED, stroke_width="1",
           stroke_dasharray="2 3")
    svg.text(sx(ridge) + 4, bottom - 6, f"ridge {ridge:.0f} FLOP/B", class_="tick")
    # Each point is marked by its short name on the plot; its numbers go in a legend under the axis.
    label_slots: list[float] = []
    for n, p in enumerate(shown):
        x = sx(p.intensity)
        attainable = min(primary.flops, bandwidth * p.intensity)
        legend_y = bottom + 56 + 20 * n
        # A point that does not describe the workload is hollow, and the legend says why.
        fill, stroke = (p.color, "#ffffff") if p.trusted else ("#ffffff", p.color)
        why_not = "" if p.trusted else f"; not representative: {p.note}"
        svg.el("circle", cx=left + 6, cy=legend_y - 4, r="5", fill=fill, stroke=p.color, stroke_width="1.5")
        if p.flops and p.flops > 0:
            y = sy(p.flops)
            detail = (f"{p.label}: {p.intensity:,.1f} FLOP/B, {fmt(p.flops, 'FLOP/s')}, {p.flops / attainable:.0%} "
                      f"of its roof{why_not}")
            svg.open_group(tip=detail)
            svg.el("circle", cx=x, cy=y, r="6", fill=fill, stroke=stroke if p.trusted else p.color,
                   stroke_width="1.5" if p.trusted else "2")
            svg.close_group()
            fits_right = x + 9 + _text_width(p.label, 12) < right
            anchor, tx = ("start", x + 9) if fits_right else ("end", x - 9)
            svg.text(tx, _free_slot(y - 8, label_slots), p.label, class_="pt", text_anchor=anchor, fill=p.color)
        else:
            detail = f"{p.label}: {p.intensity:,.1f} FLOP/B (achieved FLOP/s not measured, so a line){why_not}"
            svg.open_group(tip=detail)
            svg.el("line", x1=x, y1=top, x2=x, y2=bottom, stroke=p.color, stroke_width="2" if p.trusted else "1",
                   stroke_dasharray="4 3" if p.trusted else "1 4")
            svg.close_group()
            anchor, tx = ("end", x - 6) if x > (left + right) / 2 else ("start", x + 6)
            svg.text(tx, _free_slot(top + 28, label_slots), p.label, class_="pt", text_anchor=anchor, fill=p.color)
        svg.text(left + 16, legend_y, ellipsize(detail, right - left - 16, 11.5), class_="legend", tip=detail)
    return svg.render()


def _free_slot(y: float, used: list[float], gap: float = 15) -> float:
    while any(abs(y - u) < gap for u in used):
        y += gap
    used.append(y)
    return y


# --- shares --------------------------------------------------------------------------------------------------

def stacked_bar(title: str, segments: Sequence[Segment], *, width: float = 520, note: str = "") -> Markup:
    """One bar of the whole (a window, a fleet) split into parts, with a legend of each part's share."""
    segments = [s for s in segments if s.value > 0]
    columns = 2 if width < 800 else 3
    rows = math.ceil(len(segments) / columns)
    height = 58 + 20 * rows + (18 if note else 0)
    svg = _Svg(width, height, title)
    left, right, y, bar_h = 8.0, width - 8, 8.0, 30.0
    total = sum(s.value for s in segments) or 1.0
    scale = (right - left) / max(1.0, total)
    x = left
    for s in segments:
        w = s.value * scale
        svg.open_group(tip=f"{s.label}: {s.value:.1%}" + (f" ({s.detail})" if s.detail else ""))
        svg.el("rect", x=x, y=y, width=max(0.5, w), height=bar_h, fill=s.color, stroke="#ffffff",
               stroke_width="1")
        svg.close_group()
        share = f"{s.value:.0%}"
        if w > _text_width(share, 12) + 8:
            svg.text(x + w / 2, y + 20, share, class_="onbar", text_anchor="middle")
        x += w
    col_w = (right - left) / columns
    for i, s in enumerate(segments):
        lx = left + (i % columns) * col_w
        ly = y + bar_h + 22 + 20 * (i // columns)
        svg.el("rect", x=lx, y=ly - 10, width="12", height="12", fill=s.color)
        text = f"{s.label}  {s.value:.1%}"
        svg.text(lx + 18, ly, ellipsize(text, col_w - 22, 11.5), class_="legend",
                 tip=text + (f" ({s.detail})" if s.detail else ""))
    if note:
        svg.text(left, height - 6, note, class_="note")
    return svg.render()


def bar_chart(title: str, items: Sequence[tuple[str, float]], *, unit: str = "ratio", width: float = 520,
              color: str = PALETTE[0]) -> Markup:
    """Horizontal bars, largest first; values in `unit` (ratios drawn against 100 %)."""
    items = sorted(items, key=lambda kv: -kv[1])
    height = 16 + 26 * len(items)
    svg = _Svg(width, height, title)
    label_w = min(220.0, max(_text_width(k, 12) for k, _ in items) + 14) if items else 100.0
    left, right = 8 + label_w, width - 70
    top_value = 1.0 if unit == "ratio" else nice_max(max((v for _, v in items), default=1.0))
    for i, (label, value) in enumerate(items):
        y = 8 + 26 * i
        svg.text(left - 8, y + 14, ellipsize(label, label_w - 10, 12), class_="label", text_anchor="end", tip=label)
        svg.el("rect", x=left, y=y + 2, width=right - left, height="17", fill="#f0f3f6")
        svg.el("rect", x=left, y=y + 2, width=max(0.5, (right - left) * min(1.0, value / top_value)), height="17",
               fill=color)
        svg.text(right + 6, y + 15, fmt(value, unit), class_="value")
    return svg.render()


# --- throughput against the physics ---------------------------------------------------------------------------

def throughput_bullet(title: str, achieved: float | None, marks: Sequence[Mark], *, unit: str = "tokens/s",
                      width: float = 520) -> Markup:
    """A log-scale bar of achieved throughput with the physical limits marked on the same axis."""
    values = [m.value for m in marks if m.value > 0] + ([achieved] if achieved and achieved > 0 else [])
    height = 94 + 18 * (len(marks) + 1)
    svg = _Svg(width, height, title)
    left, right, bar_y, bar_h = 16.0, width - 24, 22.0, 26.0
    lo = 10 ** math.floor(math.log10(min(values) / 2))
    hi = 10 ** math.ceil(math.log10(max(values) * 1.2))

    def sx(v: float) -> float:
        return left + (right - left) * (math.log10(max(v, lo)) - math.log10(lo)) / (math.log10(hi) - math.log10(lo))

    svg.el("rect", x=left, y=bar_y, width=right - left, height=bar_h, fill="#f0f3f6")
    for tick in log_ticks(lo, hi):
        x = sx(tick)
        svg.el("line", x1=x, y1=bar_y + bar_h, x2=x, y2=bar_y + bar_h + 5, stroke=MUTED, stroke_width="1")
        svg.text(x, bar_y + bar_h + 18, short_number(tick), class_="tick", text_anchor="middle")
    if achieved and achieved > 0:
        svg.open_group(tip=f"achieved {achieved:,.0f} {unit}")
        svg.el("rect", x=left, y=bar_y + 5, width=max(1.0, sx(achieved) - left), height=bar_h - 10, fill=PALETTE[0])
        svg.close_group()
    legend_y = bar_y + bar_h + 40
    for i, m in enumerate(sorted(marks, key=lambda m: m.value)):
        x = sx(m.value)
        color = PALETTE[(i + 1) % len(PALETTE)]
        svg.open_group(tip=f"{m.label}: {m.value:,.0f} {unit}" + (f" ({m.detail})" if m.detail else ""))
        svg.el("line", x1=x, y1=bar_y - 6, x2=x, y2=bar_y + bar_h + 2, stroke=color, stroke_width="3")
        svg.close_group()
        svg.text(x, bar_y - 9, str(i + 1), class_="marknum", text_anchor="middle")
        y = legend_y + 18 * i
        svg.el("rect", x=left, y=y - 10, width="12", height="12", fill=color)
        svg.text(left + 18, y, f"{i + 1}  {m.label}: {m.value:,.0f} {unit}", class_="legend",
                 tip=m.detail or None)
    if achieved and achieved > 0:
        y = legend_y + 18 * len(marks)
        svg.el("rect", x=left, y=y - 10, width="12", height="12", fill=PALETTE[0])
        svg.text(left + 18, y, f"achieved: {achieved:,.0f} {unit}", class_="legend strong")
    return svg.render()


__all__ = ["Band", "HLine", "Line", "Mark", "PALETTE", "Roof", "RoofPoint", "Segment", "bar_chart", "downsample",
           "nice_ticks", "roofline", "stacked_bar", "throughput_bullet", "time_series"]

