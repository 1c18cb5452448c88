"""The HTML report: one self-contained file (inline CSS and SVG, no network, no fonts to fetch) that opens offline,
reads on a laptop screen and prints.

Everything shown is escaped by Jinja's autoescape and redacted on the way out (`finalize`), and a Content-Security-
Policy in the page allows only its own stylesheet and sorting script (by hash): even a string that slipped through
could neither run a script nor fetch anything.
"""

from __future__ import annotations

from diagnoser.fileio import write_atomic

import base64
import hashlib
import shlex
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path
from typing import Any

import jinja2
from markupsafe import Markup

from diagnoser import __version__, physics
from diagnoser.capture import Capture
from diagnoser.diagnosis import INCONCLUSIVE, LIMITER_LABELS, SCHEMA_VERSION, Diagnosis, Limiter
from diagnoser.errors import InputError
from diagnoser.evidence import Evidence, build_evidence
from diagnoser.fleet_model import FleetReport, FleetRow
from diagnoser.reports import svg
from diagnoser.reports.figures import SOURCE_NAMES, build_figures, source_name
from diagnoser.reports.redact import MASK, redact, redact_argv
from diagnoser.signals import spec
from diagnoser.units import fmt, gain

_TEMPLATES = Path(__file__).parent / "templates"

VERDICT_COLORS = {
    "vram": "#8250df", "memory_bandwidth": "#0969da", "compute": "#bf3989", "batching": "#bc4c00",
    "host_launch": "#9a6700", "throttling": "#cf222e", "interconnect": "#1a7f37", "idle": "#57606a",
    "errors": "#a40e26", INCONCLUSIVE: "#6e7781",
}


def _finalize(value: Any) -> Any:
    """Applied to every {{ expression }}: plain strings are redacted (Markup, our own SVG, is left alone)."""
    if isinstance(value, str) and not isinstance(value, Markup):
        return redact(value)
    return value


@lru_cache(maxsize=1)
def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), autoescape=True,
                             finalize=_finalize, undefined=jinja2.StrictUndefined, trim_blocks=True,
                             lstrip_blocks=True)
    env.filters["fmt"] = fmt
    env.filters["gain"] = gain
    env.filters["pct"] = lambda v: "n/a" if v is None else f"{v:.0%}"
    env.filters["source"] = source_name
    env.filters["sentence"] = lambda v: v[:1].upper() + v[1:]  # "VRAM-limited" stays VRAM, unlike capitalize
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
                                                schema_version=SCHEMA_VERSION, generated=_utc(time.time()),
                                                **context)


def _utc(ts: float | None) -> str:
    if not ts:
        return "n/a"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def verdict_label(d: Diagnosis) -> str:
    return d.limiter.label if d.limiter else INCONCLUSIVE


def headline_sentence(d: Diagnosis) -> str:
    """The headline without its "Verdict-label: " prefix, which the report already shows beside it."""
    prefix = verdict_label(d).lower() + ": "
    text = d.headline
    if text.lower().startswith(prefix):
        text = text[len(prefix):]
        text = text[:1].upper() + text[1:]
    return text


def join_argv(argv: list[str]) -> str:
    """A shell-quoted command line that leaves the redaction mask readable."""
    return " ".join(w if w == MASK else shlex.quote(w) for w in argv)


# --- one capture ---------------------------------------------------------------------------------------------

@dataclass
class CitationView:
    signal: str
    description: str
    stat: str
    value: str
    test: str
    source: str


@dataclass
class FindingView:
    code: str
    name: str
    limiter: str
    limiter_key: str
    strength: float
    message: str
    detects: str
    primary: bool
    citations: list[CitationView] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)


