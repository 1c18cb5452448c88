"""Server-metrics collector: scrapes an inference server's Prometheus /metrics and maps it onto server.* signals.

Lines are read one by one (collectors/exposition.py): a malformed line is skipped and noted, never the whole scrape.
The engine is decided from the page's own names (collectors/server_maps.py holds one table per engine: vLLM V1 and
V0, SGLang in both spellings, TGI, Triton with TensorRT-LLM, NVIDIA NIM). Gauges are recorded as they are, counters
become per-second rates between scrapes, ratios of counters become one value over the window, and histograms give
the window's p50, p99 and mean from the difference of their buckets between the first and the last scrape
(Prometheus' histogram_quantile method) -- per label set first (an engine, a LoRA model), then combined on the bucket
bounds all label sets share, so that two series with different buckets cannot make the combined one fall.

The serving configuration the page states (vLLM's cache_config_info, SGLang's and TensorRT-LLM's capacity gauges,
NIM's max request count) is read into a ServerConfig, and written into Capture.serving under its keys.

A vLLM scrape carries hundreds of families the diagnosis never reads; lines are filtered by metric name before they
are parsed, which is what keeps a 1 Hz scrape cheap.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import math
import socket
import threading
import time
import urllib.parse
from dataclasses import dataclass, field, fields
from typing import Any

import msgspec

from diagnoser import signals as S
from diagnoser.capture import Capture, CounterTrack, ServingConfig, bucket_labels
from diagnoser.collectors.base import SeriesBook
from diagnoser.collectors.exposition import (
    ParseError,
    ParseReport,
    Samples,
    parse_text,
    safe_excerpt,
)
from diagnoser.collectors.server_maps import (
    CORE_SIGNALS,
    HIST_KEYS,
    LLAMACPP_BUSY_SLOTS,
    LLAMACPP_MAP,
    SERVER_MAPS,
    VLLM_CACHE_INFO,
    VLLM_LORA_INFO,
    Gauge,
    GaugeRatio,
    Hist,
    Rate,
    ServerMap,
    Source,
    StepRatio,
    WindowRatio,
    hist_signal,
    parse_spec,
)
from diagnoser.collectors.server_maps import detect_kind as _detect_kind_of_names
from diagnoser.errors import SourceUnavailable

DEFAULT_PERIOD_S = 1.0
FETCH_TIMEOUT_S = 2.0
# Histogram buckets are most of a page's lines and only the first and last scrape's buckets are needed; they are
# also read every few scrapes so that an endpoint dying mid-window still leaves a recent snapshot.
HISTOGRAM_EVERY = 5
MAX_BODY_BYTES = 32 << 20
# Consecutive failed scrapes after which the endpoint is given up for the rest of the window.
MAX_FAILURES = 3
# Kept for callers that list what the collector always accounts for.
SERVER_SIGNALS = CORE_SIGNALS


class MetricsError(SourceUnavailable):
    """The endpoint could not be read or did not return Prometheus text; the message is one sentence."""


# --- fetching and parsing -----------------------------------------------------------------------------------

# The whole answer may take this many times the socket timeout: a loaded server that streams a big page slowly still
# gets read, one that trickles bytes forever (never tripping a socket timeout) is cut off. The deadline covers the
# status line and headers too: a watchdog shuts the socket down when it passes, whatever read is waiting then.
ANSWER_DEADLINE_FACTOR = 5
_REQUEST_HEADERS = {"Accept": "text/plain;version=0.0.4", "User-Agent": "diagnoser"}


class _Deadline(Exception):
    """The whole answer took longer than its deadline."""


def _read_body(response: Any, deadline: float) -> bytes:
    """The body, up to MAX_BODY_BYTES + 1 bytes, read in chunks so that the whole read is bounded by `deadline`.

    A body read to its end is closed here: read1, unlike read, can leave an answer open once its Content-Length is
    read (Python 3.11), and http.client then refuses the next request on the kept-alive connection
    (ResponseNotReady after the request went out): every scrape after the first was sent twice."""
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_BODY_BYTES:
        if time.monotonic() > deadline:
            raise _Deadline
        chunk = response.read1(65536)
        if not chunk:
            response.close()  # the whole answer is in: the connection can carry the next request
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _connection(url: str, timeout: float) -> tuple[http.client.HTTPConnection, str, dict[str, str]]:
    """A connection (not yet opened) to `url`'s host, the request target and the headers to send; ValueError for a
    URL that is not http(s)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("not an http(s) URL")
    port = parts.port  # ValueError for a port that is not a number in range
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    headers = dict(_REQUEST_HEADERS)
    if parts.username is not None:
        userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
        headers["Authorization"] = "Basic " + base64.b64encode(userinfo.encode()).decode()
    cls = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    return cls(parts.hostname, port, timeout=timeout), target, headers


def _exchange(conn: http.client.HTTPConnection, target: str, headers: dict[str, str],
              timeout: float) -> tuple[http.client.HTTPResponse, bytes]:
    """GET `target` on `conn` and read the whole answer, status line and headers included, within
    ANSWER_DEADLINE_FACTOR x `timeout` (_Deadline past it); `timeout` bounds each wait on the socket."""
    whole = timeout * ANSWER_DEADLINE_FACTOR
    deadline = time.monotonic() + whole
    fired = threading.Event()

    def watchdog() -> None:  # a read in http.client (the status line, a header) cannot be interrupted otherwise
        fired.set()
        sock = conn.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(whole, watchdog)
    timer.daemon = True
    timer.start()
    try:
        conn.request("GET", target, headers=headers)
        if fired.is_set():  # it fired while connecting, before there was a socket to shut
            raise _Deadline
        response = conn.getresponse()
        body = _read_body(response, deadline)
    except (OSError, http.client.HTTPException):
        if fired.is_set():
            raise _Deadline from None
        raise
    finally:
        timer.cancel()
    if fired.is_set():  # the shut socket read as the end of the answer
        raise _Deadline
    return response, body


def _status_error(url: str, response: http.client.HTTPResponse) -> MetricsError:
    """One sentence for an answer other than 2xx; a redirect names where it pointed and is not followed (another
    host's or port's page would be reported as this one's)."""
    code, reason = response.status, safe_excerpt(response.reason or "", 60)
    if 300 <= code < 400:
        location = response.getheader("Location")
        if location:
            where = safe_excerpt(urllib.parse.urljoin(url, location.strip()), 200)
            return MetricsError(f"{url} redirects to {where}; diagnoser does not follow redirects: give that URL "
                                "with --metrics-url if it is the server's.")
        return MetricsError(f"{url} answered HTTP {code} ({reason}), a redirect without saying where to.")
    return MetricsError(f"{url} answered HTTP {code} ({reason}).")


