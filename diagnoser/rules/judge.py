"""From the fixes the rules proposed to the ranked list a user reads.

Four checks a demanding engineer would make, applied to every fix whatever rule proposed it:
1. Not already in place: a fix the capture shows applied (CUDA graph replays in the trace, FP8 weights in the model,
   an engine that batches continuously) is withheld, with the evidence.
2. Fits the workload: serving-engine advice is withheld from a training job, training advice from a server.
3. One per kind: the first proposal of a kind (the primary finding's, else the strongest finding's) gives the title
   and action, and names every rule that proposed it. Its gain is the best any proposal can stand behind: the
   best-grounded estimate (of the rule that needs the most evidence present before it fires: BAT002 sizes the batch
   from the running batch, the queue and the ridge, BAT001 from a fixed factor), no larger than the tightest upper
   bound any proposal measured (the straggler's lead caps what balancing the ranks can give, whatever the stream
   waits would allow); with no estimate, the tightest bound.
4. Bounded by what was measured: a host-side fix cannot beat a GPU busy all the time (1 / busy), a kernel fix cannot
   beat the floor (1 / efficiency), and nothing is promised beyond 20x. A bound that cuts a gain makes it an upper
   bound and says so. A fix sized from the timeline's host gaps (a host-side fix, or any fix of a host/launch finding
   read from the trace: HOST002's larger batch, HOST003's fused kernels) is not sized at all from a trace window that
   one pause of the host's holds most of (a warm-up, a first call): the idle it would remove is that pause's, not
   the workload's. Nor is any fix sized from the timeline's idle gaps (those, and the stream waits) from a trace
   holding a sample of its events (a launch missing from the sample reads as the host late, a kernel missing as
   idle). One sized from a cut-short trace says so (its last step may be partial).
Then the ranking: the fixes for the verdict's limiter first (for a GPU that waits for work, batching, host and idle
fixes together: with requests queued, a larger batch may be the first lever of a host-bound server), then the other
speed fixes, capacity gains last (more throughput only if more load is offered); within each, by expected gain
(predicted gain x the finding's strength). On a near tie the fixes of both limiters rank together by their gain alone,
and an estimate that stands on an efficiency reached elsewhere (a tuned engine's) ranks after the gains sized from
this workload's own measurements that are worth a change.
"""

from __future__ import annotations

from dataclasses import replace

from diagnoser.characterise import LONG_PAUSE
from diagnoser.diagnosis import (
    SERVING_ONLY,
    TRAINING_ONLY,
    Benefit,
    Finding,
    Fix,
    FixKind,
    GainKind,
    Limiter,
    Withheld,
)
from diagnoser.evidence import Evidence
from diagnoser.rules.gains import MAX_GAIN, floor_bound, host_bound, sequence_limit
from diagnoser.rules.ruleset import RuleSet

_HOST_SIDE = {FixKind.CUDA_GRAPHS, FixKind.OFFLOAD_HOST_WORK, FixKind.REMOVE_SYNCS, FixKind.PIN_MEMORY,
              FixKind.HOST_CPU}
_KERNEL_SIDE = {FixKind.FUSE_KERNELS, FixKind.TUNED_ENGINE}
# Limiters of a GPU that waits for work: their fixes rank together ahead of the rest when the verdict is one of them.
_UNDERFED = {Limiter.BATCHING, Limiter.HOST_LAUNCH, Limiter.IDLE}
# Fixes whose estimate stands on an efficiency other engines reach (a tuned decode path at 70 % of the bandwidth
# ceiling), not on what this workload measured: measured on the H200's FP32 decode, serving in 16-bit realised x1.75
# and x3.09 where a change of engine was estimated at x2.6 and x6.9 (tests/fixtures/gpu/hf/README.md).
_ASSUMED = {FixKind.TUNED_ENGINE}
ASSUMED_RANK = 1.25
# A capacity trade withheld where another fix offered removes its cause the other way: admitting fewer sequences
# (a lower --max-num-seqs) stops KV evictions, as does a KV cache given more room, which lets the batch grow up to the
# sequence cap and names raising the cap next; both on one page would advise the same knob in two directions.
_SUPERSEDED = {FixKind.STOP_PREEMPTION: (FixKind.KV_MEMORY, FixKind.FP8_KV)}
# The trace's idle shares by cause: a finding that stands on one (cites it against a threshold) sized its fixes
# from the timeline's gaps.
_IDLE_SIGNALS = "trace.idle."


def _from_host_gaps(fix: Fix, finding: Finding | None) -> bool:
    """Whether the fix's gain comes from the trace's host gaps: a host-side fix, or any fix of a host/launch finding
    read from the trace (HOST002's larger batch and HOST003's fused kernels are sized from the same launch gaps)."""
    if fix.kind in _HOST_SIDE:
        return True
    return (finding is not None and finding.limiter is Limiter.HOST_LAUNCH
            and any(c.signal.startswith("trace.") for c in finding.citations))


