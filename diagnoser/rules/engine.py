"""The rule engine: runs every rule over the evidence and weighs the findings into one diagnosis.

How the primary limiter is chosen (the physics first, then the strongest evidence):
1. GPU errors of high strength come first: numbers from a failing GPU mean little.
2. A strong VRAM finding comes next: if the model or its KV cache does not fit, nothing else helps.
3. If the GPU is busy under half the time and a batching/host/idle finding exists, the roofs (bandwidth,
   compute) cannot be primary: fix batching before hardware.
4. Otherwise the strongest finding wins.
Confidence starts at the winner's strength and drops for thin windows, missing core signals, and strong findings
that contradict it. Below 0.3 the verdict is "inconclusive" and says what to collect.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType

from diagnoser.capture import Capture
from diagnoser.diagnosis import INCONCLUSIVE, Diagnosis, Finding, Fix, Limiter, Skipped
from diagnoser.errors import InputError
from diagnoser.evidence import Evidence, build_evidence
from diagnoser.fileio import read_text_bounded
from diagnoser.rules.base import RULES, Check, Rule

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

MIN_CONFIDENCE = 0.30
_ROOFS = {Limiter.MEMORY_BANDWIDTH, Limiter.COMPUTE}
_UNDERFED = {Limiter.BATCHING, Limiter.HOST_LAUNCH, Limiter.IDLE}
# Limiters that cannot both be the main story of one window.
_CONFLICTS = {
    frozenset({Limiter.MEMORY_BANDWIDTH, Limiter.COMPUTE}),
    frozenset({Limiter.COMPUTE, Limiter.BATCHING}),
    frozenset({Limiter.COMPUTE, Limiter.IDLE}),
    frozenset({Limiter.MEMORY_BANDWIDTH, Limiter.IDLE}),
    frozenset({Limiter.VRAM, Limiter.IDLE}),
    frozenset({Limiter.BATCHING, Limiter.IDLE}),
}
_ACTIVITY = ("gpu.busy", "gpu.sm_active", "gpu.dram_active", "gpu.tensor_active")

Thresholds = Mapping[str, Mapping[str, float]]


def load_thresholds(path: str | Path) -> dict[str, dict[str, float]]:
    """Threshold overrides from a TOML file: [thresholds.BW001] dram_active_mean = 0.45"""
    path = Path(path)
    try:
        data = tomllib.loads(read_text_bounded(path))  # bounded: never /dev/zero into memory
    except FileNotFoundError:
        raise InputError(f"no rules config at {path}.") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read rules config {path}: {exc}.") from None
    table = data.get("thresholds", {})
    out: dict[str, dict[str, float]] = {}
    for code, values in table.items():
        rule = RULES.get(code.upper())
        if rule is None:
            raise InputError(f"{path} sets thresholds for unknown rule {code}.")
        if not isinstance(values, dict):
            raise InputError(f"{path}: [thresholds.{code}] must be a table of name = number.")
        for name, value in values.items():
            if name not in rule.thresholds:
                raise InputError(f"{path}: rule {code} has no threshold '{name}' "
                                 f"(it has {', '.join(rule.thresholds)}).")
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise InputError(f"{path}: threshold {code}.{name} must be a number.")
        out[rule.code] = {k: float(v) for k, v in values.items()}
    return out


# Each rule's default thresholds, built once: a fleet run checks every rule for every GPU. Read-only (a mapping
# proxy), since every check shares it.
_DEFAULT_THRESHOLDS: dict[str, Mapping[str, float]] = {}


def _thresholds_for(rule: Rule, overrides: Thresholds | None) -> Mapping[str, float]:
    if overrides and rule.code in overrides:
        return {**{name: t.value for name, t in rule.thresholds.items()}, **overrides[rule.code]}
    found = _DEFAULT_THRESHOLDS.get(rule.code)
    if found is None:
        found = _DEFAULT_THRESHOLDS[rule.code] = MappingProxyType({n: t.value for n, t in rule.thresholds.items()})
    return found


# Which rules run and why the others are skipped depends only on the signals present and on what the capture says
# is unavailable; a fleet's GPUs mostly share both, so the plan is made once per distinct case.
_PLANS: dict[tuple[frozenset[str], tuple[tuple[str, str, str], ...]], tuple[tuple[Rule, Skipped | None], ...]] = {}
_PLANS_MAX = 1024


def _plan(ev: Evidence) -> tuple[tuple[Rule, Skipped | None], ...]:
    key = (frozenset(ev.signals), ev.absent_key())
    plan = _PLANS.get(key)
    if plan is None:
        plan = tuple((rule, Skipped(rule.code, reason) if (reason := rule.skip_reason(ev)) else None)
                     for rule in RULES.values())
        if len(_PLANS) >= _PLANS_MAX:
            _PLANS.clear()
        _PLANS[key] = plan
    return plan


def run_rules(ev: Evidence, overrides: Thresholds | None = None) -> tuple[list[Finding], list[Skipped], list[str]]:
    findings: list[Finding] = []
    skipped: list[Skipped] = []
    passed: list[str] = []
    for rule, skip in _plan(ev):
        if skip is not None:
            skipped.append(skip)
            continue
        result = rule.predicate(Check(rule, ev, _thresholds_for(rule, overrides)))
        if result is None:
            passed.append(rule.code)
        else:
            findings.append(result)
    findings.sort(key=lambda f: -f.strength)
    return findings, skipped, passed


def _busy(ev: Evidence) -> float | None:
    for name in ("gpu.busy", "gpu.sm_active"):
        s = ev.get(name)
        if s is not None:
            return s.mean
    idle = ev.get("trace.gpu_idle_frac")
    return 1.0 - idle.values[0] if idle is not None else None


def choose_primary(findings: list[Finding], ev: Evidence) -> Finding | None:
    if not findings:
        return None
    for limiter, floor in ((Limiter.ERRORS, 0.9), (Limiter.VRAM, 0.6)):
        strong = [f for f in findings if f.limiter is limiter and f.strength >= floor]
        if strong:
            return strong[0]
    busy = _busy(ev)
    if busy is not None and busy < 0.5 and any(f.limiter in _UNDERFED for f in findings):
        return next(f for f in findings if f.limiter not in _ROOFS)
    return findings[0]


def _confidence(primary: Finding, findings: list[Finding], ev: Evidence) -> tuple[float, list[str]]:
    conf, reasons = primary.strength, [f"{primary.code} evidence strength {primary.strength:.2f}"]
    activity = [ev[n] for n in _ACTIVITY if n in ev]
    if not activity and "trace.gpu_idle_frac" not in ev:
        conf *= 0.6
        reasons.append("no GPU activity counter or trace: x0.6")
    elif activity and max(s.n for s in activity) < 5:
        conf *= 0.6
        reasons.append(f"only {max(s.n for s in activity)} GPU samples in the window: x0.6")
    if primary.limiter in (Limiter.BATCHING, Limiter.IDLE) and "server.waiting" not in ev:
        conf *= 0.85
        reasons.append("no server queue metric to separate batching from a light load: x0.85")
    for other in findings:
        if other is primary or frozenset({primary.limiter, other.limiter}) not in _CONFLICTS:
            continue
        if other.strength >= primary.strength - 0.15:
            conf *= 0.65
            reasons.append(f"{other.code} ({other.limiter.label}) fits the evidence almost as well: x0.65")
            break
    if ev.capture.cpu_only:
        reasons.append("CPU run: counters describe the host, not a GPU")
    return round(conf, 3), reasons


def _rank_fixes(findings: list[Finding], primary: Finding | None) -> list[Fix]:
    """Expected gain = 1 + (gain - 1) x strength; the primary finding's fixes first among equals."""
    seen: set[str] = set()
    scored: list[tuple[float, int, Fix]] = []
    for order, f in enumerate(findings):
        for fix in f.fixes:
            if fix.title in seen:
                continue
            seen.add(fix.title)
            expected = 1 + ((fix.gain if fix.gain is not None else 1.1) - 1) * f.strength
            bonus = 0.05 if f is primary else 0.0
            scored.append((expected + bonus, order, fix))
    scored.sort(key=lambda x: (-x[0], x[1]))
    return [fix for _, _, fix in scored]


