"""The rule engine: runs a rule set over the evidence and weighs the findings into one diagnosis.

How the primary limiter is chosen (the physics first, then the strongest evidence):
1. GPU errors of high strength come first: numbers from a failing GPU mean little.
2. A strong VRAM finding comes next: if the model or its KV cache does not fit, nothing else helps.
3. If the GPU is busy under half the time and a batching/host/idle finding exists, the roofs and kernel latency
   cannot be primary: fix batching before hardware.
4. Otherwise the strongest finding wins (ties: the earlier rule in the set).
A verdict whose finding beat a finding of another limiter, eligible by the same step, by less than NEAR_TIE of
strength is said to be a near tie, naming both (`Diagnosis.near_tie`): the window supports either about as well.
A finding whose rule is not decisive (it sees where the time goes, not which roof) leaves the verdict inconclusive
but still writes its headline and fixes. A finding that stands on a trace's idle gaps by cause (host gaps, stream
waits) in a trace holding a sample of its events is listed with its fixes but neither names the verdict nor ties
with it: the sample cannot tell which gaps the host left, so the verdict falls back to what it can measure.

Confidence starts at the winner's strength and drops for thin windows, missing core signals, strong findings that
contradict it, and what limits the data's quality (a cut-short trace, damaged events, a sampled trace, a handful of
kernels). An idle finding from a proxy (the server's request counts) does not contradict a GPU a kernel keeps busy
BUSY_GPU of the window, nor ties with it; a near tie keeps confidence below "high". Below 0.3 the verdict is
"inconclusive" and says what to collect.

Fixes (diagnoser.rules.judge) are then checked against the evidence: none for what is already in place, none that
does not fit the workload, one per kind, every gain bounded by the measured time split, and the first one addresses
the verdict's limiter.
"""

from __future__ import annotations

import functools
from typing import TypedDict

from diagnoser import signals as S
from diagnoser.capture import Capture, Unavailable
from diagnoser.characterise import LONG_PAUSE
from diagnoser.diagnosis import Diagnosis, Finding, Limiter, Regime, Skipped, Verdict
from diagnoser.evidence import Evidence
from diagnoser.evidence_build import build_evidence
from diagnoser.rules.judge import judge_fixes
from diagnoser.rules.ruleset import RuleSet, default_rules

MIN_CONFIDENCE = 0.30
# Where Diagnosis.confidence_label says "high"; a near tie stays below it.
HIGH_CONFIDENCE = 0.70
# Strengths closer than this are a near tie: the rules' strengths are graded evidence, not measurements to 0.01.
NEAR_TIE = 0.05
_ROOFS = {Limiter.MEMORY_BANDWIDTH, Limiter.COMPUTE, Limiter.LATENCY}
_UNDERFED = {Limiter.BATCHING, Limiter.HOST_LAUNCH, Limiter.IDLE}
# Limiters that cannot both be the main story of one window.
_CONFLICTS = {
    frozenset({Limiter.MEMORY_BANDWIDTH, Limiter.COMPUTE}),
    frozenset({Limiter.COMPUTE, Limiter.BATCHING}),
    frozenset({Limiter.COMPUTE, Limiter.IDLE}),
    frozenset({Limiter.MEMORY_BANDWIDTH, Limiter.IDLE}),
    frozenset({Limiter.LATENCY, Limiter.IDLE}),
    frozenset({Limiter.VRAM, Limiter.IDLE}),
    frozenset({Limiter.BATCHING, Limiter.IDLE}),
}
# An idle verdict against the target's own use: its process tree using this share of the host's cores, or its GPU
# busy this share of the window, is a server at work, whatever its gauges read.
BUSY_CPU_SHARE = 0.6
BUSY_GPU = 0.8
_ACTIVITY = (S.GPU_BUSY, S.GPU_SM_ACTIVE, S.GPU_DRAM_ACTIVE, S.GPU_TENSOR_ACTIVE)


def choose_primary(findings: list[Finding], ev: Evidence) -> Finding | None:
    if not findings:
        return None
    for limiter, floor in ((Limiter.ERRORS, 0.9), (Limiter.VRAM, 0.6)):
        strong = [f for f in findings if f.limiter is limiter and f.strength >= floor]
        if strong:
            return strong[0]
    busy = ev.busy_fraction()
    if busy is not None and busy < 0.5 and any(f.limiter in _UNDERFED for f in findings):
        return next(f for f in findings if f.limiter not in _ROOFS)
    return findings[0]