def _from_idle_gaps(fix: Fix, finding: Finding | None) -> bool:
    """Whether the fix's gain comes from the timeline's idle gaps of any cause (host, sync, stream waits)."""
    return _from_host_gaps(fix, finding) or (
        finding is not None and any(c.signal.startswith(_IDLE_SIGNALS) and c.op for c in finding.citations))


def _bounded(fix: Fix, ev: Evidence, finding: Finding | None = None) -> Fix:
    if fix.gain is None or fix.benefit is not Benefit.SPEED:
        return _cap(fix)
    gain = fix.gain
    pause = ev.trace.longest_gap_frac if ev.trace is not None else None
    # A pause of the host's making (not a queue with no work, which host fixes do not remove); a capture that predates
    # the pause's cause ("") counts as one.
    hosts = ev.trace is not None and ev.trace.longest_gap_cause in ("", "host", "sync", "pageable_memcpy")
    if _from_host_gaps(fix, finding) and hosts and pause is not None and pause >= LONG_PAUSE:
        return _unsized(fix, f"one pause holds {pause:.0%} of its window (a warm-up, a first call), so the idle it "
                        f"would remove is the pause's, not the workload's ({gain:.1f}x from this window); trace the "
                        "steady state to size it")
    if _from_idle_gaps(fix, finding) and ev.trace is not None and ev.trace.sampled:
        # Why the trace is a sample is said once, by the confidence's reasons and the trace's notes; each fix
        # says only that it is one.
        return _unsized(fix, "it holds a sample of its events, so which gaps the GPU idled in is not known (a launch "
                        f"missing from the sample reads as the host late, a kernel missing as idle); {gain:.1f}x from "
                        "the sample")
    if fix.kind in _HOST_SIDE | _KERNEL_SIDE and ev.trace is not None and ev.trace.truncated:
        # Sized from the shares of what was read: a cut-short file can end inside a step.
        fix = replace(fix, basis=fix.basis + "; from a trace cut short, whose last step may be partial: the whole "
                      "trace would size it")
    bound = None
    if fix.kind in _HOST_SIDE:
        bound = host_bound(ev)
    elif fix.kind in _KERNEL_SIDE:
        bound = floor_bound(ev)
    if bound is not None and gain > bound[0] + 1e-9:
        fix = replace(fix, gain=bound[0], gain_kind=GainKind.UPPER_BOUND, gain_low=None, gain_high=None,
                      capped=(fix.capped + "; " if fix.capped else "")
                      + f"bounded by {bound[1]} (from {gain:.2f}x)")
    return _cap(fix)


def _unsized(fix: Fix, why: str) -> Fix:
    """The fix with no gain, and why the trace cannot size it."""
    return replace(fix, gain=None, gain_kind=GainKind.ESTIMATE, capped="", gain_low=None, gain_high=None,
                   basis=f"not sized from this trace: {why}")


def _cap(fix: Fix) -> Fix:
    if fix.gain is not None and fix.gain > MAX_GAIN:
        return replace(fix, gain=MAX_GAIN, gain_kind=GainKind.UPPER_BOUND, gain_low=None, gain_high=None,
                       capped=(fix.capped + "; " if fix.capped else "") + f"capped at {MAX_GAIN:g}x (from "
                       f"{fix.gain:.1f}x)")
    return fix


def _misfit(kind: FixKind, ev: Evidence) -> str:
    if ev.workload == "training" and kind in SERVING_ONLY:
        return "serving-engine advice, and this is a training job"
    if ev.workload == "inference" and kind in TRAINING_ONLY:
        return "training advice, and this is an inference workload"
    return ""


def _grounding(fix: Fix, rules: RuleSet | None) -> int:
    """How many pieces of evidence (a signal, or one of a set) the proposing rule needs present before it fires: a
    proxy for how much of what was measured its estimate rests on (BAT002 needs the running batch, the queue and the
    ridge; BAT001 the busy share and the queue, and sizes the batch by a fixed factor)."""
    rule = rules.get(fix.rule) if rules is not None else None
    return len(rule.requires) if rule is not None else 0


