"""acquire_trace through a server's own profiler endpoints and Kineto's daemon mode.

vLLM and SGLang are not installable here (no GPU), so the endpoint tests run a real HTTP server process that
implements their profiler protocol as documented in shared/research/data-sources.md §4.5 (vLLM: endpoints only
with a profiler config, traces in --profiler-config.torch_profiler_dir; SGLang: always mounted, traces in the
request's output_dir) around a real torch model and a real torch.profiler.
"""

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
from diagnoser.tracing import acquire_trace
from diagnoser.tracing.endpoints import server_kind, vllm_profiler_dir

ROOT = Path(__file__).resolve().parents[1]

PROFILED_SERVER = r'''
import http.server, json, os, queue, sys, threading, time
from pathlib import Path
import torch
from torch.profiler import ProfilerActivity, profile
torch.set_num_threads(1)
kind, port_file = sys.argv[1], sys.argv[2]
profile_dir = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--profiler-config.torch_profiler_dir=")),
                   None)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)).eval()
commands = queue.Queue()  # like vLLM's RPC to its workers: the profiler runs where the model runs

class Handler(http.server.BaseHTTPRequestHandler):
    def _reply(self, code, body=b""):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if kind == "vllm" and profile_dir is None:
            return self._reply(404)  # vLLM mounts the router only with a profiler config
        if self.path not in ("/start_profile", "/stop_profile"):
            return self._reply(404)
        done = threading.Event()
        commands.put((self.path, json.loads(body) if body else {}, done))
        done.wait()
        return self._reply(200, b"Start profiling.\n" if self.path == "/start_profile" else b"Stop profiling.\n")

    def log_message(self, *args):
        pass

srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
Path(port_file).write_text(str(srv.server_address[1]))
prof, out_dir = None, None
while True:  # the engine loop on the main thread
    with torch.no_grad():
        model(torch.randn(8, 32))
    time.sleep(0.002)
    try:
        path, req, done = commands.get_nowait()
    except queue.Empty:
        continue
    if path == "/start_profile":
        out_dir = req.get("output_dir") or profile_dir
        prof = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
        prof.start()
    else:
        prof.stop()
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(Path(out_dir) / f"host_{os.getpid()}.pt.trace.json"))
    done.set()
'''


def _start(tmp: Path, script_name: str, *args: str) -> tuple[subprocess.Popen, str]:
    script = tmp / script_name
    script.write_text(PROFILED_SERVER)
    port_file = tmp / f"{script_name}.port"
    proc = subprocess.Popen([sys.executable, str(script), *args[:1], str(port_file), *args[1:]], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not (port_file.exists() and port_file.read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port_file.read_text()}"


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture
def vllm_like(tmp_path: Path) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    profile_dir = tmp_path / "vllm-profiles"
    proc, url = _start(tmp_path, "vllm_like_server.py", "vllm",
                       f"--profiler-config.torch_profiler_dir={profile_dir}")
    yield proc, url, profile_dir
    _stop(proc)


def test_vllm_endpoints_give_a_trace_copied_next_to_the_capture(vllm_like, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    proc, url, profile_dir = vllm_like
    assert server_kind(proc.pid) == "vllm"
    assert vllm_profiler_dir(proc.pid) == profile_dir
    path = acquire_trace(proc.pid, 0.5, tmp_path / "out", server_url=url)
    assert path.parent.parent == tmp_path / "out" and path.name.endswith(".pt.trace.json")
    a = analyze_trace(path)
    assert a.ops is not None and a.ops.by_op["aten::linear"]["count"] > 0


def test_vllm_without_profiler_config_says_how_to_enable_it(tmp_path: Path) -> None:
    proc, url = _start(tmp_path, "vllm_like_server.py", "vllm")
    try:
        with pytest.raises(SourceUnavailable, match="--profiler-config.profiler=torch"):
            acquire_trace(proc.pid, 0.5, tmp_path / "out", server_url=url)
        assert proc.poll() is None
    finally:
        _stop(proc)


def test_sglang_endpoints_write_into_the_requested_folder(tmp_path: Path) -> None:
    proc, url = _start(tmp_path, "sglang_like_server.py", "sglang")
    try:
        assert server_kind(proc.pid) == "sglang"
        path = acquire_trace(proc.pid, 0.5, tmp_path / "out", server_url=url)
        assert path.is_file() and path.parent.name.startswith("sglang-trace-")
        assert analyze_trace(path).ops is not None
    finally:
        _stop(proc)


def test_unreachable_url_then_no_hook(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(SourceUnavailable, match="cannot reach .*nor is process .* hooked"):
            acquire_trace(proc.pid, 0.5, tmp_path, server_url="http://127.0.0.1:9")
    finally:
        proc.kill()
        proc.wait()


def test_kineto_daemon_mode_without_dyno_says_what_to_install(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("PATH", str(tmp_path))  # no `dyno` here
    proc = subprocess.Popen(["/bin/sleep", "60"], env=dict(os.environ, KINETO_USE_DAEMON="1"))
    try:
        with pytest.raises(SourceUnavailable, match="KINETO_USE_DAEMON=1 but the `dyno` command is not on PATH"):
            acquire_trace(proc.pid, 0.5, tmp_path)
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait()


def test_server_answers_requests_while_the_endpoint_trace_runs(vllm_like, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    proc, url, _ = vllm_like
    errors: list[Exception] = []

    def probe() -> None:
        try:
            urllib.request.urlopen(urllib.request.Request(f"{url}/unknown", method="POST"), timeout=30)
        except urllib.error.HTTPError as exc:  # a 404 is an answer
            assert exc.code == 404
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=probe)
    t.start()
    acquire_trace(proc.pid, 0.3, tmp_path / "out", server_url=url)
    t.join(timeout=60)
    assert not errors and proc.poll() is None


FORKING_SERVER = r'''
import multiprocessing as mp, os, sys, time
from pathlib import Path
import torch
torch.set_num_threads(1)
import diagnoser.hook

def loop():
    model = torch.nn.Linear(32, 32)
    while True:
        with torch.no_grad():
            model(torch.randn(4, 32))
        time.sleep(0.005)

if __name__ == "__main__":
    worker = mp.get_context("fork").Process(target=loop, daemon=True)  # a GPU worker, in vLLM's terms
    worker.start()
    Path(sys.argv[1]).write_text(f"{os.getpid()} {worker.pid}")
    loop()
'''


def test_forked_worker_is_hooked_and_traced_with_its_parent(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from diagnoser.tracing.hook_client import find_hooked

    monkeypatch.setenv("DIAGNOSER_HOOK_DIR", str(tmp_path / "registry"))
    script = tmp_path / "forking.py"
    script.write_text(FORKING_SERVER)
    pids_file = tmp_path / "pids"
    # Its own process group: SIGKILL of the parent alone would leave the forked worker running (a daemon child is
    # only ended by the parent's exit handlers).
    proc = subprocess.Popen([sys.executable, str(script), str(pids_file)], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (pids_file.exists() and pids_file.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        parent, child = map(int, pids_file.read_text().split())
        while len(find_hooked(parent)) < 2:
            assert time.monotonic() < deadline, "the forked worker did not register"
            time.sleep(0.05)
        path = acquire_trace(parent, 0.5, tmp_path / "out")
        assert path.is_dir()  # one trace per process
        a = analyze_trace(path)
        assert len(a.ranks) == 2
        assert {int(r.path.name.split("-")[1]) for r in a.ranks} == {parent, child}
        assert all(r.ops is not None for r in a.ranks)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
