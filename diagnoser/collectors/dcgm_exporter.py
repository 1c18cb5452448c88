"""Reading a dcgm-exporter endpoint live: one scrape (`ExporterScraper`) and a collector that samples it over a
window (`DcgmExporterCollector`, with the start/sample/stop protocol of collectors/base.py so attach can run it beside
NVML). Failures become one sentence (SourceUnavailable); what was read before a failure stays in the capture."""

from __future__ import annotations

import threading
import time

from diagnoser.capture import Capture
from diagnoser.collectors.dcgm import (
    CSV_HINT,
    DEVICE_LEVEL_FIELDS,
    FIELDS_BY_KEY,
    WANTED_SIGNALS,
    GpuIdentity,
    GpuKey,
    GpuSelector,
    GpuWindow,
    Scrape,
    add_gpu_window,
    describe_target,
    drop_mig_parents,
    inherit_device_fields,
    mark_missing,
    parent_key,
    parse_exporter_lines,
    select_gpus,
)
from diagnoser.collectors.http import MIB, FetchError, lines, stream
from diagnoser.errors import InputError, SourceUnavailable

# An exporter page for 8 GPUs with every field and NVLink entity is a few MB: far above that is no exporter page.
MAX_PAGE_BYTES = 32 * MIB


class ExporterScraper:
    """Reads one dcgm-exporter endpoint (http://node:9400/metrics) within one deadline and a size cap, parsing the
    page as it arrives; failures become one sentence."""

    def __init__(self, url: str, timeout_s: float = 5.0, *, max_bytes: int = MAX_PAGE_BYTES) -> None:
        if not url.startswith(("http://", "https://")):
            raise InputError(f"--dcgm-exporter wants an http(s) URL such as http://node:9400/metrics, not '{url}'.")
        self.url = url
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes

    def scrape(self) -> Scrape:
        at = time.time()
        origin = f"dcgm-exporter at {self.url}"
        try:
            with stream(self.url, timeout_s=self.timeout_s, max_bytes=self.max_bytes,
                        headers={"Accept": "text/plain;version=0.0.4"}) as body:
                scrape = parse_exporter_lines(lines(body), at, origin=origin)
        except FetchError as exc:
            raise SourceUnavailable(self._failure(exc)) from None
        if not scrape.metric_names:
            raise SourceUnavailable(f"{self.url} serves no DCGM_* metrics: is it a dcgm-exporter endpoint?")
        return scrape

    def _failure(self, exc: FetchError) -> str:
        origin = f"dcgm-exporter at {self.url}"
        if exc.kind == "timeout":
            return f"{origin} did not send its page within {self.timeout_s:g} s."
        if exc.kind == "status":
            return f"{origin} answered {exc.reason}."
        if exc.kind == "truncated":
            return f"{origin} sent a truncated page ({exc.reason}): the exporter or a proxy broke off; try again."
        if exc.kind == "too_large":
            return (f"{origin} sent a page too large to be one node's exporter ({exc.reason}): is the URL an "
                    "exporter's /metrics?")
        if exc.kind == "bad_url":
            return f"--dcgm-exporter: {exc.reason}."
        return f"{origin} is unreachable ({exc.reason})."


def _has_wanted(scrape: Scrape, key: GpuKey) -> bool:
    """Whether a GPU (or its MIG board, for the board's fields) reports a field some wanted signal is made of."""
    wanted = {k for keys in WANTED_SIGNALS.values() for k in keys}
    own = set(scrape.values.get(key, {}))
    board = set(scrape.values.get(parent_key(key), {})) & DEVICE_LEVEL_FIELDS if key[1] else set()
    return bool((own | board) & wanted)


