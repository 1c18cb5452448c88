"""Prometheus rule groups that keep the fleet's per-GPU window statistics and limiter classification continuously
in Prometheus (or Thanos Ruler, Mimir's ruler, vmalert), with alerts for the limiters that call for action.

`diagnoser rules --prometheus-rules [--window 1h] [--shards N --shard-by LABEL]` prints them as YAML. Two groups
(per shard), which the engine evaluates side by side:

1. `diagnoser-gpu-<window>-statistics`, the passes over the samples: exactly the PromQL `diagnoser fleet` would ask ad
   hoc (collectors/prom_stats.py `stat_expr`), recorded as `gpu:dcgm_<field>:<stat>_<window>`, plus the GPUs'
   identity labels (`gpu:dcgm_identity:count_<window>`); when these exist for its window, `fleet` reads them (by
   name, one plain read each) instead of computing them.
2. `diagnoser-gpu-<window>`, arithmetic on what the statistics group recorded (no range over samples), compiled from
   the rules' formulas (`@rule(fleet=...)`, rules/formula.py): each leaf a formula reads is a recorded statistic or
   a per-GPU signal made from several (busy, memory used, the clock share with the spec table's maximum SM clock
   where DCGM_FI_DEV_MAX_SM_CLOCK is not exported, the throttled shares, errors, the regime), recorded once
   (`gpu:diagnoser_<signal>:<window>`), as is each part a formula names (`fm.Named`); then one recording rule per
   rule with a formula, valued at the rule's strength with the thresholds in force (a --rules-config's overrides
   included), its rule and limiter as the rule's labels: `gpu:diagnoser_finding:<window>{rule, limiter}`; the
   primary limiter, chosen as the engine chooses it (errors first, then strong VRAM findings, then, for a GPU busy
   under half the time, the strongest non-roof finding, else the strongest): `gpu:diagnoser_limiter:<window>`, a
   count per limiter, and alerts. A formula's leaf the fleet cannot give (a trace's share, the model's roofs, the
   server's queue) compiles to nothing, as PromQL's vector algebra reads an absent series.

One union of every finding's PromQL over the statistics, each relabelled per series, cost a Prometheus 40-64 s per
evaluation at 10,000 GPUs (benchmarks/FLEET.md); as recorded signals and one rule per finding it is arithmetic on a
few series per GPU. Sharded, each shard's groups take the DCGM series whose `--shard-by` label value ends in its
characters (`shards`) and label what they record with `diagnoser_shard`, which its findings read.

Not in PromQL: the engine's confidence (an edge case it calls inconclusive is classified here), and the rules
without a formula (those that need server metrics, a trace or the model's shape). tests/test_fleet_promrules.py
holds the classification equal to the Python engine's for every planted class, on a real Prometheus, in one group
and in shards; tests/test_rule_formula.py each formula equal to its rule's predicate.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from diagnoser import signals as S
from diagnoser.characterise import COUNTER_DRAM_MIN, COUNTER_TENSOR_BUSY, COUNTER_TENSOR_IDLE
from diagnoser.collectors.dcgm import (
    CLOCK_EVENT_POWER,
    CLOCK_EVENT_THERMAL,
    FIELDS_BY_KEY,
    NAMESPACE_LABELS,
    NODE_LABELS,
    POD_LABELS,
)
from diagnoser.collectors.dcgm_stats import FLEET_SIGNALS
from diagnoser.collectors.prom_stats import (
    FALLBACK,
    KEY_LABELS,
    STATS,
    Stat,
    duration,
    identity_expr,
    identity_record_name,
    record_name,
    stat_expr,
)
from diagnoser.collectors.prometheus_source import bits_expr
from diagnoser.diagnosis import Limiter, Regime
from diagnoser.errors import InputError
from diagnoser.rules import Rule, RuleSet, default_rules
from diagnoser.rules.formula import Formula, Named
from diagnoser.rules.load import BUSY

BOARD = "UUID, uuid"  # a MIG board's own series carry its device fields, without GPU_I_ID
# As the engine's choice reads them (rules/engine.py): a GPU busy under half the time with an underfed finding is
# limited by what feeds it, not by a roof or its kernels.
_ROOFS = (Limiter.MEMORY_BANDWIDTH.value, Limiter.COMPUTE.value, Limiter.LATENCY.value)
_UNDERFED = (Limiter.BATCHING.value, Limiter.HOST_LAUNCH.value, Limiter.IDLE.value)
# Limiters an alert is worth: the GPU is failing, held back, or paid for and underused. A saturated roof (bandwidth,
# compute) is the GPU doing its work: a finding for the fleet report, not a page.
ALERTS: dict[str, tuple[str, str, str]] = {
    Limiter.ERRORS.value: ("GpuErrors", "critical", "reports XID or uncorrectable ECC errors"),
    Limiter.THROTTLING.value: ("GpuThrottled", "warning", "is held below its maximum clock by power or heat"),
    Limiter.IDLE.value: ("GpuIdle", "warning", "is nearly idle: paid for and unused"),
    Limiter.BATCHING.value: ("GpuUnderfed", "info", "is underused: it waits for work more than it does it"),
    Limiter.LATENCY.value: ("GpuKernelBound", "info", "is busy far below its roofs: its kernels are the gap"),
    Limiter.VRAM.value: ("GpuMemoryFull", "info", "has its device memory nearly full"),
}

# Where an alert's runbook is: each rule's page in docs/rules.md (`diagnoser rules --markdown`), by the anchor of its
# heading; `--runbook-url-prefix` points the links at wherever the operator serves that page.
RUNBOOK_PREFIX = "docs/rules.md"
# The identity labels an alert carries beside its GPU's key: where the GPU is and what it serves, for the summary.
ALERT_LABELS = ("gpu", "modelName", *NODE_LABELS[:-1], *POD_LABELS, *NAMESPACE_LABELS)


def runbook_anchor(rule: Rule) -> str:
    """The anchor of a rule's heading in docs/rules.md (`## CODE name`), as GitHub and most Markdown renderers spell
    it: lower case, spaces as hyphens, other punctuation dropped."""
    return re.sub(r"[^a-z0-9 _-]", "", f"{rule.code} {rule.name}".lower()).replace(" ", "-")


def runbook_url(rule: Rule, prefix: str = RUNBOOK_PREFIX) -> str:
    return f"{prefix.rstrip('#')}#{runbook_anchor(rule)}"


def _names(field_key: str) -> list[str]:
    return list(FIELDS_BY_KEY[field_key].query_names)


def _limiter(rules: RuleSet, code: str) -> str:
    found = rules.get(code)
    assert found is not None, code
    return found.limiter.value


def spec_clock_expr(models: str, matchers: str = "") -> str:
    """Each GPU model's maximum SM clock from the spec table, by modelName as physics.match_gpu matches it: the same
    patterns in the same order (a model a pattern without a tabled clock claims gets none). `models` holds a series
    per model name (a handful, where the identities are one per GPU: the patterns' regexes are matched against the
    names, not against every GPU, which cost VictoriaMetrics 47 s at 100,000 GPUs); `matchers` a shard's own."""
    more = f", {matchers}" if matchers else ""
    from diagnoser.physics.gpus import _NVML_PATTERNS, GPUS

    terms: list[str] = []
    claimed: list[str] = []
    for pattern, keys in _NVML_PATTERNS:
        regex = "(?i).*" + pattern + ".*"
        clocks = {GPUS[k].max_sm_clock_mhz for k in keys}
        if len(clocks) == 1 and None not in clocks:
            # Both matchers in one selector: the engine reads only the models this pattern claims first.
            unclaimed = f", modelName!~{json.dumps('|'.join(claimed))}" if claimed else ""
            terms.append(f"max by (modelName) ({models}{{modelName=~{json.dumps(regex)}{unclaimed}{more}}}) * 0 + "
                         f"{next(iter(clocks)):g}")
        claimed.append(regex)
    return "\n  or\n".join(terms)


