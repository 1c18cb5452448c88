"""Issue 29, item 5: a fleet-wide outage. Every GPU of a simulated fleet is scraped every 5 s and falls silent for the
window's last 110 s; one GPU appears mid-window. The samples are written into a real Prometheus's storage with their
own times (promtool's backfill), so the window is exactly known. The scrape interval must read 5 s (the spacing of
the points, not the window over the most samples), and every silent GPU's row must be partial."""

from __future__ import annotations

import math
import re
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from diagnoser.collectors.prom_client import PromClient
from diagnoser.collectors.prometheus_source import Window, WindowQuery
from diagnoser.fleet.run import run_fleet
from tests.prom_harness import NO_PROMETHEUS, PrometheusServer, SimFleet, find_prometheus

INTERVAL_S = 5.0
WINDOW_S = 1000.0
SILENT_S = 110.0
LATE_START_S = 500.0  # the late GPU's first sample, after the window's start
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{.*\})? (\S+)$")


@dataclass
class Outage:
    prom: PrometheusServer
    window: Window
    fleet: SimFleet
    late_uuid: str


def _openmetrics(fleet: SimFleet, window: Window) -> str:
    """Every sample of the window with its time: all GPUs from the start, the last one from LATE_START_S, none in the
    last SILENT_S."""
    late = fleet.gpus[-1]
    families: dict[str, list[str]] = {}
    t = window.start
    while t <= window.end - SILENT_S:
        gpus = [g for g in fleet.gpus if g is not late or t >= window.start + LATE_START_S]
        for line in fleet.render(gpus, t).splitlines():
            m = _SAMPLE.match(line)
            if m:
                families.setdefault(m.group(1), []).append(f"{line} {t:.3f}")
        t += INTERVAL_S
    out: list[str] = []
    for name, lines in families.items():
        out += [f"# TYPE {name} unknown", *lines]
    return "\n".join(out) + "\n# EOF\n"


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Outage]:
    if find_prometheus() is None:
        pytest.skip(NO_PROMETHEUS)
    if shutil.which("promtool") is None:
        pytest.skip("promtool is not installed (Debian's prometheus has it)")
    workdir = tmp_path_factory.mktemp("outage")
    end = math.floor(time.time() / 60) * 60 - 3600.0  # an hour ago: inside retention, clear of the head block
    window = Window(end - WINDOW_S, end)
    fleet = SimFleet(n_gpus=6, gpus_per_node=3, start=window.start, profiles=("compute", "bandwidth", "idle"))
    source = workdir / "samples.om"
    source.write_text(_openmetrics(fleet, window))
    data = workdir / "prom-data"
    made = subprocess.run(["promtool", "tsdb", "create-blocks-from", "openmetrics", str(source), str(data)],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    prom = PrometheusServer(workdir, [], data_dir=data).start()
    try:
        yield Outage(prom, window, fleet, fleet.gpus[-1].uuid)
    finally:
        prom.stop()


def test_a_fleet_wide_outage_marks_every_silent_gpu_partial_and_reads_the_interval(outage: Outage) -> None:
    timings: dict[str, float | int | None] = {}
    report = run_fleet(PromClient(outage.prom.url, timeout_s=60), outage.window, detail=2, processes=1,
                       timings=timings)
    assert timings["scrape_interval_s"] == pytest.approx(INTERVAL_S, abs=0.01)
    assert len(report.rows) == len(outage.fleet.gpus)
    assert all(r.partial for r in report.rows), [(r.uuid, r.basis, r.diagnosis.verdict, r.notes) for r in report.rows]
    triaged = [r for r in report.rows if r.basis == "statistics"]
    assert triaged  # rows from the window statistics, not only the --detail ones read as points
    for r in triaged:
        assert r.notes[0].startswith("series partial: no sample in the window's last 15 s"), r.notes
    assert any(f"{len(report.rows)} GPUs have gaps or stopped reporting" in e for e in report.errors), report.errors


def test_the_interval_of_a_gpu_that_appeared_mid_window_is_its_scrape_interval(outage: Outage) -> None:
    query = WindowQuery(PromClient(outage.prom.url, timeout_s=60), outage.window)
    data = query.discover(matchers=f'UUID="{outage.late_uuid}"')
    assert [k[0] for k in data.gpus] == [outage.late_uuid]
    assert data.samples[next(iter(data.gpus))] < WINDOW_S / INTERVAL_S / 2  # it reported for under half the window
    assert data.scrape_interval_s == pytest.approx(INTERVAL_S, abs=0.01)
