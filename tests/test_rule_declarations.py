"""Rules declare the (signal, statistic) pairs they read; the fleet's DCGM statistics follow from the declarations.

A rule reading a statistic it did not declare raises, naming the rule; a declaration the fleet cannot compute is
refused when the rule set is made; prom_stats.STATS is what the default rules' declarations need; what to collect for
an inconclusive verdict is what the rules that could not run declare.
"""

from __future__ import annotations

import pytest

from diagnoser import signals as S
from diagnoser.collectors import dcgm_stats
from diagnoser.collectors.prom_stats import FALLBACK, STATS
from diagnoser.diagnosis import Finding, Limiter
from diagnoser.evidence_build import build_evidence
from diagnoser.rules import Check, Page, RuleSet, Threshold, default_rules, rule
from diagnoser.rules.base import MEAN, P99, Rule, Statistic, UndeclaredStatistic
from diagnoser.rules.engine import _to_collect
from tests.factories import make_capture
from tests.where import constant, line_of, rule_at

_PAGE = Page(detects="d", why="w", fixes="f", sources="s")


def _probe(code: str, read, **declared) -> Rule:  # type: ignore[no-untyped-def]
    @rule(code=code, name="probe", limiter=Limiter.IDLE, summary="s", thresholds={"x": Threshold(1.0, "m")},
          page=_PAGE, **declared)
    def probe(c: Check) -> Finding | None:
        read(c)
        return None

    return probe


def test_a_rule_reading_an_undeclared_statistic_raises_naming_the_rule() -> None:
    ev = build_evidence(make_capture({"gpu.busy": 0.5, "server.waiting": 2.0}))
    ok = _probe("TST101", lambda c: c.req(S.GPU_BUSY).mean, requires=(S.GPU_BUSY,), reads={S.GPU_BUSY: (MEAN,)})
    outcome = RuleSet([ok]).run(ev)
    assert outcome.passed == ["TST101"], (
        f"diagnoser/rules/base.py (Reading): a rule reading only the statistic it declares should pass, but "
        f"passed={outcome.passed}, skipped={getattr(outcome, 'skipped', '?')}: a declared read must not raise.")
    for code, read in (("TST102", lambda c: c.req(S.GPU_BUSY).p90),
                       ("TST103", lambda c: c.req(S.GPU_BUSY).frac_above(0.5)),
                       ("TST104", lambda c: c.cite(c.req(S.GPU_BUSY), "max")),
                       ("TST105", lambda c: c.opt(S.SERVER_WAITING).mean)):  # type: ignore[union-attr]
        bad = _probe(code, read, requires=(S.GPU_BUSY,), uses=(S.SERVER_WAITING,), reads={S.GPU_BUSY: (MEAN,)})
        with pytest.raises(UndeclaredStatistic, match=f"rule {code} reads .* of (gpu.busy|server.waiting)"):
            RuleSet([bad]).run(ev)


def test_what_a_signal_is_reads_freely_and_a_reading_answers_like_the_signal() -> None:
    seen: list[object] = []

    def read(c: Check) -> None:
        busy = c.req(S.GPU_BUSY)
        seen.extend((busy.name, busy.unit, busy.n, busy.source, busy.mean, c.cite(busy, "mean")))

    ev = build_evidence(make_capture({"gpu.busy": [0.2, 0.4, 0.6]}, n=3))
    RuleSet([_probe("TST106", read, requires=(S.GPU_BUSY,), reads={S.GPU_BUSY: (MEAN,)})]).run(ev)
    signal = ev.signals[S.GPU_BUSY]
    want = [S.GPU_BUSY, signal.unit, 3, signal.source, signal.mean, signal.mean]
    assert seen == want, (f"diagnoser/rules/base.py (Reading): a reading should answer its name, unit, sample count, "
                          f"source and declared mean as the signal does ({want}), not {seen}.")


def test_a_malformed_declaration_is_refused_when_the_rule_is_made() -> None:
    for reads, match in (({S.GPU_DRAM_ACTIVE: (MEAN,)}, "neither requires nor uses"),
                         ({S.GPU_BUSY: ("p95",)}, "unknown statistic 'p95'"),
                         ({S.GPU_BUSY: "mean"}, "as a string"),
                         ({S.GPU_BUSY: (MEAN, MEAN)}, "twice")):
        with pytest.raises(ValueError, match=match):
            _probe("TST107", lambda c: None, requires=(S.GPU_BUSY,), reads=reads)


