"""A rule's `fleet=` formula is its predicate written over statistics: on any evidence it fires where the predicate
fires, at the predicate's strength. The fleet's PromQL is compiled from the formula (fleet/promrules.py), so this
is what keeps the rule group and the Python engine one definition."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from diagnoser import signals as S
from diagnoser.collectors import dcgm_stats
from diagnoser.evidence import Meta, Signal
from diagnoser.evidence_build import WindowSignals, build_evidence
from diagnoser.physics.gpus import GPUS
from diagnoser.rules import Check, default_rules
from diagnoser.rules import formula as fm
from diagnoser.rules.base import FRAC_ABOVE, MAX, MEAN, P90, AnyOf, Rule, Threshold, rule
from diagnoser.signals import spec
from tests.where import rule_at as where

RULES = default_rules()
WITH_FORMULA = [r for r in RULES.rules if r.fleet is not None]
HERE = "tests/test_rule_formula.py"


# --- what values a signal takes, from its unit (signals.py) -------------------------------------------------------
# One range per unit, not per rule: a new rule on a signal of a unit seen here gets draws in that unit (a rule on °C
# gets degrees, not [0, 1]). Roofs come from the GPU table (physics/gpus.py): the most any tabled board has.
_BOARDS = tuple(GPUS.values())
_MOST_FLOPS = max(max(g.flops.values()) for g in _BOARDS)


@dataclass(frozen=True)
class Range:
    low: float
    high: float
    whole: bool = False  # counts: whole numbers, zero often


UNIT_RANGES: dict[str, Range] = {
    "ratio": Range(0.0, 1.0),
    "%": Range(0.0, 100.0),
    "C": Range(20.0, 100.0),  # a GPU's temperature: idle in a cool room to past its slowdown point
    "W": Range(0.0, max(g.tdp_w for g in _BOARDS)),
    "MHz": Range(0.0, max(g.max_sm_clock_mhz or 0.0 for g in _BOARDS)),
    "bytes": Range(0.0, float(max(g.memory_bytes for g in _BOARDS))),
    "B/s": Range(0.0, max(g.hbm_bytes_per_s for g in _BOARDS)),
    "FLOP/s": Range(0.0, _MOST_FLOPS),
    "FLOP/B": Range(0.0, 2000.0),
    "count": Range(0.0, 5.0, whole=True),
    "requests": Range(0.0, 64.0),
    "sequences": Range(0.0, 512.0),
    "tokens": Range(0.0, 32768.0),
    "adapters": Range(0.0, 16.0, whole=True),
    "threads": Range(1.0, 512.0, whole=True),
    "cores": Range(0.0, 256.0),
    "s": Range(0.0, 30.0),
    "1/s": Range(0.0, 1000.0),
    "tokens/s": Range(0.0, 50000.0),
    "tokens/J": Range(0.0, 50.0),
    "USD": Range(0.0, 100.0),
}


def unit_range(name: str) -> Range:
    unit = spec(name).unit
    if unit not in UNIT_RANGES:
        pytest.fail(f"signal {name} is in {unit!r}, which {HERE} has no range of values for: add the unit's range to "
                    f"UNIT_RANGES there (every signal in that unit is then drawn in it).", pytrace=False)
    return UNIT_RANGES[unit]


def _bars(formula: fm.Formula, thresholds: dict[str, float]) -> dict[str, set[float]]:
    """Each signal's values where a rule's formula compares it with a threshold or a number: drawn often, so the
    draws land on both sides of every bar and on it."""
    out: dict[str, set[float]] = {}
    for node in formula.walk():
        if isinstance(node, fm.Binary) and node.op in (">=", ">", "<=", "<"):
            for leaf, other in ((node.a, node.b), (node.b, node.a)):
                if isinstance(leaf, fm.Read) and isinstance(other, (fm.Bar, fm.Const)):
                    value = thresholds[other.name] if isinstance(other, fm.Bar) else other.x
                    out.setdefault(leaf.name, set()).add(value)
    return out


# Each signal's edges: its unit's ends, every bar a rule compares it with, and each rule's thresholds that lie in its
# unit's range (a bar reached through arithmetic).
EDGES: dict[str, tuple[float, ...]] = {}
FRACTIONS: set[float] = set()  # the thresholds of frac_above a formula reads ("frac_above:0.5")
for _r in WITH_FORMULA:
    assert _r.fleet is not None
    _values = RULES.thresholds(_r.code)
    _direct = _bars(_r.fleet, dict(_values))
    for _name in _r.declared:
        _range, _unit = unit_range(_name), spec(_name).unit
        _near = {v for k, v in _values.items() if _r.thresholds[k].unit == _unit and _range.low <= v <= _range.high}
        _near |= _direct.get(_name, set())
        _near |= {v * k for v in _direct.get(_name, set()) for k in (0.99, 1.01)}
        EDGES[_name] = tuple(sorted(set(EDGES.get(_name, ())) | _near | {_range.low, _range.high}))
    FRACTIONS |= {float(f.stat.split(":", 1)[1]) for f in _r.fleet.walk()
                  if isinstance(f, fm.Read) and f.stat.startswith("frac_above:")}


def _value(name: str, rng: random.Random) -> float:
    r = unit_range(name)
    if r.whole:
        return float(rng.choice((0, 0, 0, *range(int(r.low), int(r.high) + 1))))
    if rng.random() < 0.5:
        return min(r.high, max(r.low, rng.choice(EDGES[name])))
    return rng.uniform(r.low, r.high)


def _above(name: str, low: float, rng: random.Random) -> float:
    """A statistic at or above `low` in the signal's range (a p90 or a maximum over the mean)."""
    r = unit_range(name)
    return low if r.whole else min(r.high, low + (r.high - low) * rng.random() / 5)


