"""The agent end to end against real local targets: demo servers under real load, the agent as a real process
(one-shot and loop), history rows, metrics scraped over HTTP from its endpoint, the webhook on a verdict change,
and SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from diagnoser.agent.history import OK, HistoryStore, RunRecord
from diagnoser.agent.metrics import VERDICTS
from diagnoser.capture import load as load_capture
from tests.test_agent_notify import Receiver

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1"}


# --- real targets -------------------------------------------------------------------------------------------------

class DemoServer:
    """`python -m diagnoser.demo.server` on a free port; a small KV budget so real load fills it."""

    def __init__(self, *, kv_tokens: int = 512, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diagnoser.demo.server", "--port", "0", "--kv-tokens", str(kv_tokens)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**ENV, **(env or {})})
        line = _readline(self.proc, timeout=90)
        if "ready on http://" not in line:
            self.stop()
            raise RuntimeError(f"demo server did not start: {line!r}")
        self.port = int(line.split("ready on http://", 1)[1].split()[0].rsplit(":", 1)[1])
        self.url = f"http://127.0.0.1:{self.port}"
        # Drain its output so a full pipe never blocks it.
        threading.Thread(target=lambda: self.proc.stdout and self.proc.stdout.read(), daemon=True).start()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Load:
    """The demo's own closed-loop load generator, until stopped."""

    def __init__(self, url: str, concurrency: int = 16) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "diagnoser.demo.loadgen", "--url", url, "--concurrency", str(concurrency),
             "--duration", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=ENV)

    def wait_busy(self, server: DemoServer, timeout: float = 90.0) -> None:
        """Until the server queues requests with its KV cache over half full (the load has really arrived)."""
        def busy() -> bool:
            samples = scrape_url(f"{server.url}/metrics")
            kv = metric(samples, "vllm:kv_cache_usage_perc") or 0.0
            return kv >= 0.5 and (metric(samples, "vllm:num_requests_waiting") or 0.0) >= 1

        wait_until(busy, timeout, "the demo server to be under load")

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    box: list[str] = []
    t = threading.Thread(target=lambda: box.append(proc.stdout.readline() if proc.stdout else ""), daemon=True)
    t.start()
    t.join(timeout)
    return box[0] if box else ""


@pytest.fixture(scope="module")
def demo() -> Iterator[DemoServer]:
    """One demo server for the module (it takes seconds to start); each test stops the load it starts."""
    server = DemoServer()
    yield server
    server.stop()


# The demo's KV budget is tiny, but on a busy 2-core machine its p90 use may stay just under the default 0.9 that
# makes VRAM001 fire; the agent's rule thresholds are configurable, and the tests use that.
THRESHOLDS = "[thresholds.VRAM001]\nkv_usage_p90 = 0.5\n"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# --- the agent as a process -----------------------------------------------------------------------------------------

def agent_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "diagnoser", "agent", *args]


