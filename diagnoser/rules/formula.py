"""A rule's conclusion from its window statistics, written once as a formula: evaluated per GPU in Python (a rule's
`fleet=`, `Check.formula`) and compiled to PromQL for the fleet's rule group (fleet/promrules.py), so that the
group's findings are derived from the rules, not written beside them.

A formula is a per-GPU value in PromQL's vector algebra: each node gives a number or nothing (the GPU has no series
there). Arithmetic and comparisons of nothing give nothing; a comparison keeps its left side's value where it holds
(PromQL's filter); `a & b` is a where b is present (`and`), `a | b` a, else b (`or`), `a.unless(b)` a where b is
absent (`unless`). Evaluating it on a GPU in Python is evaluating the PromQL on that GPU's series, which is what
tests/test_rule_formula.py holds on random windows and tests/test_fleet_promrules.py on a real Prometheus.

Leaves read the evidence the way a predicate does: `Read(S.X, MEAN)` a statistic the rule declares in `reads=`
(`@rule` refuses one it does not), `Present(S.X)` whether a signal is there at all, `InRegime(...)` the regime
characterise named. A leaf the fleet cannot give (a trace share, the model's roofs) compiles to nothing, so a rule's
formula states everything its predicate reads and the fleet's PromQL keeps what DCGM can answer.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

from diagnoser.diagnosis import Regime
from diagnoser.signals import Sig

Value = float | None
# PromQL needs no parentheses around a number or a plain series selector.
_ATOM = re.compile(r"^(-?[0-9.e+-]+|[A-Za-z_:][A-Za-z0-9_:]*(\{[^{}]*\})?)$")


def _p(expr: str) -> str:
    return expr if _ATOM.match(expr) else f"({expr})"


class Env(Protocol):
    """Where a formula's leaves are read from in Python (a rule's Check, for one GPU's evidence)."""

    def read(self, name: Sig, stat: str) -> Value: ...

    def present(self, name: Sig) -> bool: ...

    def regime(self) -> Regime: ...

    def threshold(self, name: str) -> float: ...


class Compiler(Protocol):
    """What compiling a formula to PromQL needs: each leaf's series (None: the fleet has none), each threshold's
    value, a recorded series for each named part, and the labels that name a GPU."""

    key: str

    def read(self, name: str, stat: str) -> str | None: ...

    def present(self, name: str) -> str | None: ...

    def regime(self, regimes: tuple[Regime, ...]) -> str | None: ...

    def threshold(self, name: str) -> str: ...

    def named(self, name: str, formula: Formula) -> str | None: ...


class Formula:
    """A node. Operators build new nodes: + - * / with formulas or numbers, comparisons (filters), & | and unless."""

    scalar = False  # a number, not a vector: PromQL joins no labels with it

    def value(self, env: Env) -> Value:
        raise NotImplementedError

    def promql(self, q: Compiler) -> str | None:
        raise NotImplementedError

    def parts(self) -> tuple[Formula, ...]:
        return ()

    def walk(self) -> Iterator[Formula]:
        yield self
        for part in self.parts():
            yield from part.walk()

    def _bin(self, op: str, other: Formula | float, swap: bool = False) -> Formula:
        o = other if isinstance(other, Formula) else Const(float(other))
        return Binary(op, o, self) if swap else Binary(op, self, o)

    def __add__(self, other: Formula | float) -> Formula:
        return self._bin("+", other)

    def __radd__(self, other: float) -> Formula:
        return self._bin("+", other, swap=True)

    def __sub__(self, other: Formula | float) -> Formula:
        return self._bin("-", other)

    def __rsub__(self, other: float) -> Formula:
        return self._bin("-", other, swap=True)

    def __mul__(self, other: Formula | float) -> Formula:
        return self._bin("*", other)

    def __rmul__(self, other: float) -> Formula:
        return self._bin("*", other, swap=True)

    def __truediv__(self, other: Formula | float) -> Formula:
        return self._bin("/", other)

    def __ge__(self, other: Formula | float) -> Formula:
        return self._bin(">=", other)

    def __gt__(self, other: Formula | float) -> Formula:
        return self._bin(">", other)

    def __le__(self, other: Formula | float) -> Formula:
        return self._bin("<=", other)

    def __lt__(self, other: Formula | float) -> Formula:
        return self._bin("<", other)

    def __and__(self, other: Formula) -> Formula:
        return Binary("and", self, other)

    def __or__(self, other: Formula) -> Formula:
        return Binary("or", self, other)

    def unless(self, other: Formula) -> Formula:
        return Binary("unless", self, other)

    def valued(self, x: float) -> Formula:
        """`x` wherever this formula has a value (a finding's fixed strength)."""
        return Valued(self, x)


