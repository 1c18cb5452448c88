"""`analyze_trace(path)`: one pass over a trace file (or a folder of per-rank files) into a TraceAnalysis, whose
`.summary` is the TraceSummary a Capture carries, and `capture_from_trace` to diagnose a trace on its own.

The analysed window:
- a live capture by diagnoser's hook (metadata `diagnoser_window`): the profiler's own span, because idle time at
  its edges is real idle time of the server;
- otherwise, with ProfilerStep annotations: from the first step's start to the end of the last step or of the last
  GPU op launched inside a step, whichever is later. The last step is kept (HolisticTraceAnalysis drops it);
- otherwise the span of GPU activity (first GPU op start to last GPU op end), which leaves out setup before the
  first kernel and teardown after the last; a CPU-only trace uses the profiler span or all events.
`window="trace" | "gpu" | "steps"` forces one of these.
"""

from __future__ import annotations

import gc
import math
import os
from collections import Counter
from collections.abc import Sequence
from functools import partial
from operator import add
from pathlib import Path
from typing import Any

from diagnoser.capture import (
    Capture,
    GpuInfo,
    ModelInfo,
    TraceSummary,
    new_capture,
)
from diagnoser.traces import facts
from diagnoser.traces.classify import ATTENTION, GEMM
from diagnoser.traces.decode import (
    SKIP_BAD_TYPE,
    SKIP_MALFORMED,
    SKIP_MISSING_TIME,
    SKIP_NEGATIVE_DURATION,
    SKIP_NEGATIVE_TIME,
    SKIP_NON_FINITE,
    SKIP_TRUNCATED,
    TraceError,
)
from diagnoser.traces.engine_steps import engine_step_stats
from diagnoser.traces.kernels import (
    COMM_KINDS,
    KernelStats,
    device_unions,
    kernel_stats,
)
from diagnoser.traces.ops import (
    LaunchIndex,
    build_launch_index,
    cost_ops,
    covered_kernel_us,
    kernel_costs,
)
from diagnoser.traces.phases import find_phases
from diagnoser.traces.result import DeviceInfo, TraceAnalysis
from diagnoser.traces.snapshot import build_window, choose_range
from diagnoser.traces.tables import Tables
from diagnoser.traces.timeline import (
    IDLE_CAUSES,
    DeviceTimeline,
    HostActivity,
    Launches,
    build_timeline,
    device_order,
)
from diagnoser.traces.windows import (
    WINDOWS,  # defined apart so that the CLI's help needs no analysis
)

TRACE_SUFFIXES = (".json", ".json.gz", ".pt.trace.json", ".pt.trace.json.gz")
LIVE_WINDOW_KEY = "diagnoser_window"


def trace_files(path: Path) -> list[Path]:
    """The trace files in a folder (one per rank), sorted by name."""
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(TRACE_SUFFIXES))
    if not files:
        raise TraceError(f"{path} holds no trace files (*.json or *.json.gz).")
    return files


