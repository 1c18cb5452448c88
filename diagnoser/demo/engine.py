"""The demo server's engine: continuous batching over a paged KV-cache budget, with vLLM-named metrics.

Each step admits waiting requests while a sequence slot and enough KV blocks are free (prefilling each), then runs
one decode step for every running sequence together. KV memory is accounted in blocks of 16 tokens, as vLLM's
paged attention does; when a growing sequence needs a block and none is free, the youngest running sequence is
preempted (its blocks freed, re-queued at the front, recomputed later). That is what makes a too-small KV budget
show up exactly as it does in vLLM: KV usage near 1, requests waiting, preemptions counted.
"""

from __future__ import annotations

import itertools
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from diagnoser.demo.model import TinyDecoder

BLOCK_TOKENS = 16
# vLLM's own bucket boundaries (vllm/v1/metrics/loggers.py), so histograms read the same.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
               480.0, 960.0, 1920.0, 7680.0)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
MODEL_NAME = "diagnoser-demo-tiny"


class RequestError(ValueError):
    """A request the engine cannot serve; the message goes back to the client with HTTP 400."""


@dataclass
class Request:
    id: int
    prompt: list[int]
    max_tokens: int
    arrived: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    slot: int | None = None
    blocks: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    preemptions: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""

    @property
    def cached_tokens(self) -> int:
        """Tokens whose K/V sit in the cache: the prompt and every generated token but the newest."""
        return len(self.prompt) + max(0, len(self.output) - 1)


class Metrics:
    """vLLM's metric names for the signals the demo has, on the demo's own registry."""

    def __init__(self, info: dict[str, str]) -> None:
        r = self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.running = Gauge("vllm:num_requests_running", "Number of requests in model execution batches.", labels,
                             registry=r).labels(MODEL_NAME)
        self.waiting = Gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", labels,
                             registry=r).labels(MODEL_NAME)
        self.kv_usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", labels,
                              registry=r).labels(MODEL_NAME)
        self.preemptions = Counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                   labels, registry=r).labels(MODEL_NAME)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.", labels,
                                     registry=r).labels(MODEL_NAME)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.", labels,
                                         registry=r).labels(MODEL_NAME)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               labels + ["finished_reason"], registry=r).labels(MODEL_NAME, "length")
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=r).labels(MODEL_NAME)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             labels, buckets=ITL_BUCKETS, registry=r).labels(MODEL_NAME)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             labels, buckets=E2E_BUCKETS, registry=r).labels(MODEL_NAME)
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per "
                                          "engine_step.", labels, buckets=ITERATION_BUCKETS,
                                          registry=r).labels(MODEL_NAME)
        Gauge("diagnoser_demo_info", "The diagnoser demo server and its configuration.", list(info),
              registry=r).labels(*info.values()).set(1)


