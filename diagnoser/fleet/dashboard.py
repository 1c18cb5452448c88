"""The Grafana dashboard of the fleet's rule group and the agent (`diagnoser rules --grafana-dashboard`), generated
from the declarations the rule group is compiled from, so that a renamed series cannot leave a dead panel.

What it reads: the series the rule group records (fleet/promrules.py: `gpu:diagnoser_limiter:<window>`,
`gpu:diagnoser_finding:<window>`, the recorded statistics and signals, the GPUs' identities, the count per limiter),
each rule's formula's comparisons with its thresholds in force (the parts compiled by the group's own compiler,
`promrules.PartCompiler`), and the agent's metric families as `agent/metrics.AgentMetrics` exposes them (a family
the dashboard names and the agent no longer exports fails the generation). deploy/grafana/diagnoser-fleet.json is
this module's output for the defaults; tests/test_grafana_dashboard.py holds it equal, and
tests/test_fleet_promrules.py runs every panel's and every variable's query on a real Prometheus that evaluates the
group over a simulated fleet and scrapes a real agent endpoint.

Three rows: the fleet at a glance (GPUs per verdict over time, the GPUs with the most at stake with their first fix
and runbook, verdict changes and firing alerts as annotations), one GPU's window (its verdict, its findings'
strength, and each statistic a rule compares with a threshold, plotted with that threshold as a line), and the
agent's view of each server (verdict history, first fix and predicted gain, confidence and efficiency, scrape and run
health). Variables: the data source, the runbook's URL, node, pod and model (read from the recorded identities,
whatever spelling of the label the exporter used) and GPU.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from diagnoser.collectors.dcgm import NODE_LABELS, POD_LABELS
from diagnoser.collectors.prom_stats import KEY_LABELS, duration, identity_record_name
from diagnoser.diagnosis import Limiter, Verdict
from diagnoser.fleet.promrules import (
    ALERTS,
    RUNBOOK_PREFIX,
    PartCompiler,
    default_interval,
    prometheus_rules_text,
    runbook_anchor,
    signal_name,
)
from diagnoser.reports.labels import limiter_label, verdict_color
from diagnoser.rules import Rule, RuleSet, default_rules
from diagnoser.rules import formula as fm

UID = "diagnoser-fleet"
TITLE = "diagnoser: GPU fleet and agent"
SCHEMA_VERSION = 39  # Grafana 10.4-11's dashboard JSON
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
PATH = "deploy/grafana/diagnoser-fleet.json"
REGENERATE = f"diagnoser rules --grafana-dashboard > {PATH}"
# The node's label as the exporters spell it, most specific first (not `instance`: an exporter's address).
_NODES = tuple(n for n in NODE_LABELS if n != "instance")
_VERDICTS = tuple(v.value for v in Verdict)  # the agent's order (agent/metrics.py VERDICTS)
# As fleet/run.stake_fraction prices a GPU: all of it for these verdicts, its idle share for the underfed ones.
_WHOLE = (Limiter.IDLE.value, Limiter.ERRORS.value)
_UNDERFED = (Limiter.BATCHING.value, Limiter.HOST_LAUNCH.value)


# --- the agent's families ------------------------------------------------------------------------------------------


def agent_metrics() -> dict[str, str]:
    """The agent's metric families, by family name, as exposed once it has run a cycle (a counter's `_total`, an
    info's `_info`)."""
    from diagnoser.agent.metrics import AgentMetrics

    metrics = AgentMetrics()
    metrics.record_cycle(0.0, 0.0)
    suffix = {"counter": "_total", "info": "_info"}
    return {m.name: m.name + suffix.get(m.type, "") for m in metrics.collect()}


class _Agent:
    def __init__(self) -> None:
        self._names = agent_metrics()

    def __call__(self, family: str) -> str:
        if family not in self._names:
            raise ValueError(f"the dashboard reads the agent's {family}, which agent/metrics.py no longer exports")
        return self._names[family]


# --- PromQL --------------------------------------------------------------------------------------------------------


def _q(s: str) -> str:
    return json.dumps(s)


