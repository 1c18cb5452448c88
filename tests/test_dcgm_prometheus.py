"""DCGM through a real Prometheus scraping simulated dcgm-exporters: one target by pod, UUID, node + index and MIG
instance, both field-name sets and both hostname spellings; and the outages: Prometheus stopped mid-query, gone,
silent, rejecting queries, not Prometheus at all; unknown metrics; empty windows."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diagnoser.capture import load, new_capture
from diagnoser.collectors.dcgm import GpuSelector
from diagnoser.collectors.dcgm_collect import collect_dcgm_into
from diagnoser.collectors.prometheus_source import PromClient, PromError, Window
from diagnoser.errors import SourceUnavailable
from diagnoser.fleet.run import run_fleet
from tests.prom_harness import (  # noqa: F401  (dcgm_stack is a fixture)
    NO_PROMETHEUS,
    REPO,
    ExporterProcess,
    PrometheusServer,
    dcgm_stack,
    find_prometheus,
    legacy_fleet,
    node_targets,
    poll,
)

pytestmark = [pytest.mark.prometheus, pytest.mark.slow,
              pytest.mark.skipif(find_prometheus() is None, reason=NO_PROMETHEUS)]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    # Warnings other modules' imports may print (torch without numpy) are not the command's message.
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "diagnoser", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def one_sentence_error(result: subprocess.CompletedProcess[str], code: int, *fragments: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("diagnoser: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_pod_through_prometheus_is_diagnosed_throttled(dcgm_stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    g = dcgm_stack.gpu("throttled")
    saved = tmp_path / "throttled.dgc"
    r = cli("dcgm", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--pod", g.pod, "--json",
            "--save", str(saved))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == "throttling"
    assert g.pod in d["target"] and g.uuid in d["target"]
    assert d["findings"][0]["code"] == "THR001"
    cap = load(saved)  # the capture is kept: diagnose it again later, or render it
    assert cap.gpus[0].uuid == g.uuid and cap.gpus[0].max_sm_clock_mhz == 1980
    throttle = cap.series_named("gpu.throttle.power")[0]
    assert throttle.source == "dcgm" and 0.7 < sum(throttle.values) / len(throttle.values) <= 1.0
    assert cap.duration_s == pytest.approx(12, abs=0.01)


def test_uuid_without_prefix_selects_the_compute_gpu(dcgm_stack) -> None:  # type: ignore[no-untyped-def]
    g = dcgm_stack.gpu("compute")
    r = cli("dcgm", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--uuid",
            g.uuid.removeprefix("GPU-").upper(), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == "compute" and g.uuid in d["target"]


def test_dcgm46_names_and_lowercase_hostname_by_node_and_index(dcgm_stack) -> None:  # type: ignore[no-untyped-def]
    g = dcgm_stack.gpu("batching", renamed=True)
    r = cli("dcgm", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--node", g.hostname, "--gpu",
            str(g.index), "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == "batching"
    missing = {u["what"]: u for u in d["unavailable"]}
    # The default counters omit these: the diagnosis says so and points to the counters CSV.
    assert "commented out" in missing["gpu.sm_active"]["reason"]
    assert "dcgm-counters.csv" in missing["gpu.sm_active"]["hint"]
    assert "gpu.throttle.power" not in missing  # no violation counters: the clock event reasons stand in
    assert "gpu.sm_clock_frac" not in missing  # the H100's maximum clock from the spec table stands in
    assert any("1980 MHz maximum from the spec table" in n for n in d["notes"])
    assert "gpu.busy" not in missing and "gpu.dram_active" not in missing


def test_mig_instance_inherits_the_boards_fields(dcgm_stack, tmp_path) -> None:  # type: ignore[no-untyped-def]
    g = dcgm_stack.gpu("bandwidth", mig=True)
    saved = tmp_path / "mig.dgc"
    r = cli("dcgm", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--uuid", g.uuid, "--mig-instance",
            g.mig_id, "--json", "--save", str(saved))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["verdict"] == "memory_bandwidth"
    cap = load(saved)
    assert cap.gpus[0].mig_instance == g.mig_id and cap.gpus[0].mig_mode
    names = {s.name for s in cap.series}
    assert {"gpu.busy", "gpu.dram_active", "gpu.power_w", "gpu.sm_clock_frac"} <= names
    assert "gpu.mem_total_bytes" in names  # the instance's own slice: used + free


def test_collect_dcgm_into_fills_an_attach_capture(dcgm_stack) -> None:  # type: ignore[no-untyped-def]
    g = dcgm_stack.gpu("idle")
    end = time.time()
    cap = new_capture("pid 1 (attach)", started_at=end - 10, duration_s=10)
    targets = collect_dcgm_into(cap, prometheus_url=dcgm_stack.prom.url, selector=GpuSelector(uuid=g.uuid))
    assert [t.uuid for t in targets] == [g.uuid]
    assert cap.target == "pid 1 (attach)"  # the caller's description stays
    busy = cap.series_named("gpu.busy")[0]
    assert busy.source == "dcgm" and len(busy.values) >= 5
    assert all(0 <= t <= 10.5 for t in busy.times) and max(busy.values) < 0.1


def test_pid_is_looked_up_on_this_node(dcgm_stack) -> None:  # type: ignore[no-untyped-def]
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                            env={**os.environ, "CUDA_VISIBLE_DEVICES": "0"})
    try:
        r = cli("dcgm", "--prometheus", dcgm_stack.prom.url, "--since", "10s", "--pid", str(proc.pid))
    finally:
        proc.kill()
        proc.wait()
    # This machine is none of the simulated nodes: the error names the PID, the node and what the source has.
    one_sentence_error(r, 2, f"pid {proc.pid}", f"node {os.uname().nodename}", "node-0000")


def test_unknown_metric_is_empty_and_bad_promql_is_rejected(dcgm_stack) -> None:  # type: ignore[no-untyped-def]
    client = PromClient(dcgm_stack.prom.url, timeout_s=10)
    assert client.instant("DCGM_FI_PROF_NO_SUCH_FIELD", time.time()) == []
    with pytest.raises(PromError) as err:
        client.instant("avg by (UUID) (DCGM_FI_DEV_FB_USED", time.time())
    assert err.value.kind == "rejected" and "parse error" in str(err.value)


def test_window_with_no_data_is_one_clear_sentence(dcgm_stack) -> None:  # type: ignore[no-untyped-def]
    r = cli("fleet", "--prometheus", dcgm_stack.prom.url, "--at", "now-3h", "--since", "10m")
    one_sentence_error(r, 3, "has no DCGM series", "is dcgm-exporter scraped")
    r = cli("dcgm", "--prometheus", dcgm_stack.prom.url, "--since", "10s", "--pod", "no-such-pod")
    one_sentence_error(r, 2, "no GPU matches pod no-such-pod", "idle-server-00000-7f9c")


def test_prometheus_without_dcgm_targets(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with PrometheusServer(tmp_path, []) as prom:
        r = cli("fleet", "--prometheus", prom.url, "--since", "5m")
    one_sentence_error(r, 3, "has no DCGM series")


class StopsPrometheus(PromClient):
    """The real client; after `after` answered requests it stops the real Prometheus, as a crash would."""

    def __init__(self, url: str, prom: PrometheusServer, after: int) -> None:
        super().__init__(url, timeout_s=10)
        self.prom, self.after = prom, after

    def _call(self, endpoint: str, params: dict[str, str], method: str = "POST") -> bytes:
        result = super()._call(endpoint, params, method)
        if self.queries == self.after:
            self.prom.stop()
        return result


@pytest.fixture
def own_stack(tmp_path):  # type: ignore[no-untyped-def]
    """A Prometheus of the test's own (it gets stopped) over a small exporter."""
    with ExporterProcess(legacy_fleet(), tmp_path) as exporter:
        prom = PrometheusServer(tmp_path, node_targets(exporter)).start()
        try:
            prom.wait_for_samples(6, timeout=120)
            yield prom, exporter
        finally:
            prom.stop()


