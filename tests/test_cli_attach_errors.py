"""Bad input to `diagnoser attach` (and `gpus`): one clear sentence on stderr, a non-zero exit, no traceback."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

CLI = [sys.executable, "-m", "diagnoser"]
# Library warnings (e.g. a torch import elsewhere) are not diagnoser's sentence; keep stderr to what diagnoser says.
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def run(*args: str, user: int | None = None) -> subprocess.CompletedProcess:
    prefix = [] if user is None else ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups"]
    return subprocess.run([*prefix, *CLI, *args], capture_output=True, text=True, timeout=120, env=ENV, cwd="/")


def one_sentence(result: subprocess.CompletedProcess, code: int, *fragments: str) -> str:
    assert result.returncode == code, (result.returncode, result.stderr)
    assert "Traceback" not in result.stderr and result.stdout == ""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    (line,) = lines
    assert line.startswith("diagnoser: ") and line.endswith("."), line
    for fragment in fragments:
        assert fragment in line, line
    return line


def _unused_pid() -> int:
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    return pid_max + 1  # above pid_max: no process can have it


def test_a_pid_that_does_not_exist():
    pid = _unused_pid()
    one_sentence(run("attach", str(pid), "--duration", "1"), 3, f"no process with PID {pid} is running")


def _nobody() -> int | None:
    try:
        return pwd.getpwnam("nobody").pw_uid
    except KeyError:
        return None


def _pid_of_another_user() -> int | None:
    """A process other than PID 1 (refused before its owner is looked at) that belongs to another user."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != "1":
            try:
                if entry.stat().st_uid != os.geteuid():
                    return int(entry.name)
            except OSError:
                continue
    return None


@pytest.mark.skipif(os.geteuid() != 0 and _pid_of_another_user() is None,
                    reason="needs root (to run as nobody) or a process of another user")
def test_a_pid_owned_by_another_user():
    if os.geteuid() == 0:
        uid = _nobody()
        if uid is None or shutil.which("setpriv") is None:
            pytest.skip("needs a 'nobody' user and setpriv to run as it")
        if run("--version", user=uid).returncode != 0:
            pytest.skip("the virtual environment is not executable by nobody here")
        # As nobody, attach to this test process, which belongs to root.
        result = run("attach", str(os.getpid()), "--duration", "1", user=uid)
        line = one_sentence(result, 3, f"process {os.getpid()}", "belongs to root", "diagnoser runs as")
    else:
        pid = _pid_of_another_user()
        assert pid is not None
        owner = pwd.getpwuid(os.stat(f"/proc/{pid}").st_uid).pw_name
        line = one_sentence(run("attach", str(pid), "--duration", "1"), 3, f"process {pid}", f"belongs to {owner}")
    assert "as root" in line


def test_pid_1_is_refused():
    # Its tree is every process: attach found some server's /metrics and reported it as PID 1's.
    line = one_sentence(run("attach", "1", "--duration", "1"), 2)
    assert line == ("diagnoser: PID 1 is the init process of this machine or container, not a server; give the "
                    "server's PID or --port.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_port_with_nothing_listening():
    port = _free_port()
    one_sentence(run("attach", "--port", str(port), "--duration", "1"), 3,
                 f"nothing is listening on TCP port {port}")


class _Garbage(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"<!doctype html><html><body><h1>It works!</h1></body></html>\n"
        self.send_response(200)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def garbage_url() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Garbage)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    httpd.shutdown()
    httpd.server_close()


def test_an_endpoint_that_returns_garbage(garbage_url):
    one_sentence(run("attach", "--metrics-url", garbage_url, "--duration", "1"), 3,
                 garbage_url, "did not return Prometheus metrics")


class _Redirect(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(302)
        self.send_header("Location", "http://127.0.0.1:9/x")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_an_endpoint_that_redirects_is_not_followed():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Redirect)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/metrics"
    try:
        one_sentence(run("attach", "--metrics-url", url, "--duration", "1"), 3,
                     f"{url} redirects to http://127.0.0.1:9/x; diagnoser does not follow redirects")
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_an_endpoint_that_does_not_answer():
    url = f"http://127.0.0.1:{_free_port()}/metrics"
    one_sentence(run("attach", str(os.getpid()), "--metrics-url", url, "--duration", "1"), 3,
                 f"nothing answers at {url}")


@pytest.mark.parametrize(("args", "fragment"), [
    ((), "say what to attach to"),
    (("--metrics-url", "ftp://example/metrics"), "must be an http(s) URL"),
    (("--port", "70000"), "is not a TCP port"),
    (("PID", "--duration", "0"), "--duration must be positive"),
    (("PID", "--interval", "0.001", "--duration", "1"), "--interval must be at least"),
    (("PID", "--fail-on", "slowness"), "--fail-on got unknown limiter"),
    (("PID", "--model", "/nonexistent/config.json"), "no config file at /nonexistent/config.json"),
])
def test_bad_options_are_input_errors(args, fragment):
    pid_args = tuple(str(os.getpid()) if a == "PID" else a for a in args)
    one_sentence(run("attach", *pid_args), 2, fragment)


@pytest.mark.skipif(Path("/proc/driver/nvidia").exists(), reason="this machine has an NVIDIA driver")
def test_gpus_without_a_gpu():
    one_sentence(run("gpus"), 3, "no GPU visible", "no NVIDIA driver")
