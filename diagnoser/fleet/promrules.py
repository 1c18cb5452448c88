"""Prometheus rule groups that keep the fleet's per-GPU window statistics and limiter classification continuously
in Prometheus (or Thanos Ruler, Mimir's ruler, vmalert), with alerts for the limiters that call for action.

`diagnoser rules --prometheus-rules [--window 1h] [--shards N --shard-by LABEL]` prints them as YAML. Two groups
(per shard), which the engine evaluates side by side:

1. `diagnoser-gpu-<window>-statistics`, the passes over the samples: exactly the PromQL `diagnoser fleet` would ask ad
   hoc (collectors/prom_stats.py `stat_expr`), recorded as `gpu:dcgm_<field>:<stat>_<window>`, plus the GPUs'
   identity labels (`gpu:dcgm_identity:count_<window>`); when these exist for its window, `fleet` reads them (by
   name, one plain read each) instead of computing them.
2. `diagnoser-gpu-<window>`, arithmetic on what the statistics group recorded (no range over samples): the spec
   table's maximum SM clock where DCGM_FI_DEV_MAX_SM_CLOCK is not exported; the per-GPU signals several rules read,
   each recorded once (`gpu:diagnoser_<signal>:<window>`: busy, memory used, clocks, throttling, errors, the
   regime); one recording rule per finding, for the rules that DCGM counters alone decide (ERR001, VRAM003, IDLE001,
   BAT003, BW001, CMP001, LAT001, LAT002, THR001), valued at the rule's strength with the same thresholds as the
   Python rules (and a --rules-config's overrides), its rule and limiter as the rule's labels:
   `gpu:diagnoser_finding:<window>{rule, limiter}`; the primary limiter, chosen as the engine chooses it (errors
   first, then strong VRAM findings, then, for a GPU busy under half the time, the strongest non-roof finding, else
   the strongest): `gpu:diagnoser_limiter:<window>`, a count per limiter, and alerts.

One union of every finding's PromQL over the statistics, each relabelled per series, cost a Prometheus 40-64 s per
evaluation at 10,000 GPUs (benchmarks/FLEET.md); as recorded signals and one rule per finding it is arithmetic on a
few series per GPU. Sharded, each shard's groups take the DCGM series whose `--shard-by` label value ends in its
characters (`shards`) and label what they record with `diagnoser_shard`, which its findings read.

Not in PromQL: the engine's confidence (an edge case it calls inconclusive is classified here), and the rules that
need server metrics, a trace or the model's shape. tests/test_fleet_promrules.py holds the classification equal to
the Python engine's for every planted class, on a real Prometheus, in one group and in shards.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass

from diagnoser.characterise import COUNTER_DRAM_MIN, COUNTER_TENSOR_BUSY, COUNTER_TENSOR_IDLE
from diagnoser.collectors.dcgm import CLOCK_EVENT_POWER, CLOCK_EVENT_THERMAL, FIELDS_BY_KEY
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
from diagnoser.diagnosis import Limiter
from diagnoser.errors import InputError
from diagnoser.rules import RuleSet, default_rules

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


def _names(field_key: str) -> list[str]:
    return list(FIELDS_BY_KEY[field_key].query_names)


def _limiter(rules: RuleSet, code: str) -> str:
    found = rules.get(code)
    assert found is not None, code
    return found.limiter.value


def spec_clock_expr(identity: str, matchers: str = "") -> str:
    """Each GPU's maximum SM clock from the spec table, matched on its modelName as physics.match_gpu matches it:
    the same patterns in the same order (a GPU a pattern without a tabled clock claims gets none). `matchers`
    narrow the identities read (a shard's own)."""
    more = f", {matchers}" if matchers else ""
    from diagnoser.physics.gpus import _NVML_PATTERNS, GPUS

    terms: list[str] = []
    claimed: list[str] = []
    for pattern, keys in _NVML_PATTERNS:
        regex = "(?i).*" + pattern + ".*"
        clocks = {GPUS[k].max_sm_clock_mhz for k in keys}
        if len(clocks) == 1 and None not in clocks:
            # Both matchers in one selector: the engine reads only the GPUs this pattern claims first.
            unclaimed = f", modelName!~{json.dumps('|'.join(claimed))}" if claimed else ""
            terms.append(f"max by ({BOARD}) ({identity}{{modelName=~{json.dumps(regex)}{unclaimed}{more}}}) * 0 + "
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


def signal_rules(window_s: float, shard: Shard) -> list[dict[str, object]]:
    """Per-GPU signals several findings read (busy, memory used, clocks, throttling, errors, the regime), each
    computed once from the recorded statistics, so that a finding is a comparison of one or two series."""
    r = _Read(window_s, shard)
    k = KEY_LABELS
    sm, tensor, dram = r.stat("sm_active", "avg"), r.stat("tensor_active", "avg"), r.stat("dram_active", "avg")
    spec_clock = f"gpu:dcgm_max_sm_clock:spec_{duration(window_s)}"
    busy = r.signal("busy")

    def device(board_expr: str) -> str:
        """A board-level value (clocks, throttling, errors) for each GPU or MIG instance that reports activity."""
        return f"{busy} * 0 + on ({BOARD}) group_left max by ({BOARD}) ({board_expr})"

    max_clock = f"(max by ({BOARD}) ({r.stat('max_sm_clock', 'last')}) or on ({BOARD}) {r.of(spec_clock)})"
    power, thermal = r.signal("power_held_frac"), r.signal("thermal_held_frac")
    # The larger of the two shares: power's where it is at least thermal's, else thermal's, else whichever exists.
    throttled = f"({power} >= on ({k}) {thermal}) or on ({k}) {thermal} or on ({k}) {power}"
    xid, ecc = r.stat("xid", "max"), r.stat("ecc_dbe", "increase")
    errors = f"({xid} >= on ({k}) {ecc}) or on ({k}) {ecc} or on ({k}) {xid}"  # the larger, or the one there is
    rules: list[dict[str, object]] = [
        {"record": spec_clock, "expr": spec_clock_expr(identity_record_name(window_s), r.matchers)},
        # gpu.busy (GR_ENGINE_ACTIVE, else GPU_UTIL); the load rules and the engine's choice fall back to SM activity
        {"record": signal_name("gpu_busy", window_s),
         "expr": f"{r.stat('gr_engine_active', 'avg')} or on ({k}) {r.stat('gpu_util', 'avg')} / 100"},
        {"record": signal_name("busy", window_s), "expr": f"{r.signal('gpu_busy')} or on ({k}) {sm}"},
        {"record": signal_name("mem_used_frac", window_s),
         "expr": f"{r.stat('fb_used', 'p90')} / on ({k}) {r.stat('fb_total', 'last')}"},
        {"record": signal_name("clock_frac", window_s),
         "expr": device(f"max by ({BOARD}) ({r.stat('sm_clock', 'avg')}) / on ({BOARD}) {max_clock}")},
        *_held_rules(r, window_s),
        {"record": signal_name("throttled_frac", window_s), "expr": device(throttled)},
        {"record": signal_name("errors", window_s), "expr": device(errors)},
        # The regime from the counters, as characterise reads it: DRAM used while the tensor pipes idle is
        # memory-bound work, tensor pipes busier than DRAM compute-bound.
        {"record": signal_name("memory_bound", window_s),
         "expr": f"{dram} >= {COUNTER_DRAM_MIN:g} and on ({k}) {tensor} < {COUNTER_TENSOR_IDLE:g}"},
        {"record": signal_name("compute_bound", window_s),
         "expr": f"{tensor} >= {COUNTER_TENSOR_BUSY:g} and on ({k}) {tensor} > on ({k}) {dram}"},
    ]
    return _labelled(rules, shard.labels)


def _held_rules(r: _Read, window_s: float) -> list[dict[str, object]]:
    """The share of the window clocks were held by power and by heat: the violation counter's, else the clock-event
    bits' from the mask's minimum, maximum and mean (prom_stats.bit_shares: the time at the maximum is
    (mean - min) / (max - min), all of it when the mask held one value). Each part is recorded once: an engine's cost
    here is the series it reads, and the bits of a mask take one read per bit."""
    k = KEY_LABELS
    high, low, mean = (r.stat("reasons_power", s) for s in ("max", "min", "avg"))
    at_high = r.signal("clock_events_high_share")
    # Every operator between two vectors matches on the key: a shard's series carry its label, results do not.
    rules: list[dict[str, object]] = [{
        "record": signal_name("clock_events_high_share", window_s),
        "expr": f"({mean} - on ({k}) {low}) / on ({k}) ({high} - on ({k}) {low} > 0) or on ({k}) "
                f"({high} == on ({k}) {low}) * 0 + 1"}]
    for reason, counter, mask in (("power", "power_violation", CLOCK_EVENT_POWER),
                                  ("thermal", "thermal_violation", CLOCK_EVENT_THERMAL)):
        bits_high, bits_low = r.signal(f"{reason}_bits_at_max"), r.signal(f"{reason}_bits_at_min")
        rules += [
            {"record": signal_name(f"{reason}_bits_at_max", window_s), "expr": bits_expr(high, mask)},
            {"record": signal_name(f"{reason}_bits_at_min", window_s), "expr": bits_expr(low, mask)},
            {"record": signal_name(f"{reason}_held_frac", window_s),
             "expr": f"clamp({r.stat(counter, 'rate')} / 1e9, 0, 1) or on ({k}) ({bits_low} * on ({k}) "
                     f"(1 - {at_high}) + on ({k}) {bits_high} * on ({k}) {at_high})"},
        ]
    return rules


def finding_exprs(window_s: float, shard: Shard, ruleset: RuleSet) -> dict[str, str]:
    """Each rule's PromQL: the series of the GPUs where it fires, valued at its strength."""

    def t(code: str, name: str) -> str:
        return f"{ruleset.thresholds(code)[name]:g}"

    r = _Read(window_s, shard)
    k = KEY_LABELS
    sm, tensor, dram = r.stat("sm_active", "avg"), r.stat("tensor_active", "avg"), r.stat("dram_active", "avg")
    gpu_busy, busy = r.signal("gpu_busy"), r.signal("busy")
    return {
        "ERR001": f"({r.signal('errors')} > {t('ERR001', 'errors')}) * 0 + 0.95",
        "VRAM003": f"({r.signal('mem_used_frac')} >= {t('VRAM003', 'mem_used_p90')}) * 0 + 0.4",
        "IDLE001": f"({busy} < {t('IDLE001', 'busy_mean')}) * 0 + 0.65",
        "BAT003": f"({busy} >= {t('BAT003', 'idle_below')} < {t('BAT003', 'busy_mean')}) * 0 + 0.5",
        "BW001": (f"0.6 + clamp_max((({dram} >= {t('BW001', 'dram_active_mean')} unless on ({k}) "
                  f"({dram} - on ({k}) {tensor} < {t('BW001', 'split')})) - {t('BW001', 'dram_active_mean')}) "
                  "* 1.5, 0.3)"),
        "CMP001": _compute_finding(ruleset, r),
        "LAT001": _kernel_bound(ruleset, r),
        "LAT002": (f"({gpu_busy} >= {t('LAT002', 'busy_min')} unless on ({k}) {dram} unless on ({k}) {sm} "
                   f"unless on ({k}) {tensor}) * 0 + 0.45"),
        "THR001": (f"0.5 + clamp_max(({t('THR001', 'clock_frac_mean')} - ({r.signal('clock_frac')} < "
                   f"{t('THR001', 'clock_frac_mean')} and on ({k}) ({r.signal('throttled_frac')} >= "
                   f"{t('THR001', 'throttled_frac')}) unless on ({k}) ({gpu_busy} < 0.3))) * 2, 0.4)"),
    }


def findings_rules(window_s: float, shard: Shard, ruleset: RuleSet) -> list[dict[str, object]]:
    """The signals, one recording rule per finding (its rule and limiter as the rule's labels), the primary limiter,
    the count per limiter and the alerts: every rule reads recorded series only."""
    w = duration(window_s)
    r = _Read(window_s, shard)
    out = signal_rules(window_s, shard)
    finding = f"gpu:diagnoser_finding:{w}"
    out += _labelled([{"record": finding, "expr": expr, "labels": {"rule": code, "limiter": _limiter(ruleset, code)}}
                      for code, expr in finding_exprs(window_s, shard, ruleset).items()], shard.labels)
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
    out += _alerts(w, limiter, r, shard)
    return out


def _alerts(w: str, limiter: str, r: _Read, shard: Shard) -> list[dict[str, object]]:
    out: list[dict[str, object]] = []
    for value, (name, severity, what) in ALERTS.items():
        out.append({
            "alert": name, "expr": r.of(limiter, f"limiter={json.dumps(value)}"), "for": w,
            "labels": {"severity": severity, **shard.labels},
            "annotations": {
                "summary": f"GPU {{{{ $labels.UUID }}}}{{{{ $labels.uuid }}}} {what} ({{{{ $labels.rule }}}}, "
                           f"over {w})",
                "description": "Diagnose it: diagnoser dcgm --prometheus <this Prometheus> --uuid "
                               "{{ $labels.UUID }}{{ $labels.uuid }} --since " + w
                               + "; the fleet: diagnoser fleet --since " + w + ".",
            },
        })
    return out


@dataclass(frozen=True)
class Group:
    name: str
    interval: str
    rules: list[dict[str, object]]


def build_groups(window_s: float, *, interval: str = "1m", rules: RuleSet | None = None, shard_count: int = 1,
                 shard_by: str = "gpu") -> list[Group]:
    """The rule groups, with the thresholds in force in `rules` (the shipped ones by default): for each shard a
    statistics group (the passes over the samples) and a findings group (arithmetic on what the statistics group
    recorded), which the engine evaluates side by side."""
    ruleset = rules or default_rules()
    w = duration(window_s)
    groups: list[Group] = []
    for shard in shards(shard_count, shard_by):
        groups.append(Group(f"diagnoser-gpu-{w}-statistics{shard.suffix}", interval, statistics_rules(window_s, shard)))
        groups.append(Group(f"diagnoser-gpu-{w}{shard.suffix}", interval, findings_rules(window_s, shard, ruleset)))
    return groups


def build_rules(window_s: float, *, rules: RuleSet | None = None) -> list[dict[str, object]]:
    """Every rule of the unsharded groups, statistics first."""
    return [rule for g in build_groups(window_s, rules=rules) for rule in g.rules]


def _compute_finding(rules: RuleSet, r: _Read) -> str:
    """CMP001: the tensor pipes at their roof, or the SMs in compute-bound work, clearly busier than DRAM; stronger
    the more signals say so and the higher the busiest."""
    th = rules.thresholds("CMP001")
    k = KEY_LABELS
    sm, tensor, dram = r.stat("sm_active", "avg"), r.stat("tensor_active", "avg"), r.stat("dram_active", "avg")
    by_tensor = f"({tensor} >= {th['tensor_active_mean']:g})"
    by_sm = f"({sm} >= {th['sm_active_mean']:g} and on ({k}) {r.signal('compute_bound')})"
    # The busiest signal that says so, and how many say so, without a label per signal.
    top_hit = f"(({by_tensor} >= on ({k}) {by_sm}) or on ({k}) {by_sm} or on ({k}) {by_tensor})"
    count = (f"(({by_tensor} * 0 + 1) + on ({k}) ({by_sm} * 0 + 1) or on ({k}) {by_tensor} * 0 + 1 "
             f"or on ({k}) {by_sm} * 0 + 1)")
    top = f"({top_hit} unless on ({k}) ({top_hit} - on ({k}) {dram} < {th['split']:g}))"
    return f"0.6 + clamp_max(0.1 * {count} + on ({k}) ({top} - 0.6) * 0.5, 0.3)"


def _kernel_bound(rules: RuleSet, r: _Read) -> str:
    """LAT001: busy, with HBM, the tensor pipes and the SMs all under their roofs; stronger the further below the
    roof of its regime (or the closer of the two where the counters name none) the work runs."""
    th = rules.thresholds("LAT001")
    k = KEY_LABELS
    sm, tensor, dram = r.stat("sm_active", "avg"), r.stat("tensor_active", "avg"), r.stat("dram_active", "avg")
    gpu_busy, memory, compute = r.signal("gpu_busy"), r.signal("memory_bound"), r.signal("compute_bound")
    roof = f"{th['roof_frac']:g}"
    busy = (f"({gpu_busy} >= {th['busy_min']:g} unless on ({k}) {dram} >= {roof} unless on ({k}) {tensor} >= {roof} "
            f"unless on ({k}) {sm} >= {th['sm_active']:g}) and on ({k}) ({dram} or on ({k}) {sm})")
    used = f"(({dram} >= on ({k}) {tensor}) or on ({k}) {tensor} or on ({k}) {dram})"
    saturation = (f"(({dram} and on ({k}) {memory}) or on ({k}) ({tensor} and on ({k}) {compute}) "
                  f"or on ({k}) {used} or on ({k}) {gpu_busy} * 0 + 0.3)")
    known = f"(({memory} or on ({k}) {compute}) * 0 + 0.1 or on ({k}) {gpu_busy} * 0)"
    return (f"clamp_max(0.55 + 0.25 * clamp_min(1 - {saturation} / {roof}, 0) + on ({k}) {known}, 0.9) "
            f"and on ({k}) {busy}")


def rule_group_yaml(window_s: float, *, interval: str = "1m", rules: RuleSet | None = None, shard_count: int = 1,
                    shard_by: str = "gpu") -> str:
    """The rule groups as a Prometheus rule file (YAML; strings JSON-quoted, expressions as literal blocks)."""
    w = duration(window_s)
    lines = ["# diagnoser: per-GPU window statistics, findings and limiters over " + w + " windows (generated by",
             "# `diagnoser rules --prometheus-rules`). Load it into Prometheus (rule_files), Thanos Ruler, Mimir's",
             "# ruler or vmalert. `diagnoser fleet --since " + w + "` reads the recorded statistics when present.",
             "groups:"]
    for group in build_groups(window_s, interval=interval, rules=rules, shard_count=shard_count, shard_by=shard_by):
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


def prometheus_rules_text(window: str, interval: str, rules: RuleSet | None = None, *, shard_count: int = 1,
                          shard_by: str = "gpu") -> str:
    """`diagnoser rules --prometheus-rules`: the options checked, then the YAML with the thresholds in force."""
    from diagnoser.units import parse_duration

    if not _VALID_INTERVAL.match(interval):
        raise InputError(f"--interval wants a Prometheus duration such as 30s or 1m, not '{interval}'.")
    window_s = parse_duration(window, "--window", positive=True)
    if window_s < 2 * parse_duration(interval, "--interval", positive=True):
        raise InputError("--window must hold at least two evaluation intervals.")
    if not 1 <= shard_count <= MAX_SHARDS:
        raise InputError(f"--shards wants a number from 1 to {MAX_SHARDS}, not {shard_count}.")
    if not _LABEL_NAME.match(shard_by):
        raise InputError(f"--shard-by wants a label name such as gpu or Hostname, not '{shard_by}'.")
    return rule_group_yaml(window_s, interval=interval, rules=rules, shard_count=shard_count, shard_by=shard_by)


__all__ = ["ALERTS", "MAX_SHARDS", "SHARD_LABEL", "Group", "Shard", "build_groups", "build_rules",
           "prometheus_rules_text", "rule_group_yaml", "shards", "spec_clock_expr"]