def _finding_views(d: Diagnosis) -> list[FindingView]:
    from diagnoser.rules import get_rule

    views = []
    for i, f in enumerate(d.findings):
        rule = get_rule(f.code)
        citations = [CitationView(
            signal=c.signal, description=spec(c.signal).description, stat=c.stat, value=fmt(c.value, c.unit),
            test=f"{svg.op_symbol(c.op)} {fmt(c.threshold, c.unit)}" if c.op and c.threshold is not None else "context",
            source=source_name(c.source)) for c in f.citations]
        views.append(FindingView(
            code=f.code, name=f.name, limiter=f.limiter.label, limiter_key=f.limiter.value, strength=f.strength,
            message=f.message, detects=rule.page.detects if rule else "", primary=i == 0 and d.limiter is f.limiter,
            citations=citations, fixes=[x.title for x in f.fixes]))
    return views


def _skipped_views(d: Diagnosis) -> list[dict[str, str]]:
    from diagnoser.rules import get_rule

    out = []
    for s in d.skipped:
        rule = get_rule(s.code)
        out.append({"code": s.code, "name": rule.name if rule else "", "reason": s.reason})
    return out


def _signal_rows(ev: Evidence) -> list[dict[str, str]]:
    rows = []
    for sig in sorted(ev, key=lambda s: s.name):
        one = sig.n == 1
        rows.append({
            "name": sig.name, "description": spec(sig.name).description, "source": source_name(sig.source),
            "n": str(sig.n), "mean": fmt(sig.mean, sig.unit), "p50": "" if one else fmt(sig.p50, sig.unit),
            "p90": "" if one else fmt(sig.p90, sig.unit), "max": "" if one else fmt(sig.max, sig.unit),
        })
    return rows