def test_a_declaration_the_fleet_cannot_compute_is_refused_in_one_sentence() -> None:
    bad = _probe("TST108", lambda c: None, requires=(S.GPU_MEM_USED_FRAC,), reads={S.GPU_MEM_USED_FRAC: (P99,)})
    with pytest.raises(ValueError) as err:
        RuleSet([bad])
    message = str(err.value)
    assert message.count(". ") == 0 and message.endswith(".") and "rule TST108 reads p99 of gpu.mem_used_frac" in \
        message and "dcgm_stats.py" in message, (
        f"diagnoser/collectors/dcgm_stats.py (unproducible): the refusal should be one sentence naming the rule, what "
        f"it reads and the file to edit, not {message!r}.")
    # A DCGM signal the fleet does not ask for: refused too, until the table makes it (or says why it need not).
    power = _probe("TST111", lambda c: None, requires=(S.GPU_BUSY,), uses=(S.GPU_POWER_W,),
                   reads={S.GPU_POWER_W: (MEAN,)})
    with pytest.raises(ValueError, match="rule TST111 reads mean of gpu.power_w, .* makes no such signal"):
        RuleSet([power])
    # A statistic of a signal that is not DCGM's (a server's) is not the fleet's concern.
    RuleSet([_probe("TST109", lambda c: None, requires=(S.SERVER_WAITING,), reads={S.SERVER_WAITING: (P99,)})])


# Each check of the shipped declarations fails with one sentence naming the file and line to change: a bare
# dataclass or a truncated dict says what differs, not what to do.
_TABLE = "diagnoser/collectors/dcgm_stats.py"
_FIELDS = "diagnoser/collectors/dcgm.py"


def _stat_at(stat: dcgm_stats.Stat) -> str:
    return line_of(_TABLE, f'Stat("{stat.field}", "{stat.stat}")') if stat.field != "fb_total" else \
        line_of(_TABLE, "FB_TOTAL =")


def _entry_at(name: str) -> str:
    """The line of the table's entry for a signal (its constant inside TABLE)."""
    return line_of(_TABLE, constant(name), after="TABLE: tuple")


def _readers(stat: dcgm_stats.Stat) -> str:
    """Who needs a statistic: the rules whose reads= the table computes from it (and the engine's own reads)."""
    rules = default_rules().rules
    pairs = {p for p, stats in dcgm_stats.PRODUCES.items() if stat in stats}
    codes = sorted({r.code for r in rules for name, st in (*r.read_pairs(), *((n, MEAN) for n, _ in r.read_pairs()))
                    if (name, str(st)) in pairs})
    engine = [f"{n}'s {st}" for n, st in dcgm_stats.ENGINE_READS if (n, st) in pairs]
    who = [f"rule {', '.join(codes)}" if codes else "", f"the engine ({', '.join(engine)})" if engine else ""]
    what = ", ".join(f"{n}'s {st}" for n, st in sorted(pairs))
    return f"{what}, read by {' and '.join(w for w in who if w) or 'nobody'}"


def test_every_shipped_rule_reads_only_what_the_fleet_can_compute() -> None:
    problems = [f"{rule_at(r)}: {p}" for r in default_rules().rules for p in dcgm_stats.unproducible([r])]
    if problems:
        pytest.fail(" ".join(problems), pytrace=False)


def test_the_fleet_statistics_are_what_the_declarations_need() -> None:
    rules = default_rules().rules
    need = dcgm_stats.stats_for(rules)
    if need != STATS:
        missing = ", ".join(s.key for s in need if s not in STATS) or "none"
        extra = ", ".join(s.key for s in STATS if s not in need) or "none"
        pytest.fail(f"{line_of('diagnoser/collectors/prom_stats.py', 'STATS: tuple')}: the statistics the fleet asks "
                    f"for are not those the default rules' reads= need through {_TABLE}'s table (missing {missing}; "
                    f"not needed {extra}; order {'the same' if set(need) == set(STATS) else 'aside'}): STATS is "
                    "stats_for(default_rules().rules), in the table's order.", pytrace=False)
    if not (FALLBACK == dcgm_stats.GPU_UTIL and FALLBACK not in STATS):
        pytest.fail(f"{line_of(_TABLE, 'GPU_UTIL = Stat')}: GPU_UTIL stands in for GR_ENGINE_ACTIVE and is asked "
                    "apart (prom_stats.FALLBACK), so no group's inputs may hold it.", pytrace=False)
    # Without the PCIe rule nobody reads the PCIe p90: it is not asked for, and the mean still is (NET002's signal
    # is made with its mean, so a rule reading only the p90 costs both).
    keys = {s.key for s in dcgm_stats.stats_for([r for r in rules if r.code != "NET002"])}
    if "pcie_tx.p90" in keys or "pcie_rx.p90" in keys:
        pytest.fail(f"{_stat_at(dcgm_stats.PCIE['tx'][1])}: without rule NET002 nobody reads a PCIe p90, yet the fleet "
                    f"still asks for it: dcgm_stats.needed should take only what the rules' reads= need.",
                    pytrace=False)
    if not {"pcie_tx.p90", "pcie_tx.avg", "pcie_tx_total.rate"} <= {s.key for s in STATS}:
        pytest.fail(f"{_entry_at(S.GPU_PCIE_TX_BPS)}: rule NET002 reads the PCIe p90, so the fleet should ask for "
                    "pcie_tx.p90 and the mean's pcie_tx.avg and pcie_tx_total.rate (a signal read at all is made "
                    "with its mean).", pytrace=False)
    # Nothing the engine itself reads: still the activity counters and the memory size.
    bare = {s.key for s in dcgm_stats.stats_for([])}
    want = {"gr_engine_active.avg", "sm_active.avg", "tensor_active.avg", "dram_active.avg", "fb_total.last"}
    if bare != want:
        pytest.fail(f"{line_of(_TABLE, 'ENGINE_READS: tuple')}: with no rule the fleet asks for "
                    f"{', '.join(sorted(bare))}, not the engine's own {', '.join(sorted(want))}: ENGINE_READS is what "
                    "characterise, the gains and the fleet row read of a GPU.", pytrace=False)