@dataclass(frozen=True)
class Series:
    """The names the rule group records for one window."""

    window_s: float

    @property
    def w(self) -> str:
        return duration(self.window_s)

    @property
    def limiter(self) -> str:
        return f"gpu:diagnoser_limiter:{self.w}"

    @property
    def finding(self) -> str:
        return f"gpu:diagnoser_finding:{self.w}"

    @property
    def count(self) -> str:
        return f"limiter:diagnoser_gpus:count_{self.w}"

    @property
    def identity(self) -> str:
        return identity_record_name(self.window_s)

    @property
    def busy(self) -> str:
        return signal_name("busy", self.window_s)

    def any_of(self, labels: Iterable[str], value: str, extra: str = "") -> str:
        """The identities whose label, in any of its spellings, matches `value` (a variable)."""
        more = f", {extra}" if extra else ""
        return "(" + " or ".join(f"{self.identity}{{{label}=~{_q(value)}{more}}}" for label in labels) + ")"

    def selected(self, gpu: bool = False) -> str:
        """The GPUs the variables select (node, pod and model; with `gpu`, the GPU too), one series per key."""
        k = KEY_LABELS
        parts = [self.any_of(_NODES, "$node"), self.any_of(POD_LABELS, "$pod"),
                 f'{self.identity}{{modelName=~"$model"}}']
        if gpu:
            parts.append(self.any_of(("UUID", "uuid"), "$gpu"))
        return f"max by ({k}) (" + f" and on ({k}) ".join(parts) + ")"

    def of_selected(self, expr: str, gpu: bool = False) -> str:
        return f"({expr}) and on ({KEY_LABELS}) {self.selected(gpu)}"

    def with_identity(self, expr: str) -> str:
        """`expr` with each GPU's node, pod and model labels."""
        k = KEY_LABELS
        labels = ", ".join(("gpu", "modelName", *_NODES, *POD_LABELS))
        return f"({expr})\n  * on ({k}) group_left ({labels})\n(topk by ({k}) (1, {self.identity}) * 0 + 1)"


def verdict_numbers() -> dict[str, int]:
    """Each verdict as a number (a state timeline colours numbers; the value mappings name them)."""
    return {v: i for i, v in enumerate(_VERDICTS, 1)}


def numbered_verdicts(selector: str, by: str) -> str:
    """One series per `by` valued at its verdict's number, from a 0/1 series per limiter."""
    terms = [f"{selector.replace('LIMITER', _q(v))} * {n}" for v, n in verdict_numbers().items()]
    return f"max by ({by}) (\n  " + "\n  or ".join(terms) + "\n)"


def with_label_per_rule(expr: str, label: str, values: dict[str, str]) -> str:
    """`expr` with `label` set from its `rule` label: values[code] (anchors and plain text only)."""
    for code, value in values.items():
        if "$" in value:
            raise ValueError(f"{value!r}: a '$' would be read as a Grafana variable or a regex group")
        expr = f"label_replace({expr}, {_q(label)}, {_q(value)}, \"rule\", {_q(code)})"
    return expr


def first_sentence(text: str) -> str:
    """A page's first fix: its "How to fix it" up to the first sentence's end."""
    found = re.match(r"(.+?[.;:])(\s|$)", text.strip(), re.S)
    return " ".join((found.group(1) if found else text).split()).rstrip(".;:") + "."


# --- what a finding read, against its thresholds -------------------------------------------------------------------


@dataclass
class Compared:
    """A part of a rule's formula that it compares with thresholds: its PromQL and the thresholds' values."""

    rule: Rule
    title: str
    expr: str
    bars: dict[str, float] = field(default_factory=dict)


def describe(f: fm.Formula, has: Callable[[fm.Formula], bool] = lambda f: True) -> str:
    """A part of a formula in words, leaving out an alternative the fleet has no series for (`has`)."""
    if isinstance(f, fm.Read):
        return f"{f.name} {f.stat}"
    if isinstance(f, fm.Named | fm.Bar):
        return f.name
    if isinstance(f, fm.Const):
        return f"{f.x:g}"
    if isinstance(f, fm.Binary):
        if f.op == "or" and not (has(f.a) and has(f.b)):
            return describe(f.a if has(f.a) else f.b, has)
        return f"({describe(f.a, has)} {f.op} {describe(f.b, has)})"
    if isinstance(f, fm.Clamp):
        return f"clamp({describe(f.a, has)})"
    if isinstance(f, fm.Larger):
        if not (has(f.a) and has(f.b)):
            return describe(f.a if has(f.a) else f.b, has)
        return f"larger of {describe(f.a, has)}, {describe(f.b, has)}"
    return type(f).__name__.lower()