def analyze_trace(path: str | Path | Sequence[str | Path], *, window: str = "auto", gpu_name: str | None = None,
                  max_bytes: int | None = None, jobs: int | None = None) -> TraceAnalysis:
    """Analyse a Kineto/Chrome trace (plain or gzip), a folder of per-rank traces, or a list of trace files (the
    ranks of one job: the analysis compares them, summary.ranks).

    `gpu_name` overrides the GPU named in deviceProperties for the ridge point (e.g. when the trace lacks them).
    `max_bytes` overrides the trace-size limit (decode.max_trace_bytes). `jobs` is the number of processes that read a
    large trace (parallel.py; default: every core this process may use; 1: this process alone).
    Raises TraceError (an InputError, exit 2) when nothing usable can be read; a partly readable trace gives a
    partial analysis whose summary.skipped says what was left out.
    """
    if window not in WINDOWS:
        raise TraceError(f"unknown window '{window}'; use one of {', '.join(WINDOWS)}.")
    if not isinstance(path, (str, Path)):
        files = [Path(p) for p in path]
        if len(files) == 1:
            return analyze_trace(files[0], window=window, gpu_name=gpu_name, max_bytes=max_bytes, jobs=jobs)
        if not files:
            raise TraceError("no trace files given.")
        for f in files:
            if not f.is_file() and not f.exists():
                raise TraceError(f"no trace file at {f}.")
            if f.is_dir():
                raise TraceError(f"{f} is a folder; give either one folder of ranks or several trace files.")
        from diagnoser.traces.ranks import combine

        return combine(_common_parent(files), _analyze_files(files, window, gpu_name, max_bytes, jobs))
    path = Path(path)
    if path.is_dir():
        from diagnoser.traces.ranks import combine

        return combine(path, _analyze_files(trace_files(path), window, gpu_name, max_bytes, jobs))
    if not path.exists():
        raise TraceError(f"no trace file at {path}.")
    return analyze_file(path, window=window, gpu_name=gpu_name, max_bytes=max_bytes, jobs=jobs)


def _analyze_files(files: list[Path], window: str, gpu_name: str | None, max_bytes: int | None,
                   jobs: int | None) -> list[TraceAnalysis]:
    """Each rank's analysis, the ranks spread over the jobs' processes (parallel.each_file). Only the first file's
    window to draw is built (the job's, ranks.combine); where the first file is a serving frontend, the first rank is
    read again for its window."""
    from diagnoser.traces.parallel import each_file
    from diagnoser.traces.ranks import split_frontends

    out = each_file(partial(_analyze_one, window=window, gpu_name=gpu_name, max_bytes=max_bytes, drawn=files[0]),
                    files, jobs)
    first = split_frontends(out)[0][0]
    if first is not out[0] and first.gpu_ops:
        out[out.index(first)] = analyze_file(first.path, window=window, gpu_name=gpu_name, max_bytes=max_bytes,
                                             jobs=jobs)
    return out


def _analyze_one(path: Path, jobs: int, *, window: str, gpu_name: str | None, max_bytes: int | None,
                 drawn: Path) -> TraceAnalysis:
    return analyze_file(path, window=window, gpu_name=gpu_name, max_bytes=max_bytes, jobs=jobs, draw=path == drawn)


def _common_parent(files: list[Path]) -> Path:
    parents = {f.resolve().parent for f in files}
    return parents.pop() if len(parents) == 1 else Path(os.path.commonpath([str(p) for p in parents]))


def analyze_file(path: Path, *, window: str = "auto", gpu_name: str | None = None,
                 max_bytes: int | None = None, jobs: int | None = None, draw: bool = True) -> TraceAnalysis:
    """One trace file's analysis; `draw`: with its window to draw (TraceAnalysis.snapshot)."""
    from diagnoser.traces.parallel import collect_parallel

    t = collect_parallel(path, jobs=jobs, max_bytes=max_bytes)
    if t.stats.events == 0:
        if t.stats.truncated:
            raise TraceError(f"{path} is cut short before its first complete event; nothing to analyse.")
        raise TraceError(f"{path} is a trace with no events.")
    return analyze_tables(t, window=window, gpu_name=gpu_name, draw=draw)


def analyze_tables(t: Tables, *, window: str = "auto", gpu_name: str | None = None,
                   draw: bool = True) -> TraceAnalysis:
    """The analysis of decoded columns. The cyclic garbage collector is paused meanwhile: the analysis builds lists of
    millions of numbers and no cycles, and each full collection would walk all of them (15 % of the analysis of an
    800 MB trace)."""
    was = gc.isenabled()
    gc.disable()
    try:
        return _analyze_tables(t, window, gpu_name, draw)
    finally:
        if was:
            gc.enable()


