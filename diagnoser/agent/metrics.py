"""What the agent tells Prometheus: the latest verdict per target and the agent's own health.

The numbers live in `AgentMetrics` (plain data, updated by the loop after each run) and are turned into metric
families only when scraped or written, by a custom collector; so a target that goes away simply stops being listed,
with no stale label sets left in a global registry. Two ways out:
- `MetricsServer`: prometheus_client's HTTP server on 127.0.0.1 by default (port 9464);
- `write_textfile`: the node_exporter textfile format, written atomically (temporary file + rename).

Metrics (labels target, gpu, pod on the per-target ones):
  diagnoser_verdict{limiter}              1 for the current verdict, 0 for every other limiter (and 'inconclusive')
  diagnoser_confidence                    0..1
  diagnoser_efficiency_ratio              achieved generation tokens/s over the physical decode ceiling
  diagnoser_top_fix_gain_ratio{rule}      predicted throughput multiplier of the top-ranked fix
  diagnoser_last_run_timestamp_seconds, diagnoser_last_success_timestamp_seconds, diagnoser_last_run_duration_seconds
  diagnoser_last_run_ok                   1 if the newest run produced a verdict
  diagnoser_runs_total, diagnoser_run_errors_total{kind}
  diagnoser_source_unavailable{source}    1 per source that could not be read in the newest run
  diagnoser_agent_cycles_total, diagnoser_agent_last_cycle_timestamp_seconds,
  diagnoser_agent_last_cycle_duration_seconds, diagnoser_agent_discovery_errors_total,
  diagnoser_agent_webhook_errors_total, diagnoser_agent_info{version}
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from prometheus_client import start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import CollectorRegistry

from diagnoser import __version__
from diagnoser.agent.history import OK, RunRecord
from diagnoser.diagnosis import Verdict
from diagnoser.errors import InputError, SourceUnavailable
from diagnoser.fileio import write_atomic

VERDICTS = tuple(v.value for v in Verdict)  # the limiters in their order, then inconclusive
_TARGET_LABELS = ["target", "gpu", "pod"]


@dataclass
class TargetStatus:
    """The newest known state of one target."""

    target: str
    gpu: str = ""
    pod: str = ""
    verdict: str | None = None
    confidence: float | None = None
    efficiency: float | None = None
    top_fix_rule: str = ""
    top_fix_gain: float | None = None
    last_run_at: float | None = None
    last_success_at: float | None = None
    last_duration_s: float | None = None
    last_ok: bool = False
    runs_total: int = 0
    errors_total: dict[str, int] = field(default_factory=dict)
    unavailable: list[str] = field(default_factory=list)

    def labels(self) -> list[str]:
        return [self.target, self.gpu, self.pod]


class AgentMetrics:
    """Thread-safe holder of the numbers; the scrape thread reads, the loop writes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._targets: dict[str, TargetStatus] = {}
        self.cycles_total = 0
        self.last_cycle_at: float | None = None
        self.last_cycle_duration_s: float | None = None
        self.discovery_errors_total = 0
        self.webhook_errors_total = 0

    def known(self, target: str) -> bool:
        with self._lock:
            return target in self._targets

    def restore(self, run: RunRecord, last_ok: RunRecord | None) -> None:
        """Start a target's state from the history (after a restart), without counting those runs again."""
        with self._lock:
            status = self._targets.setdefault(run.target, TargetStatus(target=run.target))
            good = last_ok or (run if run.status == OK else None)
            if good is not None:
                _set_verdict(status, good)
                status.last_success_at = good.finished_at
            status.last_run_at = run.finished_at
            status.last_ok = run.status == OK

    def record_run(self, run: RunRecord) -> None:
        with self._lock:
            status = self._targets.setdefault(run.target, TargetStatus(target=run.target))
            status.runs_total += 1
            status.last_run_at = run.finished_at
            status.last_duration_s = run.finished_at - run.started_at
            status.last_ok = run.status == OK
            status.unavailable = sorted({p.split(":", 1)[0] for p in run.problems})
            if run.gpu:
                status.gpu = run.gpu
            if run.pod:
                status.pod = run.pod
            if run.status == OK:
                _set_verdict(status, run)
                status.last_success_at = run.finished_at
            else:
                status.errors_total[run.status] = status.errors_total.get(run.status, 0) + 1

    def forget(self, keep: set[str]) -> None:
        """Drop targets not in `keep` (processes that went away)."""
        with self._lock:
            for name in [n for n in self._targets if n not in keep]:
                del self._targets[name]

    def record_cycle(self, finished_at: float, duration_s: float) -> None:
        with self._lock:
            self.cycles_total += 1
            self.last_cycle_at = finished_at
            self.last_cycle_duration_s = duration_s

    def count_discovery_error(self) -> None:
        with self._lock:
            self.discovery_errors_total += 1

    def count_webhook_error(self) -> None:
        with self._lock:
            self.webhook_errors_total += 1

    def snapshot(self) -> list[TargetStatus]:
        with self._lock:
            return [TargetStatus(**{**s.__dict__, "errors_total": dict(s.errors_total),
                                    "unavailable": list(s.unavailable)}) for s in self._targets.values()]

    # --- exposition ------------------------------------------------------------------------------------------

    def collect(self) -> Iterator[Metric]:
        targets = sorted(self.snapshot(), key=lambda s: s.target)
        verdict = GaugeMetricFamily("diagnoser_verdict", "1 for the target's current verdict, 0 for the others.",
                                    labels=_TARGET_LABELS + ["limiter"])
        confidence = GaugeMetricFamily("diagnoser_confidence", "Confidence of the current verdict (0..1).",
                                       labels=_TARGET_LABELS)
        efficiency = GaugeMetricFamily("diagnoser_efficiency_ratio",
                                       "Achieved generation tokens/s over the physical decode ceiling.",
                                       labels=_TARGET_LABELS)
        gain = GaugeMetricFamily("diagnoser_top_fix_gain_ratio",
                                 "Predicted throughput multiplier of the top-ranked fix.",
                                 labels=_TARGET_LABELS + ["rule"])
        last_run = GaugeMetricFamily("diagnoser_last_run_timestamp_seconds", "When the newest run ended.",
                                     labels=_TARGET_LABELS)
        last_ok_ts = GaugeMetricFamily("diagnoser_last_success_timestamp_seconds",
                                       "When the newest run that produced a verdict ended.", labels=_TARGET_LABELS)
        duration = GaugeMetricFamily("diagnoser_last_run_duration_seconds", "How long the newest run took.",
                                     labels=_TARGET_LABELS)
        ok = GaugeMetricFamily("diagnoser_last_run_ok", "1 if the newest run produced a verdict, else 0.",
                               labels=_TARGET_LABELS)
        runs = CounterMetricFamily("diagnoser_runs", "Runs of this target since the agent started.",
                                   labels=_TARGET_LABELS)
        errors = CounterMetricFamily("diagnoser_run_errors", "Runs that produced no verdict, by kind.",
                                     labels=_TARGET_LABELS + ["kind"])
        unavailable = GaugeMetricFamily("diagnoser_source_unavailable",
                                        "1 for each source that could not be read in the newest run.",
                                        labels=_TARGET_LABELS + ["source"])
        for s in targets:
            lab = s.labels()
            if s.verdict is not None:
                for v in VERDICTS:
                    verdict.add_metric(lab + [v], 1.0 if v == s.verdict else 0.0)
            if s.confidence is not None:
                confidence.add_metric(lab, s.confidence)
            if s.efficiency is not None:
                efficiency.add_metric(lab, s.efficiency)
            if s.top_fix_gain is not None:
                gain.add_metric(lab + [s.top_fix_rule], s.top_fix_gain)
            if s.last_run_at is not None:
                last_run.add_metric(lab, s.last_run_at)
            if s.last_success_at is not None:
                last_ok_ts.add_metric(lab, s.last_success_at)
            if s.last_duration_s is not None:
                duration.add_metric(lab, s.last_duration_s)
            ok.add_metric(lab, 1.0 if s.last_ok else 0.0)
            runs.add_metric(lab, s.runs_total)
            for kind in ("error", "timeout"):
                errors.add_metric(lab + [kind], s.errors_total.get(kind, 0))
            for source in s.unavailable:
                unavailable.add_metric(lab + [source], 1.0)
        yield from (verdict, confidence, efficiency, gain, last_run, last_ok_ts, duration, ok, runs, errors,
                    unavailable)
        with self._lock:
            cycles, last_at, last_dur = self.cycles_total, self.last_cycle_at, self.last_cycle_duration_s
            disc, hook = self.discovery_errors_total, self.webhook_errors_total
        yield CounterMetricFamily("diagnoser_agent_cycles", "Cycles the agent completed.", value=cycles)
        if last_at is not None:
            yield GaugeMetricFamily("diagnoser_agent_last_cycle_timestamp_seconds", "When the newest cycle ended.",
                                    value=last_at)
        if last_dur is not None:
            yield GaugeMetricFamily("diagnoser_agent_last_cycle_duration_seconds", "How long the newest cycle took.",
                                    value=last_dur)
        yield CounterMetricFamily("diagnoser_agent_discovery_errors", "Cycles whose GPU process discovery failed.",
                                  value=disc)
        yield CounterMetricFamily("diagnoser_agent_webhook_errors", "Webhook calls that failed or were dropped.",
                                  value=hook)
        yield InfoMetricFamily("diagnoser_agent", "The diagnoser agent.", value={"version": __version__})

    def registry(self) -> CollectorRegistry:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return registry

    def exposition(self) -> bytes:
        return generate_latest(self.registry())