def _kv(rows: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """Context rows with something to say, values as display strings."""
    out = []
    for key, value in rows:
        if value is None or value == "" or value == [] or value == {}:
            continue
        out.append((key, value if isinstance(value, str) else str(value)))
    return out


def _context_views(capture: Capture, ev: Evidence) -> dict[str, Any]:
    end = capture.started_at + capture.duration_s if capture.started_at else None
    window = _kv([("target", capture.target), ("start", _utc(capture.started_at)), ("end", _utc(end)),
                  ("duration", fmt(capture.duration_s, "s")), ("host", capture.host),
                  ("captured by", f"diagnoser {capture.tool_version}" if capture.tool_version else ""),
                  ("report by", f"diagnoser {__version__}"),
                  ("CPU-only run", "yes: counters describe the host, not a GPU" if capture.cpu_only else "")])
    gpus = []
    for g in capture.gpus:
        matched = physics.match_gpu(g.name, g.memory_total_bytes)
        gpus.append({
            "index": str(g.index), "name": g.name, "uuid": g.uuid, "memory": fmt(g.memory_total_bytes, "bytes")
            if g.memory_total_bytes else "", "driver": g.driver, "cc": g.cuda_capability,
            "clock": f"{g.max_sm_clock_mhz:.0f} MHz" if g.max_sm_clock_mhz else "",
            "power": f"{g.power_limit_w:.0f} W" if g.power_limit_w else "",
            "mig": g.mig_instance or ("on" if g.mig_mode else ""),
            "spec": (matched.name + (" (measured roofs)" if g.measured else "")) if matched else "not in the table",
        })
    process = None
    if capture.process is not None:
        p = capture.process
        process = _kv([("pid", str(p.pid)), ("name", p.name), ("user", p.user),
                       ("command line", join_argv(redact_argv(p.cmdline)) if p.cmdline else ""),
                       ("children", ", ".join(map(str, p.children))),
                       ("GPUs", ", ".join(map(str, p.gpu_indices))),
                       ("exited", f"{p.exited_at_s:.1f} s into the window" if p.exited_at_s is not None else "")])
    server = None
    if capture.server is not None:
        server = _kv([("kind", capture.server.kind), ("metrics URL", capture.server.url),
                      ("version", capture.server.version)])
    model = None
    if capture.model is not None:
        m = capture.model
        model = _kv([("name", m.name), ("parameters", _count(m.params)),
                     ("active per token", _count(m.active_params) if m.active_params != m.params else ""),
                     ("layers", m.layers), ("hidden size", m.hidden), ("attention heads", m.heads),
                     ("KV heads", m.kv_heads), ("head size", m.head_dim), ("vocabulary", m.vocab),
                     ("weights", m.dtype), ("KV cache", m.kv_dtype), ("max context", m.max_context),
                     ("tensor parallel", m.tensor_parallel if m.tensor_parallel != 1 else "")])
    serving = _kv([(str(k), v if isinstance(v, str) else repr(v)) for k, v in capture.serving.items()])
    trace = None
    if capture.trace is not None:
        t = capture.trace
        trace = _kv([("file", t.path), ("window", fmt(t.window_s, "s") if t.window_s else ""),
                     ("devices", ", ".join(map(str, t.devices))), ("kernels", f"{t.kernel_count:,}"),
                     ("CUDA graph launches", f"{t.cuda_graph_launches:,}"),
                     ("launch call p50", f"{t.launch_call_us_p50:.1f} µs" if t.launch_call_us_p50 else ""),
                     ("launch delay p50", f"{t.launch_delay_us_p50:.1f} µs" if t.launch_delay_us_p50 else ""),
                     ("decode batch", f"{t.decode_batch:.1f}" if t.decode_batch else ""),
                     ("not read", "; ".join(t.skipped))]
                    + [(k, f"{v:g}") for k, v in t.extra.items()])
    return {"window": window, "gpus": gpus, "process": process, "server": server, "model": model,
            "serving": serving, "trace": trace, "roofs_note": "; ".join(ev.notes)}


def _count(value: float | None) -> str:
    if not value:
        return ""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if value >= size:
            return f"{value / size:.3g} {suffix}"
    return f"{value:,.0f}"


def _fix_views(d: Diagnosis) -> list[dict[str, Any]]:
    return [{"rank": i, "title": f.title, "action": f.action, "gain": gain(f.gain), "multiplier": f.gain,
             "basis": f.basis, "rule": f.rule} for i, f in enumerate(d.fixes, 1)]


def render_html(diagnosis: Diagnosis, capture: Capture, evidence: Evidence | None = None) -> str:
    """The report for one capture and its diagnosis, as one self-contained HTML document."""
    ev = evidence if evidence is not None else build_evidence(capture)
    figures, not_drawn = build_figures(capture, ev, diagnosis)
    d = diagnosis
    return _page(
        "report.html.j2", d=d, verdict=verdict_label(d), headline=headline_sentence(d),
        secondary=[(v, LIMITER_LABELS[Limiter(v)]) for v in d.secondary if v in Limiter._value2member_map_],
        top_fixes=_fix_views(d)[:3], all_fixes=_fix_views(d), findings=_finding_views(d), figures=figures,
        not_drawn=not_drawn, skipped=_skipped_views(d), signals=_signal_rows(ev), ctx=_context_views(capture, ev),
        source_names=SOURCE_NAMES, title=f"{verdict_label(d)}: {capture.target}",
        window_text=f"{fmt(capture.duration_s, 's')} from {_utc(capture.started_at)}",
    )


def _atomic_write(text: str, path: str | Path) -> Path:
    """A crash mid-write leaves the old file (or none), never half a report."""
    try:
        return write_atomic(path, text.encode("utf-8"))
    except OSError as exc:
        raise InputError(f"cannot write the report to {path}: {exc.strerror or exc}.") from None


def write_html(diagnosis: Diagnosis, capture: Capture, path: str | Path, evidence: Evidence | None = None) -> Path:
    """Render and write the report atomically; returns the path written."""
    return _atomic_write(render_html(diagnosis, capture, evidence), path)


# --- a fleet -------------------------------------------------------------------------------------------------

def _row_view(i: int, r: FleetRow, window_h: float) -> dict[str, Any]:
    d = r.diagnosis
    top = d.fixes[0] if d.fixes else None
    return {
        "i": i, "node": r.node, "gpu": r.gpu, "uuid": r.uuid, "model": r.model_name,
        "pod": "/".join(x for x in (r.namespace, r.pod) if x), "container": r.container, "mig": r.mig_profile,
        "verdict": verdict_label(d), "verdict_key": d.verdict, "color": VERDICT_COLORS.get(d.verdict, "#6e7781"),
        "confidence": d.confidence, "confidence_label": d.confidence_label, "headline": headline_sentence(d),
        "usd_h": r.usd_per_hour_at_stake, "usd_window": r.usd_per_hour_at_stake * window_h,
        "priced": getattr(r, "usd_per_gpu_hour", None) is not None or r.usd_per_hour_at_stake > 0,
        "busy": getattr(r, "busy", None),
        "gain": r.top_fix_gain, "gain_text": gain(r.top_fix_gain) if r.top_fix_gain is not None else "",
        "top_fix": top.title if top else "", "partial": r.partial, "notes": r.notes,
        "findings": _finding_views(d)[:3], "fixes": _fix_views(d)[:3], "to_collect": d.to_collect,
    }


_DETAIL_ROWS = 200  # per-GPU detail sections; the table and the JSON output carry every row


def render_fleet_html(report: FleetReport) -> str:
    """The fleet report: what is at stake, verdicts across GPUs, a sortable table and per-GPU evidence."""
    window_s = max(0.0, report.window_end - report.window_start)
    window_h = window_s / 3600.0
    rows = sorted(report.rows, key=lambda r: (-r.usd_per_hour_at_stake, -(r.top_fix_gain or 0.0), r.node, r.gpu))
    views = [_row_view(i, r, window_h) for i, r in enumerate(rows)]
    counts = Counter(r.diagnosis.verdict for r in rows)
    segments = [svg.Segment(f"{LIMITER_LABELS[Limiter(k)] if k in Limiter._value2member_map_ else k}: {n} GPU"
                            + ("s" if n != 1 else ""), n / len(rows), VERDICT_COLORS.get(k, "#6e7781"))
                for k, n in counts.most_common()] if rows else []
    verdict_chart = svg.stacked_bar("Verdicts across the fleet", segments, width=1080) if segments else None
    usd_h = sum(r.usd_per_hour_at_stake for r in rows)
    priced = [r for r in views if r["priced"]]
    if report.usd_per_gpu_hour is not None:
        price_note = f"at ${report.usd_per_gpu_hour:.2f} per GPU-hour"
    elif priced:
        price_note = ("at rough cloud list prices per GPU model (pass --usd-per-gpu-hour for yours)"
                      + (f"; {len(views) - len(priced)} GPU{'s' if len(views) - len(priced) != 1 else ''} without a "
                         "price" if len(priced) < len(views) else ""))
    else:
        price_note = ""
    gains = [r.top_fix_gain for r in rows if r.top_fix_gain is not None]
    summary = {
        "gpus": len(rows), "nodes": len({r.node for r in rows}), "usd_h": usd_h, "usd_window": usd_h * window_h,
        "usd_month": usd_h * 730.0, "window": fmt(window_s, "s") if window_s < 3600 else f"{window_h:.1f} h",
        "idle": counts.get("idle", 0), "big_gain": sum(1 for g in gains if g >= 1.5),
        "median_gain": statistics.median(gains) if gains else None,
        "inconclusive": counts.get(INCONCLUSIVE, 0), "partial": sum(1 for r in rows if r.partial),
        "priced": bool(priced), "price_note": price_note,
    }
    return _page(
        "fleet.html.j2", report=report, rows=views, details=views[:_DETAIL_ROWS], summary=summary,
        verdict_chart=verdict_chart, start=_utc(report.window_start), end=_utc(report.window_end),
        title=f"Fleet diagnosis: {len(rows)} GPUs",
    )


def write_fleet_html(report: FleetReport, path: str | Path) -> Path:
    """Render and write the fleet report atomically; returns the path written."""
    return _atomic_write(render_fleet_html(report), path)


__all__ = ["render_html", "write_html", "render_fleet_html", "write_fleet_html", "VERDICT_COLORS"]
