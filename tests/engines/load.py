"""A bounded load generator for a real OpenAI-compatible server on 127.0.0.1 (stdlib only).

`clients` threads each send completion requests one after another until `stop` is set, `requests` have been sent
in all, or `seconds` have passed. A client with `timeout_s` gives up on a request after that long (closes the
connection: the server aborts it), as impatient users do. Prompts are made-up words the tiny tokenizer knows;
`shared_prefix` words are the same for every request (a system prompt), the rest differ per request.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Load:
    port: int
    model: str
    clients: int = 1
    prompt_words: int = 32
    shared_prefix: int = 0  # words at the start of every prompt that are the same for every request
    max_tokens: int = 32
    timeout_s: float = 120.0
    pause_s: float = 0.0  # each client waits this long after every answer (a client that paces its retries)
    seconds: float = 600.0  # hard cap on the whole run
    requests: int = 100_000  # hard cap on requests sent
    seed: int = 0
    done: int = 0
    gave_up: int = 0
    failed: int = 0
    tokens: int = 0
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _threads: list[threading.Thread] = field(default_factory=list)
    _sent: int = 0

    def start(self) -> Load:
        self._deadline = time.monotonic() + self.seconds
        for i in range(self.clients):
            t = threading.Thread(target=self._client, args=(i,), name=f"load-{i}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=self.timeout_s + 10)

    def __enter__(self) -> Load:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _prompt(self, rng: random.Random) -> str:
        shared = [f"w{i % 2000}" for i in range(self.shared_prefix)]
        own = [f"w{rng.randrange(2000)}" for _ in range(self.prompt_words - self.shared_prefix)]
        return " ".join(shared + own)

    def _take(self) -> bool:
        with self._lock:
            if self._stop.is_set() or self._sent >= self.requests or time.monotonic() > self._deadline:
                return False
            self._sent += 1
            return True

    def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 1000 + index)
        while self._take():
            body = json.dumps({"model": self.model, "prompt": self._prompt(rng), "max_tokens": self.max_tokens,
                               "min_tokens": self.max_tokens, "ignore_eos": True, "temperature": 0.0})
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout_s)
            try:
                conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
                resp = conn.getresponse()
                data = resp.read()
                with self._lock:
                    if resp.status == 200:
                        self.done += 1
                        self.tokens += json.loads(data).get("usage", {}).get("completion_tokens", 0)
                    else:
                        self.failed += 1
                        self.errors.append(f"HTTP {resp.status}: {data[:200]!r}")
            except TimeoutError:
                with self._lock:
                    self.gave_up += 1
            except OSError as exc:
                with self._lock:
                    self.failed += 1
                    self.errors.append(repr(exc))
                time.sleep(0.2)
            finally:
                conn.close()
            if self.pause_s > 0:
                self._stop.wait(self.pause_s)
