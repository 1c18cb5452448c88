"""The report model: everything a renderer shows, built once from the capture, its evidence, the diagnosis and the
rule set in force. Terminal, JSON and HTML each render a Report; none of them rebuilds evidence, reruns physics or
looks rules up. A Report (and a fleet's FleetView) is typed views only, every string redacted here, once, a figure's
labels and tooltips with its data: a renderer reads its fields and nothing past them (no diagnosis, no capture), and
redacts nothing, so none can forget to redact or derive a view its own way.
"""

from __future__ import annotations

import shlex
import statistics
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from diagnoser import __version__, physics
from diagnoser.capture import TRACE_RESULTS, Capture, EngineSteps, TraceSummary
from diagnoser.diagnosis import LIMITER_LABELS, Benefit, Diagnosis, Fix, GainKind, Limiter, Regime, Verdict
from diagnoser.evidence import Evidence
from diagnoser.fleet.model import FleetReport, FleetRow
from diagnoser.reports.figdata import Figure, KernelTable, NotDrawn, Segment, StackedBar
from diagnoser.reports.figures import SOURCE_NAMES, build_figures, op_symbol, source_name
from diagnoser.reports.labels import VERDICT_COLORS, limiter_label, verdict_color
from diagnoser.reports.redact import MASK, redact, redact_argv, redact_fields
from diagnoser.reports.trace_figures import kernel_table, window_text
from diagnoser.rules.ruleset import RuleSet, default_rules
from diagnoser.signals import spec
from diagnoser.units import fmt, fmt_bucket