SHARD_LABEL = "diagnoser_shard"
# A shard takes the series whose label value ends in one of its characters: the digits and hex digits spread in turn
# (with 4 shards: 0 4 8 c, 1 5 9 d, 2 6 a e), the last shard everything the others do not take, so that every
# series, a value ending otherwise or no label at all included, is in exactly one shard.
_SHARD_CHARS = "0123456789abcdef"
MAX_SHARDS = 16
_LABEL_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Shard:
    """One shard of the rule groups: the DCGM series `matcher` selects ("" when the group is not sharded)."""

    index: int  # 1-based
    count: int
    matcher: str = ""

    @property
    def suffix(self) -> str:
        return "" if self.count == 1 else f"-shard-{self.index}-of-{self.count}"

    @property
    def labels(self) -> dict[str, str]:
        """What every series the shard records carries, so that its later rules read only its own."""
        return {} if self.count == 1 else {SHARD_LABEL: str(self.index)}


def shards(count: int = 1, label: str = "gpu") -> list[Shard]:
    """The shards of a group split `count` ways by the last character of `label`'s value."""
    if count == 1:
        return [Shard(1, 1)]
    sets = ["".join(c + c.upper() if c.isalpha() else c for c in _SHARD_CHARS[i::count]) for i in range(count - 1)]
    matchers = [f'{label}=~".*[{chars}]"' for chars in sets] + [f'{label}!~".*[{"".join(sets)}]"']
    return [Shard(i + 1, count, m) for i, m in enumerate(matchers)]