def test_prometheus_stopped_mid_query_keeps_partial_results(own_stack) -> None:  # type: ignore[no-untyped-def]
    prom, exporter = own_stack
    window = Window(time.time() - 6, time.time())
    # The metric names, the GPU list, GR_ENGINE_ACTIVE's and SM_ACTIVE's statistics answered; then Prometheus dies.
    client = StopsPrometheus(prom.url, prom, after=4)
    report = run_fleet(client, window, workers=1)
    assert len(report.rows) == len(exporter.fleet.gpus)
    assert all(r.partial and r.basis == "statistics" for r in report.rows)
    assert any("statistic queries failed" in e and "unreachable" in e for e in report.errors)
    assert any("could not be read" in e and "their rows come from statistics" in e for e in report.errors)
    by_uuid = {(r.uuid, r.gpu): r for r in report.rows}
    idle = next(g for g in exporter.fleet.gpus if g.profile == "idle")
    row = by_uuid[(idle.uuid, str(idle.index))]
    assert row.diagnosis.verdict == "idle"  # busy was read before the crash
    reasons = {u.what: u.reason for u in row.diagnosis.unavailable}
    assert "query for DCGM_FI_PROF_DRAM_ACTIVE failed" in reasons["gpu.dram_active"]
    # Once it is gone for good, the command says so in one sentence.
    r = cli("fleet", "--prometheus", prom.url, "--since", "1m")
    one_sentence_error(r, 3, f"Prometheus at {prom.url} is unreachable")
    r = cli("dcgm", "--prometheus", prom.url, "--since", "1m", "--gpu", "0")
    one_sentence_error(r, 3, "unreachable")