def utc(ts: float | None) -> str:
    if not ts:
        return "n/a"
    return datetime.fromtimestamp(ts, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def verdict_label(d: Diagnosis) -> str:
    return d.limiter.label if d.limiter else Verdict.INCONCLUSIVE.value


def headline_sentence(d: Diagnosis) -> str:
    """The headline without its "Verdict-label: " prefix, which a report shows beside it."""
    prefix = verdict_label(d).lower() + ": "
    text = d.headline
    if text.lower().startswith(prefix):
        text = text[len(prefix):]
        text = text[:1].upper() + text[1:]
    return text


def join_argv(argv: list[str]) -> str:
    """A shell-quoted command line that leaves the redaction mask readable."""
    return " ".join(w if w == MASK else shlex.quote(w) for w in argv)


def gain_text(fix: Fix) -> str:
    """A fix's gain as a promise a user can hold us to: an estimate, an upper bound, or capacity."""
    g = fix.gain
    if g is None:
        return {"cost": "frees GPU time", "health": "a failing GPU"}.get(fix.benefit.value, "gain not predictable")
    amount = f"{g:.1f}x" if g >= 1.995 else f"+{(g - 1) * 100:.0f} %"
    text = f"up to {amount}" if fix.gain_kind is GainKind.UPPER_BOUND else f"about {amount}"
    if fix.benefit is Benefit.CAPACITY:
        text = f"capacity {amount}" if fix.gain_kind is GainKind.ESTIMATE else f"capacity up to {amount}"
    if fix.gain_kind is GainKind.ESTIMATE and fix.gain_low is not None and fix.gain_high is not None:
        text += f" ({fix.gain_low:.1f}x to {fix.gain_high:.1f}x)"
    if fix.capped:
        text += " (capped)"
    return text


_BENEFIT_TEXT = {
    Benefit.SPEED: "speed: this traffic served faster",
    Benefit.CAPACITY: "capacity: more load fits; a gain only if more is offered",
    Benefit.COST: "cost: fewer or cheaper GPUs",
    Benefit.HEALTH: "health: a failing GPU",
}


@dataclass
class FixView:
    rank: int
    title: str
    action: str
    gain: str  # the promise, in words (gain_text)
    multiplier: float | None
    basis: str
    rule: str  # every rule that proposed it, comma-separated
    kind: str
    benefit: str
    upper_bound: bool
    capped: str


@dataclass
class CitationView:
    signal: str
    description: str
    stat: str
    value: str
    test: str
    source: str
    text: str  # the whole citation in one line, Citation.text()'s form, redacted: what the terminal prints


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
    regime: str = ""
    citations: list[CitationView] = field(default_factory=list)
    fixes: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class WithheldView:
    """A fix a rule proposed that the capture shows in place, or that does not fit the workload."""

    title: str
    why: str
    rule: str
    kind: str


@dataclass(frozen=True)
class SkippedView:
    """A rule that could not run for lack of signals."""

    code: str
    name: str  # "" where the rule set in force has no such rule
    reason: str


@dataclass(frozen=True)
class UnavailableView:
    """A source or signal the collectors could not read, and how to get it."""

    source: str  # the collector's key ("dcgm"): each renderer names it in its own words
    what: str
    reason: str
    hint: str


@dataclass(frozen=True)
class SignalRow:
    """One signal of the capture as display strings; p50, p90 and max are "" for a single-number signal."""

    name: str
    description: str
    source: str
    n: str
    mean: str
    p50: str
    p90: str
    max: str


@dataclass(frozen=True)
class GpuRow:
    index: str
    name: str
    uuid: str
    memory: str
    driver: str
    cc: str
    clock: str
    power: str
    mig: str
    spec: str  # the physics table's entry, or "not in the table"


Rows = list[tuple[str, str]]  # (key, value) rows with something to say, values as display strings


@dataclass
class RunContext:
    """The run's context, section by section; a section is None where the capture has no such part."""

    window: Rows = field(default_factory=list)
    gpus: list[GpuRow] = field(default_factory=list)
    process: Rows | None = None
    server: Rows | None = None
    model: Rows | None = None
    serving: Rows = field(default_factory=list)
    trace: Rows | None = None
    physics: Rows = field(default_factory=list)
    roofs_note: str = ""


@dataclass
class Report:
    """One capture's report, ready to render: typed views, every string redacted. Renderers read these fields only
    (tests/test_report_contract.py holds terminal.py and html.py to it)."""

    title: str
    verdict: str  # the verdict's label
    verdict_key: str  # the verdict's value ("memory_bandwidth"): styles and colours are keyed by it
    headline: str  # without the label prefix
    confidence: float
    confidence_label: str
    confidence_reasons: list[str]
    near_tie: str  # "" unless another limiter was a hair behind
    notes: list[str]
    target: str
    gpu_line: str  # the GPU, its roofs and the window in one line, or ""
    window_text: str
    generated: str
    secondary: list[tuple[str, str]]  # (limiter key, label) of the other limiters seen
    also: list[str]  # every secondary name in words, those that are no limiter too
    fixes: list[FixView]
    withheld: list[WithheldView]
    findings: list[FindingView]
    passed: list[str]  # the rules that ran and found nothing
    skipped: list[SkippedView]
    to_collect: list[str]
    unavailable: list[UnavailableView]
    signals: list[SignalRow]
    ctx: RunContext
    figures: list[Figure]
    not_drawn: list[NotDrawn]
    regime: str  # "memory-bound regime at 33 % of the bandwidth roof", or ""
    # For jsonout alone: the published JSON is the diagnosis itself (docs/diagnosis.schema.json), redacted as a
    # whole on the way out, so it is serialised from the diagnosis rather than from a hand-kept copy of its shape.
    document: Diagnosis
    source_names: dict[str, str] = field(default_factory=lambda: dict(SOURCE_NAMES))
    kernels: KernelTable | None = None  # the kernels holding the GPU time, where a trace names them
    tool_version: str = __version__

    @property
    def top_fixes(self) -> list[FixView]:
        return self.fixes[:3]


def fix_views(d: Diagnosis) -> list[FixView]:
    return [FixView(rank=i, title=redact(f.title), action=redact(f.action), gain=gain_text(f), multiplier=f.gain,
                    basis=redact(f.basis), rule=", ".join(f.rules or (f.rule,)), kind=f.kind.value,
                    benefit=_BENEFIT_TEXT[f.benefit], upper_bound=f.is_upper_bound, capped=redact(f.capped))
            for i, f in enumerate(d.fixes, 1)]


def finding_views(d: Diagnosis, rules: RuleSet) -> list[FindingView]:
    views = []
    for i, f in enumerate(d.findings):
        rule = rules.get(f.code)
        citations = [CitationView(
            signal=c.signal, description=spec(c.signal).description, stat=c.stat,
            value=fmt_bucket(c.value, c.unit, c.bucket),
            test=f"{op_symbol(c.op)} {fmt(c.threshold, c.unit)}" if c.op and c.threshold is not None else "context",
            source=source_name(c.source), text=redact(c.text())) for c in f.citations]
        detects = rule.page_for(rules.thresholds(rule.code)).detects if rule is not None else ""
        views.append(FindingView(
            code=f.code, name=f.name, limiter=f.limiter.label, limiter_key=f.limiter.value, strength=f.strength,
            message=redact(f.message), detects=detects, primary=i == 0 and d.limiter is f.limiter,
            regime=f.regime.value, citations=citations, fixes=[redact(x.title) for x in f.fixes]))
    return views


def _skipped_views(d: Diagnosis, rules: RuleSet) -> list[SkippedView]:
    out = []
    for s in d.skipped:
        rule = rules.get(s.code)
        out.append(SkippedView(code=s.code, name=rule.name if rule else "", reason=redact(s.reason)))
    return out


def _signal_rows(ev: Evidence) -> list[SignalRow]:
    rows = []
    for sig in sorted(ev, key=lambda s: s.name):
        one = sig.n == 1
        rows.append(SignalRow(
            name=sig.name, description=spec(sig.name).description, source=source_name(sig.source),
            n=str(sig.n), mean=fmt_bucket(sig.mean, sig.unit, sig.bucket),
            p50="" if one else fmt(sig.p50, sig.unit),
            p90="" if one else fmt(sig.p90, sig.unit), max="" if one else fmt(sig.max, sig.unit),
        ))
    return rows


def _kv(rows: list[tuple[str, Any]]) -> Rows:
    """Context rows with something to say, as redacted display strings (a model name or a serving flag can carry a
    token as well as a command line can)."""
    out = []
    for key, value in rows:
        if value is None or value == "" or value == [] or value == {}:
            continue
        out.append((redact(key), redact(value if isinstance(value, str) else str(value))))
    return out


def _count(value: float | None) -> str:
    if not value:
        return ""
    for size, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if value >= size:
            return f"{value / size:.3g} {suffix}"
    return f"{value:,.0f}"


def _gpu_rows(capture: Capture) -> list[GpuRow]:
    gpus = []
    for g in capture.gpus:
        matched = physics.match_gpu(g.name, g.memory_total_bytes)
        gpus.append(GpuRow(
            index=str(g.index), name=redact(g.name), uuid=redact(g.uuid),
            memory=fmt(g.memory_total_bytes, "bytes") if g.memory_total_bytes else "", driver=redact(g.driver),
            cc=redact(g.cuda_capability), clock=f"{g.max_sm_clock_mhz:.0f} MHz" if g.max_sm_clock_mhz else "",
            power=f"{g.power_limit_w:.0f} W" if g.power_limit_w else "",
            mig=redact(g.mig_instance or ("on" if g.mig_mode else "")),
            spec=(matched.name + (" (measured roofs)" if g.measured else "")) if matched else "not in the table",
        ))
    return gpus


def _context_views(capture: Capture, ev: Evidence) -> RunContext:
    end = capture.started_at + capture.duration_s if capture.started_at else None
    window = _kv([("target", capture.target), ("start", utc(capture.started_at)), ("end", utc(end)),
                  ("duration", fmt(capture.duration_s, "s")), ("host", capture.host),
                  ("captured by", f"diagnoser {capture.tool_version}" if capture.tool_version else ""),
                  ("report by", f"diagnoser {__version__}"),
                  ("CPU-only run", "yes: counters describe the host, not a GPU" if capture.cpu_only else "")])
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
                     # Not the server's running batch: the batch of the decode-like steps the trace's shapes show.
                     ("decode batch (from the trace)", fmt(t.decode_batch) if t.decode_batch else ""),
                     ("temporal breakdown", _temporal(t)),
                     *_engine_rows(t.engine_steps),
                     ("frontends (not ranks)", "; ".join(t.frontends)),
                     ("not read", "; ".join(t.skipped))]
                    + [_trace_result(k, v) for k in TRACE_RESULTS if (v := getattr(t, k)) is not None])
    physics_rows = _kv([("regime", _regime_text(ev.regime, None)), ("regime from", ev.regime_basis),
                        ("workload", ev.workload), ("platform", ev.platform)]
                       + [(f"in place: {k.value.replace('_', ' ')}", why) for k, why in ev.in_place.items()]
                       + [("data quality", q.reason) for q in ev.quality])
    return RunContext(window=window, gpus=_gpu_rows(capture), process=process, server=server, model=model,
                      serving=serving, trace=trace, physics=physics_rows, roofs_note=redact("; ".join(ev.notes)))


