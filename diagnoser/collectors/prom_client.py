"""A client for the Prometheus HTTP query API, as Prometheus, Thanos Query, Mimir, Cortex and VictoriaMetrics serve it.

Every request is one bounded POST (collectors/http.py: one deadline for the whole answer, a size cap) whose answer
msgspec decodes; errors become one sentence (PromError, exit 3) that names the server and, when it sent one, its own
error text, also when it was sent with HTTP 200. Thanos' and Mimir's "partial response" warnings are kept in
`warnings`. Field answers are decoded straight into GPU keys and floats (KeyedSeries, `vector_values`): the dozen
other labels of each series are skipped without being built.

The URL is the API's base: `/api/v1/query` is appended. So Mimir is `http://mimir/prometheus`, a VictoriaMetrics
cluster `http://vmselect:8481/select/0/prometheus`; `headers` carries what those need (X-Scope-OrgID, a bearer
token), and `user:password@` in the URL becomes basic auth.
"""

from __future__ import annotations

import math
import threading
import urllib.parse
from array import array
from collections.abc import Mapping, Sequence

import msgspec

from diagnoser.collectors.dcgm import GpuKey
from diagnoser.collectors.http import MIB, FetchError, fetch
from diagnoser.errors import InputError, SourceUnavailable

# An answer bigger than this is refused: 100,000 GPUs' discovery (a dozen labels each) is about 60 MB.
DEFAULT_MAX_BYTES = 1024 * MIB


class PromError(SourceUnavailable):
    """A Prometheus query that failed; `kind` is unreachable, timeout, rejected, too_large, truncated or
    not_prometheus."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Labels(msgspec.Struct):
    """The labels that key a GPU; msgspec skips the others (a dozen per series) without building them."""

    UUID: str = ""
    uuid: str = ""
    GPU_I_ID: str = ""

    @property
    def key(self) -> GpuKey:
        return (self.UUID or self.uuid, self.GPU_I_ID)


class KeyedSeries(msgspec.Struct):
    """One series of a field query's answer: its GPU key's labels and its points as (time, value) floats.
    `value` is an instant query's single point."""

    metric: _Labels = msgspec.field(default_factory=_Labels)
    values: list[tuple[float, float]] = msgspec.field(default_factory=list)
    value: tuple[float, float] | None = None

    @property
    def points(self) -> list[tuple[float, float]]:
        return self.values if self.value is None else [self.value]

    @property
    def key(self) -> GpuKey:
        return self.metric.key

    @classmethod
    def from_dict(cls, series: dict) -> KeyedSeries:
        """From generically decoded JSON (the fallback when the typed decode refuses an answer)."""
        m = series.get("metric") or {}
        value = series.get("value")
        return cls(_Labels(m.get("UUID", ""), m.get("uuid", ""), m.get("GPU_I_ID", "")),
                   [(float(t), float(v)) for t, v in series.get("values") or ()],
                   (float(value[0]), float(value[1])) if value else None)


class _KeyedData(msgspec.Struct):
    resultType: str = ""
    result: list[KeyedSeries] = msgspec.field(default_factory=list)


class _KeyedAnswer(msgspec.Struct):
    status: str = ""
    data: _KeyedData | None = None
    warnings: list[str] = msgspec.field(default_factory=list)


class _Envelope(msgspec.Struct):
    """What every answer has, whatever its data: read when the typed decode refuses one."""

    status: str = ""
    errorType: str = ""
    error: str = ""
    warnings: list[str] = msgspec.field(default_factory=list)


# Typed and lax: values arrive as strings ("0.31") and become floats in C; labels other than the key are skipped.
_KEYED_DECODER = msgspec.json.Decoder(_KeyedAnswer, strict=False)
_ENVELOPE_DECODER = msgspec.json.Decoder(_Envelope)
_ANY_DECODER = msgspec.json.Decoder()


def _decode_json(content: bytes, keyed: bool = False) -> object:
    """An answer as a dict; with `keyed`, its series as KeyedSeries when the typed decode takes them."""
    if keyed:
        try:
            answer = _KEYED_DECODER.decode(content)
        except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
            pass  # "+Inf", an error body, another server: the generic decode below sees what it is
        else:
            if answer.status == "success" and answer.data is not None:
                return {"status": answer.status, "warnings": answer.warnings,
                        "data": {"resultType": answer.data.resultType, "result": answer.data.result}}
    try:
        return _ANY_DECODER.decode(content)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON: {exc}") from None


