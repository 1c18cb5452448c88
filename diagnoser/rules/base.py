"""What a rule is: a code, a name, the limiter it points to, the signals it needs, visible thresholds, a predicate
and a page (what it detects, why it limits throughput, the fixes, the sources of its thresholds).

Writing a rule:

    @rule(code="BW001", name="dram-bandwidth-saturated", limiter=Limiter.MEMORY_BANDWIDTH, summary="...",
          requires=(S.GPU_DRAM_ACTIVE, AnyOf(S.GPU_BUSY, S.GPU_SM_ACTIVE)), uses=(S.GPU_TENSOR_ACTIVE,),
          reads={S.GPU_DRAM_ACTIVE: (MEAN,), S.GPU_BUSY: (MEAN,), S.GPU_SM_ACTIVE: (MEAN,),
                 S.GPU_TENSOR_ACTIVE: (MEAN,)},
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
threshold the page names but the rule lacks, and a duplicate requirement. `reads` declares, per signal, the statistics
the predicate reads (MEAN, P90, FRAC_ABOVE, ...): `req`/`first`/`opt` hand the predicate a `Reading` that answers
those only, and reading another raises `UndeclaredStatistic` naming the rule, so what a rule reads is known without
running it (the fleet derives its DCGM statistics from it, and RuleSet refuses a rule whose reads the fleet cannot
produce). A signal read only for its presence needs no entry; its name, unit, sources and sample count are free.
`fleet=` gives the rule's conclusion from its statistics as a formula (rules/formula.py), the predicate's test and
strength written in PromQL's vector algebra: `Check.formula()` evaluates it, the fleet's rule group compiles it to
PromQL, and `@rule` refuses one that reads a statistic, a signal or a threshold the rule does not declare.
`@rule` returns the Rule; it registers nothing: each rule module lists its rules in `RULES`, and
diagnoser.rules.ruleset.RuleSet runs a tuple of them.
A page's text may name thresholds in braces, `{dram_active_mean}`: `Rule.page_for(thresholds)` fills in the values in
force (with the threshold's unit), so an overridden threshold reads right on the page too.
"""

from __future__ import annotations

import functools
import re
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

from diagnoser.diagnosis import Benefit, Citation, Finding, Fix, FixKind, GainKind, Limiter, Regime
from diagnoser.engines.knobs import Setting
from diagnoser.evidence import Evidence, Signal
from diagnoser.rules import formula as fm
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
    # An estimate's range, where it has one (the engine's own curve, rules/curve.py): the least and most it allows.
    low: float | None = None
    high: float | None = None

    @classmethod
    def unknown(cls, why: str, benefit: Benefit = Benefit.SPEED) -> Gain:
        return cls(None, why, benefit=benefit)

    def bounded(self, bound: float, why: str) -> Gain:
        """This gain, no larger than `bound` (an Amdahl bound from a measured time split, say)."""
        if self.value is None or self.value <= bound:
            return self
        return replace(self, value=bound, kind=GainKind.UPPER_BOUND, low=None, high=None,
                       capped=(self.capped + "; " if self.capped else "") + f"{why} (from {self.value:.2f}x)")

    def as_capacity(self, why: str) -> Gain:
        return replace(self, benefit=Benefit.CAPACITY, basis=f"{self.basis}; {why}" if self.basis else why)


class Statistic(str, Enum):
    """What a rule may read of a signal (`reads=`): each a property or method of `Signal`."""

    MEAN = "mean"
    VALUE = "value"  # the one number of a one-number signal (trace, physics), else the mean
    P50 = "p50"
    P90 = "p90"
    P99 = "p99"
    MIN = "min"
    MAX = "max"
    QUANTILE = "quantile"  # quantile(q) at any q
    FRAC_ABOVE = "frac_above"  # frac_above(t): the share of samples at or above t
    FRAC_BELOW = "frac_below"
    LOWEST = "lowest"  # a histogram quantile's bucket bounds (Signal.lowest / highest)
    HIGHEST = "highest"
    SAMPLES = "samples"  # the samples themselves: values and times

    def __str__(self) -> str:
        return self.value