# The trace's own results as a reader names them, with the unit `units.fmt` writes them in. Its ridge is the one the
# trace analysis held the ops against (the physics table's datasheet roofs), which differs from the roofline's when
# the capture carries measured roofs: the label says which it is.
TRACE_RESULT_LABELS: dict[str, tuple[str, str]] = {
    "comm_exposed_frac": ("communication not overlapped", "ratio"),
    "graph_kernel_count_frac": ("kernels from graph replays", "ratio"),
    "costed_gemm_attention_frac": ("GEMM + attention time costed", "ratio"),
    "costed_op_count": ("ops with known FLOPs, bytes", ""),
    "ridge_flop_per_byte": ("ridge (datasheet roofs)", "FLOP/B"),
    "time_frac_below_ridge": ("costed time below that ridge", "ratio"),
    "context_tokens_first": ("context, first decode step", "tokens"),
    "context_tokens_last": ("context, last decode step", "tokens"),
    "attention_frac_first": ("attention, first decode step", "ratio"),
    "attention_frac_last": ("attention, last decode step", "ratio"),
    "rank_count": ("ranks combined", ""),
    "comm_share_max_rank": ("most communication of a rank", "ratio"),
}


def _trace_result(key: str, value: float) -> tuple[str, str]:
    label, unit = TRACE_RESULT_LABELS.get(key, (key, ""))
    return label, f"{int(value):,}" if not unit and float(value).is_integer() else fmt(value, unit)