class AgentProcess:
    """`diagnoser agent` in the background, its JSON log lines collected as they come."""

    def __init__(self, *args: str, sigint_ignored: bool = False) -> None:
        # As a shell starts a script's background job: SIGINT ignored, which exec keeps.
        ignore = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if sigint_ignored else None
        self.proc = subprocess.Popen(agent_cmd(*args), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=ENV, preexec_fn=ignore)
        self.events: list[dict[str, Any]] = []
        self.raw: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.raw.append(line)
            try:
                self.events.append(json.loads(line))
            except ValueError:
                pass

    def named(self, event: str) -> list[dict[str, Any]]:
        return [e for e in list(self.events) if e.get("event") == event]

    def terminate(self, timeout: float = 20.0) -> int:
        self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout)
        self._reader.join(5)
        return rc

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def wait_until(predicate: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return scrape_url(f"http://127.0.0.1:{port}/metrics")


def scrape_url(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
    except (urllib.error.URLError, OSError):
        return {}
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float | None:
    for (n, labs), value in samples.items():
        if n == name and all(dict(labs).get(k) == v for k, v in labels.items()):
            return value
    return None


def rows(db: Path, target: str | None = None) -> list[RunRecord]:
    if not db.exists():
        return []
    with HistoryStore(db, create=False) as store:
        return store.runs(target=target, with_diagnosis=True)


# --- the tests ------------------------------------------------------------------------------------------------------

def test_once_under_load_stores_history_report_and_textfile(demo: DemoServer, tmp_path: Path) -> None:
    db, textfile = tmp_path / "state" / "history.db", tmp_path / "textfile" / "diagnoser.prom"
    rules = tmp_path / "rules.toml"
    rules.write_text(THRESHOLDS)
    load = Load(demo.url)
    try:
        load.wait_busy(demo)
        result = subprocess.run(agent_cmd("--once", "--targets", f"demo={demo.port}", "--window", "3s",
                                          "--db", str(db), "--textfile", str(textfile), "--rules-config", str(rules)),
                                capture_output=True, text=True, env=ENV, timeout=180)
    finally:
        load.stop()
    assert result.returncode == 0, result.stderr
    (run,) = rows(db)
    assert run.status == OK and run.verdict in VERDICTS and run.target == "demo"
    assert result.stdout.startswith(f"demo: {run.verdict} (")
    # Under real load the server's own metrics were read: a KV cache this small is full.
    assert run.diagnosis is not None and run.diagnosis["context"]["server"] == "demo"
    assert run.verdict == "vram", run.headline
    # The run's report folder: the capture is the ground truth, and diagnosing it again gives the same verdict.
    folder = Path(run.report_dir)
    assert folder.parent == db.parent / "reports" / "demo"
    assert sorted(p.name for p in folder.iterdir()) == ["capture.dgc", "diagnosis.json", "report.html"]
    assert json.loads((folder / "diagnosis.json").read_text())["verdict"] == run.verdict
    again = subprocess.run([sys.executable, "-m", "diagnoser", "diagnose", str(folder / "capture.dgc"), "--json",
                            "--rules-config", str(rules)],
                           capture_output=True, text=True, env=ENV, timeout=120)
    assert json.loads(again.stdout)["verdict"] == run.verdict
    assert load_capture(folder / "capture.dgc").process is not None
    # The textfile, for node_exporter.
    samples = {}
    for family in text_string_to_metric_families(textfile.read_text()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    assert metric(samples, "diagnoser_verdict", target="demo", limiter=run.verdict) == 1.0
    assert metric(samples, "diagnoser_last_run_ok", target="demo") == 1.0
    # One structured line per run on stderr.
    lines = [json.loads(l) for l in result.stderr.splitlines() if l.startswith("{")]
    runs = [l for l in lines if l["event"] != "progress"]  # --once also tells each stage as it goes
    assert [l["event"] for l in runs] == ["run"] and runs[0]["verdict"] == run.verdict


def test_loop_serves_metrics_keeps_history_and_stops_on_sigterm(demo: DemoServer, tmp_path: Path) -> None:
    db, port = tmp_path / "history.db", free_port()
    agent = AgentProcess("--every", "1s", "--jitter", "0", "--window", "1s", "--targets", f"demo={demo.port}",
                         "--db", str(db), "--metrics-port", str(port), "--keep-reports", "2")
    try:
        # A cycle is counted when it ends, after its runs: wait for both counters.
        wait_until(lambda: (metric(scrape(port), "diagnoser_runs_total", target="demo") or 0) >= 3
                   and (metric(scrape(port), "diagnoser_agent_cycles_total") or 0) >= 3, 120,
                   "three runs and three cycles counted on the metrics endpoint")
        samples = scrape(port)
        assert metric(samples, "diagnoser_last_run_ok", target="demo") == 1.0
        assert sum(metric(samples, "diagnoser_verdict", target="demo", limiter=v) or 0 for v in VERDICTS) == 1.0
        assert (metric(samples, "diagnoser_agent_cycles_total") or 0) >= 3
        assert (metric(samples, "diagnoser_last_run_timestamp_seconds", target="demo") or 0) > time.time() - 120
        # Only loopback: the endpoint is not on the machine's other addresses.
        assert agent.named("metrics_serving")[0]["url"] == f"http://127.0.0.1:{port}/metrics"
        stopped_at = time.monotonic()
        assert agent.terminate() == 0
        assert time.monotonic() - stopped_at < 15
    finally:
        agent.kill()
    assert agent.named("agent_stopped"), agent.raw[-5:]
    history = rows(db, "demo")
    assert len(history) >= 3 and all(r.status == OK for r in history)
    # Reports rotate: two kept, however many runs.
    assert len(list((db.parent / "reports" / "demo").iterdir())) == 2
    # No scratch files left behind.
    assert not list(db.parent.glob(".agent-work-*"))
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()


def test_an_agent_started_with_sigint_ignored_keeps_running_through_ctrl_c(demo: DemoServer, tmp_path: Path) -> None:
    # `diagnoser agent &` in a start-up script: the shell ignores SIGINT in its background jobs, so a Ctrl-C meant for
    # the script's foreground must not stop the agent. SIGTERM still does.
    db, port = tmp_path / "history.db", free_port()
    agent = AgentProcess("--every", "1s", "--jitter", "0", "--window", "1s", "--targets", f"demo={demo.port}",
                         "--db", str(db), "--metrics-port", str(port), sigint_ignored=True)
    try:
        cycles = lambda: metric(scrape(port), "diagnoser_agent_cycles_total") or 0  # noqa: E731
        wait_until(lambda: cycles() >= 1, 120, "a first cycle counted on the metrics endpoint")
        agent.proc.send_signal(signal.SIGINT)
        seen = cycles()
        wait_until(lambda: cycles() >= seen + 2, 120, "two more cycles after the Ctrl-C")
        assert agent.proc.poll() is None and not agent.named("agent_stopped")
        assert agent.terminate() == 0
    finally:
        agent.kill()
    assert agent.named("agent_stopped"), agent.raw[-5:]


def test_sigterm_mid_window_keeps_what_was_captured(demo: DemoServer, tmp_path: Path) -> None:
    db = tmp_path / "history.db"
    agent = AgentProcess("--every", "1h", "--jitter", "0", "--window", "120s", "--targets", f"demo={demo.port}",
                         "--db", str(db), "--metrics-port", "0")
    try:
        wait_until(lambda: list(db.parent.glob(".agent-work-*/run-*/job.json")), 60, "a run to start")
        time.sleep(3)  # into the window
        stopped_at = time.monotonic()
        assert agent.terminate() == 0
        took = time.monotonic() - stopped_at
    finally:
        agent.kill()
    assert took < 15, f"SIGTERM took {took:.1f} s"
    (run,) = rows(db, "demo")
    assert run.status == OK, run.error
    capture = load_capture(Path(run.report_dir) / "capture.dgc")
    assert 0 < capture.duration_s < 60
    assert any("ended early" in n for n in capture.notes)


def test_verdict_change_is_logged_once_and_posted(demo: DemoServer, tmp_path: Path) -> None:
    receiver = Receiver()
    server = demo
    db = tmp_path / "history.db"
    config = tmp_path / "agent.toml"
    config.write_text(f'[notify]\nwebhook = "{receiver.url}"\nnotify_inconclusive = true\n'
                      f'[[targets]]\nname = "demo"\nport = {server.port}\n' + THRESHOLDS)
    args = ("--once", "--config", str(config), "--window", "3s", "--db", str(db))
    try:
        load = Load(server.url)
        try:
            load.wait_busy(server)
            busy = subprocess.run(agent_cmd(*args), capture_output=True, text=True, env=ENV, timeout=180)
        finally:
            load.stop()
        assert busy.returncode == 0, busy.stderr
        # The server finishes the requests it had queued (their clients are gone) and goes quiet.
        wait_until(lambda: all(metric(scrape_url(f"{server.url}/metrics"), name) == 0.0 for name in (
            "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")), 120,
            "the demo server to go idle")
        quiet = subprocess.run(agent_cmd(*args), capture_output=True, text=True, env=ENV, timeout=180)
        assert quiet.returncode == 0, quiet.stderr
        first, second = rows(db, "demo")
        # A server with nothing in flight and nothing waiting is under-loaded (IDLE002, from its own signals).
        assert first.verdict == "vram" and second.verdict == "idle", (first.headline, second.headline)
        assert "verdict_change" not in busy.stderr  # a first verdict is not a change
        changes = [json.loads(l) for l in quiet.stderr.splitlines() if '"verdict_change"' in l]
        assert len(changes) == 1
        assert (changes[0]["target"], changes[0]["from"], changes[0]["to"]) == ("demo", "vram", "idle")
        (body,) = receiver.wait_for(1)
        assert [(c["target"], c["from"], c["to"]) for c in body["changes"]] == [("demo", "vram", "idle")]
    finally:
        receiver.close()