def statistics_rules(window_s: float, shard: Shard) -> list[dict[str, object]]:
    """The window statistics `fleet` reads, exactly the PromQL it would send (prom_stats.stat_expr), and the GPUs'
    identities: each one pass over the window's samples of the shard's GPUs."""
    m = shard.matcher
    out: list[dict[str, object]] = [
        {"record": identity_record_name(window_s), "expr": identity_expr(_names("fb_used"), window_s, m)}]
    for stat in STATS:
        if stat.field == "fb_total":
            expr = stat_expr(stat, _names("fb_used"), window_s, matchers=m, extra_names=_names("fb_free"))
        else:
            expr = stat_expr(stat, _names(stat.field), window_s, matchers=m)
        out.append({"record": record_name(stat, window_s), "expr": expr})
    out.append({"record": record_name(FALLBACK, window_s),
                "expr": stat_expr(FALLBACK, _names("gpu_util"), window_s, matchers=m,
                                  unless_names=_names("gr_engine_active"))})
    return _labelled(out, shard.labels)


def _labelled(rules: list[dict[str, object]], labels: Mapping[str, str]) -> list[dict[str, object]]:
    if labels:
        for rule in rules:
            rule["labels"] = {**labels, **rule.get("labels", {})}  # type: ignore[dict-item]
    return rules


def signal_name(name: str, window_s: float) -> str:
    """A per-GPU signal the findings group records once for every rule that reads it."""
    return f"gpu:diagnoser_{name}:{duration(window_s)}"


class _Read:
    """Selectors of the series a findings group reads: the statistics and signals its shard recorded."""

    def __init__(self, window_s: float, shard: Shard) -> None:
        self.window_s = window_s
        self.matchers = ", ".join(f'{k}="{v}"' for k, v in shard.labels.items())

    def of(self, name: str, *more: str) -> str:
        inner = ", ".join(m for m in (self.matchers, *more) if m)
        return f"{name}{{{inner}}}" if inner else name

    def stat(self, field: str, stat: str) -> str:
        return self.of(record_name(Stat(field, stat), self.window_s))

    def signal(self, name: str) -> str:
        return self.of(signal_name(name, self.window_s))