def _temporal(t: TraceSummary) -> str:
    if t.compute_time_frac is None or t.non_compute_time_frac is None or t.idle_time_frac is None:
        return ""
    return (f"compute {t.compute_time_frac:.1%}, non-compute {t.non_compute_time_frac:.1%}, idle "
            f"{t.idle_time_frac:.1%}")


def _engine_rows(e: EngineSteps | None) -> list[tuple[str, str]]:
    """The engine's own step annotations (vLLM) as rows: the split as the engine wrote it."""
    if e is None:
        return []
    rows = [("engine steps", f"{e.steps}, p50 {e.step_ms_p50:.2f} ms, {e.steps_frac:.0%} of the window"),
            ("steps with a prefill", f"{e.prefill_steps} ({e.prompt_tokens:,} prompt tokens, "
             f"{e.prefill_time_frac:.1%} of the steps' time); {e.generated_tokens:,} tokens generated")]
    if e.decode_batch is not None:
        rows.append(("decode-only steps", f"batch {fmt(e.decode_batch)}, p50 {e.decode_step_ms_p50 or 0:.2f} ms"))
    if e.op_share:
        rows.append(("steps' time by CPU op", ", ".join(
            f"{k} {v:.1%}" for k, v in sorted(e.op_share.items(), key=lambda kv: -kv[1]))))
    if e.outside_op_share:
        from diagnoser.reports.trace_text import outside_text

        rows.append((f"outside the steps ({1.0 - e.steps_frac:.1%} of the window)", outside_text(e)))
    return rows


def _regime_text(regime: Regime, saturation: float | None) -> str:
    if regime is Regime.UNKNOWN:
        return ""
    roof = "the bandwidth roof" if regime is Regime.MEMORY else "the tensor peak"
    at = f" at {saturation:.0%} of {roof}" if saturation is not None else ""
    return f"{regime.value}-bound regime{at}"


def _gpu_line(d: Diagnosis) -> str:
    """The diagnosis's GPU, its roofs and the window in one line: "H100 SXM (+1 more), H100 SXM roofs (spec
    sheet), 30 s window"."""
    gpus = d.context.get("gpus") or []
    if not gpus:
        return ""
    text = str(gpus[0].get("name", ""))
    if len(gpus) > 1:
        text += f" (+{len(gpus) - 1} more)"
    spec_name = d.context.get("gpu_spec")
    if spec_name:
        text += f", {spec_name} roofs ({d.context.get('roofs', 'spec sheet')})"
    window = d.context.get("window_s")
    if isinstance(window, (int, float)) and window > 0:
        text += f", {window_text(window)} window"
    return redact(text)