def test_every_field_query_failing_is_fatal(own_stack) -> None:  # type: ignore[no-untyped-def]
    prom, _ = own_stack
    client = StopsPrometheus(prom.url, prom, after=2)  # only the GPU list and the metric names answered
    with pytest.raises(SourceUnavailable, match="no counter could be read"):
        run_fleet(client, Window(time.time() - 6, time.time()), workers=1)


def test_query_limits_are_reported_as_rejections(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with ExporterProcess(legacy_fleet(), tmp_path) as exporter:
        with PrometheusServer(tmp_path, node_targets(exporter), extra_args=["--query.max-samples=20"]) as prom:
            poll(lambda: prom.query("count(up == 1)") and
                 float(prom.query("count(up == 1)")[0]["value"][1]) >= 3, 60, "the first scrapes")
            r = cli("fleet", "--prometheus", prom.url, "--since", "1m")
    one_sentence_error(r, 3, "rejected the query", "too many samples")


def _silent_server() -> tuple[socket.socket, int]:
    """Accepts connections and never answers: a Prometheus stuck on a heavy query."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return server, server.getsockname()[1]


def test_slow_prometheus_times_out_in_one_sentence() -> None:
    server, port = _silent_server()
    try:
        started = time.monotonic()
        r = cli("fleet", "--prometheus", f"http://127.0.0.1:{port}", "--timeout", "1")
        took = time.monotonic() - started
    finally:
        server.close()
    one_sentence_error(r, 3, "did not answer within 1 s")
    assert took < 60  # bounded by the timeout, not hanging


def test_something_that_is_not_prometheus(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with ExporterProcess(legacy_fleet(), tmp_path) as exporter:
        base = exporter.url().removesuffix("/metrics")
        r = cli("fleet", "--prometheus", base, "--since", "5m")
        # An exporter's URL given as Prometheus: the error says which command reads it.
        one_sentence_error(r, 3, "is a dcgm-exporter endpoint, not Prometheus",
                           f"diagnoser dcgm --dcgm-exporter {exporter.url()}")
        r = cli("fleet", "--prometheus", base + "/healthz", "--since", "5m")
    one_sentence_error(r, 3, "answered HTTP ")
    r = cli("fleet", "--prometheus", "localhost:9090")
    one_sentence_error(r, 2, "wants an http(s) URL")


def test_unreachable_prometheus() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here once the socket is closed
    r = cli("dcgm", "--prometheus", f"http://127.0.0.1:{port}", "--since", "5m", "--gpu", "0")
    one_sentence_error(r, 3, "is unreachable (connection refused)")


def test_outputs_are_written_where_asked(dcgm_stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    g = dcgm_stack.gpu("vram")
    html = tmp_path / "gpu.html"
    r = cli("dcgm", "--prometheus", dcgm_stack.prom.url, "--since", "12s", "--uuid", g.uuid, "--html", str(html))
    assert r.returncode == 0, r.stderr
    assert html.read_text().lstrip().lower().startswith("<!doctype html")
    assert "VRAM" in r.stdout.upper()


def test_gpu_util_stands_in_where_gr_engine_active_is_missing(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from tests.prom_harness import PROFILE_VERDICT, PROFILES, SimFleet

    # An exporter without the DCP fields' GR_ENGINE_ACTIVE (older CSVs): busy comes from GPU_UTIL in percent.
    fleet = SimFleet(n_gpus=3, gpus_per_node=3, omit=("gr_engine_active",), profiles=("idle", "compute", "batching"))
    with ExporterProcess(fleet, tmp_path) as exporter, PrometheusServer(tmp_path, node_targets(exporter)) as prom:
        prom.wait_for_samples(2, timeout=120)
        start = time.time()
        prom.wait_for_samples(8, timeout=120)
        report = run_fleet(PromClient(prom.url), Window(start, time.time()))
    assert report.errors == []
    for row in report.rows:
        g = next(x for x in fleet.gpus if x.uuid == row.uuid)
        assert row.diagnosis.verdict == PROFILE_VERDICT[g.profile]
        assert row.busy is not None and abs(row.busy - PROFILES[g.profile]["gr"]) < 0.06
