"""From the fixes the rules proposed to the ranked list a user reads.

Four checks a demanding engineer would make, applied to every fix whatever rule proposed it:
1. Not already in place: a fix the capture shows applied (CUDA graph replays in the trace, FP8 weights in the model,
   an engine that batches continuously) is withheld, with the evidence.
2. Fits the workload: serving-engine advice is withheld from a training job, training advice from a server.
3. One per kind: the first proposal of a kind (the primary finding's, else the strongest finding's) stands, and
   names every rule that proposed it.
4. Bounded by what was measured: a host-side fix cannot beat a GPU busy all the time (1 / busy), a kernel fix cannot
   beat the floor (1 / efficiency), and nothing is promised beyond 20x. A bound that cuts a gain makes it an upper
   bound and says so. A host-side fix is not sized at all from a trace window that one pause holds most of (a
   warm-up, a first call): the idle it would remove is that pause's, not the workload's; nor from a trace holding a
   sample of its events (a launch missing from the sample reads as the host late). One sized from a cut-short trace
   says so (its last step may be partial).
Then the ranking: the fixes for the verdict's limiter first, then the other speed fixes, capacity gains last (more
throughput only if more load is offered); within each, by expected gain (predicted gain x the finding's strength).
"""

from __future__ import annotations

from dataclasses import replace

from diagnoser.characterise import LONG_PAUSE
from diagnoser.diagnosis import SERVING_ONLY, TRAINING_ONLY, Benefit, Finding, Fix, FixKind, GainKind, Withheld
from diagnoser.evidence import Evidence
from diagnoser.rules.gains import MAX_GAIN, floor_bound, host_bound

_HOST_SIDE = {FixKind.CUDA_GRAPHS, FixKind.OFFLOAD_HOST_WORK, FixKind.REMOVE_SYNCS, FixKind.PIN_MEMORY,
              FixKind.HOST_CPU}
_KERNEL_SIDE = {FixKind.FUSE_KERNELS, FixKind.TUNED_ENGINE}


def _bounded(fix: Fix, ev: Evidence) -> Fix:
    if fix.gain is None or fix.benefit is not Benefit.SPEED:
        return _cap(fix)
    gain = fix.gain
    pause = ev.trace.longest_gap_frac if ev.trace is not None else None
    # A pause of the host's making (not a queue with no work, which host fixes do not remove); a capture that predates
    # the pause's cause ("") counts as one.
    hosts = ev.trace is not None and ev.trace.longest_gap_cause in ("", "host", "sync", "pageable_memcpy")
    if fix.kind in _HOST_SIDE and hosts and pause is not None and pause >= LONG_PAUSE:
        return _unsized(fix, f"one pause holds {pause:.0%} of its window (a warm-up, a first call), so the idle it "
                        f"would remove is the pause's, not the workload's ({gain:.1f}x from this window); trace the "
                        "steady state to size it")
    if fix.kind in _HOST_SIDE and ev.trace is not None and ev.trace.sampled:
        return _unsized(fix, f"it holds a sample of its events ({ev.trace.sampled_reason or 'sampled'}), so which "
                        "gaps the host left is not known (a launch missing from the sample reads as the host late); "
                        f"{gain:.1f}x from the sample")
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
        fix = replace(fix, gain=bound[0], gain_kind=GainKind.UPPER_BOUND,
                      capped=(fix.capped + "; " if fix.capped else "")
                      + f"bounded by {bound[1]} (from {gain:.2f}x)")
    return _cap(fix)


def _unsized(fix: Fix, why: str) -> Fix:
    """The fix with no gain, and why the trace cannot size it."""
    return replace(fix, gain=None, gain_kind=GainKind.ESTIMATE, capped="", basis=f"not sized from this trace: {why}")


def _cap(fix: Fix) -> Fix:
    if fix.gain is not None and fix.gain > MAX_GAIN:
        return replace(fix, gain=MAX_GAIN, gain_kind=GainKind.UPPER_BOUND,
                       capped=(fix.capped + "; " if fix.capped else "") + f"capped at {MAX_GAIN:g}x (from "
                       f"{fix.gain:.1f}x)")
    return fix


def _misfit(kind: FixKind, ev: Evidence) -> str:
    if ev.workload == "training" and kind in SERVING_ONLY:
        return "serving-engine advice, and this is a training job"
    if ev.workload == "inference" and kind in TRAINING_ONLY:
        return "training advice, and this is an inference workload"
    return ""


def judge_fixes(findings: list[Finding], ev: Evidence) -> tuple[list[Fix], list[Withheld]]:
    """`findings` in order of importance (primary first). Returns the ranked fixes and those withheld."""
    if not findings:
        return [], []
    primary = findings[0]
    kept: dict[FixKind, tuple[Fix, Finding, int]] = {}
    withheld: dict[FixKind, Withheld] = {}
    order = 0
    for finding in findings:
        for fix in finding.fixes:
            why = ev.in_place.get(fix.kind) or _misfit(fix.kind, ev)
            if why:
                withheld.setdefault(fix.kind, Withheld(fix.kind, fix.title, why, fix.rule))
                continue
            if fix.kind in kept:
                first, by, at = kept[fix.kind]
                if fix.rule not in first.rules:
                    kept[fix.kind] = (replace(first, rules=first.rules + (fix.rule,)), by, at)
                continue
            if not fix.rules:
                fix = replace(fix, rules=(fix.rule,))
            kept[fix.kind] = (_bounded(fix, ev), finding, order)
            order += 1

    def rank(item: tuple[Fix, Finding, int]) -> tuple[int, float, int]:
        fix, finding, at = item
        if fix.benefit is Benefit.CAPACITY:
            tier = 2
        elif finding.limiter is primary.limiter:
            tier = 0
        else:
            tier = 1
        expected = 1 + ((fix.gain if fix.gain is not None else 1.1) - 1) * finding.strength
        return tier, -expected, at

    ranked = [fix for fix, _, _ in sorted(kept.values(), key=rank)]
    return ranked, list(withheld.values())


__all__ = ["judge_fixes"]