def _report(d: Diagnosis, rules: RuleSet, target: str, *, window: str, signals: list[SignalRow], ctx: RunContext,
            figures: list[Figure], not_drawn: list[NotDrawn], kernels: KernelTable | None) -> Report:
    """The views of the diagnosis itself, with the run's views as given."""
    return Report(
        title=redact(f"{verdict_label(d)}: {target}"), verdict=verdict_label(d), verdict_key=Verdict(d.verdict).value,
        headline=redact(headline_sentence(d)), confidence=d.confidence, confidence_label=d.confidence_label,
        confidence_reasons=[redact(r) for r in d.confidence_reasons], near_tie=redact(d.near_tie),
        notes=[redact(n) for n in d.notes], target=redact(d.target), gpu_line=_gpu_line(d), window_text=window,
        generated=utc(time.time()),
        secondary=[(v, LIMITER_LABELS[Limiter(v)]) for v in d.secondary if v in Limiter._value2member_map_],
        also=[redact(s.replace("_", " ")) for s in d.secondary], fixes=fix_views(d),
        withheld=[WithheldView(title=redact(w.title), why=redact(w.why), rule=redact(w.rule), kind=w.kind.value)
                  for w in d.withheld],
        findings=finding_views(d, rules), passed=list(d.passed), skipped=_skipped_views(d, rules),
        to_collect=[redact(w) for w in d.to_collect],
        unavailable=[UnavailableView(source=redact(u.source), what=redact(u.what), reason=redact(u.reason),
                                     hint=redact(u.hint or "")) for u in d.unavailable],
        signals=signals, ctx=ctx, regime=_regime_text(d.regime, d.saturation), document=d,
        # A figure is redacted here, its labels and tooltips with it (series, kernel and lane names come from the
        # capture): the renderers that draw it only escape.
        figures=redact_fields(figures), not_drawn=redact_fields(not_drawn),
        kernels=redact_fields(kernels) if kernels is not None else None)


def build_report(capture: Capture, evidence: Evidence, diagnosis: Diagnosis, rules: RuleSet | None = None) -> Report:
    """Everything a renderer needs for one capture's report."""
    rules = rules or default_rules()
    figures, not_drawn = build_figures(capture, evidence, diagnosis)
    kernels = kernel_table(capture, evidence) if capture.trace is not None else None
    if isinstance(kernels, NotDrawn):
        not_drawn.append(kernels)
        kernels = None
    return _report(diagnosis, rules, capture.target,
                   window=f"{fmt(capture.duration_s, 's')} from {utc(capture.started_at)}",
                   signals=_signal_rows(evidence), ctx=_context_views(capture, evidence), figures=figures,
                   not_drawn=not_drawn, kernels=kernels)


def report_from_diagnosis(diagnosis: Diagnosis, rules: RuleSet | None = None) -> Report:
    """A report of a diagnosis alone (a fleet row's, say): no figures, signals or run context."""
    return _report(diagnosis, rules or default_rules(), diagnosis.target, window="", signals=[], ctx=RunContext(),
                   figures=[], not_drawn=[], kernels=None)


# --- a fleet -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class FleetRowView:
    """One GPU as the fleet table lists it, every string redacted (node and pod names are label values)."""

    i: int  # its place in the table's order: the detail section's anchor
    node: str
    gpu: str
    uuid: str
    model: str
    pod: str  # namespace/pod
    container: str
    mig: str
    verdict: str
    verdict_key: str
    color: str
    confidence: float
    confidence_label: str
    headline: str
    usd_h: float
    usd_window: float
    priced: bool
    busy: float | None
    gain: float | None
    gain_text: str
    top_fix: str
    partial: bool
    notes: tuple[str, ...]
    detailed: bool  # its evidence is on the page (a FleetDetail)


@dataclass(frozen=True)
class FleetDetail:
    """The evidence section of one GPU the page shows: its row, its strongest findings and fixes, what to collect."""

    row: FleetRowView
    findings: tuple[FindingView, ...]
    fixes: tuple[FixView, ...]
    to_collect: tuple[str, ...]


@dataclass(frozen=True)
class FleetSummary:
    """The fleet's totals: every GPU, not only those the table lists."""

    gpus: int
    nodes: int
    usd_h: float
    usd_window: float
    usd_month: float
    window: str
    idle: int
    big_gain: int  # GPUs whose top fix is predicted to give 1.5x or more
    median_gain: float | None
    inconclusive: int
    partial: int
    priced: bool
    price_note: str
    listed: int  # the table's rows


@dataclass(frozen=True)
class FleetGroupView:
    """Every GPU of one verdict and GPU model, counted, with the money at stake."""

    verdict: str
    verdict_key: str
    model: str
    gpus: int
    usd_h: float
    partial: int