@dataclass(frozen=True, eq=False)
class Const(Formula):
    x: float
    scalar = True

    def value(self, env: Env) -> Value:
        return self.x

    def promql(self, q: Compiler) -> str | None:
        return f"{self.x:g}"


@dataclass(frozen=True, eq=False)
class Bar(Formula):
    """A threshold of the rule, by name: its value in force (a --rules-config's override included)."""

    name: str
    scalar = True

    def value(self, env: Env) -> Value:
        return env.threshold(self.name)

    def promql(self, q: Compiler) -> str | None:
        return q.threshold(self.name)


@dataclass(frozen=True, eq=False)
class Read(Formula):
    """A statistic of a signal (`stat`: a Statistic's value, or "frac_above:0.5"); nothing where it is absent."""

    name: Sig
    stat: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "stat", str(self.stat))  # a Statistic (a str enum) as its plain name

    def value(self, env: Env) -> Value:
        return env.read(self.name, self.stat)

    def promql(self, q: Compiler) -> str | None:
        return q.read(self.name, self.stat)


@dataclass(frozen=True, eq=False)
class Present(Formula):
    """1 where the signal is there (read for its presence only: no statistic of it is declared)."""

    name: Sig

    def value(self, env: Env) -> Value:
        return 1.0 if env.present(self.name) else None

    def promql(self, q: Compiler) -> str | None:
        return q.present(self.name)


@dataclass(frozen=True, eq=False)
class InRegime(Formula):
    """1 where characterise named one of these regimes."""

    regimes: tuple[Regime, ...]

    def value(self, env: Env) -> Value:
        return 1.0 if env.regime() in self.regimes else None

    def promql(self, q: Compiler) -> str | None:
        return q.regime(self.regimes)


_ARITH: dict[str, Callable[[float, float], float]] = {
    "+": operator.add, "-": operator.sub, "*": operator.mul,
    "/": lambda a, b: a / b if b else (float("nan") if a == 0 else float("inf") if a > 0 else float("-inf"))}
_COMPARE: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge, ">": operator.gt, "<=": operator.le, "<": operator.lt}


@dataclass(frozen=True, eq=False)
class Binary(Formula):
    op: str
    a: Formula
    b: Formula

    @property
    def scalar(self) -> bool:  # type: ignore[override]
        return self.a.scalar and self.b.scalar

    def parts(self) -> tuple[Formula, ...]:
        return (self.a, self.b)

    def value(self, env: Env) -> Value:
        a, b = self.a.value(env), self.b.value(env)
        if self.op == "and":
            return a if b is not None else None
        if self.op == "or":
            return a if a is not None else b
        if self.op == "unless":
            return a if b is None else None
        if a is None or b is None:
            return None
        if self.op in _COMPARE:
            return a if _COMPARE[self.op](a, b) else None
        return _ARITH[self.op](a, b)

    def promql(self, q: Compiler) -> str | None:
        a, b = self.a.promql(q), self.b.promql(q)
        if self.op == "or":
            return a if b is None else b if a is None else self._join(q, a, b)
        if self.op == "unless":
            return a if b is None or a is None else self._join(q, a, b)
        if a is None or b is None:
            return None
        return self._join(q, a, b)

    def _join(self, q: Compiler, a: str, b: str) -> str:
        if self.op in ("and", "or", "unless") and (self.a.scalar or self.b.scalar):
            raise ValueError(f"'{self.op}' joins two vectors, not a number")
        if self.op in _COMPARE and self.a.scalar and not self.b.scalar:
            # PromQL would keep the right side's value: a comparison is written with the GPU's value on the left.
            raise ValueError(f"a comparison '{self.op}' has a number on its left")
        on = f" on ({q.key})" if not (self.a.scalar or self.b.scalar) else ""
        return f"{_p(a)} {self.op}{on} {_p(b)}"


