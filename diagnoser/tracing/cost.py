"""What taking a trace cost the traced server: its throughput while the trace was being taken (profiler start, the
window, stop and export) against its throughput in the counter window just before.

The counters are the server's own (generated and prompt tokens, finished requests), read from its /metrics right
before the trace is asked for and right after it is written, so the loss covers everything the user's trace cost,
pauses included. Without /metrics only the pauses the hook reports are known.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from diagnoser import signals as S
from diagnoser.collectors.server_metrics import MetricsError, served_totals

T = TypeVar("T")

# Rates compared, in the order they are named: the server's own counters, as `served_totals` returns them.
RATES = ("gen_tokens", "prompt_tokens", "requests")
_SIGNALS = {"gen_tokens": S.SERVER_GEN_TOKENS_PER_S, "prompt_tokens": S.SERVER_PROMPT_TOKENS_PER_S,
            "requests": S.SERVER_REQUESTS_PER_S}
_UNITS = {"gen_tokens": "generated tokens/s", "prompt_tokens": "prompt tokens/s", "requests": "requests/s"}


@dataclass
class TraceCost:
    seconds: float  # wall time of the whole trace operation
    before: dict[str, float] = field(default_factory=dict)  # per-second rates in the counter window
    during: dict[str, float] = field(default_factory=dict)  # per-second rates while tracing
    pauses_ms: dict[int, float] = field(default_factory=dict)
    why_not: str = ""  # why the throughput could not be compared

    def loss(self, rate: str) -> float | None:
        """1 - during/before for one rate; None when it was not measured or nothing was served before."""
        if rate not in self.during or not self.before.get(rate):
            return None
        return 1.0 - self.during[rate] / self.before[rate]

    def headline_rate(self) -> str | None:
        return next((r for r in RATES if self.loss(r) is not None), None)

    def sentence(self) -> str:
        pauses = "; ".join(f"pid {pid} paused {ms:.0f} ms by the profiler" for pid, ms in self.pauses_ms.items())
        rate = self.headline_rate()
        if rate is None:
            told = f"throughput while tracing not measured: {self.why_not}" if self.why_not else\
                "throughput while tracing not measured"
            return f"Tracing took {self.seconds:.1f} s; {told}" + (f"; {pauses}." if pauses else ".")
        loss = self.loss(rate)
        assert loss is not None
        change = f"{loss:.0%} less" if loss >= 0 else f"{-loss:.0%} more"
        return (f"While tracing ({self.seconds:.1f} s, start to export) the server made {self.during[rate]:,.1f} "
                f"{_UNITS[rate]} against {self.before[rate]:,.1f} in the window before: {change}"
                + (f"; {pauses}." if pauses else "."))

    def to_dict(self) -> dict[str, Any]:
        return {"seconds": round(self.seconds, 3), "before": self.before, "during": self.during,
                "loss": {r: self.loss(r) for r in RATES if self.loss(r) is not None},
                "pauses_ms": {str(k): v for k, v in self.pauses_ms.items()}, "why_not": self.why_not}


def window_rates(series_means: dict[str, float]) -> dict[str, float]:
    """The counter window's rates, from the capture's mean of each server rate signal."""
    return {rate: series_means[sig] for rate, sig in _SIGNALS.items() if sig in series_means}


def _totals(url: str | None) -> tuple[dict[str, float] | None, str]:
    if not url:
        return None, "the server has no /metrics endpoint that diagnoser knows"
    try:
        return served_totals(url), ""
    except MetricsError as exc:
        return None, str(exc).rstrip(".")


def measure(run: Callable[[], T], metrics_url: str | None, before: dict[str, float]) -> tuple[T, TraceCost]:
    """Run `run` (the trace) between two reads of the server's counters; return its result and what it cost."""
    first, why = _totals(metrics_url)
    t0 = time.monotonic()
    result = run()
    seconds = time.monotonic() - t0
    cost = TraceCost(seconds=seconds, before=dict(before))
    if first is None:
        cost.why_not = why
        return result, cost
    second, why = _totals(metrics_url)
    if second is None:
        cost.why_not = why
        return result, cost
    for rate in RATES:
        if rate in first and rate in second and second[rate] >= first[rate] and seconds > 0:
            cost.during[rate] = (second[rate] - first[rate]) / seconds
    if not cost.during:
        cost.why_not = "the server's /metrics has no token or request counters"
    elif not any(cost.before.get(r) for r in cost.during):
        cost.why_not = "the server served nothing in the window before"
    return result, cost