@dataclass(frozen=True)
class FleetView:
    title: str
    generated: str
    start: str
    end: str
    source: str  # the Prometheus URL or exporter list, redacted
    query_seconds: float | None
    errors: tuple[str, ...]
    rows: tuple[FleetRowView, ...]  # the GPUs the table lists (all of a small fleet), in order of money at stake
    details: tuple[FleetDetail, ...]
    summary: FleetSummary
    verdict_chart: StackedBar | None
    groups: tuple[FleetGroupView, ...] = ()  # every GPU, counted by verdict and model
    tool_version: str = __version__


_DETAIL_ROWS = 200  # per-GPU detail sections; the JSON output carries every row
# Table rows on the page. At 100,000 GPUs a row each made an 76 MB page (68 s to open in Chromium) and unpacked
# every GPU's diagnosis (2 GB peak); the page lists the GPUs most at stake and counts the rest by verdict and model.
_TABLE_ROWS = 2000


def _detail_indices(rows: list[FleetRow], n: int = _DETAIL_ROWS) -> set[int]:
    """The GPUs whose evidence the page shows: the most at stake of every verdict in turn. By money alone, 200 of
    100,000 GPUs were all idle ones (the largest price of a GPU doing nothing), and no VRAM- or compute-limited GPU's
    evidence was on the page. `rows` come sorted by money at stake; only verdicts are read (a packed diagnosis stays
    packed)."""
    if len(rows) <= n:
        return set(range(len(rows)))
    by_verdict: dict[str, list[int]] = {}
    for i, r in enumerate(rows):
        by_verdict.setdefault(r.diagnosis.verdict, []).append(i)
    chosen: set[int] = set()
    depth = 0
    while len(chosen) < n:
        added = [group[depth] for group in by_verdict.values() if depth < len(group)]
        if not added:
            break
        chosen.update(added[:n - len(chosen)])
        depth += 1
    return chosen


def _listed_indices(count: int, details: set[int], n: int = _TABLE_ROWS) -> list[int]:
    """The table's rows: every GPU whose evidence is shown, then the most at stake up to `n`, in the table's order."""
    listed = set(details)
    for i in range(count):
        if len(listed) >= n:
            break
        listed.add(i)
    return sorted(listed)


def _row_view(i: int, r: FleetRow, window_h: float, *, detailed: bool) -> FleetRowView:
    d = r.diagnosis
    top = d.fixes[0] if d.fixes else None
    return FleetRowView(
        i=i, node=redact(r.node), gpu=redact(r.gpu), uuid=redact(r.uuid), model=redact(r.model_name),
        pod=redact("/".join(x for x in (r.namespace, r.pod) if x)), container=redact(r.container),
        mig=redact(r.mig_profile), verdict=verdict_label(d), verdict_key=Verdict(d.verdict).value,
        color=verdict_color(d.verdict),
        confidence=d.confidence, confidence_label=d.confidence_label, headline=redact(headline_sentence(d)),
        usd_h=r.usd_per_hour_at_stake, usd_window=r.usd_per_hour_at_stake * window_h, priced=_priced(r),
        busy=r.busy, gain=r.top_fix_gain,
        gain_text=gain_text(top) if top is not None and r.top_fix_gain is not None else "",
        top_fix=redact(top.title) if top else "", partial=r.partial, notes=tuple(redact(n) for n in r.notes),
        detailed=detailed)


def _detail(row: FleetRowView, d: Diagnosis, rules: RuleSet) -> FleetDetail:
    """The evidence only where the page shows it: building it for every listed GPU doubled the page's cost."""
    return FleetDetail(row=row, findings=tuple(finding_views(d, rules)[:3]), fixes=tuple(fix_views(d)[:3]),
                       to_collect=tuple(redact(w) for w in d.to_collect))


def _priced(r: FleetRow) -> bool:
    return r.usd_per_gpu_hour is not None or r.usd_per_hour_at_stake > 0


def _groups(rows: list[FleetRow]) -> tuple[FleetGroupView, ...]:
    """Every GPU counted by verdict and GPU model, with the money at stake: what the table's cut leaves out."""
    acc: dict[tuple[str, str], list[float]] = {}  # (verdict, model) -> [gpus, usd_h, partial]
    for r in rows:
        g = acc.setdefault((r.diagnosis.verdict, r.model_name), [0, 0.0, 0])
        g[0] += 1
        g[1] += r.usd_per_hour_at_stake
        g[2] += r.partial
    ordered = sorted(acc.items(), key=lambda kv: (-kv[1][1], -kv[1][0], kv[0]))
    return tuple(FleetGroupView(verdict=limiter_label(v), verdict_key=Verdict(v).value, model=redact(model),
                                gpus=int(g[0]), usd_h=g[1], partial=int(g[2])) for (v, model), g in ordered)


