"""Which GPUs the fleet sees: every GPU or MIG instance any DCGM series names, not only those with the discovery's
anchor field; and the rule group's recorded statistics read only while they are fresh.

Real dcgm-exporter pages (tests/fixtures/dcgm, SOURCES.md there: a T4 pair with DCP fields only, H100 MIG instances
with pods and activity only, an RTX 2000 Ada and an A30 MIG instance with no field a rule reads, an A100 whose MIG
instance has activity but no memory field) are served as four nodes to a real Prometheus; and simulated exporters
scraped by a Prometheus whose rule group stops recording before the window's end."""

from __future__ import annotations

import http.server
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diagnoser.collectors.dcgm import drop_mig_parents, parse_exporter_text
from diagnoser.collectors.prom_client import PromClient
from diagnoser.collectors.prometheus_source import Window
from diagnoser.fleet.run import run_fleet
from tests.prom_harness import (
    NO_PROMETHEUS,
    PROFILE_VERDICT,
    REPO,
    ExporterProcess,
    PrometheusServer,
    ScrapeTarget,
    SimFleet,
    find_prometheus,
    node_targets,
    poll,
)

pytestmark = [pytest.mark.prometheus, pytest.mark.slow,
              pytest.mark.skipif(find_prometheus() is None, reason=NO_PROMETHEUS)]

DCGM = REPO / "tests" / "fixtures" / "dcgm"
PAGES = ("t4x2_gke_k8s_prof", "h100_mig_1g10gb_k8s_excerpt", "rtx2000ada_a30mig_lowercase_hostname_excerpt",
         "a100_mig_1g5gb_cloud_native_docs")
H100_UUID = "GPU-58e8f5ea-13cc-013a-d88f-2bcf5ae8bc77"
T4_UUID = "GPU-84412445-5790-0b3f-f714-da8aa3b2c0b0"
A30_POD = "triton-server-f7cb5d77-95xcf"
H100_POD = "text-embedding-predictor-00008-deployment-57946f6c67-vdtjl"


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "diagnoser", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=180, env=env)


def expected_gpus() -> dict[tuple[str, str], tuple[str, list[tuple[str, str]], set[str]]]:
    """(UUID, gpu label) -> (node, pods, fields) of every GPU or MIG instance of the pages, as the exporter parser
    reads them (a MIG board is no GPU of its own: its instances are)."""
    out = {}
    for page in PAGES:
        scrape = parse_exporter_text((DCGM / f"{page}.prom").read_text(), at=0.0)
        for g in drop_mig_parents(scrape.gpus.values()):
            out[(g.uuid, g.label)] = (g.node, g.pods, set(scrape.values.get(g.key, {})))
    return out


