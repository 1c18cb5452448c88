"""Evidence: what rules read (evidence_build.py builds it from a capture, characterise.py fills in what it says).

Rules read only this, never the capture: named signals with statistics over the window, the hardware and model the
physics needs, the serving configuration, the trace's facts, which fixes are already in place, the workload's
regime (which roof it would hit) and how far each roof is from saturated, and what limits the data's quality. A
signal that was not measured is absent (never a zero), and `why_missing` says why, from the capture's list of
unavailable sources.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from diagnoser import signals as S
from diagnoser.capture import GpuInfo, ModelInfo, ServingConfig, StackSamples, TraceSummary, Unavailable
from diagnoser.diagnosis import FixKind, Regime
from diagnoser.engines.knobs import Setting
from diagnoser.engines.tables import in_force, platform_of

if TYPE_CHECKING:
    from diagnoser.physics import GpuSpec

_STATS = ("mean", "p50", "p90", "p99", "min", "max")


@dataclass(frozen=True)
class Signal:
    """All samples of one signal over the window (pooled over the target's GPUs), with statistics.

    A signal built from statistics a time-series engine computed (`from_stats`) has no samples; its statistics answer
    from those numbers."""

    name: str
    unit: str
    sources: tuple[str, ...]
    values: tuple[float, ...]
    times: tuple[float, ...] = ()
    # A quantile read from a server's histogram: the bucket it was interpolated in (low, high). Inside a bucket the
    # value says only where the rank falls (a median step of "0.51 tokens" lies in the bucket (0, 1]): rules compare
    # with `lowest`/`highest`, and renderers show the bucket, not the interpolated value.
    bucket: tuple[float, float] | None = None
    # False for a signal known only by statistics an engine computed (from_stats), which has no samples.
    from_samples: ClassVar[bool] = True

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def value(self) -> float:
        """The one number of a one-number signal (trace, physics), or the mean."""
        return self.values[0] if len(self.values) == 1 else self.mean

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / len(self.values)

    @property
    def min(self) -> float:
        return min_(self.values)

    @property
    def max(self) -> float:
        return max_(self.values)

    @property
    def p50(self) -> float:
        return self.quantile(0.5)

    @property
    def p90(self) -> float:
        return self.quantile(0.9)

    @property
    def p99(self) -> float:
        return self.quantile(0.99)

    def quantile(self, q: float) -> float:
        """Linear-interpolated quantile (numpy's default method)."""
        xs = sorted(self.values)
        pos = (len(xs) - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)

    def frac_above(self, threshold: float) -> float:
        """Fraction of samples at or above the threshold (samples are evenly spaced in time)."""
        return sum(1 for v in self.values if v >= threshold) / len(self.values)

    def frac_below(self, threshold: float) -> float:
        return sum(1 for v in self.values if v < threshold) / len(self.values)

    def stat(self, name: str) -> float:
        if name.startswith("frac_above:"):
            return self.frac_above(float(name.split(":", 1)[1]))
        if name == "value":
            return self.value
        return float(getattr(self, name))

    @property
    def source(self) -> str:
        return "+".join(self.sources)

    @property
    def lowest(self) -> float:
        """The least the value can be: a quantile's bucket's lower bound (a count is at least 1 where the bucket
        starts at 0 and the unit counts whole things), else the value."""
        if self.bucket is None:
            return self.value
        low = self.bucket[0]
        return max(low, 1.0) if low <= 0 and self.unit == "tokens" and self.bucket[1] >= 1 else low

    @property
    def highest(self) -> float:
        """The most the value can be: a quantile's bucket's upper bound, else the value."""
        return self.value if self.bucket is None else self.bucket[1]

    @classmethod
    def from_stats(cls, name: str, unit: str, sources: Iterable[str], *, mean: float, p50: float | None = None,
                   p90: float | None = None, max: float | None = None, min: float | None = None,
                   n: int = 1, frac_above: Mapping[float, float] | None = None) -> Signal:
        """A signal known only by statistics that a time-series engine computed over the window (the fleet's
        triage reads these instead of the samples): mean, quantiles and extremes answer from them; `frac_above`
        from the fractions given for exact thresholds, else from the piecewise-linear distribution through the
        known quantiles. `n` is the number of samples the statistics summarise."""
        signal = object.__new__(_StatsSignal)
        # The fields set at once: the frozen dataclass __init__ sets each through object.__setattr__, 3x slower, and
        # a fleet of 100,000 GPUs makes a million of these.
        signal.__dict__.update(name=name, unit=unit, sources=tuple(sources), values=(mean,), times=(),
                               count=n if n > 1 else 1, s_mean=mean, s_p50=p50, s_p90=p90, s_max=max, s_min=min,
                               fractions=tuple(sorted(frac_above.items())) if frac_above else ())
        return signal


class NoSuchStatistic(LookupError):
    """A statistic of a signal known only by window statistics that the engine did not compute: reading it would
    interpolate a number nobody measured (the fleet computes what the rules declare they read, `@rule(reads=...)`).
    A rule that meets one is skipped with the reason (RuleSet.run)."""

    def __init__(self, signal: str, what: str) -> None:
        super().__init__(f"the window statistics of {signal} hold no {what}")
        self.signal, self.what = signal, what


@dataclass(frozen=True)
class _StatsSignal(Signal):
    """Signal.from_stats: statistics without the samples. It answers the statistics it was given and no other: a
    quantile, a share above a threshold or an extreme that was not computed raises NoSuchStatistic, so that a read
    that bypasses a rule's declarations (an evidence helper, a gain) fails in the tests instead of quietly
    interpolating on the fleet path."""

    count: int = 1
    s_mean: float = 0.0
    s_p50: float | None = None
    s_p90: float | None = None
    s_max: float | None = None
    s_min: float | None = None
    fractions: tuple[tuple[float, float], ...] = ()
    from_samples: ClassVar[bool] = False

    @property
    def n(self) -> int:
        return self.count

    @property
    def mean(self) -> float:
        return self.s_mean

    def _missing(self, what: str) -> NoSuchStatistic:
        return NoSuchStatistic(self.name, what)

    @property
    def min(self) -> float:
        if self.s_min is None:
            raise self._missing("minimum")
        return self.s_min

    @property
    def max(self) -> float:
        if self.s_max is None:
            raise self._missing("maximum")
        return self.s_max

    def quantile(self, q: float) -> float:
        """A computed quantile: the median, p90 or an extreme where it was given."""
        known = {0.0: self.s_min, 0.5: self.s_p50, 0.9: self.s_p90, 1.0: self.s_max}.get(q)
        if known is None:
            raise self._missing(f"quantile {q:g}")
        return known

    def frac_above(self, threshold: float) -> float:
        for t, frac in self.fractions:
            if t == threshold:
                return frac
        raise self._missing(f"share of the window at or above {threshold:g}")

    def frac_below(self, threshold: float) -> float:
        return 1.0 - self.frac_above(threshold)



min_, max_ = min, max  # Signal's own min/max properties shadow the builtins inside the class body


@dataclass(frozen=True)
class Meta:
    """The capture's identity and circumstances: what the engine needs to write the diagnosis's context."""

    target: str = ""
    window_s: float = 0.0
    started_at: float = 0.0
    host: str = ""
    tool_version: str = ""
    cpu_only: bool = False
    origin: str = ""
    server_kind: str = ""
    server_version: str = ""  # as the engine reported it (vLLM's /version), "" when unknown
    model_name: str = ""
    gpus: tuple[GpuInfo, ...] = ()
    measured_roofs: bool = False
    exited_at_s: float | None = None
    notes: tuple[str, ...] = ()
    unavailable: tuple[Unavailable, ...] = ()


@dataclass(frozen=True)
class Quality:
    """One thing that limits how far the data can be trusted, and how much it lowers the confidence."""

    factor: float
    reason: str


@dataclass
class Evidence:
    """What the rules of one capture may read."""

    signals: dict[str, Signal] = field(default_factory=dict)
    meta: Meta = field(default_factory=Meta)
    gpu_spec: GpuSpec | None = None
    model: ModelInfo | None = None
    serving: ServingConfig = field(default_factory=ServingConfig)
    trace: TraceSummary | None = None
    stacks: StackSamples | None = None  # the target's sampled Python stacks (collectors/stacks.py), when taken
    # Fixes the capture shows are already in place, with the evidence that says so.
    in_place: dict[FixKind, str] = field(default_factory=dict)
    workload: str = ""  # inference, training, or ""
    platform: str = ""  # cuda, rocm, or ""
    regime: Regime = Regime.UNKNOWN
    regime_basis: str = ""
    context_tokens: int = 0  # mean tokens per sequence when known, else 0
    quality: list[Quality] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    _absent_key: tuple[tuple[str, str, str], ...] | None = field(default=None, repr=False, compare=False)

    def __contains__(self, name: object) -> bool:
        return name in self.signals

    def get(self, name: str) -> Signal | None:
        return self.signals.get(name)

    def __getitem__(self, name: str) -> Signal:
        return self.signals[name]

    def __iter__(self) -> Iterator[Signal]:
        return iter(self.signals.values())

    def add(self, signal: Signal) -> None:
        self.signals[signal.name] = signal

    def value(self, name: str) -> float | None:
        """The mean (or the one value) of a signal, None when absent."""
        s = self.signals.get(name)
        return None if s is None else s.value

    def absent_key(self) -> tuple[tuple[str, str, str], ...]:
        """What the capture says is unavailable, as a hashable key: two captures with the same key give the same
        why_missing answers (a fleet's GPUs mostly share one)."""
        if self._absent_key is None:
            self._absent_key = tuple((u.source, u.what, u.reason) for u in self.meta.unavailable)
        return self._absent_key

    def why_missing(self, name: str) -> str:
        """The capture's own reason a signal is absent, or a generic one."""
        family = name.split(".")[0]
        for u in self.meta.unavailable:
            if u.what == name:
                return f"{u.source}: {u.reason}"
        for u in self.meta.unavailable:
            if u.what in (family, f"{family}.*") or name.startswith(u.what.rstrip("*")) and u.what.endswith("*"):
                return f"{u.source}: {u.reason}"
        return "not collected in this capture"

    # --- what several rules ask ------------------------------------------------------------------------------

    def knob(self, name: str) -> Setting | None:
        """The serving engine's knob `name` as it is in force in this capture (configured, else the engine's default
        for its version and platform, else unknown and why); None where the engine has no knob table or no such
        knob (engines/)."""
        engine = self.serving.engine or self.meta.server_kind
        platform = platform_of(self.meta.server_version, self.meta.cpu_only, self.meta.gpus, self.serving)
        return in_force(engine, name, self.serving, self.meta.server_version, platform)

    def observed_batch(self) -> float | None:
        """Sequences per step: the server's running count, its batch size, or the trace's decode batch."""
        for name in (S.SERVER_RUNNING, S.SERVER_BATCH_SIZE, S.TRACE_DECODE_BATCH):
            s = self.signals.get(name)
            if s is not None and s.mean > 0:
                return s.mean
        return None

    def busy_fraction(self) -> float | None:
        """Share of the window a kernel ran: NVML/DCGM's busy, else the trace's, else SM activity."""
        busy = self.signals.get(S.GPU_BUSY)
        if busy is not None:
            return busy.mean
        idle = self.signals.get(S.TRACE_GPU_IDLE_FRAC)
        if idle is not None:
            return 1.0 - idle.value
        sm = self.signals.get(S.GPU_SM_ACTIVE)
        return sm.mean if sm is not None else None

    def waiting(self) -> float | None:
        """Mean requests queued, when the server says."""
        return self.value(S.SERVER_WAITING)

    def weights_dtype(self) -> str | None:
        """The weights' precision when the model names a known one."""
        from diagnoser.errors import InputError
        from diagnoser.physics import normalise_dtype

        if self.model is None or not self.model.dtype:
            return None
        try:
            return normalise_dtype(self.model.dtype)
        except InputError:
            return None
