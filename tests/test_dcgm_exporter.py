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
                     omit=("sm_active", "power_violation", "thermal_violation", "max_sm_clock", "clock_reasons"))
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


@pytest.mark.parametrize("sig, said, code", [(signal.SIGINT, "Ctrl-C", 0), (signal.SIGTERM, "SIGTERM", 143)])
def test_ctrl_c_and_sigterm_end_the_window_and_diagnose_what_was_read(legacy, tmp_path, sig, said, code) -> None:  # type: ignore[no-untyped-def]
    g = legacy.fleet.by_profile("idle")[0]
    saved = tmp_path / "stopped.dgc"
    before = legacy.served(0)
    proc = popen("dcgm", "--dcgm-exporter", legacy.url(0), "--uuid", g.uuid, "--duration", "60", "--interval",
                 "0.3", "--json", "--save", str(saved))
    poll(lambda: legacy.served(0) - before >= 6, 60, "six readings")
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    d = json.loads(out)
    assert d["verdict"] == "idle" and any(f"Interrupted by {said} after" in n for n in d["notes"]), d["notes"]
    # The saved window is the span the readings cover, not the 60 s planned.
    cap = load(saved)
    busy = cap.series_named("gpu.busy")[0]
    assert len(busy.values) >= 5 and busy.times[-1] <= cap.duration_s < 60


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


def test_clock_event_bits_without_a_max_clock_field_are_throttling(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """DCGM 4.x names, no violation counters, no DCGM_FI_DEV_MAX_SM_CLOCK: the HW power brake bit at 60 % of the
    H100's 1980 MHz (the spec table's maximum) is throttling."""
    fleet = SimFleet(n_gpus=1, gpus_per_node=1, names="dcgm46", profiles=("throttled",),
                     omit=("power_violation", "thermal_violation", "max_sm_clock"))
    with ExporterProcess(fleet, tmp_path) as exporter:
        d = sample(exporter.url(0), seconds="3")
    assert d["verdict"] == "throttling", d["headline"]
    cited = {c["signal"]: c for f in d["findings"] for c in f["citations"]}
    assert cited["gpu.throttle.power"]["value"] == pytest.approx(1.0)  # 0x84: SW power cap + HW power brake
    # The brake is asserted from outside the GPU: the node's power is the fix, not the GPU's power limit.
    assert cited["gpu.throttle.power_brake"]["value"] == pytest.approx(1.0)
    assert "HW power brake" in d["headline"] and d["fixes"][0]["title"] == "Check the node's power supply"
    assert not any("power limit" in f["title"] for f in d["fixes"])
    assert cited["gpu.sm_clock_frac"]["value"] == pytest.approx(1190 / 1980, abs=0.03)
    assert any("1980 MHz maximum from the spec table" in n for n in d["notes"])
    assert "gpu.sm_clock_frac" not in {u["what"] for u in d["unavailable"]}


def test_lowercase_names_old_labels_and_a_uuid_prefix(tmp_path) -> None:  # type: ignore[no-untyped-def]
    fleet = SimFleet(n_gpus=2, gpus_per_node=2, names="lowercase", profiles=("bandwidth", "idle"))
    with ExporterProcess(fleet, tmp_path) as exporter:
        g = fleet.by_profile("bandwidth")[0]
        d = sample(exporter.url(0), "--uuid", g.uuid[4:12])  # as `nvidia-smi -L` abbreviates, without GPU-
        assert d["verdict"] == "memory_bandwidth" and g.pod in d["target"]
        r = cli("dcgm", "--dcgm-exporter", exporter.url(0), "--pod", fleet.by_profile("idle")[0].pod[:6],
                "--duration", "1", "--json")
    assert r.returncode == 0, r.stderr


def test_a_gpu_without_the_fields_the_rules_read_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    every = ("gr_engine_active", "gpu_util", "sm_active", "sm_occupancy", "tensor_active", "dram_active", "fb_used",
             "fb_free", "sm_clock", "max_sm_clock", "power", "power_violation", "thermal_violation", "pcie_tx",
             "pcie_rx", "xid", "clock_reasons")
    fleet = SimFleet(n_gpus=1, gpus_per_node=1, omit=every, profiles=("compute",))  # only the temperature is left
    with ExporterProcess(fleet, tmp_path) as exporter:
        r = cli("dcgm", "--dcgm-exporter", exporter.url(0), "--gpu", "0", "--duration", "1")
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 3 and len(lines) == 1, r.stderr
    assert f"gpu 0 {fleet.gpus[0].uuid}" in lines[0] and "none of the fields the diagnosis reads" in lines[0]
