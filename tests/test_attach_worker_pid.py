"""Attaching by the PID a GPU host shows (a serving engine's worker or engine core) finds the /metrics its parent
serves, without probing ports that do not speak HTTP, within a bounded time. A real vLLM's worker made `attach` probe
its ZMQ and gloo ports over HTTP at 2 s each: 37.7 s for a 5 s window, and no server signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from diagnoser.collectors.target import DISCOVERY_DEADLINE_S, listening_ports, resolve_target

REPO = Path(__file__).resolve().parents[1]


def _start() -> tuple[subprocess.Popen[str], int, int]:
    proc = subprocess.Popen([sys.executable, "-m", "tests.light_server", "--worker", "vllm", "serve", "m"], cwd=REPO,
                            text=True,
                            stdout=subprocess.PIPE, start_new_session=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    worker = int(proc.stdout.readline().split()[1])
    port = int(proc.stdout.readline().split()[1])
    deadline = time.monotonic() + 60
    while len(listening_ports(worker)) < 3 and time.monotonic() < deadline:  # the worker's three listeners
        time.sleep(0.1)
    return proc, worker, port


def test_worker_pid_finds_the_parents_metrics_without_probing_its_silent_ports() -> None:
    proc, worker, port = _start()
    try:
        assert len(listening_ports(worker)) == 3
        t0 = time.monotonic()
        target = resolve_target(pid=worker)
        took = time.monotonic() - t0
        assert target.metrics_url == f"http://127.0.0.1:{port}/metrics", target.metrics_problem
        assert target.pid == proc.pid and target.rerooted_from == worker
        assert f"the server of pid {worker}" in target.description
        assert psutil.Process(worker).ppid() == target.pid  # the observed tree holds the named worker
        # Generous for a loaded machine; what matters is no per-port fetch timeout on the silent ports.
        assert took < DISCOVERY_DEADLINE_S + 5
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_process_with_only_silent_ports_says_so_within_the_deadline() -> None:
    proc, worker, _ = _start()
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # the parent's HTTP server stops answering: nothing serves HTTP
        t0 = time.monotonic()
        target = resolve_target(pid=worker)
        assert target.metrics_url is None and "answers HTTP" in target.metrics_problem
        assert time.monotonic() - t0 < DISCOVERY_DEADLINE_S + 5
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def test_a_parent_that_is_no_server_is_not_climbed_into() -> None:
    """A process that listens nowhere under a test runner or a shell: its parent's tree holds unrelated servers, so
    nothing above it is tried (the climb once re-rooted a target onto pytest, whose tree held another test's server,
    and the window never saw its target exit)."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.light_server", "--worker"], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, start_new_session=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout is not None
    worker = int(proc.stdout.readline().split()[1])
    proc.stdout.readline()
    try:
        target = resolve_target(pid=worker)
        assert target.pid == worker and target.metrics_url is None and target.rerooted_from is None
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
