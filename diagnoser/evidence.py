"""Evidence: pure functions from a capture to named signals with statistics over the window.

Rules read only this. A signal that was not measured is absent (never a zero), and `why_missing` says why, from the
capture's list of unavailable sources.
"""

from __future__ import annotations

import itertools
import math
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from diagnoser.capture import Capture, GpuInfo, Series
from diagnoser.signals import spec


@dataclass(frozen=True)
class Signal:
    """All samples of one signal over the window (pooled over the target's GPUs), with statistics."""

    name: str
    unit: str
    sources: tuple[str, ...]
    values: tuple[float, ...]
    times: tuple[float, ...] = ()

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return math.fsum(self.values) / len(self.values)

    @property
    def min(self) -> float:
        return min(self.values)

    @property
    def max(self) -> float:
        return max(self.values)

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
        return float(getattr(self, name))

    @property
    def source(self) -> str:
        return "+".join(self.sources)

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


@dataclass(frozen=True)
class _StatsSignal(Signal):
    """Signal.from_stats: statistics without the samples."""

    count: int = 1
    s_mean: float = 0.0
    s_p50: float | None = None
    s_p90: float | None = None
    s_max: float | None = None
    s_min: float | None = None
    fractions: tuple[tuple[float, float], ...] = ()

    @property
    def n(self) -> int:
        return self.count

    @property
    def mean(self) -> float:
        return self.s_mean

    def _knots(self) -> list[tuple[float, float]]:
        """(cumulative share, value) pairs known, in order of share."""
        known = ((0.0, self.s_min), (0.5, self.s_p50), (0.9, self.s_p90), (1.0, self.s_max))
        return [(q, v) for q, v in known if v is not None]

    @property
    def min(self) -> float:
        return self.s_min if self.s_min is not None else self.quantile(0.0)

    @property
    def max(self) -> float:
        return self.s_max if self.s_max is not None else self.quantile(1.0)

    def quantile(self, q: float) -> float:
        """Interpolated between the known quantiles; beyond them, the nearest one (the mean when none is known)."""
        knots = self._knots()
        if not knots:
            return self.s_mean
        if q <= knots[0][0]:
            return knots[0][1]
        for (qa, va), (qb, vb) in itertools.pairwise(knots):
            if q <= qb:
                return va + (vb - va) * (q - qa) / (qb - qa)
        return knots[-1][1]

    def frac_above(self, threshold: float) -> float:
        for t, frac in self.fractions:
            if t == threshold:
                return frac
        knots = self._knots()
        if not knots:
            return 1.0 if self.s_mean >= threshold else 0.0
        if threshold <= knots[0][1]:
            return 1.0 - knots[0][0]
        for (qa, va), (qb, vb) in itertools.pairwise(knots):
            if threshold <= vb:
                below = qa if vb == va else qa + (qb - qa) * (threshold - va) / (vb - va)
                return 1.0 - below
        return 0.0

    def frac_below(self, threshold: float) -> float:
        return 1.0 - self.frac_above(threshold)


@dataclass
class Evidence:
    """The signals of one capture, plus the context rules may cite (hardware spec, model)."""

    capture: Capture
    signals: dict[str, Signal] = field(default_factory=dict)
    gpu_spec: object | None = None  # diagnoser.physics.GpuSpec when the GPU was recognised
    notes: list[str] = field(default_factory=list)
    _absent_key: tuple[tuple[str, str, str], ...] | None = field(default=None, repr=False, compare=False)

    def __contains__(self, name: str) -> bool:
        return name in self.signals

    def absent_key(self) -> tuple[tuple[str, str, str], ...]:
        """What the capture says is unavailable, as a hashable key: two captures with the same key give the same
        why_missing answers (a fleet's GPUs mostly share one)."""
        if self._absent_key is None:
            self._absent_key = tuple((u.source, u.what, u.reason) for u in self.capture.unavailable)
        return self._absent_key

    def get(self, name: str) -> Signal | None:
        return self.signals.get(name)

    def observed_batch(self) -> float | None:
        """Sequences per step: the server's running count, its batch size, or the trace's decode batch."""
        for name in ("server.running", "server.batch_size", "trace.decode_batch"):
            s = self.signals.get(name)
            if s is not None and s.mean > 0:
                return s.mean
        return None

    def __getitem__(self, name: str) -> Signal:
        return self.signals[name]

    def __iter__(self) -> Iterator[Signal]:
        return iter(self.signals.values())

    def why_missing(self, name: str) -> str:
        """The capture's own reason a signal is absent, or a generic one."""
        family = name.split(".")[0]
        for u in self.capture.unavailable:
            if u.what == name:
                return f"{u.source}: {u.reason}"
        for u in self.capture.unavailable:
            if u.what in (family, f"{family}.*") or name.startswith(u.what.rstrip("*")) and u.what.endswith("*"):
                return f"{u.source}: {u.reason}"
        return "not collected in this capture"

    def add(self, signal: Signal) -> None:
        self.signals[signal.name] = signal