def _analyze_tables(t: Tables, window: str, gpu_name: str | None, draw: bool) -> TraceAnalysis:
    skipped: list[str] = list(t.stats.notes)
    reasons = t.stats.skips + t.skips
    if reasons:
        skipped.append(_skip_note(reasons, t.stats.events + sum(t.stats.skips.values())))
    launches = Launches(t)
    order = device_order(t)
    win, policy = _window(t, window, launches, skipped)
    win = _cut_at_last_gpu_event(t, win, skipped)
    devices = _devices(t.metadata)
    summary = TraceSummary(path=str(t.path), window_s=max(0.0, (win[1] - win[0]) / 1e6))
    summary.truncated = t.stats.truncated
    summary.events_total = t.stats.events + sum(t.stats.skips.values())
    summary.events_skipped = sum(reasons.values())
    summary.skip_reasons = {k: v for k, v in sorted(reasons.items()) if v}
    analysis = TraceAnalysis(path=t.path, summary=summary, window=win, window_policy=policy, devices=devices,
                             decode=t.stats, metadata_keys=sorted(t.metadata))
    _distributed(analysis, t.metadata)
    analysis.gpu_ops, analysis.cpu_ops = len(t.g_ts), t.counts["cpu_op"]
    base = t.metadata.get("baseTimeNanoseconds")
    analysis.base_time_ns = base if isinstance(base, int) else None

    g_ts, g_dur = t.g_ts, t.g_dur
    w0, w1 = win
    in_window = {dev: [i for i in idx if g_ts[i] < w1 and g_ts[i] + g_dur[i] > w0] for dev, idx in order.items()}
    selected = [i for idx in in_window.values() for i in idx]
    skipped += _missing_gpu_notes(t, devices, selected)
    shown = choose_range(t, selected, win, launches) if draw else None
    _timelines(analysis, t, in_window, launches, shown)
    index: LaunchIndex | None = build_launch_index(t, launches, selected) if t.costed and selected else None
    if t.costed:
        analysis.ops = cost_ops(t, index, win)
        if analysis.ops.uncosted:
            skipped.append(f"{analysis.ops.uncosted} matmul/conv/attention ops had incomplete shapes and were not "
                           "costed")
    elif t.counts["cpu_op"] and not t.shapes_seen:
        skipped.append("no recorded shapes (record_shapes=False): FLOPs, intensity and serving phases are not "
                       "derived")
    if selected:
        costs = kernel_costs(t, analysis.ops) if analysis.ops is not None and index is not None else {}
        analysis.kernels = kernel_stats(t, selected, launches, costs=costs)
    if shown is not None:
        analysis.snapshot = build_window(t, selected, shown, win, launches, analysis.timelines)
    analysis.step_ms_p50 = facts.step_ms_p50(t)
    if analysis.ops is not None and analysis.ops.runs:
        steps_in_window = [s for s in t.steps if s[1] + s[2] > win[0] and s[1] < win[1]]
        analysis.phases = find_phases(analysis.ops, steps_in_window, index, win)
    _ridge(analysis, gpu_name, skipped)
    _fill_summary(analysis, t, skipped)
    if t.engine_steps:
        summary.engine_steps = engine_step_stats(t.engine_steps, t.classed_ops, win)
    return analysis


def _cut_at_last_gpu_event(t: Tables, win: tuple[float, float], skipped: list[str]) -> tuple[float, float]:
    """Kineto writes the GPU events after the host's: a cut file loses the last kernels first. Idle after the last
    GPU event read would be the cut, not the GPU waiting, so the window ends there."""
    if not (t.stats.truncated and t.g_ts):
        return win
    gpu_end = max(map(add, t.g_ts, t.g_dur))
    if not win[0] < gpu_end < win[1]:
        return win
    skipped.append(f"the window ends at the last GPU event read ({(gpu_end - win[0]) / 1e3:.1f} of "
                   f"{(win[1] - win[0]) / 1e3:.1f} ms): the file is cut short, and what follows is missing, "
                   "not idle")
    return (win[0], gpu_end)


