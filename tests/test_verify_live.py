"""`diagnoser verify`: the loop closed live. A real server (the demo's, with vLLM-named metrics) is diagnosed, the
first fix applied by restarting it on the same port with other flags while the load runs on, and the command waits
for it, measures the same window and prints what compare prints."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from diagnoser.cli.verify import changed, wait_for_change
from diagnoser.collectors.target import AttachTarget
from diagnoser.errors import SourceUnavailable
from tests.engines.load import Load

PY = sys.executable
ENV = {**os.environ, "PYTHONWARNINGS": "ignore"}


def _target(pid: int, cmdline: list[str], url: str = "http://127.0.0.1:1/metrics") -> AttachTarget:
    return AttachTarget(pid=pid, port=1, metrics_url=url, cmdline=cmdline)


def test_waits_through_the_restart_for_a_changed_process() -> None:
    before = _target(10, ["srv", "--max-num-seqs", "2"])
    answers: list[AttachTarget | Exception] = [SourceUnavailable("nothing listens"), _target(10, before.cmdline),
                                               _target(11, ["srv", "--max-num-seqs", "8"], url=""),
                                               _target(11, ["srv", "--max-num-seqs", "8"])]
    said: list[str] = []

    def resolve(port: int) -> AttachTarget:
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    now = wait_for_change(before, 1, 60.0, said.append, resolve, poll_s=0.0)
    assert now.pid == 11 and not answers
    assert any("down (restarting?)" in s for s in said) and any("unchanged" in s for s in said)
    assert any("metrics not answering yet" in s for s in said) and "pid 10 -> 11" in said[-1]
    assert changed(before, _target(10, ["srv", "--max-num-seqs", "4"])) == "its command line changed"


def test_gives_up_after_the_wait_in_one_sentence() -> None:
    before = _target(10, ["srv"])
    with pytest.raises(SourceUnavailable, match="did not come back with a change within 0.05 s"):
        wait_for_change(before, 1, 0.05, lambda _: None, lambda _: before, poll_s=0.01)
    with pytest.raises(SourceUnavailable, match="stopped before"):
        wait_for_change(before, 1, 60.0, lambda _: None, lambda _: before, poll_s=0.01, stopped=lambda: True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _demo(port: int, seqs: int) -> subprocess.Popen[str]:
    proc = subprocess.Popen([PY, "-m", "diagnoser.demo.server", "--port", str(port), "--max-num-seqs", str(seqs),
                             "--max-len", "256", "--kv-tokens", "4096"], stdout=subprocess.PIPE, text=True, env=ENV)
    assert proc.stdout is not None
    ready = proc.stdout.readline()
    assert re.search(r"ready on http://127\.0\.0\.1:\d+", ready), ready
    return proc


def _stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.mark.slow
def test_verify_grades_the_fix_applied_by_a_restart(tmp_path: Path) -> None:
    """Written before the run: the demo server with --max-num-seqs 2 under 8 closed-loop clients is pinned at its
    limit (BAT005, batching); the fix raises --max-num-seqs. Restarted with 8 on the same port, verify sees the new
    process, names the changed knob, credits the batch fix, and prints the realised gain."""
    port = _free_port()
    first = _demo(port, 2)
    second: subprocess.Popen[str] | None = None
    load = Load(port=port, model="diagnoser-demo-tiny", clients=8, prompt_words=16, max_tokens=24, seconds=600)
    verify: subprocess.Popen[str] | None = None
    try:
        load.start()
        time.sleep(3.0)  # the batch and queue reach their steady state
        verify = subprocess.Popen([PY, "-m", "diagnoser", "verify", "--port", str(port), "--duration", "5",
                                   "--settle", "3", "--wait", "300", "--save-dir", str(tmp_path), "--json"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
        said: list[str] = []
        waiting = threading.Event()

        def read_stderr() -> None:
            assert verify is not None and verify.stderr is not None
            for line in verify.stderr:
                said.append(line)
                if "waiting up to" in line:
                    waiting.set()

        reader = threading.Thread(target=read_stderr, daemon=True)
        reader.start()
        assert waiting.wait(300), "".join(said)
        assert any("first fix" in s and "--max-num-seqs" in s for s in said), "".join(said)
        _stop(first)
        second = _demo(port, 8)
        # stdout read by its own thread: communicate() would also drain stderr and steal lines from the reader
        out_parts: list[str] = []
        out_reader = threading.Thread(target=lambda: out_parts.append(verify.stdout.read()  # type: ignore[union-attr]
                                                                      ), daemon=True)
        out_reader.start()
        verify.wait(timeout=400)
        out_reader.join(30)
        reader.join(30)
        out = "".join(out_parts)
        assert verify.returncode in (0, 1), "".join(said)
        result = json.loads(out)
        (ch,) = [c for c in result["changes"] if c["what"] == "serving.max_num_seqs"]
        assert (ch["before"], ch["after"], ch["fix"]) == ("2", "8", "batch_more"), result["changes"]
        (p,) = [p for p in result["predictions"] if p["kind"] == "batch_more"]
        assert p["applied"] and p["realised"] is not None, p
        assert (tmp_path / "before.dgc").exists() and (tmp_path / "after.dgc").exists()
        assert any("is back: pid" in s for s in said), "".join(said)
    finally:
        load.stop()
        if verify is not None and verify.poll() is None:
            verify.kill()
        _stop(first)
        if second is not None:
            _stop(second)