class _Compiler:
    """Compiles the rules' formulas (rules/formula.py) for one shard's findings group: each leaf a recorded
    statistic, or a per-GPU signal recorded once from them (the fleet's table, dcgm_stats.py, in PromQL); each named
    part recorded once; a leaf the fleet cannot give (a trace's, the model's) compiles to nothing."""

    key = KEY_LABELS

    def __init__(self, window_s: float, shard: Shard, ruleset: RuleSet) -> None:
        self.window_s, self.ruleset, self.r = window_s, ruleset, _Read(window_s, shard)
        self.code = ""  # the rule being compiled: whose thresholds
        self.recorded: dict[str, str] = {}  # name -> expression, in the order the group evaluates them
        # The named parts worth a series of their own: read by two findings or more. Recording one costs the engine
        # a series per GPU written every evaluation (at 10,000 GPUs each added a second or so of CPU a minute);
        # a part one finding reads is written out inside it.
        self.shared: set[str] = {"busy"}
        self._leaves = _leaves(self)

    def record(self, name: str, expr: str) -> str:
        """Record `expr` once under `name` (a signal's short name, or a series' full name); its selector."""
        if self.recorded.setdefault(name, expr) != expr:
            raise ValueError(f"two parts named {name} differ")
        return self.r.of(name) if ":" in name else self.r.signal(name)

    def read(self, name: str, stat: str) -> str | None:
        leaf = self._leaves.get((name, stat))
        if leaf is None:
            if name in FLEET_SIGNALS:
                raise ValueError(f"rule {self.code}'s formula reads {stat} of {name}, which the rule group does "
                                 "not compute (add it to fleet/promrules.py _leaves)")
            return None  # not a DCGM signal: the fleet has none
        return leaf()

    def present(self, name: str) -> str | None:
        return self.read(name, "mean") if name in FLEET_SIGNALS else None

    def regime(self, regimes: tuple[Regime, ...]) -> str | None:
        names = [{Regime.MEMORY: "memory_bound", Regime.COMPUTE: "compute_bound"}[r] for r in regimes]
        parts = [self._regime(n) for n in names]
        return f" or on ({self.key}) ".join(parts)

    def _regime(self, name: str) -> str:
        """The regime from the counters, as characterise reads it: DRAM used while the tensor pipes idle is
        memory-bound work, tensor pipes busier than DRAM compute-bound."""
        k, r = self.key, self.r
        tensor, dram = r.stat("tensor_active", "avg"), r.stat("dram_active", "avg")
        expr = (f"{dram} >= {COUNTER_DRAM_MIN:g} and on ({k}) {tensor} < {COUNTER_TENSOR_IDLE:g}"
                if name == "memory_bound" else
                f"{tensor} >= {COUNTER_TENSOR_BUSY:g} and on ({k}) {tensor} > on ({k}) {dram}")
        return self.record(name, expr)

    def threshold(self, name: str) -> str:
        return f"{self.ruleset.thresholds(self.code)[name]:g}"

    def named(self, name: str, formula: Formula) -> str | None:
        if name in self.recorded:
            return self.r.of(name) if ":" in name else self.r.signal(name)
        expr = formula.promql(self)
        if expr is None or _SELECTOR.match(expr) or name not in self.shared:
            return expr  # nothing to record: absent, a series read as it is, or read by one finding only
        return self.record(name, expr)

    def finding(self, code: str, formula: Formula) -> str | None:
        self.code = code
        return formula.promql(self)


_SELECTOR = re.compile(r"^[A-Za-z_:][A-Za-z0-9_:]*(\{[^{}]*\})?$")
Leaf = Callable[[], str]