def _answer_error(url: str, exc: http.client.HTTPException | OSError) -> MetricsError:
    if isinstance(exc, http.client.RemoteDisconnected):
        return MetricsError(f"cannot read {url}: the server closed the connection without answering.")
    if isinstance(exc, http.client.HTTPException):
        return MetricsError(f"cannot read {url}: not an HTTP answer ({type(exc).__name__}).")
    return MetricsError(f"cannot read {url}: {exc.strerror or exc}.")


def fetch_metrics(url: str, timeout: float = FETCH_TIMEOUT_S) -> str:
    """GET a /metrics page: `timeout` bounds each wait on the socket, ANSWER_DEADLINE_FACTOR x `timeout` the whole
    answer (headers included); a redirect is refused, not followed; every failure becomes one sentence."""
    try:
        conn, target, headers = _connection(url, timeout)
    except ValueError as exc:
        raise MetricsError(f"cannot read {url}: {exc}.") from None
    headers["Connection"] = "close"
    try:
        try:
            conn.connect()
        except ConnectionRefusedError:
            raise MetricsError(f"nothing answers at {url} (connection refused).") from None
        except TimeoutError:
            raise MetricsError(f"{url} did not answer within {timeout:g} s.") from None
        except OSError as exc:
            raise MetricsError(f"cannot reach {url}: {getattr(exc, 'strerror', None) or exc}.") from None
        try:
            response, body = _exchange(conn, target, headers, timeout)
        except _Deadline:
            raise MetricsError(f"{url} did not finish answering within {timeout * ANSWER_DEADLINE_FACTOR:g} s.") \
                from None
        except TimeoutError:
            raise MetricsError(f"{url} did not answer within {timeout:g} s.") from None
        except (OSError, http.client.HTTPException) as exc:
            raise _answer_error(url, exc) from None
    finally:
        conn.close()
    if not 200 <= response.status < 300:
        raise _status_error(url, response)
    if len(body) > MAX_BODY_BYTES:
        raise MetricsError(f"{url} returned more than {MAX_BODY_BYTES >> 20} MiB; that is not a metrics page.")
    return body.decode("utf-8", errors="replace")


class Fetcher:
    """GET one URL repeatedly over a kept-alive HTTP connection (a new TCP connection per scrape costs more CPU)."""

    def __init__(self, url: str, timeout: float = FETCH_TIMEOUT_S) -> None:
        self.url, self.timeout = url, timeout
        self._conn: http.client.HTTPConnection | None = None
        self._target, self._headers = "/", dict(_REQUEST_HEADERS)

    def get(self) -> str:
        for _ in range(2):  # a server may close an idle keep-alive connection: retry once on a fresh one
            try:
                return self._get()
            except _Deadline:
                self.close()
                raise MetricsError(f"{self.url} did not finish answering within "
                                   f"{self.timeout * ANSWER_DEADLINE_FACTOR:g} s.") from None
            except TimeoutError:
                self.close()
                raise MetricsError(f"{self.url} did not answer within {self.timeout:g} s.") from None
            except (http.client.HTTPException, OSError, ValueError):  # a bad URL too: the plain path words it
                self.close()
        return fetch_metrics(self.url, self.timeout)  # still failing: the plain path words the error

    def _get(self) -> str:
        if self._conn is None:
            self._conn, self._target, self._headers = _connection(self.url, self.timeout)
        response, body = _exchange(self._conn, self._target, self._headers, self.timeout)
        if response.status != 200 or len(body) > MAX_BODY_BYTES or response.will_close:
            self.close()
        if response.status != 200 or len(body) > MAX_BODY_BYTES:
            return fetch_metrics(self.url, self.timeout)  # let the plain path produce the error sentence
        return body.decode("utf-8", errors="replace")

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def parse_page(text: str, names: tuple[str, ...] | None = None, *,
               origin: str = "the endpoint") -> tuple[Samples, ParseReport]:
    """Sample name -> [(labels, value)] and what was skipped; with `names`, only lines whose metric name starts with
    one of them. A page with no readable sample line is not Prometheus metrics: MetricsError."""
    try:
        return parse_text(text, names)
    except ParseError as exc:
        raise MetricsError(f"{origin} did not return Prometheus metrics ({exc}).") from None


def parse_samples(text: str, names: tuple[str, ...] | None = None, *, origin: str = "the endpoint") -> Samples:
    """parse_page without the report: malformed lines are skipped."""
    return parse_page(text, names, origin=origin)[0]


def detect_kind(samples: Samples) -> str | None:
    """vllm, sglang, tgi, triton, nim or demo, from the names on the page; None for no serving engine's page."""
    return _detect_kind_of_names(samples.keys())


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
    samples = canonical(samples, mapping)
    out: dict[str, float] = {}
    for key, signal in (("gen_tokens", S.SERVER_GEN_TOKENS_PER_S), ("prompt_tokens", S.SERVER_PROMPT_TOKENS_PER_S),
                        ("requests", S.SERVER_REQUESTS_PER_S)):
        for src in mapping.signals.get(signal, ()):
            if isinstance(src, Rate):
                value = _total(samples, src.specs)
                if value is not None:
                    out[key] = value
                    break
    return out


# --- reading values off a page ------------------------------------------------------------------------------

def canonical(samples: Samples, mapping: ServerMap) -> Samples:
    """The page with alias spellings (sglang_num_running_reqs, TensorRT-LLM's older nv_trt_llm_*_statistics)
    renamed to the table's (sglang:num_running_reqs, nv_trt_llm_*_metrics); a page with both keeps the table's.

    On Triton with TensorRT-LLM, the per-model nv_inference_* counters count one request once per model of the
    ensemble (preprocessing, tensorrt_llm, postprocessing, ensemble): they are read for the TensorRT-LLM model only.
    The first-response histogram exists for the decoupled (client-facing) model and is kept whole."""
    if mapping.aliases:
        out = dict(samples)
        for name in samples:
            for alt, canon in mapping.aliases:
                if name.startswith(alt):
                    out.setdefault(canon + name[len(alt):], samples[name])
        samples = out
    if mapping.kind == "triton":
        return _triton_models(samples)
    if mapping.kind == "llamacpp":
        return _llamacpp_busy_slots(samples)
    return samples


