"""Agent soak: does the agent's own CPU and memory stay small and flat over many cycles?

An accelerated long run: `diagnoser agent` (a real process, as deployed) runs thousands of cycles at a tiny interval
against cheap real targets: a small HTTP server serving vLLM-style /metrics whose counters advance, diagnosed under
several target names (so each cycle has several runs, the history fills and is pruned by size, report folders
rotate, the metrics endpoint is scraped). At 15-minute intervals, 1,000 cycles are ten days of production.

Sampled every few seconds from outside (psutil): the agent process's RSS, its own CPU time (workers excluded),
the CPU of its reaped workers, open file descriptors and threads, the history file's size, the reports folder's
size, and the cycle count from its metrics endpoint. Reported: least-squares slopes per 1,000 cycles after a
warm-up, first-half vs second-half means, and the agent's share of all CPU the diagnosis used.

Peer, in the same run and on the same targets: an in-process loop that does what one worker does (collect,
diagnose, write the report folder and the history row) in its own Python process, with no subprocess per run.
It is the design the agent avoids; its RSS and slope are the yardstick for the agent's.

Run:  .venv/bin/python benchmarks/agent_soak.py [--minutes 20] [--targets 4] [--write]
With --write the summary goes to benchmarks/out/agent_soak.json (benchmarks/AGENT.md quotes it).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}

# A vLLM-looking /metrics with counters that advance on every scrape: enough for the server collector to record
# rates and the rules to run, for almost no CPU.
CHEAP_SERVER = r"""
import http.server, sys, threading
count = [0]
lock = threading.Lock()
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        with lock:
            count[0] += 1
            n = count[0]
        body = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="m"}} {4 + n % 3}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="m"}} {n % 2}\n'
            "# TYPE vllm:kv_cache_usage_perc gauge\n"
            f'vllm:kv_cache_usage_perc{{model_name="m"}} {0.3 + (n % 5) / 20}\n'
            "# TYPE vllm:generation_tokens_total counter\n"
            f'vllm:generation_tokens_total{{model_name="m"}} {n * 50}\n'
            "# TYPE vllm:prompt_tokens_total counter\n"
            f'vllm:prompt_tokens_total{{model_name="m"}} {n * 200}\n'
        ).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(srv.server_port, flush=True)
srv.serve_forever()
"""

# The peer: the worker's own run_job in a loop in one process (no subprocess per run, no process isolation).
PEER = r"""
import json, sys, threading, time
from pathlib import Path
from diagnoser.agent.config import SourcesConfig, TargetSpec
from diagnoser.agent.history import HistoryStore, RunRecord
from diagnoser.agent.reports import RunReports
from diagnoser.agent.worker import build_job, run_job
port, names, every = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
window, root = float(sys.argv[4]), Path(sys.argv[5])
store = HistoryStore(root / "history.db")
reports = RunReports(root / "reports", keep=5)
stop = threading.Event()
cycles = 0
while True:
    for i in range(names):
        spec = TargetSpec(name=f"cheap-{i}", port=port)
        job = build_job(spec, window_s=window, interval_s=0.1, sources=SourcesConfig(nvml=True),
                        thresholds_path=None, reports_root=root / "reports", keep_reports=5, html=True,
                        result_path=root / "unused.json")
        result = run_job(job, stop)
        store.add(RunRecord(target=spec.name, started_at=result["started_at"], finished_at=time.time(),
                            status=result.get("status", "error"), verdict=result.get("verdict"),
                            confidence=result.get("confidence"), diagnosis=result.get("diagnosis"),
                            report_dir=result.get("report_dir", "")))
        reports.rotate(spec.name)
    store.prune(max_age_s=None, max_bytes=2 << 20)
    cycles += 1
    (root / "cycles").write_text(str(cycles))
    time.sleep(every)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def folder_bytes(path: Path) -> int:
    """Bytes of the files under path; folders renamed or removed mid-walk (report rotation) are skipped."""
    total = 0
    for folder, _, files in os.walk(path):  # os.walk ignores folders that vanish under it
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except OSError:
                continue
    return total


def agent_cycles(port: int) -> int | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith("diagnoser_agent_cycles_total "):
                    return int(float(line.split()[1]))
    except OSError:
        return None
    return None