# The trace's idle shares by cause: what a trace holding a sample of its events cannot measure (a launch missing from
# the sample reads as the host late, a kernel missing as idle), where its shares of GPU time by kernel class stay
# estimates it can make.
_IDLE_SIGNALS = "trace.idle."


def unmeasured(finding: Finding, ev: Evidence) -> str:
    """The idle share by cause `finding` stands on (cites against a threshold) that this trace cannot measure, or "":
    a sampled trace's host gaps and stream waits are not known, so a finding read from them never decides its
    verdict; the verdict falls back to what the sample can measure."""
    if ev.trace is None or not ev.trace.sampled:
        return ""
    return next((c.signal for c in finding.citations if c.signal.startswith(_IDLE_SIGNALS) and c.op), "")


def near_tie(primary: Finding, findings: list[Finding], ev: Evidence) -> str:
    """One sentence when `primary` won by a hair over a finding of another limiter that the same step of
    choose_primary could have picked; "" when it won clearly or by precedence (GPU errors, VRAM that does not fit)."""
    rival = tie_rival(primary, findings, ev)
    if rival is None:
        return ""
    margin = primary.strength - rival.strength
    return (f"A near tie: {primary.limiter.label} ({primary.code}, strength {primary.strength:.3f}) against "
            f"{rival.limiter.label} ({rival.code}, strength {rival.strength:.3f}), {abs(margin):.3f} apart; the "
            f"window supports either about as well, so the fixes for both are listed.")


def tie_rival(primary: Finding, findings: list[Finding], ev: Evidence) -> Finding | None:
    """The finding of another limiter `primary` beat by less than NEAR_TIE, or None."""
    if (primary.limiter is Limiter.ERRORS and primary.strength >= 0.9) or (
            primary.limiter is Limiter.VRAM and primary.strength >= 0.6):
        return None
    rivals = [f for f in findings if f.limiter is not primary.limiter]
    busy = ev.busy_fraction()
    if busy is not None and busy < 0.5 and primary.limiter not in _ROOFS:
        rivals = [f for f in rivals if f.limiter not in _ROOFS]  # a GPU idle most of the time: roofs cannot win
    if busy is not None and busy >= BUSY_GPU and not ev.meta.cpu_only:
        rivals = [f for f in rivals if f.limiter is not Limiter.IDLE]  # a GPU busy most of the time is not idle
    if not rivals:
        return None
    rival = max(rivals, key=lambda f: f.strength)
    return rival if abs(primary.strength - rival.strength) < NEAR_TIE else None


def _confidence(primary: Finding, findings: list[Finding], ev: Evidence, tie: str = "") -> tuple[float, list[str]]:
    conf, reasons = primary.strength, [f"{primary.code} evidence strength {primary.strength:.2f}"]
    activity = [ev[n] for n in _ACTIVITY if n in ev]
    if not activity and S.TRACE_GPU_IDLE_FRAC not in ev:
        conf *= 0.6
        reasons.append("no GPU activity counter or trace: x0.6")
    elif activity and max(s.n for s in activity) < 5:
        conf *= 0.6
        reasons.append(f"only {max(s.n for s in activity)} GPU samples in the window: x0.6")
    if primary.limiter in (Limiter.BATCHING, Limiter.IDLE) and S.SERVER_WAITING not in ev:
        conf *= 0.85
        reasons.append("no server queue metric to separate batching from a light load: x0.85")
    busy = ev.busy_fraction() if not ev.meta.cpu_only else None
    for other in findings:
        if other is primary or frozenset({primary.limiter, other.limiter}) not in _CONFLICTS:
            continue
        if other.limiter is Limiter.IDLE and busy is not None and busy >= BUSY_GPU:
            # A GPU-side measure of busy time outranks a proxy for idleness (a server's request counts): a GPU
            # busy most of the window is not idle, whatever the running count reads.
            reasons.append(f"{other.code} ({other.limiter.label}) set aside: the GPU was busy {busy:.0%} of the "
                           "window")
            continue
        if other.strength >= primary.strength - 0.15:
            conf *= 0.65
            reasons.append(f"{other.code} ({other.limiter.label}) fits the evidence almost as well: x0.65")
            break
    if tie and conf >= HIGH_CONFIDENCE:
        # "High" confidence cannot stand above "the window supports either about as well".
        conf = HIGH_CONFIDENCE - 0.01
        reasons.append(f"a near tie with another limiter: below high ({conf:.2f})")
    for q in ev.quality:
        conf *= q.factor
        reasons.append(f"{q.reason}: x{q.factor:.2f}")
    if ev.meta.cpu_only:
        reasons.append("CPU run: counters describe the host, not a GPU")
    return round(conf, 3), reasons




