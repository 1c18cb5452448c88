"""One self-test scenario as a process a user could attach to:

    python -m diagnoser.selftest.workload decode-b1 --size auto --seconds 60 --ready-file ready.json

It serves its own Prometheus /metrics on 127.0.0.1 under vLLM's names (requests running and waiting, KV-cache use,
prompt and generation token counters, tokens per iteration), so `diagnoser attach` reads it exactly as it reads a
vLLM server. Once warm (model built, CUDA graph captured, step time measured) it writes the ready file: its PID,
metrics URL, model shape and plan. It runs until --seconds pass or SIGTERM, then writes its own totals to
--stats-file.

Requests are a closed loop of `clients` concurrent users: a finished sequence is replaced at once by the next request,
and requests beyond the batch limit wait in the queue. KV-cache use is the share of the KV pool's slots that running
sequences hold (a slot is reserved per sequence at admission, as static-cache servers do); only kv-full sizes the
pool to fill the device memory, so only there does a full cache cap the batch.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from diagnoser.fileio import write_atomic
from diagnoser.selftest.scenarios import SCENARIOS, Plan, kv_slots_to_fill, plan

# vLLM's bucket boundaries (vllm/v1/metrics/loggers.py), so the histograms read the same.
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# Memory kept free beside the KV slots of kv-full: activations, the CUDA graph's pool, cuBLAS workspaces.
KV_FULL_RESERVE_BYTES = 3 << 30
# Steps a CUDA decode loop may run ahead of the GPU before it waits: the counters stay honest, the GPU stays fed.
MAX_STEPS_AHEAD = 2
# torch._scaled_mm's FP8 GEMMs run on Ada (8.9) and newer.
FP8_MIN_CAPABILITY = (8, 9)


class Metrics:
    """The vLLM-named metrics this workload has; the KV gauge only where there is a KV cache."""

    def __init__(self, model_name: str, *, kv_cache: bool) -> None:
        r = self.registry = CollectorRegistry()
        label = ["model_name"]

        def make(kind: Any, name: str, doc: str, **kw: Any) -> Any:
            return kind(name, doc, label, registry=r, **kw).labels(model_name)

        self.running = make(Gauge, "vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = make(Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = make(Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.") \
            if kv_cache else None
        self.prompt_tokens = make(Counter, "vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = make(Counter, "vllm:generation_tokens", "Number of generation tokens processed.")
        self.success = make(Counter, "vllm:request_success", "Count of successfully processed requests.")
        # These workloads never preempt (a sequence keeps its slot until done): the counter stays at zero, truly.
        self.preemptions = make(Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.itl = make(Histogram, "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        buckets=ITL_BUCKETS)
        self.iteration_tokens = make(Histogram, "vllm:iteration_tokens_total",
                                     "Histogram of number of tokens per engine_step.", buckets=ITERATION_BUCKETS)


class Workload:
    def __init__(self, p: Plan, torch: Any, device: str, deadline: float) -> None:
        self.p, self.torch, self.device = p, torch, device
        self.deadline = deadline
        self.stopping = False
        self.steps = 0
        self.gen_tokens = 0
        self.prompt_tokens = 0
        self.started = 0.0
        self.step_s = 0.0
        self.host_work_s = 0.0
        self.rng = random.Random(0)
        self.info: dict[str, Any] = {}

    def stop(self, *_args: Any) -> None:
        self.stopping = True

    def done(self) -> bool:
        return self.stopping or time.monotonic() >= self.deadline

    def sync(self) -> None:
        if self.device.startswith("cuda"):
            self.torch.cuda.synchronize()

    def prompts(self, count: int, length: int) -> Any:
        return self.torch.randint(0, self.p.shape.vocab, (count, length), device=self.device)


def python_work(seconds: float) -> None:
    """Host work in the serving thread, the way sampling and detokenising are: pure Python until `seconds` pass."""
    end = time.perf_counter() + seconds
    text: list[str] = []
    i = 0
    while time.perf_counter() < end:
        text.append(chr(97 + i % 26))
        i += 1
        if len(text) > 4096:
            "".join(text)
            text.clear()


def _write_json(path: Path, data: dict[str, Any]) -> None:
    write_atomic(path, json.dumps(data).encode())  # the harness polls for the file: never let it read half


def _dtype(torch: Any, name: str) -> Any:
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


def run_decode(w: Workload, model: Any, metrics: Metrics, ready: Any) -> None:
    from diagnoser.selftest.model import DecodeRunner, KvCache

    p, torch = w.p, w.torch
    pool, slots, clients = max(p.kv_slots, p.batch), p.batch, p.clients
    if p.fill_memory:
        free, _ = torch.cuda.mem_get_info()
        element = torch.finfo(_dtype(torch, p.dtype)).bits // 8
        pool = slots = kv_slots_to_fill(p.shape, element, p.max_ctx, int(free), p.fill_memory, KV_FULL_RESERVE_BYTES)
        clients = slots + max(4, slots // 4)
    cache = KvCache.allocate(p.shape, pool, p.max_ctx, w.device, _dtype(torch, p.dtype))
    w.info.update(batch=slots, clients=clients, kv_slots=pool, kv_cache_bytes=cache.nbytes)
    max_gen = p.max_ctx - p.prompt - 1
    runner = DecodeRunner(model, cache.first(slots), graph=p.graph, compiled=p.compiled)
    runner.start(list(range(slots)), w.prompts(slots, p.prompt))
    # Stagger the requests' lengths so sequences finish at different steps, as in continuous batching.
    remaining = [w.rng.randint(1, max_gen) for _ in range(slots)]
    w.sync()
    timings = []
    for _ in range(5):
        t0 = time.perf_counter()
        runner.step()
        w.sync()
        timings.append(time.perf_counter() - t0)
    w.step_s = sorted(timings)[len(timings) // 2]
    w.host_work_s = p.host_work * w.step_s
    w.info.update(step_s=w.step_s, host_work_s=w.host_work_s)
    # The warm-up steps advanced every sequence: point them back at their prompts' ends (the prompts' K/V stay).
    runner.positions.fill_(p.prompt)
    running = min(slots, clients)
    metrics.running.set(running)
    metrics.waiting.set(clients - running)
    assert metrics.kv_usage is not None  # decode workloads have a KV cache
    metrics.kv_usage.set(running / pool)
    ready()
    w.started = time.monotonic()
    cuda = w.device.startswith("cuda")
    in_flight: list[Any] = []
    last = time.perf_counter()
    while not w.done():
        runner.step()
        if p.sync_every_step:
            runner.tokens.tolist()  # the server reads the new tokens back to stream them
        elif cuda:
            event = torch.cuda.Event()
            event.record()
            in_flight.append(event)
            if len(in_flight) > MAX_STEPS_AHEAD:
                in_flight.pop(0).synchronize()
        if w.host_work_s:
            python_work(w.host_work_s)
        w.steps += 1
        w.gen_tokens += slots
        metrics.generation_tokens.inc(slots)
        metrics.iteration_tokens.observe(slots)
        now = time.perf_counter()
        metrics.itl.observe(now - last)
        last = now
        finished = []
        for slot in range(slots):
            remaining[slot] -= 1
            if remaining[slot] <= 0:
                finished.append(slot)
                remaining[slot] = max_gen
        if finished:  # the next requests take the freed slots at once
            runner.start(finished, w.prompts(len(finished), p.prompt))
            metrics.success.inc(len(finished))
            w.prompt_tokens += p.prompt * len(finished)
            metrics.prompt_tokens.inc(p.prompt * len(finished))
    w.sync()


def run_prefill(w: Workload, model: Any, metrics: Metrics, ready: Any) -> None:
    p = w.p
    w.info.update(batch=p.prefill_batch, clients=p.clients, prefill_tokens=p.prefill_batch * p.prefill_len)

    def batch() -> Any:
        return w.prompts(p.prefill_batch, p.prefill_len)

    model.prefill(batch())
    w.sync()
    t0 = time.perf_counter()
    model.prefill(batch())
    w.sync()
    w.step_s = time.perf_counter() - t0
    w.info["step_s"] = w.step_s
    metrics.running.set(p.prefill_batch)
    metrics.waiting.set(max(0, p.clients - p.prefill_batch))
    ready()
    w.started = time.monotonic()
    tokens = p.prefill_batch * p.prefill_len
    while not w.done():
        first = model.prefill(batch())
        first.tolist()  # each request's first token goes back to its client
        w.steps += 1
        w.prompt_tokens += tokens
        w.gen_tokens += p.prefill_batch
        metrics.prompt_tokens.inc(tokens)
        metrics.generation_tokens.inc(p.prefill_batch)
        metrics.success.inc(p.prefill_batch)
        metrics.iteration_tokens.observe(tokens)


def _install_trace_hook() -> bool:
    """Let `diagnoser attach --trace` profile this process: the hook runs the profiler on the main thread."""
    try:
        import diagnoser.hook  # noqa: F401  (importing it installs the signal-triggered profiler)
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m diagnoser.selftest.workload", description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario", choices=sorted(SCENARIOS))
    ap.add_argument("--size", choices=("auto", "toy"), default="auto")
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--seconds", type=float, default=60.0, help="run at most this long after warming up")
    ap.add_argument("--port", type=int, default=0, help="metrics port on 127.0.0.1 (0: any free port)")
    ap.add_argument("--ready-file", type=Path, help="written (JSON) once warm: pid, metrics URL, model, plan")
    ap.add_argument("--stats-file", type=Path, help="written (JSON) at exit: steps, tokens, rates")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (CPU runs)")
    ap.add_argument("--compile", action="store_true", help="decode: run the step through torch.compile")
    args = ap.parse_args(argv)

    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        print("selftest workload: --device cuda, but PyTorch sees no CUDA device.", file=sys.stderr)
        return 3
    if device == "cpu":
        torch.set_num_threads(max(1, args.threads))
    free = int(torch.cuda.mem_get_info()[0]) if device == "cuda" else None
    p = plan(args.scenario, device=device, size=args.size, free_bytes=free)
    if args.compile and p.mode == "decode":
        p = replace(p, compiled=True)
    if device == "cuda" and p.graph and not hasattr(torch.cuda, "CUDAGraph"):
        p = replace(p, graph=False)
    if p.weights == "fp8" and device == "cuda" and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        major, minor = torch.cuda.get_device_capability()
        why = (f"needs FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, Blackwell); this GPU is "
               f"{major}.{minor}")
        if args.ready_file is not None:
            _write_json(args.ready_file, {"pid": os.getpid(), "scenario": p.scenario, "skipped": why})
        print(f"selftest workload: {p.scenario} {why}.", file=sys.stderr)
        return 0
    from diagnoser.selftest.model import Decoder

    metrics = Metrics(p.shape.name, kv_cache=p.mode == "decode")
    server, _thread = start_http_server(args.port, addr="127.0.0.1", registry=metrics.registry)
    port = server.server_port
    w = Workload(p, torch, device, deadline=time.monotonic() + 3600)
    signal.signal(signal.SIGTERM, w.stop)
    signal.signal(signal.SIGINT, w.stop)
    hooked = _install_trace_hook()
    model = Decoder(p.shape, device=device, dtype=_dtype(torch, p.dtype), fp8=p.weights == "fp8")
    context = p.max_ctx if p.mode == "decode" else p.prefill_len

    def ready() -> None:
        w.deadline = time.monotonic() + args.seconds
        if args.ready_file is None:
            return
        _write_json(args.ready_file, {
            "pid": os.getpid(), "port": port, "metrics_url": f"http://127.0.0.1:{port}/metrics",
            "scenario": p.scenario, "device": device,
            "gpu_name": torch.cuda.get_device_name() if device == "cuda" else "",
            "torch": str(torch.__version__), "trace_hook": hooked,
            "model": msgspec.to_builtins(p.shape.model_info(p.weight_dtype, context, kv_dtype=p.dtype)),
            "plan": {k: v for k, v in asdict(p).items() if k != "shape"},
            # KV tokens each decode step reads per sequence: the whole static slot.
            "context_read": p.max_ctx if p.mode == "decode" else 0,
            **w.info,
        })

    try:
        (run_decode if p.mode == "decode" else run_prefill)(w, model, metrics, ready)
    finally:
        elapsed = time.monotonic() - w.started if w.started else 0.0
        if args.stats_file is not None:
            _write_json(args.stats_file, {
                "steps": w.steps, "gen_tokens": w.gen_tokens, "prompt_tokens": w.prompt_tokens,
                "elapsed_s": elapsed, "step_s": w.step_s,
                "gen_tokens_per_s": w.gen_tokens / elapsed if elapsed > 0 else 0.0,
                "prompt_tokens_per_s": w.prompt_tokens / elapsed if elapsed > 0 else 0.0,
            })
        server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