def _llamacpp_busy_slots(samples: Samples) -> Samples:
    """llama.cpp's busy slots since start (n_busy_slots_per_decode x n_decode_total, as LLAMACPP_BUSY_SLOTS): the
    page gives only their average since start, and the window's batch is their increase over the window's decode
    calls. The gauge is printed to 6 significant digits, so the product is good to about a millionth of the count."""
    per = _total(samples, (LLAMACPP_MAP.prefixes[0] + "n_busy_slots_per_decode",), mean=True)
    calls = _total(samples, (LLAMACPP_MAP.prefixes[0] + "n_decode_total",))
    if per is None or calls is None:
        return samples
    return {**samples, LLAMACPP_BUSY_SLOTS: [({}, round(per * calls))]}


def _triton_models(samples: Samples) -> Samples:
    models = {labels.get("model") for name, found in samples.items() if name.startswith("nv_trt_llm_")
              for labels, _ in found}
    models.discard(None)
    if not models:
        return samples
    out = dict(samples)
    for name, found in samples.items():
        if name.startswith("nv_inference_") and not name.startswith("nv_inference_first_response"):
            out[name] = [(labels, v) for labels, v in found if labels.get("model") in models]
    return out


def _select(samples: Samples, spec: str) -> list[float] | None:
    """The values of one spec ('name' or 'family{label="v"}'); None when the page lacks it."""
    name, where = parse_spec(spec)
    found = samples.get(name)
    if not found:
        return None
    if where is None:
        return [v for _, v in found]
    if where.label not in {k for labels, _ in found for k in labels}:
        return None  # a page without the label (an older engine) does not have this spec: the next one is tried
    picked = [v for labels, v in found if where.matches(labels)]
    return picked or None


def _total(samples: Samples, specs: tuple[str, ...], *, mean: bool = False, positive: bool = False) -> float | None:
    """The first spec the page has: its values summed over label sets (averaged when `mean`)."""
    for spec in specs:
        values = _select(samples, spec)
        if values is None:
            continue
        values = [v for v in values if not math.isnan(v)]
        if positive:
            values = [v for v in values if v > 0]
        if values:
            return sum(values) / len(values) if mean else sum(values)
        return None
    return None


def _sum_all(samples: Samples, specs: tuple[str, ...]) -> float | None:
    """Every spec's total added up; None unless the page has them all."""
    total = 0.0
    for spec in specs:
        value = _total(samples, (spec,))
        if value is None:
            return None
        total += value
    return total


# --- histograms, per label set ---------------------------------------------------------------------------------

LabelKey = tuple[tuple[str, str], ...]


@dataclass
class HistSeries:
    """One label set of a histogram at one scrape: cumulative bucket counts (upper bound -> count), sum, count."""

    buckets: dict[float, float] = field(default_factory=dict)
    sum: float | None = None
    count: float | None = None
    repaired: bool = False  # the counts fell as the bound rose and were held at their running maximum
    cut: bool = False  # buckets without le="+Inf" and no _count to stand for it: no quantile can be computed


def histogram_series(samples: Samples, spec: str) -> dict[LabelKey, HistSeries]:
    """A histogram's series by label set (labels other than le), each made cumulative-monotone as Prometheus does."""
    base, where = parse_spec(spec)

    def keep(labels: dict[str, str]) -> bool:
        return where is None or where.matches(labels)

    out: dict[LabelKey, HistSeries] = {}

    def series(labels: dict[str, str]) -> HistSeries:
        key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        return out.setdefault(key, HistSeries())

    for labels, value in samples.get(base + "_bucket", []):
        if not keep(labels) or math.isnan(value):
            continue
        try:
            bound = float(labels.get("le", "nan"))
        except ValueError:
            continue
        if not math.isnan(bound):
            series(labels).buckets[bound] = value
    for suffix in ("_sum", "_count"):
        for labels, value in samples.get(base + suffix, []):
            if keep(labels) and not math.isnan(value):
                setattr(series(labels), suffix[1:], value)
    for s in out.values():
        if s.buckets and math.inf not in s.buckets:
            if s.count is not None:
                # Every exposition has le="+Inf"; an excerpt without it still has _count, which is the same number.
                s.buckets[math.inf] = s.count
            else:
                s.cut = True
        running = -math.inf
        for bound in sorted(s.buckets):
            if s.buckets[bound] < running:
                s.buckets[bound], s.repaired = running, True
            running = s.buckets[bound]
    return out


def _first_histogram(samples: Samples, hist: Hist) -> tuple[str, dict[LabelKey, HistSeries]] | None:
    for spec in hist.bases:
        found = histogram_series(samples, spec)
        if any(s.buckets or s.count is not None for s in found.values()):
            return spec, found
    return None


@dataclass
class Combined:
    """A histogram over the window: label sets' increases combined on the bounds they share."""

    buckets: dict[float, float]
    sum: float | None
    count: float | None
    dropped_bounds: int = 0  # bounds some label set lacked, left out of the combination
    reset: bool = False  # a series went backwards (server restart): its last totals stand for the window
    repaired: bool = False


def window_histogram(first: dict[LabelKey, HistSeries] | None, last: dict[LabelKey, HistSeries]) -> Combined:
    """The increase of each label set between two scrapes (a set absent at the first scrape started inside the
    window), then summed over the finite bounds every set with observations has, plus +Inf."""
    deltas: list[HistSeries] = []
    reset = repaired = False
    for key, now in last.items():
        before = (first or {}).get(key)
        repaired |= now.repaired
        if before is None:
            deltas.append(now)
            continue
        d = HistSeries(buckets={b: c - before.buckets.get(b, 0.0) for b, c in now.buckets.items()},
                       sum=None if now.sum is None or before.sum is None else now.sum - before.sum,
                       count=None if now.count is None or before.count is None else now.count - before.count)
        if any(v < 0 for v in d.buckets.values()) or (d.count is not None and d.count < 0):
            reset = True
            d = now  # counters reset mid-window: the last scrape's totals are all this series has
        deltas.append(d)
    active = [d for d in deltas if d.buckets and d.buckets.get(math.inf, 0.0) > 0]
    shared: set[float] | None = None
    every: set[float] = set()
    for d in active:
        bounds = set(d.buckets)
        every |= bounds
        shared = bounds if shared is None else shared & bounds
    buckets = {b: sum(d.buckets[b] for d in active) for b in (shared or set())}
    sums = [d.sum for d in deltas if d.sum is not None]
    counts = [d.count for d in deltas if d.count is not None]
    return Combined(buckets=buckets, sum=sum(sums) if sums else None, count=sum(counts) if counts else None,
                    dropped_bounds=len(every - (shared or set())), reset=reset, repaired=repaired)