def _signal(name: str, rng: random.Random) -> Signal:
    """One signal as its source has it: a fleet GPU's from the statistics the fleet computes of it
    (collectors/dcgm_stats.py's table), a server's as samples, a trace's or the physics' as one number."""
    mean, unit = _value(name, rng), spec(name).unit
    if name in dcgm_stats.FLEET_SIGNALS:
        stats = {stat for n, stat in dcgm_stats.PRODUCES if n == name}
        extra: dict[str, object] = {}
        if P90 in stats:
            extra["p90"] = _above(name, mean, rng)
        if MAX in stats:
            extra["max"] = _above(name, mean, rng)
        if FRAC_ABOVE in stats:
            # a 0/1 signal's share of samples above a bar under 1 is its mean; any other's, some share
            extra["frac_above"] = {t: (mean if unit == "ratio" else rng.random()) for t in FRACTIONS or {0.5}}
        return Signal.from_stats(name, unit, ("dcgm",), mean=mean, **extra)  # type: ignore[arg-type]
    return Signal(name, unit, (name.split(".", 1)[0],), (mean,))


def _group(names: set[str]) -> tuple[str, ...]:
    return tuple(sorted(names))


# The signals the formulas' rules declare, by where a window has them: a fleet GPU's DCGM statistics, a server's
# metrics (and the host's), and what a capture with a model and a trace adds (the physics, the trace). Taken from the
# rules, so a new rule's signals are drawn without a line here. A DCGM signal the fleet does not make (its table has
# no entry for it, or NOT_ON_FLEET says why) is absent on every fleet GPU, which is where the formula is evaluated.
_DECLARED = {n for r in WITH_FORMULA for n in r.declared
             if n in dcgm_stats.FLEET_SIGNALS or n not in dcgm_stats.DCGM_SIGNALS | set(dcgm_stats.NOT_ON_FLEET)}
_DCGM = _group({n for n in _DECLARED if n in dcgm_stats.FLEET_SIGNALS})
_OTHERS = _group({n for n in _DECLARED if n.split(".", 1)[0] in ("server", "host", "proc")} - set(_DCGM))
_THEORY = _group(_DECLARED - set(_DCGM) - set(_OTHERS))


