"""Telling people: one JSON line per event on stderr (journald and `kubectl logs` keep it), and an optional webhook.

A verdict change is logged as {"event": "verdict_change", "target": ..., "from": ..., "to": ...} (one line). The
webhook gets one POST per cycle with every change of that cycle, from a single sender thread: a slow or dead
endpoint never stalls the loop (the POST has a timeout), is never retried (the next change is the next try), and
changes that arrive while a POST is still in flight wait for the next one rather than piling up in memory. A
redirect is followed only to the configured scheme, host and port, and only one that keeps the POST (307/308);
any other is a failed POST, logged (`webhook_failed`, with where it pointed) and counted, never a silent loss.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Any, TextIO

from diagnoser import __version__
from diagnoser.diagnosis import Verdict

# Pending changes kept for the next POST while one is in flight; beyond this the oldest are dropped and counted.
MAX_PENDING = 256
# Redirects followed within the configured host (307/308 only); a loop of them is a failed POST.
MAX_REDIRECTS = 3


class EventLog:
    """Structured log lines: {"ts": ..., "event": ..., ...fields} as one JSON object per line."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> dict[str, Any]:
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        line = json.dumps(record, default=str, separators=(",", ":"))
        with self._lock:
            try:
                self.stream.write(line + "\n")
                self.stream.flush()
            except (OSError, ValueError):
                pass  # a closed or broken log stream must not end the agent
        return record


def is_change(previous: str | None, current: str | None, *, include_inconclusive: bool) -> bool:
    """A verdict change worth telling: both sides known and different; inconclusive only when asked for."""
    if previous is None or current is None or previous == current:
        return False
    return include_inconclusive or Verdict.INCONCLUSIVE not in (previous, current)


class Webhook:
    """POSTs batches of changes as JSON from one daemon thread."""

    def __init__(self, url: str, timeout_s: float, log: EventLog, on_error: Callable[[], None] | None = None) -> None:
        self.url = url
        self.timeout_s = timeout_s
        self.log = log
        self.on_error = on_error
        self._pending: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="diagnoser-webhook", daemon=True)
        self._thread.start()

    def send(self, changes: list[dict[str, Any]]) -> None:
        if not changes:
            return
        with self._lock:
            self._pending.extend(changes)
            overflow = len(self._pending) - MAX_PENDING
            if overflow > 0:
                del self._pending[:overflow]
                self.dropped += overflow
        self._wake.set()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the sender; a POST in flight gets `timeout_s` to finish (the daemon thread dies with the process)."""
        self._closed = True
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                batch, self._pending = self._pending, []
                self._wake.clear()
            if batch:
                self._post(batch)
                continue  # changes may have arrived (or close() been called) during the POST
            if self._closed:
                return

    def _post(self, batch: list[dict[str, Any]]) -> None:
        body = json.dumps({"source": "diagnoser-agent", "version": __version__, "changes": batch},
                          default=str).encode()
        url = self.url
        for _ in range(MAX_REDIRECTS + 1):
            request = urllib.request.Request(url, data=body, method="POST",
                                             headers={"Content-Type": "application/json", "User-Agent": "diagnoser"})
            try:
                with _OPENER.open(request, timeout=self.timeout_s) as response:
                    response.read(1 << 16)
                self.sent += 1
                return
            except urllib.error.HTTPError as exc:
                location = exc.headers.get("Location", "") if exc.headers else ""
                exc.close()
                if not 300 <= exc.code < 400:
                    self._failed(f"HTTP {exc.code} ({exc.reason})", len(batch))
                    return
                target = urllib.parse.urljoin(url, location)
                refused = _redirect_refusal(self.url, target, exc.code)
                if refused:
                    self._failed(refused, len(batch))
                    return
                url = target
            except urllib.error.URLError as exc:
                self._failed(str(getattr(exc.reason, "strerror", None) or exc.reason), len(batch))
                return
            except (OSError, ValueError) as exc:
                self._failed(str(exc) or type(exc).__name__, len(batch))
                return
        self._failed(f"more than {MAX_REDIRECTS} redirects", len(batch))

    def _failed(self, reason: str, n: int) -> None:
        self.failed += 1
        if self.on_error is not None:
            self.on_error()
        self.log.emit("webhook_failed", url=_safe_url(self.url), reason=reason, changes=n)


class _NoRedirects(urllib.request.HTTPRedirectHandler):
    """urllib follows 301/302/303 by itself, to any host, turning the POST into a GET: the changes (and any token
    in the URL's path) would go where the configured endpoint points. Here every 3xx reaches `_post`, which decides."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirects)


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urllib.parse.urlsplit(url)
    default = {"http": 80, "https": 443}.get(parts.scheme)
    try:
        port = parts.port or default
    except ValueError:
        port = None
    return parts.scheme, (parts.hostname or "").lower(), port


def _redirect_refusal(configured: str, target: str, code: int) -> str:
    """Why a redirect is not followed (empty when it is): only 307/308 (they keep the POST and its body) to the
    scheme, host and port of the configured URL."""
    where = _safe_url(target) or "nowhere"
    if _origin(target) != _origin(configured):
        return (f"redirected (HTTP {code}) to another host, {where}; not followed: changes are only posted to the "
                "configured host")
    if code not in (307, 308):
        return f"redirected (HTTP {code}) to {where}, which would turn the POST into a GET; not followed"
    return ""


def _safe_url(url: str) -> str:
    """The URL without credentials or query (webhook URLs often carry a token there) for the log."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, host, parts.path, "", ""))