def _set_verdict(status: TargetStatus, run: RunRecord) -> None:
    status.verdict = run.verdict
    status.confidence = run.confidence
    status.efficiency = run.efficiency
    status.top_fix_gain = run.top_fix_gain
    status.top_fix_rule = run.top_fix_rule
    if run.gpu:
        status.gpu = run.gpu
    if run.pod:
        status.pod = run.pod


class MetricsServer:
    """The /metrics endpoint, served from a daemon thread until `close()`."""

    def __init__(self, metrics: AgentMetrics, addr: str, port: int) -> None:
        try:
            self._server, self._thread = start_http_server(port, addr=addr, registry=metrics.registry())
        except OSError as exc:
            raise SourceUnavailable(f"cannot serve metrics on {addr}:{port}: {exc.strerror or exc} "
                                    "(pick another --metrics-port, or --metrics-port 0 to turn it off).") from None
        self.addr = addr
        self.port = int(self._server.server_port)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def write_textfile(metrics: AgentMetrics, path: Path) -> Path:
    """The node_exporter textfile collector reads *.prom; the temporary name does not end in .prom."""
    try:
        return write_atomic(path, metrics.exposition())
    except OSError as exc:
        raise InputError(f"cannot write the metrics textfile {path}: {exc.strerror or exc}.") from None