def _merged(proposals: list[Fix], rules: RuleSet | None) -> Fix:
    """One fix from every proposal of its kind (each already judged): the first one's title and action, every rule
    named, and the gain the proposals together support: the best-grounded estimate no larger than the tightest
    upper bound, else the tightest bound."""
    first = proposals[0]
    names = tuple(dict.fromkeys(r for p in proposals for r in (p.rules or (p.rule,))))
    sized = [p for p in proposals if p.gain is not None and p.benefit is first.benefit]
    if not sized:
        return replace(first, rules=names)
    bounds = [p for p in sized if p.is_upper_bound]
    estimates = [p for p in sized if not p.is_upper_bound]
    # max() keeps the first of equals: ties go to the more important finding's proposal.
    chosen = max(estimates, key=lambda p: _grounding(p, rules)) if estimates else min(bounds, key=lambda p: p.gain or 0)
    tight = min(bounds, key=lambda p: p.gain or 0) if bounds else None
    gain, kind, capped, basis = chosen.gain, chosen.gain_kind, chosen.capped, chosen.basis
    span = (chosen.gain_low, chosen.gain_high)
    if chosen.rule != first.rule:
        basis = f"{basis} [{chosen.rule}]"
    if tight is not None and tight is not chosen and gain is not None and tight.gain is not None \
            and gain > tight.gain + 1e-9:
        capped = (capped + "; " if capped else "") + f"bounded by {tight.rule}'s {tight.basis} (from {gain:.2f}x)"
        gain, kind, span = tight.gain, GainKind.UPPER_BOUND, (None, None)
    return replace(first, gain=gain, gain_kind=kind, capped=capped, basis=basis, rules=names, gain_low=span[0],
                   gain_high=span[1])


def judge_fixes(findings: list[Finding], ev: Evidence, rules: RuleSet | None = None,
                tied: Limiter | None = None) -> tuple[list[Fix], list[Withheld]]:
    """`findings` in order of importance (primary first). Returns the ranked fixes and those withheld. `rules` (the
    rule set that ran) tells which proposal of a kind is the best grounded. `tied`: the limiter the verdict's won over
    by a near tie, whose fixes rank with the verdict's."""
    if not findings:
        return [], []
    primary = findings[0]
    proposed: dict[FixKind, tuple[list[Fix], Finding, int]] = {}
    withheld: dict[FixKind, Withheld] = {}
    order = 0
    for finding in findings:
        for fix in finding.fixes:
            why = ev.in_place.get(fix.kind) or _misfit(fix.kind, ev)
            if why:
                withheld.setdefault(fix.kind, Withheld(fix.kind, fix.title, why, fix.rule))
                continue
            if not fix.rules:
                fix = replace(fix, rules=(fix.rule,))
            judged = _bounded(fix, ev, finding)
            if fix.kind in proposed:
                proposed[fix.kind][0].append(judged)
                continue
            proposed[fix.kind] = ([judged], finding, order)
            order += 1

    limit = sequence_limit(ev)
    for kind, by in _SUPERSEDED.items():
        # Only where a fix offered raises the server's sequence cap (its batch stops there: "raising it is the next
        # fix"): then lowering the same cap would advise one knob both ways.
        covering = [k for k in by if k in proposed and limit is not None and any(
            limit.setting in f"{p.action} {p.basis}" for p in proposed[k][0])]
        if kind in proposed and covering and kind not in withheld:
            first = proposed.pop(kind)[0][0]
            withheld[kind] = Withheld(kind, first.title, f"the {covering[0].value.replace('_', ' ')} fix stops the "
                                      f"evictions by giving the cache room and raises {limit.setting if limit else ''} "
                                      "next; admitting fewer sequences would lower the same cap", first.rule)

    def tier(limiter: Limiter) -> int:
        if limiter is primary.limiter or (limiter in _UNDERFED and primary.limiter in _UNDERFED):
            return 0
        if tied is not None and (limiter is tied or (limiter in _UNDERFED and tied in _UNDERFED)):
            return 0
        return 1

    def rank(item: tuple[Fix, Finding, int]) -> tuple[int, float, int]:
        fix, finding, at = item
        level = 2 if fix.benefit is Benefit.CAPACITY else tier(finding.limiter)
        expected = 1 + ((fix.gain if fix.gain is not None else 1.1) - 1) * finding.strength
        # On a near tie both limiters' fixes compete on the gain alone: the strengths are the tie's, not a ranking.
        if tied is not None and level == 0:
            expected = fix.gain if fix.gain is not None else 1.1
        # A gain from an efficiency reached elsewhere ranks after the gains sized from this workload's own bytes, FLOPs
        # and time split that are worth a change (above ASSUMED_RANK), before those below it.
        if fix.kind in _ASSUMED and fix.gain is not None and not fix.is_upper_bound:
            expected = min(expected, ASSUMED_RANK)
        return level, -expected, at

    kept = [(_merged(fixes, rules), finding, at) for fixes, finding, at in proposed.values()]
    ranked = [fix for fix, _, _ in sorted(kept, key=rank)]
    return ranked, list(withheld.values())


__all__ = ["judge_fixes"]
