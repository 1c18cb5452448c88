"""`diagnoser rules --prometheus-rules`: the rule group passes promtool and vmalert's checks, and a real Prometheus
evaluating it over simulated exporters records the statistics `fleet` reads in one query and a limiter per GPU equal
to the Python engine's verdict for every planted class (throttled by clock-event bits and the spec clock
included), with the alerts pending or firing; split into shards, the same limiter for every GPU, each in one shard."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from diagnoser.collectors.prom_client import PromClient
from diagnoser.collectors.prom_stats import FALLBACK, STATS, identity_record_name, record_name
from diagnoser.collectors.prometheus_source import Window
from diagnoser.fleet.promrules import ALERTS, SHARD_LABEL, build_groups, rule_group_yaml
from diagnoser.fleet.run import run_fleet
from diagnoser.rules import default_rules
from tests.prom_harness import (
    NO_PROMETHEUS,
    PROFILE_RULE,
    PROFILE_VERDICT,
    REPO,
    ExporterProcess,
    PrometheusServer,
    ScrapeTarget,
    find_prometheus,
    legacy_fleet,
    node_targets,
    old_fleet,
    poll,
    renamed_fleet,
)

WINDOW = "15s"
SHARDED = "16s"  # the same group split three ways, over windows of another length (its own recorded names)


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "diagnoser", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env=env)


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (Debian's prometheus has it)")
def test_rule_group_passes_promtool(tmp_path: Path) -> None:
    config = tmp_path / "rules.toml"
    config.write_text("[thresholds.BW001]\ndram_active_mean = 0.45\n")
    for args in ((), ("--window", "30m", "--interval", "30s", "--rules-config", str(config))):
        r = cli("rules", "--prometheus-rules", *args)
        assert r.returncode == 0, r.stderr
        path = tmp_path / "rules.yml"
        path.write_text(r.stdout)
        check = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        assert check.returncode == 0, check.stdout + check.stderr
        assert "SUCCESS" in check.stdout
    assert ">= 0.45" in r.stdout  # the override reaches the PromQL, as it reaches the Python rule
    _assert_runbooks(r.stdout, "docs/rules.md")
    # A prefix of the user's: the links point there, and the file still passes.
    prefix = "https://runbooks.example.com/diagnoser/docs/rules.md"
    r = cli("rules", "--prometheus-rules", "--runbook-url-prefix", prefix)
    assert r.returncode == 0, r.stderr
    path.write_text(r.stdout)
    check = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert check.returncode == 0 and "SUCCESS" in check.stdout, check.stdout + check.stderr
    _assert_runbooks(r.stdout, prefix)
    for bad, fragment in ((("--window", "1s", "--interval", "1s"), "two evaluation intervals"),
                          (("--interval", "soon"), "--interval wants"), (("--window", "x"), "--window"),
                          (("--shards", "0"), "--shards wants"), (("--shards", "2", "--shard-by", "a-b"), "--shard-by"),
                          (("--runbook-url-prefix", "https://x/rules.md#top"), "--runbook-url-prefix wants"),
                          (("--runbook-url-prefix", 'x" y'), "--runbook-url-prefix wants")):
        r = cli("rules", "--prometheus-rules", *bad)
        assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr


def docs_anchors() -> set[str]:
    """The anchors of docs/rules.md's headings as GitHub writes them: lower case, punctuation but hyphens and
    underscores dropped, spaces as hyphens."""
    return {re.sub(r"[^a-z0-9 _-]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
            for line in (REPO / "docs" / "rules.md").read_text().splitlines() if line.startswith("#")}


def _assert_runbooks(text: str, prefix: str) -> None:
    """Every alert links its rule's page (a heading of docs/rules.md) and says what and where from its labels."""
    import yaml

    alerts = [r for g in yaml.safe_load(text)["groups"] for r in g["rules"] if "alert" in r]
    anchors = docs_anchors()
    assert {a["alert"] for a in alerts} == {name for name, _, _ in ALERTS.values()}
    rules = default_rules()
    for alert in alerts:
        notes = alert["annotations"]
        limiter = next(v for v, (name, _, _) in ALERTS.items() if name == alert["alert"])
        named = {r.code for r in rules.rules if r.fleet is not None and r.limiter.value == limiter}
        # One link per rule that can name the alert's limiter, chosen by its `rule` label (a Go template when two
        # rules can), each to a heading of docs/rules.md.
        links = re.findall(re.escape(prefix) + r"#([a-z0-9_-]+)", notes["runbook_url"])
        assert links and set(links) <= anchors, (alert["alert"], notes["runbook_url"], sorted(anchors)[:5])
        assert sorted(a.split("-", 1)[0].upper() for a in links) == sorted(named), (alert["alert"], links)
        rest = re.sub(re.escape(prefix) + r"#[a-z0-9_-]+", "", notes["runbook_url"])
        assert rest == "" if len(links) == 1 else rest.startswith("{{ if eq $labels.rule "), notes["runbook_url"]
        assert "{{ or $labels.UUID $labels.uuid }}" in notes["summary"] and "$labels.Hostname" in notes["summary"]
        assert "{{ $value" in notes["description"] and "$labels.modelName" in notes["description"]