def _evidence(rng: random.Random, names: tuple[str, ...]):  # type: ignore[no-untyped-def]
    signals = {n: _signal(n, rng) for n in names if rng.random() < (0.8 if n in _DCGM else 0.5)}
    return build_evidence(WindowSignals(Meta(target="gpu", window_s=60.0, origin="fleet"), signals))


def _strengths(ev) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {f.code: f.strength for f in RULES.run(ev).findings}


def _drawn(ev, r: Rule) -> str:  # type: ignore[no-untyped-def]
    """The rule's signals in the window with every statistic drawn, in full (a message is not cut short)."""
    out = []
    for n, s in sorted((n, s) for n, s in ev.signals.items() if n in r.declared):
        stats = {k: v for k in ("mean", "p90", "max") if (v := getattr(s, f"s_{k}", None)) is not None}
        fractions = getattr(s, "fractions", ())
        out.append(f"{n}={s.mean:g} {spec(n).unit}" + "".join(f" {k} {v:g}" for k, v in stats.items() if k != "mean")
                   + "".join(f" frac_above({t:g}) {v:g}" for t, v in fractions))
    absent = sorted(n for n in r.declared if n not in ev.signals)
    return "; ".join(out) + (f" ({', '.join(absent)} absent)" if absent else "")


def _could_run(r: Rule, names: tuple[str, ...]) -> bool:
    return all(any(n in names for n in (req.names if isinstance(req, AnyOf) else (req,))) for req in r.requires)


DRAWS = 4000


@pytest.mark.parametrize("names", [_DCGM, _DCGM + _OTHERS, _DCGM + _OTHERS + _THEORY],
                         ids=["dcgm", "dcgm+server", "dcgm+server+theory+trace"])
def test_formula_fires_where_the_predicate_fires_at_its_strength(names: tuple[str, ...]) -> None:
    rng = random.Random(20261127)
    fired = {r.code: 0 for r in WITH_FORMULA}
    ran = {r.code: 0 for r in WITH_FORMULA}
    for _ in range(DRAWS):
        ev = _evidence(rng, names)
        found = _strengths(ev)
        for r in WITH_FORMULA:
            want = found.get(r.code)
            if r.missing(ev):
                if want is not None:
                    pytest.fail(f"{where(r)} found something without its required signals on {_drawn(ev, r)}: a rule "
                                "runs only where what it requires is there.", pytrace=False)
                continue
            ran[r.code] += 1
            got = Check(r, ev, RULES.thresholds(r.code)).formula()
            got = None if got is None else max(0.0, min(1.0, got))
            if (got is None) != (want is None) or (want is not None and got != pytest.approx(want, abs=1e-9)):
                said = "does not fire" if got is None else f"fires at {got:g}"
                does = "does not fire" if want is None else f"fires at {want:g}"
                pytest.fail(f"{where(r)}: its fleet= formula {said} where its predicate {does}, on {_drawn(ev, r)}: "
                            "make the formula state what the predicate concludes (the fleet's PromQL is compiled "
                            "from it).", pytrace=False)
            if want is not None:
                fired[r.code] += 1
    # Every formula was seen firing and not firing: the draws reach both sides of each rule's bars.
    for r in WITH_FORMULA:
        if not _could_run(r, names):
            continue
        if fired[r.code] == 0:
            pytest.fail(f"{where(r)} never fired in {DRAWS} windows drawn in its signals' units ({_ranges(r)}), so "
                        "nothing here tests its formula: check its bars are inside those ranges, or give the signal's "
                        f"unit its real range in UNIT_RANGES in {HERE}.", pytrace=False)
        if fired[r.code] == ran[r.code]:
            pytest.fail(f"{where(r)} fired in every one of the {ran[r.code]} windows it ran on, drawn in its signals' "
                        f"units ({_ranges(r)}), so nothing here tests where it does not: check its bars are inside "
                        f"those ranges, or give the signal's unit its real range in UNIT_RANGES in {HERE}.",
                        pytrace=False)


