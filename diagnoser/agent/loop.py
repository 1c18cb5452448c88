"""The agent's scheduler: every interval (with jitter) one cycle over the node's targets, until told to stop.

A cycle discovers targets (NVML, when asked), runs one worker process per target (at most `max_parallel` at once),
stores each result in the history, updates the metrics, tells of verdict changes, rotates reports and prunes the
history. The loop never waits on a target: each worker has a deadline (its window plus a grace) after which its
process group is killed and the run is recorded as a timeout. `stop()` (wired to SIGTERM/SIGINT by the CLI) wakes
the sleeping loop at once; running workers get SIGTERM, which ends their windows early so they still store what
they captured, and SIGKILL if they are not done within STOP_GRACE_S.

Each worker also gets a pipe (DIAGNOSER_STATUS_FD) for short JSON lines: its stages ("observing 10 s window of PID
..."), logged as `progress` events when asked for (`agent --once`), and its one-sentence error, which reaches the
loop even when a full disk keeps the worker from writing its result file or its stderr.

The scratch folders (run markers) beside the history are named after it (`.agent-work-<history>-<pid>-...`), so a
second history in the same folder neither removes the first's scratch nor holds back or runs the first's sweep.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from diagnoser.agent.config import AgentConfig, TargetSpec
from diagnoser.agent.history import ERROR, OK, TIMEOUT, HistoryStore, RunRecord
from diagnoser.agent.metrics import AgentMetrics, MetricsServer, write_textfile
from diagnoser.agent.notify import EventLog, Webhook, is_change
from diagnoser.agent.reports import RunReports, write_error
from diagnoser.agent.worker import STATUS_FD_ENV, build_job
from diagnoser.collectors.process import pid_alive
from diagnoser.errors import DiagnoserError, InputError

STOP_GRACE_S = 3.0  # after SIGTERM, how long workers get to store what they captured
DISCOVERY_TIMEOUT_S = 30.0
_POLL_S = 0.1
_WORK_PREFIX = ".agent-work-"
_TAIL_BYTES = 64 << 10
_STATUS_LINE = 4096  # a status line longer than this is cut (a worker's sentence is far shorter)


class _StatusPipe:
    """The read end of a worker's status pipe: complete JSON lines as they arrive, never blocking."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buffer = b""

    def read(self) -> list[dict[str, Any]]:
        chunks = []
        while self.fd >= 0:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            except OSError:
                chunk = b""
            if not chunk:
                self.close()  # the worker's end is closed: it has exited
                break
            chunks.append(chunk)
        *lines, self._buffer = (self._buffer + b"".join(chunks)).split(b"\n")
        self._buffer = self._buffer[-_STATUS_LINE:]
        messages = []
        for line in lines:
            try:
                message = json.loads(line[:_STATUS_LINE])
            except ValueError:
                continue
            if isinstance(message, dict):
                messages.append(message)
        return messages

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass
class _Job:
    target: TargetSpec
    proc: subprocess.Popen[bytes]
    started_at: float
    deadline: float  # monotonic
    job_dir: Path
    status: _StatusPipe | None = None
    error: str = ""  # the worker's one-sentence error, from its status pipe
    terminated: bool = False


@dataclass
class CycleReport:
    """What one cycle did (for --once's exit code and the tests)."""

    started_at: float
    finished_at: float = 0.0
    runs: list[RunRecord] = field(default_factory=list)
    changes: list[dict[str, Any]] = field(default_factory=list)
    discovery_error: str = ""
    skipped: list[str] = field(default_factory=list)  # targets not run because the agent was stopping

    @property
    def failed(self) -> list[RunRecord]:
        return [r for r in self.runs if r.status != OK]


