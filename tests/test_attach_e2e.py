"""`diagnoser attach` end to end: a real demo server under real load, attached to through the CLI in a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import msgspec
import pytest

from diagnoser.capture import Capture, load
from diagnoser.rules import diagnose
from diagnoser.collectors.server_metrics import MetricsError, probe
from diagnoser.demo.loadgen import run_load

PY = sys.executable
CLI = [PY, "-m", "diagnoser"]


def start_server(*extra: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([PY, "-m", "diagnoser.demo.server", "--port", "0", *extra], stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline()
    found = re.search(r"ready on http://127\.0\.0\.1:(\d+)", line)
    assert found, f"the demo server did not start: {line!r}"
    return proc, int(found.group(1))


def wait_until(port: int, metric: str, at_least: float, timeout: float = 60.0) -> None:
    """Poll the server's own metrics until `metric` reaches `at_least` (readiness, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            _, samples = probe(f"http://127.0.0.1:{port}/metrics")
            if sum(v for _, v in samples.get(metric, [])) >= at_least:
                return
        except MetricsError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{metric} never reached {at_least} on the demo server")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[subprocess.Popen, int]]:
    """The demo server with a small KV cache under 16 closed-loop clients."""
    server, port = start_server("--kv-tokens", "1024")
    loadgen = subprocess.Popen([PY, "-m", "diagnoser.demo.loadgen", "--url", f"http://127.0.0.1:{port}",
                                "--concurrency", "16", "--duration", "600"], stdout=subprocess.DEVNULL)
    try:
        # steady state: the KV cache has filled and a queue has formed behind it
        wait_until(port, "vllm:num_preemptions_total", 1)
        wait_until(port, "vllm:num_requests_waiting", 4)
        yield server, port
    finally:
        stop(loadgen)
        stop(server)


