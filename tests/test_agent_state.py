"""The agent's state and what it tells: a private history store, no report folder without its history row, a webhook
that posts only to the host it was given (a notification lost to a redirect is reported), and a source that is down
or over-size is not an error of the whole run."""

from __future__ import annotations

import io
import json
import os
import stat
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from diagnoser.agent.config import build_config
from diagnoser.agent.history import OK, HistoryStore, RunRecord
from diagnoser.agent.loop import Agent, _tail
from diagnoser.agent.notify import MAX_REDIRECTS, EventLog, Webhook

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- state files ----------------------------------------------------------------------------------------------------

def test_history_store_and_its_log_files_are_private(tmp_path: Path) -> None:
    db = tmp_path / "state" / "history.db"
    os.umask(0o022)
    with HistoryStore(db) as store:
        store.add(RunRecord(target="a", started_at=1.0, finished_at=2.0, status=OK, verdict="idle"))
        for suffix in ("", "-wal", "-shm"):
            path = Path(str(db) + suffix)
            assert path.exists(), path
            assert _mode(path) == 0o600, (path, oct(_mode(path)))


def test_an_existing_readable_store_is_made_private(tmp_path: Path) -> None:
    db = tmp_path / "history.db"
    with HistoryStore(db):
        pass
    os.chmod(db, 0o644)
    with HistoryStore(db) as store:
        assert store.count() == 0
    assert _mode(db) == 0o600


# --- report folders and history rows ------------------------------------------------------------------------------

def _agent(tmp_path: Path, log: io.StringIO) -> Agent:
    cfg = build_config(None, {"history.db": str(tmp_path / "history.db"), "reports.dir": str(tmp_path / "reports"),
                              "metrics.port": 0, "targets": ["demo=pid:1"]})
    return Agent(cfg, log=EventLog(log))


def _run_folder(tmp_path: Path, stamp: str) -> Path:
    folder = tmp_path / "reports" / "demo" / stamp
    folder.mkdir(parents=True)
    (folder / "capture.dgc").write_bytes(b"x")
    return folder


def test_report_folders_without_a_history_row_are_swept_at_start(tmp_path: Path) -> None:
    _agent(tmp_path, io.StringIO()).close()  # an earlier start made the reports folder this history's
    kept = _run_folder(tmp_path, "20260101T000000Z")
    orphan = _run_folder(tmp_path, "20260101T000100Z")  # renamed into place, then the agent was killed
    partial = tmp_path / "reports" / "demo" / "notes"  # not a run folder: never touched
    partial.mkdir()
    with HistoryStore(tmp_path / "history.db") as store:
        store.add(RunRecord(target="demo", started_at=1.0, finished_at=2.0, status=OK, verdict="idle",
                            report_dir=str(kept)))
    log = io.StringIO()
    agent = _agent(tmp_path, log)
    agent.close()
    assert kept.is_dir() and partial.is_dir()
    assert not orphan.exists()
    swept = [json.loads(line) for line in log.getvalue().splitlines() if '"reports_swept"' in line]
    assert swept and swept[0]["folders"] == 1


def test_no_sweep_while_another_live_agent_shares_the_state_folder(tmp_path: Path) -> None:
    orphan = _run_folder(tmp_path, "20260101T000100Z")
    with HistoryStore(tmp_path / "history.db"):
        pass
    # Another agent (this test process: alive) has its scratch folder beside the history: its worker may have just
    # renamed this folder into place, its row not committed yet.
    (tmp_path / f".agent-work-{os.getpid()}-other").mkdir()
    agent = _agent(tmp_path, io.StringIO())
    agent.close()
    assert orphan.is_dir()


def test_the_tail_of_a_huge_worker_stderr_is_read_from_its_end(tmp_path: Path) -> None:
    err = tmp_path / "stderr"
    with open(err, "wb") as f:
        f.write(b"noise\n" * (8 << 20))  # 48 MiB of a runaway worker
        f.write(b"diagnoser: the last sentence.\n")
    assert _tail(err) == "diagnoser: the last sentence."


# --- the webhook and redirects --------------------------------------------------------------------------------------