def _has(parts: PartCompiler, code: str) -> Callable[[fm.Formula], bool]:
    return lambda f: parts.promql(code, f) is not None


_COMPARISONS = (">=", ">", "<=", "<")


def compared(rules: RuleSet, parts: PartCompiler) -> Iterator[Compared]:
    """Each statistic (or part) a rule's formula compares with a threshold, once per rule, with every threshold it is
    compared with; a part the fleet has no series for (a trace's, the server's) is left out, as the group leaves it."""
    for rule in rules.rules:
        if rule.fleet is None or rule.code not in parts.findings:
            continue
        values = rules.thresholds(rule.code)
        found: dict[str, Compared] = {}
        for node in rule.fleet.walk():
            if not (isinstance(node, fm.Binary) and node.op in _COMPARISONS
                    and isinstance(node.b, fm.Bar | fm.Const)):
                continue
            left = node.a
            while isinstance(left, fm.Binary) and left.op in _COMPARISONS:  # a filter's value is its left side's
                left = left.a
            expr = parts.promql(rule.code, left)
            if expr is None:
                continue
            title = describe(left, _has(parts, rule.code))
            seen = found.setdefault(expr, Compared(rule, title, expr))
            bar = node.b
            name, value = (bar.name, values[bar.name]) if isinstance(bar, fm.Bar) else (f"{bar.x:g}", bar.x)
            seen.bars[name] = value
        yield from found.values()


# --- panels --------------------------------------------------------------------------------------------------------


@dataclass
class Target:
    expr: str
    legend: str = ""
    instant: bool = False
    table: bool = False

    def json(self, ref: str) -> dict[str, object]:
        out: dict[str, object] = {"refId": ref, "datasource": DATASOURCE, "expr": self.expr,
                                  "range": not self.instant, "instant": self.instant}
        if self.legend:
            out["legendFormat"] = self.legend
        if self.table:
            out["format"] = "table"
        return out


@dataclass
class Panel:
    kind: str
    title: str
    description: str
    targets: list[Target]
    width: int = 12
    height: int = 8
    unit: str = ""
    thresholds: dict[str, float] = field(default_factory=dict)
    mappings: list[dict[str, object]] = field(default_factory=list)
    overrides: list[dict[str, object]] = field(default_factory=list)
    options: dict[str, object] = field(default_factory=dict)
    transformations: list[dict[str, object]] = field(default_factory=list)
    minimum: float | None = None

    def json(self, pid: int, x: int, y: int) -> dict[str, object]:
        defaults: dict[str, object] = {"mappings": self.mappings}
        if self.unit:
            defaults["unit"] = self.unit
        if self.minimum is not None:
            defaults["min"] = self.minimum
        steps: list[dict[str, object]] = [{"color": "green", "value": None}]
        steps += [{"color": "red", "value": v} for v in sorted(set(self.thresholds.values()))]
        defaults["thresholds"] = {"mode": "absolute", "steps": steps}
        if self.kind == "timeseries":
            defaults["custom"] = {"thresholdsStyle": {"mode": "dashed" if self.thresholds else "off"},
                                  "drawStyle": "line", "lineWidth": 1, "fillOpacity": 0, "spanNulls": False}
        out: dict[str, object] = {
            "id": pid, "type": self.kind, "title": self.title, "description": self.description,
            "datasource": DATASOURCE, "gridPos": {"h": self.height, "w": self.width, "x": x, "y": y},
            "targets": [t.json(chr(ord("A") + i)) for i, t in enumerate(self.targets)],
            "fieldConfig": {"defaults": defaults, "overrides": self.overrides},
            "options": self.options,
        }
        if self.transformations:
            out["transformations"] = self.transformations
        return out