def histogram_quantile(q: float, cumulative: dict[float, float]) -> float | None:
    """Prometheus' histogram_quantile over cumulative bucket counts; None with no observations.

    Linear interpolation inside the bucket holding the rank; a rank in the +Inf bucket returns the highest finite
    bound, as Prometheus does.
    """
    found = quantile_in_bucket(q, cumulative)
    return None if found is None else found[0]


def quantile_in_bucket(q: float, cumulative: dict[float, float]) -> tuple[float, float, float] | None:
    """(the quantile, the lower and upper bound of the bucket it was interpolated in). Inside one bucket the value
    says nothing but where the rank falls (the first bucket's p50 is half its bound, whatever the latencies were),
    so a comparison needs the bucket too."""
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
                return (bounds[-2], bounds[-2], math.inf) if len(bounds) > 1 else None
            if i == 0 and bound <= 0:
                return bound, bound, bound
            in_bucket = count - prev_count
            if in_bucket <= 0:
                return bound, prev_bound, bound
            return prev_bound + (bound - prev_bound) * (rank - prev_count) / in_bucket, prev_bound, bound
        prev_bound, prev_count = bound, count
    return (bounds[-2], bounds[-2], math.inf) if len(bounds) > 1 else None


def _buckets(samples: Samples, bases: tuple[str, ...]) -> tuple[str, dict[float, float]] | None:
    """Cumulative bucket counts of the first histogram present, label sets combined as window_histogram does."""
    found = _first_histogram(samples, Hist(bases))
    if found is None:
        return None
    combined = window_histogram(None, found[1])
    return (found[0], combined.buckets) if combined.buckets else None


def _summary(samples: Samples, bases: tuple[str, ...]) -> dict[float, float] | None:
    """Quantile -> value of the first summary present (older TGI exports its latencies as summaries)."""
    for spec in bases:
        base, _ = parse_spec(spec)
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


# --- the serving configuration a page states ---------------------------------------------------------------------