MEAN, VALUE, P50, P90, P99, MIN, MAX = (Statistic.MEAN, Statistic.VALUE, Statistic.P50, Statistic.P90, Statistic.P99,
                                        Statistic.MIN, Statistic.MAX)
QUANTILE, FRAC_ABOVE, FRAC_BELOW, LOWEST, HIGHEST, SAMPLES = (
    Statistic.QUANTILE, Statistic.FRAC_ABOVE, Statistic.FRAC_BELOW, Statistic.LOWEST, Statistic.HIGHEST,
    Statistic.SAMPLES)
Reads = Mapping[Sig, tuple[Statistic, ...]]


class UndeclaredStatistic(LookupError):
    """A rule read a statistic of a signal that its `reads=` does not declare: a bug in the rule."""


def _statistic_of(stat: str) -> str:
    """The declared statistic a `Signal.stat` name reads ('frac_above:0.5' -> 'frac_above')."""
    return stat.split(":", 1)[0]


class Reading(Signal):
    """A rule's view of one signal: the statistics the rule declared answer from the signal, any other raises.

    Made by Check (`_reading`) without the dataclass __init__: a fleet makes dozens per GPU."""

    def _allowed(self, stat: str) -> Signal:
        d = self.__dict__
        if stat not in d["_ok"]:
            signal = d["_signal"]
            declared = ", ".join(sorted(d["_ok"])) or "none"
            raise UndeclaredStatistic(f"rule {d['_code']} reads {stat} of {signal.name} but declares only "
                                      f"{declared} (add it to the rule's reads=)")
        signal_: Signal = d["_signal"]
        return signal_

    # What a rule may read freely: which signal, its unit, sources and how many samples it pools.
    name = property(lambda self: self.__dict__["_signal"].name)
    unit = property(lambda self: self.__dict__["_signal"].unit)
    sources = property(lambda self: self.__dict__["_signal"].sources)
    bucket = property(lambda self: self.__dict__["_signal"].bucket)
    n = property(lambda self: self.__dict__["_signal"].n)
    source = property(lambda self: self.__dict__["_signal"].source)
    from_samples = property(lambda self: self.__dict__["_signal"].from_samples)

    # The statistics: each only where declared.
    mean = property(lambda self: self._allowed("mean").mean)
    value = property(lambda self: self._allowed("value").value)
    p50 = property(lambda self: self._allowed("p50").p50)
    p90 = property(lambda self: self._allowed("p90").p90)
    p99 = property(lambda self: self._allowed("p99").p99)
    min = property(lambda self: self._allowed("min").min)
    max = property(lambda self: self._allowed("max").max)
    lowest = property(lambda self: self._allowed("lowest").lowest)
    highest = property(lambda self: self._allowed("highest").highest)
    values = property(lambda self: self._allowed("samples").values)
    times = property(lambda self: self._allowed("samples").times)

    def quantile(self, q: float) -> float:
        return self._allowed("quantile").quantile(q)

    def frac_above(self, threshold: float) -> float:
        return self._allowed("frac_above").frac_above(threshold)

    def frac_below(self, threshold: float) -> float:
        return self._allowed("frac_below").frac_below(threshold)

    def stat(self, name: str) -> float:
        return self._allowed(_statistic_of(name)).stat(name)

    def unwrap(self, stat: str) -> Signal:
        """The signal itself, once `stat` is checked as declared (Check.cite reads through it)."""
        return self._allowed(_statistic_of(stat))

    def __repr__(self) -> str:
        return f"Reading({self.__dict__['_code']}, {self.__dict__['_signal']!r})"

    __hash__ = object.__hash__

    def __eq__(self, other: object) -> bool:
        return self is other