def contradicted_by_use(primary: Finding, ev: Evidence) -> str:
    """Why a verdict contradicts what the target itself used, or "": an idle server does not keep its cores or its
    GPU busy."""
    if primary.limiter is not Limiter.IDLE:
        return ""
    mine, cores = ev.get(S.HOST_TARGET_CPU), ev.get(S.HOST_CORES)
    # The gauge against the process: only where the server's own running gauge read nothing most of the window is
    # its CPU use unexplained (a CPU build serving one request at a time keeps its cores busy with that request).
    running = ev.get(S.SERVER_RUNNING)
    unexplained = running is None or running.p50 < 0.5
    if unexplained and mine is not None and cores is not None and cores.max > 0 and \
            mine.mean >= BUSY_CPU_SHARE * cores.max:
        return (f"the server's own processes used {mine.mean:.2f} of the host's {cores.max:g} cores, a busy server's "
                "use, not an idle one's")
    busy = ev.busy_fraction() if not ev.meta.cpu_only else None
    if busy is not None and busy >= BUSY_GPU:
        return f"its GPU was busy {busy:.0%} of the window, a busy server's use, not an idle one's"
    return ""


def _to_collect(ev: Evidence, rules: RuleSet | None = None) -> list[str]:
    """What to collect for a firmer verdict: the signals the rules that could not run declare and the evidence lacks
    (by family, with where to get them), then what limits the data (a cut-short trace, a short window)."""
    wants = []
    if ev.trace is not None and ev.trace.truncated:
        wants.append("The whole trace: this file is cut short (copy or export it again); only what was read is "
                     "analysed.")
    trace_only = not any(n for n in ev.signals if not n.startswith(("trace.", "theory."))) and ev.trace is not None
    wants += _signal_wants(ev, (rules or default_rules()).unmet(ev), trace_only)
    if trace_only or ev.meta.origin == "trace":
        if ev.trace is not None and 0 < ev.trace.window_s < 0.5:
            wants.append("A longer trace window (several steps of the workload).")
        if ev.trace is not None and (ev.trace.longest_gap_frac or 0.0) >= LONG_PAUSE:
            wants.append("A trace of the steady state: one pause holds most of this window (a warm-up, a first "
                         "call); torch.profiler's schedule(wait=1, warmup=1, active=3) records steps after it.")
    elif ev.meta.window_s < 5 and ev.meta.origin not in _NO_DURATION:
        wants.append("A longer window (--duration 10 or more).")
    return wants


@functools.lru_cache(maxsize=256)
def _families(names: frozenset[str]) -> frozenset[str]:
    """The signal families ('server', 'trace', ...) of `names`: a fleet's GPUs mostly share one set."""
    return frozenset(n.split(".", 1)[0] for n in names)


def _signal_wants(ev: Evidence, unmet: frozenset[str], trace_only: bool) -> list[str]:
    """Where to get the signals `unmet` (declared by rules that could not run, absent here), family by family."""
    wants = []
    if unmet.intersection(_ACTIVITY) and not any(n in ev for n in _ACTIVITY):
        wants.append("GPU activity counters: run on the GPU's host with NVML access (diagnoser doctor says what "
                     "is missing)" + (", e.g. diagnoser attach PID --trace 5 to a running server." if trace_only
                                      else "."))
    if unmet.intersection((S.GPU_DRAM_ACTIVE, S.GPU_TENSOR_ACTIVE)) and S.GPU_DRAM_ACTIVE not in ev \
            and S.GPU_TENSOR_ACTIVE not in ev:
        wants.append("DRAM and tensor-pipe activity, which tell memory-bound from compute-bound kernels: GPM on "
                     "Hopper or newer, or DCGM_FI_PROF_DRAM_ACTIVE and DCGM_FI_PROF_PIPE_TENSOR_ACTIVE from "
                     "dcgm-exporter (--dcgm-exporter/--prometheus).")
    if trace_only and ev.trace is not None and ev.trace.intensity_flop_per_byte is None:
        wants.append("The ops' input shapes (torch.profiler record_shapes=True), so FLOPs and bytes per op, and so the "
                     "roof, can be computed.")
    families = _families(unmet)
    if "server" in families and S.SERVER_WAITING not in ev and ev.workload != "training":
        wants.append("Server metrics (queue, running batch, KV cache): attach with --port to the server's /metrics.")
    if "trace" in families and ev.trace is None:
        wants.append("A short torch.profiler trace (attach --trace 5) to attribute idle time and measure intensity.")
    if "theory" in families and ev.model is None and ev.workload != "training":
        wants.append("The model's shape (--model config.json) for the physical floor and predicted gains.")
    return wants


