"""A rule's `fleet=` formula is its predicate written over statistics: on any evidence it fires where the predicate
fires, at the predicate's strength. The fleet's PromQL is compiled from the formula (fleet/promrules.py), so this
is what keeps the rule group and the Python engine one definition."""

from __future__ import annotations

import random

import pytest

from diagnoser import signals as S
from diagnoser.evidence import Meta, Signal
from diagnoser.evidence_build import WindowSignals, build_evidence
from diagnoser.rules import Check, default_rules
from diagnoser.rules import formula as fm
from diagnoser.rules.base import MEAN, P90, Threshold, rule
from diagnoser.signals import spec

RULES = default_rules()
WITH_FORMULA = [r for r in RULES.rules if r.fleet is not None]
# Values where the rules' bars lie, on both sides, and anywhere between.
_EDGES = (0.0, 0.05, 0.1, 0.2, 0.29, 0.3, 0.45, 0.5, 0.55, 0.6, 0.61, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95, 0.97, 0.99, 1.0)


def _value(rng: random.Random) -> float:
    return rng.choice(_EDGES) if rng.random() < 0.5 else rng.random()


def _signal(name: str, rng: random.Random) -> Signal:
    mean = _value(rng)
    if name in (S.GPU_XID_ERRORS, S.GPU_ECC_DBE):
        mean = float(rng.choice((0, 0, 1, 3)))
        return Signal.from_stats(name, spec(name).unit, ("dcgm",), mean=mean, max=mean)
    if name in (S.GPU_THROTTLE_POWER, S.GPU_THROTTLE_THERMAL):
        return Signal.from_stats(name, spec(name).unit, ("dcgm",), mean=mean, frac_above={0.5: mean})
    if name == S.GPU_MEM_USED_FRAC:
        return Signal.from_stats(name, spec(name).unit, ("dcgm",), mean=mean, p90=min(1.0, mean + _value(rng) / 10))
    if name == S.SERVER_WAITING:
        return Signal(name, spec(name).unit, ("server",), (rng.choice((0.0, 0.3, 0.5, 2.0)),))
    if not name.startswith("gpu."):  # a capture's: samples (a server's), or one number (physics, a trace)
        return Signal(name, spec(name).unit, ("server",), (mean,))
    return Signal.from_stats(name, spec(name).unit, ("dcgm",), mean=mean, n=1)


_DCGM = (S.GPU_BUSY, S.GPU_SM_ACTIVE, S.GPU_TENSOR_ACTIVE, S.GPU_DRAM_ACTIVE, S.GPU_MEM_USED_FRAC,
         S.GPU_SM_CLOCK_FRAC, S.GPU_THROTTLE_POWER, S.GPU_THROTTLE_THERMAL, S.GPU_XID_ERRORS, S.GPU_ECC_DBE)
# Signals a capture has beside DCGM's that the formulas read: the server's queue and KV cache.
_OTHERS = (S.SERVER_WAITING, S.SERVER_KV_USAGE)
# And what a capture with a model and a trace has: the roofs' shares from physics, the trace's idle share.
_THEORY = (S.THEORY_HBM_ROOF_FRAC, S.THEORY_COMPUTE_ROOF_FRAC, S.TRACE_GPU_IDLE_FRAC)


def _evidence(rng: random.Random, names: tuple[str, ...]):  # type: ignore[no-untyped-def]
    signals = {n: _signal(n, rng) for n in names if rng.random() < (0.8 if n in _DCGM else 0.5)}
    return build_evidence(WindowSignals(Meta(target="gpu", window_s=60.0, origin="fleet"), signals))


def _strengths(ev) -> dict[str, float]:  # type: ignore[no-untyped-def]
    return {f.code: f.strength for f in RULES.run(ev).findings}


@pytest.mark.parametrize("names", [_DCGM, _DCGM + _OTHERS, _DCGM + _OTHERS + _THEORY],
                         ids=["dcgm", "dcgm+server", "dcgm+server+theory+trace"])
def test_formula_fires_where_the_predicate_fires_at_its_strength(names: tuple[str, ...]) -> None:
    rng = random.Random(20261127)
    fired = {r.code: 0 for r in WITH_FORMULA}
    for _ in range(4000):
        ev = _evidence(rng, names)
        found = _strengths(ev)
        for r in WITH_FORMULA:
            want = found.get(r.code)
            if r.missing(ev):
                assert want is None
                continue
            got = Check(r, ev, RULES.thresholds(r.code)).formula()
            got = None if got is None else max(0.0, min(1.0, got))
            assert (got is None) == (want is None), (r.code, {n: s.mean for n, s in ev.signals.items()}, got, want)
            if want is not None:
                fired[r.code] += 1
                assert got == pytest.approx(want, abs=1e-9), r.code
    # Every formula was seen firing and not firing: the sample reaches both sides of each rule's bars.
    assert all(n > 0 for n in fired.values()), fired


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
