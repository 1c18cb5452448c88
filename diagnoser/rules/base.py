"""What a rule is: a code, a name, the limiter it points to, the signals it needs, visible thresholds, a predicate
and a page (what it detects, why it limits throughput, the fixes, the sources of its thresholds).

Writing a rule:

    @rule(code="BW001", name="dram-bandwidth-saturated", limiter=Limiter.MEMORY_BANDWIDTH, summary="...",
          requires=(S.GPU_DRAM_ACTIVE, AnyOf(S.GPU_BUSY, S.GPU_SM_ACTIVE)), uses=(S.GPU_TENSOR_ACTIVE,),
          thresholds={"dram_active_mean": Threshold(0.6, "DRAM activity at or above which ...", "ratio")},
          page=Page(detects="DRAM activity at or above {dram_active_mean} ...", why=..., fixes=..., sources=...))
    def dram_bandwidth_saturated(c: Check) -> Finding | None:
        dram = c.req(S.GPU_DRAM_ACTIVE)          # a Signal: the engine runs the rule only when it is present
        busy = c.first(S.GPU_BUSY, S.GPU_SM_ACTIVE)
        tensor = c.opt(S.GPU_TENSOR_ACTIVE)      # Signal | None
        ...
        c.fix(FixKind.FP8_WEIGHTS, "Serve FP8 weights", "...", gains.dtype_gain(c.ev, "fp8"))
        return c.finding(0.8, "one sentence")

Signals are named by their constants in diagnoser.signals (S); `@rule` rejects a name that is not registered, a
threshold the page names but the rule lacks, and a duplicate requirement. `@rule` returns the Rule; it registers
nothing: each rule module lists its rules in `RULES`, and diagnoser.rules.ruleset.RuleSet runs a tuple of them.
A page's text may name thresholds in braces, `{dram_active_mean}`: `Rule.page_for(thresholds)` fills in the values in
force (with the threshold's unit), so an overridden threshold reads right on the page too.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

from diagnoser.diagnosis import Benefit, Citation, Finding, Fix, FixKind, GainKind, Limiter, Regime
from diagnoser.evidence import Evidence, Signal
from diagnoser.signals import Sig, known
from diagnoser.units import fmt


@dataclass(frozen=True)
class Threshold:
    value: float
    meaning: str
    unit: str = ""  # ratio, bytes, s, ...: how the value reads on the rule's page

    def text(self, value: float | None = None) -> str:
        v = self.value if value is None else value
        if self.unit:
            return fmt(v, self.unit)
        return f"{v:g}"


@dataclass(frozen=True)
class Page:
    detects: str
    why: str
    fixes: str
    sources: str

    def fields(self) -> dict[str, str]:
        return {"detects": self.detects, "why": self.why, "fixes": self.fixes, "sources": self.sources}


@dataclass(frozen=True)
class AnyOf:
    """A requirement met by any one of several signals (GPU busy from NVML, or SM activity from GPM)."""

    names: tuple[Sig, ...]

    def __init__(self, *names: Sig) -> None:
        object.__setattr__(self, "names", tuple(names))

    def __str__(self) -> str:
        return " or ".join(self.names)


Requirement = Sig | AnyOf


@dataclass(frozen=True)
class Gain:
    """A predicted throughput multiplier and how it was reached. `None` value: not predictable (basis says why)."""

    value: float | None
    basis: str
    kind: GainKind = GainKind.ESTIMATE
    benefit: Benefit = Benefit.SPEED
    capped: str = ""

    @classmethod
    def unknown(cls, why: str, benefit: Benefit = Benefit.SPEED) -> Gain:
        return cls(None, why, benefit=benefit)

    def bounded(self, bound: float, why: str) -> Gain:
        """This gain, no larger than `bound` (an Amdahl bound from a measured time split, say)."""
        if self.value is None or self.value <= bound:
            return self
        return replace(self, value=bound, kind=GainKind.UPPER_BOUND,
                       capped=(self.capped + "; " if self.capped else "") + f"{why} (from {self.value:.2f}x)")

    def as_capacity(self, why: str) -> Gain:
        return replace(self, benefit=Benefit.CAPACITY, basis=f"{self.basis}; {why}" if self.basis else why)


class Check:
    """What a predicate gets: the evidence, the thresholds in force, and helpers to read, cite and conclude.

    `req` and `first` return signals the rule requires (present: the engine checked); `opt` one it uses (maybe
    absent). Asking for a signal the rule did not declare is a bug in the rule, and raises."""

    def __init__(self, rule: Rule, ev: Evidence, thresholds: Mapping[str, float]) -> None:
        self.rule = rule
        self.ev = ev
        self.t = thresholds
        self.citations: list[Citation] = []
        self.fixes: list[Fix] = []

    def req(self, name: Sig) -> Signal:
        if name not in self.rule.required_names:
            raise KeyError(f"{self.rule.code} reads {name} with req() but does not require it")
        return self.ev.signals[name]

    def first(self, *names: Sig) -> Signal:
        for name in names:
            if name not in self.rule.required_names:
                raise KeyError(f"{self.rule.code} reads {name} with first() but does not require it")
            found = self.ev.signals.get(name)
            if found is not None:
                return found
        raise KeyError(f"{self.rule.code}: none of {', '.join(names)} is present")

    def opt(self, name: Sig) -> Signal | None:
        if name not in self.rule.declared:
            raise KeyError(f"{self.rule.code} reads {name} but neither requires nor uses it")
        return self.ev.signals.get(name)

    def cite(self, signal: Signal, stat: str = "mean", op: str = "", threshold: float | None = None) -> float:
        """Record a number this finding stands on, and return it."""
        if signal.n == 1 and signal.from_samples and (stat == "value" or stat in _POINT_STATS):
            value, shown = signal.values[0], "value"  # a one-number signal (trace, physics) has no statistics
        else:
            value, shown = signal.stat("mean" if stat == "value" else stat), stat
        bucket = signal.bucket if stat in ("value", "mean") or signal.n == 1 else None
        self.citations.append(Citation(signal.name, shown, value, signal.unit, signal.source, op, threshold, bucket))
        return value

    def fix(self, kind: FixKind, title: str, action: str, gain: Gain | None = None) -> None:
        g = gain or Gain(None, "")
        self.fixes.append(Fix(title=title, action=action, gain=g.value, basis=g.basis, rule=self.rule.code,
                              kind=kind, gain_kind=g.kind, benefit=g.benefit, capped=g.capped,
                              rules=(self.rule.code,)))

    def finding(self, strength: float, message: str, *, regime: Regime = Regime.UNKNOWN,
                saturation: float | None = None) -> Finding:
        return Finding(
            code=self.rule.code,
            name=self.rule.name,
            limiter=self.rule.limiter,
            strength=max(0.0, min(1.0, strength)),
            message=message,
            citations=tuple(self.citations),
            fixes=tuple(self.fixes),
            regime=regime,
            saturation=saturation,
        )


_POINT_STATS = ("mean", "p50", "p90", "p99", "min", "max")

Predicate = Callable[[Check], "Finding | None"]


@dataclass(frozen=True)
class Rule:
    code: str
    name: str
    limiter: Limiter
    summary: str
    requires: tuple[Requirement, ...]
    uses: tuple[Sig, ...]
    thresholds: Mapping[str, Threshold]
    page: Page
    predicate: Predicate = field(compare=False)
    # Whether a finding of this rule can name the verdict on its own (False: it says where the time goes but not
    # which roof, and the verdict stays inconclusive).
    decisive: bool = True
    # An advisory rule reports a latency tail or a client-side effect: its finding and fixes are listed, but it never
    # names the verdict (a server with a slow p99 and nothing waiting is not "batching-limited").
    advisory: bool = False

    # Cached (the fields are frozen): a fleet asks each rule for these about ten times per GPU.
    @functools.cached_property
    def required_names(self) -> frozenset[str]:
        names: set[str] = set()
        for req in self.requires:
            names.update(req.names if isinstance(req, AnyOf) else (req,))
        return frozenset(names)

    @functools.cached_property
    def declared(self) -> frozenset[str]:
        return self.required_names | frozenset(self.uses)

    def missing(self, ev: Evidence) -> list[Requirement]:
        signals = ev.signals
        out: list[Requirement] = []
        for req in self.requires:
            if isinstance(req, AnyOf):
                if not any(n in signals for n in req.names):
                    out.append(req)
            elif req not in signals:
                out.append(req)
        return out

    def defaults(self) -> dict[str, float]:
        return {name: t.value for name, t in self.thresholds.items()}

    def page_for(self, thresholds: Mapping[str, float] | None = None) -> Page:
        """The page with every {threshold} replaced by the value in force, in its unit."""
        values = {name: t.text((thresholds or {}).get(name)) for name, t in self.thresholds.items()}
        return Page(**{k: v.format_map(values) for k, v in self.page.fields().items()})

    def threshold_lines(self, thresholds: Mapping[str, float] | None = None) -> list[tuple[str, str, str]]:
        """(name, value in force, meaning) for each threshold."""
        return [(name, t.text((thresholds or {}).get(name)), t.meaning) for name, t in self.thresholds.items()]


_CODE = re.compile(r"^[A-Z]+[0-9]{3}$")


def _check_names(code: str, what: str, names: tuple[str, ...]) -> None:
    for name in names:
        try:
            known(name)
        except Exception:
            raise ValueError(f"rule {code} {what} unknown signal '{name}'") from None


def rule(
    *,
    code: str,
    name: str,
    limiter: Limiter,
    summary: str,
    requires: tuple[Requirement, ...],
    uses: tuple[Sig, ...] = (),
    thresholds: Mapping[str, Threshold],
    page: Page,
    decisive: bool = True,
    advisory: bool = False,
) -> Callable[[Predicate], Rule]:
    """Make a Rule of a predicate, after checking its declaration (see the module docstring)."""
    if not _CODE.match(code):
        raise ValueError(f"rule code {code!r} is not letters then three digits")
    flat: list[str] = []
    for req in requires:
        flat.extend(req.names if isinstance(req, AnyOf) else (req,))
    _check_names(code, "requires", tuple(flat))
    _check_names(code, "uses", tuple(uses))
    if len(set(flat)) != len(flat):
        raise ValueError(f"rule {code} requires a signal twice")
    fields = {f for text in page.fields().values() for _, f, _, _ in string.Formatter().parse(text) if f}
    unknown = fields - set(thresholds)
    if unknown:
        raise ValueError(f"rule {code}'s page names thresholds it does not have: {', '.join(sorted(unknown))}")

    def make(predicate: Predicate) -> Rule:
        return Rule(code, name, limiter, summary, tuple(requires), tuple(uses), dict(thresholds), page, predicate,
                    decisive, advisory)

    return make


__all__ = ["AnyOf", "Check", "Gain", "Page", "Requirement", "Rule", "Threshold", "rule"]
