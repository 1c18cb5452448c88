"""Renderers of a comparison (diagnoser/compare.py): terminal, JSON and HTML, in the report's visual language."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TextIO

from diagnoser.compare import Comparison, Measure
from diagnoser.reports.redact import redact, redact_obj
from diagnoser.units import fmt


def _ratio(m: Measure) -> str:
    if m.ratio is None:
        return "-"
    text = f"x{m.ratio:.2f}"
    if m.ratio_error is not None:
        text += f" ± {m.ratio * m.ratio_error:.2f}"
    return text


def _value(m: Measure, side: str) -> str:
    mean = getattr(m, side)
    sd = getattr(m, f"{side}_sd")
    if mean is None:
        return "-"
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
            out += ["", f"{title} (mean ± sd of the samples; ratio ± its standard error)"]
            out += [f"  {m.signal}: {_value(m, 'before')} -> {_value(m, 'after')}  {_ratio(m)}" for m in group]
    out += ["", "Predicted (by the BEFORE capture) against realised"]
    for p in c.predictions:
        line = f"  {p.title} [{p.kind.value}]: predicted {_gain(p.predicted)} ({p.predicted_kind}, {p.benefit})"
        if p.applied:
            if p.for_change is not None:
                line += f"; for the change made {_gain(p.for_change)}"
            line += f"; realised {_gain(p.realised)}: {p.verdict}"
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
        if isinstance(obj, float) and obj != obj or obj in (float("inf"), float("-inf")):
            return None
        if isinstance(obj, dict):
            return {k: finite(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            return [finite(v) for v in obj]
        return obj

    return json.dumps(redact_obj(finite(c.to_dict())), indent=2, allow_nan=False)


def render_html(c: Comparison) -> str:
    from diagnoser.reports.html import _page

    return _page("compare.html.j2", c=c, title=f"Compare: {c.before_target} -> {c.after_target}",
                 ratio=_ratio, value=_value, gain=_gain)


def write_html(c: Comparison, path: str | Path) -> Path:
    from diagnoser.reports.html import _atomic_write

    return _atomic_write(render_html(c), path)


__all__ = ["render_html", "render_json", "render_terminal", "terminal_lines", "write_html"]
