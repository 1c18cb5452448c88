"""What every live collector is, and the bookkeeping they share.

A collector fills a Capture with Series of signal names from diagnoser.signals; it knows nothing of rules. The session
(collectors/session.py) drives all collectors from one sampler thread: `start` once, `sample(t)` whenever the
collector's own period is due, `stop(t)` once at the end of the window (t = seconds since the window start).
"""

from __future__ import annotations

import math
from typing import Protocol

from diagnoser.capture import Capture, Series
from diagnoser.signals import spec

# Window defaults, here so that the CLI can show them without importing the collectors (NVML, psutil, HTTP).
DEFAULT_DURATION_S = 10.0
DEFAULT_INTERVAL_S = 0.1
MIN_INTERVAL_S = 0.01


class Collector(Protocol):
    name: str
    # Seconds between samples; None means every sampler tick.
    @property
    def period_s(self) -> float | None: ...

    def start(self, capture: Capture) -> None: ...

    def sample(self, t: float) -> None: ...

    def stop(self, t: float) -> None: ...

    def latest(self) -> dict[str, float]:
        """The newest key numbers, for the live display (signal name -> value)."""
        ...


class SeriesBook:
    """Finds or creates the Series for (signal, labels) of one source in a capture, so collectors just `add`."""

    def __init__(self, capture: Capture, source: str) -> None:
        self.capture = capture
        self.source = source
        self._index: dict[tuple[str, tuple[tuple[str, str], ...]], Series] = {}
        self.newest: dict[str, float] = {}

    def series(self, name: str, labels: dict[str, str] | None = None) -> Series:
        key = (name, tuple(sorted((labels or {}).items())))
        found = self._index.get(key)
        if found is None:
            found = Series(name=name, unit=spec(name).unit, source=self.source, labels=dict(labels or {}))
            self.capture.series.append(found)
            self._index[key] = found
        return found

    def add(self, name: str, t: float, value: float, labels: dict[str, str] | None = None) -> None:
        value = float(value)
        if not math.isfinite(value):
            return  # no reading: the series keeps its gap and `newest` its last real value
        self.series(name, labels).add(round(t, 4), value)
        self.newest[name] = value

    def has(self, name: str) -> bool:
        return any(key[0] == name and s.values for key, s in self._index.items())


def gpu_labels(index: int) -> dict[str, str]:
    return {"gpu": str(index)}
