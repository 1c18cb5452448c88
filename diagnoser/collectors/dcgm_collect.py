"""DCGM series into a capture from either source, a dcgm-exporter scraped live (dcgm_exporter.py) or the Prometheus
that keeps its history (prometheus_source.py): the one entry point for attach, the agent and the dcgm command.

It sits above both sources, apart from the tables in dcgm.py that both read, so that no module imports one that
imports it back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from diagnoser.capture import Capture
from diagnoser.collectors.dcgm import GpuIdentity, GpuSelector
from diagnoser.collectors.dcgm_exporter import DcgmExporterCollector
from diagnoser.collectors.prometheus_source import PromClient, Window, collect_target
from diagnoser.errors import InputError


def collect_dcgm_into(
    capture: Capture,
    *,
    exporter_url: str | None = None,
    prometheus_url: str | None = None,
    selector: GpuSelector | None = None,
    duration_s: float | None = None,
    interval_s: float = 1.0,
    start: float | None = None,
    end: float | None = None,
    timeout_s: float = 10.0,
    stop: threading.Event | None = None,
    headers: Mapping[str, str] | None = None,
) -> list[GpuIdentity]:
    """Fill `capture` with DCGM series of the selected GPU(s); returns them.

    exporter_url: scrape it every `interval_s` for `duration_s` (default: the capture's duration) or until `stop`.
    prometheus_url: range queries over [start, end] (default: the capture's own window, as attach recorded it), with
    `headers` on every request (a tenant, a token).
    Raises SourceUnavailable / InputError with one sentence; what was read before a failure stays in the capture.
    """
    selector = selector or GpuSelector()
    if (exporter_url is None) == (prometheus_url is None):
        raise InputError("give one DCGM source: --dcgm-exporter URL or --prometheus URL.")
    if prometheus_url is not None:
        w_start = capture.started_at if start is None else start
        w_end = (capture.started_at + capture.duration_s) if end is None else end
        client = PromClient(prometheus_url, timeout_s=timeout_s, headers=headers)
        return collect_target(capture, client, Window(w_start, w_end), selector)
    assert exporter_url is not None
    collector = DcgmExporterCollector(exporter_url, selector, period_s=interval_s, timeout_s=min(timeout_s, 10.0))
    collector.start(capture)
    duration = capture.duration_s if duration_s is None else duration_s
    t = time.time() - capture.started_at
    try:
        while t < duration and not collector.gone and not (stop is not None and stop.is_set()):
            wait = max(0.0, min(interval_s, duration - t))
            if stop is not None:
                stop.wait(wait)
            else:
                time.sleep(wait)
            t = time.time() - capture.started_at
            collector.sample(t)
    finally:
        t = time.time() - capture.started_at
        if duration_s is not None or capture.duration_s <= 0:
            capture.duration_s = t  # the window the readings cover, shorter when it was stopped early
        collector.stop(t)
    return collector.targets


__all__ = ["collect_dcgm_into"]