class Engine:
    def __init__(self, model: TinyDecoder, *, max_num_seqs: int, kv_tokens: int, metrics: Metrics,
                 max_prefill_tokens: int = 2048) -> None:
        self.model = model
        self.max_num_seqs = max_num_seqs
        self.total_blocks = max(1, kv_tokens // BLOCK_TOKENS)
        self.free_blocks = self.total_blocks
        self.free_slots = list(range(max_num_seqs))[::-1]
        self.max_prefill_tokens = max_prefill_tokens
        self.metrics = metrics
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.cond = threading.Condition()
        self.ids = itertools.count(1)
        self.stopping = False
        self.steps = 0
        self.rng = random.Random(0)

    # --- called from HTTP threads -----------------------------------------------------------------------------

    def submit(self, prompt: list[int], max_tokens: int) -> Request:
        limit = self.model.cfg.max_len
        if not prompt:
            raise RequestError("the prompt is empty")
        if max_tokens < 1:
            raise RequestError("max_tokens must be at least 1")
        if len(prompt) + max_tokens > limit:
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                               f"context of {limit}")
        if _blocks(len(prompt) + max_tokens) > self.total_blocks:
            raise RequestError(f"the request needs more KV cache than the server has ({self.total_blocks} blocks)")
        req = Request(next(self.ids), [t % self.model.cfg.vocab for t in prompt], max_tokens)
        with self.cond:
            if self.stopping:
                raise RequestError("the server is shutting down")
            self.waiting.append(req)
            self.metrics.waiting.set(len(self.waiting))
            self.cond.notify()
        return req

    def random_prompt(self, n: int) -> list[int]:
        with self.cond:
            return [self.rng.randrange(self.model.cfg.vocab) for _ in range(n)]

    # --- the loop (main thread) -------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            if not self.step():
                with self.cond:
                    if not self.waiting and not stop.is_set():
                        self.cond.wait(0.05)
        with self.cond:
            self.stopping = True
            pending = list(self.waiting) + self.running
            self.waiting.clear()
            self.running = []
        for req in pending:
            req.error = "the server shut down"
            req.done.set()

    def step(self) -> bool:
        """One engine iteration: admit and prefill, then one decode step for all running. False if idle."""
        now = time.monotonic()
        prefill_tokens = self._admit(now)
        decoded = self._decode()
        if not prefill_tokens and not decoded:
            self._gauges()
            return False
        self.steps += 1
        self.metrics.iteration_tokens.observe(prefill_tokens + decoded)
        self._gauges()
        return True

    def _admit(self, now: float) -> int:
        tokens = 0
        while True:
            with self.cond:
                if not self.waiting or not self.free_slots or tokens >= self.max_prefill_tokens:
                    return tokens
                req = self.waiting[0]
                context = req.prompt + req.output  # a preempted request recomputes what it had generated
                need = _blocks(len(context) + 1)
                if need > self.free_blocks:
                    return tokens
                self.waiting.popleft()
                req.slot, req.blocks = self.free_slots.pop(), need
                self.free_blocks -= need
            first = self.model.prefill(req.slot, context)
            tokens += len(context)
            self.metrics.prompt_tokens.inc(len(context))
            self.running.append(req)
            self._emit(req, first, time.monotonic())

    def _decode(self) -> int:
        batch = [r for r in self.running if not r.done.is_set()]
        if not batch:
            return 0
        # Each sequence writes one more K/V entry; grow its block allocation first, preempting if memory is short.
        for req in list(batch):
            if req not in self.running:
                continue
            if _blocks(req.cached_tokens + 1) > req.blocks:
                while self.free_blocks == 0 and self._preempt_youngest(exclude=req):
                    pass
                if self.free_blocks == 0:
                    self._preempt(req)
                    continue
                req.blocks += 1
                self.free_blocks -= 1
        batch = [r for r in self.running if not r.done.is_set()]
        if not batch:
            return 0
        positions = [r.cached_tokens for r in batch]
        nexts = self.model.decode([r.slot for r in batch], positions, [r.output[-1] for r in batch])  # type: ignore[misc]
        now = time.monotonic()
        for req, token in zip(batch, nexts, strict=True):
            self._emit(req, token, now)
        return len(batch)

    def _emit(self, req: Request, token: int, now: float) -> None:
        req.output.append(token)
        self.metrics.generation_tokens.inc()
        if req.first_token_at is None:
            req.first_token_at = now
            self.metrics.ttft.observe(now - req.arrived)
        elif req.last_token_at is not None:
            self.metrics.itl.observe(now - req.last_token_at)
        req.last_token_at = now
        if len(req.output) >= req.max_tokens:
            self._release(req)
            self.metrics.success.inc()
            self.metrics.e2e.observe(now - req.arrived)
            req.done.set()

    def _preempt_youngest(self, exclude: Request) -> bool:
        candidates = [r for r in self.running if r is not exclude]
        if not candidates:
            return False
        self._preempt(max(candidates, key=lambda r: r.arrived))
        return True

    def _preempt(self, req: Request) -> None:
        self._release(req)
        req.preemptions += 1
        self.metrics.preemptions.inc()
        with self.cond:
            self.waiting.appendleft(req)

    def _release(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        with self.cond:
            if req.slot is not None:
                self.free_slots.append(req.slot)
            self.free_blocks += req.blocks
            req.slot, req.blocks = None, 0

    def _gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.waiting.set(len(self.waiting))
        self.metrics.kv_usage.set(1.0 - self.free_blocks / self.total_blocks)


def _blocks(tokens: int) -> int:
    return -(-tokens // BLOCK_TOKENS)