@pytest.mark.skipif(shutil.which("vmalert") is None,
                    reason="vmalert is not installed (Debian's victoria-metrics has it)")
def test_rule_group_loads_in_vmalert(tmp_path: Path) -> None:
    path = tmp_path / "rules.yml"
    for text in (rule_group_yaml(3600), rule_group_yaml(3600, runbook_prefix="https://wiki.example/gpu/rules.md"),
                 rule_group_yaml(3600, shard_count=3, shard_by="Hostname")):
        path.write_text(text)
        r = subprocess.run(["vmalert", f"-rule={path}", "-dryRun"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]


AGENT_INSTANCE = "agent-0000"


@pytest.fixture(scope="module")
def agent_endpoint():  # type: ignore[no-untyped-def]
    """A real agent metrics endpoint (agent/metrics.py's MetricsServer) holding what two targets' runs left: one
    verdict with its first fix and a source it could not read, one run that failed."""
    from diagnoser.agent.history import RunRecord
    from diagnoser.agent.metrics import AgentMetrics, MetricsServer

    metrics = AgentMetrics()
    now = time.time()
    metrics.record_run(RunRecord(target="vllm:8000", started_at=now - 40, finished_at=now - 10, status="ok",
                                 verdict="memory_bandwidth", confidence=0.82, efficiency=0.61, top_fix="FP8 weights",
                                 top_fix_rule="BW001", top_fix_gain=1.7, gpu="0", pod="bandwidth-server-00001-7f9c",
                                 problems=["server: connection refused"]))
    metrics.record_run(RunRecord(target="sglang:30000", started_at=now - 40, finished_at=now - 5, status="timeout",
                                 error="the window did not end", gpu="1", pod="idle-server-00004-7f9c"))
    metrics.record_cycle(now - 5, 35.0)
    server = MetricsServer(metrics, "127.0.0.1", 0)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(scope="module")
def ruled(tmp_path_factory, agent_endpoint):  # type: ignore[no-untyped-def]
    """The planted fleets scraped by a Prometheus that evaluates the rule group every second over 15 s windows, and
    a real agent's metrics endpoint scraped beside them."""
    if find_prometheus() is None:
        pytest.skip(NO_PROMETHEUS)
    workdir = tmp_path_factory.mktemp("ruled")
    rules = workdir / "diagnoser.rules.yml"
    rules.write_text(cli("rules", "--prometheus-rules", "--window", WINDOW, "--interval", "1s").stdout)
    sharded = workdir / "diagnoser.sharded.rules.yml"
    sharded.write_text(cli("rules", "--prometheus-rules", "--window", SHARDED, "--interval", "1s", "--shards", "3",
                           "--shard-by", "gpu").stdout)
    exporters = [ExporterProcess(f, workdir) for f in (legacy_fleet(), renamed_fleet(), old_fleet())]
    prom = None
    try:
        for e in exporters:
            e.start()
        agent = ScrapeTarget(f"127.0.0.1:{agent_endpoint.port}", "/metrics", AGENT_INSTANCE)
        prom = PrometheusServer(workdir, [t for e in exporters for t in node_targets(e)] + [agent],
                                rule_files=[rules, sharded]).start()
        gpus = [g for e in exporters for g in e.fleet.gpus]
        # Every GPU classified over a full window (the first evaluations see a window only partly filled).
        poll(lambda: prom.query("min(count_over_time(DCGM_FI_DEV_FB_USED[1h]))") and
             float(prom.query("min(count_over_time(DCGM_FI_DEV_FB_USED[1h]))")[0]["value"][1]) >= 20, 240,
             "20 scrapes")
        for window in (WINDOW, SHARDED):
            poll(lambda w=window: len(prom.query(f"gpu:diagnoser_limiter:{w}")) == len(gpus), 120, "a limiter per GPU")
        yield prom, gpus
    finally:
        if prom is not None:
            prom.stop()
        for e in exporters:
            e.stop()


def _key(uuid: str, mig: str) -> tuple[str, str]:
    return (uuid, mig)


def test_promql_limiter_agrees_with_the_engine_for_every_planted_class(ruled) -> None:  # type: ignore[no-untyped-def]
    prom, gpus = ruled
    at = time.time()
    limiters = {}
    for s in prom.query(f"gpu:diagnoser_limiter:{WINDOW}"):
        m = s["metric"]
        limiters[_key(m.get("UUID") or m.get("uuid", ""), m.get("GPU_I_ID", ""))] = (m["limiter"], m["rule"])
    # The engine on the same recorded statistics (one query for them all), and on statistics it asks for itself.
    window = Window(at - 15, at)
    timings: dict = {}
    recorded = run_fleet(PromClient(prom.url), window, detail=0, timings=timings)
    assert timings["recorded"] and all(r.basis == "recorded statistics" for r in recorded.rows)
    adhoc = run_fleet(PromClient(prom.url), window, detail=0, use_recorded=False)
    assert all(r.basis == "statistics" for r in adhoc.rows)
    engine = {(r.uuid, r.gpu.partition("/")[2]): r for r in recorded.rows}
    asked = {(r.uuid, r.gpu.partition("/")[2]): r for r in adhoc.rows}
    for g in gpus:
        key = _key(g.uuid, g.mig_id)
        promql_limiter, promql_rule = limiters[key]
        row = engine[key]
        assert promql_limiter == row.diagnosis.verdict == PROFILE_VERDICT[g.profile], (g, limiters[key],
                                                                                       row.diagnosis.headline)
        assert promql_rule == row.diagnosis.findings[0].code == PROFILE_RULE[g.profile], (g, promql_rule)
        assert asked[key].diagnosis.verdict == row.diagnosis.verdict, (g, asked[key].diagnosis.headline)


def test_findings_are_arithmetic_on_recorded_series_in_a_group_of_their_own() -> None:
    """At 10,000 GPUs the findings rule, one union of every rule's PromQL over the statistics with a label_replace per
    rule, took 40-64 s of a Prometheus evaluation (benchmarks/FLEET.md). Each pass over the samples is now in the
    statistics group; the findings group reads recorded series only, one rule per finding labelled by the rule."""
    groups = build_groups(3600)
    assert [g.name for g in groups] == ["diagnoser-gpu-1h-statistics", "diagnoser-gpu-1h"]
    statistics, findings = groups
    assert all("_over_time(" in str(r["expr"]) or "rate(" in str(r["expr"]) or "increase(" in str(r["expr"])
               for r in statistics.rules)
    for rule in findings.rules:
        expr = str(rule["expr"])
        # no range selector (no pass over the samples), no label written per series
        assert not re.search(r"\[\d+(ms|s|m|h|d)\]", expr) and "label_replace" not in expr, rule
    codes = [r["labels"]["rule"] for r in findings.rules if r.get("record") == "gpu:diagnoser_finding:1h"]  # type: ignore[index]
    # One finding per rule with a formula (`@rule(fleet=...)`), compiled from it, in the rule set's order.
    assert codes == [r.code for r in default_rules().rules if r.fleet is not None]
    assert sorted(codes) == ["BAT003", "BW001", "CMP001", "ERR001", "IDLE001", "LAT001", "LAT002", "THR001", "VRAM003"]
    # Sharded: every group and every series it records carries its shard, and its findings read only their own.
    sharded = build_groups(3600, shard_count=4, shard_by="Hostname")
    assert len(sharded) == 8
    for g in sharded[1::2]:
        shard = g.name.rsplit("-", 3)[1]
        for rule in g.rules:
            assert rule["labels"][SHARD_LABEL] == shard, rule  # type: ignore[index]
            if "record" in rule and "spec" not in str(rule["record"]):
                assert f'{SHARD_LABEL}="{shard}"' in str(rule["expr"]), rule


def test_sharded_groups_classify_each_gpu_once_as_one_group_does(ruled) -> None:  # type: ignore[no-untyped-def]
    prom, gpus = ruled

    def limiters(window: str) -> dict[tuple[str, str], list[tuple[str, str, str]]]:
        out: dict[tuple[str, str], list[tuple[str, str, str]]] = {}
        for s in prom.query(f"gpu:diagnoser_limiter:{window}"):
            m = s["metric"]
            out.setdefault(_key(m.get("UUID") or m.get("uuid", ""), m.get("GPU_I_ID", "")), []).append(
                (m["limiter"], m["rule"], m.get(SHARD_LABEL, "")))
        return out

    whole, split = limiters(WINDOW), limiters(SHARDED)
    assert set(split) == set(whole) == {_key(g.uuid, g.mig_id) for g in gpus}
    for key, found in split.items():
        assert len(found) == 1 and found[0][:2] == whole[key][0][:2], (key, found, whole[key])
    assert {found[0][2] for found in split.values()} == {"1", "2", "3"}  # the GPU indexes spread over all three
    # Each GPU's statistics in one shard only, and `fleet` reads them as it reads one group's.
    sm = prom.query("gpu:dcgm_sm_active:avg_16s")
    assert len({(s["metric"].get("UUID") or s["metric"].get("uuid"), s["metric"].get("GPU_I_ID")) for s in sm}) \
        == len(sm)
    timings: dict = {}
    report = run_fleet(PromClient(prom.url), Window(time.time() - 16, time.time()), detail=0, timings=timings)
    assert timings["recorded"] and all(r.basis == "recorded statistics" for r in report.rows)
    assert sorted((r.uuid, r.diagnosis.verdict) for r in report.rows) == sorted(
        (g.uuid, PROFILE_VERDICT[g.profile]) for g in gpus)


def test_fleet_reads_the_recorded_statistics_by_name(ruled) -> None:  # type: ignore[no-untyped-def]
    prom, gpus = ruled
    client = PromClient(prom.url)
    sent: list[str] = []
    call = client._call

    def recording(endpoint: str, params: dict[str, str], method: str = "POST") -> bytes:
        sent.append(params.get("query", endpoint))
        return call(endpoint, params, method)

    client._call = recording  # type: ignore[method-assign]
    timings: dict = {}
    report = run_fleet(client, Window(time.time() - 15, time.time()), detail=0, timings=timings)
    assert len(report.rows) == len(gpus) and report.errors == []
    # The metric names, the recorded identities, and each recorded statistic read by its name: no pass over samples,
    # no function evaluated (one query for all of them made the engine write one answer of 168 MB at 100,000 GPUs).
    # Besides: the recorded series' freshness (their newest sample's time at the window's end beside the newest
    # scrape's, and the sample before it) and the UUIDs any DCGM series carries (label values, from the index), which
    # every GPU listed already has.
    recorded = {record_name(s, 15) for s in (*STATS, FALLBACK)}
    assert sent[0] == "label/__name__/values" and identity_record_name(15) in sent
    fresh = [q for q in sent if f"max(timestamp({identity_record_name(15)}))" in q]
    census = [q for q in sent[1:] if q.startswith("label/")]
    assert len(fresh) == 2 and sorted(census) == ["label/UUID/values", "label/uuid/values"], sent
    # And three small probes of the raw samples, each one query whatever the fleet's size: one GPU's anchor samples
    # over the window (the scrape interval, from their spacing), the newest scrape's time (`up`), and which GPUs sent
    # a sample in the window's last few intervals (one count per GPU over 10 s: GPUs silent at the end are partial).
    probes = [q for q in sent if q == "max(timestamp(up))" or q.startswith("max by (UUID, uuid, GPU_I_ID) "
                                                                              "(count_over_time(")
              or (q.startswith("{__name__=~") and 'UUID="' in q and q.endswith("ms]"))]
    assert len(probes) == 3, sent
    reads = [q for q in sent[1:] if q != identity_record_name(15) and q not in fresh and q not in census
             and q not in probes]
    assert reads and set(reads) <= recorded and len(reads) == len(set(reads)), sent
    assert {"gpu:dcgm_sm_active:avg_15s", "gpu:dcgm_reasons_power:max_15s"} <= set(reads)
    assert client.queries == len(sent) == len(reads) + 2 + len(fresh) + len(census) + len(probes)
    assert timings["recorded"]
    # A window of another length has no recorded series: the statistics are computed, and the answer is the same.
    other = run_fleet(PromClient(prom.url), Window(time.time() - 14, time.time()), detail=0)
    assert all(r.basis == "statistics" for r in other.rows)
    assert sorted(r.diagnosis.verdict for r in other.rows) == sorted(r.diagnosis.verdict for r in report.rows)


def test_alerts_for_the_limiters_that_call_for_action(ruled) -> None:  # type: ignore[no-untyped-def]
    prom, gpus = ruled

    def alerting() -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for s in prom.query("ALERTS"):
            m = s["metric"]
            out.setdefault(m["alertname"], set()).add(m.get("UUID") or m.get("uuid", ""))
        return out

    throttled = {g.uuid for g in gpus if g.profile == "throttled"}
    errors = {g.uuid for g in gpus if g.profile == "xid"}
    poll(lambda: throttled <= alerting().get(ALERTS["throttling"][0], set()), 60, "the throttling alerts")
    found = alerting()
    # Each alert carries its GPU's node, pod and model and is valued at its finding's strength (as the description
    # says; THR001's is 0.5-0.9), its summary filled from them, its runbook its rule's page.
    from tests.prom_harness import _get

    active = [a for a in json.loads(_get(f"{prom.url}/api/v1/alerts", 30))["data"]["alerts"]
              if a["labels"]["alertname"] == ALERTS["throttling"][0]]
    assert active
    for a in active:
        labels = a["labels"]
        node = labels.get("Hostname") or labels.get("hostname")
        assert labels["rule"] == "THR001" and node and labels.get("modelName"), labels
        assert 0.5 <= float(a["value"]) <= 0.9, a["value"]
        uuid = labels.get("UUID") or labels.get("uuid")
        assert a["annotations"]["summary"].startswith(f"GPU {uuid}") and f" on {node}" in a["annotations"]["summary"]
        assert f"strength is {float(a['value']):.2f}" in a["annotations"]["description"]
        assert a["annotations"]["runbook_url"] == "docs/rules.md#thr001-clocks-throttled"
    # Two rules name the kernel-bound limiter: each alert's link is its own rule's page.
    kernel = poll(lambda: [a for a in json.loads(_get(f"{prom.url}/api/v1/alerts", 30))["data"]["alerts"]
                           if a["labels"]["alertname"] == ALERTS["latency"][0]], 60, "the kernel-bound alerts")
    for a in kernel:  # type: ignore[attr-defined]
        code = a["labels"]["rule"]
        assert code in ("LAT001", "LAT002") and a["annotations"]["runbook_url"].startswith(
            f"docs/rules.md#{code.lower()}-"), a
    assert errors <= found[ALERTS["errors"][0]]
    idle = {g.uuid for g in gpus if g.profile == "idle"}
    assert idle <= found[ALERTS["idle"][0]]
    # A saturated roof is the GPU doing its work: no alert.
    compute = {g.uuid for g in gpus if g.profile == "compute" and not g.mig_id}
    assert not compute & set().union(*found.values())


def test_a_lost_statistic_is_asked_again_and_a_loss_is_partial_in_the_exit_code(ruled, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """One query lost to the engine's 30 s limit turned every VRAM-limited GPU of a 10,000-GPU fleet inconclusive,
    exit 0 with a warning. A lost statistic is asked once more; lost twice, the rows are partial and `fleet` exits 4
    after writing the report."""
    from typer.testing import CliRunner

    from diagnoser.cli.app import app
    from diagnoser.collectors.prom_client import PromError

    prom, gpus = ruled
    target = record_name(next(s for s in STATS if s.field == "sm_active"), 15)
    real = PromClient._call
    lost = {"left": 1}

    def flaky(self, endpoint: str, params: dict[str, str], method: str = "POST") -> bytes:  # type: ignore[no-untyped-def]
        if params.get("query") == target and lost["left"] > 0:
            lost["left"] -= 1
            raise PromError("did not answer within 30 s (raise --timeout or shorten the window).", "timeout")
        return real(self, endpoint, params, method)

    monkeypatch.setattr(PromClient, "_call", flaky)
    once = run_fleet(PromClient(prom.url), Window(time.time() - 15, time.time()), detail=0)
    assert lost["left"] == 0 and once.lost == [] and not any("failed" in e for e in once.errors), once.errors
    lost["left"] = 10**6  # lost every time it is asked
    twice = run_fleet(PromClient(prom.url), Window(time.time() - 15, time.time()), detail=0)
    assert twice.lost == ["sm_active"] and all(r.partial for r in twice.rows)
    result = CliRunner().invoke(app, ["fleet", "--prometheus", prom.url, "--since", "15s", "--json"])
    assert result.exit_code == 4, result.output
    assert "partial result" in result.stderr and json.loads(result.stdout)["lost"] == ["sm_active"]


# --- the Grafana dashboard's queries (fleet/dashboard.py) on the same Prometheus -----------------------------------


def _grafana(expr: str, **values: str) -> str:
    """A query as Grafana sends it: each variable replaced by its value (All: `.*`), the rate interval by a minute."""
    expr = expr.replace("$__rate_interval", "1m")
    for name in ("node", "pod", "model", "gpu"):
        expr = expr.replace(f"${name}", values.get(name, ".*"))
    assert "$" not in expr.replace('"$1"', ""), expr
    return expr


def _range(prom, expr: str, seconds: float = 120, step: str = "1s") -> list[dict]:  # type: ignore[no-untyped-def,type-arg]
    import urllib.parse

    from tests.prom_harness import _get

    end = time.time()
    params = urllib.parse.urlencode({"query": expr, "start": f"{end - seconds:.3f}", "end": f"{end:.3f}",
                                     "step": step})
    answer = json.loads(_get(f"{prom.url}/api/v1/query_range?{params}", 60))
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _variable_values(prom, variable: dict, **values: str) -> list[str]:  # type: ignore[no-untyped-def,type-arg]
    """What Grafana lists for a query variable: label_values(expr, label), or query_result(expr) through the regex
    (each series written as Grafana writes it, `name{label="value",...}`)."""
    definition = variable["definition"]
    found = re.fullmatch(r"label_values\((.*), (\w+)\)", definition, re.S)
    if found:
        expr, label = found.groups()
        return sorted({s["metric"][label] for s in prom.query(_grafana(expr, **values)) if label in s["metric"]})
    found = re.fullmatch(r"query_result\((.*)\)", definition, re.S)
    assert found, definition
    regex = re.compile(variable["regex"].strip("/"))
    out = set()
    for s in prom.query(_grafana(found.group(1), **values)):
        labels = ",".join(f'{k}="{v}"' for k, v in s["metric"].items() if k != "__name__")
        hit = regex.search(f"{s['metric'].get('__name__', '')}{{{labels}}} {s['value'][1]} {s['value'][0]}")
        if hit:
            out.add(hit.group(1))
    return sorted(out)


def test_every_dashboard_query_has_data_on_the_test_fleet_and_agent(ruled) -> None:  # type: ignore[no-untyped-def]
    """deploy/grafana's dashboard, generated for this group's window: every panel's query, every variable's and
    every annotation's returns series, on the fleet's recorded series and on a real agent's scraped metrics."""
    from diagnoser.fleet.dashboard import dashboard

    prom, gpus = ruled
    d = dashboard(15, interval="1s")
    # The alerts' annotation needs an alert firing: the throttled GPUs' fire once their `for` has passed.
    poll(lambda: prom.query('ALERTS{alertstate="firing"}'), 90, "a firing alert")
    empty: list[str] = []
    row = ""
    for panel in d["panels"]:
        if panel["type"] == "row":
            row = panel["title"]
            continue
        for target in panel["targets"]:
            expr = _grafana(target["expr"])
            result = prom.query(expr) if target["instant"] else _range(prom, expr)
            if not result:
                empty.append(f"{row} / {panel['title']}: {expr[:300]}")
    for note in d["annotations"]["list"]:
        if "expr" in note:  # a verdict change: each GPU's first limiter is one, in the hour the fleet has run
            if not _range(prom, _grafana(note["expr"]), seconds=3600, step=note["step"]):
                empty.append(f"annotation {note['name']}")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    for name in ("node", "pod", "model", "gpu"):
        if not _variable_values(prom, variables[name]):
            empty.append(f"variable {name}")
    assert empty == [], "\n".join(empty)
    # What the panels show is what was planted: the table's rows carry their runbook and first fix, the agent's
    # verdict is its target's number, the variables list the fleet's nodes, pods and GPUs.
    table = next(p for p in d["panels"] if p["title"].startswith("The most at stake"))
    rows = prom.query(_grafana(table["targets"][0]["expr"]))
    assert all(r["metric"].get("runbook") and r["metric"].get("first_fix") for r in rows)
    stakes = {r["metric"]["limiter"]: float(r["value"][1]) for r in rows}
    assert stakes.get("idle") == stakes.get("errors") == 1.0 and 0 < stakes["batching"] < 1, stakes
    verdicts = next(p for p in d["panels"] if p["title"] == "Verdict per server")
    number = {s["metric"]["target"]: float(s["value"][1]) for s in prom.query(_grafana(verdicts["targets"][0]["expr"]))}
    from diagnoser.fleet.dashboard import verdict_numbers

    assert number == {"vllm:8000": verdict_numbers()["memory_bandwidth"]}
    assert set(_variable_values(prom, variables["node"])) == {g.hostname for g in gpus}
    assert set(_variable_values(prom, variables["gpu"])) == {g.uuid for g in gpus}
    assert {g.pod for g in gpus if g.pod} <= set(_variable_values(prom, variables["pod"]))


def test_the_dashboards_variables_narrow_its_panels(ruled) -> None:  # type: ignore[no-untyped-def]
    """A node chosen: its pods and GPUs listed, its GPUs counted; a GPU chosen: the GPU's panels show it alone."""
    from diagnoser.fleet.dashboard import dashboard

    prom, gpus = ruled
    d = dashboard(15, interval="1s")
    variables = {v["name"]: v for v in d["templating"]["list"]}
    node = "node-0005"  # the renamed exporter's node: its label is `hostname`, not `Hostname`
    on_node = [g for g in gpus if g.hostname == node]
    assert set(_variable_values(prom, variables["gpu"], node=node)) == {g.uuid for g in on_node}
    assert set(_variable_values(prom, variables["pod"], node=node)) == {g.pod for g in on_node if g.pod}
    per_verdict = next(p for p in d["panels"] if p["title"] == "GPUs per verdict")["targets"][0]["expr"]
    counted = prom.query(_grafana(per_verdict, node=node))
    assert sum(float(s["value"][1]) for s in counted) == len(on_node)
    throttled = next(g for g in gpus if g.profile == "throttled" and not g.mig_id)
    gpu_row = [p for p in d["panels"] if p["type"] != "row" and p["gridPos"]["y"] > 9 and "server" not in p["title"]
               and not p["title"].startswith(("First fix", "Predicted", "Confidence", "Scrape", "Since", "Sources"))]
    clock = next(p for p in gpu_row if p["title"].startswith("THR001") and "clock_frac" in p["title"])
    shown = prom.query(_grafana(clock["targets"][0]["expr"], gpu=throttled.uuid))
    assert [s["metric"].get("UUID") or s["metric"].get("uuid") for s in shown] == [throttled.uuid]
    bar = clock["fieldConfig"]["defaults"]["thresholds"]["steps"][1]["value"]
    assert float(shown[0]["value"][1]) < bar  # why it is throttled: its clock under the threshold drawn