def _missing_gpu_notes(t: Tables, devices: list[DeviceInfo], selected: list[int]) -> list[str]:
    """Why the GPU timeline is not measured, or idle gaps not told apart, when the trace lacks what they need."""
    out = []
    if not t.g_ts and t.stats.truncated and devices:
        out.append(f"no GPU events: the file is cut short before them (it names {devices[0].name}), so the GPU "
                   "timeline, idle causes and kernel shares are not measured")
    elif not t.g_ts:
        out.append("no GPU events (kernels, copies): a CPU-only trace, so the GPU timeline, idle causes and "
                   "kernel shares are not measured")
    elif not selected:
        out.append("no GPU events inside the analysed window")
    if t.g_ts and not t.r_ts:
        out.append("no CUDA runtime/driver events: idle gaps cannot be told apart by launch time")
    return out


def _timelines(a: TraceAnalysis, t: Tables, in_window: dict[int, list[int]], launches: Launches,
               shown: tuple[float, float, str] | None) -> None:
    """Each device's timeline over the window, its compute time and its communication (overlapped or not)."""
    host = HostActivity(t)
    for dev in sorted(in_window):
        idx = in_window[dev]
        if idx:
            tl = build_timeline(t, dev, idx, a.window, launches, host, keep_range=shown[:2] if shown else None)
            compute, comm, overlapped = device_unions(t, idx, a.window)
            tl.compute_us = min(tl.busy_us, compute)
            a.timelines.append(tl)
            a.comm_us += comm
            a.comm_overlapped_us += overlapped


_SKIP_TEXT = {
    SKIP_MALFORMED: "in text that is not JSON",
    SKIP_BAD_TYPE: "with a field of an unexpected type",
    SKIP_TRUNCATED: "cut off at the end of the file",
    SKIP_NON_FINITE: "with a NaN or infinite time",
    SKIP_NEGATIVE_TIME: "with a negative start",
    SKIP_NEGATIVE_DURATION: "with a negative duration",
    SKIP_MISSING_TIME: "without a start or duration",
}


def _skip_note(reasons: Counter[str], total: int) -> str:
    """One line: how many events were left out of how many, and why."""
    parts = ", ".join(f"{n} {_SKIP_TEXT.get(r, r)}" for r, n in reasons.most_common() if n)
    skipped = sum(reasons.values())
    return f"{skipped} of {total} events were left out ({parts})"


def _window(t: Tables, policy: str, launches: Launches, skipped: list[str]) -> tuple[tuple[float, float], str]:
    gpu_span = None
    if t.g_ts:
        gpu_span = (min(t.g_ts), max(map(add, t.g_ts, t.g_dur)))
    trace_span = None
    if t.trace_spans:
        trace_span = (min(s for s, _ in t.trace_spans), max(e for _, e in t.trace_spans))
    elif (host := t.host_span())[0] < host[1] or gpu_span:
        lo = min(host[0], gpu_span[0] if gpu_span else math.inf)
        hi = max(host[1], gpu_span[1] if gpu_span else -math.inf)
        trace_span = (lo, hi)
    steps_span = _steps_span(t, launches, trace_span) if t.steps else None
    if policy == "auto":
        if LIVE_WINDOW_KEY in t.metadata and trace_span:
            return trace_span, "profiler window (live capture)"
        if steps_span:
            return steps_span, f"ProfilerSteps ({len(t.steps)}, last one kept)"
        if gpu_span:
            return gpu_span, "GPU activity span (no ProfilerStep annotations)"
        if trace_span:
            return trace_span, "trace span (no GPU events)"
    chosen = {"trace": trace_span, "gpu": gpu_span, "steps": steps_span}.get(policy)
    if chosen is not None:
        return chosen, {"trace": "profiler window", "gpu": "GPU activity span", "steps": "ProfilerSteps"}[policy]
    fallback = steps_span or gpu_span or trace_span
    if fallback is None:
        raise TraceError(f"{t.path} has no timed events to analyse.")
    skipped.append(f"window '{policy}' is not available in this trace; used the default window instead")
    return _window(t, "auto", launches, [])