def vector_values(result: Sequence[KeyedSeries], index: Mapping[GpuKey, int], n: int,
                  unlisted: list[KeyedSeries] | None = None) -> array:
    """An instant vector as one float per GPU, in `index` order (NaN: no value). Several series of one GPU (pods
    sharing it) are averaged; series of GPUs not in the index are dropped (and put in `unlisted` when given)."""
    out = array("d", [math.nan]) * n
    seen = bytearray(n)  # answers grouped by key have one series per GPU; a count only for the odd duplicate
    get = index.get
    for series in result:
        m, point = series.metric, series.value
        i = get((m.UUID or m.uuid, m.GPU_I_ID))
        if i is None or point is None:
            if i is None and point is not None and unlisted is not None:
                unlisted.append(series)
            continue
        v = point[1]
        if v - v != 0.0:  # NaN or an infinity: no reading
            continue
        k = seen[i]
        out[i] = v if k == 0 else (out[i] * k + v) / (k + 1)
        seen[i] = min(k + 1, 255)
    return out


def _error_text(body: bytes) -> str:
    """Prometheus's own error text from an error answer, or a short plain-text reason (never an HTML page)."""
    try:
        env = _ENVELOPE_DECODER.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
        flat = " ".join(body.decode("utf-8", "replace").split())
        return "not a Prometheus query API" if not flat or flat.startswith("<") else flat[:200]
    detail = f"{env.errorType}: {env.error}".strip(": ")
    return " ".join(detail.split()) or "no error text"


def _looks_like_timeout(text: str) -> bool:
    low = text.lower()
    return "timeout" in low or "timed out" in low or "deadline exceeded" in low


def parse_headers(items: Sequence[str]) -> dict[str, str]:
    """--header 'Name: value' options as a dict; a malformed one is the user's to fix."""
    out: dict[str, str] = {}
    for item in items:
        name, sep, value = item.partition(":")
        name, value = name.strip(), value.strip()
        if not sep or not name or any(c in name for c in " \t\r\n") or any(c in value for c in "\r\n"):
            raise InputError(f"--header wants 'Name: value', not '{item}'.")
        out[name] = value
    return out


