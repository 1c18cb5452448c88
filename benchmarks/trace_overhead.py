"""Throughput a server loses while diagnoser.hook traces it, measured on a real server process.

A single-threaded HTTP server (the model runs on its main thread, as in a simple PyTorch server) imports
diagnoser.hook; one client thread sends requests back to back. Windows of WINDOW seconds alternate: untraced,
then traced with `acquire_trace`. In each window the requests served and the server process's CPU time
(/proc/<pid>/stat) are counted. Two losses are reported (medians over the pairs): from requests per second
(1 - traced/untraced; meaningful on a quiet machine) and from CPU time per request (1 - untraced/traced cost;
what a CPU-bound server loses, and robust to other load on a shared machine). The pause the profiler imposes
around the window (start, stop, export), reported by the hook, is listed apart.

    python benchmarks/trace_overhead.py [--workload mlp|decoder] [--window 3] [--pairs 3]

Results go to benchmarks/out/traces/overhead.json and are summarised in benchmarks/TRACES.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "traces"

SERVER = r'''
import http.server, json, os, sys
from pathlib import Path
import torch
torch.set_num_threads(1)
import diagnoser.hook
workload = sys.argv[2]
if workload == "decoder":
    sys.path.insert(0, sys.argv[3])
    import traces_workload as w
    model = w._model()
    def serve():
        w.generate(model, batch=2, prompt=16, decode_steps=4)
else:
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).eval()
    def serve():
        with torch.no_grad():
            model(torch.randn(16, 256))

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        serve()
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):
        pass

srv = http.server.HTTPServer(("127.0.0.1", 0), Handler)
Path(sys.argv[1]).write_text(str(srv.server_address[1]))
srv.serve_forever(poll_interval=0.05)
'''


class Load:
    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/"
        self.count = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                with urllib.request.urlopen(self.url, timeout=60) as r:
                    r.read()
            except OSError:
                if self.stop.is_set():
                    return
                raise
            self.count += 1

    def rate_over(self, seconds: float, pid: int) -> tuple[float, float]:
        """(requests per second, server CPU ms per request) over the next `seconds`."""
        c0, t0, cpu0 = self.count, time.perf_counter(), _cpu_s(pid)
        time.sleep(seconds)
        served = self.count - c0
        return served / (time.perf_counter() - t0), 1e3 * (_cpu_s(pid) - cpu0) / max(1, served)


def _cpu_s(pid: int) -> float:
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rfind(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("mlp", "decoder"), default="mlp")
    ap.add_argument("--window", type=float, default=3.0)
    ap.add_argument("--pairs", type=int, default=3)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    from diagnoser.tracing import protocol
    from diagnoser.tracing.acquire import acquire_trace_detailed

    tmp = Path(tempfile.mkdtemp(prefix="trace-overhead-"))
    os.environ["DIAGNOSER_HOOK_DIR"] = str(tmp / "registry")
    (tmp / "server.py").write_text(SERVER)
    port_file = tmp / "port"
    proc = subprocess.Popen([sys.executable, str(tmp / "server.py"), str(port_file), args.workload,
                             str(ROOT / "tests")], cwd=ROOT, stderr=subprocess.DEVNULL)
    try:
        while not (port_file.exists() and port_file.read_text()):
            time.sleep(0.05)
        while not protocol.read_json(protocol.registration_path(proc.pid)):
            time.sleep(0.05)
        load = Load(int(port_file.read_text()))
        load.rate_over(2.0, proc.pid)  # warm-up
        pairs = []
        for i in range(args.pairs):
            base, base_cost = load.rate_over(args.window, proc.pid)
            result: dict[str, object] = {}
            t = threading.Thread(target=lambda result=result, i=i: result.update(
                a=acquire_trace_detailed(proc.pid, args.window, tmp / f"out{i}")))
            t.start()
            # count only inside the window: from the hook's "started" to the timer's stop
            deadline = time.monotonic() + 180
            while not any((protocol.read_json(p) or {}).get("state") == "started"
                          for p in protocol.registry_dir().glob(f"{proc.pid}.*.status.json")):
                if time.monotonic() > deadline:
                    raise SystemExit("the hook did not start a window")
                time.sleep(0.01)
            traced, traced_cost = load.rate_over(args.window * 0.9, proc.pid)
            t.join()
            acquired = result["a"]
            status = acquired.statuses[0]  # type: ignore[attr-defined]
            pairs.append({"untraced_rps": base, "traced_rps": traced, "loss": 1 - traced / base,
                          "untraced_cpu_ms_per_req": base_cost, "traced_cpu_ms_per_req": traced_cost,
                          "cpu_loss": 1 - base_cost / traced_cost,
                          "start_pause_ms": status.get("start_pause_ms"), "stop_pause_ms": status.get("stop_pause_ms"),
                          "export_pause_ms": status.get("export_pause_ms"), "trace_bytes": status.get("bytes")})
        load.stop.set()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    summary = {"workload": args.workload, "window_s": args.window, "pairs": pairs,
               "median_loss": statistics.median(p["loss"] for p in pairs),
               "median_cpu_loss": statistics.median(p["cpu_loss"] for p in pairs),
               "date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"overhead-{args.workload}.json").write_text(json.dumps(summary, indent=1))
    print(f"workload {args.workload}, {args.window:g} s windows, load avg {os.getloadavg()[0]:.1f}")
    print("| pair | untraced req/s | traced req/s | loss (req/s) | untraced CPU ms/req | traced CPU ms/req "
          "| loss (CPU/req) | start ms | stop ms | export ms | trace MB |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for i, p in enumerate(pairs):
        print(f"| {i} | {p['untraced_rps']:.1f} | {p['traced_rps']:.1f} | {p['loss']:.0%} | "
              f"{p['untraced_cpu_ms_per_req']:.2f} | {p['traced_cpu_ms_per_req']:.2f} | {p['cpu_loss']:.0%} | "
              f"{p['start_pause_ms']:.0f} | {p['stop_pause_ms']:.0f} | {p['export_pause_ms']:.0f} | "
              f"{(p['trace_bytes'] or 0) / 1e6:.1f} |")
    print(f"median throughput loss while tracing: {summary['median_loss']:.0%} from req/s, "
          f"{summary['median_cpu_loss']:.0%} from CPU time per request")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