# What made a capture whose window is not set by --duration: a trace (analyze), a fleet or agent window, a self-test
# scenario (--window).
_NO_DURATION = frozenset({"trace", "fleet", "agent", "selftest"})


def _context(ev: Evidence) -> dict[str, object]:
    m = ev.meta
    ctx: dict[str, object] = {
        "target": m.target,
        "window_s": m.window_s,
        "started_at": m.started_at,
        "host": m.host,
        "tool_version": m.tool_version,
        "cpu_only": m.cpu_only,
        "gpus": [{"index": g.index, "name": g.name, "driver": g.driver,
                  "memory_total_bytes": g.memory_total_bytes, "mig": g.mig_instance or None} for g in m.gpus],
    }
    if ev.gpu_spec is not None:
        ctx["gpu_spec"] = ev.gpu_spec.name
        ctx["roofs"] = "measured (diagnoser calibrate)" if m.measured_roofs else "spec sheet"
    if m.model_name:
        ctx["model"] = m.model_name
    if m.server_kind:
        ctx["server"] = m.server_kind
    if ev.regime is not Regime.UNKNOWN:
        ctx["regime_basis"] = ev.regime_basis
    if ev.platform:
        ctx["platform"] = ev.platform
    return ctx


def diagnose(capture: Capture, rules: RuleSet | None = None) -> Diagnosis:
    return diagnose_evidence(build_evidence(capture), rules)


class _Common(TypedDict):
    """The parts of a Diagnosis every verdict path fills the same way."""

    target: str
    skipped: list[Skipped]
    passed: list[str]
    unavailable: list[Unavailable]
    notes: list[str]
    context: dict[str, object]
    workload: str
    near_tie: str


