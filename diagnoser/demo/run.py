"""`diagnoser demo` as a library call: start the demo server and the load generator, attach, diagnose, write files.

Both children run in their own session (so a Ctrl-C at the terminal ends the window, not the server under it) and
are stopped in a `finally`, whatever happens. Files written to the output folder: capture.dgc (the capture),
diagnosis.json, report.html (when the HTML renderer is installed), demo.json (what ran: PIDs, config, load
summary), server.log and loadgen.log.
"""

from __future__ import annotations

import json
import queue
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

from diagnoser.capture import Capture, ModelInfo
from diagnoser.collectors.server_metrics import MetricsError, probe
from diagnoser.collectors.session import Progress, collect
from diagnoser.collectors.target import resolve_target
from diagnoser.diagnosis import Diagnosis
from diagnoser.errors import InputError, SourceUnavailable
from diagnoser.pipeline import Outcome
from diagnoser.reports.jsonout import dumps as diagnosis_json

DEFAULT_OUT = Path("diagnoser-demo")
_READY = re.compile(r"ready on http://([^:\s]+):(\d+) \(device (\w+)")


@dataclass
class DemoConfig:
    duration_s: float = 8.0
    interval_s: float = 0.1
    concurrency: int = 24
    max_num_seqs: int = 16
    # Deliberately small, so the queue builds up behind a full KV cache as it does on a GPU out of KV memory.
    kv_tokens: int = 1024
    device: str = "auto"
    layers: int = 4
    d_model: int = 256
    start_timeout_s: float = 120.0
    warmup_timeout_s: float = 30.0


@dataclass
class DemoRun:
    outcome: Outcome
    out_dir: Path
    device: str
    files: dict[str, Path] = field(default_factory=dict)
    load: dict[str, Any] = field(default_factory=dict)
    server_pid: int = 0
    loadgen_pid: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def capture(self) -> Capture:
        return self.outcome.capture

    @property
    def diagnosis(self) -> Diagnosis:
        return self.outcome.diagnosis


def run_demo(cfg: DemoConfig, out_dir: Path = DEFAULT_OUT, *, on_sample: Callable[[Progress], None] | None = None,
             on_status: Callable[[str], None] | None = None, thresholds: Any = None) -> DemoRun:
    from diagnoser.pipeline import Pipeline

    status = on_status or (lambda _msg: None)
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError(f"cannot create the output folder {out_dir}: {exc.strerror or exc}.") from None
    server = loadgen = None
    logs: list[IO[str]] = []
    try:
        status("starting the demo server (a small random-weight transformer)")
        server_log = open(out_dir / "server.log", "w")  # noqa: SIM115  (closed in finally)
        logs.append(server_log)
        server = subprocess.Popen(
            [sys.executable, "-m", "diagnoser.demo.server", "--port", "0", "--device", cfg.device,
             "--max-num-seqs", str(cfg.max_num_seqs), "--kv-tokens", str(cfg.kv_tokens), "--layers", str(cfg.layers),
             "--d-model", str(cfg.d_model)],
            stdout=subprocess.PIPE, stderr=server_log, text=True, start_new_session=True)
        host, port, device = _wait_ready(server, cfg.start_timeout_s, out_dir / "server.log")
        url = f"http://{host}:{port}"
        status(f"server ready on {url} ({device}); starting {cfg.concurrency} closed-loop clients")
        loadgen_log = open(out_dir / "loadgen.log", "w")  # noqa: SIM115
        logs.append(loadgen_log)
        loadgen = subprocess.Popen(
            [sys.executable, "-m", "diagnoser.demo.loadgen", "--url", url, "--concurrency", str(cfg.concurrency),
             "--duration", str(cfg.warmup_timeout_s + cfg.duration_s + 30)],
            stdout=subprocess.PIPE, stderr=loadgen_log, text=True, start_new_session=True)
        _wait_busy(f"{url}/metrics", server, cfg.warmup_timeout_s)
        status(f"attaching to pid {server.pid} for {cfg.duration_s:g} s")
        target = resolve_target(pid=server.pid, port=port)
        capture = collect(target, cfg.duration_s, cfg.interval_s, on_sample=on_sample)
    finally:
        load = _stop(loadgen, wait_s=5.0, read_summary=True)
        _stop(server, wait_s=10.0)
        for log in logs:
            log.close()
    _describe_demo(capture, cfg, device)
    capture.origin = "demo"
    # Saved first: whatever fails later, the capture is on disk.
    pipeline = Pipeline(overrides=thresholds, save_to=out_dir / "capture.dgc")
    pipeline.checkpoint(capture)
    outcome = pipeline.diagnose(capture)
    run = DemoRun(outcome=outcome, out_dir=out_dir, device=device, load=load, server_pid=server.pid,
                  loadgen_pid=loadgen.pid)
    run.files["capture"] = out_dir / "capture.dgc"
    run.files["diagnosis"] = _write(out_dir / "diagnosis.json", diagnosis_json(run.diagnosis) + "\n")
    try:
        Pipeline(overrides=thresholds, html=out_dir / "report.html").write(outcome)
        run.files["report"] = outcome.written["report"]
    except ImportError:
        run.problems.append("the HTML renderer is not installed, so no report.html was written")
    except Exception as exc:  # noqa: BLE001  (a renderer bug must not cost the capture and verdict)
        run.problems.append(f"report.html could not be written ({type(exc).__name__}: {exc})")
    meta = {"server_pid": run.server_pid, "loadgen_pid": run.loadgen_pid, "url": url, "device": device,
            "config": asdict(cfg), "load": load, "window_s": capture.duration_s}
    run.files["demo"] = _write(out_dir / "demo.json", json.dumps(meta, indent=2) + "\n")
    return run


