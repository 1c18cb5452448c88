"""SIGINT and SIGTERM to `attach`, `dcgm` and the agent, as real processes against real (light) servers: the window
ends, is saved and diagnosed; its saved length is the span of its samples; nothing committed is lost. Every wait polls
a state (scrapes served, rows committed, a run in flight); random points come from seeded generators."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from diagnoser.agent.history import HistoryStore
from diagnoser.capture import Capture, load
from diagnoser.errors import EXIT_TERMINATED

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
CLI = [sys.executable, "-m", "diagnoser"]
# The server is scraped a last time at the window's end, and that scrape is recorded unless one was taken in the
# 0.2 s before (server_metrics: no duplicate points): the window ends at most this long after its last sample.
FINAL_SCRAPE_S = 0.2 + 0.01


# --- helpers --------------------------------------------------------------------------------------------------------

def poll(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


class LightServer:
    """tests/light_server.py as a process: its PID, port and how many /metrics requests it has served."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.light_server", *args], cwd=REPO, env=ENV,
                                     stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line.startswith("ready "), f"the light server did not start: {line!r}"
        self.port = int(line.split()[1])
        self.pid = self.proc.pid
        self.url = f"http://127.0.0.1:{self.port}/metrics"

    def scrapes(self) -> int:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/stats", timeout=10) as r:
            return int(json.loads(r.read())["scrapes"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def light() -> Iterator[LightServer]:
    server = LightServer()
    yield server
    server.stop()


class Cli:
    """A diagnoser command in the background; its stderr lines collected as they come."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([*CLI, *args], cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line)

    def said(self, pattern: str) -> bool:
        return any(re.search(pattern, line) for line in list(self.err))

    def finish(self, timeout: float = 180) -> tuple[int, str, str]:
        assert self.proc.stdout is not None
        out = self.proc.stdout.read()
        rc = self.proc.wait(timeout)
        self._reader.join(10)
        return rc, out, "".join(self.err)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def last_sample(capture: Capture) -> float:
    return max(max(s.times) for s in capture.series if s.times)


def assert_window_is_its_samples(capture: Capture, slack_s: float) -> None:
    """The saved window length is the span of the samples: none after its end, and its end no later than the last
    sample plus `slack_s` (the final sample at the window's end, or one period of the slowest source)."""
    last = last_sample(capture)
    assert capture.duration_s > 0, capture.duration_s
    assert last <= capture.duration_s + 1e-3, (last, capture.duration_s)
    assert capture.duration_s - last <= slack_s, (last, capture.duration_s)


# --- attach ---------------------------------------------------------------------------------------------------------

def test_ctrl_c_five_seconds_into_a_30_s_window(light: LightServer, tmp_path: Path) -> None:
    saved, html = tmp_path / "run.dgc", tmp_path / "run.html"
    run = Cli("attach", str(light.pid), "--duration", "30", "--save", str(saved), "--html", str(html))
    try:
        poll(lambda: run.said("attaching to pid"), 120, "the window to start")
        # The server is scraped once a second, on the window's own grid (t = 0, 1, 2, ...): six scrapes after the
        # window started mean at least five seconds of it.
        base = light.scrapes()
        poll(lambda: light.scrapes() >= base + 6, 120, "six scrapes of the window")
        run.proc.send_signal(signal.SIGINT)
        rc, out, err = run.finish()
    finally:
        run.kill()
    assert rc == 0, err
    assert "Traceback" not in err
    capture = load(saved)
    assert 5.0 <= capture.duration_s < 30
    assert_window_is_its_samples(capture, slack_s=FINAL_SCRAPE_S)
    said = f"ended early by Ctrl-C after {capture.duration_s:.1f} s of the 30 s asked for"
    assert any(said in n for n in capture.notes), capture.notes
    assert said in " ".join(out.split())
    assert "longer window" not in out  # five seconds or more is long enough; 0.0 s was not
    assert html.is_file()


def test_sigterm_is_treated_like_ctrl_c_then_exits_143(light: LightServer, tmp_path: Path) -> None:
    saved = tmp_path / "run.dgc"
    run = Cli("attach", str(light.pid), "--duration", "60", "--save", str(saved), "--json")
    try:
        poll(lambda: run.said("attaching to pid"), 120, "the window to start")
        base = light.scrapes()
        poll(lambda: light.scrapes() >= base + 3, 120, "three scrapes of the window")
        run.proc.send_signal(signal.SIGTERM)
        rc, out, err = run.finish()
    finally:
        run.kill()
    assert rc == EXIT_TERMINATED, err
    assert "Traceback" not in err and "saved the capture" in err
    capture = load(saved)
    assert_window_is_its_samples(capture, slack_s=FINAL_SCRAPE_S)
    assert any(f"ended early by SIGTERM after {capture.duration_s:.1f} s" in n for n in capture.notes)
    assert json.loads(out)["verdict"]  # the diagnosis was printed before the exit


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigint_or_sigterm_at_a_random_point_of_attach(light: LightServer, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    signum = rng.choice([signal.SIGINT, signal.SIGTERM])
    scrapes, extra_s = rng.randint(0, 4), rng.uniform(0, 0.9)  # a random point, also between two scrapes
    saved = tmp_path / "run.dgc"
    run = Cli("attach", str(light.pid), "--duration", "60", "--interval", "0.05", "--save", str(saved))
    try:
        poll(lambda: run.said("attaching to pid"), 120, "the window to start")
        base = light.scrapes()
        poll(lambda: light.scrapes() >= base + scrapes, 120, f"{scrapes} scrapes of the window")
        time.sleep(extra_s)  # not a wait for readiness: the random point itself
        run.proc.send_signal(signum)
        rc, _, err = run.finish()
    finally:
        run.kill()
    assert rc == (EXIT_TERMINATED if signum == signal.SIGTERM else 0), err
    assert "Traceback" not in err
    capture = load(saved)
    assert_window_is_its_samples(capture, slack_s=FINAL_SCRAPE_S)
    how = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
    assert any(f"ended early by {how} after {capture.duration_s:.1f} s" in n for n in capture.notes)


def test_outputs_that_cannot_be_written_fail_before_the_window(light: LightServer, tmp_path: Path) -> None:
    cases = [
        (["--html", "/nonexistent-diagnoser/dir/x.html"],
         "--html /nonexistent-diagnoser/dir/x.html: the folder /nonexistent-diagnoser/dir does not exist"),
        (["--save", "/sys/diagnoser-x.dgc"], "--save /sys/diagnoser-x.dgc cannot be written"),
    ]
    for extra, sentence in cases:
        before = light.scrapes()
        result = subprocess.run([*CLI, "attach", str(light.pid), "--duration", "30", *extra], cwd=REPO, env=ENV,
                                capture_output=True, text=True, timeout=120, check=False)
        lines = [line for line in result.stderr.splitlines() if line.strip()]
        assert result.returncode == 2 and len(lines) == 1 and sentence in lines[0], (extra, result.stderr)
        assert light.scrapes() == before  # failed before anything was probed or sampled
    assert not Path("/nonexistent-diagnoser").exists()


# --- dcgm -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_sigint_or_sigterm_at_a_random_point_of_dcgm(tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    signum = rng.choice([signal.SIGINT, signal.SIGTERM])
    readings, extra_s = rng.randint(2, 6), rng.uniform(0, 0.4)
    exporter = LightServer("--page", "dcgm")
    saved = tmp_path / "dcgm.dgc"
    run = Cli("dcgm", "--dcgm-exporter", exporter.url, "--duration", "60", "--interval", "0.5", "--json",
              "--save", str(saved))
    try:
        poll(lambda: exporter.scrapes() >= readings, 120, f"{readings} readings")
        time.sleep(extra_s)  # the random point itself
        run.proc.send_signal(signum)
        rc, out, err = run.finish()
    finally:
        run.kill()
        exporter.stop()
    assert rc == (EXIT_TERMINATED if signum == signal.SIGTERM else 0), err
    assert "Traceback" not in err
    capture = load(saved)
    # Saved length = time read for (it was the planned 60 s), ending at most one reading after the last sample.
    assert_window_is_its_samples(capture, slack_s=0.5 + 1.0)
    assert capture.duration_s < 30
    how = "SIGTERM" if signum == signal.SIGTERM else "Ctrl-C"
    d = json.loads(out)
    assert any(f"Interrupted by {how} after {capture.duration_s:.1f} s of the planned 60 s" in n for n in d["notes"])


def test_dcgm_outputs_that_cannot_be_written_fail_before_the_window(tmp_path: Path) -> None:
    exporter = LightServer("--page", "dcgm")
    try:
        result = subprocess.run([*CLI, "dcgm", "--dcgm-exporter", exporter.url, "--duration", "30", "--html",
                                 "/nonexistent-diagnoser/x.html"], cwd=REPO, env=ENV, capture_output=True, text=True,
                                timeout=120, check=False)
        assert result.returncode == 2 and "does not exist" in result.stderr, result.stderr
        assert exporter.scrapes() == 0
    finally:
        exporter.stop()
    assert not Path("/nonexistent-diagnoser").exists()


# --- the agent ------------------------------------------------------------------------------------------------------

def _rows(db: Path) -> list[dict[str, Any]]:
    if not db.exists():
        return []
    with HistoryStore(db, create=False) as store:
        return [r.summary() for r in store.runs()]


def _report_folders(reports: Path) -> set[str]:
    return {str(p) for p in reports.glob("*/*") if p.is_dir() and not p.name.startswith(".")}


@pytest.mark.parametrize("seed", [1, 2])
def test_sigint_or_sigterm_at_a_random_point_of_the_agent(light: LightServer, tmp_path: Path, seed: int) -> None:
    rng = random.Random(seed)
    signum = rng.choice([signal.SIGINT, signal.SIGTERM])
    committed_first, extra_s = rng.randint(1, 2), rng.uniform(0, 1.5)
    db, reports = tmp_path / "history.db", tmp_path / "reports"
    agent = Cli("agent", "--every", "1s", "--jitter", "0", "--window", "3s", "--sample-interval", "0.25",
                "--targets", f"light=pid:{light.pid}", "--db", str(db), "--reports-dir", str(reports),
                "--metrics-port", "0", "--no-html")
    try:
        poll(lambda: len(_rows(db)) >= committed_first, 180, f"{committed_first} committed runs")
        # A run in flight: the signal lands mid-window (or, with extra_s, wherever that brings it).
        poll(lambda: list(tmp_path.glob(".agent-work-*/run-*/job.json")), 60, "a run in flight")
        time.sleep(extra_s)  # the random point itself
        committed = _rows(db)
        agent.proc.send_signal(signum)
        rc, _, err = agent.finish(timeout=60)
    finally:
        agent.kill()
    assert rc == 0, err
    assert "Traceback" not in err
    after = _rows(db)
    assert after[:len(committed)] == committed  # nothing committed was lost or changed
    with HistoryStore(db, create=False) as store:
        assert store.integrity_ok()
    for row in after:
        capture = load(Path(row["report_dir"]) / "capture.dgc")
        assert_window_is_its_samples(capture, slack_s=FINAL_SCRAPE_S)
    # Restarted, the agent finds every report folder named by a row (none left over by the stop).
    subprocess.run([*CLI, "agent", "--once", "--targets", f"light=pid:{light.pid}", "--window", "1s", "--db",
                    str(db), "--reports-dir", str(reports), "--no-html"], cwd=REPO, env=ENV, capture_output=True,
                   text=True, timeout=180, check=True)
    assert _report_folders(reports) == {r["report_dir"] for r in _rows(db)}


def test_kill_9_at_random_points_leaves_no_report_without_its_row(light: LightServer, tmp_path: Path) -> None:
    """A worker renames its report folder into place before the agent commits the run's row: an agent killed in
    between left a report the history did not know. The next start sweeps such folders."""
    rng = random.Random(7)
    db, reports = tmp_path / "history.db", tmp_path / "reports"
    orphans_seen = 0
    for round_ in range(3):
        agent = Cli("agent", "--every", "0.5s", "--jitter", "0", "--window", "0.5s", "--sample-interval", "0.25",
                    "--targets", f"light=pid:{light.pid}", "--db", str(db), "--reports-dir", str(reports),
                    "--metrics-port", "0", "--no-html")
        try:
            before = len(_rows(db))
            poll(lambda before=before: len(_rows(db)) > before, 180, "a committed run")
            time.sleep(rng.uniform(0, 1.0))  # the random point itself
            committed = _rows(db)
            agent.proc.send_signal(signal.SIGKILL)
            agent.proc.wait(30)
        finally:
            agent.kill()
        # The orphaned worker (SIGTERM from the kernel) may still rename its folder: wait until none is left.
        poll(lambda pid=agent.proc.pid: not _workers_alive(pid), 60, "the orphaned workers to exit")
        assert _rows(db)[:len(committed)] == committed
        orphans_seen += len(_report_folders(reports) - {r["report_dir"] for r in _rows(db)})
        del round_
    result = subprocess.run([*CLI, "agent", "--once", "--targets", f"light=pid:{light.pid}", "--window", "0.5s",
                             "--db", str(db), "--reports-dir", str(reports), "--no-html"], cwd=REPO, env=ENV,
                            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr
    assert _report_folders(reports) == {r["report_dir"] for r in _rows(db)}
    if orphans_seen:
        assert '"event":"reports_swept"' in result.stderr


def _workers_alive(agent_pid: int) -> bool:
    import psutil

    for p in psutil.process_iter(["cmdline", "environ", "status"]):
        if ("diagnoser.agent.worker" in " ".join(p.info["cmdline"] or [])
                and (p.info["environ"] or {}).get("DIAGNOSER_AGENT_PID") == str(agent_pid)
                and p.info["status"] != psutil.STATUS_ZOMBIE):
            return True
    return False
