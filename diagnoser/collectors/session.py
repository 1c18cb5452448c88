"""One observation window: every collector driven from one sampler thread, returning the Capture.

    from diagnoser.collectors.session import collect
    from diagnoser.collectors.target import resolve_target
    capture = collect(resolve_target(pid=1234), duration_s=10)

The window ends after `duration_s`, when `stop_event` is set, when the target process exits, or on Ctrl-C; in every
case the capture holds everything sampled until then. One thread samples NVML, GPM, psutil and the server's
/metrics, each at its own period, on a fixed schedule (no drift); the caller's thread only waits and reports progress
through `on_sample`, so a slow progress display never delays a sample.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import psutil

from diagnoser.capture import Capture, ServerInfo, new_capture
from diagnoser.collectors.base import (
    DEFAULT_DURATION_S,
    DEFAULT_INTERVAL_S,
    MIN_INTERVAL_S,
    Collector,
)
from diagnoser.collectors.gpm import GpmCollector
from diagnoser.collectors.host import DEFAULT_PERIOD_S as HOST_PERIOD_S
from diagnoser.collectors.host import HostCollector
from diagnoser.collectors.nvml import NvmlCollector
from diagnoser.collectors.process import ProcessTree
from diagnoser.collectors.server_metrics import DEFAULT_PERIOD_S as SERVER_PERIOD_S
from diagnoser.collectors.server_metrics import ServerMetricsCollector
from diagnoser.collectors.stacks import StackCollector
from diagnoser.collectors.target import AttachTarget
from diagnoser.errors import InputError, SourceUnavailable

# How often the caller's thread wakes to report progress and notice Ctrl-C.
_PROGRESS_S = 0.25


@dataclass
class Progress:
    """What `on_sample` receives: seconds elapsed of the window and the newest key numbers by signal name."""

    elapsed_s: float
    duration_s: float
    latest: dict[str, float] = field(default_factory=dict)
    cpu_only: bool = False
    gpu_problem: str = ""  # why no GPU is sampled, when none is


class Sampler:
    """Runs the collectors of one window on one thread. `collect()` is the simple entry point."""

    def __init__(self, capture: Capture, collectors: list[Collector], *, duration_s: float, interval_s: float,
                 tree: ProcessTree | None = None, stop_event: threading.Event | None = None) -> None:
        self.capture = capture
        self.collectors = collectors
        self.duration_s = duration_s
        self.interval_s = interval_s
        self.tree = tree
        self.stop_event = stop_event or threading.Event()
        self.elapsed_s = 0.0
        self.ticks = 0
        self.cpu_s = 0.0  # CPU time the sampler thread used, for the sampler-cost benchmark
        self.started = threading.Event()
        self.finished = threading.Event()
        self._failed: set[str] = set()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="diagnoser-sampler", daemon=True)
        self._thread.start()

    def join(self, timeout: float | None = None) -> bool:
        """Wait for the window to end (its duration written, its collectors stopped); True once it has.

        Waits on an Event, not on Thread.join: a KeyboardInterrupt that lands inside Thread.join makes CPython
        (3.11, 3.12) mark a thread that is still running as finished, and the caller then read a capture whose
        window had not ended ("ended early after 0.0 s" while the samples covered 4 s)."""
        assert self._thread is not None
        return self.finished.wait(timeout)

    def latest(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.collectors:
            try:
                out.update(c.latest())
            except RuntimeError:  # a dict resized under us by the sampler thread: skip this refresh
                continue
        return out

    def _run(self) -> None:
        cpu0 = time.thread_time()
        try:
            self._start_collectors()
            t0 = time.monotonic()
            self.started.set()
            due = [0.0 for _ in self.collectors]
            while True:
                now = time.monotonic() - t0
                for i, c in enumerate(self.collectors):
                    if c.name in self._failed or now + 1e-6 < due[i]:
                        continue
                    period = c.period_s or self.interval_s
                    # Next slot on the collector's own grid; skip slots missed while a slow call blocked.
                    due[i] = (math.floor(now / period) + 1) * period
                    self._guard(c, "sample", now)
                self.ticks += 1
                self.elapsed_s = now
                if self.tree is not None and not self.tree.alive(now):
                    self.tree.exited_at = now
                    break
                if now >= self.duration_s:
                    break
                next_tick = min(self.duration_s, self.ticks * self.interval_s)
                wait = next_tick - (time.monotonic() - t0)
                if self.stop_event.wait(max(0.0, wait)):
                    self.elapsed_s = time.monotonic() - t0
                    break
            end = time.monotonic() - t0
            self.elapsed_s = end
            for c in reversed(self.collectors):
                self._guard(c, "stop", end)
            # Rounded up to the millisecond: never shorter than its last sample (times are kept to 0.1 ms).
            self.capture.duration_s = math.ceil(end * 1000) / 1000
        finally:
            self.cpu_s = time.thread_time() - cpu0
            self.started.set()
            self.finished.set()

    def _start_collectors(self) -> None:
        for c in self.collectors:
            self._guard(c, "start", self.capture)

    def _guard(self, collector: Collector, step: str, arg: object) -> None:
        """A collector bug must not end the window: drop that collector, keep what it and the others recorded."""
        try:
            getattr(collector, step)(arg)
        except Exception as exc:
            if collector.name not in self._failed:
                self._failed.add(collector.name)
                self.capture.notes.append(f"The {collector.name} collector failed during {step} "
                                          f"({type(exc).__name__}: {exc}); its data until then is kept.")
                self.capture.mark_unavailable(collector.name, f"{collector.name}.*", f"collector failed: {exc}")


def build_collectors(target: AttachTarget, tree: ProcessTree | None, *, interval_s: float,
                     host_interval_s: float = HOST_PERIOD_S, server_interval_s: float = SERVER_PERIOD_S,
                     gpu: bool = True, stacks: bool = True) -> list[Collector]:
    collectors: list[Collector] = []
    if gpu:
        nvml = NvmlCollector(tree)
        collectors += [nvml, GpmCollector(nvml)]
    collectors.append(HostCollector(tree, period_s=max(interval_s, host_interval_s)))
    if target.metrics_url:
        collectors.append(ServerMetricsCollector(target.metrics_url, target.server_kind,
                                                 period_s=max(interval_s, server_interval_s)))
    if stacks and target.pid is not None:
        collectors.append(StackCollector(target.pid))  # the target's Python stacks, when py-spy may read them
    return collectors


def new_window(target: AttachTarget) -> tuple[Capture, ProcessTree | None]:
    """The empty capture of a window on `target`, with its process and server described."""
    capture = new_capture(target.description)
    tree: ProcessTree | None = None
    if target.pid is not None:
        try:
            tree = ProcessTree(target.pid)
            tree.refresh(0.0, force=True)
        except psutil.NoSuchProcess:  # it exited between resolve_target and now
            raise SourceUnavailable(f"process {target.pid} exited before the window started.") from None
        capture.process = tree.info()
    if target.metrics_url:
        capture.server = ServerInfo(kind=target.server_kind, url=target.metrics_url, version=target.engine_version)
    elif target.pid is not None:
        capture.server = ServerInfo(kind=target.server_kind)
        if target.metrics_problem:
            capture.mark_unavailable("server", "server.*", target.metrics_problem,
                                     "give --port PORT or --metrics-url URL of the server's Prometheus endpoint")
    capture.serving = msgspec.structs.replace(target.serving)
    return capture, tree


def collect(target: AttachTarget, duration_s: float = DEFAULT_DURATION_S, interval_s: float = DEFAULT_INTERVAL_S,
            on_sample: Callable[[Progress], None] | None = None, stop_event: threading.Event | None = None, *,
            host_interval_s: float = HOST_PERIOD_S, server_interval_s: float = SERVER_PERIOD_S,
            gpu: bool = True) -> Capture:
    """Observe `target` for `duration_s` and return the capture, however the window ends.

    Ctrl-C (KeyboardInterrupt in the calling thread) or `stop_event` end the window early; the capture then covers
    the time until that moment and says so in its notes. If the target process exits, the window ends there and
    `capture.process.exited_at_s` records when.
    """
    if not duration_s > 0 or math.isinf(duration_s):
        raise InputError(f"the window must last a positive number of seconds, not {duration_s}.")
    if not interval_s >= MIN_INTERVAL_S:
        raise InputError(f"the sampling interval must be at least {MIN_INTERVAL_S} s, not {interval_s}.")
    capture, tree = new_window(target)
    collectors = build_collectors(target, tree, interval_s=interval_s, host_interval_s=host_interval_s,
                                  server_interval_s=server_interval_s, gpu=gpu)
    sampler = Sampler(capture, collectors, duration_s=duration_s, interval_s=interval_s, tree=tree,
                      stop_event=stop_event)
    run_sampler(sampler, on_sample)
    return capture


def run_sampler(sampler: Sampler, on_sample: Callable[[Progress], None] | None = None) -> None:
    """Run a window to its end on the sampler thread while this thread reports progress and catches Ctrl-C."""
    capture = sampler.capture

    def report() -> None:
        if on_sample is not None:
            problem = next((u.reason for u in capture.unavailable if u.source == "nvml" and u.what == "gpu.*"), "")
            on_sample(Progress(sampler.elapsed_s, sampler.duration_s, sampler.latest(), capture.cpu_only, problem))

    sampler.start()
    interrupted = False
    while True:
        try:
            if sampler.join(_PROGRESS_S):
                break
            if sampler.started.is_set():
                report()
        except KeyboardInterrupt:
            # End the window and wait for the sampler's last tick and its collectors' stop (one collector call at
            # most): what it sampled is the capture. Further Ctrl-Cs meanwhile are absorbed the same way.
            interrupted = True
            sampler.stop_event.set()
    if sampler.tree is not None and capture.process is not None:
        capture.process.children = sorted(set(capture.process.children) | set(sampler.tree.children()))
    if sampler.tree is not None and sampler.tree.exited_at is not None and capture.process is not None:
        capture.process.exited_at_s = round(sampler.tree.exited_at, 3)
    elif interrupted or (sampler.stop_event.is_set() and sampler.elapsed_s < sampler.duration_s - 1e-3):
        how = "by Ctrl-C" if interrupted else str(getattr(sampler.stop_event, "how", "on request"))
        capture.notes.append(f"The window was ended early {how} after {capture.duration_s:.1f} s of the "
                             f"{sampler.duration_s:g} s asked for.")
    report()