def build_evidence(capture: Capture) -> Evidence:
    ev = Evidence(capture=capture)
    for signal in _pooled(capture.series):
        ev.add(signal)
    _derive_memory_fraction(capture, ev)
    if capture.trace is not None:
        for signal in _trace_signals(capture):
            ev.add(signal)
    _derive_theory(capture, ev)
    _derive_energy(capture, ev)
    return ev


def _derive_energy(capture: Capture, ev: Evidence) -> None:
    """Tokens per joule from generation rate and board power; cost per million tokens from a $/GPU-hour."""
    from diagnoser import physics

    gen = ev.get("server.gen_tokens_per_s")
    if gen is None or gen.mean <= 0:
        return
    power = ev.get("gpu.power_w")
    if power is not None and power.mean > 0:
        gpus = max(1, len(capture.gpus))
        ev.add(Signal("energy.tokens_per_joule", "tokens/J", ("server", *power.sources),
                      (physics.tokens_per_joule(gen.mean, power.mean * gpus),)))
    price = capture.serving.get("usd_per_gpu_hour")
    if isinstance(price, (int, float)) and price > 0:
        ev.add(Signal("energy.usd_per_million_tokens", "USD", ("server", "user"),
                      (physics.cost_per_million_tokens(gen.mean, float(price), gpus=max(1, len(capture.gpus))),)))


def _pooled(series: Iterable[Series]) -> Iterator[Signal]:
    """Pool every series of one name (one per GPU, say) into one signal; empty series are not evidence."""
    groups: dict[str, list[Series]] = defaultdict(list)
    for s in series:
        if s.values:
            groups[s.name].append(s)
    for name, members in groups.items():
        if len(members) == 1 and not any(map(math.isnan, members[0].values)):  # the common case: one clean series
            values, times = tuple(members[0].values), tuple(members[0].times)
        elif not any(any(map(math.isnan, s.values)) for s in members):
            values = tuple(v for s in members for v in s.values)
            times = tuple(t for s in members for t in s.times)
        else:
            values = tuple(v for s in members for v in s.values if not math.isnan(v))
            times = tuple(t for s in members for t, v in zip(s.times, s.values) if not math.isnan(v))
        if not values:
            continue
        sources = (members[0].source,) if len(members) == 1 else tuple(sorted({s.source for s in members}))
        yield Signal(name, members[0].unit or spec(name).unit, sources, values, times)


def _derive_memory_fraction(capture: Capture, ev: Evidence) -> None:
    """gpu.mem_used_frac from used bytes and the total (a series or the GPU's size), per GPU, then pooled."""
    if "gpu.mem_used_frac" in ev or "gpu.mem_used_bytes" not in ev:
        return
    totals = {str(g.index): g.memory_total_bytes for g in capture.gpus if g.memory_total_bytes}
    for s in capture.series_named("gpu.mem_total_bytes"):
        if s.values:
            totals[s.labels.get("gpu", "0")] = int(max(s.values))
    fracs: list[float] = []
    times: list[float] = []
    sources: set[str] = set()
    for s in capture.series_named("gpu.mem_used_bytes"):
        total = totals.get(s.labels.get("gpu", "0"))
        if not total:
            continue
        fracs.extend(v / total for v in s.values)
        times.extend(s.times)
        sources.add(s.source)
    if fracs:
        ev.add(Signal("gpu.mem_used_frac", "ratio", tuple(sorted(sources)), tuple(fracs), tuple(times)))
    if "gpu.mem_total_bytes" not in ev and totals:
        ev.add(Signal("gpu.mem_total_bytes", "bytes", ("nvml",), (float(max(totals.values())),)))