def _steps_span(t: Tables, launches: Launches, trace_span: tuple[float, float] | None) -> tuple[float, float]:
    start = min(s[1] for s in t.steps)
    end = max(s[1] + s[2] for s in t.steps)
    if trace_span is not None:
        # A step still open when the profiler stopped is written with a bogus end far past the profiler window.
        start, end = max(start, trace_span[0]), min(end, trace_span[1])
    # GPU work launched inside the last step may finish after the step's CPU span closes: keep it.
    r_ts, g_ts, g_dur = t.r_ts, t.g_ts, t.g_dur
    later = [i for i, e in enumerate(map(add, g_ts, g_dur)) if e > end]  # few: only these can extend the window
    last_gpu_end = max((g_ts[i] + g_dur[i] for i in later
                        if (li := launches.of_gpu[i]) is not None and start <= r_ts[li] <= end), default=end)
    return start, max(end, last_gpu_end)


def _devices(meta: dict[str, Any]) -> list[DeviceInfo]:
    out: list[DeviceInfo] = []
    props = meta.get("deviceProperties")
    if isinstance(props, list):
        for p in props:
            if isinstance(p, dict) and isinstance(p.get("name"), str):
                mem = p.get("totalGlobalMem")
                major, minor = p.get("computeMajor"), p.get("computeMinor")
                out.append(DeviceInfo(
                    index=p["id"] if isinstance(p.get("id"), int) else len(out), name=p["name"],
                    memory_bytes=mem if isinstance(mem, int) else None,
                    sms=p.get("numSms") if isinstance(p.get("numSms"), int) else None,
                    capability=f"{major}.{minor}" if isinstance(major, int) and isinstance(minor, int) else ""))
    return out


def _distributed(analysis: TraceAnalysis, meta: dict[str, Any]) -> None:
    info = meta.get("distributedInfo")
    if isinstance(info, dict):
        rank, world = info.get("rank"), info.get("world_size")
        analysis.rank = rank if isinstance(rank, int) else None
        analysis.world_size = world if isinstance(world, int) else None


def _ridge(analysis: TraceAnalysis, gpu_name: str | None, skipped: list[str]) -> None:
    """Place the intensity against the GPU's ridge point, from the physics table."""
    from diagnoser import physics
    from diagnoser.errors import InputError

    used = {tl.device for tl in analysis.timelines}
    devices = [d for d in analysis.devices if d.index in used] or analysis.devices
    spec = None
    if gpu_name:
        spec = physics.get_gpu(gpu_name)
    elif devices:
        spec = physics.match_gpu(devices[0].name, devices[0].memory_bytes)
        if spec is None:
            skipped.append(f"GPU '{devices[0].name}' is not in the physics table: no ridge point")
    if spec is None:
        return
    analysis.gpu_spec = spec.name
    dtype = analysis.ops.dtype if analysis.ops is not None and analysis.ops.dtype else "bf16"
    try:
        analysis.ridge_flop_per_byte = physics.ridge_point(spec, dtype)
    except InputError as exc:
        skipped.append(f"no ridge point: {exc}")


# Op-derived numbers (intensity, phases) stand for the trace only when the costed ops launched at least this share of
# the GEMM and attention kernel time. On an H100, a CUDA-graph decode's only shaped ops were the eager prefills of new
# requests, a sliver of the GEMM time, which made a batch-1 decode look 99 % prefill at 107 FLOP/byte.
MIN_COSTED_COVERAGE = 0.5