def _leaves(q: _Compiler) -> dict[tuple[str, str], Leaf]:
    """Each (signal, statistic) the formulas read, as the fleet's table (collectors/dcgm_stats.py) makes it from the
    recorded statistics; a signal made of several statistics is recorded once when first read."""
    r, k = q.r, KEY_LABELS
    w = q.window_s
    spec_clock = f"gpu:dcgm_max_sm_clock:spec_{duration(w)}"

    def busy() -> str:  # gpu.busy: GR_ENGINE_ACTIVE, else GPU_UTIL
        return q.record("gpu_busy", f"{r.stat('gr_engine_active', 'avg')} or on ({k}) {r.stat('gpu_util', 'avg')} "
                                    "/ 100")

    def device(name: str, board_expr: str, record: bool = True) -> str:
        """A board-level value (clocks, throttling, errors) for each GPU or MIG instance that reports activity;
        recorded unless one finding alone reads it."""
        anchor = q.named("busy", BUSY)
        expr = f"{anchor} * 0 + on ({BOARD}) group_left max by ({BOARD}) ({board_expr})"
        return q.record(name, expr) if record else expr

    def clock() -> str:
        identity = r.of(identity_record_name(w))
        models = f"model:dcgm_gpus:count_{duration(w)}"  # a series per model name, read with the patterns' matchers
        q.record(models, f"count by (modelName) ({identity})")
        by_model = q.record(f"model:dcgm_max_sm_clock:spec_{duration(w)}", spec_clock_expr(models, r.matchers))
        # Each GPU's model's clock: one join on the model name (a board whose series name it two ways gets the
        # larger clock, one series a board as the clock share's join needs).
        spec = q.record(spec_clock, f"max by ({BOARD}) (max by ({BOARD}, modelName) ({identity}) * 0 + on (modelName) "
                                    f"group_left {by_model})")
        max_clock = f"(max by ({BOARD}) ({r.stat('max_sm_clock', 'last')}) or on ({BOARD}) {spec})"
        return device("clock_frac", f"max by ({BOARD}) ({r.stat('sm_clock', 'avg')}) / on ({BOARD}) {max_clock}")

    def xid() -> str:  # ERR001's alone
        return device("xid_errors", f"{r.stat('xid', 'max')} > bool 0", record=False)

    def ecc() -> str:
        return device("ecc_dbe", f"clamp_min({r.stat('ecc_dbe', 'increase')}, 0)", record=False)

    def held(reason: str) -> Leaf:
        return lambda: device(f"{reason}_held_frac", _held_expr(q, reason))

    return {
        (S.GPU_BUSY, "mean"): busy,
        (S.GPU_SM_ACTIVE, "mean"): lambda: r.stat("sm_active", "avg"),
        (S.GPU_TENSOR_ACTIVE, "mean"): lambda: r.stat("tensor_active", "avg"),
        (S.GPU_DRAM_ACTIVE, "mean"): lambda: r.stat("dram_active", "avg"),
        (S.GPU_MEM_USED_FRAC, "mean"): lambda: q.record(
            "mem_used_mean_frac", f"{r.stat('fb_used', 'avg')} / on ({k}) {r.stat('fb_total', 'last')}"),
        (S.GPU_MEM_USED_FRAC, "p90"): lambda: q.record(
            "mem_used_frac", f"{r.stat('fb_used', 'p90')} / on ({k}) {r.stat('fb_total', 'last')}"),
        (S.GPU_SM_CLOCK_FRAC, "mean"): clock,
        (S.GPU_THROTTLE_POWER, "frac_above:0.5"): held("power"),
        (S.GPU_THROTTLE_POWER, "mean"): held("power"),
        (S.GPU_THROTTLE_THERMAL, "frac_above:0.5"): held("thermal"),
        (S.GPU_THROTTLE_THERMAL, "mean"): held("thermal"),
        (S.GPU_XID_ERRORS, "max"): xid,
        (S.GPU_XID_ERRORS, "mean"): xid,
        (S.GPU_ECC_DBE, "max"): ecc,
        (S.GPU_ECC_DBE, "mean"): ecc,
    }


def _held_expr(q: _Compiler, reason: str) -> str:
    """The share of the window clocks were held by power or by heat: the violation counter's, else the clock-event
    bits' from the mask's minimum, maximum and mean (dcgm_stats.bit_shares: the time at the maximum is
    (mean - min) / (max - min), all of it when the mask held one value). Each part is recorded once: an engine's cost
    here is the series it reads, and the bits of a mask take one read per bit."""
    r, k = q.r, KEY_LABELS
    high, low, mean = (r.stat("reasons_power", s) for s in ("max", "min", "avg"))
    # Every operator between two vectors matches on the key: a shard's series carry its label, results do not.
    at_high = q.record("clock_events_high_share",
                       f"({mean} - on ({k}) {low}) / on ({k}) ({high} - on ({k}) {low} > 0) or on ({k}) "
                       f"({high} == on ({k}) {low}) * 0 + 1")
    counter, mask = {"power": ("power_violation", CLOCK_EVENT_POWER),
                     "thermal": ("thermal_violation", CLOCK_EVENT_THERMAL)}[reason]
    bits_high = q.record(f"{reason}_bits_at_max", bits_expr(high, mask))
    bits_low = q.record(f"{reason}_bits_at_min", bits_expr(low, mask))
    return (f"clamp({r.stat(counter, 'rate')} / 1e9, 0, 1) or on ({k}) ({bits_low} * on ({k}) (1 - {at_high}) "
            f"+ on ({k}) {bits_high} * on ({k}) {at_high})")


def finding_exprs(window_s: float, shard: Shard, ruleset: RuleSet) -> tuple[dict[str, str], dict[str, str]]:
    """Each rule's PromQL, compiled from its formula (`@rule(fleet=...)`): the series of the GPUs where it fires,
    valued at its strength; and the parts they read, recorded once (name -> expression, in order)."""
    q, found = _compiled(window_s, shard, ruleset)
    return found, q.recorded