def _to_collect(ev: Evidence) -> list[str]:
    wants = []
    if not any(n in ev for n in _ACTIVITY):
        wants.append("GPU activity counters: run on the GPU's host with NVML access (diagnoser doctor says what "
                     "is missing).")
    if "gpu.dram_active" not in ev and "gpu.tensor_active" not in ev:
        wants.append("DRAM and tensor-pipe activity: GPM on Hopper or newer, or DCGM_FI_PROF_DRAM_ACTIVE and "
                     "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE from dcgm-exporter (--dcgm-exporter/--prometheus).")
    if "server.waiting" not in ev:
        wants.append("Server metrics (queue, running batch, KV cache): attach with --port to the server's /metrics.")
    if ev.capture.trace is None:
        wants.append("A short torch.profiler trace (attach --trace 5) to attribute idle time and measure intensity.")
    if ev.capture.model is None:
        wants.append("The model's shape (--model config.json) for the physical floor and predicted gains.")
    if ev.capture.duration_s < 5:
        wants.append("A longer window (--duration 10 or more).")
    return wants


def _context(capture: Capture, ev: Evidence) -> dict[str, object]:
    ctx: dict[str, object] = {
        "target": capture.target,
        "window_s": capture.duration_s,
        "started_at": capture.started_at,
        "host": capture.host,
        "tool_version": capture.tool_version,
        "cpu_only": capture.cpu_only,
        "gpus": [{"index": g.index, "name": g.name, "driver": g.driver,
                  "memory_total_bytes": g.memory_total_bytes, "mig": g.mig_instance or None} for g in capture.gpus],
    }
    if ev.gpu_spec is not None:
        ctx["gpu_spec"] = ev.gpu_spec.name
        ctx["roofs"] = "measured (diagnoser calibrate)" if any(g.measured for g in capture.gpus) else "spec sheet"
    if capture.model is not None:
        ctx["model"] = capture.model.name or "unnamed"
    if capture.server is not None:
        ctx["server"] = capture.server.kind
    return ctx