class _Pages(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        parts = [p for p in self.path.split("/") if p]
        if len(parts) == 3 and parts[0] == "page" and parts[1] in PAGES and parts[2] == "metrics":
            body = (DCGM / f"{parts[1]}.prom").read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        else:
            self.send_error(404)


@pytest.fixture(scope="module")
def pages_prom(tmp_path_factory):  # type: ignore[no-untyped-def]
    """The four real pages, each a node's exporter, scraped every second by a real Prometheus."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Pages)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    port = server.server_address[1]
    targets = [ScrapeTarget(f"127.0.0.1:{port}", f"/page/{p}/metrics", f"exporter-{i}:9400")
               for i, p in enumerate(PAGES)]
    prom = PrometheusServer(tmp_path_factory.mktemp("pages"), targets).start()
    try:
        def scraped() -> bool:
            counts = prom.query("count_over_time(up[1h]) and up == 1")
            return len(counts) == len(PAGES) and min(float(s["value"][1]) for s in counts) >= 14
        poll(scraped, 120, "14 scrapes of every page")
        yield prom
    finally:
        prom.stop()
        server.shutdown()
        server.server_close()


def fleet_json(prom: PrometheusServer, *args: str) -> dict:
    r = cli("fleet", "--prometheus", prom.url, "--since", "12s", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_every_gpu_of_the_pages_is_diagnosed_or_listed_with_a_reason(pages_prom) -> None:  # type: ignore[no-untyped-def]
    expected = expected_gpus()
    assert len(expected) == 8  # 2 T4, 3 H100 MIG instances, an RTX 2000 Ada, an A30 and an A100 MIG instance
    doc = fleet_json(pages_prom)
    rows = {(r["uuid"], r["gpu"]): r for r in doc["rows"]}
    assert set(rows) == set(expected), sorted(set(expected) - set(rows))
    blind = set()
    for key, (node, pods, _fields) in expected.items():
        row = rows[key]
        assert row["node"] == node
        assert row["pod"] == ", ".join(p for _, p in pods)
        if row["basis"] == "not diagnosed":
            blind.add(key)
            assert row["diagnosis"]["verdict"] == "inconclusive" and row["partial"]
            assert row["notes"][0].startswith("not diagnosed: no field a rule reads (only ")
            assert "DCGM_FI_DEV_FB_FREE" in row["notes"][0]
        else:
            assert row["basis"] in ("points", "statistics"), row
    # The two with free memory only (and the decoder, encoder): nothing a rule reads. The rest has activity.
    assert {k[1] for k in blind} == {"1", "2/3"} and fields_of(expected, blind) == {"fb_free"}
    h100 = {k: rows[k] for k in expected if k[0] == H100_UUID}
    assert sorted(h100) == [(H100_UUID, "0/7"), (H100_UUID, "0/8"), (H100_UUID, "0/9")]
    assert all(r["diagnosis"]["verdict"] == "idle" for r in h100.values())  # GR_ENGINE_ACTIVE 0 all along
    a100 = rows[("GPU-34319582-d595-d1c7-d1d2-179bcfa61660", "0/13")]
    assert a100["mig_profile"] == "1g.5gb" and a100["basis"] != "not diagnosed"
    # The account, in the report and its first note.
    assert doc["gpus_seen"] == 8 and doc["gpus_diagnosed"] == 6
    assert doc["gpus_per_field"]["DCGM_FI_PROF_GR_ENGINE_ACTIVE"] == 4  # 3 H100 instances and the A100's
    assert doc["gpus_per_field"]["DCGM_FI_PROF_SM_ACTIVE"] == 2
    head = doc["notes"][0]
    assert head.startswith("8 GPUs or MIG instances seen in the window on 4 nodes, 6 diagnosed"), head
    assert "2 GPUs have no field a rule reads" in head and "listed as not diagnosed" in head
    assert any("2 GPUs have no field a rule reads" in e for e in doc["errors"])


def fields_of(expected: dict, keys: set) -> set[str]:  # type: ignore[type-arg]
    return set().union(*(expected[k][2] for k in keys))


def test_selectors_find_the_gpus_the_anchor_lacks(pages_prom) -> None:  # type: ignore[no-untyped-def]
    rows = fleet_json(pages_prom, "--pod", H100_POD[:20])["rows"]
    assert [(r["uuid"], r["gpu"]) for r in rows] == [(H100_UUID, "0/7")] and rows[0]["basis"] == "points"
    rows = fleet_json(pages_prom, "--uuid", H100_UUID[:12])["rows"]
    assert sorted(r["gpu"] for r in rows) == ["0/7", "0/8", "0/9"]
    rows = fleet_json(pages_prom, "--uuid", T4_UUID)["rows"]
    assert [r["gpu"] for r in rows] == ["0"] and rows[0]["pod"] == "triton-84d57987c9-kks4k"
    rows = fleet_json(pages_prom, "--node", "ub20-a100-k8s")["rows"]
    assert [r["gpu"] for r in rows] == ["0/13"]  # the instance without FB_USED; its board is no row
    rows = fleet_json(pages_prom, "--pod", A30_POD)["rows"]
    assert [r["gpu"] for r in rows] == ["2/3"] and rows[0]["basis"] == "not diagnosed"
    # One target, through the same union.
    r = cli("dcgm", "--prometheus", pages_prom.url, "--since", "12s", "--pod", H100_POD, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verdict"] == "idle"
    r = cli("dcgm", "--prometheus", pages_prom.url, "--since", "12s", "--uuid", T4_UUID, "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verdict"] == "idle"  # SM activity 0


# --- the recorded statistics' freshness ---------------------------------------------------------------------------

WINDOW = "15s"


def _rules(workdir: Path) -> Path:
    path = workdir / "diagnoser.rules.yml"
    r = cli("rules", "--prometheus-rules", "--window", WINDOW, "--interval", "1s")
    assert r.returncode == 0, r.stderr
    path.write_text(r.stdout)
    return path


def _recording(prom: PrometheusServer, n: int) -> None:
    poll(lambda: len(prom.query(f"gpu:diagnoser_limiter:{WINDOW}")) == n, 120, "a limiter per GPU")


def _check_fallback(prom: PrometheusServer, fleet: SimFleet, what: str) -> None:
    window = Window(time.time() - 15, time.time())
    notes: list[str] = []
    timings: dict = {}
    report = run_fleet(PromClient(prom.url), window, detail=0, notes=notes, timings=timings)
    assert not timings["recorded"] and {r.basis for r in report.rows} == {"statistics"}
    stale = [n for n in notes if n.startswith("The recorded statistics")]
    assert len(stale) == 1 and what in stale[0] and "computed from the samples instead" in stale[0], notes
    by_key = {(r.uuid, r.gpu): r.diagnosis.verdict for r in report.rows}
    for g in fleet.gpus:
        assert by_key[(g.uuid, str(g.index))] == PROFILE_VERDICT[g.profile]


def test_recorded_statistics_that_stopped_are_not_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The rule group removed (Prometheus marks its series stale) a few seconds before the window's end: the
    statistics are computed from the samples, and the note says how old the recorded ones are."""
    fleet = SimFleet(n_gpus=3, gpus_per_node=3, profiles=("compute", "idle", "batching"))
    with ExporterProcess(fleet, tmp_path) as exporter:
        prom = PrometheusServer(tmp_path, node_targets(exporter), rule_files=[_rules(tmp_path)]).start()
        try:
            prom.wait_for_samples(20, timeout=180)
            _recording(prom, len(fleet.gpus))
            window = Window(time.time() - 15, time.time())
            fresh: dict = {}
            report = run_fleet(PromClient(prom.url), window, detail=0, timings=fresh)
            assert fresh["recorded"] and {r.basis for r in report.rows} == {"recorded statistics"}
            # Reload without the rule group: its series get stale markers, its names stay in the window.
            prom.rule_files = []
            prom.write_config()
            assert prom.proc is not None
            prom.proc.send_signal(signal.SIGHUP)
            poll(lambda: not prom.query(f"gpu:dcgm_identity:count_{WINDOW}"), 60, "the recorded series to go stale")
            _check_fallback(prom, fleet, "have none at the window's end (their newest sample is")
        finally:
            prom.stop()


def test_recorded_statistics_that_lag_the_window_are_not_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Prometheus killed and started again without the rule group: no stale marker, the recorded series still answer
    an instant query, but their newest sample is seconds older than the window's end."""
    fleet = SimFleet(n_gpus=3, gpus_per_node=3, profiles=("compute", "idle", "batching"))
    with ExporterProcess(fleet, tmp_path) as exporter:
        prom = PrometheusServer(tmp_path, node_targets(exporter), rule_files=[_rules(tmp_path)]).start()
        try:
            prom.wait_for_samples(20, timeout=180)
            _recording(prom, len(fleet.gpus))
            assert prom.proc is not None
            prom.proc.kill()
            prom.proc.wait(20)
            prom.rule_files = []
            prom.start()
            # Eight evaluations missed (1.5 intervals and 2 s are allowed), the exporters scraped all along.
            poll(lambda: prom.query(f"time() - max(timestamp(gpu:dcgm_identity:count_{WINDOW})) > 8 and "
                                    "on() time() - max(timestamp(up)) < 2"), 90, "the recorded series to age")
            assert prom.query(f"gpu:dcgm_identity:count_{WINDOW}")  # what plain reads would take as current
            _check_fallback(prom, fleet, "are stale: the newest is")
        finally:
            prom.stop()