def _compiled(window_s: float, shard: Shard, ruleset: RuleSet) -> tuple[_Compiler, dict[str, str]]:
    q = _Compiler(window_s, shard, ruleset)
    readers = Counter(name for rule in ruleset.rules if rule.fleet is not None
                      for name in {f.name for f in rule.fleet.walk() if isinstance(f, Named)})
    q.shared |= {name for name, n in readers.items() if n > 1}
    q.named("busy", BUSY)  # the engine's choice reads it, and board-level values are given to the GPUs it names
    found: dict[str, str] = {}
    for rule in ruleset.rules:
        if rule.fleet is not None:
            expr = q.finding(rule.code, rule.fleet)
            if expr is not None:
                found[rule.code] = expr
    return q, found


class PartCompiler:
    """A part of a rule's formula (a statistic it compares with a threshold, say) in PromQL over the series the
    unsharded findings group records, for a dashboard to plot what a finding read: compiled by the same compiler, after
    every finding, so a part reads only what the group records (one that would need a series of its own is refused)."""

    def __init__(self, window_s: float, ruleset: RuleSet) -> None:
        self._q, self.findings = _compiled(window_s, Shard(1, 1), ruleset)
        self.recorded = dict(self._q.recorded)

    def promql(self, code: str, part: Formula) -> str | None:
        self._q.code = code
        expr = part.promql(self._q)
        if self._q.recorded != self.recorded:
            raise ValueError(f"a part of rule {code}'s formula reads a series the rule group does not record")
        return expr


def finding_promql(code: str, ruleset: RuleSet, window_s: float = 3600) -> str | None:
    """One rule's finding as the unsharded rule group records it (None: the rule has no formula, or its formula
    reads nothing the fleet has): what `diagnoser rules CODE` shows."""
    return finding_exprs(window_s, Shard(1, 1), ruleset)[0].get(code)


def findings_rules(window_s: float, shard: Shard, ruleset: RuleSet, runbook_prefix: str = RUNBOOK_PREFIX
                   ) -> list[dict[str, object]]:
    """The parts the findings read, one recording rule per finding (its rule and limiter as the rule's labels), the
    primary limiter, the count per limiter and the alerts: every rule reads recorded series only."""
    w = duration(window_s)
    r = _Read(window_s, shard)
    exprs, parts = finding_exprs(window_s, shard, ruleset)
    out = _labelled([{"record": name if ":" in name else signal_name(name, window_s), "expr": expr}
                     for name, expr in parts.items()], shard.labels)
    finding = f"gpu:diagnoser_finding:{w}"
    out += _labelled([{"record": finding, "expr": expr, "labels": {"rule": code, "limiter": _limiter(ruleset, code)}}
                      for code, expr in exprs.items()], shard.labels)
    not_roofs = "|".join(_ROOFS)
    underfed = "|".join(_UNDERFED)
    k = KEY_LABELS
    # As the engine chooses (rules/engine.py): errors, strong VRAM findings, then for a GPU busy under half the time
    # the strongest finding that is not a roof when one says it is underfed, else the strongest.
    primary = (
        f'topk by ({k}) (1, {r.of(finding, f"limiter={json.dumps(Limiter.ERRORS.value)}")} >= 0.9)\n'
        f'  or on ({k})\n'
        f'topk by ({k}) (1, {r.of(finding, f"limiter={json.dumps(Limiter.VRAM.value)}")} >= 0.6)\n'
        f'  or on ({k})\n'
        f'(topk by ({k}) (1, {r.of(finding, f"limiter!~{json.dumps(not_roofs)}")}) and on ({k}) '
        f'{r.signal("busy")} < 0.5 and on ({k}) {r.of(finding, f"limiter=~{json.dumps(underfed)}")})\n'
        f'  or on ({k})\n'
        f'topk by ({k}) (1, {r.of(finding)})')
    limiter = f"gpu:diagnoser_limiter:{w}"
    out += _labelled([{"record": limiter, "expr": f"({primary}) * 0 + 1"},
                      {"record": f"limiter:diagnoser_gpus:count_{w}",
                       "expr": f"count by (limiter) ({r.of(limiter)})"}], shard.labels)
    out += _alerts(window_s, limiter, finding, r, shard, ruleset, list(exprs), runbook_prefix)
    return out


