"""`diagnoser dcgm --dcgm-exporter URL`: sampling a live exporter process over HTTP (values that change over time),
both field-name sets, the default counters' gaps, a slow collect interval, an exporter that vanishes mid-window,
Ctrl-C, and endpoints that are down or are not dcgm-exporter."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from diagnoser.capture import load
from tests.prom_harness import REPO, ExporterProcess, SimFleet, poll

pytestmark = pytest.mark.slow


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "diagnoser", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env)


def popen(*args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([sys.executable, "-m", "diagnoser", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def sample(url: str, *selector: str, seconds: str = "3") -> dict:
    r = cli("dcgm", "--dcgm-exporter", url, *selector, "--duration", seconds, "--interval", "0.5", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.fixture(scope="module")
def legacy(tmp_path_factory):  # type: ignore[no-untyped-def]
    with ExporterProcess(SimFleet(n_gpus=8, gpus_per_node=8), tmp_path_factory.mktemp("exp")) as exporter:
        yield exporter


def test_live_exporter_bandwidth_gpu_by_pod(legacy, tmp_path) -> None:  # type: ignore[no-untyped-def]
    g = legacy.fleet.by_profile("bandwidth")[0]
    saved = tmp_path / "bw.dgc"
    r = cli("dcgm", "--dcgm-exporter", legacy.url(0), "--pod", g.pod, "--duration", "3", "--interval", "0.5",
            "--json", "--save", str(saved))
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["verdict"] == "memory_bandwidth" and g.pod in d["target"]
    cap = load(saved)
    dram = cap.series_named("gpu.dram_active")[0]
    assert dram.source == "dcgm" and len(dram.values) >= 4
    assert len(set(dram.values)) > 1  # the exporter's values move: every reading was recorded
    assert cap.gpus[0].uuid == g.uuid and cap.gpus[0].memory_total_bytes == 81559 * 2**20


def test_violation_counter_becomes_throttled_share(legacy) -> None:  # type: ignore[no-untyped-def]
    g = legacy.fleet.by_profile("throttled")[0]
    d = sample(legacy.url(0), "--uuid", g.uuid)
    assert d["verdict"] == "throttling"
    cited = {c["signal"]: c for f in d["findings"] for c in f["citations"]}
    assert cited["gpu.throttle.power"]["value"] == pytest.approx(1.0)  # 85 % of each interval: above 0.5
    assert cited["gpu.sm_clock_frac"]["value"] == pytest.approx(1150 / 1980, abs=0.03)


def test_gpu_index_on_the_exporters_node_and_xid(legacy) -> None:  # type: ignore[no-untyped-def]
    g = legacy.fleet.by_profile("xid")[0]
    d = sample(legacy.url(0), "--gpu", str(g.index), seconds="2")
    assert d["verdict"] == "errors"
    assert any("XID 79" in note for note in d["notes"])


def test_dcgm46_names_with_default_counters(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fleet = SimFleet(n_gpus=2, gpus_per_node=2, names="dcgm46", host_label="hostname", profiles=("compute", "idle"),
                     omit=("sm_active", "power_violation", "thermal_violation", "max_sm_clock"))
    with ExporterProcess(fleet, tmp_path) as exporter:
        d = sample(exporter.url(0), "--gpu", "0")
    assert d["verdict"] == "compute"
    missing = {u["what"]: u for u in d["unavailable"]}
    assert set(missing) == {"gpu.sm_active", "gpu.throttle.power", "gpu.throttle.thermal"}
    assert all("dcgm-counters.csv" in u["hint"] for u in missing.values())
    # No DCGM_FI_DEV_MAX_SM_CLOCK: the clock is judged against the H100's maximum from the spec table, and said so.
    assert any("DCGM_FI_DEV_MAX_SM_CLOCK is not exported" in n and "1980 MHz" in n for n in d["notes"])


def test_slow_collect_interval_is_said_and_not_double_counted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fleet = SimFleet(n_gpus=1, profiles=("bandwidth",), refresh_s=30.0)
    with ExporterProcess(fleet, tmp_path) as exporter:
        d = sample(exporter.url(0), seconds="3")
    assert any("refreshed its values" in note and "-c 1000" in note for note in d["notes"])
    # One or two distinct DCGM readings, not six copies of them: the confidence says the window is thin.
    assert any("GPU samples in the window" in reason for reason in d["confidence_reasons"])


def test_exporter_vanishing_mid_window_keeps_what_was_read(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fleet = SimFleet(n_gpus=1, profiles=("compute",))
    exporter = ExporterProcess(fleet, tmp_path).start()
    try:
        proc = popen("dcgm", "--dcgm-exporter", exporter.url(0), "--duration", "60", "--interval", "0.3", "--json")
        poll(lambda: exporter.served(0) >= 8, 60, "eight readings")
    finally:
        exporter.stop()  # gone: connections are refused from now on
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    d = json.loads(out)
    assert d["verdict"] == "compute"
    assert any("stopped answering" in note for note in d["notes"])


def test_ctrl_c_diagnoses_what_was_read(legacy) -> None:  # type: ignore[no-untyped-def]
    g = legacy.fleet.by_profile("idle")[0]
    before = legacy.served(0)
    proc = popen("dcgm", "--dcgm-exporter", legacy.url(0), "--uuid", g.uuid, "--duration", "60", "--interval",
                 "0.3", "--json")
    poll(lambda: legacy.served(0) - before >= 6, 60, "six readings")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    d = json.loads(out)
    assert d["verdict"] == "idle" and any("Interrupted after" in n for n in d["notes"])


def test_several_gpus_without_a_selector_are_listed(legacy) -> None:  # type: ignore[no-untyped-def]
    r = cli("dcgm", "--dcgm-exporter", legacy.url(0), "--duration", "1")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "lists 8 GPUs" in r.stderr and "pick one with --gpu" in r.stderr


def test_endpoints_that_are_down_or_not_dcgm_exporter(legacy) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cases = [
        (f"http://127.0.0.1:{port}/metrics", 3, "is unreachable (connection refused)"),
        (legacy.url().replace("/metrics", "/healthz"), 3, "serves no DCGM_* metrics"),
        (legacy.url(99), 3, "answered HTTP 404"),
        ("node:9400/metrics", 2, "wants an http(s) URL"),
    ]
    for url, code, fragment in cases:
        r = cli("dcgm", "--dcgm-exporter", url, "--duration", "1")
        lines = [line for line in r.stderr.splitlines() if line.strip()]
        assert r.returncode == code, (url, r.stderr)
        assert len(lines) == 1 and fragment in lines[0], (url, r.stderr)
    r = cli("dcgm", "--dcgm-exporter", legacy.url(0), "--prometheus", "http://x:9090")
    assert r.returncode == 2 and "give one DCGM source" in r.stderr
    r = cli("dcgm", "--dcgm-exporter", legacy.url(0), "--since", "1h", "--gpu", "0")
    assert r.returncode == 2 and "--since" in r.stderr
