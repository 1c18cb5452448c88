"""`diagnoser trace PID` against a server that exposes vLLM's profiler endpoints (a real process, tests.light_server
with vLLM's /start_profile and /stop_profile): the endpoints are found from its command line without --url, a
complete trace is picked up, and a server that dies while writing its trace is said to have died, first, with the
trace it left and the settings that make tracing that costly. On a real vLLM 0.32 with the default profiler settings,
the engine was killed in its post-processing and diagnoser said only 'stop_profile answered HTTP 500 ... start it
with python -m diagnoser.hook'."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}


def _server(tmp: Path, on_stop: str, *flags: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.light_server", "--profile-into", str(tmp),
                             "--on-stop", on_stop, "vllm", "serve", "m", *flags],
                            cwd=REPO, text=True, stdout=subprocess.PIPE, env=ENV, start_new_session=True)
    assert proc.stdout is not None
    assert proc.stdout.readline().startswith("ready")
    return proc


def _trace(pid: int, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "diagnoser", "trace", str(pid), "--seconds", "0.5", "-o", str(out),
                           "--no-analyze"], cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


def test_endpoints_found_from_the_command_line_without_url(tmp_path: Path) -> None:
    written = tmp_path / "profiles"
    written.mkdir()
    proc = _server(written, "ok", f"--profiler-config.torch_profiler_dir={written}",
                   "--profiler-config.torch_profiler_with_stack=false",
                   "--profiler-config.torch_profiler_dump_cuda_time_total=false")
    try:
        done = _trace(proc.pid, tmp_path / "out")
        assert done.returncode == 0, done.stderr
        assert "via endpoint" in done.stdout
        assert list((tmp_path / "out").rglob("worker_*.json*"))
    finally:
        _stop(proc)


def test_a_server_that_dies_while_writing_is_said_to_have_died_with_the_trace_it_left(tmp_path: Path) -> None:
    written = tmp_path / "profiles"
    written.mkdir()
    proc = _server(written, "die", f"--profiler-config.torch_profiler_dir={written}")  # stacks on by default
    try:
        done = _trace(proc.pid, tmp_path / "out")
        assert done.returncode == 3, done.stderr
        err = done.stderr.strip().splitlines()[-1]
        assert f"the server (process {proc.pid}) died" in err
        assert "torch_profiler_with_stack" in err and "torch_profiler_with_stack=false" in err
        assert str(written) in err and "diagnoser analyze" in err
        assert "diagnoser.hook" not in err and "Traceback" not in done.stderr
    finally:
        _stop(proc)


def test_doctor_names_the_costly_profiler_settings_and_the_light_ones(tmp_path: Path) -> None:
    from diagnoser.collectors.doctor import LIMITED, OK, profiler_settings

    heavy = _server(tmp_path, "ok", f"--profiler-config.torch_profiler_dir={tmp_path}")
    light = _server(tmp_path, "ok", f"--profiler-config.torch_profiler_dir={tmp_path}",
                    "--profiler-config.torch_profiler_with_stack=false",
                    "--profiler-config.torch_profiler_dump_cuda_time_total=false")
    try:
        check = profiler_settings([(heavy.pid, "vllm", ""), (light.pid, "vllm", "")])
        assert check.status == LIMITED and f"pid {heavy.pid} (torch_profiler_with_stack" in check.detail
        assert "torch_profiler_with_stack=false" in check.fix
        assert profiler_settings([(light.pid, "vllm", "")]).status == OK
    finally:
        _stop(heavy)
        _stop(light)


def test_endpoint_url_from_the_servers_own_port_flag_without_a_probe() -> None:
    """A real vLLM under load missed the port probe's 0.5 s deadline and `trace PID` was refused as if it had no
    endpoints: the server's own --host/--port name the URL."""
    from diagnoser.tracing.endpoints import profiler_url

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "vllm", "serve", "m", "--host",
                             "0.0.0.0", "--port", "45678", "--profiler-config.profiler=torch",
                             "--profiler-config.torch_profiler_dir=/tmp/x"], start_new_session=True)
    try:
        assert profiler_url(proc.pid) == "http://127.0.0.1:45678"  # nothing listens there: no probe was made
    finally:
        proc.kill()
        proc.wait()
