"""A light stand-in for an inference server, for tests that need many real processes on a loaded 2-core machine.

`python -m tests.light_server [--page vllm|oversize|dcgm] [--model-name NAME] [extra argv...]` listens on a free
port on 127.0.0.1 and prints "ready PORT" once it serves. Pages:

- vllm: vLLM-named gauges and counters that move between scrapes (what `attach` and the agent read);
- oversize: a /metrics page larger than any collector accepts (a broken or hostile endpoint);
- dcgm: one GPU as dcgm-exporter prints it, with `--model-name` as its modelName label (hostile labels).

GET /stats answers how many /metrics requests were served, so tests poll the window's progress instead of sleeping.
`--profile-into DIR --on-stop ok|die` adds vLLM's POST /start_profile and /stop_profile: the stop writes a real
trace (a fixture) into DIR, then answers 200 ("ok") or kills the server before answering ("die", as a vLLM whose
post-processing ran out of memory). A command line with `vllm` and `--profiler-config.torch_profiler_dir=DIR` in
its extra words makes it look like a vLLM started with its profiler on.
`--worker` starts a child that listens on TCP ports that never speak HTTP (as a vLLM worker's ZMQ and gloo ports)
and prints "worker PID" before "ready PORT": the process nvidia-smi would list, whose parent serves the page.
Extra argv words are ignored: they let a test put what it wants (escape sequences) into the process's command line.
"""

from __future__ import annotations

import argparse
import http.server
import json
import math
import sys
import threading
import time

_OVERSIZE_BYTES = 40 << 20  # above server_metrics.MAX_BODY_BYTES (32 MiB)


class _State:
    def __init__(self, page: str, model_name: str, profile_into: str = "", on_stop: str = "ok") -> None:
        self.page = page
        self.model_name = model_name
        self.profile_into = profile_into
        self.on_stop = on_stop
        self.scrapes = 0
        self.lock = threading.Lock()
        self.t0 = time.monotonic()

    def vllm(self) -> bytes:
        t = time.monotonic() - self.t0
        running = 8 + 4 * math.sin(t)
        lines = [
            "# TYPE vllm:num_requests_running gauge", f'vllm:num_requests_running{{model_name="m"}} {running:.3f}',
            "# TYPE vllm:num_requests_waiting gauge", f'vllm:num_requests_waiting{{model_name="m"}} {2 + t % 3:.3f}',
            "# TYPE vllm:kv_cache_usage_perc gauge", f'vllm:kv_cache_usage_perc{{model_name="m"}} {0.5 + 0.1 * math.sin(t):.4f}',
            "# TYPE vllm:generation_tokens_total counter", f'vllm:generation_tokens_total{{model_name="m"}} {400 * t:.1f}',
            "# TYPE vllm:prompt_tokens_total counter", f'vllm:prompt_tokens_total{{model_name="m"}} {900 * t:.1f}',
            "# TYPE vllm:request_success_total counter", f'vllm:request_success_total{{model_name="m"}} {int(3 * t)}',
        ]
        return ("\n".join(lines) + "\n").encode()

    def dcgm(self) -> bytes:
        t = time.monotonic() - self.t0
        labels = (f'gpu="0",UUID="GPU-00000000-1111-2222-3333-444444444444",pci_bus_id="00000000:01:00.0",'
                  f'device="nvidia0",modelName="{self.model_name}",Hostname="node-a"')
        fields = {"DCGM_FI_DEV_GPU_UTIL": 90 + 5 * math.sin(t), "DCGM_FI_PROF_GR_ENGINE_ACTIVE": 0.9,
                  "DCGM_FI_PROF_DRAM_ACTIVE": 0.8 + 0.05 * math.sin(t), "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE": 0.2,
                  "DCGM_FI_DEV_FB_USED": 40000 + t, "DCGM_FI_DEV_FB_FREE": 41000, "DCGM_FI_DEV_POWER_USAGE": 500.0,
                  "DCGM_FI_DEV_SM_CLOCK": 1980}
        lines = []
        for name, value in fields.items():
            lines += [f"# HELP {name} {name}.", f"# TYPE {name} gauge", f"{name}{{{labels}}} {value}"]
        return ("\n".join(lines) + "\n").encode()


def _handler(state: _State) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            if self.path == "/stats":
                with state.lock:
                    body = json.dumps({"scrapes": state.scrapes}).encode()
                return self._send(body, "application/json")
            if self.path != "/metrics":
                return self._send(b"not found\n", "text/plain", 404)
            with state.lock:
                state.scrapes += 1
            if state.page == "oversize":
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(_OVERSIZE_BYTES))
                self.end_headers()
                chunk = b"# " + b"x" * 65533 + b"\n"
                try:
                    for _ in range(_OVERSIZE_BYTES // len(chunk)):
                        self.wfile.write(chunk)
                    self.wfile.write(b"#" * (_OVERSIZE_BYTES % len(chunk)))
                except OSError:
                    pass  # the reader gave up, as it should
                return None
            body = state.dcgm() if state.page == "dcgm" else state.vllm()
            return self._send(body, "text/plain; version=0.0.4")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if length:
                self.rfile.read(length)
            if not state.profile_into or self.path not in ("/start_profile", "/stop_profile"):
                return self._send(b"not found\n", "text/plain", 404)
            if self.path == "/stop_profile":
                import os
                import shutil
                from pathlib import Path
                src = Path(__file__).parent / "fixtures" / "gpu" / "traces"
                trace = sorted(src.glob("*.json*"))[0]
                shutil.copy(trace, Path(state.profile_into) / f"worker_{os.getpid()}{''.join(trace.suffixes)}")
                if state.on_stop == "die":
                    os._exit(137)  # killed in post-processing, before answering
            return self._send(b"{}", "application/json")

        def _send(self, body: bytes, ctype: str, code: int = 200) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            # One request per scrape: a new connection each time, so /stats counts scrapes, not retries.
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--page", choices=("vllm", "oversize", "dcgm"), default="vllm")
    parser.add_argument("--model-name", default="NVIDIA H100 80GB HBM3")
    parser.add_argument("--worker", action="store_true")
    parser.add_argument("--profile-into", default="")
    parser.add_argument("--on-stop", choices=("ok", "die"), default="ok")
    args, _extra = parser.parse_known_args(argv)
    if args.worker:
        import subprocess
        # Three listeners: one silent, one that sends a ZMQ-like greeting, one that closes at once.
        code = ("import socket, threading, time\n"
                "def serve(mode):\n"
                "    s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(8)\n"
                "    while True:\n"
                "        c, _ = s.accept()\n"
                "        if mode == 1: c.sendall(bytes([0xff] + [0] * 8 + [0x7f]))\n"
                "        if mode == 2: c.close()\n"
                "for m in (0, 1, 2): threading.Thread(target=serve, args=(m,), daemon=True).start()\n"
                "time.sleep(600)\n")
        child = subprocess.Popen([sys.executable, "-c", code])
        print(f"worker {child.pid}", flush=True)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(_State(args.page, args.model_name, args.profile_into, args.on_stop)))
    server.daemon_threads = True
    print(f"ready {server.server_address[1]}", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