@dataclass(frozen=True, eq=False)
class Valued(Formula):
    a: Formula
    x: float

    def parts(self) -> tuple[Formula, ...]:
        return (self.a,)

    def value(self, env: Env) -> Value:
        return None if self.a.value(env) is None else self.x

    def promql(self, q: Compiler) -> str | None:
        a = self.a.promql(q)
        return None if a is None else f"{_p(a)} * 0 + {self.x:g}"


@dataclass(frozen=True, eq=False)
class Clamp(Formula):
    """`a` no larger than `high` (clamp_max) or no smaller than `low` (clamp_min)."""

    a: Formula
    low: float | None = None
    high: float | None = None

    def parts(self) -> tuple[Formula, ...]:
        return (self.a,)

    def value(self, env: Env) -> Value:
        a = self.a.value(env)
        if a is None:
            return None
        if self.high is not None:
            a = min(a, self.high)
        return a if self.low is None else max(a, self.low)

    def promql(self, q: Compiler) -> str | None:
        a = self.a.promql(q)
        if a is None:
            return None
        if self.high is not None:
            a = f"clamp_max({a}, {self.high:g})"
        return a if self.low is None else f"clamp_min({a}, {self.low:g})"


@dataclass(frozen=True, eq=False)
class Larger(Formula):
    """The larger of two, or the one there is."""

    a: Formula
    b: Formula

    def parts(self) -> tuple[Formula, ...]:
        return (self.a, self.b)

    def value(self, env: Env) -> Value:
        present = [v for v in (self.a.value(env), self.b.value(env)) if v is not None]
        return max(present) if present else None

    def promql(self, q: Compiler) -> str | None:
        a, b = self.a.promql(q), self.b.promql(q)
        if a is None or b is None:
            return a or b
        k = q.key
        return f"({_p(a)} >= on ({k}) {_p(b)}) or on ({k}) {_p(b)} or on ({k}) {_p(a)}"


@dataclass(frozen=True, eq=False)
class Count(Formula):
    """How many of the parts have a value; nothing where none has."""

    items: tuple[Formula, ...]

    def parts(self) -> tuple[Formula, ...]:
        return self.items

    def value(self, env: Env) -> Value:
        n = sum(1 for f in self.items if f.value(env) is not None)
        return float(n) if n else None

    def promql(self, q: Compiler) -> str | None:
        there = [s for s in (f.promql(q) for f in self.items) if s is not None]
        if not there:
            return None
        k = q.key
        anyone = f" or on ({k}) ".join(_p(s) for s in there)
        # Each part counts 1 where it is, 0 where another is: every term is defined wherever any part is.
        terms = [f"({_p(s)} * 0 + 1 or on ({k}) ({anyone}) * 0)" for s in there]
        return f" + on ({k}) ".join(terms)


@dataclass(frozen=True, eq=False)
class Named(Formula):
    """A part several findings read: recorded once by the rule group (`gpu:diagnoser_<name>:<window>`)."""

    name: str
    a: Formula

    def parts(self) -> tuple[Formula, ...]:
        return (self.a,)

    def value(self, env: Env) -> Value:
        return self.a.value(env)

    def promql(self, q: Compiler) -> str | None:
        return q.named(self.name, self.a)


def reads(formula: Formula) -> set[tuple[str, str]]:
    """The (signal, statistic) pairs a formula reads, statistics as a rule declares them ('frac_above', not
    'frac_above:0.5')."""
    return {(f.name, f.stat.split(":", 1)[0]) for f in formula.walk() if isinstance(f, Read)}


def signals(formula: Formula) -> set[str]:
    """Every signal a formula reads or asks the presence of."""
    return {f.name for f in formula.walk() if isinstance(f, (Read, Present))}


def thresholds(formula: Formula) -> set[str]:
    return {f.name for f in formula.walk() if isinstance(f, Bar)}


__all__ = ["Clamp", "Compiler", "Const", "Count", "Env", "Formula", "InRegime", "Larger", "Named", "Present", "Read",
           "Bar", "Value", "reads", "signals", "thresholds"]