class Agent:
    def __init__(self, cfg: AgentConfig, *, log: EventLog | None = None, rng: random.Random | None = None,
                 progress: bool = False) -> None:
        self.cfg = cfg
        self.log = log or EventLog()
        self.progress = progress  # log each worker's stages as `progress` events (agent --once)
        self.rng = rng or random.Random()
        self.stop_event = threading.Event()
        self.store = HistoryStore(cfg.db_path)
        self.metrics = AgentMetrics()
        self.reports = RunReports(cfg.reports_dir, cfg.keep_reports, cfg.reports_mode) \
            if cfg.reports_dir is not None and cfg.keep_reports > 0 else None
        self._marker = _WORK_PREFIX + cfg.db_path.name + "-"  # this history's scratch folders start so
        self.webhook = Webhook(cfg.webhook, cfg.webhook_timeout_s, self.log, self.metrics.count_webhook_error) \
            if cfg.webhook else None
        self.server: MetricsServer | None = None
        self.cycles = 0
        self._workdir = self._make_workdir()
        try:
            claimed = self.reports.claim(cfg.db_path) if self.reports is not None else False
        except DiagnoserError:
            self.close()
            raise
        if claimed:
            self._sweep_reports()  # a folder claimed only now may hold another history's runs of an older version

    # --- lifecycle -----------------------------------------------------------------------------------------

    def serve_metrics(self) -> MetricsServer | None:
        if self.cfg.metrics_port:
            self.server = MetricsServer(self.metrics, self.cfg.metrics_addr, self.cfg.metrics_port)
            self.log.emit("metrics_serving", url=f"http://{self.cfg.metrics_addr}:{self.server.port}/metrics")
        return self.server

    def stop(self) -> None:
        """Safe from a signal handler: only sets an event."""
        self.stop_event.set()

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self.webhook is not None:
            # Give a change of the last cycle its chance to go out (bounded by the webhook's own timeout).
            self.webhook.close(timeout_s=self.cfg.webhook_timeout_s + 0.5)
        self.store.close()
        shutil.rmtree(self._workdir, ignore_errors=True)

    def _make_workdir(self) -> Path:
        # Scratch for job and result files, beside the history (the one place the agent must be able to write,
        # also under a read-only root file system). Leftovers of an agent that was killed are removed first.
        parent = self.cfg.db_path.parent
        for old, pid in self._markers():
            if not pid_alive(pid):
                shutil.rmtree(old, ignore_errors=True)
        try:
            return Path(tempfile.mkdtemp(prefix=f"{self._marker}{os.getpid()}-", dir=parent))
        except OSError as exc:
            self.store.close()
            raise InputError(write_error(f"write to the agent's state folder {parent}", exc)) from None

    def _markers(self) -> list[tuple[Path, int]]:
        """This history's scratch folders with the PID of the agent that made each; those of older versions
        (`.agent-work-<pid>-...`, no history in the name) count as anyone's."""
        found = []
        for path in self.cfg.db_path.parent.glob(_WORK_PREFIX + "*"):
            rest = path.name[len(self._marker):] if path.name.startswith(self._marker) else ""
            legacy = path.name[len(_WORK_PREFIX):]
            for candidate in (rest, legacy):
                pid = candidate.split("-")[0]
                if pid.isdigit() and len(candidate.split("-")) == 2:
                    found.append((path, int(pid)))
                    break
        return found

    def _sweep_reports(self) -> None:
        """Remove report folders no history row names (left by an agent killed between a worker's rename and the
        row's commit); not while another live agent shares this state folder, which may be between the two."""
        if self.reports is None:
            return
        mine = self._workdir.name
        for other, pid in self._markers():
            if other.name != mine and pid_alive(pid):
                return
        try:
            removed = self.reports.sweep(self.store.report_dirs())
        except DiagnoserError as exc:
            self.log.emit("reports_sweep_failed", error=str(exc))
            return
        if removed:
            self.log.emit("reports_swept", folders=len(removed),
                          reason="report folders without a history row (the agent was killed mid-run)")

    # --- the loop ------------------------------------------------------------------------------------------

    def first_delay(self) -> float:
        """A random start within the jitter, so a fleet of nodes started together does not scan in lockstep."""
        return self.rng.uniform(0, self.cfg.every_s * self.cfg.jitter)

    def next_delay(self, cycle_seconds: float) -> float:
        """Seconds to sleep after a cycle: the interval, jittered by +-jitter, minus the time the cycle took."""
        every = self.cfg.every_s * (1 + self.rng.uniform(-self.cfg.jitter, self.cfg.jitter))
        return max(0.0, every - cycle_seconds)

    def run_forever(self) -> None:
        self.log.emit("agent_started", every_s=self.cfg.every_s, jitter=self.cfg.jitter, window_s=self.cfg.window_s,
                      targets=[t.name for t in self.cfg.targets], discover=self.cfg.discovering,
                      db=str(self.cfg.db_path), pid=os.getpid())
        delay = self.first_delay()
        while not self.stop_event.wait(delay):
            t0 = time.monotonic()
            try:
                self.run_cycle()
            except Exception as exc:  # a bug or a full disk must not end an unattended agent
                self.log.emit("cycle_failed", error=f"{type(exc).__name__}: {exc}")
            delay = self.next_delay(time.monotonic() - t0)
        self.log.emit("agent_stopped", cycles=self.cycles)

    def run_cycle(self) -> CycleReport:
        report = CycleReport(started_at=time.time())
        t0 = time.monotonic()
        targets = list(self.cfg.targets)
        if self.cfg.discovering:
            self._progress("", "discovering the serving processes on this node's GPUs")
            found, error = self._discover()
            report.discovery_error = error
            taken = {t.name for t in targets} | {t.pid for t in targets if t.pid is not None}
            targets += [t for t in found if t.name not in taken and t.pid not in taken]
        if not targets:
            self.log.emit("no_targets", reason=report.discovery_error or "nothing configured and nothing found")
        self._run_targets(targets, report)
        self.metrics.forget({t.name for t in targets} | {t.name for t in self.cfg.targets})
        self._housekeeping()
        report.finished_at = time.time()
        self.cycles += 1
        self.metrics.record_cycle(report.finished_at, time.monotonic() - t0)
        if self.cfg.textfile is not None:
            try:
                write_textfile(self.metrics, self.cfg.textfile)
            except DiagnoserError as exc:
                self.log.emit("textfile_failed", error=str(exc))
        if self.webhook is not None and report.changes:
            self.webhook.send(report.changes)
        return report

    # --- discovery -----------------------------------------------------------------------------------------

    def _discover(self) -> tuple[list[TargetSpec], str]:
        out = self._workdir / "discover.json"
        out.unlink(missing_ok=True)
        try:
            proc = self._spawn(["discover", str(out)], self._workdir / "discover.err")
        except OSError as exc:
            error = f"cannot start GPU process discovery: {exc.strerror or exc}"
            self.metrics.count_discovery_error()
            self.log.emit("discovery_failed", error=error)
            return [], error
        deadline = time.monotonic() + DISCOVERY_TIMEOUT_S
        while proc.poll() is None:
            if time.monotonic() > deadline or self.stop_event.is_set():
                _kill_group(proc, signal.SIGKILL)
                proc.wait()
                error = "GPU process discovery did not finish in time" if not self.stop_event.is_set() else ""
                if error:
                    self.metrics.count_discovery_error()
                    self.log.emit("discovery_failed", error=error)
                return [], error
            time.sleep(_POLL_S)
        try:
            data = json.loads(out.read_text())
        except (OSError, ValueError):
            data = {"error": _tail(self._workdir / "discover.err") or f"discovery exited with code {proc.returncode}"}
        if "error" in data:
            self.metrics.count_discovery_error()
            self.log.emit("discovery_failed", error=data["error"])
            return [], str(data["error"])
        return self._discovered_targets(data.get("servers", [])), ""

    def _discovered_targets(self, servers: list[dict[str, Any]]) -> list[TargetSpec]:
        targets: list[TargetSpec] = []
        names: set[str] = set()
        for s in servers:
            base = f"{s.get('kind') or s.get('name') or 'gpu-process'}-gpu{'-'.join(str(g) for g in s['gpus'])}"
            name = base if base not in names else f"{base}-pid{s['pid']}"
            names.add(name)
            targets.append(TargetSpec(name=name, pid=int(s["pid"]), discovered=True))
        return targets

    # --- running targets -----------------------------------------------------------------------------------

    def _spawn(self, args: list[str], stderr_path: Path, status_fd: int | None = None) -> subprocess.Popen[bytes]:
        env = {**os.environ, "DIAGNOSER_AGENT_PID": str(os.getpid())}
        if status_fd is not None:
            env[STATUS_FD_ENV] = str(status_fd)
        with open(stderr_path, "wb") as err:
            # A new session: the worker and anything it starts can be killed as one group.
            return subprocess.Popen([sys.executable, "-m", "diagnoser.agent.worker", *args],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True, close_fds=True,
                                    pass_fds=() if status_fd is None else (status_fd,), env=env)

    def _progress(self, target: str, stage: str) -> None:
        if self.progress:
            self.log.emit("progress", **({"target": target} if target else {}), stage=stage)

    def _launch(self, target: TargetSpec) -> _Job:
        job_dir = Path(tempfile.mkdtemp(prefix="run-", dir=self._workdir))
        window = target.window_s if target.window_s is not None else self.cfg.window_s
        job = build_job(target, window_s=window, interval_s=min(self.cfg.sample_interval_s, window),
                        sources=self.cfg.sources, thresholds_path=self.cfg.thresholds_path,
                        reports_root=self.reports.root if self.reports else None,
                        keep_reports=self.cfg.keep_reports, html=self.cfg.html_reports,
                        result_path=job_dir / "result.json", reports_mode=self.cfg.reports_mode)
        try:
            (job_dir / "job.json").write_text(json.dumps(job))
            read_end, write_end = os.pipe()
        except OSError:
            shutil.rmtree(job_dir, ignore_errors=True)
            raise
        try:
            proc = self._spawn(["run", str(job_dir / "job.json")], job_dir / "stderr", write_end)
        except OSError:
            os.close(read_end)
            shutil.rmtree(job_dir, ignore_errors=True)
            raise
        finally:
            os.close(write_end)  # the worker holds the only write end: EOF when it exits
        os.set_blocking(read_end, False)
        self._progress(target.name, "starting a worker")
        return _Job(target, proc, time.time(), time.monotonic() + self.cfg.timeout_for(target), job_dir,
                    status=_StatusPipe(read_end))

    def _read_status(self, job: _Job) -> None:
        if job.status is None:
            return
        for message in job.status.read():
            if isinstance(message.get("stage"), str):
                self._progress(job.target.name, message["stage"][:300])
            if isinstance(message.get("error"), str):
                job.error = message["error"][:1000]

    def _run_targets(self, targets: list[TargetSpec], report: CycleReport) -> None:
        pending = deque(targets)
        running: list[_Job] = []
        while pending or running:
            stopping = self.stop_event.is_set()
            if stopping and pending:
                report.skipped += [t.name for t in pending]
                pending.clear()
            while pending and len(running) < self.cfg.max_parallel:
                target = pending.popleft()
                try:
                    running.append(self._launch(target))
                except OSError as exc:  # no disk space, no processes left: this run fails, the loop goes on
                    now_s = time.time()
                    self._store(RunRecord(target=target.name, started_at=now_s, finished_at=now_s, status=ERROR,
                                          error=write_error(f"start a worker in {self._workdir}", exc)),
                                target, report)
            now = time.monotonic()
            for job in list(running):
                self._read_status(job)
                if job.proc.poll() is not None:
                    running.remove(job)
                    self._finish(job, report, timed_out=False)
                elif now > job.deadline:
                    _kill_group(job.proc, signal.SIGKILL)
                    job.proc.wait()
                    running.remove(job)
                    self._finish(job, report, timed_out=True)
                elif stopping and not job.terminated:
                    # End the window early; the worker still stores what it captured.
                    _kill_group(job.proc, signal.SIGTERM)
                    job.terminated = True
                    job.deadline = min(job.deadline, now + STOP_GRACE_S)
            if running:
                time.sleep(_POLL_S)

    def _finish(self, job: _Job, report: CycleReport, *, timed_out: bool) -> None:
        finished = time.time()
        result: dict[str, Any] = {}
        self._read_status(job)  # what the worker said last, up to its exit
        if job.status is not None:
            job.status.close()
        if job.terminated and (timed_out or not (job.job_dir / "result.json").exists()):
            # Stopped by our own shutdown before it had a result: a cancelled run, not the target's error.
            shutil.rmtree(job.job_dir, ignore_errors=True)
            if self.reports is not None:
                self.reports.rotate(job.target.name)
            report.skipped.append(job.target.name)
            self.log.emit("run_cancelled", target=job.target.name, reason="the agent is stopping")
            return
        if not timed_out:
            try:
                result = json.loads((job.job_dir / "result.json").read_text())
            except (OSError, ValueError):
                # Its own sentence first: on a full disk neither the result nor its stderr could be written.
                said = job.error or _tail(job.job_dir / "stderr")
                result = {"status": ERROR, "error": said or f"the worker exited with code {job.proc.returncode} "
                                                            "without a result"}
        else:
            result = {"status": TIMEOUT, "error": f"no result within {self.cfg.timeout_for(job.target):.0f} s "
                                                  "(window plus grace); the worker was killed"}
        shutil.rmtree(job.job_dir, ignore_errors=True)
        run = RunRecord(
            target=job.target.name, started_at=job.started_at, finished_at=float(result.get("finished_at", finished)),
            status=str(result.get("status", ERROR)), verdict=result.get("verdict"),
            confidence=result.get("confidence"), efficiency=result.get("efficiency"), top_fix=result.get("top_fix"),
            top_fix_rule=result.get("top_fix_rule") or "", top_fix_gain=result.get("top_fix_gain"),
            headline=result.get("headline") or "", error=result.get("error") or "", gpu=result.get("gpu") or "",
            pod=result.get("pod") or "", report_dir=result.get("report_dir") or "",
            problems=list(result.get("problems") or []), diagnosis=result.get("diagnosis"))
        if timed_out and self.reports is not None:
            self.reports.rotate(job.target.name)  # drop the half-built folder of the killed worker
        self._store(run, job.target, report)

    def _store(self, run: RunRecord, target: TargetSpec, report: CycleReport) -> None:
        previous: str | None = None
        try:
            if not self.metrics.known(run.target):
                self._restore(run.target)
            previous = self.store.last_verdict(run.target, include_inconclusive=self.cfg.notify_inconclusive)
            self.store.add(run)
        except DiagnoserError as exc:
            self.log.emit("history_write_failed", target=run.target, error=str(exc))
        self.metrics.record_run(run)
        report.runs.append(run)
        fields: dict[str, Any] = {"target": run.target, "status": run.status,
                                  "seconds": round(run.finished_at - run.started_at, 2)}
        if run.status == OK:
            fields.update(verdict=run.verdict, confidence=run.confidence)
        else:
            fields["error"] = run.error
        if run.problems:
            fields["problems"] = run.problems
        self.log.emit("run", **fields)
        if run.status == OK and is_change(previous, run.verdict, include_inconclusive=self.cfg.notify_inconclusive):
            change = self.log.emit("verdict_change", target=run.target, gpu=run.gpu, pod=run.pod,
                                   **{"from": previous, "to": run.verdict}, confidence=run.confidence,
                                   headline=run.headline, top_fix=run.top_fix, report_dir=run.report_dir)
            report.changes.append(change)
        if self.reports is not None:
            self.reports.rotate(run.target)

    def _restore(self, target: str) -> None:
        """Seed a target's metrics from its newest stored runs (after an agent restart)."""
        newest = self.store.runs(target=target, limit=1, newest_first=True)
        if not newest:
            return
        last_ok = newest[0] if newest[0].status == OK else next(
            iter(r for r in self.store.runs(target=target, limit=50, newest_first=True) if r.status == OK), None)
        self.metrics.restore(newest[0], last_ok)

    def _housekeeping(self) -> None:
        try:
            pruned = self.store.prune(max_age_s=self.cfg.retention_s, max_bytes=self.cfg.max_db_bytes)
        except DiagnoserError as exc:
            self.log.emit("history_prune_failed", error=str(exc))
            return
        if pruned.by_age or pruned.by_size:
            self.log.emit("history_pruned", by_age=pruned.by_age, by_size=pruned.by_size)


def _kill_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _tail(path: Path, limit: int = 400) -> str:
    """The last non-empty line of a worker's stderr: its one sentence (or the last line of a traceback)."""
    try:
        with open(path, "rb") as f:  # the end only: a worker's stderr can be a long traceback, or anything
            f.seek(max(0, os.fstat(f.fileno()).st_size - _TAIL_BYTES))
            text = f.read(_TAIL_BYTES).decode(errors="replace")
        lines = [line.strip() for line in text.splitlines() if line.strip()]
    except OSError:
        return ""
    return lines[-1][:limit] if lines else ""

