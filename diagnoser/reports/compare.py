"""Renderers of a comparison (diagnoser/compare.py): terminal, JSON and HTML, in the report's visual language."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from diagnoser import signals as S
from diagnoser.compare import AGREEMENT, ITL_FROM_RATES, Comparison, Measure
from diagnoser.reports.figdata import Figure, GainPair, GainPairs, NotDrawn, Ratio, Ratios
from diagnoser.reports.labels import limiter_label
from diagnoser.reports.redact import redact, redact_fields, redact_obj
from diagnoser.units import fmt, fmt_bucket


def _ratio(m: Measure) -> str:
    if m.unresolved:
        return "not resolved"
    if m.bound_op and m.bound is not None:
        return f"{'≤' if m.bound_op == '<=' else '≥'} x{m.bound:.2f}"
    if m.ratio_low is not None or m.ratio_high is not None:
        if m.ratio_high is None:
            return f"≥ x{m.ratio_low:.2f} (from the buckets)"
        if m.ratio_low is None:
            return f"≤ x{m.ratio_high:.2f} (from the buckets)"
        return f"x{m.ratio_low:.2f} to x{m.ratio_high:.2f} (from the buckets)"
    if m.ratio is None:
        return "-"
    text = f"x{m.ratio:.2f}"
    if m.ratio_error is not None:
        text += f" ± {m.ratio * m.ratio_error:.2f}"
    return text


def _value(m: Measure, side: str) -> str:
    mean = getattr(m, side)
    sd = getattr(m, f"{side}_se") if m.method else getattr(m, f"{side}_sd")
    if mean is None:
        return "-"
    bucket = getattr(m, f"{side}_bucket")
    if bucket is not None:
        return fmt_bucket(mean, m.unit, bucket)
    return fmt(mean, m.unit) + (f" ± {fmt(sd, m.unit)}" if sd is not None else "")


def _gain(x: float | None) -> str:
    return "-" if x is None else f"x{x:.2f}"


def terminal_lines(c: Comparison) -> list[str]:
    out = [f"BEFORE {redact(c.before_target)}", f"  {c.before_verdict}: {redact(c.before_headline)}",
           f"AFTER  {redact(c.after_target)}", f"  {c.after_verdict}: {redact(c.after_headline)}", ""]
    out.append("What changed")
    out += [f"  {ch.what}: {redact(ch.before)} -> {redact(ch.after)}"
            + (f"  (fix: {ch.fix.value})" if ch.fix else "") for ch in c.changes] or ["  nothing the captures record"]
    for title, group in (("Rates", c.rates), ("Latencies", c.latencies), ("GPU activity", c.activity)):
        if group:
            how = ("each the counters' change over the window ± its standard error" if title == "Rates"
                   and any(m.method for m in group) else "mean ± sd of the samples")
            out += ["", f"{title} ({how}; ratio ± its standard error; a quantile inside a histogram bucket is shown "
                    "as its bucket)" if title == "Latencies" else f"{title} ({how}; ratio ± its standard error)"]
            out += [f"  {m.signal}: {_value(m, 'before')} -> {_value(m, 'after')}  {_ratio(m)}"
                    + (f" ({why})" if (why := m.unresolved or m.bound_why or m.ungraded) else "") for m in group]
    out += ["", "Predicted (by the BEFORE capture) against realised"]
    for p in c.predictions:
        line = f"  {p.title} [{p.kind.value}]: predicted {_gain(p.predicted)} ({p.predicted_kind}, {p.benefit})"
        if p.applied:
            if p.for_change is not None:
                line += f"; for the change made {_gain(p.for_change)}"
            line += f"; realised {_gain(p.realised)}: {p.verdict}"
            if p.in_range is not None:
                line += (f" ({'within' if p.in_range else 'outside'} the estimate's range, {_gain(p.low)} to "
                         f"{_gain(p.high)})")
        else:
            line += ": not applied"
        out.append(line)
    for note in c.notes:
        out.append(f"! {redact(note)}")
    return out


def render_terminal(c: Comparison, file: TextIO) -> None:
    file.write("\n".join(terminal_lines(c)) + "\n")


def render_json(c: Comparison) -> str:
    def finite(obj: object) -> object:
        if isinstance(obj, float) and math.isnan(obj) or obj in (float("inf"), float("-inf")):
            return None
        if isinstance(obj, dict):
            return {k: finite(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [finite(v) for v in obj]
        return obj

    return json.dumps(redact_obj(finite(c.to_dict())), indent=2, allow_nan=False)


# --- the HTML page's view: the report's visual language for a before/after pair ------------------------------

COMPARE_LABELS: dict[str, str] = {
    S.SERVER_REQUESTS_PER_S: "requests finished/s", S.SERVER_TTFT_P50_S: "time to first token p50",
    S.SERVER_TTFT_P99_S: "time to first token p99", S.SERVER_ITL_P50_S: "inter-token latency p50",
    S.SERVER_ITL_P99_S: "inter-token latency p99", S.SERVER_ITL_MEAN_S: "inter-token latency mean",
    S.SERVER_TTFT_MEAN_S: "time to first token mean", S.TRACE_GPU_IDLE_FRAC: "GPU idle (trace)",
    S.THEORY_EFFICIENCY: "share of the decode ceiling",
    ITL_FROM_RATES: "time per token, each sequence (running batch / generated tokens/s)",
}


def _label(signal: str) -> str:
    from diagnoser.reports.figures import SIGNAL_LABELS

    return COMPARE_LABELS.get(signal) or SIGNAL_LABELS.get(signal, signal)


@dataclass
class Side:
    """One capture of the pair, as the report's verdict card shows it."""

    name: str  # Before / After
    verdict_key: str
    verdict: str
    headline: str
    target: str