def _reading(signal: Signal, ok: frozenset[str], code: str) -> Signal:
    view = object.__new__(Reading)
    d = view.__dict__  # set directly: the frozen dataclass's __setattr__ refuses, and kwargs cost a dict
    d["_signal"], d["_ok"], d["_code"] = signal, ok, code
    return view


class CannotDecide(Exception):
    """Raised by a predicate that cannot decide from this capture (the limit it compares against is unknown): the rule
    is reported as skipped with this reason, never as passed."""


class Check:
    """What a predicate gets: the evidence, the thresholds in force, and helpers to read, cite and conclude.

    `req` and `first` return signals the rule requires (present: the engine checked); `opt` one it uses (maybe
    absent), each as a `Reading` that answers the statistics the rule declares of it (`reads=`). Asking for a signal
    the rule did not declare, or for a statistic of it the rule did not declare, is a bug in the rule, and raises."""

    def __init__(self, rule: Rule, ev: Evidence, thresholds: Mapping[str, float]) -> None:
        self.rule = rule
        self.ev = ev
        self.t = thresholds
        self.citations: list[Citation] = []
        self.fixes: list[Fix] = []

    def req(self, name: Sig) -> Signal:
        if name not in self.rule.required_names:
            raise KeyError(f"{self.rule.code} reads {name} with req() but does not require it")
        return _reading(self.ev.signals[name], self.rule.statistics[name], self.rule.code)

    def first(self, *names: Sig) -> Signal:
        for name in names:
            if name not in self.rule.required_names:
                raise KeyError(f"{self.rule.code} reads {name} with first() but does not require it")
            found = self.ev.signals.get(name)
            if found is not None:
                return _reading(found, self.rule.statistics[name], self.rule.code)
        raise KeyError(f"{self.rule.code}: none of {', '.join(names)} is present")

    def opt(self, name: Sig) -> Signal | None:
        if name not in self.rule.declared:
            raise KeyError(f"{self.rule.code} reads {name} but neither requires nor uses it")
        found = self.ev.signals.get(name)
        return None if found is None else _reading(found, self.rule.statistics[name], self.rule.code)

    def knob(self, name: str) -> Setting | None:
        """The serving engine's knob `name` in force (engines/): configured, else the engine's default for its
        version, else unknown; None where the engine has no knob table."""
        return self.ev.knob(name)

    def limit(self, name: str) -> Setting:
        """A knob the rule cannot decide without: its setting, or CannotDecide saying why it is unknown."""
        s = self.ev.knob(name)
        if s is None or not s.known:
            why = s.why_unknown if s is not None else f"the engine ({self.ev.serving.engine or 'unknown'}) has no " \
                f"table of its {name}"
            raise CannotDecide(f"cannot decide: {why}")
        return s

    def formula(self) -> float | None:
        """The rule's `fleet=` formula on this evidence: its strength where it fires, else None."""
        if self.rule.fleet is None:
            raise KeyError(f"rule {self.rule.code} has no fleet= formula")
        return self.rule.fleet.value(_CheckEnv(self))

    def cite(self, signal: Signal, stat: str = "mean", op: str = "", threshold: float | None = None) -> float:
        """Record a number this finding stands on, and return it."""
        if isinstance(signal, Reading):
            signal = signal.unwrap(stat)  # a cited statistic is a read statistic: declared
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
                              rules=(self.rule.code,), gain_low=g.low, gain_high=g.high))

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