def test_every_field_the_fleet_asks_for_is_one_it_reads_from_prometheus() -> None:
    from diagnoser.collectors.dcgm import FIELDS_BY_KEY

    problems = []
    for stat in (*STATS, FALLBACK):
        for f in ("fb_used", "fb_free") if stat.field == "fb_total" else (stat.field,):
            if f not in FIELDS_BY_KEY:
                problems.append(f"{_stat_at(stat)}: the fleet asks for {stat.key} ({_readers(stat)}), but {_FIELDS}'s "
                                f"FIELDS has no field {f!r}: add a DcgmField for it there (its exporter names and "
                                "signal).")
            elif not FIELDS_BY_KEY[f].fleet:
                at = line_of(_FIELDS, 'DcgmField("' + f + '"')
                problems.append(f"{at}: the field {f!r} says fleet=False, but the "
                                f"fleet asks Prometheus for its {stat.key} ({_readers(stat)}): remove fleet=False "
                                "there, or the fleet's query leaves the field out and those reads find nothing.")
    if problems:
        pytest.fail(" ".join(problems), pytrace=False)


def test_the_table_names_known_statistics_signals_and_inputs() -> None:
    statistics = {s.value for s in Statistic}
    inputs = {s for g in dcgm_stats.TABLE for s in g.inputs} | {dcgm_stats.GPU_UTIL}
    problems = []
    for (name, stat), stats in dcgm_stats.PRODUCES.items():
        at = _entry_at(name)
        if stat not in statistics:
            problems.append(f"{at}: the table gives {stat!r} of {name}, which is no statistic a rule can declare "
                            f"(rules/base.py's Statistic: {', '.join(sorted(statistics))}): spell it as one.")
        if name not in S.REGISTRY:
            problems.append(f"{at}: the table makes {name!r}, which diagnoser/signals.py does not register: name it "
                            "by its constant there (or register it).")
        lacking = [s for s in stats if s not in inputs]
        if lacking:
            problems.append(f"{at}: {name}'s {stat} is computed from {', '.join(s.key for s in lacking)}, which no "
                            "group's inputs ask the engine for: add it to that group's inputs.")
    if problems:
        pytest.fail(" ".join(problems), pytrace=False)


def test_what_to_collect_is_what_the_rules_that_could_not_run_declare() -> None:
    ev = build_evidence(make_capture({"gpu.busy": 0.5}, model=None))
    wants = _to_collect(ev, default_rules())
    assert any(w.startswith("Server metrics") for w in wants) and any(w.startswith("A short torch") for w in wants), (
        f"diagnoser/rules/engine.py (_to_collect): a GPU-only capture should be told to collect the server's metrics "
        f"and a short torch trace, which the rules that could not run declare, not {wants}.")
    # A rule set whose only rule needs a trace: the server's metrics would serve none of them.
    traced = _probe("TST110", lambda c: None, requires=(S.TRACE_IDLE_HOST_FRAC,))
    wants = _to_collect(ev, RuleSet([traced]))
    assert not any(w.startswith("Server metrics") for w in wants) and any(w.startswith("A short torch") for w in wants), (
        f"diagnoser/rules/engine.py (_to_collect): with one rule, needing a trace, only a trace should be asked for, "
        f"not {wants}.")
