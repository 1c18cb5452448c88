"""Bounded reads on every HTTP path (collectors/http.py): servers that trickle, send too much, cut their body short, or
answer an error inside HTTP 200, against `dcgm`, `fleet` and the reader itself. Each ends in one sentence, within
the deadline, never a traceback or exit 70."""

from __future__ import annotations

import gzip
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from diagnoser.collectors.dcgm_exporter import ExporterScraper
from diagnoser.collectors.http import MIB, FetchError, fetch, lines, stream
from diagnoser.collectors.prom_client import PromClient, PromError
from diagnoser.errors import SourceUnavailable
from tests.prom_harness import REPO

GOOD_LINE = (b'DCGM_FI_PROF_GR_ENGINE_ACTIVE{gpu="0",UUID="GPU-0000aaaa-1111-2222-3333-444455556666",'
             b'modelName="NVIDIA H100 80GB HBM3",Hostname="n1"} 0.5\n')


def cli(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    started = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "diagnoser", *args], cwd=REPO, capture_output=True, text=True,
                       timeout=180, env=env)
    return r, time.monotonic() - started


def one_sentence(r: subprocess.CompletedProcess[str], code: int, *fragments: str) -> str:
    lines_ = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == code, (r.returncode, r.stderr)
    assert len(lines_) == 1 and "Traceback" not in r.stderr, r.stderr
    for fragment in fragments:
        assert fragment in lines_[0], (fragment, lines_[0])
    return lines_[0]


class RawServer:
    """A TCP server whose every connection is handled by `respond(conn)`: whatever bytes, at whatever pace."""

    def __init__(self, respond: Callable[[socket.socket], None]) -> None:
        self.respond = respond
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(32)
        self.port = self.sock.getsockname()[1]
        self.closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(30)
            request = b""
            while b"\r\n\r\n" not in request:
                piece = conn.recv(65536)
                if not piece:
                    return
                request += piece
            head, _, body = request.partition(b"\r\n\r\n")
            length = next((int(h.split(b":")[1]) for h in head.split(b"\r\n")
                           if h.lower().startswith(b"content-length")), 0)
            while len(body) < length:
                body += conn.recv(65536)
            self.respond(conn)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.closed.set()
        self.sock.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[socket.socket], None]], RawServer]]:
    servers: list[RawServer] = []

    def start(respond: Callable[[socket.socket], None]) -> RawServer:
        servers.append(RawServer(respond))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _trickle(conn: socket.socket) -> None:
    """Headers at once, then one line a second for a minute: each read is quick, the answer never ends."""
    conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nTransfer-Encoding: chunked\r\n\r\n")
    for _ in range(60):
        conn.sendall(b"%x\r\n%s\r\n" % (len(GOOD_LINE), GOOD_LINE))
        time.sleep(1)