@dataclass
class ServerConfig:
    """Serving configuration read off the /metrics page, as plain typed fields (None / "" when the page is silent).
    `as_serving()` gives the Capture.serving keys."""

    kv_block_size: int | None = None  # tokens per KV block (vLLM block_size, SGLang page_size, TRT-LLM tokens_per)
    kv_cache_dtype: str = ""  # vLLM cache_dtype, when not "auto"
    gpu_memory_utilization: float | None = None  # share of GPU memory the engine may fill (vLLM)
    num_gpu_blocks: int | None = None
    num_gpu_blocks_override: int | None = None  # vLLM --num-gpu-blocks-override in force: it, not memory, sizes KV
    num_cpu_blocks: int | None = None
    kv_cache_tokens: int | None = None  # KV capacity in tokens, per engine
    enable_prefix_caching: bool | None = None
    max_num_seqs: int | None = None  # most requests run together (SGLang, TRT-LLM, NIM)
    max_model_len: int | None = None  # context length (SGLang context_len)
    max_loras: int | None = None  # adapters one batch may hold (vLLM max_lora, SGLang LoRA pool slots)
    data_parallel_engines: int | None = None  # engine label values on the page (vLLM data parallel)
    swap_space_bytes: int | None = None  # CPU swap space for KV (vLLM V0)
    cpu_offload_gb: float | None = None
    lora_adapters_seen: int | None = None  # distinct adapters seen running or waiting during the window
    longest_sequence_tokens: int | None = None  # llama.cpp's n_tokens_max: the longest prompt + output since start

    def as_serving(self) -> dict[str, Any]:
        """The known fields by name (None and "" left out)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and value != "":
                out[f.name] = value
        return out

    def apply(self, serving: ServingConfig) -> ServingConfig:
        """`serving` with what the page says: typed fields where ServingConfig has one (the page is what the engine
        resolved, so it replaces a flag's value), the rest as text in `extra`; an unknown field changes nothing."""
        typed: dict[str, Any] = {}
        extra = dict(serving.extra)
        for name, value in self.as_serving().items():
            target = _TYPED.get(name)
            if target is not None:
                typed[target] = value
            else:
                extra[name] = str(value)
        return msgspec.structs.replace(serving, **typed, extra=extra)


# ServerConfig field -> ServingConfig field; the others go to ServingConfig.extra as text.
_TYPED = {"kv_block_size": "block_size", "kv_cache_dtype": "kv_cache_dtype",
          "gpu_memory_utilization": "gpu_memory_utilization", "kv_cache_tokens": "kv_cache_tokens",
          "enable_prefix_caching": "prefix_caching", "max_num_seqs": "max_num_seqs", "max_model_len": "max_model_len"}


def _int(text: str | None) -> int | None:
    try:
        value = float(text) if text not in (None, "", "None") else None
    except ValueError:
        return None
    return int(value) if value is not None and math.isfinite(value) and value >= 0 else None


def _float(text: str | None) -> float | None:
    try:
        value = float(text) if text not in (None, "", "None") else None
    except ValueError:
        return None
    return value if value is not None and math.isfinite(value) else None


def read_config(samples: Samples, kind: str, config: ServerConfig | None = None) -> ServerConfig:
    """What the page says about the serving configuration (kind: the engine's table)."""
    c = config or ServerConfig()
    if kind in ("vllm", "demo"):
        infos = samples.get(VLLM_CACHE_INFO, [])
        if infos:
            labels = infos[0][0]
            c.kv_block_size = _int(labels.get("block_size")) or c.kv_block_size
            dtype = labels.get("cache_dtype", "")
            if dtype and dtype.lower() not in ("auto", "none"):
                c.kv_cache_dtype = safe_excerpt(dtype, 24)
            c.gpu_memory_utilization = _float(labels.get("gpu_memory_utilization"))
            c.num_gpu_blocks = _int(labels.get("num_gpu_blocks"))
            c.num_gpu_blocks_override = _int(labels.get("num_gpu_blocks_override"))
            c.num_cpu_blocks = _int(labels.get("num_cpu_blocks"))
            c.swap_space_bytes = _int(labels.get("swap_space_bytes"))
            c.cpu_offload_gb = _float(labels.get("cpu_offload_gb"))
            prefix = labels.get("enable_prefix_caching", "").lower()
            c.enable_prefix_caching = True if prefix == "true" else False if prefix == "false" else None
            tokens = _int(labels.get("kv_cache_size_tokens"))
            if tokens is None and c.num_gpu_blocks and c.kv_block_size:
                tokens = c.num_gpu_blocks * c.kv_block_size
            c.kv_cache_tokens = tokens or c.kv_cache_tokens
        engines = {labels["engine"] for series in samples.values() for labels, _ in series[:64]
                   if labels.get("engine")}
        if len(engines) > 1:
            c.data_parallel_engines = len(engines)
        lora = _lora_state(samples)
        if lora is not None and lora[2]:
            c.max_loras = lora[2]
    elif kind == "sglang":
        c.kv_cache_tokens = _int_of(samples, "sglang:max_total_num_tokens") or c.kv_cache_tokens
        c.kv_block_size = _int_of(samples, "sglang:page_size") or c.kv_block_size
        c.max_model_len = _int_of(samples, "sglang:context_len") or c.max_model_len
        c.max_num_seqs = _int_of(samples, "sglang:max_running_requests") or c.max_num_seqs
        c.max_loras = _int_of(samples, "sglang:lora_pool_slots_total") or c.max_loras
    elif kind == "triton":
        per = _int_of(samples, 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="tokens_per"}')
        blocks = _int_of(samples, 'nv_trt_llm_kv_cache_block_metrics{kv_cache_block_type="max"}')
        c.kv_block_size = per or c.kv_block_size
        c.num_gpu_blocks = blocks or c.num_gpu_blocks
        if per and blocks:
            c.kv_cache_tokens = per * blocks
        c.max_num_seqs = _int_of(samples, 'nv_trt_llm_request_metrics{request_type="max"}') or c.max_num_seqs
    elif kind == "nim":
        c.max_num_seqs = _int_of(samples, "num_request_max") or c.max_num_seqs
    elif kind == "llamacpp":  # its slots and context are on /props, read by the target (collectors/target.py)
        c.longest_sequence_tokens = _int_of(samples, "llamacpp:n_tokens_max") or c.longest_sequence_tokens
    return c


def _int_of(samples: Samples, spec: str) -> int | None:
    values = _select(samples, spec)
    if not values:
        return None
    return _int(repr(max(values)))


def _lora_state(samples: Samples) -> tuple[list[str], list[str], int | None] | None:
    """(running adapters, waiting adapters, max_lora) from vLLM's lora_requests_info: an info gauge whose value is
    the time it was last set, one series per combination ever seen -- the newest one is the state now."""
    found = samples.get(VLLM_LORA_INFO)
    if not found:
        return None
    labels, _ = max(found, key=lambda lv: lv[1] if not math.isnan(lv[1]) else -math.inf)

    def names(key: str) -> list[str]:
        return [n for n in labels.get(key, "").split(",") if n.strip()]

    return names("running_lora_adapters"), names("waiting_lora_adapters"), _int(labels.get("max_lora"))


# --- the collector ----------------------------------------------------------------------------------------

def _spec_names(src: Source) -> tuple[str, ...]:
    if isinstance(src, (Gauge, Rate)):
        return src.specs
    if isinstance(src, StepRatio):
        return src.num + src.den
    if isinstance(src, GaugeRatio):
        return (src.num, src.den)
    return tuple(n for num, den in src.pairs for n in (*num, *den))


@dataclass
class _Window:
    """A WindowRatio's counters at the first and the latest scrape that had them."""

    pair: int
    first: tuple[float, float]
    last: tuple[float, float]


def json_beside(metrics_url: str, path: str, timeout: float) -> Any:
    """The JSON answer at `path` beside the metrics URL (llama.cpp's /props, /slots), or None where there is none
    (no such endpoint, disabled, not JSON)."""
    from diagnoser.collectors import http as bounded

    parsed = urllib.parse.urlparse(metrics_url)
    url = urllib.parse.urlunparse((parsed.scheme, parsed.netloc, path, "", "", ""))
    try:
        return msgspec.json.decode(bounded.fetch(url, timeout_s=timeout, max_bytes=1 << 20))
    except (bounded.FetchError, msgspec.DecodeError):
        return None


def llamacpp_last_task(metrics_url: str, timeout_s: float = 2.0) -> int | None:
    """The last task id any of llama-server's slots took (its /slots beside /metrics); None where /slots does not
    answer (disabled with --no-slots) or holds no task ids."""
    slots = json_beside(metrics_url, "/slots", timeout_s)
    ids = [x["id_task"] for x in slots if isinstance(x, dict) and type(x.get("id_task")) is int] \
        if isinstance(slots, list) else []
    return max(ids) if ids else None


class ServerMetricsCollector:
    name = "server"

    def __init__(self, url: str, kind: str | None = None, period_s: float = DEFAULT_PERIOD_S,
                 timeout_s: float = FETCH_TIMEOUT_S) -> None:
        self.url = url
        # The target's guess (from the command line or a probe); the page's own names decide.
        self.hint = kind if kind in SERVER_MAPS else None
        self.kind: str | None = None
        self.map: ServerMap | None = None
        self.period_s: float | None = period_s
        self.timeout_s = timeout_s
        self.book: SeriesBook | None = None
        self.config = ServerConfig()
        self._names: tuple[str, ...] | None = None
        self._light: tuple[str, ...] | None = None
        self._fetcher = Fetcher(url, timeout_s)
        self._prev_t: float | None = None
        self._prev: dict[str, float] = {}
        self._window: dict[str, _Window] = {}
        self._shadow: dict[str, list[tuple[float, float]]] = {}
        self._first_hist: dict[str, tuple[str, dict[LabelKey, HistSeries]]] = {}
        self._last_hist: dict[str, tuple[str, dict[LabelKey, HistSeries]]] = {}
        self._summary_quantiles: dict[str, dict[float, float]] = {}
        self._present: set[str] = set()
        self._lora_seen: set[str] = set()
        self._failures = 0
        self._given_up = False
        self._last_sample_t: float | None = None
        self._skipped_lines = 0
        self._percent_noted: set[str] = set()  # ratio gauges found given as percents
        self._first_bad = ""
        self._cut_note = ""  # the first page cut at exposition.MAX_PAGE_SERIES, said once
        self._unmapped_pages = 0
        self._backend_seen = False  # a name of the map's backend (Triton's TensorRT-LLM) was on the page
        self.scrapes = 0  # scrapes whose mapped values were read
        self.pages = 0  # scrapes that returned a metrics page
        self.resets: set[str] = set()
        self._fetch_s = 0.0  # how long the current scrape's answer took
        self._tracks: dict[str, CounterTrack] = {}  # each rate's counter at every scrape (Capture.counters)
        # llama.cpp: (monotonic time, metrics pages read, the last task id a slot took) at the window's start
        self._tasks_first: tuple[float, int, int] | None = None

    def start(self, capture: Capture) -> None:
        self.book = SeriesBook(capture, "server")

    def sample(self, t: float, *, final: bool = False) -> None:
        if self._given_up:
            return
        assert self.book is not None
        full = final or self.map is None or self.scrapes % HISTOGRAM_EVERY == 0
        try:
            asked = time.monotonic()
            text = self._fetcher.get()
            self._fetch_s = time.monotonic() - asked
            samples, report = parse_page(text, self._names if full else self._light, origin=self.url)
            if not samples and self.map is not None:
                samples = self._unmapped(text)
        except MetricsError as exc:
            self._failures += 1
            if self._failures >= MAX_FAILURES:
                self._given_up = True
                self.book.capture.notes.append(
                    f"The server's metrics endpoint stopped answering {t:.1f} s into the window "
                    f"({str(exc).rstrip('.')}); server signals cover the window until then.")
            return
        self._failures = 0
        self.pages += 1
        if report.skipped:
            self._skipped_lines = max(self._skipped_lines, report.skipped)
            self._first_bad = self._first_bad or report.first_bad
        if report.unread and not self._cut_note:
            self._cut_note = report.cut_note(f"The server's /metrics ({self.url})")
        if self.map is None:
            if not self._identify(samples):
                return
            assert self._names is not None
            samples = {n: v for n, v in samples.items() if n.startswith(self._names)}
            if not samples:
                self._unmapped_pages += 1
        if not samples:
            return  # the engine's page, but none of the names mapped: said at the end of the window
        assert self.map is not None
        samples = canonical(samples, self.map)
        self._note_backend(samples)
        # A final scrape right after a regular one only refreshes the histograms: no duplicate gauge points.
        just_sampled = final and self._last_sample_t is not None and t - self._last_sample_t <= 0.2
        self._record(t, samples, values=not just_sampled, histograms=full)
        self._last_sample_t = t
        self.scrapes += 1
        if self.kind == "llamacpp" and self._tasks_first is None and not final:
            last = llamacpp_last_task(self.url)
            if last is not None:
                self._tasks_first = (time.monotonic(), self.pages, last)

    def _note_backend(self, samples: Samples) -> None:
        prefixes = self.map.backend_prefixes if self.map is not None else ()
        if prefixes and not self._backend_seen:
            self._backend_seen = any(n.startswith(prefixes) for n in samples)

    def _unmapped(self, text: str) -> Samples:
        """A page with none of the mapped names: still this engine's page (an empty return, counted), or garbage
        or another program's page (MetricsError, counted as a failed scrape)."""
        assert self.map is not None
        everything = parse_samples(text, origin=self.url)
        if not any(n.startswith(self.map.prefixes) for n in everything):
            raise MetricsError(f"{self.url} returned none of the metrics it served before.")
        self._unmapped_pages += 1
        return {}

    def _identify(self, samples: Samples) -> bool:
        kind = detect_kind(samples)
        assert self.book is not None
        capture = self.book.capture
        if kind is None:
            capture.mark_unavailable(
                "server", "server.*", f"{self.url} serves Prometheus metrics, but none from vLLM, SGLang, TGI, "
                "Triton or NVIDIA NIM, nor llama.cpp", "point --metrics-url at the inference server's own /metrics")
            self._given_up = True
            return False
        self.kind, self.map = kind, SERVER_MAPS[kind]
        self._note_backend(samples)
        extra = (VLLM_LORA_INFO,) if kind in ("vllm", "demo") else ()
        self._names = self.map.names() + extra
        self._light = self.map.names(histograms=False) + extra
        if self.hint is not None and self.hint != kind:
            capture.notes.append(f"The target looked like {SERVER_MAPS[self.hint].label}, but its /metrics serves "
                                 f"{self.map.label} names: read as {self.map.label}.")
        if capture.server is not None:
            capture.server.kind = kind
        return True

    def _record(self, t: float, samples: Samples, *, values: bool, histograms: bool) -> None:
        assert self.book is not None and self.map is not None
        if histograms:
            self._record_histograms(samples)
            read_config(samples, self.map.kind, self.config)
        dt = None if self._prev_t is None else t - self._prev_t
        current: dict[str, float] = {}
        for signal, sources in self.map.signals.items():
            for src in sources:
                if self._source(signal, src, samples, t, dt, current, record=values):
                    self._present.add(signal)
                    if not isinstance(src, WindowRatio):
                        break
                    # a window ratio gives one value at the end; the next source is kept aside in case it gives none
                    for fallback in sources[sources.index(src) + 1:]:
                        if isinstance(fallback, Gauge) and values:
                            value = _total(samples, fallback.specs, mean=fallback.mean, positive=fallback.positive)
                            if value is not None:
                                self._shadow.setdefault(signal, []).append((t, value))
                            break
                    break
        if values:
            self._record_lora(t, samples)
            self._prev, self._prev_t = current, t

    def _source(self, signal: str, src: Source, samples: Samples, t: float, dt: float | None,
                current: dict[str, float], *, record: bool) -> bool:
        """Record one source's reading; False when the page does not have it (the next source is tried)."""
        assert self.book is not None
        if isinstance(src, WindowRatio):
            return self._track_window(signal, src, samples)
        if not record:
            return any(_select(samples, s) is not None for s in _spec_names(src))
        if isinstance(src, Gauge):
            return self._gauge(signal, src, samples, t)
        if isinstance(src, GaugeRatio):
            num, den = _total(samples, (src.num,)), _total(samples, (src.den,))
            if num is None or den is None:
                return False
            if den > 0:
                self.book.add(signal, t, num / den)
            return True
        if isinstance(src, Rate):
            return self._rate(signal, src, samples, t, dt, current)
        return self._step_ratio(signal, src, samples, t, current)

    def _gauge(self, signal: str, src: Gauge, samples: Samples, t: float) -> bool:
        assert self.book is not None
        if not any(_select(samples, s) is not None for s in src.specs):
            return False
        value = _total(samples, src.specs, mean=src.mean, positive=src.positive)
        if value is not None and src.percent_above_one and 1.0 < value <= 100.0:
            value /= 100.0  # a percent where the engine's other releases give a ratio
            if signal not in self._percent_noted:
                self._percent_noted.add(signal)
                self.book.capture.notes.append(f"{signal}: the page gives a percent (above 1), read as one.")
        if value is not None:
            self.book.add(signal, t, value)
        return True

    def _rate(self, signal: str, src: Rate, samples: Samples, t: float, dt: float | None,
              current: dict[str, float]) -> bool:
        assert self.book is not None
        value = _total(samples, src.specs)
        if value is None:
            return False
        current[signal] = value
        self._track(signal, t, value)
        before = self._prev.get(signal)
        if src.moving and value <= 0:
            return True  # the page has it, but nothing was ever counted: not a measurement of zero
        if before is not None and dt:
            if value < before:
                self.resets.add(signal)  # the server restarted its counters: this interval has no rate
            else:
                self.book.add(signal, t, (value - before) / dt)
        return True

    def _track(self, signal: str, t: float, value: float) -> None:
        """The counter's total at this scrape, kept for the window's rate (first and last scrape)."""
        assert self.book is not None
        track = self._tracks.get(signal)
        if track is None:
            track = self._tracks[signal] = CounterTrack(name=signal)
            self.book.capture.counters.append(track)
        if track.times and t <= track.times[-1]:
            return
        track.times.append(t)
        track.values.append(value)
        track.fetch_s.append(round(self._fetch_s, 6))

    def _step_ratio(self, signal: str, src: StepRatio, samples: Samples, t: float,
                    current: dict[str, float]) -> bool:
        """The ratio of two counters' increases over the interval (a hit rate, a mean per request)."""
        assert self.book is not None
        num, den = _total(samples, src.num), _total(samples, src.den)
        if num is None or den is None:
            return False
        current[signal + "#num"], current[signal + "#den"] = num, den
        if signal + "#num" in self._prev and signal + "#den" in self._prev:
            d_num, d_den = num - self._prev[signal + "#num"], den - self._prev[signal + "#den"]
            if d_den > 0 and d_num >= 0:
                self.book.add(signal, t, d_num / d_den)
        return True

    def _track_window(self, signal: str, src: WindowRatio, samples: Samples) -> bool:
        for i, (num_specs, den_specs) in enumerate(src.pairs):
            num, den = _sum_all(samples, num_specs), _sum_all(samples, den_specs)
            if num is None or den is None:
                continue
            state = self._window.get(signal)
            if state is None or state.pair != i:
                self._window[signal] = _Window(i, (num, den), (num, den))
            else:
                state.last = (num, den)
            return True
        return False

    def _record_lora(self, t: float, samples: Samples) -> None:
        assert self.book is not None
        state = _lora_state(samples)
        if state is None:
            return
        running, waiting, max_lora = state
        if not max_lora and not running and not waiting:
            return  # LoRA is not enabled (vLLM V0 exports the gauge with max_lora="0" regardless)
        self.book.add(S.SERVER_LORA_RUNNING_ADAPTERS, t, len(set(running)))
        self.book.add(S.SERVER_LORA_WAITING_ADAPTERS, t, len(set(waiting)))
        if len(self._lora_seen) < 4096:
            self._lora_seen.update(running + waiting)

    def _record_histograms(self, samples: Samples) -> None:
        assert self.map is not None
        for key, hist in self.map.histograms.items():
            found = _first_histogram(samples, hist)
            if found is not None:
                self._first_hist.setdefault(key, found)
                self._last_hist[key] = found
            summary = _summary(samples, hist.bases)
            if summary:
                self._summary_quantiles[key] = summary

    def stop(self, t: float) -> None:
        assert self.book is not None
        # A last scrape at the very end so counters and histograms cover the whole window.
        if not self._given_up:
            self.sample(t, final=True)
        self._fetcher.close()
        capture = self.book.capture
        if self._cut_note:
            capture.notes.append(self._cut_note)
        if self._skipped_lines:
            capture.notes.append(f"The server's /metrics had up to {self._skipped_lines} malformed line(s) per "
                                 f"scrape, skipped (first: {self._first_bad}).")
        if self.map is None:
            if not any(u.source == "server" for u in capture.unavailable):
                capture.mark_unavailable("server", "server.*", f"no scrape of {self.url} succeeded")
            return
        for key in self.map.histograms:
            self._histogram_signals(key, t)
        self._window_ratios(t)
        if self._lora_seen:
            self.config.lora_adapters_seen = len(self._lora_seen)
        self._write_config(capture)
        if self.kind == "llamacpp":
            self._llamacpp_refusals(t)
            big = sorted(name for name, track in self._tracks.items() if track.values and track.values[-1] >= 1e6)
            if big:  # llama-server writes each value through a C++ stream: %g, 6 significant digits
                capture.notes.append(f"llama.cpp prints its counters to 6 significant digits: {', '.join(big)} passed "
                                     "a million, so their rates are good to a millionth of the count per interval.")
        if self.resets:
            capture.notes.append("The server's counters went backwards during the window (restarted?): "
                                 f"{', '.join(sorted(self.resets))} skip those intervals.")
        if self.scrapes == 0 and self._unmapped_pages:
            capture.mark_unavailable(
                "server", "server.*", f"{self.url} serves {self.map.label} metrics, but none of the names diagnoser "
                f"reads from {self.map.label} (such as {', '.join(self.map.names(histograms=False)[:3])})",
                "a newer or older release may have renamed them: report the page's names to diagnoser")
        for signal in CORE_SIGNALS:
            if self.book.has(signal):
                continue
            why = self.map.absent.get(signal)
            if why is None and not self._backend_seen:
                why = self.map.absent_without_backend.get(signal)
            why = why or self._why_not_recorded(signal)
            capture.mark_unavailable("server", signal, why)

    def _llamacpp_refusals(self, t: float) -> None:
        """llama.cpp's /metrics counts no refused request (a prompt over a slot's context is answered 400 as a slot
        takes it), but every request takes a task id, which /slots shows as each slot's last task. Tasks taken over
        the window, less the ones this collector's own reads took (each /metrics and /slots read is a task too),
        with no prompt token processed and none generated, are requests refused: booked as the API's requests and
        4xx answers. Where any work was done the page cannot tell the refused from the served: nothing is booked."""
        assert self.book is not None
        if self._tasks_first is None:
            return
        last = llamacpp_last_task(self.url)
        if last is None:
            return
        began, pages, first = self._tasks_first
        own = (self.pages - pages) + 1  # the scrapes between the two /slots reads, and the first read itself
        requests = last - first - own
        worked = any(len(set(tr.values)) > 1 for name, tr in self._tracks.items()
                     if name in (S.SERVER_PROMPT_TOKENS_PER_S.name, S.SERVER_GEN_TOKENS_PER_S.name))
        seconds = time.monotonic() - began
        if worked or requests < 1 or seconds <= 0:
            return
        rate = requests / seconds
        self.book.add(S.SERVER_HTTP_REQUESTS_PER_S.name, t, rate)
        self.book.add(S.SERVER_HTTP_REJECTED_PER_S.name, t, rate)
        self.book.capture.notes.append(
            f"llama.cpp's slots took about {requests} tasks over {seconds:.1f} s beyond this tool's own reads, and "
            "not one prompt token was processed nor a token generated: each request was refused (llama.cpp "
            "answers HTTP 400 to a prompt longer than a slot's context, and its /metrics counts no refusal).")

    def _write_config(self, capture: Capture) -> None:
        """The page's serving configuration into Capture.serving (ServerConfig.apply), and the engine the page is."""
        capture.serving = self.config.apply(capture.serving)
        if self.kind is not None:
            capture.serving = msgspec.structs.replace(capture.serving, engine=self.kind)

    def _histogram_signals(self, key: str, t: float) -> None:
        assert self.book is not None and self.map is not None
        hist = self.map.histograms[key]
        first, last = self._first_hist.get(key), self._last_hist.get(key)
        notes = self.book.capture.notes
        cut = sum(1 for s in last[1].values() if s.cut) if last is not None else 0
        if cut:
            assert last is not None
            whole = len(last[1])
            which = "its only label set stops" if whole == 1 else \
                f"{cut} of its {whole} label sets stop" if cut < whole else f"all {whole} of its label sets stop"
            notes.append(f"{last[0]}: {which} before the le=\"+Inf\" bucket and the page has no _count to stand "
                         f"for it (a page cut short?): left out of the server.{key} quantiles.")
        if last is not None and (first is None or first[0] == last[0]):
            if self.scrapes < 2 and first is last:
                return  # one snapshot: no window to difference
            combined = window_histogram(first[1] if first is not None else None, last[1])
            for stat, q in (("p50", 0.5), ("p99", 0.99)):
                found = quantile_in_bucket(q, combined.buckets) if combined.buckets else None
                if found is not None:
                    quantile, low, high = (x * hist.scale for x in found)
                    # The bucket it was interpolated in, for `compare`: two values inside one bucket are not a change.
                    self.book.add(hist_signal(key, stat), t, quantile, labels=bucket_labels(low, high))
            if combined.count and combined.sum is not None and combined.count > 0:
                self.book.add(hist_signal(key, "mean"), t, combined.sum / combined.count * hist.scale)
            if combined.dropped_bounds:
                notes.append(f"{last[0]}: its label sets have different buckets; combined on the bounds they all "
                             f"have ({combined.dropped_bounds} bound(s) left out).")
            if combined.repaired:
                notes.append(f"{last[0]}: bucket counts fell as the bound rose; held at their running maximum, as "
                             "Prometheus does.")
            if combined.reset:
                notes.append(f"{last[0]}: a series went backwards (server restarted?); its totals since the "
                             "restart stand for the window.")
            if combined.buckets:
                return
        summary = self._summary_quantiles.get(key)
        if summary:
            for stat, q in (("p50", 0.5), ("p99", 0.99)):
                value = summary.get(q)
                if value is not None and not math.isnan(value):
                    self.book.add(hist_signal(key, stat), t, value * hist.scale)
            notes.append(f"server.{key} quantiles come from the server's own summary window, not from this "
                         "capture's window.")

    def _window_ratios(self, t: float) -> None:
        assert self.book is not None and self.map is not None
        for signal, state in self._window.items():
            src = next(s for s in self.map.signals[signal] if isinstance(s, WindowRatio))
            d_num, d_den = state.last[0] - state.first[0], state.last[1] - state.first[1]
            if d_num < 0 or d_den < 0:
                self.resets.add(signal)
            elif d_den > 0:
                self.book.add(signal, t, d_num / d_den * src.scale + src.plus)
                continue
            for when, value in self._shadow.get(signal, []):
                self.book.add(signal, when, value)

    def _why_not_recorded(self, signal: str) -> str:
        assert self.map is not None
        label = self.map.label
        for h in HIST_KEYS:
            if signal.startswith(f"server.{h.key}_") and h.key in ("ttft", "itl"):
                key = h.key
                if key in self.map.histograms and key in self._last_hist:
                    return f"no request of the {label} server reached that point during the window"
                bases = self.map.histograms[key].bases if key in self.map.histograms else ()
                return f"the {label} /metrics has no {' or '.join(bases) or 'such'} histogram"
        sources = self.map.signals.get(signal, ())
        names = [n for src in sources for n in _spec_names(src)]
        if not names:
            return f"the {label} server has no metric mapped to {signal}"
        if signal in self._present:
            if self.pages < 2:
                return "fewer than two scrapes succeeded, so no rate could be computed"
            if any(isinstance(s, StepRatio) for s in sources):
                return f"the {label} server ran no iteration during the window"
            return f"the {label} server reported no usable value for it during the window"
        if self.pages < 2 and any(isinstance(s, (Rate, StepRatio)) for s in sources):
            return "fewer than two scrapes succeeded, so no rate could be computed"
        return f"the {label} /metrics has no {' or '.join(dict.fromkeys(names))}"

    def latest(self) -> dict[str, float]:
        return dict(self.book.newest) if self.book else {}