def _ranges(r: Rule) -> str:
    out = []
    for n in sorted(r.declared):
        u = unit_range(n)
        out.append(f"{n} {u.low:g}..{u.high:g} {spec(n).unit}")
    bars = ", ".join(f"{k} {v:g}" for k, v in RULES.thresholds(r.code).items())
    return ", ".join(out) + (f"; its thresholds in force: {bars}" if bars else "")


def test_a_formula_reading_an_undeclared_statistic_fails_at_import() -> None:
    page_args = dict(code="TST001", name="t", limiter=RULES.rules[0].limiter, summary="s",
                     requires=(S.GPU_DRAM_ACTIVE,), thresholds={"x": Threshold(0.5, "x")},
                     page=RULES.rules[0].page.__class__("d", "w", "f", "s"))
    with pytest.raises(ValueError, match="reads p90 of gpu.dram_active, which its reads= does not declare"):
        rule(**page_args, reads={S.GPU_DRAM_ACTIVE: (MEAN,)},  # type: ignore[arg-type]
             fleet=(fm.Read(S.GPU_DRAM_ACTIVE, P90) >= fm.Bar("x")).valued(0.5))
    with pytest.raises(ValueError, match="reads gpu.busy, which it neither requires nor uses"):
        rule(**page_args, reads={S.GPU_DRAM_ACTIVE: (MEAN,)},  # type: ignore[arg-type]
             fleet=(fm.Read(S.GPU_BUSY, MEAN) >= fm.Bar("x")).valued(0.5))
    with pytest.raises(ValueError, match="names a threshold it does not have: y"):
        rule(**page_args, reads={S.GPU_DRAM_ACTIVE: (MEAN,)},  # type: ignore[arg-type]
             fleet=(fm.Read(S.GPU_DRAM_ACTIVE, MEAN) >= fm.Bar("y")).valued(0.5))


def test_the_algebra_is_promqls() -> None:
    """and / or / unless and filters as PromQL's vector operators on one series each."""

    class Env:
        def __init__(self, **values: float | None) -> None:
            self.values = values

        def read(self, name: str, stat: str) -> float | None:
            return self.values.get(name)

        def present(self, name: str) -> bool:
            return self.values.get(name) is not None

        def regime(self):  # type: ignore[no-untyped-def]
            from diagnoser.diagnosis import Regime
            return Regime.UNKNOWN

        def threshold(self, name: str) -> float:
            return 0.5

    a, b = fm.Read("a", "mean"), fm.Read("b", "mean")
    env = Env(a=0.7, b=None)
    assert (a >= fm.Bar("t")).value(env) == 0.7  # a filter keeps the left side's value
    assert (a < 0.5).value(env) is None
    assert (a & b).value(env) is None and (a | b).value(env) == 0.7 and a.unless(b).value(env) == 0.7
    assert (a + b).value(env) is None and fm.Larger(a, b).value(env) == 0.7
    assert fm.Count((a, b)).value(env) == 1.0 and fm.Count((b,)).value(env) is None
    with pytest.raises(ValueError, match="number on its left"):
        (fm.Const(1.0) < a).promql(_Compiler())  # PromQL would keep the right side's value


class _Compiler:
    key = "UUID"

    def read(self, name: str, stat: str) -> str:
        return name

    def present(self, name: str) -> str:
        return name

    def regime(self, regimes):  # type: ignore[no-untyped-def]
        return None

    def threshold(self, name: str) -> str:
        return "0.5"

    def named(self, name: str, formula: fm.Formula) -> str | None:
        return formula.promql(self)