class PromClient:
    """Queries over bounded HTTP; safe to use from several threads at once (one connection per request)."""

    def __init__(self, url: str, *, timeout_s: float = 30.0, max_bytes: int = DEFAULT_MAX_BYTES,
                 headers: Mapping[str, str] | None = None) -> None:
        if not url.startswith(("http://", "https://")):
            raise InputError(f"--prometheus wants an http(s) URL such as http://prometheus:9090, not '{url}'.")
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.max_bytes = max_bytes
        self.headers = dict(headers or {})
        self.queries = 0
        self.warnings: list[str] = []
        self._lock = threading.Lock()
        self._exporter_checked = False

    # --- the API ------------------------------------------------------------------------------------------------

    def instant(self, query: str, at: float) -> list[dict]:
        return self._result(self._call("query", {"query": query, "time": f"{at:.3f}"}), keyed=False)

    def instant_points(self, query: str, at: float) -> list[KeyedSeries]:
        """An instant query decoded into GPU keys and floats: each series has one point (`value`)."""
        return self._result(self._call("query", {"query": query, "time": f"{at:.3f}"}), keyed=True)

    def range_points(self, query: str, start: float, end: float, step_s: float) -> list[KeyedSeries]:
        """A range query decoded into GPU keys and float points."""
        params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:.3f}"}
        return self._result(self._call("query_range", params), keyed=True)

    def label_values(self, label: str, start: float, end: float, match: str | None = None) -> list[str]:
        """The values a label takes in [start, end], among the series `match` selects when given (read from the
        index alone: no sample is decoded; an engine may answer for a somewhat longer span, a block or a day)."""
        params = {"start": f"{start:.3f}", "end": f"{end:.3f}"}
        if match is not None:
            params["match[]"] = match
        body = self._call(f"label/{urllib.parse.quote(label, safe='')}/values", params, method="GET")
        data = self._envelope(body).get("data")
        if not isinstance(data, list):
            raise PromError(f"{self.url} does not answer like a Prometheus server (no label values).",
                            "not_prometheus")
        return [str(v) for v in data]

    # --- one request --------------------------------------------------------------------------------------------

    def _call(self, endpoint: str, params: dict[str, str], method: str = "POST") -> bytes:
        """One bounded request to /api/v1/<endpoint>; any failure is a PromError of one sentence."""
        with self._lock:
            self.queries += 1
        params = {**params, "timeout": f"{max(1, int(self.timeout_s))}s"}
        encoded = urllib.parse.urlencode(params)
        url = f"{self.url}/api/v1/{endpoint}"
        headers = dict(self.headers)
        if method == "POST":
            headers["Content-Type"] = "application/x-www-form-urlencoded"
            data: bytes | None = encoded.encode()
        else:
            url, data = f"{url}?{encoded}", None
        try:
            return fetch(url, timeout_s=self.timeout_s, max_bytes=self.max_bytes, method=method, data=data,
                         headers=headers)
        except FetchError as exc:
            raise self._failure(exc) from None

    def _failure(self, exc: FetchError) -> PromError:
        if exc.kind == "timeout":
            return PromError(self._timeout_message(), "timeout")
        if exc.kind == "unreachable":
            return PromError(f"Prometheus at {self.url} is unreachable ({exc.reason}).", "unreachable")
        if exc.kind == "too_large":
            return PromError(f"Prometheus at {self.url} sent too much: {exc.reason} (narrow the window, or the GPUs "
                             "with --node/--pod).", "too_large")
        if exc.kind == "truncated":
            return PromError(f"Prometheus at {self.url} sent a truncated answer ({exc.reason}).", "truncated")
        if exc.kind == "bad_url":
            return PromError(f"--prometheus: {exc.reason}.", "unreachable")
        detail = _error_text(exc.body)
        if exc.status == 503 or _looks_like_timeout(detail):
            return PromError(f"Prometheus at {self.url} gave up on the query ({detail}).", "timeout")
        if exc.status in (400, 422):
            return PromError(f"Prometheus at {self.url} rejected the query: {detail}.", "rejected")
        return self._exporter_error() or PromError(f"Prometheus at {self.url} answered HTTP {exc.status}: {detail}.",
                                                   "not_prometheus")

    def _timeout_message(self) -> str:
        return (f"Prometheus at {self.url} did not answer within {self.timeout_s:g} s (raise --timeout or shorten "
                "the window).")

    def _exporter_error(self) -> PromError | None:
        """When the URL is a dcgm-exporter (its page holds DCGM_FI_* lines), the error says which command reads it."""
        if self._exporter_checked:
            return None
        self._exporter_checked = True
        for url in (self.url, self.url + "/metrics"):
            try:
                page = fetch(url, timeout_s=min(5.0, self.timeout_s), max_bytes=MIB)
            except FetchError as exc:
                page = exc.body
            if b"DCGM_FI_" in page or b"dcgm_fi_" in page:
                return PromError(f"{self.url} is a dcgm-exporter endpoint, not Prometheus: read that node live with "
                                 f"`diagnoser dcgm --dcgm-exporter {url}`, or give --prometheus the Prometheus that "
                                 "scrapes it.", "not_prometheus")
        return None

    def _envelope(self, body: bytes) -> dict:
        try:
            doc = _ANY_DECODER.decode(body)
        except (msgspec.DecodeError, UnicodeDecodeError):
            doc = None
        if not isinstance(doc, dict) or "status" not in doc:
            raise self._exporter_error() or PromError(f"{self.url} does not answer like a Prometheus server (no JSON "
                                                      "query API).", "not_prometheus")
        self._check(doc.get("status"), doc.get("errorType"), doc.get("error"), doc.get("warnings"))
        return doc

    def _check(self, status: object, error_type: object, error: object, warnings: object) -> None:
        if isinstance(warnings, list) and warnings:
            with self._lock:
                self.warnings.extend(str(w) for w in warnings if str(w) not in self.warnings)
        if status == "success":
            return
        detail = " ".join(f"{error_type or ''}: {error or ''}".strip(": ").split()) or "no error text"
        kind = "timeout" if _looks_like_timeout(detail) or error_type in ("timeout", "canceled") else "rejected"
        # Some proxies answer errors with HTTP 200: the server's own words, however it sent them.
        raise PromError(f"Prometheus at {self.url} answered with an error: {detail}.", kind)

    def _result(self, body: bytes, *, keyed: bool) -> list:
        if keyed:
            try:
                answer = _KEYED_DECODER.decode(body)
            except (msgspec.ValidationError, msgspec.DecodeError, UnicodeDecodeError):
                answer = None  # "+Inf", an error, another server: the generic decode sees what it is
            if answer is not None and answer.status == "success" and answer.data is not None:
                self._check("success", None, None, answer.warnings)
                return answer.data.result
        doc = self._envelope(body)
        data = doc.get("data")
        result = data.get("result") if isinstance(data, dict) else None
        if not isinstance(result, list):
            raise PromError(f"{self.url} returned no result list where Prometheus returns one.", "not_prometheus")
        if keyed:
            try:
                return [KeyedSeries.from_dict(s) for s in result]
            except (TypeError, ValueError, IndexError, AttributeError):
                raise PromError(f"{self.url} returned series Prometheus would not send.", "not_prometheus") from None
        return result


__all__ = ["DEFAULT_MAX_BYTES", "KeyedSeries", "PromClient", "PromError", "parse_headers", "vector_values"]