class _CheckEnv:
    """A formula's leaves read through the Check: declared statistics only, as the predicate reads them."""

    __slots__ = ("c",)

    def __init__(self, c: Check) -> None:
        self.c = c

    def read(self, name: Sig, stat: str) -> float | None:
        found = self.c.opt(name)
        return None if found is None else found.stat(stat)

    def present(self, name: Sig) -> bool:
        return self.c.opt(name) is not None

    def regime(self) -> Regime:
        return self.c.ev.regime

    def threshold(self, name: str) -> float:
        return self.c.t[name]

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
    # The statistics the predicate reads of each signal (a signal absent here is read for its presence only).
    reads: Mapping[str, tuple[Statistic, ...]] = field(default_factory=dict, compare=False)
    # The rule's conclusion from window statistics as a formula (rules/formula.py): what the fleet's rule group
    # compiles to PromQL. Its value on a GPU is the strength of the rule's finding there (tests hold the two equal).
    fleet: fm.Formula | None = field(default=None, compare=False)

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

    @functools.cached_property
    def statistics(self) -> dict[str, frozenset[str]]:
        """Each declared signal's readable statistics, as the names Reading checks."""
        return {name: frozenset(str(s) for s in self.reads.get(name, ())) for name in self.declared}

    def read_pairs(self) -> list[tuple[str, Statistic]]:
        """Every (signal, statistic) the rule declares it reads, in declaration order."""
        return [(name, stat) for name, stats in self.reads.items() for stat in stats]

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


def _check_reads(code: str, declared: set[str], reads: Reads) -> dict[str, tuple[Statistic, ...]]:
    """The rule's reads, checked: statistics of its own signals only, each a known statistic, none twice."""
    out: dict[str, tuple[Statistic, ...]] = {}
    for name, stats in reads.items():
        if name not in declared:
            raise ValueError(f"rule {code} declares statistics of {name}, which it neither requires nor uses")
        if isinstance(stats, str):
            raise ValueError(f"rule {code} declares the statistics of {name} as a string, not a tuple")
        for stat in stats:
            if not isinstance(stat, Statistic):
                raise ValueError(f"rule {code} declares an unknown statistic {stat!r} of {name} "
                                 f"(one of {', '.join(s.value for s in Statistic)})")
        if len(set(stats)) != len(stats):
            raise ValueError(f"rule {code} declares a statistic of {name} twice")
        out[name] = tuple(stats)
    return out


def _check_formula(code: str, formula: fm.Formula, declared: set[str], reads: Mapping[str, tuple[Statistic, ...]],
                   thresholds: Mapping[str, Threshold]) -> None:
    """A rule's formula reads what the rule declares: its signals, the statistics in its reads=, its thresholds."""
    for name in sorted(fm.signals(formula) - declared):
        raise ValueError(f"rule {code}'s fleet formula reads {name}, which it neither requires nor uses")
    for name, stat in sorted(fm.reads(formula)):
        if stat not in {str(s) for s in reads.get(name, ())}:
            raise ValueError(f"rule {code}'s fleet formula reads {stat} of {name}, which its reads= does not declare")
    for name in sorted(fm.thresholds(formula) - set(thresholds)):
        raise ValueError(f"rule {code}'s fleet formula names a threshold it does not have: {name}")


def rule(
    *,
    code: str,
    name: str,
    limiter: Limiter,
    summary: str,
    requires: tuple[Requirement, ...],
    uses: tuple[Sig, ...] = (),
    reads: Reads | None = None,
    thresholds: Mapping[str, Threshold],
    page: Page,
    decisive: bool = True,
    advisory: bool = False,
    fleet: fm.Formula | None = None,
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
    declared_reads = _check_reads(code, set(flat) | set(uses), reads or {})
    if fleet is not None:
        _check_formula(code, fleet, set(flat) | set(uses), declared_reads, thresholds)

    def make(predicate: Predicate) -> Rule:
        return Rule(code, name, limiter, summary, tuple(requires), tuple(uses), dict(thresholds), page, predicate,
                    decisive, advisory, declared_reads, fleet)

    return make


__all__ = ["FRAC_ABOVE", "FRAC_BELOW", "HIGHEST", "LOWEST", "MAX", "MEAN", "MIN", "P50", "P90", "P99", "QUANTILE",
           "SAMPLES", "VALUE", "AnyOf", "Check", "Gain", "Page", "Reading", "Reads", "Requirement", "Rule", "Statistic",
           "Threshold", "UndeclaredStatistic", "rule"]