def _rule_with(fleet: fm.Formula, reads: dict, requires: tuple = (S.GPU_DRAM_ACTIVE,)):  # type: ignore[no-untyped-def,type-arg]
    return rule(code="TST002", name="t", limiter=RULES.rules[0].limiter, summary="s", requires=requires,
                reads=reads, thresholds={"x": Threshold(0.3, "x")},
                page=RULES.rules[0].page.__class__("d", "w", "f", "s"), fleet=fleet)(lambda c: None)


def test_a_new_rules_formula_reaches_the_rule_group() -> None:
    """Adding a rule with a formula adds its finding to the fleet's PromQL: nothing is written twice."""
    from diagnoser.fleet.promrules import build_groups
    from diagnoser.rules import RuleSet

    new = _rule_with((fm.Read(S.GPU_DRAM_ACTIVE, MEAN) >= fm.Bar("x")).valued(0.5), {S.GPU_DRAM_ACTIVE: (MEAN,)})
    findings = build_groups(3600, rules=RuleSet((*RULES.rules, new)))[1].rules
    mine = [r for r in findings if isinstance(r.get("labels"), dict) and r["labels"].get("rule") == "TST002"]  # type: ignore[union-attr]
    assert [r["expr"] for r in mine] == ["(gpu:dcgm_dram_active:avg_1h >= 0.3) * 0 + 0.5"]


def test_a_formula_reading_what_the_rule_group_lacks_is_refused_naming_the_rule() -> None:
    from diagnoser.fleet.promrules import build_groups
    from diagnoser.rules import RuleSet

    new = _rule_with((fm.Read(S.GPU_PCIE_TX_BPS, P90) >= fm.Bar("x")).valued(0.5), {S.GPU_PCIE_TX_BPS: (P90,)},
                     requires=(S.GPU_PCIE_TX_BPS,))
    with pytest.raises(ValueError, match="rule TST002's formula reads p90 of gpu.pcie_tx_bps"):
        build_groups(3600, rules=RuleSet((*RULES.rules, new)))


def test_the_rule_groups_evaluate_a_twelfth_of_their_window_apart_unless_told() -> None:
    """A 1 h window's statistics read every GPU's hour of samples at each evaluation: every minute cost a loaded
    Prometheus a quarter of each minute at 10,000 GPUs; the default is now 5 minutes for an hour."""
    import subprocess
    import sys

    from diagnoser.fleet.promrules import default_interval

    assert [default_interval(w) for w in (3600, 6 * 3600, 600, 60)] == ["5m", "30m", "50s", "10s"]
    for args, want in (((), "5m"), (("--window", "10m"), "50s"), (("--window", "6h", "--interval", "30s"), "30s")):
        out = subprocess.run([sys.executable, "-m", "diagnoser", "rules", "--prometheus-rules", *args],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        intervals = {line.split(":", 1)[1].strip() for line in out.stdout.splitlines() if "interval:" in line}
        assert intervals == {want}


def test_a_rules_page_shows_its_promql_with_the_thresholds_in_force(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Like ruff's rule pages: `diagnoser rules CODE` shows what the fleet's rule group evaluates for the rule."""
    import json
    import subprocess
    import sys

    config = tmp_path / "rules.toml"
    config.write_text("[thresholds.BAT003]\nbusy_mean = 0.4\n")

    def run(*args: str) -> str:
        out = subprocess.run([sys.executable, "-m", "diagnoser", "rules", *args], capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        return out.stdout

    assert "((gpu:diagnoser_busy:1h >= 0.1) < 0.5) * 0 + 0.5" in run("BAT003")
    assert "((gpu:diagnoser_busy:1h >= 0.1) < 0.4) * 0 + 0.5" in run("BAT003", "--rules-config", str(config))
    assert json.loads(run("VRAM003", "--json"))["fleet_promql"] == \
        "(gpu:diagnoser_mem_used_frac:1h >= 0.97) * 0 + 0.4"
    assert "In the fleet's rule group" not in run("VRAM001")  # server metrics: no formula, not in the group