def sample(proc: psutil.Process) -> dict[str, float]:
    with proc.oneshot():
        cpu = proc.cpu_times()
        return {"rss": proc.memory_info().rss, "cpu_own": cpu.user + cpu.system,
                "cpu_children": cpu.children_user + cpu.children_system, "fds": proc.num_fds(),
                "threads": proc.num_threads()}


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of y over x."""
    if len(xs) < 2:
        return float("nan")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / den if den else float("nan")


def summarize(samples: list[dict[str, float]], warmup_frac: float = 0.1) -> dict[str, Any]:
    """Slopes after a warm-up (the first tenth: imports, SQLite's page cache filling, the history reaching its
    size cap) and over the second half alone (the steady state)."""
    body = samples[int(len(samples) * warmup_frac):]
    cycles = [s["cycles"] for s in body]
    half = len(body) // 2
    out: dict[str, Any] = {"samples": len(samples), "cycles": samples[-1]["cycles"] if samples else 0}
    for key in ("rss", "fds", "threads", "db_bytes", "reports_bytes"):
        if key not in body[0]:
            continue
        ys = [s[key] for s in body]
        out[key] = {
            "first": samples[0][key], "min": min(ys), "max": max(ys), "last": ys[-1],
            "mean_first_half": statistics.fmean(ys[:half]), "mean_second_half": statistics.fmean(ys[half:]),
            "slope_per_1000_cycles": slope(cycles, ys) * 1000,
            "slope_per_1000_cycles_second_half": slope(cycles[half:], ys[half:]) * 1000,
        }
    if "cpu_own" in body[0]:
        first, last = body[0], body[-1]
        d_cycles = max(1.0, last["cycles"] - first["cycles"])
        own = last["cpu_own"] - first["cpu_own"]
        children = last["cpu_children"] - first["cpu_children"]
        out["cpu_own_s_per_cycle"] = own / d_cycles
        out["cpu_workers_s_per_cycle"] = children / d_cycles
        out["own_share_of_cpu"] = own / (own + children) if own + children else float("nan")
        span = last["t"] - first["t"]
        out["cpu_own_percent_of_a_core"] = 100 * own / span if span else float("nan")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=20.0)
    ap.add_argument("--targets", type=int, default=4, help="target names per cycle, all on the cheap server")
    ap.add_argument("--every", type=float, default=0.2)
    ap.add_argument("--window", type=float, default=0.5)
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--write", action="store_true")
    args = ap.parse_args()

    # SIGTERM/SIGINT end the run through the finally below, so no agent, peer or server is left behind.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sys.exit(130))
    work = Path(tempfile.mkdtemp(prefix="agent-soak-"))
    server = subprocess.Popen([sys.executable, "-c", CHEAP_SERVER], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None
    port = int(server.stdout.readline())
    metrics_port = free_port()
    targets = ",".join(f"cheap-{i}=port:{port}" for i in range(args.targets))
    agent_cmd = [sys.executable, "-m", "diagnoser", "agent", "--every", f"{args.every}s", "--jitter", "0",
                 "--window", f"{args.window}s", "--sample-interval", "0.1s", "--grace", "30s", "--max-parallel", "2",
                 "--targets", targets, "--db", str(work / "agent" / "history.db"), "--max-db-mb", "2",
                 "--keep-reports", "5", "--metrics-port", str(metrics_port)]
    log = open(work / "agent.log", "w")  # noqa: SIM115  (closed in the finally below, after the agent stops)
    agent = subprocess.Popen(agent_cmd, stdout=log, stderr=log, env=ENV)
    peer = None
    if not args.no_peer:
        (work / "peer").mkdir()
        peer = subprocess.Popen([sys.executable, "-c", PEER, str(port), str(args.targets), str(args.every),
                                 str(args.window), str(work / "peer")], stdout=log, stderr=log, env=ENV)
    a_samples: list[dict[str, float]] = []
    p_samples: list[dict[str, float]] = []
    t0 = time.monotonic()
    end = t0 + args.minutes * 60
    stop_s = float("nan")
    try:
        ap_proc = psutil.Process(agent.pid)
        pp_proc = psutil.Process(peer.pid) if peer else None
        while time.monotonic() < end:
            time.sleep(args.sample_every)
            t = time.monotonic() - t0
            cycles = agent_cycles(metrics_port)
            if cycles is not None:
                s = sample(ap_proc)
                s.update(t=t, cycles=cycles, db_bytes=folder_bytes(work / "agent") - folder_bytes(work / "agent" /
                                                                                                    "reports"),
                         reports_bytes=folder_bytes(work / "agent" / "reports"))
                a_samples.append(s)
            if pp_proc is not None and (work / "peer" / "cycles").exists():
                s = sample(pp_proc)
                s.update(t=t, cycles=int((work / "peer" / "cycles").read_text() or 0))
                p_samples.append(s)
            if a_samples and len(a_samples) % 12 == 0:
                last = a_samples[-1]
                print(f"{t / 60:5.1f} min  agent cycles {last['cycles']:5d}  rss {last['rss'] / 2**20:6.1f} MiB  "
                      f"fds {last['fds']:3.0f}  db {last['db_bytes'] / 2**20:5.2f} MiB"
                      + (f"   peer cycles {p_samples[-1]['cycles']:5d} rss {p_samples[-1]['rss'] / 2**20:6.1f} MiB"
                         if p_samples else ""), flush=True)
        stopped = time.monotonic()
        agent.send_signal(signal.SIGTERM)
        agent.wait(60)
        stop_s = time.monotonic() - stopped
    finally:
        for p in (agent, peer, server):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        log.close()
        if sys.exc_info()[0] is not None:
            shutil.rmtree(work, ignore_errors=True)
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
        "config": {k: v for k, v in vars(args).items() if k != "write"},
        "agent": summarize(a_samples),
        "agent_sigterm_exit_s": stop_s,
        "agent_exit_code": agent.returncode,
        "peer_in_process": summarize(p_samples) if p_samples else None,
        "raw": {"agent": a_samples, "peer": p_samples},
    }
    a, p = result["agent"], result["peer_in_process"]
    print(json.dumps({k: v for k, v in result.items() if k != "raw"}, indent=2))
    if p:
        print(f"\nRSS, agent vs in-process peer (second-half means): "
              f"{a['rss']['mean_second_half'] / 2**20:.1f} MiB vs {p['rss']['mean_second_half'] / 2**20:.1f} MiB "
              f"(ratio {a['rss']['mean_second_half'] / p['rss']['mean_second_half']:.2f})")
        print(f"RSS slope per 1,000 cycles after warm-up: agent {a['rss']['slope_per_1000_cycles'] / 1024:.0f} KiB, "
              f"peer {p['rss']['slope_per_1000_cycles'] / 1024:.0f} KiB; second half: agent "
              f"{a['rss']['slope_per_1000_cycles_second_half'] / 1024:.0f} KiB, "
              f"peer {p['rss']['slope_per_1000_cycles_second_half'] / 1024:.0f} KiB")
    if args.write:
        out = REPO / "benchmarks" / "out"
        out.mkdir(exist_ok=True)
        (out / "agent_soak.json").write_text(json.dumps(result, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