def _costed_coverage(a: TraceAnalysis) -> float | None:
    """Share of the GEMM and attention kernel time that costed ops launched (norms and elementwise kernels are never
    costed, so they are not counted against it); None for CPU-only traces or without both numbers."""
    ops, k = a.ops, a.kernels
    if ops is None or k is None or ops.time_basis != "gpu":
        return None
    costable = k.time_us_by_class.get(GEMM, 0.0) + k.time_us_by_class.get(ATTENTION, 0.0)
    if costable <= 0:
        return None
    return min(1.0, ops.weighted_time_us / costable)


def _fill_summary(a: TraceAnalysis, t: Tables, skipped: list[str]) -> None:
    s = a.summary
    s.devices = [tl.device for tl in a.timelines]
    if a.timelines:
        _fill_idle(a, skipped)
    k = a.kernels
    s.steps = facts.steps(t)
    s.sampled, s.sampled_reason = facts.sampling(t)
    if s.sampled:
        skipped.append(f"the trace is incomplete: {s.sampled_reason}")
    s.platform, _ = facts.platform(t, [d.name for d in a.devices])
    if k is not None and k.total_us > 0:
        s.comm_share_by_kind = {c: us / k.total_us for c, us in k.comm_us_by_kind.items()} if k.comm_us_by_kind \
            else dict.fromkeys(COMM_KINDS, 0.0)
    s.workload, s.workload_evidence = facts.workload(t, k.kernel_names if k else {}, s.comm_share_by_kind)
    if k is not None:
        _fill_kernels(a, t, k)
    s.timeline = a.snapshot
    longest = max((g for tl in a.timelines for g in tl.longest_gaps), key=lambda g: g.length, default=None)
    if longest is not None and s.window_s > 0:
        s.longest_gap_frac = min(1.0, longest.length / (s.window_s * 1e6))
        s.longest_gap_cause = longest.cause
    partial = _fill_intensity(a, skipped)
    _fill_phases(a, partial)
    if s.attention_frac is None and k is not None and k.total_us > 0:
        s.attention_frac = k.time_us_by_class[ATTENTION] / k.total_us
    s.skipped = skipped


def _fill_idle(a: TraceAnalysis, skipped: list[str]) -> None:
    """Busy, idle by cause and the ops that held the host, as means over the devices' timelines."""
    s = a.summary
    n = len(a.timelines)
    s.gpu_busy_frac = sum(tl.busy_frac for tl in a.timelines) / n
    s.idle_frac_by_cause = {c: sum(tl.idle_frac(c) for tl in a.timelines) / n for c in IDLE_CAUSES}
    _temporal(s, a.timelines)
    inside: dict[str, float] = {}
    for tl in a.timelines:
        for name, us in tl.host_idle_ops_us.items():
            inside[name] = inside.get(name, 0.0) + us / tl.window_us / n if tl.window_us > 0 else 0.0
    s.host_idle_ops = dict(sorted(inside.items(), key=lambda kv: (-kv[1], kv[0]))[:8])
    blocked: dict[str, float] = {}
    for tl in a.timelines:
        for name, us in tl.blocked_in_waits_us.items():
            blocked[name] = blocked.get(name, 0.0) + (us / tl.window_us / n if tl.window_us > 0 else 0.0)
    s.blocked_in_waits = dict(sorted(blocked.items(), key=lambda kv: (-kv[1], kv[0]))[:4])
    unattributed = sum(tl.unattributed_launch_us for tl in a.timelines)
    if unattributed > 0:
        skipped.append(f"{unattributed / 1e3:.1f} ms of idle time precede GPU ops whose launch call is not in "
                       "the trace; it was attributed by host activity alone")


