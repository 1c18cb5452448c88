"""A bounded closed-loop load generator for the demo server, on this machine only.

`concurrency` workers each send one completion request, wait for the answer and send the next, until the duration
or the request budget runs out (closed loop: the load adapts to the server's speed instead of piling up). Prompt and
output lengths are drawn uniformly from the given ranges with a fixed seed, so runs are comparable.

    python -m diagnoser.demo.loadgen --url http://127.0.0.1:8000 --concurrency 16 --duration 20

It refuses any host but the loopback: it is a demo tool, not a benchmark to point at other people's servers.
"""

from __future__ import annotations

import argparse
import http.client
import ipaddress
import json
import random
import signal
import socket
import sys
import threading
import time
import urllib.parse
from dataclasses import asdict, dataclass, field

MAX_CONSECUTIVE_ERRORS = 20


@dataclass
class LoadResult:
    requests: int = 0
    errors: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    latencies_s: list[float] = field(default_factory=list)
    last_error: str = ""

    def summary(self) -> dict[str, float | int | str]:
        lat = sorted(self.latencies_s)
        out = {k: v for k, v in asdict(self).items() if k != "latencies_s"}
        out["requests_per_s"] = self.requests / self.elapsed_s if self.elapsed_s else 0.0
        out["completion_tokens_per_s"] = self.completion_tokens / self.elapsed_s if self.elapsed_s else 0.0
        if lat:
            out["latency_p50_s"] = lat[len(lat) // 2]
            out["latency_p99_s"] = lat[min(len(lat) - 1, int(len(lat) * 0.99))]
        return out


def check_loopback(url: str) -> tuple[str, int]:
    parsed = urllib.parse.urlparse(url)
    host, port = parsed.hostname or "", parsed.port or 80
    if parsed.scheme != "http" or not host:
        raise ValueError(f"the load generator needs an http://127.0.0.1:PORT URL, not {url!r}")
    try:
        addresses = {str(info[4][0]) for info in socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)}
    except socket.gaierror as exc:
        raise ValueError(f"cannot resolve {host}: {exc}") from None
    if not addresses or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
        raise ValueError(f"the load generator only targets this machine (127.0.0.1), not {host}")
    return host, port


def run_load(url: str, *, concurrency: int = 8, duration_s: float = 10.0, prompt_tokens: tuple[int, int] = (32, 192),
             max_tokens: tuple[int, int] = (16, 64), max_requests: int | None = None, seed: int = 0,
             stop: threading.Event | None = None) -> LoadResult:
    host, port = check_loopback(url)
    if concurrency < 1 or duration_s <= 0:
        raise ValueError("concurrency must be at least 1 and the duration positive")
    stop = stop or threading.Event()
    result = LoadResult()
    lock = threading.Lock()
    deadline = time.monotonic() + duration_s
    budget = [max_requests if max_requests is not None else -1]

    def take_ticket() -> bool:
        with lock:
            if budget[0] == 0:
                return False
            budget[0] -= 1
            return True

    def worker(index: int) -> None:
        rng = random.Random(seed * 1000 + index)
        conn: http.client.HTTPConnection | None = None
        consecutive = 0
        while not stop.is_set() and time.monotonic() < deadline and take_ticket():
            body = json.dumps({"prompt_tokens": rng.randint(*prompt_tokens), "max_tokens": rng.randint(*max_tokens)})
            started = time.monotonic()
            try:
                conn = conn or http.client.HTTPConnection(host, port, timeout=max(5.0, duration_s))
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                response = conn.getresponse()
                payload = response.read()
                if response.status != 200:
                    raise RuntimeError(f"HTTP {response.status}: {payload[:200]!r}")
                usage = json.loads(payload)["usage"]
            except (OSError, RuntimeError, ValueError, KeyError, http.client.HTTPException) as exc:
                consecutive += 1
                with lock:
                    result.errors += 1
                    result.last_error = str(exc)
                if conn is not None:
                    conn.close()
                    conn = None
                if consecutive >= MAX_CONSECUTIVE_ERRORS:
                    return
                stop.wait(0.2)
                continue
            consecutive = 0
            with lock:
                result.requests += 1
                result.prompt_tokens += int(usage["prompt_tokens"])
                result.completion_tokens += int(usage["completion_tokens"])
                result.latencies_s.append(time.monotonic() - started)
        if conn is not None:
            conn.close()

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,), name=f"load-{i}", daemon=True) for i in range(concurrency)]
    for th in threads:
        th.start()
    for th in threads:
        # Once stopped, do not wait for answers still in flight: the workers are daemons.
        while th.is_alive() and not stop.is_set():
            th.join(0.2)
    with lock:
        result.elapsed_s = time.monotonic() - started
        return LoadResult(result.requests, result.errors, result.prompt_tokens, result.completion_tokens,
                          result.elapsed_s, list(result.latencies_s), result.last_error)


def _range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    a, b = int(lo), int(hi or lo)
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"{text!r} is not a range like 32:192")
    return a, b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m diagnoser.demo.loadgen", description=__doc__.split("\n")[0])
    p.add_argument("--url", required=True, help="the demo server, e.g. http://127.0.0.1:8000")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--duration", type=float, default=10.0, help="seconds (default 10)")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--prompt-tokens", type=_range, default=(32, 192), help="range, e.g. 32:192")
    p.add_argument("--max-tokens", type=_range, default=(16, 64), help="range, e.g. 16:64")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        result = run_load(args.url, concurrency=args.concurrency, duration_s=args.duration,
                          prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens,
                          max_requests=args.max_requests, seed=args.seed, stop=stop)
    except ValueError as exc:
        print(f"loadgen: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result.summary()), flush=True)
    return 0 if result.requests else 1


if __name__ == "__main__":
    raise SystemExit(main())