def diagnose_evidence(ev: Evidence, rules: RuleSet | None = None) -> Diagnosis:
    rules = rules or default_rules()
    results = rules.run(ev)
    findings, skipped, passed = results.findings, results.skipped, results.passed
    # Advisory findings (a latency tail, clients giving up) are reported with their fixes but never name the verdict.
    advisory = {r.code for r in rules if r.advisory}
    # A finding read from a share the trace cannot measure (a sampled trace's idle gaps by cause) is reported with its
    # fixes (left unsized by the judge) but never names the verdict, nor ties with it.
    unknowable = {f.code: why for f in findings if (why := unmeasured(f, ev))}
    eligible = [f for f in findings if f.code not in advisory and f.code not in unknowable]
    primary = choose_primary(eligible, ev)
    notes = list(ev.meta.notes) + ev.notes
    if unknowable:
        set_aside = [f for f in findings if f.code in unknowable]
        who = " and ".join(f"{f.code} ({f.limiter.label})" for f in set_aside)
        what = ", ".join(dict.fromkeys(unknowable[f.code] for f in set_aside))
        one = len(set_aside) == 1
        notes.append(f"{who} {'does' if one else 'do'} not decide the verdict: {'it stands' if one else 'they stand'} "
                     f"on the idle gaps by cause ({what}), which a trace holding a sample of its events cannot "
                     "measure (a launch missing from the sample reads as the host late, a kernel missing as idle).")
    if ev.meta.cpu_only:
        measured = [what for what, prefix in (("host", "host."), ("server", "server.")) if any(
            name.startswith(prefix) for name in ev.signals)]
        said = (f"{' and '.join(measured).capitalize()} signals are real; " if measured else
                "It holds no host or server signals; ")
        notes.insert(0, f"CPU run: not a GPU verdict. {said}GPU roofs are not measured.")
    if ev.meta.exited_at_s is not None:
        notes.append(f"The target process exited {ev.meta.exited_at_s:.1f} s into the window; the diagnosis covers "
                     "what was captured until then.")
    common = _Common(target=ev.meta.target, skipped=skipped, passed=passed, unavailable=list(ev.meta.unavailable),
                     notes=notes, context=_context(ev), workload=ev.workload, near_tie="")
    if primary is None:
        fixes, withheld = judge_fixes(findings, ev, rules)
        return Diagnosis(verdict=Verdict.INCONCLUSIVE, confidence=0.0, findings=findings, fixes=fixes,
                         withheld=withheld, to_collect=_to_collect(ev),
                         headline=_inconclusive_headline(ev, skipped, len(rules), findings), regime=ev.regime,
                         **common)
    tie = near_tie(primary, eligible, ev)
    rival = tie_rival(primary, eligible, ev)
    confidence, reasons = _confidence(primary, findings, ev, tie)
    secondary = []
    for f in findings:
        if f.limiter is not primary.limiter and f.limiter.value not in secondary:
            secondary.append(f.limiter.value)
    ordered = [primary] + [f for f in findings if f is not primary]
    fixes, withheld = judge_fixes(ordered, ev, rules, tied=rival.limiter if rival is not None else None)
    common["near_tie"] = tie
    regime = primary.regime if primary.regime is not Regime.UNKNOWN else ev.regime
    decisive = (rule := rules.get(primary.code)) is None or rule.decisive
    if not decisive:
        return Diagnosis(verdict=Verdict.INCONCLUSIVE, confidence=min(confidence, MIN_CONFIDENCE - 0.01),
                         findings=ordered, fixes=fixes, withheld=withheld, to_collect=_to_collect(ev),
                         confidence_reasons=reasons, headline=f"Inconclusive between the roofs: {primary.message}",
                         regime=regime, saturation=primary.saturation, **common)
    contradiction = contradicted_by_use(primary, ev)
    if contradiction:
        # The server's own gauges say idle, its process or its GPU says busy: the gauges are not the workload (a
        # vLLM running gauge read 0 in 8 of 10 scrapes under 4 closed-loop clients using 1.87 of 2 cores).
        notes.append(f"The verdict {primary.limiter.label} ({primary.code}) does not stand: {contradiction}.")
        return Diagnosis(verdict=Verdict.INCONCLUSIVE, confidence=min(confidence, MIN_CONFIDENCE - 0.01),
                         findings=ordered, fixes=fixes, withheld=withheld, to_collect=_to_collect(ev),
                         confidence_reasons=[*reasons, f"contradicted: {contradiction}"],
                         headline=f"Inconclusive: the server's metrics read {primary.limiter.label} "
                         f"({primary.message}) but {contradiction}.", regime=regime, **common)
    if confidence < MIN_CONFIDENCE:
        return Diagnosis(verdict=Verdict.INCONCLUSIVE, confidence=confidence, findings=ordered, fixes=fixes,
                         withheld=withheld, to_collect=_to_collect(ev), confidence_reasons=reasons,
                         headline=f"Inconclusive: the evidence leans {primary.limiter.label} "
                         f"({primary.message}) but is too thin or contradictory to say.", regime=regime,
                         **common)
    return Diagnosis(verdict=Verdict.of(primary.limiter), confidence=confidence, findings=ordered, secondary=secondary,
                     fixes=fixes, withheld=withheld, confidence_reasons=reasons,
                     to_collect=_to_collect(ev) if confidence < 0.6 else [],
                     headline=f"{_capitalised(primary.limiter.label)}: {primary.message}", regime=regime,
                     saturation=primary.saturation, **common)


def _capitalised(text: str) -> str:
    return text[:1].upper() + text[1:]


def _inconclusive_headline(ev: Evidence, skipped: list[Skipped], rule_count: int,
                           advisories: list[Finding] | None = None) -> str:
    if advisories:
        return (f"No limiter found in the signals captured; noted: {advisories[0].message}"
                + (f" (and {len(advisories) - 1} more)" if len(advisories) > 1 else ""))
    if not ev.signals:
        return "Inconclusive: the capture holds no signals to diagnose."
    if len(skipped) == rule_count:
        return "Inconclusive: every rule lacked the signals it needs."
    busy = ev.busy_fraction()
    if busy is not None and busy >= 0.5:
        return (f"Inconclusive: the GPU is busy {busy:.0%} of the time and no rule found a limiter in the signals "
                "captured; DRAM and tensor-pipe counters or the ops' shapes would tell compute from memory.")
    return "Inconclusive: no rule found a limiter in the signals captured."


__all__ = ["diagnose", "diagnose_evidence", "choose_primary", "near_tie", "tie_rival", "unmeasured"]