@dataclass
class Row:
    title: str
    source: str  # "fleet": the rule group's series; "agent": the agent's
    panels: list[Panel]


def _verdict_mappings() -> list[dict[str, object]]:
    options = {str(n): {"text": limiter_label(v), "color": verdict_color(v), "index": n - 1}
               for v, n in verdict_numbers().items()}
    return [{"type": "value", "options": options}]


def _limiter_overrides() -> list[dict[str, object]]:
    """Each verdict's series in its colour, named as every renderer names it (reports/labels.py)."""
    return [{"matcher": {"id": "byName", "options": v},
             "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": verdict_color(v)}},
                            {"id": "displayName", "value": limiter_label(v)}]}
            for v in _VERDICTS]


def _runbook_link(field_name: str) -> dict[str, object]:
    return {"matcher": {"id": "byName", "options": field_name},
            "properties": [{"id": "links", "value": [{"title": "The rule's page: why it matters, how to fix it",
                                                      "url": "${runbook}#${__value.raw}", "targetBlank": True}]}]}


def _hide(*names: str) -> dict[str, object]:
    return {"id": "organize", "options": {"excludeByName": dict.fromkeys(names, True)}}


_GPU_LEGEND = "{{UUID}}{{uuid}} {{GPU_I_ID}}"


def fleet_row(s: Series, rules: RuleSet) -> Row:
    k = KEY_LABELS
    named = [r for r in rules.rules if r.fleet is not None]  # the rules a limiter's series can name
    anchors = {r.code: runbook_anchor(r) for r in named}
    fixes = {r.code: first_sentence(r.page_for(rules.thresholds(r.code)).fixes) for r in named}
    whole = "|".join(_WHOLE)
    underfed = "|".join(_UNDERFED)
    stake = (f"{s.limiter}{{limiter=~{_q(whole)}}}\n"
             f"  or on ({k})\n"
             f"{s.limiter}{{limiter=~{_q(underfed)}}} * on ({k}) group_left clamp_min(1 - {s.busy}, 0)\n"
             f"  or on ({k})\n"
             f"{s.limiter} * 0")
    at_stake = with_label_per_rule(with_label_per_rule(
        s.with_identity(f"topk(20, {s.of_selected(stake)})"), "runbook", anchors), "first_fix", fixes)
    return Row("The fleet at a glance", "fleet", [
        Panel("timeseries", "GPUs per verdict",
              "How many of the selected GPUs each verdict names, over time: the rule group's primary limiter "
              f"({s.limiter}), chosen as the engine chooses it.",
              [Target(f"count by (limiter) ({s.of_selected(s.limiter)})", "{{limiter}}")],
              width=16, unit="none", overrides=_limiter_overrides(), minimum=0,
              options={"legend": {"displayMode": "table", "placement": "right", "calcs": ["lastNotNull"]},
                       "tooltip": {"mode": "multi", "sort": "desc"}}),
        Panel("bargauge", "The whole fleet now",
              f"GPUs per verdict as the rule group counts them ({s.count}), every shard added up; the variables do "
              "not narrow it.",
              [Target(f"sum by (limiter) ({s.count})", "{{limiter}}", instant=True)],
              width=8, unit="none", overrides=_limiter_overrides(), minimum=0,
              options={"orientation": "horizontal", "displayMode": "basic", "showUnfilled": True,
                       "reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False}}),
        Panel("table", "The most at stake, with their first fix",
              "The selected GPUs with the largest share of their price at stake (all of it for an idle GPU or one "
              "with errors, its idle share for an underfed one, as `diagnoser fleet` prices them; 0 where the "
              "fix's gain needs the model's physics, which `diagnoser fleet` adds), their verdict, the rule that "
              "named it, the first fix of that rule's page and a link to the page.",
              [Target(at_stake, instant=True, table=True)], width=24, height=9, unit="percentunit",
              overrides=[_runbook_link("runbook"),
                         {"matcher": {"id": "byName", "options": "Value"},
                          "properties": [{"id": "displayName", "value": "at stake"}]}],
              options={"showHeader": True, "sortBy": [{"displayName": "at stake", "desc": True}]},
              transformations=[_hide("Time", "__name__", "diagnoser_shard")]),
    ])


def gpu_row(s: Series, rules: RuleSet, parts: PartCompiler) -> Row:
    k = KEY_LABELS
    panels = [
        Panel("state-timeline", "Verdict",
              "The selected GPU's primary limiter over time, as the rule group chose it.",
              [Target(numbered_verdicts(s.of_selected(f"{s.limiter}{{limiter=LIMITER}}", gpu=True), k),
                      _GPU_LEGEND)],
              mappings=_verdict_mappings(),
              options={"showValue": "never", "mergeValues": True, "rowHeight": 0.8}),
        Panel("timeseries", "Findings' strength",
              "Each rule that fires on the selected GPU, at its strength (0..1): the primary limiter is the "
              "strongest, errors and a full memory first, and for a GPU busy under half the time what feeds it "
              "before its roofs.",
              [Target(s.of_selected(s.finding, gpu=True), "{{rule}} ({{limiter}}) " + _GPU_LEGEND)],
              unit="percentunit", minimum=0),
    ]
    for c in compared(rules, parts):
        bars = ", ".join(f"{name} = {value:g}" for name, value in c.bars.items())
        panels.append(Panel(
            "timeseries", f"{c.rule.code} {c.rule.name}: {c.title}",
            f"What rule {c.rule.code} compares with its thresholds in force ({bars}; dashed lines) on the selected "
            f"GPU, over each {s.w} window. {c.rule.summary}",
            [Target(s.of_selected(c.expr, gpu=True), _GPU_LEGEND)], width=8, thresholds=c.bars))
    return Row("One GPU's window: why the verdict fell where it did", "fleet", panels)


def agent_row() -> Row:
    """The agent's families; any rule can propose a target's first fix, so its page is linked by the list of
    codes (the dashboard does not change with every rule added)."""
    a = _Agent()
    who = "target, gpu, pod"
    pod = 'pod=~"$pod"'
    verdict = a("diagnoser_verdict")
    gain = a("diagnoser_top_fix_gain_ratio")
    return Row("The agent's view of each server", "agent", [
        Panel("state-timeline", "Verdict per server",
              f"Each target's verdict from the agent's runs ({verdict}).",
              [Target(numbered_verdicts(f"{verdict}{{limiter=LIMITER, {pod}}}", who), "{{target}} {{gpu}}")],
              width=24, mappings=_verdict_mappings(),
              options={"showValue": "never", "mergeValues": True, "rowHeight": 0.8}),
        Panel("table", "First fix and its predicted gain",
              f"The top-ranked fix of each target's newest verdict: the rule that proposed it, the predicted "
              f"throughput multiplier ({gain}); the rule's code links the rules' pages, listed by code at the "
              f"top.",
              [Target(f"{gain}{{{pod}}}", instant=True, table=True)], unit="x",
              overrides=[{"matcher": {"id": "byName", "options": "rule"},
                          "properties": [{"id": "links", "value": [{"title": "The rules' pages", "url": "${runbook}",
                                                                    "targetBlank": True}]}]},
                         {"matcher": {"id": "byName", "options": "Value"},
                          "properties": [{"id": "displayName", "value": "gain"}]}],
              transformations=[_hide("Time", "__name__", "job", "instance")]),
        Panel("timeseries", "Predicted gain of the first fix",
              f"The predicted throughput multiplier of each target's top fix ({gain}), over time.",
              [Target(f"{gain}{{{pod}}}", "{{target}} {{rule}}")], unit="x"),
        Panel("timeseries", "Confidence and efficiency",
              "The verdict's confidence (under 0.3 it is inconclusive) and the achieved tokens/s over the physical "
              "decode ceiling.",
              [Target(f"{a('diagnoser_confidence')}{{{pod}}}", "confidence {{target}}"),
               Target(f"{a('diagnoser_efficiency_ratio')}{{{pod}}}", "efficiency {{target}}")],
              unit="percentunit", minimum=0, thresholds={"inconclusive below": 0.3}),
        Panel("timeseries", "Scrape and run health",
              "Whether Prometheus reaches the agent (`up` of the job that scrapes it), whether each target's "
              "newest run produced a verdict, and the failed runs per kind over the interval.",
              [Target(f"up * on (job, instance) group_left max by (job, instance) ({a('diagnoser_agent')})",
                      "up {{instance}}"),
               Target(f"{a('diagnoser_last_run_ok')}{{{pod}}}", "last run ok {{target}}"),
               Target(f"sum by (target, kind) (increase({a('diagnoser_run_errors')}{{{pod}}}[$__rate_interval]))",
                      "{{kind}} {{target}}")], minimum=0),
        Panel("timeseries", "Since the last verdict and the last cycle",
              "Seconds since each target's newest run that produced a verdict, and since the agent's newest cycle: "
              "a line that keeps rising is an agent or a target that stopped.",
              [Target(f"time() - {a('diagnoser_last_success_timestamp_seconds')}{{{pod}}}", "{{target}}"),
               Target(f"time() - {a('diagnoser_agent_last_cycle_timestamp_seconds')}", "cycle {{instance}}")],
              unit="s", minimum=0),
        Panel("table", "Sources the newest run could not read",
              f"Per target, each source that was down or unreadable in its newest run "
              f"({a('diagnoser_source_unavailable')}): the verdict was made without it.",
              [Target(f"{a('diagnoser_source_unavailable')}{{{pod}}} == 1", instant=True, table=True)],
              transformations=[_hide("Time", "__name__", "Value", "job", "instance")]),
    ])


# --- the dashboard -------------------------------------------------------------------------------------------------


def _variables(s: Series, runbook_prefix: str) -> list[dict[str, object]]:
    def query(name: str, label: str, expr: str, regex: str = "") -> dict[str, object]:
        q = f"label_values({expr}, {label})" if not regex else f"query_result({expr})"
        return {"type": "query", "name": name, "label": label if not regex else name.capitalize(),
                "datasource": DATASOURCE, "query": {"query": q, "refId": f"{name}-variable"},
                "definition": q, "regex": regex, "refresh": 2, "sort": 1, "multi": True, "includeAll": True,
                "allValue": ".*", "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
                "options": [], "hide": 0}

    def labels_regex(labels: Iterable[str]) -> str:
        return "/[{,]\\s*(?:" + "|".join(labels) + ")=\"([^\"]+)\"/"

    k = KEY_LABELS
    identity = s.identity
    nodes = f"count by ({', '.join(_NODES)}) ({identity})"
    pods = f"count by ({', '.join(POD_LABELS)}) ({s.any_of(_NODES, '$node')})"
    gpus = (f"count by (UUID, uuid) ({identity} and on ({k}) {s.selected()})")
    return [
        {"type": "datasource", "name": "datasource", "label": "Data source", "query": "prometheus",
         "current": {}, "options": [], "refresh": 1, "regex": "", "hide": 0},
        {"type": "textbox", "name": "runbook", "label": "Runbook URL",
         "description": "Where the rules' pages are (docs/rules.md as your team serves it): each runbook link is this "
                        "URL and the rule's anchor.",
         "query": runbook_prefix, "current": {"text": runbook_prefix, "value": runbook_prefix},
         "options": [{"selected": True, "text": runbook_prefix, "value": runbook_prefix}], "hide": 0},
        query("node", "node", nodes, labels_regex(_NODES)),
        query("pod", "pod", pods, labels_regex(POD_LABELS)),
        query("model", "modelName", f'{identity}{{modelName!=""}}'),
        query("gpu", "gpu", gpus, labels_regex(("UUID", "uuid"))),
    ]


def _annotations(s: Series, interval: str) -> list[dict[str, object]]:
    k = KEY_LABELS
    changed = (f"{s.of_selected(s.limiter)}\n  unless on ({k}, limiter)\n"
               f"{s.limiter} offset {interval}")
    alerts = "|".join(name for name, _, _ in ALERTS.values())
    return [
        {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
         "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"},
        {"name": "Verdict changes", "datasource": DATASOURCE, "enable": True, "hide": False, "iconColor": "orange",
         "expr": changed, "step": interval, "titleFormat": "{{limiter}} ({{rule}})",
         "textFormat": "GPU {{UUID}}{{uuid}} {{GPU_I_ID}}: the verdict is now {{limiter}}",
         "tagKeys": "limiter,rule", "useValueForTime": False},
        {"name": "Firing alerts", "datasource": DATASOURCE, "enable": False, "hide": False, "iconColor": "red",
         "expr": f'ALERTS{{alertstate="firing", alertname=~{_q(alerts)}}}', "step": interval,
         "titleFormat": "{{alertname}}", "textFormat": "{{rule}} on GPU {{UUID}}{{uuid}}",
         "tagKeys": "alertname,severity,rule", "useValueForTime": False},
    ]


def _layout(rows: list[Row]) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    pid, y = 1, 0
    for row in rows:
        out.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y = pid + 1, y + 1
        x, height = 0, 0
        for panel in row.panels:
            if x + panel.width > 24:
                x, y, height = 0, y + height, 0
            out.append(panel.json(pid, x, y))
            pid, x, height = pid + 1, x + panel.width, max(height, panel.height)
        y += height
    return out


def rows(window_s: float, rules: RuleSet | None = None) -> list[Row]:
    ruleset = rules or default_rules()
    s = Series(window_s)
    parts = PartCompiler(window_s, ruleset)
    return [fleet_row(s, ruleset), gpu_row(s, ruleset, parts), agent_row()]


def dashboard(window_s: float = 3600, *, interval: str = "5m", rules: RuleSet | None = None,
              runbook_prefix: str = RUNBOOK_PREFIX) -> dict[str, object]:
    """The dashboard for the rule group of this window and evaluation interval (`diagnoser rules --prometheus-rules
    --window W --interval I`), with the thresholds in force in `rules`."""
    s = Series(window_s)
    return {
        "uid": UID if window_s == 3600 else f"{UID}-{s.w}",
        "title": TITLE if window_s == 3600 else f"{TITLE} ({s.w} windows)",
        "description": f"Generated by `diagnoser rules --grafana-dashboard` from the rule group over {s.w} windows "
                       "(`diagnoser rules --prometheus-rules`) and the agent's metrics.",
        "tags": ["diagnoser", "gpu", "dcgm"],
        "timezone": "browser", "editable": True, "graphTooltip": 1, "fiscalYearStartMonth": 0, "liveNow": False,
        "refresh": interval if re.match(r"^\d+[smh]$", interval) else "1m",
        "schemaVersion": SCHEMA_VERSION, "version": 1,
        "time": {"from": "now-6h", "to": "now"},
        "timepicker": {},
        "links": [],
        "templating": {"list": _variables(s, runbook_prefix)},
        "annotations": {"list": _annotations(s, interval)},
        "panels": _layout(rows(window_s, rules)),
    }


def dashboard_json(window_s: float = 3600, *, interval: str = "5m", rules: RuleSet | None = None,
                   runbook_prefix: str = RUNBOOK_PREFIX) -> str:
    """The dashboard as the file deploy/grafana/ holds (for the defaults): indented JSON, one newline at the end."""
    return json.dumps(dashboard(window_s, interval=interval, rules=rules, runbook_prefix=runbook_prefix),
                      indent=2, ensure_ascii=False) + "\n"


def grafana_dashboard_text(window: str, interval: str | None, rules: RuleSet | None = None, *,
                           runbook_prefix: str = RUNBOOK_PREFIX) -> str:
    """`diagnoser rules --grafana-dashboard`: the options checked as `--prometheus-rules` checks them (the dashboard
    reads that group's series), then the JSON."""
    from diagnoser.units import parse_duration

    prometheus_rules_text(window, interval, rules, runbook_prefix=runbook_prefix)  # the same refusals, one sentence
    window_s = parse_duration(window, "--window", positive=True)
    return dashboard_json(window_s, interval=interval or default_interval(window_s), rules=rules,
                          runbook_prefix=runbook_prefix)


__all__ = ["PATH", "REGENERATE", "SCHEMA_VERSION", "UID", "Compared", "Row", "Series", "agent_metrics", "compared",
           "dashboard", "dashboard_json", "first_sentence", "grafana_dashboard_text", "rows", "verdict_numbers"]