def _fill_kernels(a: TraceAnalysis, t: Tables, k: KernelStats) -> None:
    """Kernel shares, the top kernels, durations, launches and graph replays."""
    s = a.summary
    if k.kernel_us > 0:
        s.graph_kernel_frac = min(1.0, k.graph_kernel_us / k.kernel_us)
        s.top_kernels = k.top
        s.kernel_duration_us = k.durations
        if a.ops is not None and a.ops.time_basis == "gpu":
            s.costed_time_frac = min(1.0, covered_kernel_us(t, a.ops) / k.kernel_us)
        elif a.ops is None or not a.ops.runs:
            s.costed_time_frac = 0.0
    if k.total_us <= 0:
        return
    s.kernel_share = k.shares()
    s.kernel_count = k.kernels
    s.cuda_graph_launches = k.graph_launches
    if k.launched:
        s.short_kernel_frac = k.short_kernels / k.launched
        s.launch_call_us_p50 = k.launch_call_us_p50
        s.launch_delay_us_p50 = k.launch_delay_us_p50
    s.comm_exposed_frac = ((a.comm_us - a.comm_overlapped_us) / (s.window_s * 1e6 * len(
        a.timelines)) if a.comm_us else 0.0) if s.window_s > 0 else None
    s.graph_kernel_count_frac = k.graph_kernels / k.kernels if k.kernels else None
    _fill_collectives(a, t, k)


def _fill_collectives(a: TraceAnalysis, t: Tables, k: KernelStats) -> None:
    """The collective pattern: collectives a profiler step per device, their median time, and the share of the window
    the host spent issuing them (the union of its collective records per thread, clipped to the window)."""
    s = a.summary
    if not k.comm_kernels or s.window_s <= 0:
        return
    s.collective_us_p50 = k.comm_us_p50
    step_ms = facts.step_ms_p50(t)
    if step_ms is not None and step_ms > 0:
        s.collectives_per_step = k.comm_kernels / max(1, len(a.timelines)) / (s.window_s * 1e3 / step_ms)
    lo, hi = a.window
    by_thread: dict[int, list[tuple[float, float]]] = {}
    for tid, ts, end, _ in t.comm_ops:
        if end > lo and ts < hi:
            by_thread.setdefault(tid, []).append((max(ts, lo), min(end, hi)))
    held = 0.0
    for spans in by_thread.values():
        spans.sort()
        start, stop = spans[0]
        for x0, x1 in spans[1:]:
            if x0 > stop:
                held += stop - start
                start, stop = x0, x1
            else:
                stop = max(stop, x1)
        held += stop - start
    s.collective_host_frac = min(1.0, held / (hi - lo)) if hi > lo else None


def _fill_intensity(a: TraceAnalysis, skipped: list[str]) -> bool:
    """Intensity, dtype and achieved rates from the costed ops; whether they were left out for covering too little
    of the GEMM and attention time (then phases are left out too)."""
    s, ops = a.summary, a.ops
    coverage = _costed_coverage(a)
    if coverage is not None:
        s.costed_gemm_attention_frac = coverage
    partial = coverage is not None and coverage < MIN_COSTED_COVERAGE
    if partial:
        graphs = a.kernels is not None and a.kernels.graph_kernels > 0
        why = ("the rest ran inside CUDA graph replays, whose kernels carry no op shapes" if graphs
               else "the rest was launched outside any op with recorded shapes")
        skipped.append(f"only {coverage:.0%} of the GEMM and attention kernel time was launched by ops with recorded "
                       f"shapes ({why}): intensity and serving phases would describe the minority, so they are "
                       "left out")
    if ops is None or not ops.runs or partial:
        return partial
    s.intensity_flop_per_byte = ops.intensity
    s.dtype = ops.dtype or ""
    if s.window_s > 0:
        s.achieved_flops = ops.total_flops / s.window_s
        s.achieved_bytes_per_s = ops.total_bytes / s.window_s
    s.costed_op_count = len(ops.runs)
    if a.ridge_flop_per_byte:
        s.ridge_flop_per_byte = a.ridge_flop_per_byte
        below = sum(r.time_us for r in ops.runs if r.cost.intensity < a.ridge_flop_per_byte)
        if ops.weighted_time_us > 0:
            s.time_frac_below_ridge = below / ops.weighted_time_us
    return partial