def _alerts(window_s: float, limiter: str, finding: str, r: _Read, shard: Shard, ruleset: RuleSet,
            codes: list[str], runbook_prefix: str) -> list[dict[str, object]]:
    """One alert per limiter worth one, valued at the strength of the finding that named it, with the GPU's identity
    labels (node, pod, model) for the summary; its runbook is that rule's page."""
    out: list[dict[str, object]] = []
    k, w = KEY_LABELS, duration(window_s)
    identity = f"(topk by ({k}) (1, {r.of(identity_record_name(window_s))}) * 0 + 1)"
    uuid = "{{ or $labels.UUID $labels.uuid }}{{ with $labels.GPU_I_ID }} (MIG instance {{ . }}){{ end }}"
    where = ("{{ with or $labels.Hostname $labels.hostname $labels.node $labels.kubernetes_node }} on {{ . }}{{ end }}"
             "{{ with or $labels.exported_pod $labels.pod $labels.pod_name }} (pod {{ . }}){{ end }}")
    for value, (name, severity, what) in ALERTS.items():
        named = [rule for rule in (ruleset.get(code) for code in codes) if rule is not None
                 and rule.limiter.value == value]
        if not named:
            continue  # no rule of the group names this limiter
        expr = (f"({r.of(finding)} and on ({k}, rule) {r.of(limiter, f'limiter={json.dumps(value)}')})"
                f"\n  * on ({k}) group_left ({', '.join(ALERT_LABELS)})\n{identity}")
        out.append({
            "alert": name, "expr": expr, "for": w,
            "labels": {"severity": severity, **shard.labels},
            "annotations": {
                "summary": f"GPU {uuid}{where} {what} ({{{{ $labels.rule }}}}, over {w})",
                "description": ("{{ with $labels.modelName }}A {{ . }}: {{ end }}"
                                + _by_rule({rule.code: rule.summary for rule in named})
                                + " The finding's strength is {{ $value | printf \"%.2f\" }}. Diagnose it: "
                                  "diagnoser dcgm --prometheus <this Prometheus> --uuid "
                                  f"{{{{ or $labels.UUID $labels.uuid }}}} --since {w}; the fleet: diagnoser fleet "
                                  f"--since {w}. The rule's page says why it matters and how to fix it."),
                "runbook_url": _by_rule({rule.code: runbook_url(rule, runbook_prefix) for rule in named}),
            },
        })
    return out


def _by_rule(values: Mapping[str, str]) -> str:
    """A Go template that is the value of the alert's rule (the first rule's when the label names none of them)."""
    if len(values) == 1:
        return next(iter(values.values()))
    items = list(values.items())
    text = "".join(f"{{{{ {'if' if i == 0 else 'else if'} eq $labels.rule {json.dumps(code)} }}}}{value}"
                   for i, (code, value) in enumerate(items[1:]))
    return text + f"{{{{ else }}}}{items[0][1]}{{{{ end }}}}"


@dataclass(frozen=True)
class Group:
    name: str
    interval: str
    rules: list[dict[str, object]]


def build_groups(window_s: float, *, interval: str = "1m", rules: RuleSet | None = None, shard_count: int = 1,
                 shard_by: str = "gpu", runbook_prefix: str = RUNBOOK_PREFIX) -> list[Group]:
    """The rule groups, with the thresholds in force in `rules` (the shipped ones by default): for each shard a
    statistics group (the passes over the samples) and a findings group (arithmetic on what the statistics group
    recorded), which the engine evaluates side by side."""
    ruleset = rules or default_rules()
    w = duration(window_s)
    groups: list[Group] = []
    for shard in shards(shard_count, shard_by):
        groups.append(Group(f"diagnoser-gpu-{w}-statistics{shard.suffix}", interval, statistics_rules(window_s, shard)))
        groups.append(Group(f"diagnoser-gpu-{w}{shard.suffix}", interval,
                            findings_rules(window_s, shard, ruleset, runbook_prefix)))
    return groups


def build_rules(window_s: float, *, rules: RuleSet | None = None) -> list[dict[str, object]]:
    """Every rule of the unsharded groups, statistics first."""
    return [rule for g in build_groups(window_s, rules=rules) for rule in g.rules]