def _write(path: Path, text: str) -> Path:
    try:
        path.write_text(text)
    except OSError as exc:
        raise InputError(f"cannot write {path}: {exc.strerror or exc}.") from None
    return path


def _wait_ready(server: subprocess.Popen[str], timeout_s: float, log: Path) -> tuple[str, int, str]:
    """Read the server's stdout until its ready line; one sentence if it dies or takes too long."""
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        assert server.stdout is not None
        for line in server.stdout:
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, name="demo-server-stdout", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        if line is None:
            break
        found = _READY.search(line)
        if found:
            return found.group(1), int(found.group(2)), found.group(3)
    server.poll()
    tail = _tail(log)
    if server.returncode is not None:
        raise SourceUnavailable(f"the demo server exited (code {server.returncode}) before it was ready"
                                + (f": {tail}" if tail else "."))
    raise SourceUnavailable(f"the demo server was not ready after {timeout_s:g} s (see {log}).")


# After the first running request, how long to wait at most for a queue to form (with a large KV budget none may).
_SETTLE_S = 5.0


def _wait_busy(metrics_url: str, server: subprocess.Popen[str], timeout_s: float) -> None:
    """Wait until the load has reached the server (requests running), then for a steady state: a queue behind a
    full batch or KV cache, or _SETTLE_S seconds, whichever comes first."""
    deadline = time.monotonic() + timeout_s
    settled_by: float | None = None
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SourceUnavailable(f"the demo server exited (code {server.returncode}) during warm-up.")
        try:
            _, samples = probe(metrics_url, timeout=2.0)
        except MetricsError:
            time.sleep(0.2)
            continue
        running = sum(v for _, v in samples.get("vllm:num_requests_running", []))
        waiting = sum(v for _, v in samples.get("vllm:num_requests_waiting", []))
        if running >= 1 and settled_by is None:
            settled_by = time.monotonic() + _SETTLE_S
        if settled_by is not None and (waiting >= 1 or time.monotonic() >= settled_by):
            return
        time.sleep(0.2)
    raise SourceUnavailable(f"the load never reached the demo server within {timeout_s:g} s.")


def _stop(proc: subprocess.Popen[str] | None, *, wait_s: float, read_summary: bool = False) -> dict[str, Any]:
    """SIGTERM, wait, SIGKILL if needed; with read_summary, the load generator's JSON summary line."""
    if proc is None:
        return {}
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5.0)
    summary: dict[str, Any] = {}
    if read_summary and proc.stdout is not None:
        try:
            for line in proc.stdout.read().splitlines():
                if line.startswith("{"):
                    summary = json.loads(line)
        except (OSError, ValueError):
            summary = {}
    if proc.stdout is not None:
        proc.stdout.close()
    return summary


def _tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " / ".join(line.strip() for line in text[-lines:])


def _describe_demo(capture: Capture, cfg: DemoConfig, device: str) -> None:
    """What the demo ran, into the capture: its model's shape, serving limits, and what a CPU run means."""
    from diagnoser.demo.model import ModelConfig

    mc = ModelConfig(d_model=cfg.d_model, layers=cfg.layers)
    capture.model = ModelInfo(name="diagnoser-demo-tiny (random weights)", params=float(mc.params()),
                              active_params=float(mc.params()), layers=mc.layers, hidden=mc.d_model, heads=mc.heads,
                              kv_heads=mc.heads, head_dim=mc.head_dim, vocab=mc.vocab,
                              dtype="fp32" if device == "cpu" else "bf16", max_context=mc.max_len)
    capture.serving.engine = "demo"
    capture.serving.max_num_seqs = cfg.max_num_seqs
    capture.serving.kv_cache_tokens = cfg.kv_tokens
    capture.serving.load_concurrency = cfg.concurrency
    if device == "cpu":
        capture.cpu_only = True
    capture.notes.append(f"Demo workload: a {mc.params() / 1e6:.1f} M-parameter random-weight decoder on {device}, "
                         f"{cfg.concurrency} closed-loop clients, at most {cfg.max_num_seqs} sequences and a "
                         f"{cfg.kv_tokens}-token KV cache"
                         + (" (small on purpose)." if cfg.kv_tokens <= DemoConfig.kv_tokens else "."))