def diagnose(capture: Capture, thresholds: Thresholds | None = None) -> Diagnosis:
    ev = build_evidence(capture)
    return diagnose_evidence(ev, thresholds)


def diagnose_evidence(ev: Evidence, thresholds: Thresholds | None = None) -> Diagnosis:
    capture = ev.capture
    findings, skipped, passed = run_rules(ev, thresholds)
    primary = choose_primary(findings, ev)
    notes = list(capture.notes) + ev.notes
    if capture.cpu_only:
        notes.insert(0, "CPU run: not a GPU verdict. Host and server signals are real; GPU roofs are not measured.")
    if capture.process is not None and capture.process.exited_at_s is not None:
        notes.append(f"The target process exited {capture.process.exited_at_s:.1f} s into the window; the "
                     "diagnosis covers what was captured until then.")
    unavailable = [{"source": u.source, "what": u.what, "reason": u.reason, "hint": u.hint}
                   for u in capture.unavailable]
    common = dict(target=capture.target, skipped=skipped, passed=passed, unavailable=unavailable, notes=notes,
                  context=_context(capture, ev))
    if primary is None:
        return Diagnosis(verdict=INCONCLUSIVE, confidence=0.0, findings=findings, to_collect=_to_collect(ev),
                         headline=_inconclusive_headline(ev, skipped), **common)  # type: ignore[arg-type]
    confidence, reasons = _confidence(primary, findings, ev)
    secondary = []
    for f in findings:
        if f.limiter is not primary.limiter and f.limiter.value not in secondary:
            secondary.append(f.limiter.value)
    fixes = _rank_fixes(findings, primary)
    if confidence < MIN_CONFIDENCE:
        return Diagnosis(verdict=INCONCLUSIVE, confidence=confidence, findings=findings, fixes=fixes,
                         to_collect=_to_collect(ev), confidence_reasons=reasons,
                         headline=f"Inconclusive: the evidence leans {primary.limiter.label} "
                         f"({primary.message}) but is too thin or contradictory to say.", **common)  # type: ignore[arg-type]
    ordered = [primary] + [f for f in findings if f is not primary]
    return Diagnosis(verdict=primary.limiter.value, confidence=confidence, findings=ordered, secondary=secondary,
                     fixes=fixes, confidence_reasons=reasons, to_collect=_to_collect(ev) if confidence < 0.6 else [],
                     headline=f"{_capitalised(primary.limiter.label)}: {primary.message}", **common)  # type: ignore[arg-type]


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


def _inconclusive_headline(ev: Evidence, skipped: list[Skipped]) -> str:
    if not ev.signals:
        return "Inconclusive: the capture holds no signals to diagnose."
    if len(skipped) == len(RULES):
        return "Inconclusive: every rule lacked the signals it needs."
    return "Inconclusive: no rule found a limiter in the signals captured."


__all__ = ["diagnose", "diagnose_evidence", "load_thresholds", "run_rules", "choose_primary"]