def attach(*args: str, timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, "attach", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def names(capture: Capture) -> set[str]:
    return {s.name for s in capture.series if s.values}


def test_attach_by_pid_diagnoses_the_live_server_and_saves_the_capture(served, tmp_path):
    server, port = served
    saved = tmp_path / "window.dgc"
    started = time.monotonic()
    result = attach(str(server.pid), "--duration", "4", "--save", str(saved), "--json")
    elapsed = time.monotonic() - started
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    diagnosis = json.loads(result.stdout)
    capture = load(saved)
    assert capture.process is not None and capture.process.pid == server.pid
    assert capture.server is not None and capture.server.kind == "demo"
    assert capture.server.url == f"http://127.0.0.1:{port}/metrics"
    # the window ends at 4 s, give or take a scrape still in flight (2 s timeout) on a loaded machine
    assert 3.9 <= capture.duration_s <= 4.0 + 10.0, capture.duration_s
    assert {"host.target_cpu", "host.target_busiest_thread", "host.target_rss_bytes", "server.running",
            "server.waiting", "server.kv_usage", "server.gen_tokens_per_s", "server.ttft_p50_s"} <= names(capture)
    if capture.cpu_only:  # no GPU here: said in one line, and the verdict says what it rests on
        assert "no GPU visible" in result.stderr
        assert diagnosis["context"]["cpu_only"] is True
        assert any("CPU run" in n for n in diagnosis["notes"])
    # 16 clients against a 1024-token KV cache: the cache is full and requests queue; that is the verdict
    assert diagnosis["verdict"] == "vram", (diagnosis["headline"], diagnosis["findings"])
    assert "VRAM001" in [f["code"] for f in diagnosis["findings"]]
    assert diagnose(capture).verdict == diagnosis["verdict"]  # the saved capture gives the same verdict
    print(f"attach to verdict: {elapsed:.1f} s for a 4 s window")


def test_attach_by_port_finds_the_listening_process(served, tmp_path):
    server, port = served
    saved = tmp_path / "port.dgc"
    result = attach("--port", str(port), "--duration", "2", "--save", str(saved))
    assert result.returncode == 0, result.stderr
    assert "Verdict" in result.stdout or "VERDICT" in result.stdout
    capture = load(saved)
    assert capture.process.pid == server.pid and capture.server.kind == "demo"


def _wait_for_line(stream, pattern: str, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = stream.readline()
        if re.search(pattern, line):
            return line
        if not line:
            time.sleep(0.05)
    raise AssertionError(f"no line matching {pattern!r}")


def _let_it_sample(attach_proc: subprocess.Popen) -> None:
    """The window has started; let it run long enough to hold a few server scrapes (1 s apart)."""
    time.sleep(2.5)
    assert attach_proc.poll() is None


def test_ctrl_c_ends_the_window_early_and_still_diagnoses_and_saves(served, tmp_path):
    server, port = served
    saved = tmp_path / "interrupted.dgc"
    proc = subprocess.Popen([*CLI, "attach", str(server.pid), "--duration", "120", "--save", str(saved)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_line(proc.stderr, r"attaching to pid")
        _let_it_sample(proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "Traceback" not in err
    capture = load(saved)
    assert capture.duration_s < 120
    assert any("ended early by Ctrl-C" in n for n in capture.notes)
    assert "server.running" in names(capture)
    assert "ended early by Ctrl-C" in out


def test_target_exiting_mid_window_keeps_the_capture_and_says_so(tmp_path):
    release = tmp_path / "exit-now"
    target = subprocess.Popen([PY, "-c", "import pathlib, time\n"
                               f"while not pathlib.Path({str(release)!r}).exists(): time.sleep(0.05)"])
    saved = tmp_path / "exited.dgc"
    proc = subprocess.Popen([*CLI, "attach", str(target.pid), "--duration", "120", "--save", str(saved)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_line(proc.stderr, r"attaching to pid")
        _let_it_sample(proc)
        release.touch()
        target.wait(30)
        out, err = proc.communicate(timeout=60)
    finally:
        stop(target)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    capture = load(saved)
    assert capture.process.exited_at_s is not None and capture.duration_s < 120
    assert len(capture.series_named("host.target_rss_bytes")[0].values) >= 3
    assert f"pid {target.pid} exited" in err
    assert "diagnosis covers what was captured" in " ".join(out.split())


def test_attach_output_is_one_line_per_problem_on_stderr(served, tmp_path):
    """Nothing but short 'diagnoser: ...' lines on stderr when not on a terminal (no progress bar noise)."""
    server, _ = served
    # Python warnings from libraries are not diagnoser's output; everything diagnoser says must be one-liners.
    result = attach(str(server.pid), "--duration", "1", env={"PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines and all(line.startswith("diagnoser: ") for line in lines), lines


def test_trace_that_cannot_be_taken_is_recorded_and_the_verdict_still_comes(served, tmp_path):
    server, _ = served  # not started under the hook, no profiler endpoint, no Kineto daemon: untraceable
    saved = tmp_path / "untraced.dgc"
    result = attach(str(server.pid), "--duration", "1", "--trace", "1", "--save", str(saved), "--json")
    assert result.returncode == 0, result.stderr
    assert "diagnoser: no trace:" in result.stderr and "diagnoser.hook" in result.stderr
    capture = load(saved)
    assert capture.trace is None
    (reason,) = [u.reason for u in capture.unavailable if u.what == "trace.*"]
    assert "diagnoser.hook" in reason
    assert json.loads(result.stdout)["verdict"]


@pytest.mark.slow
def test_trace_of_a_hooked_server_is_analysed_into_the_capture(tmp_path):
    proc = subprocess.Popen([PY, "-m", "diagnoser.hook", "--", PY, "-m", "diagnoser.demo.server", "--port", "0"],
                            stdout=subprocess.PIPE, text=True)
    try:
        found = re.search(r"ready on http://127\.0\.0\.1:(\d+)", proc.stdout.readline())
        assert found
        saved = tmp_path / "traced.dgc"
        url = f"http://127.0.0.1:{found.group(1)}"
        load_stop = threading.Event()
        clients = threading.Thread(target=run_load, kwargs=dict(url=url, concurrency=4, duration_s=600.0,
                                                                 stop=load_stop), daemon=True)
        clients.start()  # tokens flow in the window and while tracing, so the trace's cost can be measured
        try:
            result = attach("--port", found.group(1), "--duration", "2", "--trace", "1", "--save", str(saved))
        finally:
            load_stop.set()
            clients.join(60)
        assert result.returncode == 0, result.stderr
        capture = load(saved)
        assert capture.trace is not None and capture.trace.window_s > 0
        assert not [u for u in capture.unavailable if u.source == "trace"]
        assert "Open it in Perfetto" in result.stderr
        spent = msgspec.to_builtins(capture.serving.trace_cost)
        assert spent["before"]["gen_tokens"] > 0 and spent["during"]["gen_tokens"] >= 0
        assert "gen_tokens" in spent["loss"] and spent["pauses_ms"]  # the hook reports its pauses
        assert "While tracing" in result.stderr and "generated tokens/s" in result.stderr
    finally:
        stop(proc)