@dataclass
class CompareView:
    c: Comparison
    title: str
    sides: list[Side]
    summary: list[str]
    gains: Figure | NotDrawn
    ratios: Figure | NotDrawn
    measures: list[dict[str, str]] = field(default_factory=list)


def _side(name: str, key: str, headline: str, target: str) -> Side:
    label = limiter_label(key)
    prefix = label.lower() + ": "
    if headline.lower().startswith(prefix):
        headline = headline[len(prefix):]
        headline = headline[:1].upper() + headline[1:]
    return Side(name, key, label, headline, target)


def _gains_figure(c: Comparison) -> Figure | NotDrawn:
    title = "Predicted against realised, per fix applied"
    checked = [p for p in c.predictions if p.graded and p.realised is not None]
    if not checked:
        if not any(p.applied for p in c.predictions):
            why = "no proposed fix was applied (nothing the captures record changed the way a fix says)"
        elif c.confounders:
            why = "the captures differ in more than a fix: " + "; ".join(c.confounders)
        else:
            why = "needs a server rate measured in both captures"
        return NotDrawn(title, why)
    pairs = [GainPair(p.title, p.for_change if p.for_change is not None else p.predicted, p.realised,
                      upper_bound=p.predicted_kind == "upper_bound" and p.for_change is None, verdict=p.verdict)
             for p in checked]
    rate = next((m for m in c.rates if m.ratio is not None), None)
    what = _label(rate.signal) if rate else "the rate"
    caption = (f"Each fix the BEFORE capture proposed and the change made applies: the gain the physics predicts for "
               f"the change actually made (outlined), and the measured ratio of {what} (filled), from x1 (no change). "
               f"Shaded: within {AGREEMENT:.0%} of an estimate, or under an upper bound, the prediction holds.")
    return Figure("gains", title, GainPairs(title, pairs, band=AGREEMENT), caption)


_BETTER: dict[str, str] = {S.SERVER_GEN_TOKENS_PER_S: "higher", S.SERVER_PROMPT_TOKENS_PER_S: "higher",
           S.SERVER_REQUESTS_PER_S: "higher", S.THEORY_EFFICIENCY: "higher", S.TRACE_GPU_IDLE_FRAC: "lower"}


def _ratios_figure(c: Comparison) -> Figure | NotDrawn:
    title = "What moved: after over before"
    items = []
    for m in c.rates + c.latencies + c.activity:
        if m.ratio is None or m.ratio <= 0:
            continue
        better = _BETTER.get(m.signal, "lower" if m in c.latencies else "")
        items.append(Ratio(_label(m.signal), m.ratio, m.ratio_error, better,
                           f"{_value(m, 'before')} -> {_value(m, 'after')}"))
    if not items:
        return NotDrawn(title, "no quantity was measured in both captures")
    caption = ("Each measured quantity after over before, on a log axis around x1, with its standard error (from each "
               "side's samples). Green: moved the better way beyond its error; red: the worse way; grey: within the "
               "noise, or a quantity with no better way (activity).")
    return Figure("ratios", title, Ratios(title, items), caption)


def build_compare_view(c: Comparison) -> CompareView:
    """The page's view of a comparison: the comparison redacted once, whole (targets, headlines, notes and fix titles
    come from the captures), and everything the page shows built from it; html.py only renders."""
    c = redact_fields(c)
    sides = [_side("Before", c.before_verdict, c.before_headline, c.before_target),
             _side("After", c.after_verdict, c.after_headline, c.after_target)]
    summary = []
    rate = next((m for m in c.rates if m.ratio is not None), None)
    if rate is not None:
        summary.append(f"{_label(rate.signal)}: {_value(rate, 'before')} -> {_value(rate, 'after')}, {_ratio(rate)}")
    checked = [p for p in c.predictions if p.graded and p.realised is not None]
    if checked:
        held = sum(1 for p in checked if p.verdict in ("held", "within the bound"))
        summary.append(f"{held} of {len(checked)} fix{'es' if len(checked) != 1 else ''} applied held to "
                       "the physics")
    if c.before_verdict != c.after_verdict:
        summary.append(f"the verdict moved from {sides[0].verdict} to {sides[1].verdict}")
    measures = [{"group": group, "signal": m.signal, "label": _label(m.signal), "before": _value(m, "before"),
                 "after": _value(m, "after"), "ratio": _ratio(m), "why": m.unresolved or m.bound_why or m.ungraded}
                for group, ms in (("rate", c.rates), ("latency", c.latencies), ("activity", c.activity))
                for m in ms]
    return CompareView(c, f"Compare: {c.before_target} -> {c.after_target}", sides, summary, _gains_figure(c),
                       _ratios_figure(c), measures)


def render_html(c: Comparison) -> str:
    from diagnoser.reports.html import _Drawn, _page, draw_both

    view = build_compare_view(c)
    figures = [_Drawn(f.key, f.title, draw_both(f.spec), f.caption, f.wide)
               for f in (view.gains, view.ratios) if isinstance(f, Figure)]
    not_drawn = [f for f in (view.gains, view.ratios) if isinstance(f, NotDrawn)]
    return _page("compare.html.j2", c=view.c, view=view, figures=figures, not_drawn=not_drawn, title=view.title,
                 ratio=_ratio, value=_value, gain=_gain)


def write_html(c: Comparison, path: str | Path) -> Path:
    from diagnoser.reports.html import _atomic_write

    return _atomic_write(render_html(c), path)


__all__ = ["CompareView", "build_compare_view", "render_html", "render_json", "render_terminal", "terminal_lines",
           "write_html"]
