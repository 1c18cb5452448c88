"""Evidence: pure functions from a capture to what rules read.

Rules read only this, never the capture: named signals with statistics over the window, the hardware and model the
physics needs, the serving configuration, the trace's facts, which fixes are already in place, the workload's
regime (which roof it would hit) and how far each roof is from saturated, and what limits the data's quality. A
signal that was not measured is absent (never a zero), and `why_missing` says why, from the capture's list of
unavailable sources.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from diagnoser import signals as S
from diagnoser.capture import Capture, GpuInfo, ModelInfo, Series, ServingConfig, StackSamples, TraceSummary
from diagnoser.characterise import fp32_share, graph_share
from diagnoser.diagnosis import FixKind, Regime
from diagnoser.signals import spec

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
    from_samples: ClassVar[bool] = False

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



min_, max_ = min, max  # Signal's own min/max properties shadow the builtins inside the class body


@dataclass(frozen=True)
class Unavailable:
    source: str
    what: str
    reason: str
    hint: str = ""


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


# --- building it -------------------------------------------------------------------------------------------

def build_evidence(capture: Capture) -> Evidence:
    ev = Evidence(meta=_meta(capture), model=capture.model, serving=capture.serving, trace=capture.trace,
                  stacks=capture.stacks)
    for signal in _pooled(capture.series):
        ev.add(signal)
    _derive_memory_fraction(capture, ev)
    if capture.trace is not None:
        for signal in _trace_signals(capture.trace):
            ev.add(signal)
    ev.context_tokens = _observed_context(capture.serving)
    _derive_theory(capture, ev)
    _derive_energy(capture, ev)
    from diagnoser.characterise import characterise

    characterise(ev)
    return ev


def _meta(capture: Capture) -> Meta:
    return Meta(
        target=capture.target, window_s=capture.duration_s, started_at=capture.started_at, host=capture.host,
        tool_version=capture.tool_version, cpu_only=capture.cpu_only, origin=capture.origin,
        server_kind=capture.server.kind if capture.server is not None else "",
        model_name=(capture.model.name or "unnamed") if capture.model is not None else "",
        gpus=tuple(capture.gpus), measured_roofs=any(g.measured for g in capture.gpus),
        exited_at_s=capture.process.exited_at_s if capture.process is not None else None,
        notes=tuple(capture.notes),
        unavailable=tuple(Unavailable(u.source, u.what, u.reason, u.hint) for u in capture.unavailable))


def _derive_energy(capture: Capture, ev: Evidence) -> None:
    """Tokens per joule from generation rate and board power; cost per million tokens from a $/GPU-hour."""
    from diagnoser import physics

    gen = ev.get(S.SERVER_GEN_TOKENS_PER_S)
    if gen is None or gen.mean <= 0:
        return
    gpus = max(1, len(capture.gpus))
    power = ev.get(S.GPU_POWER_W)
    if power is not None and power.mean > 0:
        ev.add(Signal(S.ENERGY_TOKENS_PER_JOULE, S.ENERGY_TOKENS_PER_JOULE.unit, ("server", *power.sources),
                      (physics.tokens_per_joule(gen.mean, power.mean * gpus),)))
    price = capture.serving.usd_per_gpu_hour
    if price is not None and price > 0:
        ev.add(Signal(S.ENERGY_USD_PER_MILLION_TOKENS, "USD", ("server", "user"),
                      (physics.cost_per_million_tokens(gen.mean, float(price), gpus=gpus),)))


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
            times = tuple(t for s in members for t, v in zip(s.times, s.values, strict=True) if not math.isnan(v))
        if not values:
            continue
        sources = (members[0].source,) if len(members) == 1 else tuple(sorted({s.source for s in members}))
        buckets = [b for s in members if (b := s.bucket()) is not None]
        bucket = (min(b[0] for b in buckets), max(b[1] for b in buckets)) if len(buckets) == len(members) else None
        yield Signal(name, members[0].unit or spec(name).unit, sources, values, times, bucket)


def _derive_memory_fraction(capture: Capture, ev: Evidence) -> None:
    """gpu.mem_used_frac from used bytes and the total (a series or the GPU's size), per GPU, then pooled."""
    if S.GPU_MEM_USED_FRAC in ev or S.GPU_MEM_USED_BYTES not in ev:
        return
    totals = {str(g.index): g.memory_total_bytes for g in capture.gpus if g.memory_total_bytes}
    for s in capture.series_named(S.GPU_MEM_TOTAL_BYTES):
        if s.values:
            totals[s.labels.get("gpu", "0")] = int(max(s.values))
    fracs: list[float] = []
    times: list[float] = []
    sources: set[str] = set()
    for s in capture.series_named(S.GPU_MEM_USED_BYTES):
        total = totals.get(s.labels.get("gpu", "0"))
        if not total:
            continue
        fracs.extend(v / total for v in s.values)
        times.extend(s.times)
        sources.add(s.source)
    if fracs:
        ev.add(Signal(S.GPU_MEM_USED_FRAC, "ratio", tuple(sorted(sources)), tuple(fracs), tuple(times)))
    if S.GPU_MEM_TOTAL_BYTES not in ev and totals:
        ev.add(Signal(S.GPU_MEM_TOTAL_BYTES, "bytes", ("nvml",), (float(max(totals.values())),)))


def _sum_or_none(d: Mapping[str, float], keys: tuple[str, ...]) -> float | None:
    present = [d[k] for k in keys if k in d]
    return math.fsum(present) if present else None


_TRACE_FIELDS = {
    S.TRACE_GPU_IDLE_FRAC: lambda t: None if t.gpu_busy_frac is None else 1.0 - t.gpu_busy_frac,
    S.TRACE_IDLE_HOST_FRAC: lambda t: t.idle_frac_by_cause.get("host"),
    S.TRACE_IDLE_SYNC_FRAC: lambda t: t.idle_frac_by_cause.get("sync"),
    S.TRACE_IDLE_PAGEABLE_MEMCPY_FRAC: lambda t: t.idle_frac_by_cause.get("pageable_memcpy"),
    S.TRACE_IDLE_QUEUE_DRY_FRAC: lambda t: t.idle_frac_by_cause.get("queue_dry"),
    S.TRACE_IDLE_KERNEL_OVERHEAD_FRAC: lambda t: t.idle_frac_by_cause.get("kernel_overhead"),
    S.TRACE_IDLE_STREAM_WAIT_FRAC: lambda t: t.idle_frac_by_cause.get("stream_wait"),
    S.TRACE_SHARE_EMBEDDING: lambda t: t.kernel_share.get("embedding"),
    S.TRACE_SHARE_ALL_TO_ALL: lambda t: t.comm_share_by_kind.get("all_to_all") or None,
    S.TRACE_RANK_IMBALANCE: lambda t: _rank_imbalance(t),
    S.TRACE_FP32_SHARE: lambda t: fp32_share(t),
    S.TRACE_SHARE_GEMM: lambda t: t.kernel_share.get("gemm"),
    S.TRACE_SHARE_ATTENTION: lambda t: t.kernel_share.get("attention"),
    S.TRACE_SHARE_COMM: lambda t: t.kernel_share.get("comm"),
    S.TRACE_SHARE_MEMCPY: lambda t: _sum_or_none(t.kernel_share, ("memcpy", "memset")),
    S.TRACE_SHARE_ELEMENTWISE: lambda t: _sum_or_none(t.kernel_share, ("norm_elementwise", "reduction")),
    S.TRACE_SHORT_KERNEL_FRAC: lambda t: t.short_kernel_frac,
    S.TRACE_KERNELS_PER_S: lambda t: t.kernel_count / t.window_s if t.window_s > 0 and t.kernel_count else None,
    S.TRACE_CUDA_GRAPH_LAUNCHES: lambda t: float(t.cuda_graph_launches) if t.kernel_count else None,
    S.TRACE_GRAPH_KERNEL_FRAC: graph_share,
    S.TRACE_COMM_EXPOSED_FRAC: lambda t: t.extra.get("comm_exposed_frac") if t.kernel_share.get("comm") else None,
    S.TRACE_INTENSITY: lambda t: t.intensity_flop_per_byte,
    S.TRACE_DECODE_BATCH: lambda t: t.decode_batch,
    S.TRACE_PREFILL_FRAC: lambda t: t.prefill_frac,
}


def _rank_imbalance(trace: TraceSummary) -> float | None:
    """The busiest rank's compute share over the median rank's (the straggler's lead), for two ranks or more."""
    shares = sorted(r.compute_frac for r in trace.ranks if r.compute_frac)
    if len(shares) < 2:
        return None
    median = statistics.median(shares)
    return shares[-1] / median if median > 0 else None


def _trace_signals(trace: TraceSummary) -> Iterator[Signal]:
    for name, read in _TRACE_FIELDS.items():
        value = read(trace)
        if value is not None and not math.isnan(value):
            yield Signal(name, name.unit, ("trace",), (float(value),))


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
    ev.add(Signal(S.THEORY_RIDGE_FLOP_PER_BYTE, "FLOP/B", ("physics",), (physics.ridge_point(gspec, dtype),)))
    if S.GPU_MEM_TOTAL_BYTES not in ev:
        ev.add(Signal(S.GPU_MEM_TOTAL_BYTES, "bytes", ("physics",), (float(gspec.memory_bytes),)))
    if S.GPU_POWER_DEFAULT_LIMIT_W not in ev and gspec.tdp_w:
        ev.add(Signal(S.GPU_POWER_DEFAULT_LIMIT_W, "W", ("physics",), (float(gspec.tdp_w),)))
    _trace_roofs(capture, ev, gspec, dtype)
    engine = _engine_roofs(ev, gspec, dtype)
    if model is None or not model.params:
        return
    tp = max(1, model.tensor_parallel)
    ev.add(Signal(S.THEORY_WEIGHT_BYTES, "bytes", ("physics",), (physics.weight_bytes(model, dtype) / tp,)))
    ev.add(Signal(S.THEORY_RIDGE_BATCH, "sequences", ("physics",), (physics.ridge_batch(model, gspec, dtype),)))
    batch = ev.observed_batch()
    context = ev.context_tokens
    gen, prompt = ev.get(S.SERVER_GEN_TOKENS_PER_S), ev.get(S.SERVER_PROMPT_TOKENS_PER_S)
    # Achieved model FLOP/s (2 FLOP per active weight per token, prefill and decode alike) over the tensor peak.
    rate = (gen.mean if gen is not None else 0.0) + (prompt.mean if prompt is not None else 0.0)
    if rate > 0:
        active = model.active_params or model.params
        flops = 2.0 * active * rate / tp
        if S.THEORY_COMPUTE_ROOF_FRAC not in engine:
            ev.add(Signal(S.THEORY_COMPUTE_ROOF_FRAC, "ratio", ("server", "physics"),
                          (flops / physics.peak_flops(gspec, dtype),)))
    if batch is None:
        return
    step_batch = max(1.0, batch)
    ceiling = physics.decode_ceiling_tokens_per_s(model, gspec, batch=step_batch, context=context, dtype=dtype, tp=tp)
    ev.add(Signal(S.THEORY_DECODE_CEILING_TOKENS_PER_S, "tokens/s", ("physics",), (ceiling,)))
    step_bytes = physics.decode_step_bytes(model, step_batch, context, dtype=dtype, tp=tp)
    active = model.active_params or model.params
    ev.add(Signal(S.THEORY_INTENSITY, "FLOP/B", ("physics",), (2.0 * active * step_batch / tp / step_bytes,)))
    if gen is not None and ceiling > 0:
        ev.add(Signal(S.THEORY_EFFICIENCY, "ratio", ("server", "physics"), (gen.mean / ceiling,)))
        # Bytes the decode steps read per second over the bandwidth: how close decode runs to the HBM roof.
        if S.THEORY_HBM_ROOF_FRAC not in engine:
            ev.add(Signal(S.THEORY_HBM_ROOF_FRAC, "ratio", ("server", "physics"),
                          (gen.mean / step_batch * step_bytes / gspec.hbm_bytes_per_s,)))
        # Which phase the GPU's time must go to: a second's generated tokens at the decode ceiling against a second's
        # prompt tokens at the prefill bound (compute, or one weight read for a short prompt).
        decode_s = gen.mean / ceiling
        prefill_s = (physics.prefill_time_s(model, gspec, max(1, round(prompt.mean)), dtype, tp)
                     if prompt is not None and prompt.mean > 0 else 0.0)
        if decode_s + prefill_s > 0:
            ev.add(Signal(S.THEORY_DECODE_SHARE, "ratio", ("server", "physics"), (decode_s / (decode_s + prefill_s),)))


def _engine_roofs(ev: Evidence, gspec: GpuSpec, dtype: str) -> set[str]:
    """How close the engine's own accounting puts its work to each roof (vLLM's estimated FLOPs and bytes per GPU):
    it counts what the model-based figures leave out (KV reads, attention), so it takes precedence over them. The
    names set."""
    from diagnoser import physics

    out: set[str] = set()
    read, write = ev.get(S.SERVER_EST_READ_BYTES_PER_S), ev.get(S.SERVER_EST_WRITE_BYTES_PER_S)
    moved = (read.mean if read is not None else 0.0) + (write.mean if write is not None else 0.0)
    if moved > 0:
        ev.add(Signal(S.THEORY_HBM_ROOF_FRAC, "ratio", ("server", "physics"), (moved / gspec.hbm_bytes_per_s,)))
        out.add(S.THEORY_HBM_ROOF_FRAC)
    flops = ev.get(S.SERVER_EST_FLOPS_PER_S)
    if flops is not None and flops.mean > 0:
        ev.add(Signal(S.THEORY_COMPUTE_ROOF_FRAC, "ratio", ("server", "physics"),
                      (flops.mean / physics.peak_flops(gspec, dtype),)))
        out.add(S.THEORY_COMPUTE_ROOF_FRAC)
    return out


def _trace_roofs(capture: Capture, ev: Evidence, gspec: GpuSpec, dtype: str) -> None:
    """How close the traced ops ran to each roof, when the trace measured their FLOP/s and bytes/s over ops that
    cover most of the GPU time (the server's rates, when known, take precedence: they cover all of it)."""
    from diagnoser import physics
    from diagnoser.characterise import MIN_COSTED_SHARE, costed_share

    trace = capture.trace
    if trace is None:
        return
    covered = costed_share(trace)
    if covered is None or covered < MIN_COSTED_SHARE:
        return
    if trace.achieved_bytes_per_s:
        ev.add(Signal(S.THEORY_HBM_ROOF_FRAC, "ratio", ("trace", "physics"),
                      (trace.achieved_bytes_per_s / gspec.hbm_bytes_per_s,)))
    if trace.achieved_flops:
        ev.add(Signal(S.THEORY_COMPUTE_ROOF_FRAC, "ratio", ("trace", "physics"),
                      (trace.achieved_flops / physics.peak_flops(gspec, dtype),)))


def _observed_context(serving: ServingConfig) -> int:
    """Mean context length when the serving config says so; else 0 (weights only, the optimistic ceiling)."""
    value = serving.mean_context_tokens
    return int(value) if value is not None and value > 0 else 0