def test_a_server_that_trickles_is_cut_off_at_the_deadline(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve(_trickle)
    r, took = cli("dcgm", "--dcgm-exporter", server.url + "/metrics", "--gpu", "0", "--timeout", "2", "--duration", "1")
    one_sentence(r, 3, "did not send its page within 2 s")
    assert took < 45  # bounded by the deadline (2 s), not by the minute the server would go on
    r, took = cli("fleet", "--prometheus", server.url, "--timeout", "2")
    one_sentence(r, 3, "did not answer within 2 s")
    assert took < 45


def test_the_reader_itself_keeps_one_deadline_for_the_whole_answer(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve(_trickle)
    started = time.monotonic()
    with pytest.raises(FetchError) as err:
        fetch(server.url, timeout_s=1.5, max_bytes=MIB)
    assert err.value.kind == "timeout" and time.monotonic() - started < 20


def _page(size: int) -> Callable[[socket.socket], None]:
    def respond(conn: socket.socket) -> None:
        block = GOOD_LINE * (1 * MIB // len(GOOD_LINE))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nConnection: close\r\n\r\n")
        sent = 0
        while sent < size:
            conn.sendall(block)
            sent += len(block)
    return respond


def test_an_exporter_page_over_the_cap_is_refused_while_it_streams(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve(_page(100 * MIB))  # no Content-Length: only counting tells
    r, _ = cli("dcgm", "--dcgm-exporter", server.url + "/metrics", "--gpu", "0", "--duration", "1")
    one_sentence(r, 3, "sent a page too large to be one node's exporter", "32 MiB cap")
    with pytest.raises(SourceUnavailable, match="too large"):
        ExporterScraper(server.url, 10, max_bytes=2 * MIB).scrape()


def test_a_page_under_the_cap_is_parsed_as_it_arrives(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve(_page(4 * MIB))
    scrape = ExporterScraper(server.url, 30).scrape()
    assert list(scrape.values.values()) == [{"gr_engine_active": 0.5}]  # 35,000 lines of one GPU, averaged


def _truncated(chunked: bool) -> Callable[[socket.socket], None]:
    def respond(conn: socket.socket) -> None:
        body = GOOD_LINE * 50
        if chunked:
            conn.sendall(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
            conn.sendall(b"%x\r\n%s" % (len(body), body[: len(body) // 2]))  # the chunk ends early, no last chunk
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body))
            conn.sendall(body[: len(body) // 2])
    return respond


@pytest.mark.parametrize("chunked", [False, True])
def test_a_truncated_exporter_page_is_one_sentence(serve, chunked) -> None:  # type: ignore[no-untyped-def]
    server = serve(_truncated(chunked))
    r, _ = cli("dcgm", "--dcgm-exporter", server.url + "/metrics", "--gpu", "0", "--duration", "1")
    one_sentence(r, 3, "sent a truncated page")


def _json_answer(body: bytes, status: str = "200 OK", encoding: str = "") -> Callable[[socket.socket], None]:
    def respond(conn: socket.socket) -> None:
        extra = f"Content-Encoding: {encoding}\r\n".encode() if encoding else b""
        conn.sendall(b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s"
                     % (status.encode(), len(body), extra, body))
    return respond


def test_an_error_sent_with_http_200_shows_the_servers_words(serve) -> None:  # type: ignore[no-untyped-def]
    body = b'{"status":"error","errorType":"execution","error":"query processing would load too many samples"}'
    server = serve(_json_answer(body))
    r, _ = cli("fleet", "--prometheus", server.url)
    one_sentence(r, 3, "answered with an error: execution: query processing would load too many samples")
    with pytest.raises(PromError) as err:
        PromClient(server.url).instant("up", time.time())
    assert err.value.kind == "rejected"


def test_gzip_answers_are_read_and_bombs_are_capped(serve) -> None:  # type: ignore[no-untyped-def]
    answer = (b'{"status":"success","data":{"resultType":"vector",'
              b'"result":[{"metric":{"UUID":"GPU-a"},"value":[1,"2"]}]}}')
    server = serve(_json_answer(gzip.compress(answer), encoding="gzip"))
    client = PromClient(server.url.replace("127.0.0.1", "localhost"))
    assert client.instant("up", time.time())[0]["metric"] == {"UUID": "GPU-a"}
    bomb = serve(_json_answer(gzip.compress(b" " * (64 * MIB)), encoding="gzip"))
    with pytest.raises(FetchError) as err:
        fetch(bomb.url, timeout_s=30, max_bytes=MIB)
    assert err.value.kind == "too_large"  # counted after inflating, not by the 64 KiB sent


def test_lines_split_across_chunks_and_keep_an_unterminated_last_line() -> None:
    assert list(lines([b"a\nb", b"c\n", b"", b"d"])) == [b"a", b"bc", b"d"]


def test_status_errors_keep_the_start_of_their_body(serve) -> None:  # type: ignore[no-untyped-def]
    server = serve(_json_answer(b'{"status":"error","errorType":"bad_data","error":"parse error"}', "400 Bad Request"))
    with pytest.raises(FetchError) as err, stream(server.url, timeout_s=10, max_bytes=MIB) as body:
        list(body)
    assert err.value.kind == "status" and err.value.status == 400 and b"parse error" in err.value.body
    with pytest.raises(PromError, match="rejected the query: bad_data: parse error"):
        PromClient(server.url).instant("up(", time.time())


def test_headers_and_basic_auth_reach_the_server(serve) -> None:  # type: ignore[no-untyped-def]
    seen: list[bytes] = []

    class Recording(RawServer):
        def _serve(self, conn: socket.socket) -> None:  # keep the request head
            conn.settimeout(30)
            request = b""
            while b"\r\n\r\n" not in request:
                piece = conn.recv(65536)
                if not piece:
                    break
                request += piece
            seen.append(request.split(b"\r\n\r\n")[0].lower())
            body = b'{"status":"success","data":["DCGM_FI_DEV_FB_USED"]}'
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
            conn.close()

    server = Recording(lambda conn: None)
    try:
        url = f"http://tenant:s3cret@127.0.0.1:{server.port}/prometheus"
        client = PromClient(url, headers={"X-Scope-OrgID": "team-a"})
        assert client.label_values("__name__", 0, 1) == ["DCGM_FI_DEV_FB_USED"]
    finally:
        server.close()
    head = seen[0]
    assert head.startswith(b"get /prometheus/api/v1/label/__name__/values?")
    assert b"x-scope-orgid: team-a" in head and b"authorization: basic dgvuyw50onmzy3jlda==" in head  # tenant:s3cret
