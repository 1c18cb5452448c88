"""diagnoser.hook on real running server processes: triggered twice, two valid traces, the server still serving;
a trigger during an open window is refused; processes without the hook are never signalled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch")

from diagnoser.errors import SourceUnavailable
from diagnoser.traces import analyze_trace
from diagnoser.tracing import acquire_trace, protocol
from diagnoser.tracing.acquire import acquire_trace_detailed
from diagnoser.tracing.hook_client import catches_signal, find_hooked

ROOT = Path(__file__).resolve().parents[1]

SERVER = r'''
import http.server, json, os, sys, threading
from pathlib import Path
import torch
torch.set_num_threads(1)
if os.environ.get("IMPORT_HOOK") == "1":
    import diagnoser.hook  # the one line a server adds
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).eval()

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with torch.no_grad():
            y = model(torch.randn(4, 64))
        body = json.dumps({"sum": float(y.sum())}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

server_class = http.server.ThreadingHTTPServer if os.environ.get("THREADED") == "1" else http.server.HTTPServer
srv = server_class(("127.0.0.1", 0), Handler)
Path(sys.argv[1]).write_text(str(srv.server_address[1]))
srv.serve_forever(poll_interval=0.05)
'''


def _wait_for(predicate, timeout: float, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Server:
    def __init__(self, tmp: Path, *, import_hook: bool = True, threaded: bool = False, launcher: bool = False) -> None:
        script = tmp / "server.py"
        script.write_text(SERVER)
        self.port_file = tmp / "port"
        env = dict(os.environ, IMPORT_HOOK="1" if import_hook else "0", THREADED="1" if threaded else "0",
                   DIAGNOSER_HOOK_DIR=str(tmp / "registry"))
        cmd = [sys.executable, str(script), str(self.port_file)]
        if launcher:
            cmd = [sys.executable, "-m", "diagnoser.hook", "--", *cmd]
        self.proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _wait_for(lambda: self.port_file.exists() and self.port_file.read_text() != "" or self.proc.poll() is not None,
                  120, "the server to listen")
        assert self.proc.poll() is None, self.proc.stderr.read().decode() if self.proc.stderr else ""
        self.port = int(self.port_file.read_text())
        self.served = 0
        self.failed = 0
        self._stop = threading.Event()
        self._load = threading.Thread(target=self._drive, daemon=True)

    def get(self) -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/", timeout=30) as resp:
            import json

            return json.loads(resp.read())

    def _drive(self) -> None:
        while not self._stop.is_set():
            try:
                self.get()
                self.served += 1
            except OSError:
                self.failed += 1

    def start_load(self) -> None:
        self._load.start()

    def stop(self) -> None:
        self._stop.set()
        if self._load.is_alive():
            self._load.join(timeout=30)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("DIAGNOSER_HOOK_DIR", str(tmp_path / "registry"))
    return tmp_path / "registry"


@pytest.fixture
def server(tmp_path: Path, registry: Path) -> Iterator[Server]:
    s = Server(tmp_path)
    yield s
    s.stop()


def test_hook_triggered_twice_gives_two_valid_traces_and_the_server_keeps_serving(server: Server,
                                                                                  tmp_path: Path) -> None:
    _wait_for(lambda: find_hooked(server.proc.pid), 30, "the hook to register")
    server.start_load()
    _wait_for(lambda: server.served > 5, 60, "requests to be served")
    out = tmp_path / "traces"
    paths = []
    for _ in range(2):
        before = server.served
        paths.append(acquire_trace(server.proc.pid, 1.0, out))
        assert server.served > before  # requests were answered during the window
    assert len(set(paths)) == 2 and all(p.parent == out for p in paths)
    for p in paths:
        a = analyze_trace(p)
        assert "live capture" in a.window_policy
        assert a.summary.window_s == pytest.approx(1.0, abs=0.5)
        assert a.ops is not None and "aten::linear" in a.ops.by_op  # the ops of the requests were recorded
    assert "sum" in server.get()  # still answering
    assert server.proc.poll() is None and server.failed == 0


def test_trigger_during_an_open_window_is_answered_busy(server: Server, tmp_path: Path) -> None:
    _wait_for(lambda: find_hooked(server.proc.pid), 30, "the hook to register")
    results: dict[str, object] = {}

    def long_trace() -> None:
        results["first"] = acquire_trace_detailed(server.proc.pid, 3.0, tmp_path / "a")

    t = threading.Thread(target=long_trace)
    t.start()
    registry = protocol.registry_dir()

    def window_open() -> bool:
        states = [protocol.read_json(p) for p in registry.glob("*.status.json")]
        return any(s and s.get("state") == "started" for s in states)

    _wait_for(window_open, 150, "the window to open")
    with pytest.raises(SourceUnavailable, match="already open"):
        acquire_trace(server.proc.pid, 0.5, tmp_path / "b")
    t.join(timeout=120)
    first = results["first"]
    assert first.path.exists() and first.method == "hook"  # type: ignore[attr-defined]
    assert set(first.pauses_ms()) == {server.proc.pid}  # type: ignore[attr-defined]
    assert server.get() and server.proc.poll() is None


def test_threaded_server_ops_are_recorded_from_handler_threads(tmp_path: Path, registry: Path) -> None:
    s = Server(tmp_path, threaded=True)
    try:
        _wait_for(lambda: find_hooked(s.proc.pid), 30, "the hook to register")
        s.start_load()
        _wait_for(lambda: s.served > 5, 60, "requests to be served")
        a = analyze_trace(acquire_trace(s.proc.pid, 1.0, tmp_path / "out"))
        # the handler threads are not the main thread that started the profiler
        assert a.ops is not None and a.ops.by_op["aten::linear"]["count"] > 0
        assert {r.tid for r in a.ops.runs} - {s.proc.pid}
    finally:
        s.stop()


def test_launcher_hooks_an_unchanged_server_under_the_same_pid(tmp_path: Path, registry: Path) -> None:
    s = Server(tmp_path, import_hook=False, launcher=True)
    try:
        _wait_for(lambda: find_hooked(s.proc.pid), 30, "the hook to register")
        hooked = find_hooked(s.proc.pid)
        assert [h.pid for h in hooked] == [s.proc.pid]  # exec kept the pid the shell printed
        s.start_load()
        _wait_for(lambda: s.served > 3, 60, "requests to be served")
        path = acquire_trace(s.proc.pid, 0.5, tmp_path / "out")
        assert analyze_trace(path).ops is not None
    finally:
        s.stop()


def test_a_process_without_the_hook_is_not_signalled(tmp_path: Path, registry: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(SourceUnavailable, match="python -m diagnoser.hook"):
            acquire_trace(proc.pid, 0.5, tmp_path)
        # A stale registration (the handler is not installed) must not lead to a signal that would kill it.
        protocol.ensure_registry_dir()
        protocol.write_json(protocol.registration_path(proc.pid), {"pid": proc.pid, "signal": 41,
                                                                   "start_ticks": None})
        assert not catches_signal(proc.pid, 41)
        assert find_hooked(proc.pid) == []
        with pytest.raises(SourceUnavailable):
            acquire_trace(proc.pid, 0.5, tmp_path)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_no_such_process(tmp_path: Path, registry: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    with pytest.raises(SourceUnavailable, match=f"no process {proc.pid}"):
        acquire_trace(proc.pid, 0.5, tmp_path)


def test_trace_command_prints_the_file_and_how_to_open_it(server: Server, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from diagnoser.cli.app import app

    _wait_for(lambda: find_hooked(server.proc.pid), 30, "the hook to register")
    result = CliRunner().invoke(app, ["trace", str(server.proc.pid), "--seconds", "0.5", "-o", str(tmp_path / "o")])
    assert result.exit_code == 0, result.output
    assert "Trace saved:" in result.output and "https://ui.perfetto.dev" in result.output
    assert "paused" in result.output  # the pause the profiler imposed on the server, measured
    assert "window" in result.output  # followed by the analysis


def test_trace_command_on_an_untraceable_process_exits_3_with_one_sentence(tmp_path: Path, registry: Path) -> None:
    from typer.testing import CliRunner

    from diagnoser.cli.app import app

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        result = CliRunner().invoke(app, ["trace", str(proc.pid), "--seconds", "0.5", "-o", str(tmp_path)])
        assert result.exit_code == 3
        lines = [line for line in result.output.splitlines() if line.startswith("diagnoser:")]
        assert len(lines) == 1 and "python -m diagnoser.hook" in lines[0]
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()
