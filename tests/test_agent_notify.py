"""Verdict-change log lines and the webhook: delivered to a real HTTP receiver, never stalling the sender, never
retried in a storm when the receiver is down or slow."""

from __future__ import annotations

import io
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from diagnoser.agent.notify import MAX_PENDING, EventLog, Webhook, is_change


class Receiver:
    """A local webhook endpoint that records POST bodies; `delay_s` makes it slow, `status` makes it fail."""

    def __init__(self, delay_s: float = 0.0, status: int = 200) -> None:
        self.bodies: list[dict] = []
        self.delay_s = delay_s
        self.status = status
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                time.sleep(outer.delay_s)
                outer.bodies.append(json.loads(body))
                self.send_response(outer.status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def wait_for(self, n: int, timeout: float = 30.0) -> list[dict]:
        deadline = time.monotonic() + timeout
        while len(self.bodies) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.bodies

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


def _wait(predicate: object, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


def test_what_counts_as_a_change() -> None:
    assert is_change("batching", "vram", include_inconclusive=False)
    assert not is_change("vram", "vram", include_inconclusive=True)
    assert not is_change(None, "vram", include_inconclusive=True)  # a first verdict is not a change
    assert not is_change("vram", "inconclusive", include_inconclusive=False)
    assert is_change("vram", "inconclusive", include_inconclusive=True)


def test_event_log_writes_one_json_object_per_line() -> None:
    stream = io.StringIO()
    log = EventLog(stream)
    log.emit("verdict_change", target="a", **{"from": "batching", "to": "vram"}, confidence=0.8)
    log.emit("run", target="b", status="ok")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 2
    first = json.loads(lines[0])
    assert first["event"] == "verdict_change" and first["from"] == "batching" and first["to"] == "vram"
    assert isinstance(first["ts"], float)


def test_webhook_delivers_a_batch(receiver: Receiver) -> None:
    hook = Webhook(receiver.url, 5.0, EventLog(io.StringIO()))
    try:
        hook.send([{"target": "a", "from": "batching", "to": "vram"}, {"target": "b", "from": "vram", "to": "idle"}])
        (body,) = receiver.wait_for(1)
        assert body["source"] == "diagnoser-agent" and [c["target"] for c in body["changes"]] == ["a", "b"]
        assert _wait(lambda: hook.sent == 1)
    finally:
        hook.close()


def test_dead_webhook_is_logged_and_counted_without_retries() -> None:
    with socket.socket() as s:  # a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stream = io.StringIO()
    errors: list[int] = []
    hook = Webhook(f"http://user:s3cret@127.0.0.1:{port}/hook?token=s3cret", 2.0, EventLog(stream),
                   on_error=lambda: errors.append(1))
    try:
        hook.send([{"target": "a", "from": "x", "to": "y"}])
        assert _wait(lambda: hook.failed == 1)
        time.sleep(0.3)
        assert hook.failed == 1 and len(errors) == 1  # no retry loop
        line = json.loads(stream.getvalue().splitlines()[0])
        assert line["event"] == "webhook_failed" and line["changes"] == 1
        assert line["url"] == f"http://127.0.0.1:{port}/hook" and "s3cret" not in stream.getvalue()
    finally:
        hook.close()


def test_slow_webhook_never_blocks_the_sender_and_batches_what_piles_up() -> None:
    slow = Receiver(delay_s=3.0)
    hook = Webhook(slow.url, 10.0, EventLog(io.StringIO()))
    try:
        hook.send([{"n": 0}])
        assert _wait(lambda: hook._pending == [])  # the first POST is in flight
        for n in range(1, 6):
            hook.send([{"n": n}])
        assert slow.bodies == []  # every send() returned while the first POST was still held by the receiver
        bodies = slow.wait_for(2)
        # The changes that arrived during the slow POST went out together in one more POST, not five.
        assert [c["n"] for c in bodies[0]["changes"]] == [0]
        assert [c["n"] for c in bodies[1]["changes"]] == [1, 2, 3, 4, 5]
        time.sleep(0.3)
        assert len(slow.bodies) == 2
    finally:
        hook.close(timeout_s=5)
        slow.close()


def test_pending_changes_are_bounded() -> None:
    slow = Receiver(delay_s=2.0)
    hook = Webhook(slow.url, 10.0, EventLog(io.StringIO()))
    try:
        hook.send([{"n": -1}])
        assert _wait(lambda: hook._pending == [])
        hook.send([{"n": n} for n in range(MAX_PENDING + 50)])
        assert hook.dropped == 50 and len(hook._pending) == MAX_PENDING
    finally:
        hook.close(timeout_s=0.1)
        slow.close()
