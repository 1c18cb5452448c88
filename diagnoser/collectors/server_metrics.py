"""Server-metrics collector: scrapes an inference server's Prometheus /metrics and maps it onto server.* signals.

Parsing is prometheus_client's own text parser. Each server kind has a mapping table (SERVER_MAPS): gauges are
recorded as they are, counters become per-second rates between scrapes, histograms become p50/p99 over the window
from the difference of their buckets between the first and the last scrape (Prometheus' histogram_quantile method).
Old and new metric names are both listed (vLLM renamed gpu_cache_usage_perc to kv_cache_usage_perc and
time_per_output_token_seconds to inter_token_latency_seconds); the first one present wins.

A vLLM scrape carries hundreds of families the diagnosis never reads; lines are filtered by metric name before the
parser sees them, which is what keeps a 1 Hz scrape cheap.
"""

from __future__ import annotations

import http.client
import math
import socket
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from diagnoser.capture import Capture
from diagnoser.collectors.base import SeriesBook
from diagnoser.errors import SourceUnavailable

DEFAULT_PERIOD_S = 1.0
FETCH_TIMEOUT_S = 2.0
# Histogram buckets are most of a page's lines and only the first and last scrape's buckets are needed; they are
# also read every few scrapes so that an endpoint dying mid-window still leaves a recent snapshot.
HISTOGRAM_EVERY = 5
MAX_BODY_BYTES = 32 << 20
# Consecutive failed scrapes after which the endpoint is given up for the rest of the window.
MAX_FAILURES = 3

Samples = dict[str, list[tuple[dict[str, str], float]]]


class MetricsError(SourceUnavailable):
    """The endpoint could not be read or did not return Prometheus text; the message is one sentence."""


@dataclass(frozen=True)
class ServerMap:
    kind: str
    label: str
    # signal -> sample names, first present wins; values of all label sets are summed (ratios averaged)
    gauges: dict[str, tuple[str, ...]] = field(default_factory=dict)
    ratio_gauges: frozenset[str] = frozenset()
    # signal -> counter sample names, recorded as a per-second rate between scrapes
    rates: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # "ttft" | "itl" -> histogram base names
    latencies: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # (numerator, denominator) counters whose deltas' ratio is the batch per iteration
    batch_ratio: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    # signal -> why this kind of server does not expose it
    absent: dict[str, str] = field(default_factory=dict)

    def names(self, *, histograms: bool = True) -> tuple[str, ...]:
        """Metric names the mapping reads (line prefixes); without histograms, the cheap per-scrape set."""
        out: list[str] = []
        groups = [*self.gauges.values(), *self.rates.values()] + (list(self.latencies.values()) if histograms else [])
        for group in groups:
            out.extend(group)
        if self.batch_ratio:
            out.extend(self.batch_ratio[0] + self.batch_ratio[1])
        return tuple(dict.fromkeys(out))


