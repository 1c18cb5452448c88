"""A Prometheus rule group that keeps the fleet's per-GPU window statistics and limiter classification continuously
in Prometheus (or Thanos Ruler, Mimir's ruler, vmalert), with alerts for the limiters that call for action.

`diagnoser rules --prometheus-rules [--window 1h]` prints it as YAML. Three kinds of rules, in one group (each rule
reads what the earlier ones recorded at the same evaluation):

1. Statistics: exactly the PromQL `diagnoser fleet` would ask ad hoc (collectors/prom_stats.py `stat_expr`), recorded
   as `gpu:dcgm_<field>:<stat>_<window>`, plus the GPUs' identity labels (`gpu:dcgm_identity:count_<window>`); when
   these exist for its window, `fleet` reads them (by name, one plain read each) instead of computing them. The spec
   table's maximum SM clocks stand in where DCGM_FI_DEV_MAX_SM_CLOCK is not exported.
2. Findings: one series per GPU and rule that fires, valued at the rule's strength, for the rules that DCGM counters
   alone decide (ERR001, VRAM003, IDLE001, BAT003, BW001, CMP001, LAT001, LAT002, THR001), with the same thresholds as
   the Python rules (and a --rules-config's overrides): `gpu:diagnoser_finding:<window>{rule, limiter}`.
3. The primary limiter, chosen as the engine chooses it (errors first, then strong VRAM findings, then, for a GPU
   busy under half the time, the strongest non-roof finding, else the strongest): `gpu:diagnoser_limiter:<window>`,
   a count per limiter, and alerts.

Not in PromQL: the engine's confidence (an edge case it calls inconclusive is classified here), and the rules that
need server metrics, a trace or the model's shape. tests/test_fleet_promrules.py holds the classification equal to
the Python engine's for every planted class, on a real Prometheus.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping

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


def spec_clock_expr(identity: str) -> str:
    """Each GPU's maximum SM clock from the spec table, matched on its modelName as physics.match_gpu matches it:
    the same patterns in the same order (a GPU a pattern without a tabled clock claims gets none)."""
    from diagnoser.physics.gpus import _NVML_PATTERNS, GPUS

    terms: list[str] = []
    claimed: list[str] = []
    for pattern, keys in _NVML_PATTERNS:
        regex = "(?i).*" + pattern + ".*"
        clocks = {GPUS[k].max_sm_clock_mhz for k in keys}
        if len(clocks) == 1 and None not in clocks:
            term = f"max by ({BOARD}) ({identity}{{modelName=~{json.dumps(regex)}}}) * 0 + {next(iter(clocks)):g}"
            if claimed:
                term += f" unless on ({BOARD}) {identity}{{modelName=~{json.dumps('|'.join(claimed))}}}"
            terms.append(f"({term})")
        claimed.append(regex)
    return "\n  or\n".join(terms)


def build_rules(window_s: float, *, rules: RuleSet | None = None) -> list[dict[str, object]]:
    """The rule group's rules (dicts of record/alert, expr, labels...), in evaluation order, with the thresholds
    in force in `rules` (the shipped ones by default)."""
    ruleset = rules or default_rules()

    def t(code: str, name: str) -> str:
        return f"{ruleset.thresholds(code)[name]:g}"

    w = duration(window_s)

    def rec(stat: Stat) -> str:
        return record_name(stat, window_s)

    out: list[dict[str, object]] = []
    identity = identity_record_name(window_s)
    out.append({"record": identity, "expr": identity_expr(_names("fb_used"), window_s)})
    for stat in STATS:
        if stat.field == "fb_total":
            expr = stat_expr(stat, _names("fb_used"), window_s, extra_names=_names("fb_free"))
        else:
            expr = stat_expr(stat, _names(stat.field), window_s)
        out.append({"record": rec(stat), "expr": expr})
    out.append({"record": rec(FALLBACK), "expr": stat_expr(FALLBACK, _names("gpu_util"), window_s,
                                                             unless_names=_names("gr_engine_active"))})

    spec_clock = f"gpu:dcgm_max_sm_clock:spec_{w}"
    out.append({"record": spec_clock, "expr": spec_clock_expr(identity)})

    def r(field: str, stat: str) -> str:
        return record_name(Stat(field, stat), window_s)

    sm, tensor, dram = r("sm_active", "avg"), r("tensor_active", "avg"), r("dram_active", "avg")
    # gpu.busy (GR_ENGINE_ACTIVE, else GPU_UTIL); and the busy signal of the load rules and of the engine's choice,
    # which falls back to SM activity.
    gpu_busy = f"({r('gr_engine_active', 'avg')} or on ({KEY_LABELS}) {r('gpu_util', 'avg')} / 100)"
    busy = f"({gpu_busy[1:-1]} or on ({KEY_LABELS}) {sm})"
    mem_frac = f"({r('fb_used', 'p90')} / on ({KEY_LABELS}) {r('fb_total', 'last')})"

    def device(board_expr: str) -> str:
        """A board-level value (clocks, throttling, errors) for each GPU or MIG instance that reports activity."""
        return f"(({busy}) * 0 + on ({BOARD}) group_left max by ({BOARD}) ({board_expr}))"

    max_clock = f"(max by ({BOARD}) ({r('max_sm_clock', 'last')}) or on ({BOARD}) {spec_clock})"
    clock_frac = device(f"max by ({BOARD}) ({r('sm_clock', 'avg')}) / on ({BOARD}) {max_clock}")
    # The share of time clocks were held: the violation counters', else the clock-event bits' from the mask's
    # minimum, maximum and mean (prom_stats.bit_shares: the one value held all window, or the time at each of two).
    high, low, mean = r("reasons_power", "max"), r("reasons_power", "min"), r("reasons_power", "avg")
    shares = []
    for reason, counter, mask in (("power", "power_violation", CLOCK_EVENT_POWER),
                                  ("thermal", "thermal_violation", CLOCK_EVENT_THERMAL)):
        held = f"({bits_expr(high, mask)} and on ({KEY_LABELS}) {high} == on ({KEY_LABELS}) {low})"
        two = (f"(({bits_expr(low, mask)}) * ({high} - on ({KEY_LABELS}) {mean}) + ({bits_expr(high, mask)}) * "
               f"({mean} - on ({KEY_LABELS}) {low})) / on ({KEY_LABELS}) ({high} - on ({KEY_LABELS}) {low} > 0)")
        share = f"clamp({r(counter, 'rate')} / 1e9, 0, 1) or on ({KEY_LABELS}) {held} or on ({KEY_LABELS}) {two}"
        shares.append(f'label_replace({share}, "reason", "{reason}", "", "")')
    throttled = device(f"max by ({BOARD}) ({' or '.join(shares)})")
    errors = device(f"max by ({BOARD}) (label_replace({r('xid', 'max')}, \"error\", \"xid\", \"\", \"\") or "
                    f"label_replace({r('ecc_dbe', 'increase')}, \"error\", \"ecc\", \"\", \"\"))")

    k = KEY_LABELS
    # The regime from the counters, as characterise reads it: DRAM used while the tensor pipes idle is memory-bound
    # work, tensor pipes busier than DRAM compute-bound.
    memory_regime = f"({dram} >= {COUNTER_DRAM_MIN:g} and on ({k}) {tensor} < {COUNTER_TENSOR_IDLE:g})"
    compute_regime = f"({tensor} >= {COUNTER_TENSOR_BUSY:g} and on ({k}) {tensor} > on ({k}) {dram})"
    findings: dict[str, str] = {
        "ERR001": f"({errors} > {t('ERR001', 'errors')}) * 0 + 0.95",
        "VRAM003": f"({mem_frac} >= {t('VRAM003', 'mem_used_p90')}) * 0 + 0.4",
        "IDLE001": f"({busy} < {t('IDLE001', 'busy_mean')}) * 0 + 0.65",
        "BAT003": f"({busy} >= {t('BAT003', 'idle_below')} < {t('BAT003', 'busy_mean')}) * 0 + 0.5",
        "BW001": (f"0.6 + clamp_max((({dram} >= {t('BW001', 'dram_active_mean')} unless on ({k}) "
                  f"({dram} - on ({k}) {tensor} < {t('BW001', 'split')})) - {t('BW001', 'dram_active_mean')}) "
                  "* 1.5, 0.3)"),
        "CMP001": _compute_finding(ruleset, tensor, sm, dram, compute_regime),
        "LAT001": _kernel_bound(ruleset, gpu_busy, tensor, sm, dram, memory_regime, compute_regime),
        "LAT002": (f"({gpu_busy} >= {t('LAT002', 'busy_min')} unless on ({k}) {dram} unless on ({k}) {sm} "
                   f"unless on ({k}) {tensor}) * 0 + 0.45"),
        "THR001": (f"0.5 + clamp_max(({t('THR001', 'clock_frac_mean')} - ({clock_frac} < "
                   f"{t('THR001', 'clock_frac_mean')} and on ({k}) ({throttled} >= "
                   f"{t('THR001', 'throttled_frac')}) unless on ({k}) ({gpu_busy} < 0.3))) * 2, 0.4)"),
    }
    finding = f"gpu:diagnoser_finding:{w}"
    union = "\n  or\n".join(
        f'label_replace(label_replace({expr}, "rule", "{code}", "", ""), "limiter", "{_limiter(ruleset, code)}", '
        '"", "")'
        for code, expr in findings.items())
    out.append({"record": finding, "expr": union})
    not_roofs = "|".join(_ROOFS)
    underfed = "|".join(_UNDERFED)
    primary = (
        f'topk by ({KEY_LABELS}) (1, {finding}{{limiter="{Limiter.ERRORS.value}"}} >= 0.9)\n'
        f'  or on ({KEY_LABELS})\n'
        f'topk by ({KEY_LABELS}) (1, {finding}{{limiter="{Limiter.VRAM.value}"}} >= 0.6)\n'
        f'  or on ({KEY_LABELS})\n'
        f'(topk by ({KEY_LABELS}) (1, {finding}{{limiter!~"{not_roofs}"}}) and on ({KEY_LABELS}) {busy} < 0.5 '
        f'and on ({KEY_LABELS}) {finding}{{limiter=~"{underfed}"}})\n'
        f'  or on ({KEY_LABELS})\n'
        f'topk by ({KEY_LABELS}) (1, {finding})')
    limiter = f"gpu:diagnoser_limiter:{w}"
    out.append({"record": limiter, "expr": f"({primary}) * 0 + 1"})
    out.append({"record": f"limiter:diagnoser_gpus:count_{w}", "expr": f"count by (limiter) ({limiter})"})
    for value, (name, severity, what) in ALERTS.items():
        out.append({
            "alert": name, "expr": f'{limiter}{{limiter="{value}"}}', "for": w,
            "labels": {"severity": severity},
            "annotations": {
                "summary": f"GPU {{{{ $labels.UUID }}}}{{{{ $labels.uuid }}}} {what} ({{{{ $labels.rule }}}}, "
                           f"over {w})",
                "description": "Diagnose it: diagnoser dcgm --prometheus <this Prometheus> --uuid "
                               "{{ $labels.UUID }}{{ $labels.uuid }} --since " + w
                               + "; the fleet: diagnoser fleet --since " + w + ".",
            },
        })
    return out


def _compute_finding(rules: RuleSet, tensor: str, sm: str, dram: str, compute_regime: str) -> str:
    """CMP001: the tensor pipes at their roof, or the SMs in compute-bound work, clearly busier than DRAM; stronger
    the more signals say so and the higher the busiest."""
    th = rules.thresholds("CMP001")
    k = KEY_LABELS
    hits = (f'(label_replace({tensor} >= {th["tensor_active_mean"]:g}, "hit", "tensor", "", "") or '
            f'label_replace({sm} >= {th["sm_active_mean"]:g} and on ({k}) {compute_regime}, "hit", "sm", "", ""))')
    top = f"(max by ({k}) ({hits}) unless on ({k}) (max by ({k}) ({hits}) - on ({k}) {dram} < {th['split']:g}))"
    return f"0.6 + clamp_max(0.1 * count by ({k}) ({hits}) + on ({k}) ({top} - 0.6) * 0.5, 0.3)"


def _kernel_bound(rules: RuleSet, gpu_busy: str, tensor: str, sm: str, dram: str, memory_regime: str,
                  compute_regime: str) -> str:
    """LAT001: busy, with HBM, the tensor pipes and the SMs all under their roofs; stronger the further below the
    roof of its regime (or the closer of the two where the counters name none) the work runs."""
    th = rules.thresholds("LAT001")
    k = KEY_LABELS
    roof = f"{th['roof_frac']:g}"
    busy = (f"({gpu_busy} >= {th['busy_min']:g} unless on ({k}) {dram} >= {roof} unless on ({k}) {tensor} >= {roof} "
            f"unless on ({k}) {sm} >= {th['sm_active']:g}) and on ({k}) ({dram} or on ({k}) {sm})")
    used = (f'max by ({k}) (label_replace({dram}, "use", "hbm", "", "") or '
            f'label_replace({tensor}, "use", "math", "", ""))')
    saturation = (f"(({dram} and on ({k}) {memory_regime}) or on ({k}) ({tensor} and on ({k}) {compute_regime}) "
                  f"or on ({k}) {used} or on ({k}) {gpu_busy} * 0 + 0.3)")
    known = f"(({memory_regime} or on ({k}) {compute_regime}) * 0 + 0.1 or on ({k}) {gpu_busy} * 0)"
    return (f"clamp_max(0.55 + 0.25 * clamp_min(1 - {saturation} / {roof}, 0) + on ({k}) {known}, 0.9) "
            f"and on ({k}) {busy}")


def rule_group_yaml(window_s: float, *, interval: str = "1m", rules: RuleSet | None = None) -> str:
    """The rule group as a Prometheus rule file (YAML; strings JSON-quoted, expressions as literal blocks)."""
    w = duration(window_s)
    lines = ["# diagnoser: per-GPU window statistics, findings and limiters over " + w + " windows (generated by",
             "# `diagnoser rules --prometheus-rules`). Load it into Prometheus (rule_files), Thanos Ruler, Mimir's",
             "# ruler or vmalert. `diagnoser fleet --since " + w + "` reads the recorded statistics when present.",
             "groups:", f"  - name: {json.dumps('diagnoser-gpu-' + w)}", f"    interval: {interval}", "    rules:"]
    for rule in build_rules(window_s, rules=rules):
        key = "record" if "record" in rule else "alert"
        lines.append(f"      - {key}: {json.dumps(rule[key])}")
        lines.append("        expr: |-")
        lines.extend("          " + line for line in str(rule["expr"]).splitlines())
        if "for" in rule:
            lines.append(f"        for: {rule['for']}")
        for section in ("labels", "annotations"):
            values = rule.get(section)
            if isinstance(values, Mapping):
                lines.append(f"        {section}:")
                lines.extend(f"          {k}: {json.dumps(v)}" for k, v in values.items())
    return "\n".join(lines) + "\n"


_VALID_INTERVAL = re.compile(r"^\d+(ms|s|m|h|d)$")


def prometheus_rules_text(window: str, interval: str, rules: RuleSet | None = None) -> str:
    """`diagnoser rules --prometheus-rules`: the options checked, then the YAML with the thresholds in force."""
    from diagnoser.units import parse_duration

    if not _VALID_INTERVAL.match(interval):
        raise InputError(f"--interval wants a Prometheus duration such as 30s or 1m, not '{interval}'.")
    window_s = parse_duration(window, "--window", positive=True)
    if window_s < 2 * parse_duration(interval, "--interval", positive=True):
        raise InputError("--window must hold at least two evaluation intervals.")
    return rule_group_yaml(window_s, interval=interval, rules=rules)


__all__ = ["ALERTS", "build_rules", "prometheus_rules_text", "rule_group_yaml", "spec_clock_expr"]
