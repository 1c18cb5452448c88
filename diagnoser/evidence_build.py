"""Building the evidence: pure functions from a capture to what rules read (evidence.py).

The capture's series pooled into signals (one per name, over the target's GPUs), the trace's facts as signals, the
physics (ceilings, intensity, how close decode runs to each roof) and energy signals; then `characterise` reads the
whole and says the regime, the fixes in place and the data's quality. A signal that was not measured stays absent.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from diagnoser import signals as S
from diagnoser.capture import Capture, GpuInfo, Series, ServingConfig, TraceSummary
from diagnoser.characterise import MIN_COSTED_SHARE, characterise, costed_share, fp32_share, graph_share
from diagnoser.evidence import Evidence, Meta, Signal
from diagnoser.signals import spec

if TYPE_CHECKING:
    from diagnoser.physics import GpuSpec


@dataclass(frozen=True)
class WindowSignals:
    """One GPU's window as a time-series engine's statistics give it (the fleet): its signals, made from the
    statistics (`Signal.from_stats`), and its identity and circumstances (`meta.gpus` holds the GPU). No samples,
    trace, model or server: the physics comes from the GPU alone."""

    meta: Meta
    signals: Mapping[str, Signal]


# The physics evidence of a GPU model (its spec, ceilings and roofs), by model name and memory: a fleet's GPUs of one
# model share it, and making it per GPU would double the triage's cost.
PhysicsCache = dict[tuple[str, "int | None"], Evidence]


def build_evidence(source: Capture | WindowSignals, *, physics: PhysicsCache | None = None) -> Evidence:
    """What rules read, from a capture's samples or from one GPU's window statistics; `physics` keeps the physics
    of each GPU model for the next GPU of the same model."""
    if isinstance(source, WindowSignals):
        return _from_window(source, physics)
    capture = source
    ev = Evidence(meta=_meta(capture), model=capture.model, serving=capture.serving, trace=capture.trace,
                  stacks=capture.stacks)
    for signal in _pooled(capture.series):
        ev.add(signal)
    _derive_memory_fraction(capture, ev)
    _derive_queue_growth(ev)
    if capture.trace is not None:
        for signal in _trace_signals(capture.trace):
            ev.add(signal)
    ev.context_tokens = _observed_context(capture.serving)
    _derive_theory(capture, ev)
    _derive_energy(capture, ev)
    characterise(ev)
    return ev


def _from_window(window: WindowSignals, physics: PhysicsCache | None) -> Evidence:
    gpu = window.meta.gpus[0] if window.meta.gpus else None
    template = _physics_of(gpu, physics)
    ev = Evidence(signals={**template.signals, **window.signals}, meta=window.meta, gpu_spec=template.gpu_spec,
                  notes=list(template.notes))
    characterise(ev)  # the regime, from the counters, as for any capture
    return ev


def _physics_of(gpu: GpuInfo | None, physics: PhysicsCache | None) -> Evidence:
    """The physics signals and spec of a GPU model, the same for all its GPUs."""
    key = (gpu.name, gpu.memory_total_bytes) if gpu is not None else ("", None)
    ev = physics.get(key) if physics is not None else None
    if ev is None:
        ev = build_evidence(Capture(target="", started_at=0.0, duration_s=0.0, gpus=[gpu] if gpu is not None else []))
        if physics is not None:
            physics[key] = ev
    return ev


def _meta(capture: Capture) -> Meta:
    return Meta(
        target=capture.target, window_s=capture.duration_s, started_at=capture.started_at, host=capture.host,
        tool_version=capture.tool_version, cpu_only=capture.cpu_only, origin=capture.origin,
        server_kind=capture.server.kind if capture.server is not None else "",
        server_version=capture.server.version if capture.server is not None else "",
        model_name=(capture.model.name or "unnamed") if capture.model is not None else "",
        gpus=tuple(capture.gpus), measured_roofs=any(g.measured for g in capture.gpus),
        exited_at_s=capture.process.exited_at_s if capture.process is not None else None,
        notes=tuple(capture.notes),
        unavailable=tuple(capture.unavailable))


def _derive_queue_growth(ev: Evidence) -> None:
    """How fast the waiting queue grew over the window: the lesser of the least-squares slopes of its two halves,
    so a queue that grows all window (arrivals above service) reads positive and one that filled once and then held
    (closed-loop clients starting, a burst) reads about zero."""
    waiting = ev.get(S.SERVER_WAITING)
    if waiting is None or len(waiting.times) != waiting.n or waiting.n < 6:
        return
    pairs = sorted(zip(waiting.times, waiting.values, strict=True))
    if pairs[-1][0] - pairs[0][0] < 5.0:
        return
    half = len(pairs) // 2
    slopes = [_slope(pairs[:half + 1]), _slope(pairs[half:])]
    known = [x for x in slopes if x is not None]
    if len(known) == 2:
        ev.add(Signal(S.SERVER_WAITING_GROWTH_PER_S, S.SERVER_WAITING_GROWTH_PER_S.unit, waiting.sources,
                      (min(known),)))


def _slope(pairs: list[tuple[float, float]]) -> float | None:
    ts = [t for t, _ in pairs]
    mt = math.fsum(ts) / len(ts)
    var = math.fsum((t - mt) ** 2 for t in ts)
    if var <= 0:
        return None
    mv = math.fsum(v for _, v in pairs) / len(pairs)
    return math.fsum((t - mt) * (v - mv) for t, v in pairs) / var


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
    S.TRACE_COMM_EXPOSED_FRAC: lambda t: t.comm_exposed_frac if t.kernel_share.get("comm") else None,
    S.TRACE_COLLECTIVES_PER_STEP: lambda t: t.collectives_per_step,
    S.TRACE_COLLECTIVE_S_P50: lambda t: t.collective_us_p50 / 1e6 if t.collective_us_p50 is not None else None,
    S.TRACE_COLLECTIVE_HOST_FRAC: lambda t: t.collective_host_frac,
    S.TRACE_INTENSITY: lambda t: t.intensity_flop_per_byte,
    # The engine's own step annotations, where it wrote them, over what the kernels' shapes suggest.
    S.TRACE_DECODE_BATCH: lambda t: t.engine_steps.decode_batch if _annotated(t) else t.decode_batch,
    S.TRACE_PREFILL_FRAC: lambda t: t.engine_steps.prefill_time_frac if _annotated(t) else t.prefill_frac,
}


def _annotated(trace: TraceSummary) -> bool:
    return trace.engine_steps is not None and trace.engine_steps.steps > 0


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
