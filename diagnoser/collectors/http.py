"""Bounded HTTP reads for every collector that fetches over HTTP (Prometheus, dcgm-exporter, server /metrics).

Three bounds, whatever the server does:
- one deadline for the whole exchange (connect, headers and body): a server that sends its headers and then one
  line a second is cut off at the deadline, not after each read's timeout; a watchdog shuts the socket down at the
  deadline, so no read can outlive it;
- a size cap on the body (checked against Content-Length first, then counted while reading, after gzip);
- a body that ends before its Content-Length or last chunk is an error of its own (`truncated`), never a short
  answer read as if whole.

`fetch` returns the whole body; `stream` yields it in chunks (and `lines` splits them) so a parser can work while
the bytes arrive and hold only what it keeps. Errors are `FetchError` with a `kind` and a short reason; callers add
whose URL it was ("dcgm-exporter at ... is unreachable (connection refused).").

Usage from another collector (a server's /metrics, say):

    with stream(url, timeout_s=5, max_bytes=16 * MIB, headers={"Accept": "text/plain"}) as body:
        for line in lines(body):
            ...
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import socket
import ssl
import threading
import time
import urllib.parse
import zlib
from collections.abc import Iterable, Iterator, Mapping

MIB = 1024 * 1024
CHUNK = 256 * 1024
USER_AGENT = "diagnoser"
# A refused connection is retried this often, briefly (a restarting server); nothing else is retried.
CONNECT_RETRIES = 2
RETRY_PAUSE_S = 0.2


class FetchError(Exception):
    """An HTTP exchange that failed. kind: bad_url, unreachable, timeout, too_large, truncated, status.
    `status` and `body` (its first bytes) are set for kind == "status"."""

    def __init__(self, kind: str, reason: str, *, status: int = 0, body: bytes = b"") -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.status = status
        self.body = body


def human_bytes(n: float) -> str:
    if n >= MIB:
        return f"{n / MIB:.0f} MiB" if n >= 10 * MIB else f"{n / MIB:.1f} MiB"
    if n >= 1024:
        return f"{n / 1024:.0f} KiB"
    return f"{int(n)} bytes"


class _Exchange:
    """One request on its own connection, with the deadline's watchdog."""

    def __init__(self, url: str, timeout_s: float) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise FetchError("bad_url", f"'{url}' is not an http(s) URL")
        self.parts = parts
        self.timeout_s = timeout_s
        self.deadline = time.monotonic() + timeout_s
        self.conn: http.client.HTTPConnection | None = None
        self.timed_out = False
        self._timer: threading.Timer | None = None

    def remaining(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            self.timed_out = True
            raise FetchError("timeout", f"no complete answer within {self.timeout_s:g} s")
        return left

    def _watchdog(self) -> None:
        self.timed_out = True
        conn = self.conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def open(self, method: str, body: bytes | None, headers: Mapping[str, str]) -> http.client.HTTPResponse:
        parts = self.parts
        try:
            port = parts.port
        except ValueError:
            raise FetchError("bad_url", f"'{parts.geturl()}' has an invalid port") from None
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        sent = {"User-Agent": USER_AGENT, "Connection": "close", **headers}
        if parts.username is not None and "Authorization" not in sent:
            userinfo = f"{urllib.parse.unquote(parts.username)}:{urllib.parse.unquote(parts.password or '')}"
            sent["Authorization"] = "Basic " + base64.b64encode(userinfo.encode()).decode()
        self._timer = threading.Timer(self.timeout_s, self._watchdog)
        self._timer.daemon = True
        self._timer.start()
        for attempt in range(CONNECT_RETRIES + 1):
            if parts.scheme == "https":
                self.conn = http.client.HTTPSConnection(parts.hostname or "", port, timeout=self.remaining(),
                                                        context=ssl.create_default_context())
            else:
                self.conn = http.client.HTTPConnection(parts.hostname or "", port, timeout=self.remaining())
            try:
                self.conn.request(method, target, body=body, headers=sent)
                response = self.conn.getresponse()
                return response
            except ConnectionRefusedError:
                self.conn.close()
                if attempt == CONNECT_RETRIES or self.remaining() < RETRY_PAUSE_S * 2:
                    raise FetchError("unreachable", "connection refused") from None
                time.sleep(RETRY_PAUSE_S * (attempt + 1))
            except TimeoutError:
                raise self._timeout() from None
            except ssl.SSLError as exc:
                raise FetchError("unreachable", f"TLS failed: {exc.reason or exc}") from None
            except (OSError, http.client.HTTPException) as exc:
                if self.timed_out:
                    raise self._timeout() from None
                raise FetchError("unreachable", _reason(exc)) from None
        raise FetchError("unreachable", "connection refused")  # not reached: the loop returns or raises

    def _timeout(self) -> FetchError:
        self.timed_out = True
        return FetchError("timeout", f"no complete answer within {self.timeout_s:g} s")

    def chunks(self, response: http.client.HTTPResponse, max_bytes: int) -> Iterator[bytes]:
        """The body in pieces as they arrive, decompressed, within the deadline and the cap."""
        length = response.getheader("Content-Length")
        declared = int(length) if length and length.isdigit() else None
        gzipped = (response.getheader("Content-Encoding") or "").lower() == "gzip"
        if declared is not None and not gzipped and declared > max_bytes:
            raise FetchError("too_large", f"the answer is {human_bytes(declared)}, over the {human_bytes(max_bytes)} "
                             "cap")
        inflate = zlib.decompressobj(16 + zlib.MAX_WBITS) if gzipped else None
        received = 0
        total = 0
        while True:
            piece = self._read(response, received)
            if not piece:
                self._check_end(received, declared)
                break
            received += len(piece)
            if inflate is not None:
                try:
                    piece = inflate.decompress(piece, max_bytes + 1 - total)
                except zlib.error as exc:
                    raise FetchError("truncated", f"the gzip body is damaged ({exc})") from None
            total += len(piece)
            if total > max_bytes:
                raise FetchError("too_large", f"the answer is over the {human_bytes(max_bytes)} cap")
            if self.timed_out:
                raise self._timeout()
            if piece:
                yield piece
            self.remaining()
        if inflate is not None and not inflate.eof:
            raise FetchError("truncated", f"the gzip body ended early after {human_bytes(received)}")

    def _read(self, response: http.client.HTTPResponse, received: int) -> bytes:
        """The next piece of the body as it arrives (b"" at its end), within what is left of the deadline; a broken
        connection as truncated, after `received` bytes."""
        sock = self.conn.sock if self.conn is not None else None
        if sock is not None:
            sock.settimeout(self.remaining())
        try:
            return response.read1(CHUNK)
        except http.client.IncompleteRead as exc:
            got = received + len(exc.partial)
            expected = f" of {human_bytes(received + len(exc.partial) + exc.expected)}" if exc.expected else ""
            if self.timed_out:
                raise self._timeout() from None
            raise FetchError("truncated", f"the connection closed after {human_bytes(got)}{expected}") from None
        except TimeoutError:
            raise self._timeout() from None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if self.timed_out:
                raise self._timeout() from None
            raise FetchError("truncated", f"the answer broke off after {human_bytes(received)} "
                             f"({_reason(exc)})") from None

    def _check_end(self, received: int, declared: int | None) -> None:
        """At the body's end: the watchdog did not close it, and it is as long as its Content-Length said."""
        if self.timed_out:
            raise self._timeout()
        if declared is not None and received < declared:
            raise FetchError("truncated", f"the connection closed after {human_bytes(received)} of "
                             f"{human_bytes(declared)}")

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self.conn is not None:
            self.conn.close()


def _reason(exc: BaseException) -> str:
    if isinstance(exc, socket.gaierror):
        return "name not resolved"
    if isinstance(exc, ConnectionResetError):
        return "connection reset"
    if isinstance(exc, http.client.RemoteDisconnected):
        return "the server closed the connection without answering"
    if isinstance(exc, http.client.HTTPException):
        return f"not an HTTP answer ({type(exc).__name__})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    return str(exc) or type(exc).__name__


def _encoding_headers(url: str, headers: Mapping[str, str] | None) -> dict[str, str]:
    """Ask for gzip except on this machine's loopback, where compressing costs more CPU than it saves."""
    sent = dict(headers or {})
    host = urllib.parse.urlsplit(url).hostname or ""
    if "Accept-Encoding" not in sent and host not in ("localhost", "127.0.0.1", "::1"):
        sent["Accept-Encoding"] = "gzip"
    return sent


@contextlib.contextmanager
def stream(url: str, *, timeout_s: float, max_bytes: int, method: str = "GET", data: bytes | None = None,
           headers: Mapping[str, str] | None = None, error_body_bytes: int = 4096) -> Iterator[Iterator[bytes]]:
    """The body of a 2xx answer as an iterator of chunks; any other status raises FetchError("status") with the
    first `error_body_bytes` of its body."""
    exchange = _Exchange(url, timeout_s)
    try:
        response = exchange.open(method, data, _encoding_headers(url, headers))
        if not 200 <= response.status < 300:
            body = bytearray()
            with contextlib.suppress(FetchError):
                for piece in exchange.chunks(response, max(error_body_bytes, 1)):
                    body += piece
                    if len(body) >= error_body_bytes:
                        break
            raise FetchError("status", f"HTTP {response.status} {response.reason}".strip(), status=response.status,
                             body=bytes(body[:error_body_bytes]))
        yield exchange.chunks(response, max_bytes)
    finally:
        exchange.close()


def fetch(url: str, *, timeout_s: float, max_bytes: int, method: str = "GET", data: bytes | None = None,
          headers: Mapping[str, str] | None = None) -> bytes:
    """The whole body of a 2xx answer, bounded like `stream`."""
    with stream(url, timeout_s=timeout_s, max_bytes=max_bytes, method=method, data=data, headers=headers) as body:
        parts = list(body)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Split chunks into lines (without the newline). A last line without its newline is yielded too; callers that
    care (text formats end every line) can tell by `ends_with_newline`."""
    rest = b""
    for piece in chunks:
        if rest:
            piece = rest + piece
        parts = piece.split(b"\n")
        rest = parts.pop()
        yield from parts
    if rest:
        yield rest


__all__ = ["MIB", "FetchError", "fetch", "human_bytes", "lines", "stream"]