def _fill_phases(a: TraceAnalysis, partial: bool) -> None:
    s, ph = a.summary, a.phases
    if ph is not None and s.workload == "training":
        # Prefill and decode are serving phases: a training step's forward is neither (its "decode-like" runs were
        # read as a compute-bound regime on a recommendation model).
        a.phases = ph = None
    if ph is None or partial:
        return
    s.decode_batch = ph.decode_batch
    s.prefill_frac = ph.prefill_frac
    s.attention_frac = ph.attention_frac
    if ph.context_growth is not None:
        (kv0, f0), (kv1, f1) = ph.context_growth
        s.context_tokens_first, s.context_tokens_last = kv0, kv1
        s.attention_frac_first, s.attention_frac_last = f0, f1


def _temporal(s: TraceSummary, timelines: list[DeviceTimeline]) -> None:
    """HolisticTraceAnalysis' temporal breakdown: compute, non-compute and idle shares of the window, mean over
    devices."""
    spans = [tl for tl in timelines if tl.window_us > 0]
    if not spans:
        return
    n = len(spans)
    s.compute_time_frac = sum(tl.compute_us / tl.window_us for tl in spans) / n
    s.non_compute_time_frac = sum((tl.busy_us - tl.compute_us) / tl.window_us for tl in spans) / n
    s.idle_time_frac = sum((tl.window_us - tl.busy_us) / tl.window_us for tl in spans) / n


def capture_from_trace(analysis: TraceAnalysis, *, model: ModelInfo | None = None,
                       gpu_name: str | None = None) -> Capture:
    """A Capture holding only what the trace says: target 'trace <file>', the GPUs from deviceProperties (or
    `gpu_name`), trace=summary. Counter series are absent and marked unavailable, so rules that need them are
    reported as skipped with that reason."""
    from diagnoser import physics

    if analysis.base_time_ns:
        started = analysis.base_time_ns / 1e9 + analysis.window[0] / 1e6  # ts are µs after baseTimeNanoseconds
    elif analysis.window[0] > 1e15:
        started = analysis.window[0] / 1e6  # older traces: ts are Unix µs
    else:
        started = analysis.path.stat().st_mtime if analysis.path.exists() else 0.0
    cap = new_capture(f"trace {analysis.path}", started_at=started, duration_s=analysis.summary.window_s)
    used = set(analysis.summary.devices)
    devices = [d for d in analysis.devices if d.index in used] or analysis.devices[:1]
    if gpu_name:
        spec = physics.get_gpu(gpu_name)
        cap.gpus.append(GpuInfo(index=devices[0].index if devices else 0, name=spec.name,
                                memory_total_bytes=spec.memory_bytes, spec_name=spec.key))
    else:
        for d in devices:
            match = physics.match_gpu(d.name, d.memory_bytes)
            cap.gpus.append(GpuInfo(index=d.index, name=d.name, memory_total_bytes=d.memory_bytes,
                                    cuda_capability=d.capability, spec_name=match.key if match else None))
    cap.trace = analysis.summary
    cap.model = model
    cap.origin = "trace"
    # A file cut before its GPU events still names its GPUs (deviceProperties come first): not a CPU run.
    cap.cpu_only = not analysis.summary.devices and not (analysis.summary.truncated and analysis.devices)
    reason = "not sampled: the capture was built from a trace file alone"
    cap.mark_unavailable("trace", "gpu.*", reason, "attach to the live server for NVML/GPM counters")
    cap.mark_unavailable("trace", "host.*", reason, "attach to the live server for host CPU use")
    cap.mark_unavailable("trace", "server.*", reason, "attach with --port to read the server's /metrics")
    cap.notes.append(f"From trace {analysis.path.name}: window {analysis.summary.window_s * 1e3:.1f} ms "
                     f"({analysis.window_policy}).")
    for note in analysis.summary.skipped:
        cap.notes.append(f"Trace analysis: {note}.")
    return cap