_TRACE_FIELDS = {
    "trace.gpu_idle_frac": lambda t: None if t.gpu_busy_frac is None else 1.0 - t.gpu_busy_frac,
    "trace.idle.host_frac": lambda t: t.idle_frac_by_cause.get("host"),
    "trace.idle.sync_frac": lambda t: t.idle_frac_by_cause.get("sync"),
    "trace.idle.pageable_memcpy_frac": lambda t: t.idle_frac_by_cause.get("pageable_memcpy"),
    "trace.idle.queue_dry_frac": lambda t: t.idle_frac_by_cause.get("queue_dry"),
    "trace.idle.kernel_overhead_frac": lambda t: t.idle_frac_by_cause.get("kernel_overhead"),
    "trace.share.gemm": lambda t: t.kernel_share.get("gemm"),
    "trace.share.attention": lambda t: t.kernel_share.get("attention"),
    "trace.share.comm": lambda t: t.kernel_share.get("comm"),
    "trace.share.memcpy": lambda t: _sum_or_none(t.kernel_share, ("memcpy", "memset")),
    "trace.share.elementwise": lambda t: _sum_or_none(t.kernel_share, ("norm_elementwise", "reduction")),
    "trace.short_kernel_frac": lambda t: t.short_kernel_frac,
    "trace.kernels_per_s": lambda t: t.kernel_count / t.window_s if t.window_s > 0 and t.kernel_count else None,
    "trace.cuda_graph_launches": lambda t: float(t.cuda_graph_launches) if t.kernel_count else None,
    "trace.intensity": lambda t: t.intensity_flop_per_byte,
    "trace.decode_batch": lambda t: t.decode_batch,
    "trace.prefill_frac": lambda t: t.prefill_frac,
}


def _sum_or_none(d: dict[str, float], keys: tuple[str, ...]) -> float | None:
    present = [d[k] for k in keys if k in d]
    return math.fsum(present) if present else None


def _trace_signals(capture: Capture) -> Iterator[Signal]:
    trace = capture.trace
    assert trace is not None
    for name, read in _TRACE_FIELDS.items():
        value = read(trace)
        if value is not None and not math.isnan(value):
            yield Signal(name, spec(name).unit, ("trace",), (float(value),))


def _primary_gpu(capture: Capture) -> GpuInfo | None:
    return capture.gpus[0] if capture.gpus else None


def _derive_theory(capture: Capture, ev: Evidence) -> None:
    """Physics-derived signals: need a recognised GPU; model-dependent ones need the model's shape."""
    from diagnoser import physics

    gpu = _primary_gpu(capture)
    if gpu is None:
        return
    gspec = physics.match_gpu(gpu.name, gpu.memory_total_bytes)
    if gspec is None:
        ev.notes.append(f"GPU '{gpu.name}' is not in the physics table: roofline and ceilings are not computed.")
        return
    gspec = physics.with_measured(gspec, gpu.measured) if gpu.measured else gspec
    ev.gpu_spec = gspec
    model = capture.model
    dtype = physics.normalise_dtype(model.dtype) if model and model.dtype else "bf16"
    if not (model and model.dtype) and capture.trace is not None and capture.trace.dtype:
        dtype = physics.normalise_dtype(capture.trace.dtype)  # the precision the traced ops ran at
    ev.add(Signal("theory.ridge_flop_per_byte", "FLOP/B", ("physics",), (physics.ridge_point(gspec, dtype),)))
    if "gpu.mem_total_bytes" not in ev:
        ev.add(Signal("gpu.mem_total_bytes", "bytes", ("physics",), (float(gspec.memory_bytes),)))
    if model is None or not model.params:
        return
    tp = max(1, model.tensor_parallel)
    ev.add(Signal("theory.weight_bytes", "bytes", ("physics",), (physics.weight_bytes(model, dtype) / tp,)))
    ev.add(Signal("theory.ridge_batch", "sequences", ("physics",), (physics.ridge_batch(model, gspec, dtype),)))
    batch = ev.observed_batch()
    context = _observed_context(capture)
    if batch is None:
        return
    ceiling = physics.decode_ceiling_tokens_per_s(model, gspec, batch=max(1.0, batch), context=context, dtype=dtype, tp=tp)
    ev.add(Signal("theory.decode_ceiling_tokens_per_s", "tokens/s", ("physics",), (ceiling,)))
    gen = ev.get("server.gen_tokens_per_s")
    if gen is not None and ceiling > 0:
        ev.add(Signal("theory.efficiency", "ratio", ("server", "physics"), (gen.mean / ceiling,)))
        # Which phase the GPU's time must go to: a second's generated tokens at the decode ceiling against a second's
        # prompt tokens at the prefill bound (compute, or one weight read for a short prompt).
        prompt = ev.get("server.prompt_tokens_per_s")
        decode_s = gen.mean / ceiling
        prefill_s = (physics.prefill_time_s(model, gspec, max(1, round(prompt.mean)), dtype, tp)
                     if prompt is not None and prompt.mean > 0 else 0.0)
        if decode_s + prefill_s > 0:
            ev.add(Signal("theory.decode_share", "ratio", ("server", "physics"), (decode_s / (decode_s + prefill_s),)))


def _observed_context(capture: Capture) -> int:
    """Mean context length when the serving config says so; else 0 (weights only, the optimistic ceiling)."""
    value = capture.serving.get("mean_context_tokens")
    return int(value) if isinstance(value, (int, float)) and value > 0 else 0
