"""`diagnoser fleet` against a real Prometheus scraping simulated dcgm-exporters: one verdict per GPU and MIG
instance, money at stake, grouping, JSON, the 80-column table, --fail-on, HTML, and an exporter that vanishes."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from diagnoser.collectors.prometheus_source import PromClient, Window
from diagnoser.fleet.run import publishable, run_fleet
from tests.prom_harness import (  # noqa: F401  (dcgm_stack and vm_stack are fixtures)
    HOSTILE_POD,
    NO_PROMETHEUS,
    PROFILE_VERDICT,
    REPO,
    DcgmStack,
    ExporterProcess,
    PrometheusServer,
    SimFleet,
    dcgm_stack,
    find_prometheus,
    node_targets,
    poll,
    vm_stack,
)

pytestmark = [pytest.mark.prometheus, pytest.mark.slow,
              pytest.mark.skipif(find_prometheus() is None, reason=NO_PROMETHEUS)]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "diagnoser", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env=env)


@pytest.fixture(scope="module")
def fleet_json(dcgm_stack):  # type: ignore[no-untyped-def]
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--json", "--group-by", "namespace")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def check_rows(stack: DcgmStack, doc: dict) -> None:
    """Every GPU and MIG instance of the three exporters (legacy, DCGM 4.6 with clock event reasons and no maximum
    clock, lower-case names with old labels) has its row, with its planted verdict."""
    rows = {(row["uuid"], row["gpu"]): row for row in doc["rows"]}
    expected = {(g.uuid, f"{g.index}/{g.mig_id}" if g.mig_id else str(g.index)): g for g in stack.gpus}
    assert set(rows) == set(expected)  # the MIG board itself is no row: its instances are
    for key, g in expected.items():
        row = rows[key]
        assert row["diagnosis"]["verdict"] == PROFILE_VERDICT[g.profile], (g, row["diagnosis"]["headline"])
        assert row["node"] == g.hostname
        assert row["pod"] == publishable(g.pod, {}) and row["namespace"] == g.namespace
        assert not row["partial"], row["notes"]
    mig = [r for r in doc["rows"] if r["mig_profile"]]
    assert len(mig) == 2 and all(r["gpu"].startswith("0/") for r in mig)
    # The top of the list was read again as points; the rest comes from the engine's window statistics.
    assert {r["basis"] for r in doc["rows"]} == {"points"} and doc["timings"]["detailed"] == len(rows)


def test_one_row_per_gpu_and_mig_instance_with_the_right_verdict(dcgm_stack, fleet_json) -> None:  # type: ignore[no-untyped-def]
    check_rows(dcgm_stack, fleet_json)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_statistics_alone_give_the_same_verdicts(dcgm_stack, jobs) -> None:  # type: ignore[no-untyped-def]
    # --jobs 2: the GPUs diagnosed by two forked workers, their diagnoses sent back packed (diagnoser/fleet/pack.py)
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--json", "--detail", "0", "--jobs", jobs)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert {row["basis"] for row in doc["rows"]} == {"statistics"}
    assert doc["timings"]["triage_processes"] == int(jobs)
    by_key = {(row["uuid"], row["gpu"]): row["diagnosis"]["verdict"] for row in doc["rows"]}
    for g in dcgm_stack.gpus:
        assert by_key[(g.uuid, f"{g.index}/{g.mig_id}" if g.mig_id else str(g.index))] == PROFILE_VERDICT[g.profile]


def test_victoria_metrics_serves_the_same_fleet(vm_stack) -> None:  # type: ignore[no-untyped-def]
    r = cli("fleet", "--prometheus", vm_stack.prom.url, "--since", "12s", "--json")
    assert r.returncode == 0, r.stderr
    check_rows(vm_stack, json.loads(r.stdout))
    # One GPU, on the DCGM 4.6 exporter without a maximum clock: throttled by its clock-event bits.
    g = vm_stack.gpu("throttled", renamed=True)
    r = cli("dcgm", "--prometheus", vm_stack.prom.url, "--since", "12s", "--uuid", g.uuid, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verdict"] == "throttling"


def test_selectors_narrow_the_fleet(dcgm_stack) -> None:  # type: ignore[no-untyped-def]
    g = dcgm_stack.gpu("compute")
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--json", "--node", g.hostname)
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert {row["node"] for row in rows} == {g.hostname} and len(rows) == 4
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--json", "--uuid", g.uuid[:12])
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [row["uuid"] for row in rows] == [g.uuid] and rows[0]["basis"] == "points"
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--uuid", "GPU-")
    assert r.returncode == 2 and "matches" in r.stderr and "Traceback" not in r.stderr


def test_hostile_labels_are_redacted_and_escapes_never_reach_the_terminal(dcgm_stack, fleet_json) -> None:  # type: ignore[no-untyped-def]
    text = json.dumps(fleet_json)
    assert HOSTILE_POD not in text and "sk-proj" not in text
    assert any(r["pod"] == "idle-[redacted]" for r in fleet_json["rows"])
    assert "\\u001b" not in text and "\x1b" not in text
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--limit", "40")
    assert r.returncode == 0 and "sk-proj" not in r.stdout and "\x1b" not in r.stdout + r.stderr
    r = cli("dcgm", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--pod", "idle-sk", "--json")
    assert r.returncode == 0, r.stderr
    assert "sk-proj" not in r.stdout and "\\u001b" not in r.stdout


def test_rows_are_sorted_by_money_at_stake(fleet_json) -> None:  # type: ignore[no-untyped-def]
    rows = fleet_json["rows"]
    stakes = [r["usd_per_hour_at_stake"] for r in rows]
    assert stakes == sorted(stakes, reverse=True)
    h100 = 6.9  # the rough list price of an H100 SXM in diagnoser/fleet/run.py
    idle = [r for r in rows if r["diagnosis"]["verdict"] == "idle" and not r["mig_profile"]]
    assert idle and all(r["usd_per_hour_at_stake"] == pytest.approx(h100) and r["frac_at_stake"] == 1.0 for r in idle)
    batching = [r for r in rows if r["diagnosis"]["verdict"] == "batching"]
    for r in batching:  # an underfed GPU puts its idle share at stake
        assert r["frac_at_stake"] == pytest.approx(1 - r["busy"], abs=1e-3)
    mig_idle = [r for r in rows if r["mig_profile"] == "3g.40gb"]
    assert all(r["usd_per_gpu_hour"] == pytest.approx(h100 * 3 / 7) for r in mig_idle)
    assert rows[0]["frac_at_stake"] == 1.0  # an idle GPU or one with errors leads


def test_groups_add_up(fleet_json) -> None:  # type: ignore[no-untyped-def]
    groups = fleet_json["groups"]
    assert fleet_json["group_by"] == "namespace"
    assert sum(g["gpus"] for g in groups) == len(fleet_json["rows"])
    total = sum(r["usd_per_hour_at_stake"] for r in fleet_json["rows"])
    assert sum(g["usd_per_hour_at_stake"] for g in groups) == pytest.approx(total, abs=1e-3)
    names = {g["name"] for g in groups}
    assert {"team-0", "team-1", "team-2", "(no namespace)"} <= names
    assert fleet_json["timings"]["queries"] >= 5 and fleet_json["errors"] == []


def test_price_override_and_unknown_prices(dcgm_stack) -> None:  # type: ignore[no-untyped-def]
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--json", "--usd-per-gpu-hour", "2")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["usd_per_gpu_hour"] == 2 and doc["price_source"] == "--usd-per-gpu-hour"
    idle = [row for row in doc["rows"] if row["diagnosis"]["verdict"] == "idle" and not row["mig_profile"]]
    assert all(row["usd_per_hour_at_stake"] == pytest.approx(2.0) for row in idle)


def test_terminal_table_fits_80_columns_as_plain_text(dcgm_stack) -> None:  # type: ignore[no-untyped-def]
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--group-by", "node", "--limit", "9")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "\x1b[" not in out  # piped: no colour codes
    assert all(len(line) <= 80 for line in out.splitlines()), max(out.splitlines(), key=len)
    assert re.search(r"^Fleet: 17 GPUs on 5 nodes", out, re.M)
    assert "node-0005:" in out and "idle" in out and "throttled" in out
    assert "... and 8 more GPUs" in out
    assert "At stake: $" in out


def test_fail_on_and_html(dcgm_stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    html = tmp_path / "fleet.html"
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--fail-on", "errors", "--html", str(html))
    assert r.returncode == 1, r.stderr  # one simulated GPU reports XID 79
    text = html.read_text()
    assert "17 GPUs" in text and dcgm_stack.gpu("xid").pod in text and "GPU errors" in text
    assert "sk-proj" not in text
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--fail-on", "interconnect", "--json")
    assert r.returncode == 0
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--group-by", "rack")
    assert r.returncode == 2 and "--group-by must be one of" in r.stderr


def test_exporter_vanishing_mid_window_marks_its_gpus_partial(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fleet = SimFleet(n_gpus=4, gpus_per_node=2, profiles=("compute", "idle"))
    with ExporterProcess(fleet, tmp_path) as exporter, \
            PrometheusServer(tmp_path, node_targets(exporter)) as prom:
        prom.wait_for_samples(2, timeout=120)
        started = time.time()  # the window starts once every GPU has data
        prom.wait_for_samples(10, timeout=120)
        exporter.set_down(1)
        gone = time.time()
        poll(lambda: prom.query('up{instance="node-0001"} == 0'), 60, "Prometheus to see node-0001 down")
        # Node 0 keeps reporting; wait until it has several more scrapes than node 1's last.
        poll(lambda: time.time() - gone > 8, 30, "some seconds without node 1")
        report = run_fleet(PromClient(prom.url), Window(started, time.time()), points=30)
    by_node: dict[str, list] = {}
    for row in report.rows:
        by_node.setdefault(row.node, []).append(row)
    assert len(by_node["node-0000"]) == 2 and len(by_node["node-0001"]) == 2
    assert not any(r.partial for r in by_node["node-0000"])
    for r in by_node["node-0001"]:
        assert r.partial and "no data after" in r.notes[0] and "gone" in r.notes[0]
        assert any("partial" in n for n in r.diagnosis.notes)
        # What it reported before it went is still diagnosed.
        g = next(x for x in fleet.gpus if x.uuid == r.uuid)
        assert r.diagnosis.verdict == PROFILE_VERDICT[g.profile]
    assert any("gaps or stopped reporting" in e for e in report.errors)


def test_credentials_in_the_prometheus_url_are_never_printed(dcgm_stack) -> None:  # type: ignore[no-untyped-def]
    """`--prometheus http://user:pass@host` (a basic-auth proxy in front of the engine): the JSON and the terminal
    name the source without its password, as the HTML page does."""
    url = dcgm_stack.prom.url.replace("http://", "http://fleet-reader:s3cret-Pa55word@")
    for args in (("--json",), ("--limit", "3")):
        r = cli("fleet", "--prometheus", url, "--since", "12s", *args)
        assert r.returncode == 0, r.stderr
        assert "s3cret-Pa55word" not in r.stdout + r.stderr
    assert json.loads(cli("fleet", "--prometheus", url, "--since", "12s", "--json").stdout)["source"].endswith(
        dcgm_stack.prom.url.split("://", 1)[1])