def rule_group_yaml(window_s: float, *, interval: str = "1m", rules: RuleSet | None = None, shard_count: int = 1,
                    shard_by: str = "gpu", runbook_prefix: str = RUNBOOK_PREFIX) -> str:
    """The rule groups as a Prometheus rule file (YAML; strings JSON-quoted, expressions as literal blocks)."""
    w = duration(window_s)
    lines = ["# diagnoser: per-GPU window statistics, findings and limiters over " + w + " windows (generated by",
             "# `diagnoser rules --prometheus-rules`). Load it into Prometheus (rule_files), Thanos Ruler, Mimir's",
             "# ruler or vmalert. `diagnoser fleet --since " + w + "` reads the recorded statistics when present.",
             "groups:"]
    for group in build_groups(window_s, interval=interval, rules=rules, shard_count=shard_count, shard_by=shard_by,
                              runbook_prefix=runbook_prefix):
        lines += [f"  - name: {json.dumps(group.name)}", f"    interval: {group.interval}", "    rules:"]
        lines += [line for rule in group.rules for line in _rule_yaml(rule)]
    return "\n".join(lines) + "\n"


def _rule_yaml(rule: Mapping[str, object]) -> list[str]:
    key = "record" if "record" in rule else "alert"
    lines = [f"      - {key}: {json.dumps(rule[key])}", "        expr: |-"]
    lines.extend("          " + line for line in str(rule["expr"]).splitlines())
    if "for" in rule:
        lines.append(f"        for: {rule['for']}")
    for section in ("labels", "annotations"):
        values = rule.get(section)
        if isinstance(values, Mapping):
            lines.append(f"        {section}:")
            lines.extend(f"          {k}: {json.dumps(v)}" for k, v in values.items())
    return lines


_VALID_INTERVAL = re.compile(r"^\d+(ms|s|m|h|d)$")


# A window's statistics move little between evaluations a twelfth of it apart, and each evaluation reads every
# GPU's samples of the whole window: evaluating a 1 h window every minute cost a loaded two-core Prometheus a quarter
# to a third of each minute at 10,000 GPUs (benchmarks/FLEET.md), every 5 minutes a twentieth.
EVALUATIONS_PER_WINDOW = 12


def default_interval(window_s: float) -> str:
    """The evaluation interval for a window: a twelfth of it, in whole minutes from a minute up (1 h: 5m), else in
    whole seconds, at least 10 s."""
    every = window_s / EVALUATIONS_PER_WINDOW
    return f"{int(every // 60)}m" if every >= 60 else f"{max(10, int(every))}s"


def prometheus_rules_text(window: str, interval: str | None, rules: RuleSet | None = None, *, shard_count: int = 1,
                          shard_by: str = "gpu", runbook_prefix: str = RUNBOOK_PREFIX) -> str:
    """`diagnoser rules --prometheus-rules`: the options checked, then the YAML with the thresholds in force;
    `interval` None: the window's default."""
    from diagnoser.units import parse_duration

    if interval is None:
        interval = default_interval(parse_duration(window, "--window", positive=True))
    if not _VALID_INTERVAL.match(interval):
        raise InputError(f"--interval wants a Prometheus duration such as 30s or 1m, not '{interval}'.")
    window_s = parse_duration(window, "--window", positive=True)
    if window_s < 2 * parse_duration(interval, "--interval", positive=True):
        raise InputError("--window must hold at least two evaluation intervals.")
    if not 1 <= shard_count <= MAX_SHARDS:
        raise InputError(f"--shards wants a number from 1 to {MAX_SHARDS}, not {shard_count}.")
    if not _LABEL_NAME.match(shard_by):
        raise InputError(f"--shard-by wants a label name such as gpu or Hostname, not '{shard_by}'.")
    check_runbook_prefix(runbook_prefix)
    return rule_group_yaml(window_s, interval=interval, rules=rules, shard_count=shard_count, shard_by=shard_by,
                           runbook_prefix=runbook_prefix)


def check_runbook_prefix(prefix: str) -> None:
    """A prefix goes into YAML and Go templates as it is: no spaces, quotes, braces or fragment of its own."""
    if not prefix or re.search(r"[\s\"'{}#<>`\\]", prefix):
        raise InputError(f"--runbook-url-prefix wants the URL of docs/rules.md (no spaces, quotes, braces or '#'), "
                         f"not {prefix!r}.")


__all__ = ["ALERTS", "ALERT_LABELS", "EVALUATIONS_PER_WINDOW", "MAX_SHARDS", "RUNBOOK_PREFIX", "SHARD_LABEL", "Group",
           "PartCompiler", "Shard", "build_groups", "build_rules", "check_runbook_prefix", "default_interval",
           "finding_promql", "prometheus_rules_text", "rule_group_yaml", "runbook_anchor", "runbook_url", "shards",
           "spec_clock_expr"]