class Hop:
    """An HTTP endpoint on `host` that records requests (method, path, body) and answers each path as told:
    (status, Location) or 200."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.requests: list[tuple[str, str, bytes]] = []
        self.redirects: dict[str, tuple[int, str]] = {}
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                outer.requests.append((self.command, self.path, self.rfile.read(length)))
                status, location = outer.redirects.get(self.path, (200, ""))
                self.send_response(status)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_GET = do_POST = _any

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.base = f"http://{host}:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _send_one(url: str) -> tuple[Webhook, list[dict[str, Any]], list[int]]:
    stream = io.StringIO()
    errors: list[int] = []
    hook = Webhook(url, 5.0, EventLog(stream), on_error=lambda: errors.append(1))
    hook.send([{"target": "a", "from": "idle", "to": "vram"}])
    deadline = time.monotonic() + 30
    while hook.sent + hook.failed == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    hook.close()
    return hook, [json.loads(line) for line in stream.getvalue().splitlines()], errors


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirect_to_another_host_is_not_followed_and_the_loss_is_reported(code: int) -> None:
    elsewhere = Hop("127.0.0.2")  # another host (the loopback net is all ours)
    hook_host = Hop()
    hook_host.redirects["/hook?token=s3cret"] = (code, f"{elsewhere.base}/collect")
    try:
        hook, log, errors = _send_one(f"{hook_host.base}/hook?token=s3cret")
    finally:
        elsewhere.close()
        hook_host.close()
    assert elsewhere.requests == []  # nothing reached the other host: neither the POST nor a GET
    assert hook.sent == 0 and hook.failed == 1 and errors == [1]
    (line,) = [e for e in log if e["event"] == "webhook_failed"]
    assert f"redirected (HTTP {code}) to another host, {elsewhere.base}/collect; not followed" in line["reason"]
    assert line["changes"] == 1 and "s3cret" not in json.dumps(log)


def test_a_redirect_within_the_host_that_keeps_the_post_is_followed() -> None:
    hop = Hop()
    hop.redirects["/old"] = (308, "/new")
    try:
        hook, log, _ = _send_one(f"{hop.base}/old")
    finally:
        hop.close()
    assert hook.sent == 1 and hook.failed == 0 and not log
    method, path, body = hop.requests[-1]
    assert (method, path) == ("POST", "/new") and json.loads(body)["changes"][0]["to"] == "vram"


def test_a_redirect_within_the_host_that_would_drop_the_body_or_loops_is_a_reported_failure() -> None:
    hop = Hop()
    hop.redirects["/get"] = (302, "/other")
    hop.redirects["/loop"] = (307, "/loop")
    try:
        hook, log, _ = _send_one(f"{hop.base}/get")
        assert hook.failed == 1 and "would turn the POST into a GET; not followed" in log[0]["reason"]
        hook, log, _ = _send_one(f"{hop.base}/loop")
        assert hook.failed == 1 and f"more than {MAX_REDIRECTS} redirects" in log[0]["reason"]
    finally:
        hop.close()
    assert not any(path == "/other" for _, path, _ in hop.requests)


# --- a source that is down or over-size ---------------------------------------------------------------------------

@pytest.mark.slow
def test_an_over_size_metrics_page_beside_a_process_is_not_an_error_of_the_run(tmp_path: Path) -> None:
    big = subprocess.Popen([sys.executable, "-m", "tests.light_server", "--page", "oversize"], cwd=REPO, env=ENV,
                           stdout=subprocess.PIPE, text=True)
    assert big.stdout is not None
    port = int(big.stdout.readline().split()[1])
    config = tmp_path / "agent.toml"
    config.write_text(f'[[targets]]\nname = "big"\npid = {big.pid}\n'
                      f'metrics_url = "http://127.0.0.1:{port}/metrics"\n')
    try:
        result = subprocess.run([sys.executable, "-m", "diagnoser", "agent", "--once", "--config", str(config),
                                 "--window", "1s", "--db", str(tmp_path / "h.db")], cwd=REPO, env=ENV,
                                capture_output=True, text=True, timeout=300, check=False)
    finally:
        big.kill()
        big.wait()
    assert result.returncode == 0, result.stderr
    with HistoryStore(tmp_path / "h.db", create=False) as store:
        (run,) = store.runs()
    assert run.status == OK, run.error
    assert any(p.startswith("server:") and "more than 32 MiB" in p for p in run.problems), run.problems
