"""The agent's files and what long work tells while it runs (issue 32, items 9 and 13).

Files: run reports as private as the history (0600 files, 0700 folders) unless `[reports] mode` opens them; a second
history beside the first keeps its own report folders and scratch folders and never removes the first's; a full disk
(or any write that fails) is said by the worker in one sentence, which the loop logs as the run's error. Progress:
`agent --once` and `selftest` say each stage on stderr as it starts, stdout stays clean, and the self-test leaves no
temporary folder behind on any way out.
"""

from __future__ import annotations

import errno
import io
import json
import os
import resource
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import diagnoser.agent.worker as worker
import diagnoser.capture
from diagnoser.agent.config import SourcesConfig, TargetSpec, build_config
from diagnoser.agent.history import ERROR, HistoryStore, RunRecord
from diagnoser.agent.loop import Agent
from diagnoser.agent.notify import EventLog
from diagnoser.agent.reports import OWNER_FILE, RunReports, write_error
from diagnoser.capture import CaptureError
from diagnoser.cli.app import app
from diagnoser.errors import EXIT_INPUT, InputError
from diagnoser.fileio import write_atomic
from diagnoser.selftest.harness import ScenarioResult, SelftestReport

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
CLI = [sys.executable, "-m", "diagnoser"]


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture()
def sleeper() -> Iterator[int]:
    """A process to diagnose: the worker only needs a PID (no GPU, no server metrics here)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def _once(*args: str, umask: int = 0o022) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, "agent", "--once", "--window", "1s", "--sample-interval", "0.5s", *args],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=240, check=False,
                          preexec_fn=lambda: os.umask(umask))  # a loose umask must not loosen the reports


def _events(stderr: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in stderr.splitlines() if line.startswith("{")]


def _rows(db: Path) -> list[RunRecord]:
    with HistoryStore(db, create=False) as store:
        return store.runs()


# --- item 9: modes ------------------------------------------------------------------------------------------------

def test_reports_and_their_folders_are_private_like_the_history(sleeper: int, tmp_path: Path) -> None:
    db = tmp_path / "state" / "history.db"
    result = _once("--targets", f"s=pid:{sleeper}", "--db", str(db))
    assert result.returncode == 0, result.stderr
    (run,) = _rows(db)
    folder = Path(run.report_dir)
    assert sorted(p.name for p in folder.iterdir()) == ["capture.dgc", "diagnosis.json", "report.html"]
    reports = db.parent / "reports"
    everything = [reports, *reports.rglob("*")]
    assert folder in everything
    for path in everything:
        want = 0o700 if path.is_dir() else 0o600
        assert _mode(path) == want, (path, oct(_mode(path)))
    assert _mode(db) == 0o600


def test_the_reports_mode_can_open_them_to_a_group(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text('[reports]\nmode = "0640"\n')
    assert build_config(config).reports_mode == 0o640
    config.write_text("[reports]\nmode = 0o640\n")
    assert build_config(config).reports_mode == 0o640
    old = os.umask(0o077)  # a strict umask must not narrow what the operator asked for either
    try:
        reports = RunReports(tmp_path / "reports", keep=5, mode=0o640)
        staging = reports.staging("llama")
        write_atomic(staging / "capture.dgc", b"x", mode=0o600)  # as capture.save writes it
        write_atomic(staging / "report.html", b"<html>")  # as the HTML renderer writes it (0644)
        final = reports.finalize(staging, 1_790_000_000.0)
    finally:
        os.umask(old)
    assert {p.name: _mode(p) for p in final.iterdir()} == {"capture.dgc": 0o640, "report.html": 0o640}
    assert _mode(final) == _mode(final.parent) == _mode(final.parent.parent) == 0o750


# TOML values: strings in octal, or an integer (640 in decimal is 0o1200: sticky and execute bits).
@pytest.mark.parametrize("value", ['"0755"', '"0400"', '"rw"', '"0o7777"', "640"])
def test_a_reports_mode_that_is_not_a_file_mode_is_one_sentence(value: str, tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    config.write_text(f"[reports]\nmode = {value}\n")
    with pytest.raises(InputError, match=r"reports\.mode must"):
        build_config(config)


# --- item 9: a second history in the same folder ------------------------------------------------------------------

def test_a_second_history_in_the_same_folder_keeps_the_first_ones_reports(sleeper: int, tmp_path: Path) -> None:
    first, second = tmp_path / "history.db", tmp_path / "other.db"
    outputs = []
    for db in (first, second, first):
        result = _once("--targets", f"s=pid:{sleeper}", "--db", str(db))
        assert result.returncode == 0, result.stderr
        outputs.append(result.stderr)
    # Nothing was swept: no history took the other's runs for ones the agent lost when killed.
    assert not [e for out in outputs for e in _events(out) if e["event"] == "reports_swept"]
    for db, reports, count in ((first, tmp_path / "reports", 2), (second, tmp_path / "reports-other.db", 1)):
        runs = _rows(db)
        assert len(runs) == count and all(Path(r.report_dir).is_dir() for r in runs), runs
        assert {Path(r.report_dir).parent.parent for r in runs} == {reports}
    assert not list(tmp_path.glob(".agent-work-*"))  # each removed its own scratch folder


def _agent(db: Path, log: io.StringIO, reports: Path | None = None) -> Agent:
    flags: dict[str, Any] = {"history.db": str(db), "metrics.port": 0, "targets": ["demo=pid:1"]}
    if reports is not None:
        flags["reports.dir"] = str(reports)
    return Agent(build_config(None, flags), log=EventLog(log))


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_scratch_folders_are_the_historys_own(tmp_path: Path) -> None:
    other = tmp_path / "other.db"
    _agent(other, io.StringIO()).close()  # an earlier start: reports-other.db/ is this history's
    orphan = tmp_path / "reports-other.db" / "demo" / "20260101T000100Z"
    orphan.mkdir(parents=True)
    # The first history's agent is alive (this process) and one of its earlier agents died: both folders are its own.
    live = tmp_path / f".agent-work-history.db-{os.getpid()}-abc"
    dead = tmp_path / f".agent-work-history.db-{_dead_pid()}-def"
    live.mkdir()
    dead.mkdir()
    log = io.StringIO()
    agent = _agent(other, log)
    assert agent._workdir.name.startswith(".agent-work-other.db-")
    agent.close()
    assert live.is_dir() and dead.is_dir()
    # The first history's live agent does not hold back the second's sweep of its own orphan.
    assert not orphan.exists() and '"reports_swept"' in log.getvalue()
    # A live agent of the same history does (its worker may be between rename and commit).
    orphan.mkdir(parents=True)
    (tmp_path / f".agent-work-other.db-{os.getpid()}-ghi").mkdir()
    _agent(other, io.StringIO()).close()
    assert orphan.is_dir()


def test_a_reports_folder_of_another_history_is_refused(tmp_path: Path) -> None:
    shared = tmp_path / "reports"
    _agent(tmp_path / "a.db", io.StringIO(), shared).close()
    kept = shared / "demo" / "20260101T000000Z"
    kept.mkdir(parents=True)
    with pytest.raises(InputError, match="holds the runs of the history .*a.db; give the history .*b.db its own"):
        _agent(tmp_path / "b.db", io.StringIO(), shared)
    assert kept.is_dir()
    assert not list(tmp_path.glob(".agent-work-b.db-*"))  # the refused agent left no scratch behind
    # Once that history is gone, the folder can be taken over.
    for suffix in ("", "-wal", "-shm"):
        Path(str(tmp_path / "a.db") + suffix).unlink(missing_ok=True)
    _agent(tmp_path / "b.db", io.StringIO(), shared).close()
    assert (shared / OWNER_FILE).read_text().strip() == os.path.realpath(tmp_path / "b.db")


# --- item 9: a full disk ----------------------------------------------------------------------------------------

def test_a_failed_write_is_one_sentence_and_a_full_disk_says_so() -> None:
    full = OSError(errno.ENOSPC, "No space left on device")
    assert write_error("write /s/x.json", full) == ("the disk is full (no space left on the device): cannot write "
                                                    "/s/x.json.")
    assert write_error("write /s/x.json", OSError(errno.EDQUOT, "Disk quota exceeded")).startswith(
        "the disk quota is used up")
    assert write_error("write /s/x.json", OSError(errno.EIO, "Input/output error")) == \
        "cannot write /s/x.json: Input/output error."
    # A one-sentence error raised while handling the OSError (capture.save's) is read through to it.
    try:
        try:
            raise full
        except OSError as exc:
            raise CaptureError(f"cannot write capture to /s/c.dgc: {exc.strerror}.") from None
    except CaptureError as wrapped:
        assert write_error("save the capture to /s/c.dgc", wrapped).startswith("the disk is full")


def _job(tmp_path: Path, pid: int) -> Path:
    job = worker.build_job(TargetSpec(name="s", pid=pid), window_s=0.5, interval_s=0.25,
                           sources=SourcesConfig(nvml=False, server_metrics=False), thresholds_path=None,
                           reports_root=tmp_path / "reports", keep_reports=5, html=False,
                           result_path=tmp_path / "work" / "result.json")
    path = tmp_path / "work" / "job.json"
    path.parent.mkdir()
    path.write_text(json.dumps(job))
    return path


def _read_pipe(fd: int) -> list[dict[str, Any]]:
    os.set_blocking(fd, False)
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return [json.loads(line) for line in data.splitlines()]


def test_a_full_disk_is_said_by_the_worker_over_its_status_pipe(sleeper: int, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    job = _job(tmp_path, sleeper)

    def full(path: str | Path, data: bytes, mode: int = 0o644) -> Path:
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    # Every file write fails as on a full disk: the capture, the result file.
    monkeypatch.setattr(diagnoser.capture, "write_atomic", full)
    monkeypatch.setattr(worker, "write_atomic", full)
    read_end, write_end = os.pipe()
    try:
        code = worker.run_main(["run", str(job)], threading.Event(), worker.Status(write_end))
        os.close(write_end)
        messages = _read_pipe(read_end)
    finally:
        os.close(read_end)
    assert code == EXIT_INPUT
    assert {"stage": f"observing 0.5 s window of PID {sleeper}"} in messages
    errors = [m["error"] for m in messages if "error" in m]
    capture = tmp_path / "reports" / "s"
    assert len(errors) == 1 and errors[0].startswith("the disk is full (no space left on the device): cannot save "
                                                     f"the capture to {capture}/"), errors


def test_the_loop_logs_the_workers_own_sentence_when_nothing_can_be_written(sleeper: int, tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    real = subprocess.Popen

    def no_file_writes_in_workers(args: Any, **kwargs: Any) -> Any:
        if "diagnoser.agent.worker" in args:
            # Any write to a file fails in the worker (EFBIG): its capture, its result file and its stderr.
            kwargs["preexec_fn"] = lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0))
        return real(args, **kwargs)

    monkeypatch.setattr(subprocess, "Popen", no_file_writes_in_workers)
    cfg = build_config(None, {"history.db": str(tmp_path / "history.db"), "metrics.port": 0, "agent.window": "0.5s",
                              "agent.sample_interval": "0.25s", "targets": [f"s=pid:{sleeper}"]})
    log = io.StringIO()
    agent = Agent(cfg, log=EventLog(log))
    try:
        report = agent.run_cycle()
    finally:
        agent.close()
    (run,) = report.runs
    assert run.status == ERROR
    assert run.error.startswith(f"cannot save the capture to {tmp_path / 'reports' / 's'}/"), run.error
    assert run.error.endswith(": File too large."), run.error
    (logged,) = [e for e in _events(log.getvalue()) if e["event"] == "run"]
    assert logged["error"] == run.error and "exited with code" not in logged["error"]


# --- item 13: progress ----------------------------------------------------------------------------------------

def test_agent_once_tells_each_stage_on_stderr_and_keeps_stdout_clean(sleeper: int, tmp_path: Path) -> None:
    result = _once("--targets", f"s=pid:{sleeper}", "--db", str(tmp_path / "history.db"))
    assert result.returncode == 0, result.stderr
    (line,) = result.stdout.splitlines()  # stdout: the verdict line alone
    assert line.startswith("s: ")
    events = _events(result.stderr)
    stages = [e["stage"] for e in events if e["event"] == "progress" and e.get("target") == "s"]
    assert stages == ["starting a worker", f"observing 1 s window of PID {sleeper}", "diagnosing",
                      "writing the report"], stages
    # Each stage is told before the run's result, not with it.
    names = [e["event"] for e in events]
    assert names.index("run") > max(i for i, n in enumerate(names) if n == "progress")


def test_selftest_says_each_scenario_on_stderr_even_with_json_and_leaves_no_folder(tmp_path: Path) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    result = subprocess.run([*CLI, "selftest", "--device", "cpu", "--scenarios", "throttled", "--json"], cwd=REPO,
                            env={**ENV, "TMPDIR": str(tmp)}, capture_output=True, text=True, timeout=240,
                            check=False)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)  # stdout is the JSON alone
    assert report["results"][0]["skipped"] == "needs a GPU" and report["out_dir"] == ""
    assert "[1/1] throttled: skipped (needs a GPU)" in result.stderr
    assert list(tmp.iterdir()) == []


@pytest.mark.parametrize("ending", ["ctrl-c", "error", "failed"])
def test_selftest_removes_its_temporary_folder_on_every_way_out(ending: str, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp))
    seen: list[Path] = []

    def run(names: list[str], *, out_dir: Path, progress: Any, **_: Any) -> tuple[SelftestReport, list[Any]]:
        seen.append(out_dir)
        (out_dir / "decode-b1-trace.json").write_bytes(b"x" * 100_000)  # what a scenario's trace leaves
        progress("[1/1] decode-b1: batch 1 decode")
        if ending == "ctrl-c":
            raise KeyboardInterrupt
        if ending == "error":
            raise InputError("the workload could not start.")
        report = SelftestReport(device="cpu", out_dir=str(out_dir))
        report.results = [ScenarioResult("decode-b1", ("hbm_bandwidth",), error="the workload exited")]
        return report, [None]

    monkeypatch.setattr("diagnoser.cli.selftest.run_selftest", run)
    result = CliRunner().invoke(app, ["selftest", "--device", "cpu", "--scenarios", "decode-b1"])
    assert seen and seen[0].parent == tmp
    assert result.exit_code == {"ctrl-c": 130, "error": 2, "failed": 1}[ending], result.output
    assert "[1/1] decode-b1" in result.output
    assert list(tmp.iterdir()) == [], list(tmp.iterdir())
    if ending == "failed":
        assert "now removed (--out DIR keeps them)" in result.output


def test_selftest_keeps_what_it_wrote_in_a_folder_it_was_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    def run(names: list[str], *, out_dir: Path, progress: Any, **_: Any) -> tuple[SelftestReport, list[Any]]:
        (out_dir / "decode-b1.dgc").write_bytes(b"x")
        return SelftestReport(device="cpu", out_dir=str(out_dir)), []

    monkeypatch.setattr("diagnoser.cli.selftest.run_selftest", run)
    result = CliRunner().invoke(app, ["selftest", "--device", "cpu", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "decode-b1.dgc").is_file() and f"Captures and workload logs in {tmp_path}" in result.output


@pytest.mark.slow
def test_a_real_cpu_selftest_says_each_stage_and_ctrl_c_leaves_nothing(tmp_path: Path) -> None:
    """One real scenario with its trace: every stage on stderr as it starts; Ctrl-C mid-window removes the workload's
    log, ready file and trace folder with the rest."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.Popen([*CLI, "selftest", "--device", "cpu", "--scenarios", "decode-b1", "--window", "30",
                             "--trace", "0.5"], cwd=REPO, env={**ENV, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    lines: list[str] = []
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line.strip())
            if line.strip().startswith("observing 30 s window of PID"):
                assert list(tmp.iterdir()), "the temporary folder holds the workload's files while it runs"
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
        proc.wait()
    lines += [line.strip() for line in err.splitlines()]
    assert lines[0].startswith("[1/1] decode-b1: ") and lines[2].startswith("observing 30 s window of PID"), lines
    assert lines[1] == "starting the workload (loading PyTorch, building the model)", lines
    assert proc.returncode == 130, (proc.returncode, lines, out)
    assert list(tmp.iterdir()) == []


@pytest.mark.slow
def test_a_real_cpu_selftest_with_a_trace_leaves_nothing_behind(tmp_path: Path) -> None:
    """The whole way through, trace included (the hundreds of MB a CPU run used to leave in its temporary folder)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    result = subprocess.run([*CLI, "selftest", "--device", "cpu", "--scenarios", "decode-b1", "--window", "1",
                             "--trace", "0.5"], cwd=REPO, env={**ENV, "TMPDIR": str(tmp), "OMP_NUM_THREADS": "1"},
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    stages = [line.strip() for line in result.stderr.splitlines()]
    assert stages[1:] == ["starting the workload (loading PyTorch, building the model)", stages[2], "tracing 0.5 s",
                          "diagnosing"], stages
    assert "decode-b1: trace of 0.5 s: trace-" in result.stdout, result.stdout  # the trace was taken, then removed
    assert "Harness OK on the CPU" in result.stdout and "now removed (--out DIR keeps them)" in result.stdout
    assert list(tmp.iterdir()) == []