def _price_note(report: FleetReport, rows: list[FleetRow]) -> tuple[bool, str]:
    priced = sum(1 for r in rows if _priced(r))
    if report.usd_per_gpu_hour is not None:
        return bool(priced), f"at ${report.usd_per_gpu_hour:.2f} per GPU-hour"
    if not priced:
        return False, ""
    unpriced = len(rows) - priced
    return True, ("at rough cloud list prices per GPU model (pass --usd-per-gpu-hour for yours)"
                  + (f"; {unpriced} GPU{'s' if unpriced != 1 else ''} without a price" if unpriced else ""))


def _summary(report: FleetReport, rows: list[FleetRow], counts: Counter[Verdict], listed: int) -> FleetSummary:
    window_s = max(0.0, report.window_end - report.window_start)
    window_h = window_s / 3600.0
    usd_h = sum(r.usd_per_hour_at_stake for r in rows)
    priced, price_note = _price_note(report, rows)
    gains = [r.top_fix_gain for r in rows if r.top_fix_gain is not None]
    return FleetSummary(
        gpus=len(rows), nodes=len({r.node for r in rows}), usd_h=usd_h, usd_window=usd_h * window_h,
        usd_month=usd_h * 730.0, window=fmt(window_s, "s") if window_s < 3600 else f"{window_h:.1f} h",
        idle=counts.get(Verdict.IDLE, 0), big_gain=sum(1 for g in gains if g >= 1.5),
        median_gain=statistics.median(gains) if gains else None,
        inconclusive=counts.get(Verdict.INCONCLUSIVE, 0), partial=sum(1 for r in rows if r.partial),
        priced=priced, price_note=price_note, listed=listed)


def _verdict_chart(counts: Counter[Verdict], total: int) -> StackedBar | None:
    segments = [Segment(f"{limiter_label(k)}: {n} GPU" + ("s" if n != 1 else ""), n / total, verdict_color(k))
                for k, n in counts.most_common()] if total else []
    return redact_fields(StackedBar("Verdicts across the fleet", segments, width=1080)) if segments else None


def build_fleet_view(report: FleetReport, rules: RuleSet | None = None) -> FleetView:
    """The fleet report: what is at stake, verdicts across GPUs, a sortable table of the GPUs most at stake, every
    GPU counted by verdict and model, and per-GPU evidence; every string redacted here, as a Report's are."""
    rules = rules or default_rules()
    window_h = max(0.0, report.window_end - report.window_start) / 3600.0
    rows = sorted(report.rows, key=lambda r: (-r.usd_per_hour_at_stake, -(r.top_fix_gain or 0.0), r.node, r.gpu))
    detailed = _detail_indices(rows)
    views: list[FleetRowView] = []
    details: list[FleetDetail] = []
    for i in _listed_indices(len(rows), detailed):
        views.append(_row_view(i, rows[i], window_h, detailed=i in detailed))
        if i in detailed:
            details.append(_detail(views[-1], rows[i].diagnosis, rules))
    counts = Counter(r.diagnosis.verdict for r in rows)
    return FleetView(title=f"Fleet diagnosis: {len(rows)} GPUs", generated=utc(time.time()),
                     start=utc(report.window_start), end=utc(report.window_end), source=redact(report.source),
                     query_seconds=report.query_seconds, errors=tuple(redact(e) for e in report.errors),
                     rows=tuple(views), details=tuple(details), summary=_summary(report, rows, counts, len(views)),
                     verdict_chart=_verdict_chart(counts, len(rows)), groups=_groups(rows))


__all__ = ["FixView", "FindingView", "FleetDetail", "FleetGroupView", "FleetRowView", "FleetSummary", "FleetView",
           "GpuRow", "Report", "RunContext", "SignalRow", "SkippedView", "UnavailableView", "WithheldView",
           "VERDICT_COLORS", "build_fleet_view", "build_report", "gain_text", "headline_sentence",
           "report_from_diagnosis", "verdict_label"]
