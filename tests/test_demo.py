"""The demo: the server on its own, the load generator's bounds, and `diagnoser demo` end to end."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import urllib.error
import urllib.request

import psutil
import pytest

from diagnoser.capture import load
from diagnoser.demo.loadgen import check_loopback, run_load

PY = sys.executable
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def post(url: str, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_server_runs_on_its_own_serves_requests_and_stops_cleanly():
    proc = subprocess.Popen([PY, "-m", "diagnoser.demo.server", "--port", "0", "--max-len", "128"],
                            stdout=subprocess.PIPE, text=True, env=ENV)
    try:
        ready = proc.stdout.readline()
        found = re.search(r"ready on (http://127\.0\.0\.1:\d+) \(device (\w+)", ready)
        assert found, ready
        url = found.group(1)
        status, body = post(f"{url}/v1/completions", b'{"prompt": "hello there", "max_tokens": 5}')
        assert status == 200 and body["usage"] == {"prompt_tokens": 11, "completion_tokens": 5, "total_tokens": 16}
        assert len(body["choices"][0]["text"]) == 5
        status, body = post(f"{url}/v1/completions", b'{"prompt_tokens": 100, "max_tokens": 100}')
        assert status == 400 and "exceeds the model's context of 128" in body["error"]
        status, body = post(f"{url}/v1/completions", b"not json")
        assert status == 400
        with urllib.request.urlopen(f"{url}/health", timeout=10) as response:
            assert response.read() == b"ok\n"
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
        assert 'vllm:request_success_total{finished_reason="length",model_name="diagnoser-demo-tiny"} 1.0' in text
        assert "vllm:generation_tokens_total" in text and 'diagnoser_demo_info{' in text
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0
    assert "stopped after" in rest


def test_load_generator_only_targets_this_machine():
    assert check_loopback("http://127.0.0.1:8000") == ("127.0.0.1", 8000)
    assert check_loopback("http://localhost:9") == ("localhost", 9)
    for url in ("http://10.1.2.3:8000", "https://127.0.0.1:8000", "127.0.0.1:8000"):
        with pytest.raises(ValueError):
            run_load(url, duration_s=1)


def test_diagnoser_demo_end_to_end(tmp_path):
    out = tmp_path / "demo"
    result = subprocess.run([PY, "-m", "diagnoser", "demo", "--out", str(out), "--duration", "3"],
                            capture_output=True, text=True, timeout=170, env=ENV)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    meta = json.loads((out / "demo.json").read_text())
    # both children are gone: stopped and reaped by the demo
    for pid in (meta["server_pid"], meta["loadgen_pid"]):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert meta["load"]["requests"] > 0
    capture = load(out / "capture.dgc")
    diagnosis = json.loads((out / "diagnosis.json").read_text())
    assert capture.process.pid == meta["server_pid"] and capture.server.kind == "demo"
    assert capture.model is not None and capture.model.layers == 4
    assert {"server.kv_usage", "server.waiting", "host.target_cpu"} <= {s.name for s in capture.series}
    assert diagnosis["verdict_label"].lower() in result.stdout.lower()  # the verdict is printed
    if meta["device"] == "cpu":
        assert capture.cpu_only
        assert "What it cannot show" in result.stderr and "GPU busy time" in result.stderr
        assert any("CPU run" in note for note in diagnosis["notes"])
    assert f"capture {out / 'capture.dgc'}" in result.stderr
    if (out / "report.html").exists():
        assert "<html" in (out / "report.html").read_text()[:2000].lower()
