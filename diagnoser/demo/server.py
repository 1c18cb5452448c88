"""The demo inference server: a tiny random-weight decoder behind an OpenAI-style HTTP endpoint, with continuous
batching, a paged KV-cache budget and vLLM-named Prometheus metrics.

    python -m diagnoser.demo.server --port 8000          # CUDA when torch sees a GPU, else the CPU
    curl -s localhost:8000/v1/completions -d '{"prompt_tokens": 64, "max_tokens": 32}'
    curl -s localhost:8000/metrics

Endpoints: POST /v1/completions ({"prompt": "text" | [token ids], or "prompt_tokens": N; "max_tokens": M}),
GET /metrics, GET /health. It prints one line, "diagnoser-demo-server ready on http://HOST:PORT", once it serves
(with --port 0 the port is chosen by the OS and that line says which). SIGTERM or SIGINT stop it cleanly.

The engine loop runs in the main thread, like a real engine's scheduler; HTTP requests are handled on threads and
wait for their sequence to finish.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
import time
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

REQUEST_TIMEOUT_S = 300.0
MAX_BODY_BYTES = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m diagnoser.demo.server", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="TCP port; 0 lets the OS choose (default 8000)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--max-num-seqs", type=int, default=16, help="most sequences decoded together (default 16)")
    p.add_argument("--kv-tokens", type=int, default=2048,
                   help="KV-cache budget in tokens, in blocks of 16 (default 2048)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--max-len", type=int, default=512, help="context length (default 512)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    return p


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "diagnoser-demo"
    engine: Any = None
    metrics_text: Any = None

    def log_message(self, format: str, *args: Any) -> None:
        pass  # one line per request would drown the demo's output

    def _send(self, code: int, body: bytes, content_type: str = "application/json") -> None:
        try:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client left (load generator stopped): nothing to answer

    def _json(self, code: int, obj: Any) -> None:
        self._send(code, json.dumps(obj).encode())

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0]
        if path == "/metrics":
            self._send(200, self.metrics_text(), "text/plain; version=0.0.4; charset=utf-8")
        elif path == "/health":
            self._send(200, b"ok\n", "text/plain")
        else:
            self._json(404, {"error": f"no such endpoint {path}"})

    def do_POST(self) -> None:
        from diagnoser.demo.engine import RequestError

        if self.path.split("?", 1)[0] != "/v1/completions":
            self._json(404, {"error": f"no such endpoint {self.path}"})
            return
        try:
            length = int(self.headers.get("Content-Length") or 0)
            if length > MAX_BODY_BYTES:
                raise RequestError("request body too large")
            body = json.loads(self.rfile.read(length) or b"{}")
            prompt, max_tokens = self._prompt(body)
            req = self.engine.submit(prompt, max_tokens)
        except (ValueError, TypeError) as exc:  # RequestError and bad JSON alike
            self._json(400, {"error": str(exc)})
            return
        if not req.done.wait(REQUEST_TIMEOUT_S) or req.error:
            self._json(503, {"error": req.error or "timed out"})
            return
        self._json(200, {
            "id": f"cmpl-{req.id}", "object": "text_completion", "model": "diagnoser-demo-tiny",
            "choices": [{"index": 0, "text": "".join(chr(32 + t % 95) for t in req.output), "finish_reason": "length"}],
            "usage": {"prompt_tokens": len(req.prompt), "completion_tokens": len(req.output),
                      "total_tokens": len(req.prompt) + len(req.output)},
            "timing": {"ttft_s": (req.first_token_at or 0) - req.arrived,
                       "e2e_s": (req.last_token_at or 0) - req.arrived, "preemptions": req.preemptions},
        })

    def _prompt(self, body: Any) -> tuple[list[int], int]:
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        max_tokens = int(body.get("max_tokens", 16))
        if "prompt_tokens" in body:
            return self.engine.random_prompt(int(body["prompt_tokens"])), max_tokens
        prompt = body.get("prompt", "")
        if isinstance(prompt, str):
            return list(prompt.encode()), max_tokens  # a byte-level "tokenizer" is enough for random weights
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt, max_tokens
        raise ValueError("prompt must be a string or a list of token ids")


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default 5 resets connections when many clients connect at once

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], ConnectionError):
            return  # a client that went away mid-request is not a server error
        super().handle_error(request, client_address)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    warnings.filterwarnings("ignore", message=".*NumPy.*")  # torch without numpy warns; the demo needs none
    import torch
    from prometheus_client import generate_latest

    from diagnoser.demo.engine import Engine, Metrics
    from diagnoser.demo.model import ModelConfig, TinyDecoder, pick_device

    torch.set_num_threads(max(1, args.threads))
    try:
        device, dtype = pick_device(args.device)
    except RuntimeError as exc:
        print(f"diagnoser-demo-server: {exc}", file=sys.stderr)
        return 2
    cfg = ModelConfig(vocab=args.vocab, d_model=args.d_model, layers=args.layers, heads=args.heads,
                      max_len=args.max_len)
    model = TinyDecoder(cfg, slots=args.max_num_seqs, device=device, dtype=dtype)
    info = {"device": device, "dtype": str(dtype).removeprefix("torch."), "layers": str(cfg.layers),
            "d_model": str(cfg.d_model), "heads": str(cfg.heads), "vocab": str(cfg.vocab),
            "max_len": str(cfg.max_len), "params": str(cfg.params()), "max_num_seqs": str(args.max_num_seqs),
            "kv_tokens": str(args.kv_tokens)}
    metrics = Metrics(info)
    engine = Engine(model, max_num_seqs=args.max_num_seqs, kv_tokens=args.kv_tokens, metrics=metrics)
    model.prefill(0, [1, 2, 3])  # warm up the kernels before saying ready
    model.decode([0], [3], [4])

    handler = type("Handler", (_Handler,), {"engine": engine,
                                            "metrics_text": staticmethod(lambda: generate_latest(metrics.registry))})
    try:
        httpd = _Server((args.host, args.port), handler)
    except OSError as exc:
        print(f"diagnoser-demo-server: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}",
              file=sys.stderr)
        return 3
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server_thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                     name="http", daemon=True)
    server_thread.start()
    host, port = str(httpd.server_address[0]), httpd.server_address[1]
    print(f"diagnoser-demo-server ready on http://{host}:{port} (device {device}, {cfg.params() / 1e6:.1f} M "
          f"params, max {args.max_num_seqs} sequences, KV {args.kv_tokens} tokens)", flush=True)
    started = time.monotonic()
    try:
        engine.run(stop)
    finally:
        httpd.shutdown()
        httpd.server_close()
    print(f"diagnoser-demo-server stopped after {time.monotonic() - started:.1f} s, {engine.steps} steps",
          flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
