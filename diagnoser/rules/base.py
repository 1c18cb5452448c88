"""What a rule is: a code, a name, the limiter it points to, the signals it needs, visible thresholds, a predicate
and a page (what it detects, why it limits throughput, the fixes, the sources of its thresholds).

Rules are registered with the `@rule` decorator; `diagnoser rules CODE` prints the page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from diagnoser.diagnosis import Citation, Finding, Fix, Limiter
from diagnoser.evidence import Evidence, Signal


@dataclass(frozen=True)
class Threshold:
    value: float
    meaning: str


@dataclass(frozen=True)
class Page:
    detects: str
    why: str
    fixes: str
    sources: str


_POINT_STATS = ("mean", "p50", "p90", "p99", "min", "max")


class Check:
    """What a predicate gets: the evidence, the thresholds in force, and helpers to cite and conclude."""

    def __init__(self, rule: Rule, ev: Evidence, thresholds: Mapping[str, float]) -> None:
        self.rule = rule
        self.ev = ev
        self.t = thresholds
        self.citations: list[Citation] = []
        self.fixes: list[Fix] = []

    def sig(self, name: str) -> Signal | None:
        return self.ev.get(name)

    def cite(self, signal: Signal, stat: str = "mean", op: str = "", threshold: float | None = None) -> float:
        """Record a number this finding stands on, and return it."""
        if signal.n == 1 and (stat == "value" or stat in _POINT_STATS):
            value, shown = signal.values[0], "value"  # a one-number signal (trace, physics) has no statistics
        else:
            value, shown = signal.stat("mean" if stat == "value" else stat), stat
        self.citations.append(Citation(signal.name, shown, value, signal.unit, signal.source, op, threshold))
        return value

    def fix(self, title: str, action: str, gain: float | None = None, basis: str = "") -> None:
        self.fixes.append(Fix(title, action, gain, basis, self.rule.code))

    def finding(self, strength: float, message: str) -> Finding:
        return Finding(
            code=self.rule.code,
            name=self.rule.name,
            limiter=self.rule.limiter,
            strength=max(0.0, min(1.0, strength)),
            message=message,
            citations=tuple(self.citations),
            fixes=tuple(self.fixes),
        )


Predicate = Callable[[Check], "Finding | None"]


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    limiter: Limiter
    summary: str
    # Each entry is a signal name, or alternatives separated by "|" of which one is enough.
    requires: tuple[str, ...]
    uses: tuple[str, ...]
    thresholds: Mapping[str, Threshold]
    page: Page
    predicate: Predicate = field(compare=False)

    def missing(self, ev: Evidence) -> list[str]:
        # Called for every rule of every diagnosis (10,000 per fleet run): the alternatives are split once.
        alternatives = _ALTERNATIVES.get(self.requires)
        if alternatives is None:
            alternatives = _ALTERNATIVES[self.requires] = tuple((req, tuple(req.split("|"))) for req in self.requires)
        signals = ev.signals
        return [req for req, alts in alternatives
                if alts[0] not in signals and not (len(alts) > 1 and any(alt in signals for alt in alts[1:]))]

    def skip_reason(self, ev: Evidence) -> str | None:
        missing = self.missing(ev)
        if not missing:
            return None
        # The sentence depends only on what is missing and on the capture's unavailable list, which a fleet's GPUs
        # mostly share: built once per distinct case (and then one string object, which pickles once per chunk).
        key = (self.code, tuple(missing), ev.absent_key())
        reason = _SKIP_REASONS.get(key)
        if reason is None:
            parts = []
            for req in missing:
                first = req.split("|")[0]
                parts.append(f"{req.replace('|', ' or ')} ({ev.why_missing(first)})")
            reason = "needs " + "; ".join(parts)
            if len(_SKIP_REASONS) >= _SKIP_REASONS_MAX:
                _SKIP_REASONS.clear()
            _SKIP_REASONS[key] = reason
        return reason


RULES: dict[str, Rule] = {}
_SKIP_REASONS: dict[tuple[str, tuple[str, ...], tuple[tuple[str, str, str], ...]], str] = {}
_SKIP_REASONS_MAX = 4096
_ALTERNATIVES: dict[tuple[str, ...], tuple[tuple[str, tuple[str, ...]], ...]] = {}


def rule(
    *,
    code: str,
    name: str,
    limiter: Limiter,
    summary: str,
    requires: tuple[str, ...],
    uses: tuple[str, ...] = (),
    thresholds: Mapping[str, Threshold],
    page: Page,
) -> Callable[[Predicate], Rule]:
    def register(predicate: Predicate) -> Rule:
        if code in RULES:
            raise ValueError(f"duplicate rule code {code}")
        r = Rule(code, name, limiter, summary, requires, uses, dict(thresholds), page, predicate)
        RULES[code] = r
        return r

    return register


def ratio_gain(after: float, before: float, cap: float = 20.0) -> float | None:
    """A throughput multiplier from two rates, None if either is unusable."""
    if before <= 0 or after <= 0:
        return None
    return min(cap, after / before)