class DcgmExporterCollector:
    """Samples a dcgm-exporter endpoint into a capture; follows the collectors' start/sample/stop protocol, so the
    attach session can drive it beside NVML.

    dcgm-exporter refreshes its values every collect interval (-c, 30 s by default) and serves the same numbers in
    between: a reading identical to the previous one is the same DCGM sample and is not recorded twice.
    """

    name = "dcgm"

    def __init__(self, url: str, selector: GpuSelector | None = None, *, period_s: float = 1.0,
                 timeout_s: float = 5.0, scraper: ExporterScraper | None = None) -> None:
        self.scraper = scraper or ExporterScraper(url, timeout_s)
        self.selector = selector or GpuSelector()
        self.period_s = period_s
        self.capture: Capture | None = None
        self.targets: list[GpuIdentity] = []
        self.windows: dict[GpuKey, GpuWindow] = {}
        self._previous: dict[GpuKey, tuple[float, dict[str, float]]] = {}
        self._last_recorded: dict[GpuKey, dict[str, float]] = {}
        self._fields_seen: set[str] = set()
        self._readings = 0
        self._recorded = 0
        self._failures = 0
        self._stopped_at: float | None = None
        self._stop_reason = ""
        self._newest: dict[str, float] = {}
        self._lock = threading.Lock()
        self._written = False

    def start(self, capture: Capture) -> None:
        """First reading: picks the target GPU(s); errors here (unreachable, no such GPU) are the user's to fix."""
        self.capture = capture
        first = self.scraper.scrape()
        self.targets = select_gpus(drop_mig_parents(first.gpus.values()), self.selector)
        readable = [t for t in self.targets if _has_wanted(first, t.key)]
        if not readable:
            names = sorted({FIELDS_BY_KEY[k].name for keys in WANTED_SIGNALS.values() for k in keys
                            if FIELDS_BY_KEY[k].in_default_csv})
            raise SourceUnavailable(f"{describe_target(self.targets)} is listed by dcgm-exporter at "
                                    f"{self.scraper.url}, but with none of the fields the diagnosis reads "
                                    f"({', '.join(names)}): enable them in its counters CSV ({CSV_HINT}).")
        self.windows = {g.key: GpuWindow(g) for g in self.targets}
        self._ingest(first, max(0.0, first.at - capture.started_at))

    def sample(self, t: float) -> None:
        if self._stopped_at is not None:
            return
        try:
            scrape = self.scraper.scrape()
        except SourceUnavailable as exc:
            self._failures += 1
            if self._failures >= 2:  # one lost reading is noise; two in a row is an exporter gone
                self._stopped_at, self._stop_reason = t, str(exc)
            return
        self._failures = 0
        self._ingest(scrape, t)

    def _ingest(self, scrape: Scrape, t: float) -> None:
        with self._lock:
            self._readings += 1
            self._fields_seen |= scrape.fields_seen
            for key, gw in self.windows.items():
                values = scrape.values.get(key)
                if values is None:
                    continue
                if key[1]:
                    values = inherit_device_fields(values, scrape.values.get(parent_key(key)))
                if key in scrape.gpus:
                    gw.identity.merge(scrape.gpus[key])
                if self._last_recorded.get(key) == values:
                    continue  # the exporter has not refreshed since the last reading
                self._last_recorded[key] = dict(values)
                self._recorded += 1
                previous = self._previous.get(key)
                self._previous[key] = (t, values)
                for f_key, value in values.items():
                    f = FIELDS_BY_KEY[f_key]
                    if f.reduce in ("rate", "increase"):
                        if previous is None or f_key not in previous[1] or t <= previous[0]:
                            continue
                        delta = value - previous[1][f_key]
                        if delta < 0:
                            continue  # counter reset (exporter or driver restart)
                        value = delta / (t - previous[0]) if f.reduce == "rate" else delta
                    gw.add(f_key, t, value * f.scale)
                    if f.signal:
                        self._newest[f.signal] = value * f.scale

    @property
    def gone(self) -> bool:
        """The exporter stopped answering; further samples are skipped."""
        return self._stopped_at is not None

    def stop(self, t: float) -> None:
        """Write the series into the capture, with notes on what the window lacked (once)."""
        capture = self.capture
        if capture is None or self._written:
            return
        self._written = True
        produced: set[str] = set()
        for gw in self.windows.values():
            produced |= set(add_gpu_window(capture, gw))
        mig = any(g.mig_id for g in self.targets)
        mark_missing(capture, produced, fields_in_source=self._fields_seen, mig=mig)
        if self._stopped_at is not None:
            capture.notes.append(f"dcgm-exporter stopped answering {self._stopped_at:.1f} s into the window "
                                 f"({self._stop_reason}); the DCGM series cover the time before.")
        distinct = self._recorded // max(1, len(self.windows))
        if self._readings >= 4 and distinct <= self._readings // 2:
            capture.notes.append(
                f"dcgm-exporter refreshed its values {distinct} times in {self._readings} readings: its collect "
                "interval (-c, 30 s by default) is longer than the sampling period. Run it with -c 1000 for short "
                "windows, or read a longer window from Prometheus (--prometheus --since 30m).")

    def latest(self) -> dict[str, float]:
        with self._lock:
            return dict(self._newest)


__all__ = ["MAX_PAGE_BYTES", "DcgmExporterCollector", "ExporterScraper"]