_VLLM = dict(
    gauges={
        "server.running": ("vllm:num_requests_running",),
        "server.waiting": ("vllm:num_requests_waiting",),
        "server.kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    },
    ratio_gauges=frozenset({"server.kv_usage"}),
    rates={
        "server.preemptions_per_s": ("vllm:num_preemptions_total",),
        "server.prompt_tokens_per_s": ("vllm:prompt_tokens_total",),
        "server.gen_tokens_per_s": ("vllm:generation_tokens_total",),
        "server.requests_per_s": ("vllm:request_success_total", "vllm:e2e_request_latency_seconds_count"),
    },
    latencies={
        "ttft": ("vllm:time_to_first_token_seconds",),
        "itl": ("vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"),
    },
    # generated tokens per engine step = sequences decoding together
    batch_ratio=(("vllm:generation_tokens_total",), ("vllm:iteration_tokens_total_count",)),
)

SERVER_MAPS: dict[str, ServerMap] = {
    "vllm": ServerMap(kind="vllm", label="vLLM", **_VLLM),  # type: ignore[arg-type]
    "demo": ServerMap(kind="demo", label="diagnoser demo", **_VLLM),  # type: ignore[arg-type]
    "sglang": ServerMap(
        kind="sglang", label="SGLang",
        gauges={
            "server.running": ("sglang:num_running_reqs",),
            "server.waiting": ("sglang:num_queue_reqs",),
            "server.kv_usage": ("sglang:token_usage",),
        },
        ratio_gauges=frozenset({"server.kv_usage"}),
        rates={
            "server.prompt_tokens_per_s": ("sglang:prompt_tokens_total",),
            "server.gen_tokens_per_s": ("sglang:generation_tokens_total",),
            "server.requests_per_s": ("sglang:num_requests_total", "sglang:e2e_request_latency_seconds_count"),
        },
        latencies={
            "ttft": ("sglang:time_to_first_token_seconds",),
            "itl": ("sglang:inter_token_latency_seconds", "sglang:time_per_output_token_seconds"),
        },
        absent={"server.preemptions_per_s": "SGLang exposes retractions as a gauge, not a preemption counter",
                "server.batch_size": "SGLang exposes no per-iteration batch metric (server.running is the batch)"},
    ),
    "tgi": ServerMap(
        kind="tgi", label="TGI",
        gauges={
            "server.running": ("tgi_batch_current_size",),
            "server.waiting": ("tgi_queue_size",),
            "server.batch_size": ("tgi_batch_current_size",),
        },
        rates={
            "server.prompt_tokens_per_s": ("tgi_request_input_length_sum",),
            "server.gen_tokens_per_s": ("tgi_request_generated_tokens_sum",),
            "server.requests_per_s": ("tgi_request_success", "tgi_request_success_total"),
        },
        latencies={"itl": ("tgi_request_mean_time_per_token_duration",)},
        absent={"server.kv_usage": "TGI exposes no KV-cache usage metric",
                "server.preemptions_per_s": "TGI exposes no preemption counter",
                "server.ttft_p50_s": "TGI exposes no time-to-first-token metric",
                "server.ttft_p99_s": "TGI exposes no time-to-first-token metric"},
    ),
    "triton": ServerMap(
        kind="triton", label="Triton",
        gauges={"server.waiting": ("nv_inference_pending_request_count",)},
        rates={"server.requests_per_s": ("nv_inference_request_success", "nv_inference_request_success_total")},
        # Triton documents average batch = inference count / execution count
        batch_ratio=(("nv_inference_count", "nv_inference_count_total"),
                     ("nv_inference_exec_count", "nv_inference_exec_count_total")),
        absent={s: "Triton reports requests and executions, not tokens, KV cache or token latencies"
                for s in ("server.running", "server.kv_usage", "server.preemptions_per_s",
                          "server.prompt_tokens_per_s", "server.gen_tokens_per_s", "server.ttft_p50_s",
                          "server.ttft_p99_s", "server.itl_p50_s", "server.itl_p99_s")},
    ),
}

SERVER_SIGNALS = ("server.running", "server.waiting", "server.kv_usage", "server.preemptions_per_s",
                  "server.prompt_tokens_per_s", "server.gen_tokens_per_s", "server.requests_per_s",
                  "server.ttft_p50_s", "server.ttft_p99_s", "server.itl_p50_s", "server.itl_p99_s",
                  "server.batch_size")

_PREFIX_KIND = (("diagnoser_demo_info", "demo"), ("vllm:", "vllm"), ("sglang:", "sglang"), ("tgi_", "tgi"),
                ("nv_inference_", "triton"))


# --- fetching and parsing -----------------------------------------------------------------------------------

# The whole answer may take this many times the socket timeout: a loaded server that streams a big page slowly still
# gets read, one that trickles bytes forever (never tripping a socket timeout) is cut off.
ANSWER_DEADLINE_FACTOR = 5


class _Deadline(Exception):
    """The whole answer took longer than its deadline."""


def _read_body(response: Any, deadline: float) -> bytes:
    """The body, up to MAX_BODY_BYTES + 1 bytes, read in chunks so that the whole read is bounded by `deadline`."""
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_BODY_BYTES:
        if time.monotonic() > deadline:
            raise _Deadline
        chunk = response.read1(65536)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def fetch_metrics(url: str, timeout: float = FETCH_TIMEOUT_S) -> str:
    """GET a /metrics page: `timeout` bounds each wait on the socket, ANSWER_DEADLINE_FACTOR x `timeout` the whole
    answer; every failure becomes one sentence."""
    request = urllib.request.Request(url, headers={"Accept": "text/plain;version=0.0.4", "User-Agent": "diagnoser"})
    deadline = time.monotonic() + timeout * ANSWER_DEADLINE_FACTOR
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = _read_body(response, deadline)
    except _Deadline:
        raise MetricsError(f"{url} did not finish answering within {timeout * ANSWER_DEADLINE_FACTOR:g} s.") from None
    except urllib.error.HTTPError as exc:
        raise MetricsError(f"{url} answered HTTP {exc.code} ({exc.reason}).") from None
    except urllib.error.URLError as exc:
        reason = exc.reason
        if isinstance(reason, ConnectionRefusedError):
            raise MetricsError(f"nothing answers at {url} (connection refused).") from None
        if isinstance(reason, (TimeoutError, socket.timeout)):
            raise MetricsError(f"{url} did not answer within {timeout:g} s.") from None
        raise MetricsError(f"cannot reach {url}: {getattr(reason, 'strerror', None) or reason}.") from None
    except (TimeoutError, socket.timeout):
        raise MetricsError(f"{url} did not answer within {timeout:g} s.") from None
    except (OSError, ValueError) as exc:
        raise MetricsError(f"cannot read {url}: {exc}.") from None
    if len(body) > MAX_BODY_BYTES:
        raise MetricsError(f"{url} returned more than {MAX_BODY_BYTES >> 20} MiB; that is not a metrics page.")
    return body.decode("utf-8", errors="replace")


class Fetcher:
    """GET one URL repeatedly over a kept-alive HTTP connection (a new TCP connection per scrape costs more CPU)."""

    def __init__(self, url: str, timeout: float = FETCH_TIMEOUT_S) -> None:
        self.url, self.timeout = url, timeout
        parsed = urllib.parse.urlsplit(url)
        self._https = parsed.scheme == "https"
        self._host = parsed.hostname or "127.0.0.1"
        self._port = parsed.port
        self._path = (parsed.path or "/") + (f"?{parsed.query}" if parsed.query else "")
        self._conn: http.client.HTTPConnection | None = None

    def get(self) -> str:
        for _ in range(2):  # a server may close an idle keep-alive connection: retry once on a fresh one
            try:
                return self._get()
            except _Deadline:
                self.close()
                raise MetricsError(f"{self.url} did not finish answering within "
                                   f"{self.timeout * ANSWER_DEADLINE_FACTOR:g} s.") from None
            except (TimeoutError, socket.timeout):
                self.close()
                raise MetricsError(f"{self.url} did not answer within {self.timeout:g} s.") from None
            except (http.client.HTTPException, OSError):
                self.close()
        return fetch_metrics(self.url, self.timeout)  # still failing: the plain path words the error

    def _get(self) -> str:
        if self._conn is None:
            cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
            self._conn = cls(self._host, self._port, timeout=self.timeout)
        self._conn.request("GET", self._path, headers={"Accept": "text/plain;version=0.0.4",
                                                       "User-Agent": "diagnoser"})
        deadline = time.monotonic() + self.timeout * ANSWER_DEADLINE_FACTOR
        response = self._conn.getresponse()
        body = _read_body(response, deadline)
        if response.status != 200 or len(body) > MAX_BODY_BYTES or response.will_close:
            self.close()
        if response.status != 200 or len(body) > MAX_BODY_BYTES:
            return fetch_metrics(self.url, self.timeout)  # let the plain path produce the error sentence
        return body.decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def parse_samples(text: str, names: tuple[str, ...] | None = None, *, origin: str = "the endpoint") -> Samples:
    """Sample name -> [(labels, value)]. With `names`, only lines whose metric name starts with one of them are parsed."""
    if names is not None:
        text = "\n".join(line for line in text.split("\n") if line.startswith(names))
    out: Samples = defaultdict(list)
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                out[s.name].append((s.labels, float(s.value)))
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        detail = " ".join(str(exc).split())[:120]
        raise MetricsError(f"{origin} did not return Prometheus metrics ({detail}).") from None
    return dict(out)


def detect_kind(samples: Samples) -> str | None:
    names = samples.keys()
    for prefix, kind in _PREFIX_KIND:
        if any(n.startswith(prefix) for n in names):
            return kind
    return None


def probe(url: str, timeout: float = FETCH_TIMEOUT_S) -> tuple[str | None, Samples]:
    """Fetch and parse once: (server kind or None, samples). Raises MetricsError for unreachable or garbage."""
    text = fetch_metrics(url, timeout)
    samples = parse_samples(text, origin=url)
    if not samples:
        raise MetricsError(f"{url} returned no metrics.")
    return detect_kind(samples), samples


def served_totals(url: str, timeout: float = FETCH_TIMEOUT_S) -> dict[str, float]:
    """The server's cumulative counters now: generated and prompt tokens and finished requests, for the kinds of
    server this module knows ("gen_tokens", "prompt_tokens", "requests"; those the server lacks are left out)."""
    kind, samples = probe(url, timeout)
    mapping = SERVER_MAPS.get(kind) if kind else None
    if mapping is None:
        raise MetricsError(f"{url} is not a server whose token counters diagnoser knows.")
    out: dict[str, float] = {}
    for key, signal in (("gen_tokens", "server.gen_tokens_per_s"), ("prompt_tokens", "server.prompt_tokens_per_s"),
                        ("requests", "server.requests_per_s")):
        names = mapping.rates.get(signal)
        value = _total(samples, names) if names else None
        if value is not None:
            out[key] = value
    return out


def _total(samples: Samples, names: tuple[str, ...], *, mean: bool = False) -> float | None:
    for name in names:
        found = samples.get(name)
        if found:
            values = [v for _, v in found if not math.isnan(v)]
            if values:
                return sum(values) / len(values) if mean else sum(values)
    return None


def _buckets(samples: Samples, bases: tuple[str, ...]) -> tuple[str, dict[float, float]] | None:
    """Cumulative bucket counts (upper bound -> count) summed over label sets, for the first histogram present."""
    for base in bases:
        found = samples.get(base + "_bucket")
        if not found:
            continue
        counts: dict[float, float] = defaultdict(float)
        for labels, value in found:
            try:
                bound = float(labels.get("le", "nan"))
            except ValueError:
                continue
            if not math.isnan(bound):
                counts[bound] += value
        if counts and math.inf not in counts:
            # Every exposition has le="+Inf"; an excerpt without it still has _count, which is the same number.
            total = _total(samples, (base + "_count",))
            if total is not None:
                counts[math.inf] = total
        if counts:
            return base, dict(counts)
    return None


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts; None with no observations.

    Linear interpolation inside the bucket holding the rank; a rank in the +Inf bucket returns the highest finite
    bound, as Prometheus does.
    """
    bounds = sorted(cumulative)
    if not bounds or not math.isinf(bounds[-1]):
        return None
    total = cumulative[bounds[-1]]
    if total <= 0:
        return None
    rank = q * total
    prev_bound, prev_count = 0.0, 0.0
    for i, bound in enumerate(bounds):
        count = cumulative[bound]
        if count >= rank:
            if math.isinf(bound):
                return bounds[-2] if len(bounds) > 1 else None
            if i == 0 and bound <= 0:
                return bound
            in_bucket = count - prev_count
            if in_bucket <= 0:
                return bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / in_bucket
        prev_bound, prev_count = bound, count
    return bounds[-2] if len(bounds) > 1 else None


# --- the collector ----------------------------------------------------------------------------------------

class ServerMetricsCollector:
    name = "server"

    def __init__(self, url: str, kind: str | None = None, period_s: float = DEFAULT_PERIOD_S,
                 timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.url = url
        self.kind = kind if kind in SERVER_MAPS else None
        self.period_s: float | None = period_s
        self.timeout_s = timeout_s
        self.book: SeriesBook | None = None
        self.map: ServerMap | None = SERVER_MAPS.get(kind) if kind else None
        self._names: tuple[str, ...] | None = self.map.names() if self.map else None
        self._light: tuple[str, ...] | None = self.map.names(histograms=False) if self.map else None
        self._fetcher = Fetcher(url, timeout_s)
        self._prev_t: float | None = None
        self._prev: dict[str, float] = {}
        self._first_hist: dict[str, tuple[str, dict[float, float]]] = {}
        self._last_hist: dict[str, tuple[str, dict[float, float]]] = {}
        self._summary_quantiles: dict[str, dict[float, float]] = {}
        self._failures = 0
        self._given_up = False
        self._last_sample_t: float | None = None
        self.scrapes = 0
        self.resets: set[str] = set()

    def start(self, capture: Capture) -> None:
        self.book = SeriesBook(capture, "server")

    def sample(self, t: float, *, final: bool = False) -> None:
        if self._given_up:
            return
        assert self.book is not None
        full = final or self.map is None or self.scrapes % HISTOGRAM_EVERY == 0
        try:
            text = self._fetcher.get()
            samples = parse_samples(text, self._names if full else self._light, origin=self.url)
            if not samples:
                raise MetricsError(f"{self.url} returned none of the metrics it served before.")
        except MetricsError as exc:
            self._failures += 1
            if self._failures >= MAX_FAILURES:
                self._given_up = True
                self.book.capture.notes.append(
                    f"The server's metrics endpoint stopped answering {t:.1f} s into the window "
                    f"({str(exc).rstrip('.')}); server "
                    "signals cover the window until then.")
            return
        self._failures = 0
        if self.map is None and not self._identify(samples):
            return
        # A final scrape right after a regular one only refreshes the histograms: no duplicate gauge points.
        just_sampled = final and self._last_sample_t is not None and t - self._last_sample_t <= 0.2
        self._record(t, samples, values=not just_sampled, histograms=full)
        self._last_sample_t = t
        self.scrapes += 1

    def _identify(self, samples: Samples) -> bool:
        kind = detect_kind(samples)
        if kind is None:
            assert self.book is not None
            self.book.capture.mark_unavailable(
                "server", "server.*", f"{self.url} serves Prometheus metrics, but none from vLLM, SGLang, TGI or Triton",
                "point --metrics-url at the inference server's own /metrics")
            self._given_up = True
            return False
        self.kind, self.map = kind, SERVER_MAPS[kind]
        self._names, self._light = self.map.names(), self.map.names(histograms=False)
        return True

    def _record(self, t: float, samples: Samples, *, values: bool, histograms: bool) -> None:
        assert self.book is not None and self.map is not None
        m = self.map
        if histograms:
            self._record_histograms(samples)
        if not values:
            return
        for signal, names in m.gauges.items():
            value = _total(samples, names, mean=signal in m.ratio_gauges)
            if value is not None:
                self.book.add(signal, t, value)
        dt = None if self._prev_t is None else t - self._prev_t
        current: dict[str, float] = {}
        for signal, names in m.rates.items():
            value = _total(samples, names)
            if value is None:
                continue
            current[signal] = value
            before = self._prev.get(signal)
            if before is None or not dt:
                continue
            if value < before:
                self.resets.add(signal)  # the server restarted its counters: this interval has no rate
                continue
            self.book.add(signal, t, (value - before) / dt)
        if m.batch_ratio:
            num, den = _total(samples, m.batch_ratio[0]), _total(samples, m.batch_ratio[1])
            if num is not None and den is not None:
                current["_batch_num"], current["_batch_den"] = num, den
                if "_batch_num" in self._prev and "_batch_den" in self._prev:
                    d_num, d_den = num - self._prev["_batch_num"], den - self._prev["_batch_den"]
                    if d_den > 0 and d_num >= 0:
                        self.book.add("server.batch_size", t, d_num / d_den)
        self._prev, self._prev_t = current, t

    def _record_histograms(self, samples: Samples) -> None:
        assert self.map is not None
        for key, bases in self.map.latencies.items():
            found = _buckets(samples, bases)
            if found is not None:
                self._first_hist.setdefault(key, found)
                self._last_hist[key] = found
            else:
                summary = _summary(samples, bases)
                if summary:
                    self._summary_quantiles[key] = summary

    def stop(self, t: float) -> None:
        assert self.book is not None
        # A last scrape at the very end so counters and histograms cover the whole window.
        if not self._given_up:
            self.sample(t, final=True)
        self._fetcher.close()
        capture = self.book.capture
        if self.map is None:
            if not any(u.source == "server" for u in capture.unavailable):
                capture.mark_unavailable("server", "server.*", f"no scrape of {self.url} succeeded")
            return
        for key in ("ttft", "itl"):
            self._latency(key, t)
        if self.resets:
            capture.notes.append("The server's counters went backwards during the window (restarted?): "
                                 f"{', '.join(sorted(self.resets))} skip those intervals.")
        for signal in SERVER_SIGNALS:
            if self.book.has(signal):
                continue
            why = self.map.absent.get(signal)
            if why is None:
                why = self._why_not_recorded(signal)
            capture.mark_unavailable("server", signal, why)

    def _latency(self, key: str, t: float) -> None:
        assert self.book is not None
        first, last = self._first_hist.get(key), self._last_hist.get(key)
        if first is not None and last is not None and first[0] == last[0]:
            delta = {b: last[1][b] - first[1].get(b, 0.0) for b in last[1]}
            if self.scrapes > 1 and any(v < 0 for v in delta.values()):
                delta = last[1]  # counters reset mid-window: fall back to the last scrape's totals
            for q, suffix in ((0.5, "p50"), (0.99, "p99")):
                value = histogram_quantile(q, delta)
                if value is not None:
                    self.book.add(f"server.{key}_{suffix}_s", t, value)
        elif key in self._summary_quantiles:
            for q, suffix in ((0.5, "p50"), (0.99, "p99")):
                value = self._summary_quantiles[key].get(q)
                if value is not None and not math.isnan(value):
                    self.book.add(f"server.{key}_{suffix}_s", t, value)
            self.book.capture.notes.append(f"server.{key} quantiles come from the server's own summary window, "
                                           "not from this capture's window.")

    def _why_not_recorded(self, signal: str) -> str:
        assert self.map is not None
        label = self.map.label
        if signal.startswith(("server.ttft", "server.itl")):
            key = "ttft" if "ttft" in signal else "itl"
            if key in self.map.latencies and key in self._first_hist:
                return f"no request of the {label} server reached that point during the window"
            names = self.map.latencies.get(key, ())
            return f"the {label} /metrics has no {' or '.join(names) or 'such'} histogram"
        if signal == "server.batch_size" and self.map.batch_ratio:
            return f"the {label} server ran no iteration during the window (or lacks {self.map.batch_ratio[1][0]})"
        names = self.map.gauges.get(signal) or self.map.rates.get(signal) or ()
        if not names:
            return f"the {label} server has no metric mapped to {signal}"
        if self.scrapes < 2 and signal in self.map.rates:
            return "fewer than two scrapes succeeded, so no rate could be computed"
        return f"the {label} /metrics has no {' or '.join(names)}"

    def latest(self) -> dict[str, float]:
        return dict(self.book.newest) if self.book else {}


def _summary(samples: Samples, bases: tuple[str, ...]) -> dict[float, float] | None:
    for base in bases:
        found = samples.get(base)
        if found and any("quantile" in labels for labels, _ in found):
            out: dict[float, float] = {}
            for labels, value in found:
                try:
                    out[float(labels["quantile"])] = value
                except (KeyError, ValueError):
                    continue
            return out
    return None
