"""deploy/grafana/diagnoser-fleet.json: generated from the rule group's declarations (fleet/dashboard.py), held equal
to what `diagnoser rules --grafana-dashboard` prints, valid against the dashboard schema the project pins, and reading
only series the rule group records and families the agent exports. Every panel's query returning data on a real
Prometheus is tested with the rule group's other real-Prometheus tests (tests/test_fleet_promrules.py)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

from diagnoser.collectors.prom_stats import identity_record_name
from diagnoser.fleet.dashboard import PATH, REGENERATE, UID, agent_metrics, dashboard, dashboard_json, first_sentence
from diagnoser.fleet.promrules import build_groups, runbook_anchor
from diagnoser.rules import default_rules, load_overrides
from tests.prom_harness import REPO

SCHEMA = REPO / "tests" / "fixtures" / "grafana" / "dashboard.schema.json"
COMMITTED = REPO / PATH
# A recorded series' name (level:metric:operations) in a query.
_RECORDED = re.compile(r"\b[a-z_]+:[a-z_0-9]+:[a-z_0-9]+\b")
_AGENT = re.compile(r"(?<![:\w])(?:diagnoser_[a-z_]+|up)(?![:\w])")


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "diagnoser", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)


def panels(d: dict) -> list[dict]:  # type: ignore[type-arg]
    return [p for p in d["panels"] if p["type"] != "row"]


def test_the_committed_dashboard_is_the_generated_one() -> None:
    assert COMMITTED.read_text() == dashboard_json(), (
        f"{PATH} differs from what the rule group's declarations generate; regenerate it: {REGENERATE}")
    r = cli("rules", "--grafana-dashboard")
    assert r.returncode == 0, r.stderr
    assert r.stdout == COMMITTED.read_text(), f"the command differs from the module; regenerate: {REGENERATE}"


def test_the_dashboard_validates_against_the_pinned_schema() -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    d = json.loads(COMMITTED.read_text())
    errors = [f"{e.json_path}: {e.message[:200]}" for e in validator.iter_errors(d)]
    assert errors == []
    # The schema can fail: a panel without its query's expression, a variable without its data source, a panel
    # wider than the grid.
    for path, breaks in ((("panels", 1, "targets", 0), lambda t: t.pop("expr")),
                         (("templating", "list", 2), lambda v: v.pop("datasource")),
                         (("panels", 1, "gridPos"), lambda g: g.update(w=25))):
        broken = json.loads(COMMITTED.read_text())
        node = broken
        for key in path:
            node = node[key]
        breaks(node)
        assert list(validator.iter_errors(broken)), path
    # What the schema cannot say: ids unique, no two panels on the same cells, one data source variable for all.
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids)) and d["uid"] == UID
    cells: set[tuple[int, int]] = set()
    for p in d["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not mine & cells, p["title"]
        cells |= mine
    names = [v["name"] for v in d["templating"]["list"]]
    assert names == ["datasource", "runbook", "node", "pod", "model", "gpu"]
    for p in panels(d):
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert all(t["datasource"] == p["datasource"] for t in p["targets"]), p["title"]


def _exprs(d: dict) -> list[str]:  # type: ignore[type-arg]
    out = [t["expr"] for p in panels(d) for t in p["targets"]]
    out += [a["expr"] for a in d["annotations"]["list"] if "expr" in a]
    out += [v["definition"] for v in d["templating"]["list"] if v["type"] == "query"]
    return out


def test_every_series_the_dashboard_reads_is_one_the_rule_group_records_or_the_agent_exports() -> None:
    """A renamed series cannot leave a dead panel: the names are read from the group's declarations, and here every
    name a query reads is one the group records (or the agent exports)."""
    for window_s in (3600, 15):
        d = dashboard(window_s, interval="1s" if window_s == 15 else "5m")
        recorded = {str(r["record"]) for g in build_groups(window_s) for r in g.rules if "record" in r}
        recorded.add(identity_record_name(window_s))
        read = {name for expr in _exprs(d) for name in _RECORDED.findall(expr)}
        assert read and read <= recorded, read - recorded
        # Each limiter's count, the limiter, the findings, the identities and the busy signal are read.
        for name in ("gpu:diagnoser_limiter", "gpu:diagnoser_finding", "limiter:diagnoser_gpus", "gpu:dcgm_identity",
                     "gpu:diagnoser_busy"):
            assert any(r.startswith(name) for r in read), name
    exported = set(agent_metrics().values())
    agent = {name for expr in _exprs(dashboard()) for name in _AGENT.findall(expr)} - {"up"}
    assert agent and agent <= exported, agent - exported
    assert {"diagnoser_verdict", "diagnoser_top_fix_gain_ratio", "diagnoser_last_run_ok",
            "diagnoser_run_errors_total", "diagnoser_agent_info"} <= agent


def test_each_rules_comparisons_are_plotted_against_the_thresholds_in_force(tmp_path: Path) -> None:
    config = tmp_path / "rules.toml"
    config.write_text("[thresholds.BW001]\ndram_active_mean = 0.45\n")
    rules = default_rules()
    changed = rules.with_overrides(load_overrides(config, rules))

    def bw001(d: dict) -> dict:  # type: ignore[type-arg]
        return next(p for p in panels(d) if p["title"].startswith("BW001") and "dram_active mean" in p["title"]
                    and "tensor" not in p["title"])

    def steps(p: dict) -> list[float]:  # type: ignore[type-arg]
        return [s["value"] for s in p["fieldConfig"]["defaults"]["thresholds"]["steps"] if s["value"] is not None]

    assert steps(bw001(dashboard())) == [rules.thresholds("BW001")["dram_active_mean"]]
    assert steps(bw001(dashboard(rules=changed))) == [0.45]
    r = cli("rules", "--grafana-dashboard", "--rules-config", str(config))
    assert r.returncode == 0 and steps(bw001(json.loads(r.stdout))) == [0.45]
    # Every rule with a finding in the group has its panels in the GPU's row, and each plots a threshold.
    titled = {p["title"].split(" ", 1)[0]: p for p in panels(dashboard()) if re.match(r"^[A-Z]+\d{3} ", p["title"])}
    assert set(titled) == {"BAT003", "BW001", "CMP001", "ERR001", "IDLE001", "LAT001", "LAT002", "THR001", "VRAM003"}
    assert all(steps(p) for p in titled.values())


def test_the_fleet_table_links_each_rules_page_and_names_its_first_fix() -> None:
    d = dashboard()
    table = next(p for p in panels(d) if p["title"].startswith("The most at stake"))
    expr = table["targets"][0]["expr"]
    docs = (REPO / "docs" / "rules.md").read_text()
    named = [r for r in default_rules().rules if r.fleet is not None]  # the rules a limiter's series names
    assert len(named) >= 9
    for rule in named:
        assert f'"runbook", "{runbook_anchor(rule)}", "rule", "{rule.code}"' in expr
        assert f"## {rule.code} {rule.name}\n" in docs
        fix = first_sentence(rule.page.fixes)
        assert f'"first_fix", {json.dumps(fix)}, "rule", "{rule.code}"' in expr and len(fix) > 10
    assert first_sentence("Do this first; then that. And more.") == "Do this first."
    link = table["fieldConfig"]["overrides"][0]["properties"][0]["value"][0]
    assert link["url"] == "${runbook}#${__value.raw}"
    runbook = next(v for v in d["templating"]["list"] if v["name"] == "runbook")
    assert runbook["query"] == "docs/rules.md"
    mine = dashboard(runbook_prefix="https://runbooks.example/diagnoser/rules.md")
    assert next(v for v in mine["templating"]["list"] if v["name"] == "runbook")["query"] == \
        "https://runbooks.example/diagnoser/rules.md"


@pytest.mark.parametrize("args, fragment", [(("--runbook-url-prefix", "a b"), "--runbook-url-prefix wants"),
                                            (("--window", "x"), "--window"),
                                            (("--interval", "soon"), "--interval wants")])
def test_bad_options_are_one_sentence(args: tuple[str, ...], fragment: str) -> None:
    r = cli("rules", "--grafana-dashboard", *args)
    assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr
